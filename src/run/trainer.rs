//! The training loop: epochs of optimizer steps over groups of samples (the effective batch),
//! split into micro-batches, through the step pipeline. Its collaborators each have a file:
//! the retry wrapper (`oom_answer`, `rollback`), `validation`, checkpoint saving (`save`), the
//! step records' staging (`stager`), the session's end (`summary`) and the terminal's lines
//! (`terminal`). Every outcome leaves as an event, which the `Recorder` and the terminal both
//! receive; what only the terminal shows (the progress bar) is a notice.
//!
//! Invariant that makes OOM recovery exact: a group is a fixed list of sample indices and the
//! step pipeline's gradient is the group mean however the group is split. A failed group
//! leaves no trace (its tensors are dropped while unwinding, the optimizer step is
//! transactional, gradients are zeroed) and is retried whole.
use std::time::Instant;

use anyhow::Result;
use tch::{Device, Tensor};

use super::components::{Components, LoopSettings, Outputs};
use super::execution::Execution;
use super::parts::{ArchAt, ArchStep, Parts, Trained};
use super::rollback::Attempt;
use super::stager::{Logged, Stager, TokenCounts};
use super::step::{StepOutput, StepPipeline, Work};
use super::terminal::{Lost, Notice, Terminal};
use super::tokens;
use crate::checkpoint::{Store, TrainState};
use crate::data::{self, Splits};
use crate::exit::Interrupted;
use crate::fault::{self, Phase};
use crate::host::Home;
use crate::human::device_name;
use crate::memory::{self, CachePolicy, ClearReason, Place};
use crate::oom::{BatchShape, StepError};
use crate::optim::Optimizer;
use crate::policy::levers;
use crate::policy::recovery::Recovery;
use crate::progress::Progress;
use crate::records::*;
use crate::signals::StopFlag;
use crate::spec::Monitor;

/// What the loop needs from a finished step beyond the records.
struct Stepped {
    /// Data-parallel: some rank was asked to stop; every rank stops after this step.
    stop: bool,
}

/// An epoch's wall clock and the samples this session trained in it.
struct EpochClock {
    t0: Instant,
    seen: u64,
    /// A language model's counted target tokens this session of the epoch.
    tokens: u64,
}

/// This session of the loop: its start, the stop flag, what it has done so far.
pub(super) struct LoopState {
    pub(super) t_start: Instant,
    stop: StopFlag,
    pub(super) last: Option<EpochResult>,
    steps: i64,
    preflight_pending: bool,
    /// The last checkpoint of this session (or its start), for `checkpoint.every_minutes`.
    pub(super) last_save: Instant,
}

pub struct Trainer {
    pub(super) settings: LoopSettings,
    pub(super) model: Trained,
    pub(super) arch: Option<ArchStep>,
    pub(super) data: Splits,
    pub(super) pipeline: StepPipeline,
    pub(super) recovery: Recovery,
    pub(super) execution: Execution,
    pub(super) recorder: Recorder,
    pub(super) terminal: Terminal,
    pub(super) store: Store,
    pub(super) cache: CachePolicy,
    pub(super) state: TrainState,
    pub(super) stager: Stager,
    pub(super) run: LoopState,
}

impl Trainer {
    pub fn new(c: Components, t_start: Instant) -> Result<Self> {
        let Outputs {
            recorder,
            progress,
            store,
            cache,
        } = c.out;
        let terminal = Terminal::new(progress, c.settings.epochs, c.execution.leads());
        let mut trainer = Trainer {
            run: LoopState {
                t_start,
                stop: StopFlag::install()?,
                last: None,
                steps: 0,
                preflight_pending: c.settings.preflight,
                last_save: Instant::now(),
            },
            stager: Stager::new(c.pipeline.forward.device, c.state.epoch_loss_sum, c.state.epoch_correct),
            terminal,
            settings: c.settings,
            model: c.model,
            arch: c.arch,
            data: c.data,
            pipeline: c.pipeline,
            recovery: c.recovery,
            execution: c.execution,
            recorder,
            store,
            cache,
            state: c.state,
        };
        // Levers the spec asked for or a resumed checkpoint had engaged act on the parts now.
        for lever in levers::engaged(&trainer.recovery.engaged()) {
            lever.engage(&mut trainer.parts());
        }
        Ok(trainer)
    }

    pub(super) fn parts(&mut self) -> Parts<'_> {
        Parts {
            model: &mut self.model,
            arch: self.arch.as_mut(),
            forward: &mut self.pipeline.forward,
        }
    }

    /// Where the run's terminal lines go (the report line, the last words).
    pub fn progress(&self) -> &Progress {
        self.terminal.progress()
    }

    pub(super) fn device(&self) -> Device {
        self.pipeline.forward.device
    }

    pub(super) fn place(&self) -> Place {
        self.pipeline.place()
    }

    pub fn device_name(&self) -> String {
        device_name(self.device())
    }

    pub(super) fn shape(&self) -> BatchShape {
        self.recovery.shape()
    }

    /// One optimizer step of the weights over `group`.
    fn weight_step(&mut self, group: &[i64], lr: f64, tokens: Option<u64>) -> Result<StepOutput, StepError> {
        let buffers = self.recompute_buffers();
        let micro_batch = self.shape().micro_batch as usize;
        let (share, contributes) = self.execution.share(group, micro_batch);
        let Trained { net, opt, stream, .. } = &mut self.model;
        let work = Work {
            data: &self.data.train,
            group: share,
            micro_batch,
            lr,
            step: Some(self.state.global_step + 1),
            epoch: self.state.epoch,
            loss_scale: self.state.scaler.map(|s| s.scale),
            buffers: &buffers,
            stream: stream.as_ref(),
            // A language model's loss is the mean over the group's counted target tokens.
            divisor: tokens.map_or(group.len() as f64, |t| t as f64),
            contributes,
            stop: self.run.stop.requested(),
            synced: true,
        };
        let mut others: Vec<&mut Optimizer> = self.arch.iter_mut().map(|a| &mut a.opt).collect();
        let tally = Some(&mut self.stager.tally);
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

    /// An outcome, to the records and the terminal alike.
    pub(super) fn emit(&mut self, e: Event) -> Result<()> {
        // Records stay in the order of what they tell: a step record still waiting for its
        // loss goes first.
        if !matches!(e, Event::Step(_)) {
            self.flush_record()?;
        }
        self.terminal.event(&e);
        self.recorder.emit(&e)
    }

    /// What only the terminal shows.
    pub(super) fn say(&mut self, n: Notice) {
        self.terminal.notice(n);
    }

    /// Reports the preflight: the first optimizer step of this session, measured. It is a real
    /// step (not a rehearsal), so it costs nothing and an OOM in it meets the policy at once.
    fn report_preflight(&mut self) -> Result<()> {
        let m = memory::sample(self.place());
        let (used, measure) = memory::preflight_measure(&m);
        let cap = self.settings.cap.as_ref().map(|c| c.bytes);
        let shape = self.shape();
        let beyond = match self.place() {
            Place::Cuda(i) => crate::info::process_device_bytes(i).and_then(|u| u.checked_sub(m.reserved_bytes?)),
            _ => None,
        };
        let e = PreflightEvent {
            micro_batch: shape.micro_batch,
            accumulation_steps: shape.accumulation_steps,
            peak_bytes: used,
            measure: measure.into(),
            cap_bytes: cap,
            headroom_bytes: cap.map(|c| c as i64 - used as i64),
            device: self.device_name(),
            beyond_cap_bytes: beyond,
        };
        self.emit(Event::Preflight(e))
    }

    pub(super) fn clear_cache(&mut self, reason: ClearReason) -> Result<()> {
        let cleared = self.cache.clear(self.place(), reason);
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

    fn after_clean_step(&mut self) -> Result<()> {
        if let Some(g) = self.recovery.on_clean_step() {
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
    pub(super) fn flush_record_or_warn(&mut self) {
        if let Err(e) = self.flush_record() {
            self.say(Notice::Lost(Lost::StepRecord, e));
        }
    }

    fn epochs(&mut self) -> Result<Status> {
        while self.state.epoch < self.settings.epochs {
            let mut clock = EpochClock {
                t0: Instant::now(),
                seen: 0,
                tokens: 0,
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
        let epoch = self.state.epoch;
        let n = self.data.train.len();
        let e = self.recovery.configured().effective();
        let order = data::epoch_order(n, self.settings.seed, epoch);
        let groups: Vec<&[i64]> = order.chunks(e as usize).collect();
        if std::mem::take(&mut self.state.tokens_uncounted) && self.model.net.output_head().is_some() {
            let done = self.state.groups_done as usize;
            (self.state.epoch_tokens, self.state.tokens_seen) =
                tokens::resumed_counts(&self.data.train, &groups, done, epoch);
        }
        self.model.unfreeze_if_due(epoch);
        memory::reset_peaks(self.place());
        clock.t0 = Instant::now();
        self.stager.start_epoch(self.device());
        self.say(Notice::EpochStarts {
            epoch,
            steps: ((n + e - 1) / e) as u64,
            done: self.state.groups_done as u64,
        });
        for (k, group) in groups.iter().enumerate().skip(self.state.groups_done as usize) {
            self.plan_batches(epoch, &groups[k..]);
            let out = self.optimizer_step(group, clock)?;
            if let Some(status) = self.stop_point(&out, clock)? {
                return Ok(Some(status));
            }
            self.step_checkpoint(k + 1 == groups.len())?;
        }
        self.say(Notice::EpochEnds);
        Ok(None)
    }

    /// A record for each level of prefetch depth the loader gave up under host-memory pressure.
    fn record_shed(&mut self) -> Result<()> {
        for (from, to, available) in self.data.train.shed() {
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
        if !self.data.train.prefetches() || !self.stager.data_wait.needs_plan(epoch, micro) {
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
        let measure = self.run.preflight_pending;
        if measure {
            memory::reset_peaks(self.place());
        }
        let step = self.state.global_step + 1;
        if self.arch.is_some() {
            self.with_recovery(Attempt::ArchStep, |t| {
                let _squeeze = fault::squeeze_in(Phase::Arch, step);
                t.arch_step()
            })?;
        }
        let lr = self.model.sched.lr_at(self.model.opt.steps_taken());
        let tokens = self
            .model
            .net
            .output_head()
            .map(|_| tokens::counted(&self.data.train, group));
        let work = if measure {
            Attempt::Preflight
        } else {
            Attempt::WeightStep
        };
        let out = self.with_recovery(work, |t| {
            if measure {
                memory::reset_peaks(t.place());
            }
            let _squeeze = measure.then(|| fault::squeeze_in(Phase::Preflight, step));
            t.weight_step(group, lr, tokens)
        })?;
        if measure {
            self.run.preflight_pending = false;
            self.report_preflight()?;
        }
        let StepOutput { found_inf, stop } = out;
        let on_host = self.model.opt.state_home() == Home::Host;
        let ran = self.model.opt.take_host_update_seconds();
        self.stager.host_updates(on_host, found_inf, ran);
        self.stager.data_wait.add(self.data.train.take_wait());
        self.record_shed()?;
        self.record_graphs(step)?;
        self.state.groups_done += 1;
        self.state.global_step += 1;
        self.state.epoch_seen += group.len() as i64;
        clock.seen += group.len() as u64;
        if let Some(t) = tokens {
            clock.tokens += t;
            self.state.epoch_tokens += t;
            self.state.tokens_seen += t;
        }
        self.stager.stepped(self.place());
        let cleared = self.cache.after_step(self.place(), self.state.global_step as u64);
        self.record_clear(cleared)?;
        // The record names the shape the step ran at, not the one a grow-back makes next.
        let ran = Ran {
            skipped: found_inf,
            samples: group.len(),
            micro_batch: self.shape().micro_batch,
            tokens: tokens.map(|step| TokenCounts {
                step,
                epoch: clock.tokens,
                run: self.state.tokens_seen,
            }),
        };
        // A grow-back follows the step that earned it, and so does its record.
        self.record_step(ran, lr, clock)?;
        self.after_clean_step()?;
        crate::fault::sync_errors_after(self.state.global_step);
        Ok(Stepped { stop })
    }

    /// Reads the tally into the position (one read), when a step was added since the last.
    pub(super) fn read_tally(&mut self) -> Result<Option<f64>> {
        self.flush_record()?;
        let Some(r) = self.stager.read_tally()? else {
            return Ok(None);
        };
        self.state.epoch_loss_sum = r.epoch_loss_sum;
        self.state.epoch_correct = r.epoch_correct;
        Ok(Some(r.step_loss_sum))
    }

    /// On a logged step, stages its loss read and, on a GPU, holds its record until the values
    /// are in: the next step's `record_step` (or anything that writes a record, reads the sums
    /// or ends the run) collects them (see `stager`). Then the progress line.
    fn record_step(&mut self, ran: Ran, lr: f64, clock: &EpochClock) -> Result<()> {
        self.flush_record()?;
        let ran_tokens = ran.tokens;
        let every = self.settings.log_every;
        if every > 0 && self.state.global_step % every == 0 {
            let logged = Logged {
                epoch: self.state.epoch + 1,
                step: self.state.global_step,
                lr,
                micro_batch: ran.micro_batch,
                samples: ran.samples as i64,
                loss_scale: self.state.scaler.map(|s| s.scale),
                skipped: ran.skipped,
                seen: clock.seen,
                tokens: ran.tokens,
            };
            if self.stager.stage(logged)? {
                self.flush_record()?;
            }
        }
        // The host's rate: on a GPU it runs at most a step or two ahead of the device's.
        let rate = clock.seen as f64 / clock.t0.elapsed().as_secs_f64().max(1e-9);
        self.say(Notice::Stepped {
            done: self.state.groups_done as u64,
            loss: self.stager.last_loss(),
            samples_per_s: rate,
            tokens_per_s: ran_tokens.map(|_| clock.tokens as f64 / clock.t0.elapsed().as_secs_f64().max(1e-9)),
            memory: self.stager.epoch_memory(),
        });
        Ok(())
    }

    /// Writes the step record whose loss read is staged, once the read is in.
    pub(super) fn flush_record(&mut self) -> Result<()> {
        if self.stager.awaits_update() {
            // Written before the next step's forward would finish its step's host update: it
            // finishes now.
            self.model.opt.settle()?;
            let seconds = self.model.opt.take_host_update_seconds();
            self.stager.update_in(seconds);
        }
        let Some(c) = self.stager.collect()? else {
            return Ok(());
        };
        if let Some((loss_sum, correct)) = c.sums {
            self.state.epoch_loss_sum = loss_sum;
            self.state.epoch_correct = correct;
        }
        self.emit(Event::Step(c.event))
    }

    /// After a step: an interrupt saves and ends the run; `--max-steps` ends it unsaved.
    fn stop_point(&mut self, out: &Stepped, clock: &EpochClock) -> Result<Option<Status>> {
        let stop = self.run.stop.clone();
        crate::fault::await_signal_at(self.state.global_step, || stop.requested());
        // Data-parallel ranks stop on the step they agreed on, never on their own.
        if self.execution.stops(out.stop, self.run.stop.requested()) {
            self.say(Notice::EpochEnds);
            let saved = self.save_interrupted()?;
            self.write_summary(Status::Interrupted, None)?;
            let at = saved.map_or("rank 0's run directory".into(), |(p, _)| p.display().to_string());
            return Err(Interrupted(format!(
                "interrupted at epoch {} step {}; checkpoint saved to {at}; continue with --resume",
                self.state.epoch + 1,
                self.state.global_step,
            ))
            .into());
        }
        self.run.steps += 1;
        if self.settings.max_steps.is_some_and(|m| self.run.steps >= m) {
            self.say(Notice::EpochEnds);
            // The last step's read waits for the device, so the epoch's time covers its work.
            self.flush_record_or_warn();
            let unfinished = (clock.seen, clock.t0.elapsed().as_secs_f64());
            self.write_summary(Status::StepLimit, Some(unfinished))?;
            return Ok(Some(Status::StepLimit));
        }
        Ok(None)
    }

    /// The epoch's figures: per sample, or a language model's per counted target token.
    fn epoch_result(&self, val: Option<(f64, f64)>, seconds: f64, clock: &EpochClock) -> EpochResult {
        let lm = self.model.net.output_head().is_some();
        let seen = match lm {
            true => self.state.epoch_tokens.max(1) as f64,
            false => self.state.epoch_seen.max(1) as f64,
        };
        let train_loss = self.state.epoch_loss_sum / seen;
        EpochResult {
            epoch: self.state.epoch + 1,
            train_loss,
            train_acc: self.state.epoch_correct as f64 / seen,
            val_loss: val.map(|v| v.0),
            val_acc: val.map(|v| v.1),
            seconds,
            samples_per_s: clock.seen as f64 / seconds.max(1e-9),
            language: lm.then(|| EpochTokens {
                tokens_seen: self.state.tokens_seen,
                tokens_per_s: clock.tokens as f64 / seconds.max(1e-9),
                train_perplexity: tokens::perplexity(train_loss),
                val_perplexity: val.map(|v| tokens::perplexity(v.0)),
            }),
        }
    }

    /// Validation, the epoch's record (which the terminal shows as the epoch line), and the
    /// epoch's checkpoint.
    fn end_epoch(&mut self, clock: &EpochClock) -> Result<()> {
        // The tally's read waits for the device, so the epoch's time covers its work.
        self.read_tally()?;
        let seconds = clock.t0.elapsed().as_secs_f64();
        let val = self.validate()?;
        let mut mem = memory::sample(self.place());
        mem.include(&self.stager.windows.epoch);
        let ranks = match self.rank_peaks(mem.peak_allocated_bytes, mem.peak_reserved_bytes, mem.peak_rss_bytes) {
            Ok(r) => r,
            Err(e) => {
                // Every step of the epoch is done: what is saved resumes at its end.
                let note = self.save_after_failed_collective(&format!("{e:#}"));
                return Err(anyhow::anyhow!("gathering every rank's memory peaks: {e:#}{note}"));
            }
        };
        let result = self.epoch_result(val, seconds, clock);
        let shape = self.shape();
        let ev = EpochEvent {
            result: result.clone(),
            samples: clock.seen,
            step: self.state.global_step,
            lr: self.model.sched.lr_at(self.model.opt.steps_taken()),
            micro_batch: shape.micro_batch,
            accumulation_steps: shape.accumulation_steps,
            device: self.device_name(),
            memory: mem,
            cache: (&self.cache).into(),
            genotype: self.model.net.genotype(),
            ranks,
            host_reads: self.stager.reads.take(),
            data_wait_seconds: self.stager.data_wait.take_epoch(),
        };
        self.emit(Event::Epoch(ev))?;
        self.state.monitored = match self.settings.monitor {
            Monitor::ValLoss => result.val_loss,
            Monitor::ValAcc => result.val_acc,
            Monitor::TrainLoss => Some(result.train_loss),
        };
        self.run.last = Some(result);
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
        s.epoch_tokens = 0;
        self.stager.tally = super::tally::Tally::new(self.pipeline.forward.device, 0.0, 0);
        let every = self.settings.checkpoint_every;
        let last_epoch = s.epoch == self.settings.epochs;
        s.finished = last_epoch;
        // --max-steps is a smoke test or a fit probe: it leaves no checkpoint behind.
        let probing = self.settings.max_steps.is_some();
        if !probing && (last_epoch || (every > 0 && self.state.epoch % every == 0)) {
            self.epoch_checkpoint(last_epoch)?;
        }
        if self.settings.clear_on_epoch_end {
            self.clear_cache(ClearReason::EpochEnd)?;
        }
        Ok(())
    }
}

/// What an optimizer step was, for its record: whether it was skipped (fp16 inf), its samples
/// and the micro-batch it ran at.
struct Ran {
    skipped: bool,
    samples: usize,
    micro_batch: i64,
    tokens: Option<TokenCounts>,
}
