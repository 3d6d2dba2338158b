//! The retry wrapper: work that runs out of memory is rolled back and retried as the recovery
//! machine decides, or the run ends with the last good state saved. Every OOM's record is built
//! here, whichever work met it.
use anyhow::Result;
use tch::Device;

use super::rollback::{Attempt, Rollback};
use super::terminal::Notice;
use super::trainer::Trainer;
use crate::exit::OomExit;
use crate::fault::Phase;
use crate::memory::{self, ClearReason, Place};
use crate::oom::{BatchShape, Decision, OomKind, StepError};
use crate::policy::levers::Described;
use crate::policy::recovery::Cause;
use crate::records::{Event, GraphEvent, OomEvent, OomReport, Status};
use crate::shim;

/// What differs between the OOM records of a training step, validation and a checkpoint.
pub(super) struct OomMet {
    pub phase: String,
    pub kind: OomKind,
    pub error: String,
    /// The shape of the work that failed.
    pub shape: BatchShape,
    pub decision: Decision,
    pub skipped: Vec<String>,
    pub report: Option<OomReport>,
}

impl Trainer {
    /// Runs `f` until it succeeds or recovery gives up.
    /// A failed attempt must leave no trace, and the forward passes it ran changed BatchNorm's
    /// running statistics and drew random numbers: both come back before the retry.
    pub(super) fn with_recovery<T>(
        &mut self,
        work: Attempt,
        mut f: impl FnMut(&mut Self) -> Result<T, StepError>,
    ) -> Result<T> {
        let mut rollback = None;
        loop {
            if rollback.is_none() {
                match Rollback::take(&self.model.vs, self.device()) {
                    Ok(r) => rollback = Some(r),
                    Err(e) => {
                        self.handle_oom(e, work)?;
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
                    self.handle_oom(e, work)?
                }
            }
        }
    }

    /// The record of an OOM, in the epoch (1-based) it happened in.
    pub(super) fn oom_event(&self, epoch: i64, met: OomMet) -> OomEvent {
        OomEvent {
            epoch,
            step: self.state.global_step,
            phase: met.phase,
            kind: met.kind,
            error: met.error,
            batch_shape: self.input_shape(met.shape.micro_batch),
            device: self.device_name(),
            micro_batch_before: met.shape.micro_batch,
            accumulation_before: met.shape.accumulation_steps,
            decision: met.decision,
            skipped: met.skipped,
            report: met.report,
        }
    }

    /// A batch of `b` samples' shape, as the OOM records name the failing one.
    fn input_shape(&self, b: i64) -> Vec<i64> {
        let mut s = vec![b];
        s.extend(self.data.train.sample_shape());
        s
    }

    /// Carries out the recovery machine's decision for one OOM. Ok: retry the failed work;
    /// Err: the run ends.
    fn handle_oom(&mut self, err: StepError, work: Attempt) -> Result<()> {
        let (kind, message, phase, cause) = match err {
            StepError::Oom {
                kind,
                message,
                phase: at,
            } => (kind, message, work.phase_name(at), self.oom_cause(work, at)),
            StepError::Other(m) => return Err(anyhow::anyhow!("{} failed: {m}", work.name())),
            StepError::PeerLost(m) => {
                let note = self.save_after_failed_collective(&m);
                return Err(anyhow::anyhow!("{} failed: {m}{note}", work.name()));
            }
            StepError::OomInCollective(m) => {
                let note = self.save_after_failed_collective(&m);
                return Err(OomExit(format!("{} failed: {m}{note}", work.name())).into());
            }
        };
        let outcome = self.recovery.on_oom_from(cause);
        if let Some(w) = self.recovery.cannot_fit() {
            self.say(Notice::CannotFit(w));
        }
        // The first OOM's report sees memory as the OOM left it: the gradients and the cached
        // segments (the fragmentation that may have caused it) are still there.
        let report = outcome.first.then(|| self.oom_report());
        self.stager.failed_attempt(self.place());
        // Whatever the failed attempt left in the gradients goes, and their memory with it.
        self.model.opt.drop_grads();
        if let Some(a) = &mut self.arch {
            a.opt.drop_grads();
        }
        self.clear_cache(ClearReason::Oom)?;
        let met = OomMet {
            phase: phase.clone(),
            kind,
            error: message.clone(),
            shape: outcome.before.shape,
            decision: outcome.decision(),
            skipped: outcome.skipped.clone(),
            report,
        };
        self.emit(Event::Oom(self.oom_event(self.state.epoch + 1, met)))?;
        let reason = first_line(&message).to_owned();
        let Some(lever) = outcome.lever() else {
            self.say(Notice::OutOfOptions {
                phase: phase.clone(),
                reason: reason.clone(),
            });
            return Err(self.out_of_options(&phase, &reason));
        };
        self.say(Notice::OomAnswered {
            phase,
            epoch: self.state.epoch + 1,
            step: self.state.global_step,
            device: self.device_name(),
            reason,
            said: lever.said(&outcome.before, &outcome.after, self.recovery.configured()),
        });
        // A lever may move what a pending update writes.
        self.model.opt.settle()?;
        lever.engage(&mut self.parts());
        Ok(())
    }

    /// Whether an OOM was the static bill's: only the session's first update can tell, with
    /// what it held and the largest parameter's update workspace against the run's cap. Not in a
    /// group: a peer's OOM names no stage, and every rank must take the same decision.
    fn oom_cause(&self, work: Attempt, at: Option<Phase>) -> Cause {
        if work != Attempt::Preflight || at != Some(Phase::Optimizer) || self.execution.group().is_some() {
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

    /// `memory.on_oom` has nothing left to try: the last good state is saved, and the run ends.
    fn out_of_options(&mut self, phase: &str, reason: &str) -> anyhow::Error {
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
        if let Err(e) = self.write_summary(Status::Oom, None) {
            return e;
        }
        OomExit(format!("out of memory in {phase}: {reason}; {note}")).into()
    }

    /// What capturing this optimizer step's steps did (DARTS's architecture step's too): a
    /// capture that ran out of memory is an OOM answered by running eager.
    pub(super) fn record_graphs(&mut self, step: i64) -> Result<()> {
        for oom in self.execution.capture_ooms() {
            let met = OomMet {
                phase: oom.phase.map_or("forward", |p| p.name()).to_owned(),
                kind: oom.kind,
                error: first_line(&oom.message).to_owned(),
                shape: self.shape(),
                decision: Decision {
                    action: Decision::EAGER.into(),
                    to: None,
                },
                skipped: Vec::new(),
                report: None,
            };
            let e = self.oom_event(self.state.epoch + 1, met);
            self.emit(Event::Oom(OomEvent { step, ..e }))?;
        }
        for e in self.execution.graph_events() {
            self.emit(Event::Graph(GraphEvent { step, ..e }))?;
        }
        Ok(())
    }

    pub(super) fn oom_report(&self) -> OomReport {
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
}

pub(super) fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}
