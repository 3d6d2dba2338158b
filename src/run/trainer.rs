//! The training loop: optimizer steps over groups of samples (the effective batch), split into
//! micro-batches, through the step pipeline, with OOM recovery at the step boundary and every
//! outcome emitted as an event.
//!
//! Invariant that makes OOM recovery exact: a group is a fixed list of sample indices and the
//! step pipeline's gradient is the group mean however the group is split. A failed group
//! leaves no trace (its tensors are dropped while unwinding, the optimizer step is
//! transactional, gradients are zeroed) and is retried whole.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use tch::{Device, Tensor};

use super::clock::Stamp;
use super::components::{Components, LoopSettings, Outputs};
use super::execution::Execution;
use super::forward::stage;
use super::levers;
use super::parts::{ArchAt, ArchStep, Model, Parts};
use super::recovery::{Cause, Recovery};
use super::step::{StepOutput, StepPipeline, Work};
use super::tally::{Staged, Tally, Totals};
use crate::checkpoint::{self, NamedTensors, TrainState};
use crate::data::{self, Splits};
use crate::dist::{Local, Outcome};
use crate::exit::{Interrupted, OomExit};
use crate::fault::{self, Phase};
use crate::human::{device_name, human_bytes, human_duration};
use crate::memory::{self, ClearReason, MemorySample, Place, StepMemory};
use crate::oom::{self, BatchShape, Decision, OomKind, StepError};
use crate::optim::Optimizer;
use crate::progress::Progress;
use crate::readback;
use crate::records::*;
use crate::shim;
use crate::signals::StopFlag;
use crate::spec::Monitor;

/// What a step attempt changes outside parameters and optimizer state: the model's buffers and
/// the generators' states, as they were before the step.
struct Rollback {
    buffers: Packed,
    rng: Vec<(Device, Vec<u8>)>,
}

impl Rollback {
    fn restore(&self) {
        self.buffers.restore();
        for (d, s) in &self.rng {
            if let Err(e) = shim::set_rng_state(*d, s) {
                tracing::warn!("restoring the generator state after a failed step: {e}");
            }
        }
    }
}

/// Copies of many small tensors (BatchNorm's running statistics), packed into one flat tensor
/// per device and kind: taken before every step, so a few kernels rather than one per buffer,
/// which on a GPU would leave it idle while they launch. A device's copy waits in pinned host
/// memory, so the step's peak holds no device bytes for a retry that rarely comes.
struct Packed(Vec<(Vec<Tensor>, Tensor)>);

impl Packed {
    fn of(live: Vec<Tensor>) -> Packed {
        let mut groups: Vec<((Device, tch::Kind), Vec<Tensor>)> = Vec::new();
        for t in live {
            let key = (t.device(), t.kind());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, g)) => g.push(t),
                None => groups.push((key, vec![t])),
            }
        }
        Packed(
            groups
                .into_iter()
                .map(|(_, g)| {
                    let flat: Vec<Tensor> = g.iter().map(|t| t.reshape([-1])).collect();
                    let packed = tch::no_grad(|| Tensor::cat(&flat, 0));
                    (g, off_the_device(packed))
                })
                .collect(),
        )
    }

    /// On CUDA the copy back is queued on the compute stream behind the copy out, so it reads
    /// the values as they were when the step began.
    fn restore(&self) {
        tch::no_grad(|| {
            for (live, packed) in &self.0 {
                let sizes: Vec<i64> = live.iter().map(|t| t.numel() as i64).collect();
                for (t, saved) in live.iter().zip(packed.split_with_sizes(&sizes, 0)) {
                    t.shallow_clone().copy_(&saved.view(t.size().as_slice()));
                }
            }
        });
    }
}

/// A CUDA tensor moved to pinned host memory behind the compute stream's work: its device block
/// goes back to the allocator at once. Kept on the device when the host copy cannot be made.
fn off_the_device(t: Tensor) -> Tensor {
    match t.device() {
        Device::Cuda(_) => crate::host::pinned_behind_compute(&t).unwrap_or(t),
        _ => t,
    }
}

/// The per-step readings folded into the windows that records report: since the last step
/// line, and since the epoch began.
#[derive(Debug, Default)]
struct StepWindows {
    line: StepMemory,
    epoch: StepMemory,
    /// How many readings were taken and what they cost, for the summary.
    readings: u64,
    reading_seconds: f64,
}

/// Where a validation pass stands: the next sample, the sums of the micro-batches run so far,
/// and whether it has met no OOM (only a clean pass counts towards growing back).
struct EvalPass {
    next: usize,
    tally: Tally,
    clean: bool,
}

/// What the loop needs from a finished step beyond the records.
struct Stepped {
    /// Data-parallel: some rank was asked to stop; every rank stops after this step.
    stop: bool,
}

/// A logged step's record, complete but for what its staged read brings: the loss, the time and
/// the epoch's rate (see `Trainer::record_step`).
struct StagedRecord {
    read: Staged,
    event: StepEvent,
    /// Optimizer steps the record's time covers.
    steps: u32,
    /// The epoch's samples so far, this step's included.
    seen: u64,
}

/// An epoch's wall clock and the samples this session trained in it.
struct EpochClock {
    t0: Instant,
    seen: u64,
}

/// This session of the loop: its start, the stop flag, what it has done so far.
struct Session {
    t_start: Instant,
    stop: StopFlag,
    last: Option<EpochResult>,
    windows: StepWindows,
    steps: i64,
    preflight_pending: bool,
    /// The epoch's loss and correct count, summed on the device until a record reads them.
    tally: Tally,
    /// Device reads since the last step record.
    reads: readback::Mark,
    /// The last step loss read, for the progress line.
    last_loss: Option<f64>,
    /// Where the next step record's time starts: the end of the previous record's step, or the
    /// start of the epoch's steps. On CUDA the CPU runs ahead of the device, so the stamps are on
    /// the device's clock, behind each step's work (a clock read at the end of the host's part
    /// of a step would leave that work out, and one read when the host next waits would be late
    /// by whatever the host did first).
    step_mark: Stamp,
    /// The epoch's step time so far: the sum of its step records' time.
    epoch_step_seconds: f64,
    /// The last logged step's record, waiting for its staged loss read.
    staged: Option<StagedRecord>,
    /// Optimizer steps since `step_mark`.
    steps_since_mark: u32,
    /// The steps' wait for their training batches.
    data_wait: data::DataWait,
}

pub struct Trainer {
    settings: LoopSettings,
    model: Model,
    arch: Option<ArchStep>,
    data: Splits,
    pipeline: StepPipeline,
    recovery: Recovery,
    execution: Execution,
    out: Outputs,
    state: TrainState,
    session: Session,
}

impl Trainer {
    pub fn new(c: Components, t_start: Instant) -> Result<Self> {
        let mut trainer = Trainer {
            session: Session {
                t_start,
                stop: StopFlag::install()?,
                last: None,
                windows: StepWindows::default(),
                steps: 0,
                preflight_pending: c.settings.preflight,
                tally: Tally::new(c.pipeline.forward.device, c.state.epoch_loss_sum, c.state.epoch_correct),
                reads: readback::Mark::now(),
                last_loss: None,
                step_mark: Stamp::now(Device::Cpu),
                epoch_step_seconds: 0.0,
                staged: None,
                steps_since_mark: 0,
                data_wait: Default::default(),
            },
            settings: c.settings,
            model: c.model,
            arch: c.arch,
            data: c.data,
            pipeline: c.pipeline,
            recovery: c.recovery,
            execution: c.execution,
            out: c.out,
            state: c.state,
        };
        // Levers the spec asked for or a resumed checkpoint had engaged act on the parts now.
        for lever in levers::engaged(&trainer.recovery.engaged()) {
            lever.engage(&mut trainer.parts());
        }
        Ok(trainer)
    }

    fn parts(&mut self) -> Parts<'_> {
        Parts {
            model: &mut self.model,
            arch: self.arch.as_mut(),
            forward: &mut self.pipeline.forward,
        }
    }

    /// Where the run's terminal lines go (the report line, the last words).
    pub fn progress(&self) -> &Progress {
        &self.out.progress
    }

    fn device(&self) -> Device {
        self.pipeline.forward.device
    }

    fn place(&self) -> Place {
        self.pipeline.place()
    }

    pub fn device_name(&self) -> String {
        device_name(self.device())
    }

    fn shape(&self) -> BatchShape {
        self.recovery.shape()
    }

    /// One optimizer step of the weights over `group`.
    fn weight_step(&mut self, group: &[i64], lr: f64) -> Result<StepOutput, StepError> {
        let buffers = self.recompute_buffers();
        let micro_batch = self.shape().micro_batch as usize;
        let (share, contributes) = self.execution.share(group, micro_batch);
        let Model { net, opt, stream, .. } = &mut self.model;
        let work = Work {
            data: &self.data.train,
            group: share,
            micro_batch,
            lr,
            step: self.state.global_step + 1,
            epoch: self.state.epoch,
            loss_scale: self.state.scaler.map(|s| s.scale),
            buffers: &buffers,
            stream: stream.as_ref(),
            divisor: group.len() as f64,
            contributes,
            stop: self.session.stop.requested(),
            synced: true,
        };
        let mut others: Vec<&mut Optimizer> = self.arch.iter_mut().map(|a| &mut a.opt).collect();
        let tally = Some(&mut self.session.tally);
        let out = self
            .pipeline
            .run(net.as_ref(), opt, &mut others, &work, &mut self.execution, tally)?;
        // Only a step that succeeded moves the scaler.
        if let Some(s) = &mut self.state.scaler {
            s.update(out.found_inf);
        }
        Ok(out)
    }

    /// The model's buffers (BatchNorm running statistics), which recomputation restores; empty
    /// when recomputation is off.
    fn recompute_buffers(&self) -> Vec<Tensor> {
        match self.pipeline.forward.recompute {
            true => self.model.buffers(),
            false => vec![],
        }
    }

    /// The architecture step (DARTS), when the preset has one.
    fn arch_step(&mut self) -> Result<(), StepError> {
        let buffers = self.recompute_buffers();
        let micro_batch = self.shape().micro_batch;
        let Some(arch) = &mut self.arch else {
            return Ok(());
        };
        let at = ArchAt {
            net: self.model.net.as_ref(),
            weights: &mut self.model.opt,
            val: &self.data.val,
            micro_batch,
            epoch: self.state.epoch,
            buffers: &buffers,
            pipeline: &self.pipeline,
        };
        arch.run(at, &mut self.execution)
    }

    fn emit(&mut self, e: Event) -> Result<()> {
        // Records stay in the order of what they tell: a step record still waiting for its
        // loss goes first.
        if !matches!(e, Event::Step(_)) {
            self.flush_record()?;
        }
        self.out.recorder.emit(&e)
    }

    /// Carries out the recovery machine's decision for one OOM. Ok: retry the failed work;
    /// Err: the run ends.
    fn handle_oom(&mut self, err: StepError, phase: &str) -> Result<()> {
        let (kind, message, phase, cause) = match err {
            StepError::Oom {
                kind,
                message,
                phase: at,
            } => (kind, message, phase_name(phase, at), self.oom_cause(phase, at)),
            StepError::Other(m) => return Err(anyhow::anyhow!("{phase} failed: {m}")),
            StepError::PeerLost(m) => {
                let note = self.save_without_peers();
                return Err(anyhow::anyhow!("{phase} failed: {m}{note}"));
            }
        };
        let outcome = self.recovery.on_oom_from(cause);
        if let Some(w) = self.recovery.cannot_fit() {
            tracing::warn!("{w}");
        }
        // The first OOM's report sees memory as the OOM left it: the gradients and the cached
        // segments (the fragmentation that may have caused it) are still there.
        let report = outcome.first.then(|| self.oom_report());
        // Whatever the failed attempt left in the gradients goes, and their memory with it.
        self.model.opt.drop_grads();
        if let Some(a) = &mut self.arch {
            a.opt.drop_grads();
        }
        self.clear_cache(ClearReason::Oom)?;
        for s in &outcome.skipped {
            tracing::warn!("OOM policy: skipped {s}");
        }
        let before = outcome.before.shape;
        let event = OomEvent {
            epoch: self.state.epoch + 1,
            step: self.state.global_step,
            phase: phase.clone(),
            kind,
            error: message.clone(),
            batch_shape: self.input_shape(before.micro_batch),
            device: self.device_name(),
            micro_batch_before: before.micro_batch,
            accumulation_before: before.accumulation_steps,
            decision: outcome.decision(),
            skipped: outcome.skipped.clone(),
            report,
        };
        self.emit(Event::Oom(event))?;
        let reason = first_line(&message);
        match outcome.lever() {
            Some(lever) => {
                tracing::warn!(
                    "out of memory in {phase} at epoch {} step {} on {} ({reason}); {}",
                    self.state.epoch + 1,
                    self.state.global_step,
                    self.device_name(),
                    lever.said(&outcome.before, &outcome.after, self.recovery.configured())
                );
                // A lever may move what a pending update writes.
                self.model.opt.settle()?;
                lever.engage(&mut self.parts());
                Ok(())
            }
            None => {
                tracing::error!("out of memory in {phase} ({reason}); memory.on_oom has nothing left to try");
                // The run ends here: lift the CPU cap so the last good state can be written.
                shim::cpu_alloc_set_cap(None);
                let note = if self.settings.max_steps.is_some() {
                    "no checkpoint (--max-steps)".to_owned()
                } else {
                    match self.save_checkpoint("oom") {
                        Ok(None) => "rank 0 saves the last good state".to_owned(),
                        Ok(Some((p, _))) => format!(
                            "last good state saved to {}; resume with --resume {}",
                            p.display(),
                            self.recovery.advice()
                        ),
                        Err(e) => format!("no checkpoint could be written: {e:#}"),
                    }
                };
                self.write_summary(Status::Oom, None)?;
                Err(OomExit(format!("out of memory in {phase}: {reason}; {note}")).into())
            }
        }
    }

    /// Whether an OOM was the static bill's: only the session's first update can tell, with
    /// what it held and the largest parameter's update workspace against the run's cap. Not in a
    /// group: a peer's OOM names no stage, and every rank must take the same decision.
    fn oom_cause(&self, work: &str, at: Option<Phase>) -> Cause {
        if work != PREFLIGHT || at != Some(Phase::Optimizer) || self.execution.group().is_some() {
            return Cause::Step;
        }
        let held = memory::sample(self.place()).allocated_bytes.unwrap_or(0);
        let workspace = self
            .model
            .opt
            .params()
            .iter()
            .map(|(_, t)| memory::tensor_bytes(t))
            .max();
        Cause::of_first_update(
            held,
            workspace.unwrap_or(0),
            self.settings.cap.as_ref().map(|c| c.bytes),
        )
    }

    /// Another rank is gone mid-step, before any optimizer wrote: rank 0 saves the last
    /// completed step on its own, without another collective (one would wait on the lost rank).
    /// Sharded optimizer state cannot be saved: part of it was on the lost rank.
    fn save_without_peers(&mut self) -> String {
        let rank0 = self.execution.group().is_some_and(|d| d.rank() == 0);
        let note = self.save_alone(rank0);
        // After the save (dropping a group can block on a hung peer with NCCL); no collective
        // runs from here on.
        self.execution.lose_peers();
        note
    }

    fn save_alone(&mut self, rank0: bool) -> String {
        if !rank0 {
            String::new()
        } else if self.settings.max_steps.is_some() {
            "; no checkpoint (--max-steps)".into()
        } else if self.model.opt.shard().is_some() {
            "; no checkpoint: the optimizer state is sharded and the lost rank held part of it; resume from the last one".into()
        } else {
            match self.save_checkpoint("rank lost") {
                Ok(Some((p, _))) => format!(
                    "; the last completed step (epoch {} step {}) was saved to {}; continue with --resume",
                    self.state.epoch + 1,
                    self.state.global_step,
                    p.display()
                ),
                Ok(None) => String::new(),
                Err(e) => format!("; no checkpoint could be written: {e:#}"),
            }
        }
    }

    fn oom_report(&self) -> OomReport {
        let stats = match self.place() {
            Place::Cuda(i) => shim::device_stats(i)
                .ok()
                .flatten()
                .map(|s| serde_json::to_value(s).unwrap_or_default()),
            Place::Cpu => Some(serde_json::to_value(shim::cpu_alloc_stats()).unwrap_or_default()),
        };
        // The one kept at the moment of the OOM, else one taken now (still before any cleanup).
        let snapshot = match self.device() {
            Device::Cuda(_) => match shim::take_oom_snapshot() {
                Ok(Some(s)) => Some(s),
                _ => shim::memory_snapshot()
                    .map_err(|e| tracing::warn!("no allocator snapshot: {e:#}"))
                    .ok(),
            },
            _ => None,
        };
        OomReport {
            allocator_stats: stats,
            memory: memory::sample(self.place()),
            cap: self.settings.cap.clone(),
            allocator_conf: self.settings.alloc_conf.clone(),
            snapshot,
            record_history: self.settings.record_history,
        }
    }

    /// Runs `f` until it succeeds or recovery gives up.
    /// A failed attempt must leave no trace, and the forward passes it ran changed BatchNorm's
    /// running statistics and drew random numbers: both come back before the retry.
    fn with_recovery<T>(&mut self, phase: &str, mut f: impl FnMut(&mut Self) -> Result<T, StepError>) -> Result<T> {
        let mut rollback = None;
        loop {
            if rollback.is_none() {
                match self.rollback_point() {
                    Ok(r) => rollback = Some(r),
                    Err(e) => {
                        self.handle_oom(e, phase)?;
                        continue;
                    }
                }
            }
            match f(self) {
                Ok(v) => return Ok(v),
                Err(e) => {
                    if let Some(r) = &rollback {
                        r.restore();
                    }
                    self.handle_oom(e, phase)?
                }
            }
        }
    }

    fn rollback_point(&self) -> Result<Rollback, StepError> {
        let place = self.place();
        let buffers: Vec<Tensor> = self
            .model
            .vs
            .variables()
            .into_iter()
            .filter(|(_, t)| !t.requires_grad())
            .map(|(_, t)| t)
            .collect();
        let device = self.device();
        oom::guarded_counting(
            || memory::oom_count(place),
            || {
                let packed = Packed::of(buffers);
                let mut rng = vec![(
                    Device::Cpu,
                    shim::rng_state(Device::Cpu).unwrap_or_else(|e| panic!("{e}")),
                )];
                if device != Device::Cpu {
                    rng.push((device, shim::rng_state(device).unwrap_or_else(|e| panic!("{e}"))));
                }
                Rollback { buffers: packed, rng }
            },
        )
    }

    fn input_shape(&self, b: i64) -> Vec<i64> {
        let mut s = vec![b];
        s.extend(self.data.train.sample_shape());
        s
    }

    /// Reports the preflight: the first optimizer step of this session, measured. It is a real
    /// step (not a rehearsal), so it costs nothing and an OOM in it meets the policy at once.
    fn report_preflight(&mut self) -> Result<()> {
        let m = memory::sample(self.place());
        let (used, measure) = memory::preflight_measure(&m);
        let cap = self.settings.cap.as_ref().map(|c| c.bytes);
        let headroom = cap.map(|c| c as i64 - used as i64);
        let head = match (headroom, cap) {
            (Some(h), Some(c)) if h >= 0 => {
                format!("{} headroom under the {} cap", human_bytes(h as u64), human_bytes(c))
            }
            (Some(h), Some(c)) => format!("{} over the {} cap", human_bytes((-h) as u64), human_bytes(c)),
            _ => "no cap set".into(),
        };
        let shape = self.shape();
        let beyond = match self.place() {
            Place::Cuda(i) => crate::info::process_device_bytes(i).and_then(|u| u.checked_sub(m.reserved_bytes?)),
            _ => None,
        };
        let outside = beyond.map_or(String::new(), |b| {
            format!(
                "; the CUDA context and libraries hold {} more, outside the cap: the card must hold the cap plus that",
                human_bytes(b)
            )
        });
        self.out.progress.println(&format!(
            "Preflight: the first step at micro-batch {} used {} ({measure}); {head}{outside}",
            shape.micro_batch,
            human_bytes(used)
        ));
        let e = PreflightEvent {
            micro_batch: shape.micro_batch,
            accumulation_steps: shape.accumulation_steps,
            peak_bytes: used,
            measure: measure.into(),
            cap_bytes: cap,
            headroom_bytes: headroom,
            device: self.device_name(),
            beyond_cap_bytes: beyond,
        };
        self.emit(Event::Preflight(e))
    }

    /// The validation pass, at validation's own micro-batch. An OOM here halves only that
    /// micro-batch and the pass goes on from the micro-batch that failed (a validation
    /// micro-batch changes nothing but the sums, which it adds only once it has run); training's
    /// shape, accumulation and levers stay as they are. At one sample the epoch's validation is
    /// skipped with a warning.
    fn validate(&mut self) -> Result<Option<(f64, f64)>> {
        self.model.opt.settle()?;
        let n = self.data.val.len();
        if n == 0 {
            return Ok(None);
        }
        self.eval_grow_back()?;
        let mut pass = EvalPass {
            next: 0,
            tally: Tally::new(self.device(), 0.0, 0),
            clean: true,
        };
        loop {
            let attempt = self.eval_from(&mut pass);
            let Some((kind, message)) = self.agree_on_eval(attempt)? else {
                break;
            };
            pass.clean = false;
            if !self.eval_oom(kind, message)? {
                return Ok(None);
            }
        }
        let b = self.recovery.eval_micro_batch();
        self.recovery.on_eval_pass(pass.clean, (n + b - 1) / b);
        let r = pass.tally.read().context("reading the validation sums")?;
        Ok(Some((r.epoch_loss_sum / n as f64, r.epoch_correct as f64 / n as f64)))
    }

    /// Validation from `pass.next` to the end at the micro-batch in force. Summed on the device
    /// in f64, in order (what adding each value read on the host gave), and read once at the
    /// end of the pass.
    fn eval_from(&self, pass: &mut EvalPass) -> Result<(), StepError> {
        let n = self.data.val.len();
        let b = self.recovery.eval_micro_batch() as usize;
        let place = self.place();
        let idx: Vec<i64> = (pass.next as i64..n).collect();
        let chunks: Vec<&[i64]> = idx.chunks(b).collect();
        oom::guarded_counting(
            || memory::oom_count(place),
            || {
                tch::no_grad(|| {
                    let _validation = stage(Phase::Validation, self.state.global_step);
                    let f = &self.pipeline.forward;
                    let mut ahead = chunks.first().map(|c| f.inputs(&self.data.val, c, 0));
                    for (i, chunk) in chunks.iter().enumerate() {
                        let batch = ahead.take().expect("one placed batch per micro-batch");
                        ahead = chunks.get(i + 1).map(|c| f.inputs(&self.data.val, c, 0));
                        let (l, c) = f.forward_loss(self.model.net.as_ref(), self.model.stream.as_ref(), &batch, false);
                        // Adding allocates nothing, so a micro-batch is either in the sums or not.
                        pass.tally.add(Totals::new(l, c));
                        pass.next += chunk.len();
                    }
                })
            },
        )
    }

    /// Some: validation ran out of memory, here or (data-parallel, agreed) on another rank:
    /// every rank halves together, as they do for training steps, so their validation
    /// micro-batches stay the same.
    fn agree_on_eval(&mut self, attempt: Result<(), StepError>) -> Result<Option<(OomKind, String)>> {
        let (own, broken) = match attempt {
            Ok(()) => (None, None),
            Err(StepError::Oom { kind, message, .. }) => (Some((kind, message)), None),
            Err(StepError::Other(m) | StepError::PeerLost(m)) => (None, Some(m)),
        };
        let Some(d) = self.execution.group() else {
            return match broken {
                Some(m) => Err(anyhow::anyhow!("validation failed: {m}")),
                None => Ok(own),
            };
        };
        let local = Local {
            outcome: match (&own, &broken) {
                (_, Some(_)) => Outcome::Broken,
                (Some(_), _) => Outcome::OutOfMemory,
                _ => Outcome::Done,
            },
            stop: false,
            loss_sum: 0.0,
            correct: 0,
        };
        let agreed = match d.exchange(&local) {
            Ok(a) => a,
            Err(e) => {
                // Every step of the epoch is done: what is saved resumes at its end.
                let note = self.save_without_peers();
                return Err(anyhow::anyhow!("validation: {e:#}{note}"));
            }
        };
        if let Some(&first) = agreed.broken.first() {
            return Err(anyhow::anyhow!(
                "validation failed: {}",
                broken.unwrap_or_else(|| format!("rank {first} failed (its own message says why)"))
            ));
        }
        Ok(agreed.failed.first().map(|&first| {
            own.unwrap_or_else(|| (OomKind::Peer, format!("rank {first} ran out of memory in validation")))
        }))
    }

    /// Answers a validation OOM. Ok(true): go on at the halved micro-batch; Ok(false): already
    /// at one sample, so this epoch's validation is skipped.
    fn eval_oom(&mut self, kind: OomKind, message: String) -> Result<bool> {
        let o = self.recovery.on_eval_oom();
        let report = o.first.then(|| self.oom_report());
        self.clear_cache(ClearReason::Oom)?;
        let event = OomEvent {
            epoch: self.state.epoch + 1,
            step: self.state.global_step,
            phase: "validation".into(),
            kind,
            error: message.clone(),
            batch_shape: self.input_shape(o.before),
            device: self.device_name(),
            micro_batch_before: o.before,
            accumulation_before: 1,
            decision: o.decision(),
            skipped: vec![],
            report,
        };
        self.emit(Event::Oom(event))?;
        let reason = first_line(&message);
        let training = self.shape();
        match o.after {
            Some(m) => {
                tracing::warn!(
                    "out of memory in validation at epoch {} on {} ({reason}); validation's micro-batch {} -> {m} (train.eval_batch_size); training's stays {} x {}",
                    self.state.epoch + 1,
                    self.device_name(),
                    o.before,
                    training.micro_batch,
                    training.accumulation_steps
                );
                Ok(true)
            }
            None => {
                tracing::warn!(
                    "out of memory in validation at one sample per micro-batch ({reason}); this epoch's validation is skipped, training goes on unchanged"
                );
                Ok(false)
            }
        }
    }

    /// Before a pass: validation's micro-batch grows back after enough clean ones.
    fn eval_grow_back(&mut self) -> Result<()> {
        let Some(g) = self.recovery.eval_grow_back() else {
            return Ok(());
        };
        tracing::info!(
            "clean validation micro-batches since the last OOM: validation's micro-batch grows back {} -> {}",
            g.before.micro_batch,
            g.after.micro_batch
        );
        self.emit(Event::GrowBack(GrowBackEvent {
            step: self.state.global_step,
            micro_batch_before: g.before.micro_batch,
            micro_batch: g.after.micro_batch,
            micro_batch_of: MicroBatchOf::Validation,
        }))
    }

    fn checkpoint_contents(&self) -> Result<(NamedTensors, NamedTensors)> {
        let mut model: Vec<(String, Tensor)> = self.model.vs.variables().into_iter().collect();
        model.sort_by(|a, b| a.0.cmp(&b.0));
        // Sharded optimizer state comes together on rank 0, whatever the rank count.
        let weight_state = self.execution.state_tensors(&self.model.opt)?;
        let mut optim: Vec<(String, Tensor)> = weight_state
            .into_iter()
            .map(|(n, t)| (format!("weight/{n}"), t))
            .collect();
        if let Some(a) = &self.arch {
            optim.extend(a.opt.state_tensors().into_iter().map(|(n, t)| (format!("arch/{n}"), t)));
        }
        // The generators dropout draws from, so a resumed run draws the same masks.
        let device = self.device();
        let mut gens = vec![("rng/cpu".to_owned(), Device::Cpu)];
        if device != Device::Cpu {
            gens.push(("rng/cuda".to_owned(), device));
        }
        for (name, d) in gens {
            match shim::rng_state(d) {
                Ok(bytes) => optim.push((name, Tensor::from_slice(&bytes))),
                // Out of memory is the save's failure, not a state to leave out.
                Err(e) if oom::classify(&e.to_string()).is_some() => return Err(e),
                Err(e) => tracing::warn!("saving the {name} generator state: {e}"),
            }
        }
        Ok((model, optim))
    }

    /// A data-parallel rank other than 0: it takes part in every collective but writes no
    /// checkpoint.
    fn follower(&self) -> bool {
        !self.execution.leads()
    }

    /// Saves, records the memory spike of the save, and clears the cache if configured. None on
    /// a data-parallel rank other than 0, which only helps gather the state rank 0 writes.
    pub fn save_checkpoint(&mut self, why: &str) -> Result<Option<(PathBuf, u64)>> {
        self.flush_record_or_warn();
        self.model.opt.settle()?;
        let t0 = Instant::now();
        let place = self.place();
        let before = memory::sample(place);
        memory::reset_peaks(place);
        self.state.weight_steps = self.model.opt.steps_taken();
        let pos = self.recovery.position();
        self.state.micro_batch = pos.shape.micro_batch;
        self.state.accumulation_steps = pos.shape.accumulation_steps;
        self.state.clean_steps = pos.clean_steps;
        self.state.levers = pos.engaged.names().iter().map(|n| n.to_string()).collect();
        let eval = self.recovery.eval_position();
        self.state.eval_micro_batch = Some(eval.micro_batch);
        self.state.eval_clean = eval.clean;
        if let Some(a) = &self.arch {
            self.state.arch = a.state.clone();
        }
        // Gathering the state allocates (the generators' states, sharded state on rank 0): an
        // OOM there is a typed error the caller decides on. The store writes atomically, so the
        // checkpoints already written stay as they were.
        let saved = oom::guarded_counting(
            || memory::oom_count(place),
            || -> Result<Option<(PathBuf, u64)>> {
                let _checkpoint = stage(Phase::Checkpoint, self.state.global_step);
                // An interrupted epoch resumes with its sums so far.
                self.read_tally()?;
                let (model, optim) = self.checkpoint_contents()?;
                if self.follower() {
                    return Ok(None);
                }
                self.out
                    .store
                    .save(&checkpoint::Contents {
                        model,
                        optimizer: optim,
                        state: &self.state,
                        spec_toml: &self.settings.spec_toml,
                    })
                    .map(Some)
            },
        );
        let saved = match saved {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => match oom::classify(&format!("{e:#}")) {
                Some(_) => return Err(self.save_oom(oom::short_message(&format!("{e:#}"))).into()),
                None => return Err(e),
            },
            Err(StepError::Oom { message, .. }) => return Err(self.save_oom(message).into()),
            Err(StepError::Other(m) | StepError::PeerLost(m)) => return Err(anyhow::anyhow!("{m}")),
        };
        let Some((path, size)) = saved else {
            return Ok(None);
        };
        let peak = memory::window_peak(place);
        let base = before.allocated_bytes.unwrap_or(before.rss_bytes);
        let spike = peak.saturating_sub(base);
        if self.settings.clear_after_checkpoint {
            self.clear_cache(ClearReason::Checkpoint)?;
        }
        let e = CheckpointEvent {
            reason: why.into(),
            path: path.clone(),
            bytes: size,
            seconds: t0.elapsed().as_secs_f64(),
            spike_bytes: spike,
            epochs_completed: self.state.epoch,
            step: self.state.global_step,
        };
        self.emit(Event::Checkpoint(e))?;
        Ok(Some((path, size)))
    }

    /// A checkpoint that ran out of memory while being gathered or written: what it needed and
    /// what was left, and the newest checkpoint that is still there.
    fn save_oom(&self, message: String) -> SaveOom {
        let place = self.place();
        let m = memory::sample(place);
        let cap = self.settings.cap.as_ref().map(|c| c.bytes);
        let model: u64 = self.model.vs.variables().values().map(memory::tensor_bytes).sum();
        // Listing the state may allocate (8-bit state, host copies) where memory just ran out.
        let state: u64 = oom::guarded(|| {
            self.model
                .opt
                .state_tensors()
                .iter()
                .map(|(_, t)| memory::tensor_bytes(t))
                .sum()
        })
        .unwrap_or(0);
        SaveOom {
            message,
            step: self.state.global_step,
            model_bytes: model,
            state_bytes: state,
            allocated: m.allocated_bytes,
            cap,
            previous: self.out.store.latest(),
        }
    }

    fn clear_cache(&mut self, reason: ClearReason) -> Result<()> {
        let cleared = self.out.cache.clear(self.place(), reason);
        self.record_clear(cleared)
    }

    fn record_clear(&mut self, cleared: Option<memory::Cleared>) -> Result<()> {
        match cleared {
            Some(cleared) => self.emit(Event::CacheClear(CacheClearEvent {
                step: self.state.global_step,
                cleared,
            })),
            None => Ok(()),
        }
    }

    /// The per-step memory reading, timed so the summary shows what it costs.
    fn read_step_memory(&mut self) {
        let t = Instant::now();
        let m = memory::step_reading(self.place());
        self.session.windows.line.fold(&m);
        self.session.windows.epoch.fold(&m);
        self.session.windows.readings += 1;
        self.session.windows.reading_seconds += t.elapsed().as_secs_f64();
    }

    fn after_clean_step(&mut self) -> Result<()> {
        if let Some(g) = self.recovery.on_clean_step() {
            tracing::info!(
                "clean steps since the last OOM: growing the micro-batch back {} -> {}",
                g.before.micro_batch,
                g.after.micro_batch
            );
            let e = GrowBackEvent {
                step: self.state.global_step,
                micro_batch_before: g.before.micro_batch,
                micro_batch: g.after.micro_batch,
                micro_batch_of: MicroBatchOf::Training,
            };
            self.emit(Event::GrowBack(e))?;
        }
        Ok(())
    }

    pub fn train(&mut self) -> Result<Status> {
        let r = self.epochs();
        if r.is_err() {
            self.flush_record_or_warn();
        }
        r
    }

    /// `flush_record` where the run must go on to what matters more (a checkpoint, the summary):
    /// a step record whose read failed is lost, with a warning, and nothing else.
    fn flush_record_or_warn(&mut self) {
        if let Err(e) = self.flush_record() {
            tracing::warn!("a step record is lost: {e:#}");
        }
    }

    fn epochs(&mut self) -> Result<Status> {
        while self.state.epoch < self.settings.epochs {
            let mut clock = EpochClock {
                t0: Instant::now(),
                seen: 0,
            };
            if let Some(status) = self.train_epoch(&mut clock)? {
                return Ok(status);
            }
            self.end_epoch(&clock)?;
        }
        self.write_summary(Status::Completed, None)?;
        Ok(Status::Completed)
    }

    /// The epoch's remaining optimizer steps. Some: the run stops here with this status.
    fn train_epoch(&mut self, clock: &mut EpochClock) -> Result<Option<Status>> {
        let (epoch, epochs) = (self.state.epoch, self.settings.epochs);
        let n = self.data.train.len();
        let e = self.recovery.configured().effective();
        let order = data::epoch_order(n, self.settings.seed, epoch);
        let groups: Vec<&[i64]> = order.chunks(e as usize).collect();
        memory::reset_peaks(self.place());
        // The line window carries over: a record's peaks cover every step since the last.
        self.session.windows.epoch = StepMemory::default();
        clock.t0 = Instant::now();
        // The previous epoch ended with reads (its tally, validation, the save), so the device
        // has no earlier work left that the first step's time would take in.
        self.session.step_mark = Stamp::now(self.device());
        self.session.epoch_step_seconds = 0.0;
        self.session.steps_since_mark = 0;
        let steps_per_epoch = (n + e - 1) / e;
        let done = self.state.groups_done as u64;
        self.out
            .progress
            .start_epoch(epoch, epochs, steps_per_epoch as u64, done);
        for (k, group) in groups.iter().enumerate().skip(self.state.groups_done as usize) {
            self.plan_batches(epoch, &groups[k..]);
            let out = self.optimizer_step(group, clock)?;
            if let Some(status) = self.stop_point(&out, clock)? {
                return Ok(Some(status));
            }
        }
        self.out.progress.finish_epoch();
        Ok(None)
    }

    /// A record for each level of prefetch depth the loader gave up under host-memory pressure.
    fn record_shed(&mut self) -> Result<()> {
        for (from, to, available) in self.data.train.shed() {
            tracing::warn!(
                "host memory low ({} available): the data loader keeps {to} micro-batch(es) ahead instead of {from}",
                human_bytes(available)
            );
            self.emit(Event::Prefetch(PrefetchEvent {
                step: self.state.global_step,
                prefetch_before: from as i64,
                prefetch: to as i64,
                available_bytes: available,
            }))?;
        }
        Ok(())
    }

    /// Hands the loader the micro-batches of the epoch's `rest` of groups, as the steps will
    /// ask for them, when the epoch or the micro-batch changed since its last plan.
    fn plan_batches(&mut self, epoch: i64, rest: &[&[i64]]) {
        let micro = self.shape().micro_batch;
        if !self.data.train.prefetches() || !self.session.data_wait.needs_plan(epoch, micro) {
            return;
        }
        let m = micro.max(1) as usize;
        let batches = rest
            .iter()
            .flat_map(|g| self.execution.share(g, m).0.chunks(m).map(<[i64]>::to_vec))
            .collect();
        self.data.train.plan(epoch, batches);
    }

    /// One optimizer step over `group` (after the architecture step, if any), with recovery,
    /// the preflight on the session's first, and its records.
    fn optimizer_step(&mut self, group: &[i64], clock: &mut EpochClock) -> Result<Stepped> {
        let measure = self.session.preflight_pending;
        if measure {
            memory::reset_peaks(self.place());
        }
        let step = self.state.global_step + 1;
        if self.arch.is_some() {
            self.with_recovery(ARCH_STEP, |t| {
                let _squeeze = fault::squeeze_in(Phase::Arch, step);
                t.arch_step()
            })?;
        }
        let lr = self.model.sched.lr_at(self.model.opt.steps_taken());
        let work = if measure { PREFLIGHT } else { WEIGHT_STEP };
        let out = self.with_recovery(work, |t| {
            if measure {
                memory::reset_peaks(t.place());
            }
            let _squeeze = measure.then(|| fault::squeeze_in(Phase::Preflight, step));
            t.weight_step(group, lr)
        })?;
        if measure {
            self.session.preflight_pending = false;
            self.report_preflight()?;
        }
        let StepOutput { found_inf, stop } = out;
        self.session.data_wait.add(self.data.train.take_wait());
        self.record_shed()?;
        self.state.groups_done += 1;
        self.state.global_step += 1;
        self.state.epoch_seen += group.len() as i64;
        clock.seen += group.len() as u64;
        self.session.steps_since_mark += 1;
        self.read_step_memory();
        let cleared = self.out.cache.after_step(self.place(), self.state.global_step as u64);
        self.record_clear(cleared)?;
        // The record names the shape the step ran at, not the one a grow-back makes next.
        let ran = Ran {
            skipped: found_inf,
            samples: group.len(),
            micro_batch: self.shape().micro_batch,
        };
        self.after_clean_step()?;
        self.record_step(ran, lr, clock)?;
        crate::fault::sync_errors_after(self.state.global_step);
        Ok(Stepped { stop })
    }

    /// Reads the tally into the position (one read), when a step was added since the last.
    fn read_tally(&mut self) -> Result<Option<f64>> {
        self.flush_record()?;
        if !self.session.tally.pending() {
            return Ok(None);
        }
        let r = self.session.tally.read().context("reading the training loss")?;
        self.state.epoch_loss_sum = r.epoch_loss_sum;
        self.state.epoch_correct = r.epoch_correct;
        Ok(Some(r.step_loss_sum))
    }

    /// On a logged step, stages its loss read and, on a GPU, holds its record until the values
    /// are in: the next step's `record_step` (or anything that writes a record, reads the sums
    /// or ends the run) collects them. By then the next step is queued, so the device goes from
    /// one step's work to the next without waiting for the host, and a record is written one
    /// step late. On the CPU the values are in at once, and so is the record.
    fn record_step(&mut self, ran: Ran, lr: f64, clock: &EpochClock) -> Result<()> {
        let Ran {
            skipped,
            samples,
            micro_batch,
        } = ran;
        self.flush_record()?;
        let every = self.settings.log_every;
        if every > 0 && self.state.global_step % every == 0 {
            let read = self.session.tally.stage().context("reading the training loss")?;
            let steps = std::mem::take(&mut self.session.steps_since_mark).max(1);
            let event = StepEvent {
                epoch: self.state.epoch + 1,
                step: self.state.global_step,
                loss: f64::NAN,
                lr,
                micro_batch,
                samples: samples as i64,
                seconds: f64::NAN,
                samples_per_s: f64::NAN,
                memory: std::mem::take(&mut self.session.windows.line),
                loss_scale: self.state.scaler.map(|s| s.scale),
                skipped,
                host_reads: self.session.reads.take(),
                host_update_seconds: self.model.opt.take_host_update_seconds(),
                data_wait_seconds: self.session.data_wait.take_line(steps),
            };
            let seen = clock.seen;
            let ready = read.ready() && !crate::fault::late_reads();
            self.session.staged = Some(StagedRecord {
                read,
                event,
                steps,
                seen,
            });
            if ready {
                self.flush_record()?;
            }
        }
        let w = &self.session.windows.epoch;
        let mem = w.allocated_bytes.unwrap_or(w.rss_bytes);
        let loss = self.session.last_loss;
        // The host's rate: on a GPU it runs at most a step or two ahead of the device's.
        let rate = clock.seen as f64 / clock.t0.elapsed().as_secs_f64().max(1e-9);
        self.out.progress.step(self.state.groups_done as u64, || {
            let loss = loss.map_or("-".into(), |l| format!("{l:.4}"));
            format!("loss {loss}  {rate:.1} samples/s  mem {}", human_bytes(mem))
        });
        Ok(())
    }

    /// Writes the step record whose loss read is staged, once the read is in. Its time runs
    /// from the end of the previous record's step to the end of this one's, so it takes in the
    /// device's work; the epoch's rate alike.
    fn flush_record(&mut self) -> Result<()> {
        let Some(StagedRecord {
            read,
            mut event,
            steps,
            seen,
        }) = self.session.staged.take()
        else {
            return Ok(());
        };
        let (r, done) = read.collect().context("reading the training loss")?;
        if !self.session.tally.pending() {
            // No step was added since the stage: these are the sums as they stand.
            self.state.epoch_loss_sum = r.epoch_loss_sum;
            self.state.epoch_correct = r.epoch_correct;
        }
        event.loss = r.step_loss_sum / event.samples as f64;
        let elapsed = done.seconds_since(&self.session.step_mark);
        self.session.epoch_step_seconds += elapsed;
        event.seconds = elapsed / steps as f64;
        event.samples_per_s = seen as f64 / self.session.epoch_step_seconds.max(1e-9);
        self.session.step_mark = done;
        self.session.last_loss = Some(event.loss);
        self.emit(Event::Step(event))
    }

    /// After a step: an interrupt saves and ends the run; `--max-steps` ends it unsaved.
    fn stop_point(&mut self, out: &Stepped, clock: &EpochClock) -> Result<Option<Status>> {
        let stop = self.session.stop.clone();
        crate::fault::await_signal_at(self.state.global_step, || stop.requested());
        // Data-parallel ranks stop on the step they agreed on, never on their own.
        if self.execution.stops(out.stop, self.session.stop.requested()) {
            self.out.progress.finish_epoch();
            // An interrupted run whose checkpoint does not fit ends as an OOM does.
            let saved = self
                .save_checkpoint("interrupted")
                .map_err(|e| match e.downcast::<SaveOom>() {
                    Ok(oom) => OomExit(oom.to_string()).into(),
                    Err(e) => e,
                })?;
            self.write_summary(Status::Interrupted, None)?;
            let at = saved.map_or("rank 0's run directory".into(), |(p, _)| p.display().to_string());
            return Err(Interrupted(format!(
                "interrupted at epoch {} step {}; checkpoint saved to {at}; continue with --resume",
                self.state.epoch + 1,
                self.state.global_step,
            ))
            .into());
        }
        self.session.steps += 1;
        if self.settings.max_steps.is_some_and(|m| self.session.steps >= m) {
            self.out.progress.finish_epoch();
            // The last step's read waits for the device, so the epoch's time covers its work.
            self.flush_record_or_warn();
            let unfinished = (clock.seen, clock.t0.elapsed().as_secs_f64());
            self.write_summary(Status::StepLimit, Some(unfinished))?;
            return Ok(Some(Status::StepLimit));
        }
        Ok(None)
    }

    /// Validation, the epoch's record and line, and the epoch's checkpoint.
    fn end_epoch(&mut self, clock: &EpochClock) -> Result<()> {
        let (epoch, epochs) = (self.state.epoch, self.settings.epochs);
        // The tally's read waits for the device, so the epoch's time covers its work.
        self.read_tally()?;
        let seconds = clock.t0.elapsed().as_secs_f64();
        let val = self.validate()?;
        let mut mem = memory::sample(self.place());
        mem.include(&self.session.windows.epoch);
        let ranks = match self.rank_peaks(mem.peak_allocated_bytes, mem.peak_reserved_bytes, mem.peak_rss_bytes) {
            Ok(r) => r,
            Err(e) => {
                // Every step of the epoch is done: what is saved resumes at its end.
                let note = self.save_without_peers();
                return Err(anyhow::anyhow!("gathering every rank's memory peaks: {e:#}{note}"));
            }
        };
        let seen = self.state.epoch_seen.max(1) as f64;
        let samples = clock.seen;
        let result = EpochResult {
            epoch: epoch + 1,
            train_loss: self.state.epoch_loss_sum / seen,
            train_acc: self.state.epoch_correct as f64 / seen,
            val_loss: val.map(|v| v.0),
            val_acc: val.map(|v| v.1),
            seconds,
            samples_per_s: clock.seen as f64 / seconds.max(1e-9),
        };
        let genotype = self.model.net.genotype();
        let data_wait_seconds = self.session.data_wait.take_epoch();
        let note = self.session.data_wait.note(data_wait_seconds, seconds);
        self.out.progress.println(&(epoch_line(&result, &mem, epochs) + &note));
        if !result.train_loss.is_finite() && self.execution.leads() {
            tracing::warn!(
                "epoch {}: the training loss is {}, so the weights no longer learn; lower train.lr, \
                 check the data and model.init_from for NaN or infinite values, or train in fp32",
                result.epoch,
                result.train_loss
            );
        }
        if let Some(g) = &genotype {
            self.out
                .progress
                .println(&format!("  genotype: {}", serde_json::to_string(g)?));
        }
        let shape = self.shape();
        let ev = EpochEvent {
            result: result.clone(),
            samples,
            step: self.state.global_step,
            lr: self.model.sched.lr_at(self.model.opt.steps_taken()),
            micro_batch: shape.micro_batch,
            accumulation_steps: shape.accumulation_steps,
            device: self.device_name(),
            memory: mem,
            cache: (&self.out.cache).into(),
            genotype,
            ranks,
            host_reads: self.session.reads.take(),
            data_wait_seconds,
        };
        self.emit(Event::Epoch(ev))?;
        self.state.monitored = match self.settings.monitor {
            Monitor::ValLoss => result.val_loss,
            Monitor::ValAcc => result.val_acc,
            Monitor::TrainLoss => Some(result.train_loss),
        };
        self.session.last = Some(result);
        self.next_epoch()
    }

    /// Moves the position to the next epoch and saves there when it is due.
    fn next_epoch(&mut self) -> Result<()> {
        let s = &mut self.state;
        s.epoch += 1;
        s.groups_done = 0;
        s.epoch_loss_sum = 0.0;
        s.epoch_correct = 0;
        s.epoch_seen = 0;
        self.session.tally = Tally::new(self.pipeline.forward.device, 0.0, 0);
        let every = self.settings.checkpoint_every;
        let last_epoch = s.epoch == self.settings.epochs;
        s.finished = last_epoch;
        // --max-steps is a smoke test or a fit probe: it leaves no checkpoint behind.
        let probing = self.settings.max_steps.is_some();
        if !probing && (last_epoch || (every > 0 && self.state.epoch % every == 0)) {
            match self.save_checkpoint("epoch") {
                Ok(_) => {}
                Err(e) => match e.downcast::<SaveOom>() {
                    // A periodic checkpoint can wait for the next one; the last one is the
                    // run's result, so the run ends on it.
                    Ok(oom) if !last_epoch => self.skip_checkpoint(oom)?,
                    Ok(oom) => {
                        self.record_save_oom(&oom, Decision::fail())?;
                        self.write_summary(Status::Oom, None)?;
                        return Err(OomExit(oom.to_string()).into());
                    }
                    Err(e) => return Err(e.context("saving a checkpoint")),
                },
            }
        }
        if self.settings.clear_on_epoch_end {
            self.clear_cache(ClearReason::EpochEnd)?;
        }
        Ok(())
    }

    /// A periodic checkpoint that did not fit: the run goes on, the previous checkpoint stays.
    fn skip_checkpoint(&mut self, oom: SaveOom) -> Result<()> {
        tracing::warn!(
            "{oom}; skipped this checkpoint, training goes on (the next one is due after {} more epoch(s))",
            self.settings.checkpoint_every.max(1)
        );
        self.record_save_oom(&oom, Decision::skip())
    }

    fn record_save_oom(&mut self, oom: &SaveOom, decision: Decision) -> Result<()> {
        let shape = self.shape();
        let e = OomEvent {
            epoch: self.state.epoch,
            step: self.state.global_step,
            phase: Phase::Checkpoint.label().into(),
            kind: match self.place() {
                Place::Cpu => OomKind::Cpu,
                Place::Cuda(_) => OomKind::Cuda,
            },
            error: oom.message.clone(),
            batch_shape: self.input_shape(shape.micro_batch),
            device: self.device_name(),
            micro_batch_before: shape.micro_batch,
            accumulation_before: shape.accumulation_steps,
            decision,
            skipped: vec![],
            report: None,
        };
        self.emit(Event::Oom(e))
    }

    /// The optimizer steps done so far, the run's position.
    pub fn global_step(&self) -> i64 {
        self.state.global_step
    }

    pub fn last(&self) -> Option<&EpochResult> {
        self.session.last.as_ref()
    }

    /// Data-parallel: every rank's peaks (a collective); empty for a single process.
    fn rank_peaks(&self, allocated: Option<u64>, reserved: Option<u64>, rss: u64) -> Result<Vec<RankPeak>> {
        self.execution.peaks(RankPeak {
            rank: 0,
            peak_allocated_bytes: allocated,
            peak_reserved_bytes: reserved,
            peak_rss_bytes: rss,
        })
    }

    /// With `memory.record_history` on CUDA: the allocator's history up to here, for finding what
    /// made the peak (the process that writes the records only). A snapshot that cannot be taken
    /// or written costs the run nothing else.
    fn write_end_snapshot(&self) {
        if !self.settings.record_history || !matches!(self.device(), Device::Cuda(_)) || !self.execution.leads() {
            return;
        }
        let written = shim::memory_snapshot().and_then(|bytes| self.out.recorder.write_end_snapshot(&bytes));
        if let Err(e) = written {
            tracing::warn!("no allocator snapshot at the run's end: {e:#}");
        }
    }

    /// Every status it is called with is reached by all data-parallel ranks together, so the
    /// ranks' peaks can be gathered here. `unfinished`: the samples and seconds of an epoch the
    /// session stopped in (`--max-steps`).
    pub fn write_summary(&mut self, status: Status, unfinished: Option<(u64, f64)>) -> Result<()> {
        self.flush_record_or_warn();
        let mut memory = memory::sample(self.place());
        memory.include(&self.session.windows.epoch);
        let (allocated, reserved, rss) = self.out.recorder.summary_so_far().peaks_with(&memory);
        let ranks = match self.rank_peaks(allocated, reserved, rss) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!("the summary lists no per-rank peaks: {e:#}");
                Vec::new()
            }
        };
        let scalers = [self.state.scaler, self.arch.as_ref().and_then(|a| a.state.arch_scaler)];
        let closing = Closing {
            status,
            device: self.device_name(),
            epochs_completed: self.state.epoch,
            global_steps: self.state.global_step,
            wall_seconds: self.session.t_start.elapsed().as_secs_f64(),
            unfinished_epoch: unfinished,
            configured: self.recovery.configured(),
            shape: self.shape(),
            memory,
            step_readings: self.session.windows.readings,
            step_reading_seconds: self.session.windows.reading_seconds,
            ranks,
            cache: (&self.out.cache).into(),
            oom: self.recovery.counts().clone(),
            precision: PrecisionSummary {
                mode: self.pipeline.forward.precision.precision,
                loss_scale: self.state.scaler.map(|s| s.scale),
                skipped_steps: scalers.iter().flatten().map(|s| s.skipped_steps).sum(),
                activation_checkpointing: self.recovery.engaged().contains("recompute"),
                optimizer_impl: Some(self.model.opt.implementation().name().into()),
            },
            host_reads: readback::count(),
        };
        // After the peaks are read: building the pickle raises the process's RSS.
        self.write_end_snapshot();
        self.out.recorder.close(closing)
    }
}

/// What `with_recovery` calls the weight step, the session's first (measured) weight step and
/// DARTS's architecture step; an OOM inside the first two is named by the stage it reached.
const WEIGHT_STEP: &str = "training step";
const PREFLIGHT: &str = "preflight";
const ARCH_STEP: &str = "architecture step";

/// The phase an OOM's message and record name: the weight step's stage (forward, backward,
/// optimizer step), marked "(preflight)" on the session's first step; other work by its name.
fn phase_name(work: &str, at: Option<Phase>) -> String {
    match (work, at) {
        (WEIGHT_STEP, Some(p)) => p.label().into(),
        (PREFLIGHT, Some(p)) => format!("{} (preflight)", p.label()),
        _ => work.into(),
    }
}

/// A checkpoint that ran out of memory while being gathered or written.
#[derive(Debug)]
struct SaveOom {
    message: String,
    step: i64,
    model_bytes: u64,
    state_bytes: u64,
    allocated: Option<u64>,
    cap: Option<u64>,
    previous: Option<PathBuf>,
}

impl std::fmt::Display for SaveOom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = match (self.allocated, self.cap) {
            (Some(a), Some(c)) => format!(
                "; {} of tensors were allocated under the {} cap",
                human_bytes(a),
                human_bytes(c)
            ),
            (Some(a), None) => format!("; {} of tensors were allocated", human_bytes(a)),
            _ => String::new(),
        };
        let previous = match &self.previous {
            Some(p) => format!("the previous checkpoint {} is intact", p.display()),
            None => "no earlier checkpoint exists".into(),
        };
        write!(
            f,
            "out of memory in {} at step {} ({}): the model is {} and the optimizer state {}{held}; {previous}. Raise memory.limit (memory.fraction on a GPU), or set memory.clear_after_checkpoint = true and memory.optimizer_state = \"host\" to leave the save more room",
            Phase::Checkpoint.label(),
            self.step,
            first_line(&self.message),
            human_bytes(self.model_bytes),
            human_bytes(self.state_bytes),
        )
    }
}

impl std::error::Error for SaveOom {}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

fn epoch_line(r: &EpochResult, m: &MemorySample, epochs: i64) -> String {
    let val = match (r.val_loss, r.val_acc) {
        (Some(l), Some(a)) => format!("  val loss {l:.4} acc {:.1}%", a * 100.0),
        _ => String::new(),
    };
    let mem = match (
        m.allocated_bytes,
        m.reserved_bytes,
        m.peak_allocated_bytes,
        m.peak_reserved_bytes,
    ) {
        (Some(a), Some(r), Some(pa), Some(pr)) => format!(
            "GPU {} allocated / {} reserved (peak {} / {}); RSS {}",
            human_bytes(a),
            human_bytes(r),
            human_bytes(pa),
            human_bytes(pr),
            human_bytes(m.rss_bytes)
        ),
        (Some(a), None, Some(pa), _) => format!(
            "CPU tensors {} allocated (epoch peak {}){}; RSS {}",
            human_bytes(a),
            human_bytes(pa),
            m.peak_host_bytes
                .map(|h| format!(
                    ", host {} (peak {})",
                    human_bytes(m.host_bytes.unwrap_or(0)),
                    human_bytes(h)
                ))
                .unwrap_or_default(),
            human_bytes(m.rss_bytes)
        ),
        _ => format!(
            "RSS {} (epoch peak {})",
            human_bytes(m.rss_bytes),
            human_bytes(m.peak_rss_bytes)
        ),
    };
    format!(
        "epoch {}/{}  train loss {:.4} acc {:.1}%{val}  {}  {:.1} samples/s  | {mem}",
        r.epoch,
        epochs,
        r.train_loss,
        r.train_acc * 100.0,
        human_duration(r.seconds),
        r.samples_per_s
    )
}

/// What an optimizer step was, for its record: whether it was skipped (fp16 inf), its samples
/// and the micro-batch it ran at.
struct Ran {
    skipped: bool,
    samples: usize,
    micro_batch: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_buffers_come_back_exactly_whatever_their_kinds_and_shapes() {
        let live = vec![
            Tensor::from_slice(&[0.5f32, -1.25, 3.0]),
            Tensor::from(7i64),
            Tensor::from_slice(&[1e-30f32, 2.0, 4.0, 8.0]).reshape([2, 2]),
        ];
        let before: Vec<Tensor> = live.iter().map(Tensor::copy).collect();
        let packed = Packed::of(live.iter().map(Tensor::shallow_clone).collect());
        assert_eq!(packed.0.len(), 2, "one pack per kind");
        for t in &live {
            let _ = t.shallow_clone().fill_(42);
        }
        packed.restore();
        for (t, b) in live.iter().zip(&before) {
            assert!(t.equal(b), "{t:?} vs {b:?}");
        }
    }
}
