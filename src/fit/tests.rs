use super::*;

#[test]
fn margins_are_percentages_or_sizes_below_the_budget() {
    assert_eq!(parse_margin("10%", 1000).unwrap(), 100);
    assert_eq!(parse_margin("0%", 1000).unwrap(), 0);
    assert_eq!(parse_margin("512", 1000).unwrap(), 512);
    assert!(parse_margin("100%", 1000).is_err());
    assert!(parse_margin("2KiB", 1000)
        .unwrap_err()
        .0
        .contains("not below the budget"));
    assert!(parse_margin("lots", 1000).unwrap_err().0.contains("percentage"));
}

fn args(steps: i64) -> FitArgs {
    FitArgs {
        spec: crate::cli::SpecArgs {
            file: "job.toml".into(),
            set: vec![],
        },
        limit: None,
        fraction: None,
        margin: "10%".into(),
        steps,
        precisions: vec![],
        checkpointing: Checkpointing::Both,
        write: None,
        json: false,
    }
}

#[test]
fn a_probe_writes_its_settings_graph_choice() {
    let args = args(4);
    let budget = Budget {
        bytes: 1 << 30,
        source: "--limit".into(),
        margin_bytes: 0,
        usable_bytes: 1 << 30,
        written_as: None,
    };
    let prober = Prober {
        args: &args,
        exe: "memtrain".into(),
        scratch: Scratch(std::env::temp_dir().join("memtrain-fit-unit-never-made")),
        budget: &budget,
        cuda: true,
        effective: 32,
        count: 0,
        probes: vec![],
        quiet: true,
    };
    let plain = Setting {
        precision: Precision::Fp32,
        activation_checkpointing: false,
        placement: Placement::Device,
        cuda_graph: Graph::Off,
    };
    for (graph, want) in [(Graph::Off, "\"off\""), (Graph::On, "\"on\"")] {
        let edits = prober.edits(
            Setting {
                cuda_graph: graph,
                ..plain
            },
            8,
        );
        let (_, value) = edits
            .iter()
            .find(|(k, _)| *k == "train.cuda_graph")
            .expect("every probe says train.cuda_graph");
        assert_eq!(
            value.as_ref().map(|v| v.to_string().trim().to_owned()),
            Some(want.to_owned())
        );
    }
}

#[test]
fn a_captured_probe_is_timed_over_its_replays() {
    use crate::records::{samples, Event, RunRecords};
    let mut r = RunRecords::default();
    // Steps 1-2 warm up, 3 is captured (slow), 4-6 replay (fast).
    for (i, seconds) in [1.0, 0.5, 2.0, 0.1, 0.1, 0.1].into_iter().enumerate() {
        let mut s = samples::step(i as i64 + 1, 1.0, 10, 20);
        s.seconds = seconds;
        r.events.push(Event::Step(s));
    }
    let eager = probe::measure(&r, 8, false, 0);
    let rate = eager.samples_per_s.unwrap();
    assert!((rate - 40.0 / 2.8).abs() < 1e-9, "after the first step: {rate}");
    let replays = probe::measure(&r, 8, false, 3);
    let rate = replays.samples_per_s.unwrap();
    assert!((rate - 80.0).abs() < 1e-9, "{rate}");
    assert_eq!(replays.peak_bytes, Some(20), "the peak still covers every step");
}
