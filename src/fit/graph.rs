//! CUDA graphs as one more dimension of fit's settings (`train.cuda_graph`).
//!
//! A captured step saves launches, not memory, so it does not change which micro-batch fits in
//! eager; what it can change is the speed at the micro-batch a setting settled on, and the peak
//! there (the graph's pool keeps the step's working memory between replays). So fit measures it
//! only where it can matter and only once per setting: on CUDA, for a setting whose spec could
//! capture, at that setting's candidate micro-batch, beside its eager probe there. A captured
//! probe that runs out of memory there, or that never captured, leaves the setting's eager
//! candidate as it was: stepping the micro-batch down for the graph would cost more probes for a
//! smaller batch that the eager candidate at the larger one was measured against already.
use super::setting::{Graph, Probe, Setting};
use crate::human::human_bytes;
use crate::plan::graph::WARMUP_STEPS;
use crate::records::{Event, RunRecords};
use crate::spec::{self, CudaGraph, Memory, Spec, Train};

impl Setting {
    /// The spec's `[train]` and `[memory]` as this setting's probe runs them.
    pub fn applied(self, train: &Train, memory: &Memory) -> (Train, Memory) {
        let mut t = train.clone();
        t.precision = self.precision;
        t.activation_checkpointing = self.activation_checkpointing;
        t.cuda_graph = match self.cuda_graph {
            Graph::On => CudaGraph::On,
            Graph::Off => CudaGraph::Off,
        };
        let mut m = memory.clone();
        let [state, grads, acts, params] = self.placement.keys().map(|(_, home)| home);
        m.optimizer_state = state;
        m.gradients = grads;
        m.activations = acts;
        m.parameters = params;
        (t, m)
    }
}

/// The captured twin of `setting`, where fit tries one: on CUDA, and where the spec as this
/// setting runs it could capture. Which settings can is `spec::graph_declines_of`'s to say (a
/// host lever, recomputation, fp16-mixed, 8-bit state, an optimizer implementation that reads
/// the learning rate on the host), the rule `run` itself applies.
pub(super) fn variant(setting: Setting, spec: &Spec, cuda: bool) -> Option<Setting> {
    if !cuda || setting.cuda_graph == Graph::On {
        return None;
    }
    let on = Setting {
        cuda_graph: Graph::On,
        ..setting
    };
    let (train, memory) = on.applied(&spec.train, &spec.memory);
    spec::graph_declines_of(&train, &memory).is_none().then_some(on)
}

/// Optimizer steps a probe runs: a captured probe runs its `WARMUP_STEPS` eager steps and the
/// captured one on top, so it times as many replays as an eager probe times steps after its
/// first.
pub(super) fn probe_steps(steps: i64, graph: Graph) -> i64 {
    match graph {
        Graph::Off => steps,
        Graph::On => steps + WARMUP_STEPS as i64 + 1,
    }
}

/// What a captured probe's records say about its capture: `Ok(step)` with the global step of
/// the last capture (the steps after it are replays), or `Err(why)` when no step was captured
/// (a capture that ran out of memory runs eager and says so in a `graph` record).
pub(super) fn captured_at(records: &RunRecords) -> Result<i64, String> {
    let graphs = records.events.iter().filter_map(|e| match e {
        Event::Graph(g) => Some(g),
        _ => None,
    });
    let mut last = None;
    let mut why = None;
    for g in graphs {
        match g.action.as_str() {
            "captured" => last = Some(g.step),
            _ => why = why.or(g.reason.clone()),
        }
    }
    last.ok_or_else(|| match why {
        Some(w) => format!("not captured: {w}"),
        None => "not captured".to_owned(),
    })
}

/// A setting's eager candidate and its captured twin in the order `fastest` weighs them: the
/// spec's own choice first (the twin when the spec asks for graphs), so the other must beat it
/// by `FASTER_BY`.
pub(super) fn in_order<T>(eager: T, twin: T, graph_first: bool) -> [T; 2] {
    match graph_first {
        true => [twin, eager],
        false => [eager, twin],
    }
}

/// The `train.cuda_graph` a recommendation writes, where it must say one: "on" for a captured
/// winner. For an eager winner "off" where the user's spec asked for graphs and fit measured
/// the choice (on CUDA), or where the user's "on" would refuse the winner's setting; otherwise
/// the user's own value stands (on the CPU fit measured no graph, so it decides none).
pub(super) fn written_value(setting: Setting, spec: &Spec, cuda: bool) -> Option<&'static str> {
    let asked = spec.train.cuda_graph;
    match setting.cuda_graph {
        Graph::On => Some("on"),
        Graph::Off if asked == CudaGraph::Off => None,
        Graph::Off if cuda => Some("off"),
        Graph::Off => {
            let (train, memory) = setting.applied(&spec.train, &spec.memory);
            let refused = asked == CudaGraph::On && spec::graph_declines_of(&train, &memory).is_some();
            refused.then_some("off")
        }
    }
}

/// The captured probes for the human table: one line each, after the eager settings' largest
/// micro-batches; nothing where fit tried no graph (the CPU, or no setting could capture).
pub(super) fn human_lines(probes: &[Probe]) -> String {
    let mut out = String::new();
    for p in probes.iter().filter(|p| p.setting.cuda_graph == Graph::On) {
        let m = &p.measured;
        let what = match (m.fits, &p.oom) {
            (true, _) => format!(
                "peak {}, {} samples/s",
                m.peak_bytes.map_or_else(|| "-".into(), human_bytes),
                m.samples_per_s.map_or_else(|| "-".into(), |s| format!("{s:.1}"))
            ),
            (false, Some(why)) => format!("does not fit ({why})"),
            (false, None) => "does not fit".into(),
        };
        out += &format!("  {}  at micro-batch {}: {what}\n", p.setting, m.micro_batch);
    }
    if out.is_empty() {
        return out;
    }
    format!("the step captured as a CUDA graph, at each setting's micro-batch:\n{out}")
}

/// ", CUDA graph on|off" for the recommendation's line where fit measured graphs; nothing
/// where it did not.
pub(super) fn recommendation_words(probes: &[Probe], setting: Setting) -> String {
    let tried = probes.iter().any(|p| p.setting.cuda_graph == Graph::On);
    match (tried, setting.cuda_graph) {
        (_, Graph::On) => ", CUDA graph on".into(),
        (true, Graph::Off) => ", CUDA graph off".into(),
        (false, Graph::Off) => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fit::Placement;
    use crate::records::GraphEvent;
    use crate::spec::Precision;

    fn spec(graph: &str) -> Spec {
        toml::from_str(&format!(
            "[model]\npreset = \"mlp\"\n[train]\ncuda_graph = \"{graph}\"\n"
        ))
        .expect("a minimal spec parses")
    }

    fn setting(precision: Precision, checkpointing: bool, placement: Placement) -> Setting {
        Setting {
            precision,
            activation_checkpointing: checkpointing,
            placement,
            cuda_graph: Graph::Off,
        }
    }

    #[test]
    fn only_a_cuda_setting_that_could_capture_gets_a_captured_twin() {
        let s = spec("off");
        let plain = setting(Precision::Fp32, false, Placement::Device);
        assert_eq!(variant(plain, &s, false), None, "the CPU: no graph probes");
        let twin = variant(plain, &s, true).expect("fp32 on the device captures");
        assert_eq!(twin.cuda_graph, Graph::On);
        assert_eq!(
            Setting {
                cuda_graph: Graph::Off,
                ..twin
            },
            plain
        );
        assert!(variant(setting(Precision::Bf16Mixed, false, Placement::Device), &s, true).is_some());
        for declines in [
            setting(Precision::Fp32, true, Placement::Device),
            setting(Precision::Fp16Mixed, false, Placement::Device),
            setting(Precision::Fp32, false, Placement::State),
            setting(Precision::Fp32, false, Placement::StateGrads),
        ] {
            assert_eq!(variant(declines, &s, true), None, "{declines}");
        }
        assert_eq!(variant(twin, &s, true), None, "a twin has no twin");
        // The user's other keys count too: an optimizer implementation that reads the learning
        // rate on the host cannot capture, whatever fit varies.
        let mut foreach = spec("auto");
        foreach.train.optimizer_impl = crate::spec::OptimizerImpl::Foreach;
        assert_eq!(variant(plain, &foreach, true), None);
    }

    #[test]
    fn a_captured_probe_runs_its_warm_ups_and_capture_on_top_of_the_timed_steps() {
        assert_eq!(probe_steps(4, Graph::Off), 4);
        assert_eq!(probe_steps(4, Graph::On), 4 + WARMUP_STEPS as i64 + 1);
    }

    fn graph_event(step: i64, action: &str, reason: Option<&str>) -> Event {
        Event::Graph(GraphEvent {
            step,
            of: "weights".into(),
            micro_batch: 8,
            micro_batches: 1,
            action: action.into(),
            reason: reason.map(str::to_owned),
            pool_bytes: Some(1 << 20),
        })
    }

    #[test]
    fn the_capture_step_comes_from_the_graph_records() {
        let mut r = RunRecords::default();
        assert_eq!(captured_at(&r), Err("not captured".into()));
        r.events
            .push(graph_event(3, "eager", Some("the capture ran out of memory")));
        assert_eq!(
            captured_at(&r),
            Err("not captured: the capture ran out of memory".into())
        );
        r.events.push(graph_event(5, "captured", None));
        assert_eq!(captured_at(&r), Ok(5));
    }

    #[test]
    fn the_recommendation_writes_what_was_measured() {
        let plain = setting(Precision::Fp32, false, Placement::Device);
        let on = Setting {
            cuda_graph: Graph::On,
            ..plain
        };
        let ck = setting(Precision::Fp32, true, Placement::Device);
        for asked in ["off", "auto", "on"] {
            assert_eq!(written_value(on, &spec(asked), true), Some("on"), "{asked}");
        }
        assert_eq!(
            written_value(plain, &spec("off"), true),
            None,
            "the default stays unwritten"
        );
        assert_eq!(
            written_value(plain, &spec("auto"), true),
            Some("off"),
            "eager won on CUDA"
        );
        assert_eq!(written_value(plain, &spec("on"), true), Some("off"));
        assert_eq!(
            written_value(plain, &spec("auto"), false),
            None,
            "the CPU measured no graph"
        );
        assert_eq!(written_value(plain, &spec("on"), false), None);
        assert_eq!(
            written_value(ck, &spec("on"), false),
            Some("off"),
            "\"on\" would refuse recomputation"
        );
        assert_eq!(written_value(ck, &spec("auto"), false), None);
    }

    #[test]
    fn the_specs_own_graph_choice_is_the_one_to_beat() {
        use crate::fit::{fastest, Measured};
        let m = |rate: f64| Measured {
            micro_batch: 32,
            fits: true,
            peak_bytes: Some(1),
            samples_per_s: Some(rate),
        };
        // Captured 5% faster: within the noise, so the spec's own choice stays.
        let (eager, twin) = ((0, m(100.0)), (1, m(105.0)));
        let off = in_order(eager.clone(), twin.clone(), false);
        assert_eq!(fastest(&off).unwrap().0, 0, "\"off\": eager stays");
        let auto = in_order(eager.clone(), twin.clone(), true);
        assert_eq!(fastest(&auto).unwrap().0, 1, "\"auto\": captured stays");
        let much = in_order(eager, (1, m(150.0)), false);
        assert_eq!(fastest(&much).unwrap().0, 1, "50% faster wins from behind");
    }

    #[test]
    fn the_human_output_names_graphs_only_where_fit_tried_them() {
        let plain = setting(Precision::Fp32, false, Placement::Device);
        let on = Setting {
            cuda_graph: Graph::On,
            ..plain
        };
        let probe = |setting: Setting, fits: bool, oom: Option<&str>| Probe {
            setting,
            measured: crate::fit::Measured {
                micro_batch: 32,
                fits,
                peak_bytes: fits.then_some(3 << 20),
                samples_per_s: fits.then_some(250.0),
            },
            seconds: 1.0,
            oom: oom.map(str::to_owned),
        };
        let eager_only = [probe(plain, true, None)];
        assert_eq!(human_lines(&eager_only), "");
        assert_eq!(recommendation_words(&eager_only, plain), "");
        let both = [probe(plain, true, None), probe(on, true, None)];
        let lines = human_lines(&both);
        assert!(lines.starts_with("the step captured as a CUDA graph"), "{lines}");
        assert!(
            lines.contains("cuda graph on  at micro-batch 32: peak 3.00 MiB, 250.0 samples/s"),
            "{lines}"
        );
        assert_eq!(recommendation_words(&both, on), ", CUDA graph on");
        assert_eq!(recommendation_words(&both, plain), ", CUDA graph off");
        let failed = [probe(plain, true, None), probe(on, false, Some("not captured: why"))];
        assert!(human_lines(&failed).contains("does not fit (not captured: why)"));
    }
}
