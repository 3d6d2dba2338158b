//! Checkpoint saving: gathering the state (sharded state comes together on rank 0), the write,
//! its memory spike, and a save that runs out of memory: a periodic one is skipped, the last
//! one ends the run. A rank that lost its peers saves alone.
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use tch::Tensor;

use super::forward::stage;
use super::oom_answer::{first_line, OomMet};
use super::terminal::Notice;
use super::trainer::Trainer;
use crate::checkpoint::{self, NamedTensors};
use crate::exit::OomExit;
use crate::fault::Phase;
use crate::human::human_bytes;
use crate::memory::{self, ClearReason, Place};
use crate::oom::{self, Decision, OomKind, StepError};
use crate::records::{CheckpointEvent, Event, Status};
use crate::shim;
use tch::Device;

/// Why a data-parallel rank can run no more collectives, which its checkpoint's reason says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Apart {
    /// Another rank is gone.
    PeerLost,
    /// This rank ran out of memory inside a collective the others are in.
    OutOfMemory,
}

impl Apart {
    /// From a failed collective's message.
    fn of(message: &str) -> Apart {
        match oom::classify(message) {
            Some(_) => Apart::OutOfMemory,
            None => Apart::PeerLost,
        }
    }

    fn reason(self) -> &'static str {
        match self {
            Apart::PeerLost => "rank lost",
            Apart::OutOfMemory => "oom",
        }
    }

    fn sharded(self) -> &'static str {
        match self {
            Apart::PeerLost => "the lost rank held part of it",
            Apart::OutOfMemory => "gathering it needs the other ranks",
        }
    }
}

impl Trainer {
    /// A collective failed mid-step, before any optimizer wrote: rank 0 saves the last
    /// completed step on its own, without another collective (one would wait on the lost rank,
    /// or on the one out of memory). Sharded optimizer state cannot be saved: part of it is on
    /// the other ranks.
    fn save_without_peers(&mut self, why: Apart) -> String {
        let rank0 = self.execution.group().is_some_and(|d| d.rank() == 0);
        let note = self.save_alone(rank0, why);
        // After the save (dropping a group can block on a hung peer with NCCL); no collective
        // runs from here on.
        self.execution.lose_peers();
        note
    }

    /// `save_without_peers` after a collective failed with `message`: a lost peer, or this
    /// rank out of memory inside it.
    pub(super) fn save_after_failed_collective(&mut self, message: &str) -> String {
        self.save_without_peers(Apart::of(message))
    }

    fn save_alone(&mut self, rank0: bool, why: Apart) -> String {
        if !rank0 {
            String::new()
        } else if self.settings.max_steps.is_some() {
            "; no checkpoint (--max-steps)".into()
        } else if self.model.opt.shard().is_some() {
            format!(
                "; no checkpoint: the optimizer state is sharded and {}; resume from the last one",
                why.sharded()
            )
        } else {
            match self.save_checkpoint(why.reason()) {
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
    fn checkpoint_contents(&self) -> Result<(NamedTensors, NamedTensors)> {
        let kept = &self.model.kept;
        let mut model: Vec<(String, Tensor)> = self
            .model
            .vs
            .variables()
            .into_iter()
            .filter(|(n, _)| kept.keeps(n))
            .collect();
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
    pub(super) fn save_checkpoint(&mut self, why: &str) -> Result<Option<(PathBuf, u64)>> {
        self.flush_record_or_warn();
        self.model.opt.settle()?;
        let t0 = Instant::now();
        let place = self.place();
        let before = memory::sample(place);
        memory::reset_peaks(place);
        self.state.weight_steps = self.model.opt.steps_taken();
        self.state.unfrozen_at = self.model.opt.unfrozen_at();
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
                self.store
                    .save(&checkpoint::Contents {
                        model,
                        optimizer: optim,
                        state: &self.state,
                        spec_toml: &self.settings.spec_toml,
                        base: self.model.kept.base(),
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
            Err(StepError::Other(m) | StepError::PeerLost(m) | StepError::OomInCollective(m)) => {
                return Err(anyhow::anyhow!("{m}"))
            }
        };
        self.run.last_save = Instant::now();
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
            previous: self.store.latest(),
        }
    }

    /// The epoch's checkpoint, when it is due. A periodic one that does not fit can wait for the
    /// next; the last one is the run's result, so the run ends on it.
    pub(super) fn epoch_checkpoint(&mut self, last_epoch: bool) -> Result<()> {
        let Err(e) = self.save_checkpoint("epoch") else {
            return Ok(());
        };
        match e.downcast::<SaveOom>() {
            Ok(oom) if !last_epoch => {
                self.say(Notice::CheckpointSkipped {
                    why: oom.to_string(),
                    next: format!("after {} more epoch(s)", self.settings.checkpoint_every.max(1)),
                });
                self.record_save_oom(&oom, Decision::skip())
            }
            Ok(oom) => {
                self.record_save_oom(&oom, Decision::fail())?;
                self.write_summary(Status::Oom, None)?;
                Err(OomExit(oom.to_string()).into())
            }
            Err(e) => Err(e.context("saving a checkpoint")),
        }
    }

    /// `checkpoint.every_steps` and `every_minutes`: a save within the epoch, after the step
    /// that made one due; the position within the epoch is part of it, so a resume continues
    /// with the next batch. The epoch's last step leaves it to the epoch's checkpoint where one
    /// follows; `--max-steps` saves none.
    pub(super) fn step_checkpoint(&mut self, epoch_ends: bool) -> Result<()> {
        let (steps, minutes) = (self.settings.checkpoint_steps, self.settings.checkpoint_minutes);
        if self.settings.max_steps.is_some() || (steps <= 0 && minutes <= 0.0) {
            return Ok(());
        }
        let every = self.settings.checkpoint_every;
        let epoch = self.state.epoch + 1;
        if epoch_ends && (epoch == self.settings.epochs || (every > 0 && epoch % every == 0)) {
            return Ok(());
        }
        let by_steps = steps > 0 && self.state.global_step % steps == 0;
        let by_time = minutes > 0.0 && self.run.last_save.elapsed().as_secs_f64() >= minutes * 60.0;
        if !(by_steps || self.time_agreed(by_time)?) {
            return Ok(());
        }
        let reason = if by_steps { "steps" } else { "minutes" };
        match self.save_checkpoint(reason) {
            Ok(_) => Ok(()),
            Err(e) => match e.downcast::<SaveOom>() {
                // The next one may fit: training goes on, as after a skipped epoch checkpoint.
                Ok(oom) => {
                    self.run.last_save = Instant::now();
                    let next = match by_steps {
                        true => format!("after {steps} more step(s)"),
                        false => format!("after {minutes} more minute(s)"),
                    };
                    self.say(Notice::CheckpointSkipped {
                        why: oom.to_string(),
                        next,
                    });
                    self.record_save_oom(&oom, Decision::skip())
                }
                Err(e) => Err(e.context("saving a checkpoint")),
            },
        }
    }

    /// Whether a save is due by time on every rank: rank 0's clock decides for a data-parallel
    /// group (each rank's own could cross the mark a step apart, and a save is a collective).
    fn time_agreed(&self, due_here: bool) -> Result<bool> {
        if self.settings.checkpoint_minutes <= 0.0 {
            return Ok(false);
        }
        let Some(d) = self.execution.group() else {
            return Ok(due_here);
        };
        let flag = Tensor::from_slice(&[due_here as i64]).to_device(self.device());
        d.broadcast(&[&flag])?;
        Ok(flag.int64_value(&[0]) != 0)
    }

    /// The checkpoint of an interrupted run; one that does not fit ends the run as an OOM does.
    pub(super) fn save_interrupted(&mut self) -> Result<Option<(PathBuf, u64)>> {
        self.save_checkpoint("interrupted")
            .map_err(|e| match e.downcast::<SaveOom>() {
                Ok(oom) => OomExit(oom.to_string()).into(),
                Err(e) => e,
            })
    }

    fn record_save_oom(&mut self, oom: &SaveOom, decision: Decision) -> Result<()> {
        let met = OomMet {
            phase: Phase::Checkpoint.label().into(),
            kind: match self.place() {
                Place::Cpu => OomKind::Cpu,
                Place::Cuda(_) => OomKind::Cuda,
            },
            error: oom.message.clone(),
            shape: self.shape(),
            decision,
            skipped: vec![],
            report: None,
        };
        // Recorded after the position moved on to the next epoch: its count is the epoch the save
        // belongs to.
        self.emit(Event::Oom(self.oom_event(self.state.epoch, met)))
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
