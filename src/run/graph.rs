//! The step captured as a CUDA graph (`train.cuda_graph`) and replayed with one launch.
//!
//! At small micro-batches a step on a GPU is bound by the launches of thousands of small
//! kernels, not by their arithmetic. The step pipeline already queues a step without waiting
//! on the device, with fixed shapes and fused updates, so the whole of it can be recorded once:
//! forward, loss, backward, clipping and the fused optimizer update, for every micro-batch of
//! the group. A replay then launches all of it at once.
//!
//! What a replay needs and how it gets it:
//! - **Inputs at fixed addresses.** Each micro-batch's inputs are uploaded as in an eager step
//!   and copied on the device into the buffers the graph read at capture.
//! - **The step's scalars on the device.** The learning rate and step count are written into
//!   tensors the fused kernels read (`Optimizer::stage`) before each replay, outside the graph,
//!   so the schedule goes on; the bias correction reads the step there.
//! - **Its memory.** Everything the step allocates comes from the graph's private pool, which
//!   it keeps between replays; a replay allocates nothing. The pool counts under the cap like
//!   any other allocation.
//! - **Randomness.** Dropout draws from the default CUDA generator, whose offsets PyTorch
//!   advances per replay as an eager step would.
//!
//! Each kind of step (the weights', DARTS's architecture step) has one slot. A shape runs
//! `warmup` eager steps first (all but the first on the capture stream), then is captured and replayed.
//! A group of another micro-batch (after backoff or grow-back), or the first after frozen
//! parameters start training, starts the slot over; a shorter last group, or a language
//! model's group whose counted tokens differ, runs eager and leaves the graph in place. A lever recovery engages, a fall back to the CPU or a failed capture turn
//! capture off for the slot (an OOM: until the shape changes) and say so in a `graph` record.
use tch::Device;

use super::forward::Batch;
use super::step::{StepOutput, StepPipeline, Stepping};
use super::tally::Totals;
use crate::fault::Phase;
use crate::host::Home;
use crate::memory;
use crate::oom::{OomKind, StepError};
use crate::optim::Step;
use crate::plan::GraphPlan;
use crate::records::GraphEvent;
use crate::shim::graph::{Capture, CudaGraph, SideStream};

/// Which step a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepKind {
    Weights,
    Architecture,
}

impl StepKind {
    fn name(self) -> &'static str {
        match self {
            StepKind::Weights => "weights",
            StepKind::Architecture => "architecture",
        }
    }
}

/// What a captured graph was recorded for: a replay is the same step only at the same key.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Key {
    micro_batch: usize,
    chunks: usize,
    /// The loss's divisor, which the graph holds as a constant.
    divisor: f64,
    /// Parameters that train, over the stepped optimizer and the others: unfreezing adds
    /// gradients to compute and parameters to update, which a graph recorded before it lacks.
    trained: usize,
}

impl Key {
    fn of(s: &Stepping) -> Key {
        let work = s.work;
        let micro_batch = work.micro_batch.max(1);
        Key {
            micro_batch,
            chunks: work.group.len().div_ceil(micro_batch),
            divisor: work.divisor,
            trained: s.opt.trained_count() + s.others.iter().map(|o| o.trained_count()).sum::<usize>(),
        }
    }

    /// Every micro-batch of the group is whole: a capturable shape.
    fn whole(&self, group: usize) -> bool {
        group == self.micro_batch * self.chunks
    }
}

/// A recorded step and what it reads and writes in place.
struct Captured {
    graph: CudaGraph,
    /// The inputs the graph reads, one per micro-batch.
    inputs: Vec<Batch>,
    /// The loss sum and correct count the graph writes.
    totals: Totals,
}

#[derive(Default)]
enum SlotState {
    #[default]
    Empty,
    /// Eager steps taken at the slot's key so far.
    Warming(u32),
    Ready(Captured),
    /// Not captured at this key, for the reason recorded then.
    Declined,
}

#[derive(Default)]
struct Slot {
    key: Option<Key>,
    state: SlotState,
}

/// Why a step cannot be captured now, and how far that reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Decline {
    /// The whole run (the device, a lever recovery engaged): every slot gives up its graph.
    Run(String),
    /// Only this kind of step (its optimizer): the other kind's graph stays.
    Kind(String),
}

/// What the slot does with this step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Eager,
    /// A warm-up after the first: eager, on the capture stream.
    EagerOnSide,
    Capture,
    Replay,
}

/// A capture that ran out of memory: the trainer records it as an OOM whose answer was to run
/// the step eager.
pub struct CaptureOom {
    pub kind: OomKind,
    pub message: String,
    pub phase: Option<Phase>,
}

/// The run's captured steps (a single process; data-parallel ranks run eager).
pub struct StepGraphs {
    plan: GraphPlan,
    ooms: Vec<CaptureOom>,
    side: Option<SideStream>,
    slots: [Slot; 2],
    /// The last reason recorded, per kind of step, for running it eager, so each is recorded once.
    said: [Option<String>; 2],
    /// What to record: captures, and why steps run eager.
    events: Vec<GraphEvent>,
}

impl StepGraphs {
    pub fn new(plan: GraphPlan) -> StepGraphs {
        StepGraphs {
            plan,
            ooms: Vec::new(),
            side: None,
            slots: Default::default(),
            said: Default::default(),
            events: Vec::new(),
        }
    }

    /// The records of what happened since last asked.
    pub fn take_events(&mut self) -> Vec<GraphEvent> {
        std::mem::take(&mut self.events)
    }

    /// The captures that ran out of memory since last asked.
    pub fn take_ooms(&mut self) -> Vec<CaptureOom> {
        std::mem::take(&mut self.ooms)
    }

    /// One step: eager, a warm-up, a capture or a replay.
    pub fn step(&mut self, pipeline: &StepPipeline, kind: StepKind, mut s: Stepping) -> Result<StepOutput, StepError> {
        let GraphPlan::Capture { warmup } = self.plan else {
            return pipeline.eager(s);
        };
        let key = Key::of(&s);
        let route = self.decide(
            kind,
            key,
            s.work.group.len(),
            eligible(pipeline, &s),
            s.work.step,
            warmup,
        );
        match route {
            Route::Eager => pipeline.eager(s),
            Route::EagerOnSide => {
                let side = side_stream(&mut self.side, pipeline.forward.device)?;
                let _on_side = side.enter().map_err(|e| StepError::Other(format!("{e:#}")))?;
                pipeline.eager(s)
            }
            Route::Capture => self.capture(pipeline, kind, key, s),
            Route::Replay => {
                let SlotState::Ready(c) = &mut self.slots[kind as usize].state else {
                    unreachable!("routed to replay")
                };
                replay(pipeline, c, &mut s)
            }
        }
    }

    /// What happens to a step at `key` over a group of `group` samples, given whether the run can
    /// capture it at all now (`eligible`).
    fn decide(
        &mut self,
        kind: StepKind,
        key: Key,
        group: usize,
        eligible: Result<(), Decline>,
        step: Option<i64>,
        warmup: u32,
    ) -> Route {
        match eligible {
            Err(Decline::Run(why)) => {
                self.decline_all(kind, key, step, why);
                return Route::Eager;
            }
            Err(Decline::Kind(why)) => {
                self.decline(kind, key, step, why);
                return Route::Eager;
            }
            Ok(()) => {}
        }
        if !key.whole(group) {
            // A last group with a part-filled micro-batch: eager, and every slot stays as it is,
            // as for a shorter group of whole ones (declining here would keep the key of this
            // group and turn every whole group after it aside, so nothing would be captured again).
            return Route::Eager;
        }
        self.route(kind, key, warmup)
    }

    /// Where the slot of `kind` sends a step at `key`, counting warm-ups.
    fn route(&mut self, kind: StepKind, key: Key, warmup: u32) -> Route {
        let slot = &mut self.slots[kind as usize];
        let aside = |k: Key| {
            k.micro_batch == key.micro_batch
                && k.trained == key.trained
                && (key.chunks < k.chunks || (key.chunks == k.chunks && key.divisor != k.divisor))
        };
        if slot.key.is_some_and(aside) {
            // A short last group or another token count at the same micro-batch: eager, and
            // the graph stays for the groups that follow.
            return Route::Eager;
        }
        if slot.key != Some(key) {
            // A new micro-batch: the old graph and its pool go now.
            *slot = Slot {
                key: Some(key),
                state: SlotState::Warming(0),
            };
        }
        match &mut slot.state {
            SlotState::Empty | SlotState::Declined => Route::Eager,
            SlotState::Ready(_) => Route::Replay,
            SlotState::Warming(n) if *n >= warmup => Route::Capture,
            SlotState::Warming(n) => {
                *n += 1;
                // The first warm-up makes the optimizer's state on the default stream; the rest
                // run on the capture stream, so that whatever libraries make lazily per stream
                // (cuBLAS workspaces, cuDNN plans) exists before a capture, which may not make it.
                match *n >= warmup.min(2) {
                    true => Route::EagerOnSide,
                    false => Route::Eager,
                }
            }
        }
    }

    /// Records the step at `key`, then replays it as this step. A capture that fails leaves no
    /// graph; its step runs eager.
    fn capture(
        &mut self,
        pipeline: &StepPipeline,
        kind: StepKind,
        key: Key,
        mut s: Stepping,
    ) -> Result<StepOutput, StepError> {
        let place = pipeline.place();
        // The last eager step's gradients go first (every attempt starts by releasing them; the
        // capture's backward makes them anew in the pool), then what the eager steps left cached,
        // which serves no allocation of the graph's private pool: a capture under a tight cap has
        // the room the eager step had, not that less one set of gradients.
        pipeline.guarded(|| {
            s.opt.drop_grads();
            s.others.iter_mut().for_each(|o| o.drop_grads());
        })?;
        if let Err(e) = crate::shim::empty_cache() {
            tracing::warn!("releasing the cache before a capture: {e:#}");
        }
        let reserved_before = memory::sample(place).reserved_bytes.unwrap_or(0);
        let side = side_stream(&mut self.side, pipeline.forward.device)?;
        let captured = record(pipeline, side, &mut s);
        let slot = &mut self.slots[kind as usize];
        match captured {
            Ok((c, step)) => {
                let reserved = memory::sample(place).reserved_bytes.unwrap_or(0);
                let pool = reserved.saturating_sub(reserved_before);
                self.events.push(event(kind, key, s.work.step, None, Some(pool)));
                // The capture read this step's inputs and scalars where they are now: no second
                // upload before its first launch.
                let out = launch(pipeline, &c, &mut s, step);
                slot.state = SlotState::Ready(c);
                out
            }
            Err(e) => {
                let why = match e {
                    StepError::Oom { kind, message, phase } => {
                        let why = format!(
                            "the capture ran out of memory ({})",
                            message.lines().next().unwrap_or_default()
                        );
                        self.ooms.push(CaptureOom { kind, message, phase });
                        why
                    }
                    other => format!("the capture failed: {}", failure_text(&other)),
                };
                slot.state = SlotState::Declined;
                self.events.push(event(kind, key, s.work.step, Some(why), None));
                pipeline.eager(s)
            }
        }
    }

    /// Every slot gives up its graph (and its pool); each reason is recorded once, for the
    /// step that met it.
    fn decline_all(&mut self, kind: StepKind, key: Key, step: Option<i64>, why: String) {
        for slot in &mut self.slots {
            *slot = Slot {
                key: Some(key),
                state: SlotState::Declined,
            };
        }
        self.say(kind, key, step, why);
    }

    /// The slot of `kind` alone gives up its graph: the other kind's steps can still be captured.
    fn decline(&mut self, kind: StepKind, key: Key, step: Option<i64>, why: String) {
        self.slots[kind as usize] = Slot {
            key: Some(key),
            state: SlotState::Declined,
        };
        self.say(kind, key, step, why);
    }

    fn say(&mut self, kind: StepKind, key: Key, step: Option<i64>, why: String) {
        let said = &mut self.said[kind as usize];
        if said.as_deref() != Some(why.as_str()) {
            self.events.push(event(kind, key, step, Some(why.clone()), None));
            *said = Some(why);
        }
    }
}

fn event(kind: StepKind, key: Key, step: Option<i64>, reason: Option<String>, pool_bytes: Option<u64>) -> GraphEvent {
    GraphEvent {
        step: step.unwrap_or(0),
        of: kind.name().into(),
        micro_batch: key.micro_batch as i64,
        micro_batches: key.chunks as i64,
        action: if reason.is_some() { "eager" } else { "captured" }.into(),
        reason,
        pool_bytes,
    }
}

/// The first line of what a failed capture's error says, for the `graph` record's reason (the
/// libtorch message, not the variant that carried it).
fn failure_text(e: &StepError) -> &str {
    let text = match e {
        StepError::Other(m) | StepError::PeerLost(m) | StepError::OomInCollective(m) => m,
        StepError::Oom { message, .. } => message,
    };
    text.lines().next().unwrap_or_default()
}

fn side_stream(side: &mut Option<SideStream>, device: Device) -> Result<&mut SideStream, StepError> {
    let Device::Cuda(i) = device else {
        return Err(StepError::Other("a capture stream needs a CUDA device".into()));
    };
    if side.is_none() {
        *side = Some(SideStream::new(i).map_err(|e| StepError::Other(format!("{e:#}")))?);
    }
    Ok(side.as_mut().expect("made above"))
}

/// Why no step can be captured now, when none can; recovery may have engaged a lever, or moved
/// the run to the CPU, since the plan was made.
fn eligible(pipeline: &StepPipeline, s: &Stepping) -> Result<(), Decline> {
    let f = &pipeline.forward;
    let run = |why: &str| Err(Decline::Run(why.into()));
    if !f.device.is_cuda() {
        return run("the run fell back to the CPU");
    }
    if s.work.stream.is_some() || f.recompute || f.activations == Home::Host {
        return run("a memory lever engaged by recovery moves memory or recomputes during the step");
    }
    if s.opt.state_home() == Home::Host || s.opt.grads_home() == Home::Host {
        return run("a memory lever engaged by recovery moved the optimizer's state or gradients to the host");
    }
    if s.work.loss_scale.is_some() {
        return run("fp16-mixed decides on the host whether to skip a step");
    }
    if !s.opt.reads_scalars_on_device() {
        // This step's optimizer alone: DARTS's other optimizer may still read its on the device.
        return Err(Decline::Kind(
            "the optimizer's update takes its learning rate from the host".into(),
        ));
    }
    Ok(())
}

/// The capture itself, on the side stream, inside the OOM guard: the step's inputs placed
/// where the graph reads them, its scalars staged, then forward to update recorded.
fn record(pipeline: &StepPipeline, side: &mut SideStream, s: &mut Stepping) -> Result<(Captured, Step), StepError> {
    pipeline.guarded(|| {
        let inputs = pipeline.uploads(s.work);
        let step = s.opt.stage(s.work.lr).unwrap_or_else(|e| panic!("{e:#}"));
        let on_side = side.enter().unwrap_or_else(|e| panic!("{e:#}"));
        let capture = Capture::begin().unwrap_or_else(|e| panic!("{e:#}"));
        crate::fault::oom_in_capture(pipeline.forward.device);
        crate::fault::host_read_in_capture(pipeline.forward.device);
        let totals = pipeline.recorded(s, &inputs, step);
        let graph = capture.end().unwrap_or_else(|e| panic!("{e:#}"));
        drop(on_side);
        (Captured { graph, inputs, totals }, step)
    })
}

/// This step through the captured graph: its inputs copied in and its scalars staged, then
/// launched.
fn replay(pipeline: &StepPipeline, c: &mut Captured, s: &mut Stepping) -> Result<StepOutput, StepError> {
    let step = pipeline.guarded(|| {
        let fresh = pipeline.uploads(s.work);
        tch::no_grad(|| {
            for (to, from) in c.inputs.iter_mut().zip(&fresh) {
                to.x.copy_(&from.x);
                to.y.copy_(&from.y);
            }
        });
        s.opt.stage(s.work.lr).unwrap_or_else(|e| panic!("{e:#}"))
    })?;
    launch(pipeline, c, s, step)
}

/// One launch of the graph for `step`, whose inputs and scalars are in place; the totals into
/// the tally and the step counted.
fn launch(pipeline: &StepPipeline, c: &Captured, s: &mut Stepping, step: Step) -> Result<StepOutput, StepError> {
    pipeline.guarded(|| c.graph.replay().unwrap_or_else(|e| panic!("{e:#}")))?;
    if let Some(t) = s.tally.as_deref_mut() {
        t.add(c.totals.alias());
    }
    s.opt.count(step);
    Ok(StepOutput {
        found_inf: false,
        stop: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(micro_batch: usize, chunks: usize, divisor: f64) -> Key {
        Key {
            micro_batch,
            chunks,
            divisor,
            trained: 10,
        }
    }

    fn routes(g: &mut StepGraphs, kind: StepKind, k: Key, n: usize) -> Vec<&'static str> {
        (0..n)
            .map(|_| match g.route(kind, k, WARMUP) {
                Route::Eager => "eager",
                Route::EagerOnSide => "side",
                Route::Capture => "capture",
                Route::Replay => "replay",
            })
            .collect()
    }

    const WARMUP: u32 = 2;

    fn graphs() -> StepGraphs {
        StepGraphs::new(GraphPlan::Capture { warmup: WARMUP })
    }

    #[test]
    fn a_shape_warms_up_eager_then_on_the_side_stream_then_is_captured() {
        let mut g = graphs();
        let k = key(8, 4, 32.0);
        assert_eq!(routes(&mut g, StepKind::Weights, k, 3), ["eager", "side", "capture"]);
        // Until a capture succeeds the slot keeps asking for one.
        assert_eq!(routes(&mut g, StepKind::Weights, k, 1), ["capture"]);
        // The architecture step has a slot of its own.
        assert_eq!(routes(&mut g, StepKind::Architecture, key(8, 1, 8.0), 1), ["eager"]);
    }

    #[test]
    fn the_warm_ups_after_the_first_run_on_the_side_stream() {
        let k = key(8, 4, 32.0);
        for (warmup, want) in [
            (
                3,
                vec![Route::Eager, Route::EagerOnSide, Route::EagerOnSide, Route::Capture],
            ),
            (1, vec![Route::EagerOnSide, Route::Capture]),
        ] {
            let mut g = StepGraphs::new(GraphPlan::Capture { warmup });
            let seen: Vec<Route> = want.iter().map(|_| g.route(StepKind::Weights, k, warmup)).collect();
            assert_eq!(seen, want, "warmup {warmup}");
        }
    }

    #[test]
    fn a_short_group_or_another_token_count_runs_eager_and_keeps_the_slot() {
        let mut g = graphs();
        let k = key(8, 4, 32.0);
        routes(&mut g, StepKind::Weights, k, 2);
        assert_eq!(
            routes(&mut g, StepKind::Weights, key(8, 2, 16.0), 2),
            ["eager", "eager"]
        );
        assert_eq!(routes(&mut g, StepKind::Weights, key(8, 4, 31.0), 1), ["eager"]);
        // Back at the captured shape, the warm-up count was kept.
        assert_eq!(routes(&mut g, StepKind::Weights, k, 1), ["capture"]);
    }

    #[test]
    fn a_short_group_first_does_not_keep_the_whole_ones_from_being_captured() {
        let mut g = graphs();
        routes(&mut g, StepKind::Weights, key(8, 2, 16.0), 1);
        assert_eq!(
            routes(&mut g, StepKind::Weights, key(8, 4, 32.0), 3),
            ["eager", "side", "capture"]
        );
    }

    #[test]
    fn a_new_micro_batch_starts_the_slot_over() {
        let mut g = graphs();
        routes(&mut g, StepKind::Weights, key(8, 4, 32.0), 3);
        let halved = key(4, 8, 32.0);
        assert_eq!(
            routes(&mut g, StepKind::Weights, halved, 3),
            ["eager", "side", "capture"]
        );
    }

    #[test]
    fn unfrozen_parameters_start_the_slot_over() {
        let mut g = graphs();
        let k = key(8, 4, 32.0);
        routes(&mut g, StepKind::Weights, k, 2);
        let unfrozen = Key { trained: 12, ..k };
        // A short group after unfreezing runs eager as any short group does.
        assert_eq!(
            routes(&mut g, StepKind::Weights, Key { chunks: 2, ..unfrozen }, 1),
            ["eager"]
        );
        // The first whole one warms up again instead of taking the graph recorded before.
        assert_eq!(
            routes(&mut g, StepKind::Weights, unfrozen, 3),
            ["eager", "side", "capture"]
        );
    }

    #[test]
    fn declining_ends_every_slot_and_records_each_reason_once() {
        let mut g = graphs();
        let k = key(8, 4, 32.0);
        routes(&mut g, StepKind::Weights, k, 2);
        g.decline_all(StepKind::Weights, k, Some(3), "a lever".into());
        g.decline_all(StepKind::Weights, k, Some(4), "a lever".into());
        assert_eq!(routes(&mut g, StepKind::Weights, k, 2), ["eager", "eager"]);
        assert_eq!(routes(&mut g, StepKind::Architecture, k, 1), ["eager"]);
        let events = g.take_events();
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].action, "eager");
        assert_eq!(events[0].reason.as_deref(), Some("a lever"));
        g.decline_all(StepKind::Weights, k, Some(5), "the CPU".into());
        assert_eq!(g.take_events().len(), 1);
        // A new micro-batch after declining warms up again (eligibility is checked first).
        assert_eq!(routes(&mut g, StepKind::Weights, key(4, 8, 32.0), 1), ["eager"]);
    }

    #[test]
    fn a_last_group_with_a_part_filled_micro_batch_runs_eager_and_keeps_every_slot() {
        let mut g = graphs();
        let k = key(8, 4, 32.0);
        let decide = |g: &mut StepGraphs, k: Key, group: usize| match g.decide(
            StepKind::Weights,
            k,
            group,
            Ok(()),
            Some(1),
            WARMUP,
        ) {
            Route::Eager => "eager",
            Route::EagerOnSide => "side",
            Route::Capture => "capture",
            Route::Replay => "replay",
        };
        assert_eq!(decide(&mut g, k, 32), "eager");
        assert_eq!(decide(&mut g, k, 32), "side");
        // 30 samples at micro-batch 8: four micro-batches, the last of 6.
        assert_eq!(decide(&mut g, key(8, 4, 30.0), 30), "eager");
        assert!(g.take_events().is_empty(), "nothing declined");
        // The next epoch's whole groups are captured as before.
        assert_eq!(decide(&mut g, k, 32), "capture");
        // Ineligible (a lever engaged) still ends every slot, once said.
        let lever = g.decide(
            StepKind::Weights,
            k,
            32,
            Err(Decline::Run("a lever".into())),
            Some(2),
            WARMUP,
        );
        assert!(matches!(lever, Route::Eager));
        assert_eq!(g.take_events().len(), 1);
    }

    #[test]
    fn an_optimizer_reading_its_rate_on_the_host_declines_its_own_kind_only() {
        let mut g = graphs();
        let k = key(8, 4, 32.0);
        let host_rate = || {
            Err(Decline::Kind(
                "the optimizer's update takes its learning rate from the host".into(),
            ))
        };
        let both = |g: &mut StepGraphs| {
            let w = g.decide(StepKind::Weights, k, 32, Ok(()), Some(1), WARMUP);
            let a = g.decide(StepKind::Architecture, k, 32, host_rate(), Some(1), WARMUP);
            (w, a)
        };
        let mut weights = vec![];
        for _ in 0..5 {
            let (w, a) = both(&mut g);
            assert_eq!(a, Route::Eager);
            weights.push(w);
        }
        assert_eq!(
            weights,
            [
                Route::Eager,
                Route::EagerOnSide,
                Route::Capture,
                Route::Capture,
                Route::Capture
            ]
        );
        let events = g.take_events();
        assert_eq!(events.len(), 1, "the architecture's reason once: {events:?}");
        assert_eq!(events[0].of, StepKind::Architecture.name());
    }

    #[test]
    fn a_failed_capture_is_said_in_its_errors_own_words() {
        let e = StepError::Other(
            "CUDA error: operation not permitted when stream is capturing\nSearch for `cudaErrorStreamCaptureUnsupported'".into(),
        );
        assert_eq!(
            failure_text(&e),
            "CUDA error: operation not permitted when stream is capturing"
        );
    }

    #[test]
    fn whole_groups_only() {
        assert!(key(8, 4, 32.0).whole(32));
        assert!(!key(8, 4, 30.0).whole(30));
    }
}
