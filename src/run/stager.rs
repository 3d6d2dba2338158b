//! Step timing and loss staging: a logged step's record waits, complete but for its loss, time
//! and rate, until its staged read is in. On a GPU the next step is queued by then, so the device
//! goes from one step's work to the next without waiting for the host, and a record is written
//! one step late; on the CPU the values are in at once. The per-step memory readings fold into
//! the windows the records report.
use std::time::Instant;

use anyhow::{Context, Result};
use tch::Device;

use super::clock::Stamp;
use super::tally::{Read, Staged, Tally};
use super::tokens::perplexity;
use crate::data::DataWait;
use crate::memory::{self, Place, StepMemory};
use crate::readback;
use crate::records::{StepEvent, StepTokens};

/// The per-step readings folded into the windows that records report: since the last step
/// line, and since the epoch began.
#[derive(Debug, Default)]
pub struct StepWindows {
    pub line: StepMemory,
    pub epoch: StepMemory,
    /// How many readings were taken and what they cost, for the summary.
    pub readings: u64,
    pub reading_seconds: f64,
}

/// A logged step's record, complete but for what its staged read brings: the loss, the time and
/// the epoch's rate.
struct StagedRecord {
    read: Staged,
    event: StepEvent,
    /// Optimizer steps the record's time covers.
    steps: u32,
    /// The epoch's samples so far, this step's included.
    seen: u64,
    tokens: Option<TokenCounts>,
    /// Its step's host update finishes in the next step's forward: the record waits for it.
    awaits_update: bool,
}

/// The optimizer's updates with its state on the host, for the step records. A host update by
/// block is left for the next step's forward to finish, so a step's update is timed one step
/// later; whether it is left is learned from the first step with the state on the host (an
/// update that is not left has run by the step's end).
#[derive(Debug, Default)]
struct HostUpdates {
    deferred: Option<bool>,
    /// Update seconds not yet in a record.
    seconds: Option<f64>,
}

fn add(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x + y),
        (x, y) => x.or(y),
    }
}

impl StepWindows {
    /// A memory reading now, into both windows.
    fn fold(&mut self, place: Place) {
        let m = memory::step_reading(place);
        self.line.fold(&m);
        self.epoch.fold(&m);
    }
}

impl StagedRecord {
    fn took_update(&mut self, seconds: Option<f64>) {
        self.event.host_update_seconds = add(self.event.host_update_seconds, seconds);
        self.awaits_update = false;
    }
}

/// What a logged step's record holds before its read: everything the loop knew at the step.
pub struct Logged {
    pub epoch: i64,
    pub step: i64,
    pub lr: f64,
    pub micro_batch: i64,
    pub samples: i64,
    pub loss_scale: Option<f64>,
    pub skipped: bool,
    /// The epoch's samples so far, this step's included.
    pub seen: u64,
    /// A language model's counted target tokens.
    pub tokens: Option<TokenCounts>,
}

/// A language model's counted target tokens at a logged step.
#[derive(Debug, Clone, Copy)]
pub struct TokenCounts {
    /// The step's group's, which its loss is the mean over.
    pub step: u64,
    /// The epoch's so far in this session, this step's included (its rate's numerator).
    pub epoch: u64,
    /// The run's so far.
    pub run: u64,
}

/// A written-out step record and, when no step was added since it was staged, the epoch's sums
/// as they stand.
pub struct Collected {
    pub event: StepEvent,
    pub sums: Option<(f64, i64)>,
}

pub struct Stager {
    /// The epoch's loss and correct count, summed on the device until a record reads them.
    pub tally: Tally,
    pub windows: StepWindows,
    /// Device reads since the last step record.
    pub reads: readback::Mark,
    /// The steps' wait for their training batches.
    pub data_wait: DataWait,
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
    staged: Option<StagedRecord>,
    /// Optimizer steps since `step_mark`.
    steps_since_mark: u32,
    host: HostUpdates,
}

impl Stager {
    /// Sums that start from what is already known (a resumed epoch's).
    pub fn new(device: Device, loss_sum: f64, correct: i64) -> Stager {
        Stager {
            tally: Tally::new(device, loss_sum, correct),
            windows: StepWindows::default(),
            reads: readback::Mark::now(),
            data_wait: DataWait::default(),
            last_loss: None,
            step_mark: Stamp::now(Device::Cpu),
            epoch_step_seconds: 0.0,
            staged: None,
            steps_since_mark: 0,
            host: HostUpdates::default(),
        }
    }

    /// The epoch's steps begin. The previous epoch ended with reads (its tally, validation, the
    /// save), so the device has no earlier work left that the first step's time would take in.
    /// The line window carries over: a record's peaks cover every step since the last.
    pub fn start_epoch(&mut self, device: Device) {
        self.windows.epoch = StepMemory::default();
        self.step_mark = Stamp::now(device);
        self.epoch_step_seconds = 0.0;
        self.steps_since_mark = 0;
    }

    /// A step is done: it counts towards the next record's time, and its memory reading goes
    /// into the windows, timed so the summary shows what the readings cost.
    pub fn stepped(&mut self, place: Place) {
        self.steps_since_mark += 1;
        let t = Instant::now();
        self.windows.fold(place);
        self.windows.readings += 1;
        self.windows.reading_seconds += t.elapsed().as_secs_f64();
    }

    /// A weight step is done: `ran`, the host update seconds that finished during it, belong to
    /// this step when its update ran at once, or to the step before when updates are left for
    /// the next forward (a record still waiting for them takes them).
    pub fn host_updates(&mut self, on_host: bool, skipped: bool, ran: Option<f64>) {
        if !on_host {
            self.host.deferred = None;
        } else if self.host.deferred.is_none() && !skipped {
            self.host.deferred = Some(ran.is_none());
        }
        match self.staged.as_mut().filter(|s| s.awaits_update) {
            Some(s) => s.took_update(ran),
            None => self.host.seconds = add(self.host.seconds, ran),
        }
    }

    /// Whether the staged record still waits for its step's host update.
    pub fn awaits_update(&self) -> bool {
        self.staged.as_ref().is_some_and(|s| s.awaits_update)
    }

    /// The staged record's step's host update, finished now.
    pub fn update_in(&mut self, seconds: Option<f64>) {
        if let Some(s) = self.staged.as_mut() {
            s.took_update(seconds);
        }
    }

    /// An attempt failed (out of memory): its peaks go into the windows as a step's would, so the
    /// next record, the epoch and the run's summary take them in, whatever resets the counters
    /// before the retry (a measured first step, a save at the run's end).
    pub fn failed_attempt(&mut self, place: Place) {
        self.windows.fold(place);
    }

    /// Stages a logged step's loss read and holds its record. True: the values are in already
    /// (the CPU), so the record can be collected at once.
    pub fn stage(&mut self, l: Logged) -> Result<bool> {
        let read = self.tally.stage().context("reading the training loss")?;
        let steps = std::mem::take(&mut self.steps_since_mark).max(1);
        let event = StepEvent {
            epoch: l.epoch,
            step: l.step,
            loss: f64::NAN,
            lr: l.lr,
            micro_batch: l.micro_batch,
            samples: l.samples,
            seconds: f64::NAN,
            samples_per_s: f64::NAN,
            memory: std::mem::take(&mut self.windows.line),
            loss_scale: l.loss_scale,
            skipped: l.skipped,
            host_reads: self.reads.take(),
            host_update_seconds: self.host.seconds.take(),
            data_wait_seconds: self.data_wait.take_line(steps),
            language: None,
        };
        let awaits_update = self.host.deferred == Some(true);
        let ready = read.ready() && !crate::fault::late_reads() && !awaits_update;
        self.staged = Some(StagedRecord {
            read,
            event,
            steps,
            seen: l.seen,
            tokens: l.tokens,
            awaits_update,
        });
        Ok(ready)
    }

    /// The staged record with its read in, if one waits. Its time runs from the end of the
    /// previous record's step to the end of this one's, so it takes in the device's work; the
    /// epoch's rate alike.
    pub fn collect(&mut self) -> Result<Option<Collected>> {
        let Some(StagedRecord {
            read,
            mut event,
            steps,
            seen,
            tokens,
            ..
        }) = self.staged.take()
        else {
            return Ok(None);
        };
        let (r, done) = read.collect().context("reading the training loss")?;
        // No step was added since the stage: these are the sums as they stand.
        let sums = (!self.tally.pending()).then_some((r.epoch_loss_sum, r.epoch_correct));
        event.loss = r.step_loss_sum / event.samples as f64;
        let elapsed = done.seconds_since(&self.step_mark);
        self.epoch_step_seconds += elapsed;
        event.seconds = elapsed / steps as f64;
        event.samples_per_s = seen as f64 / self.epoch_step_seconds.max(1e-9);
        if let Some(t) = tokens {
            // The token mean, which the step's gradient is the gradient of.
            event.loss = r.step_loss_sum / t.step.max(1) as f64;
            event.language = Some(StepTokens {
                tokens: t.step,
                tokens_seen: t.run,
                tokens_per_s: t.epoch as f64 / self.epoch_step_seconds.max(1e-9),
                perplexity: perplexity(event.loss),
            });
        }
        self.step_mark = done;
        self.last_loss = Some(event.loss);
        Ok(Some(Collected { event, sums }))
    }

    /// Reads the tally (one read) when a step was added since the last; the caller collects
    /// any staged record first.
    pub fn read_tally(&mut self) -> Result<Option<Read>> {
        if !self.tally.pending() {
            return Ok(None);
        }
        self.tally.read().context("reading the training loss").map(Some)
    }

    /// The last step loss read, for the progress line.
    pub fn last_loss(&self) -> Option<f64> {
        self.last_loss
    }

    /// The epoch's memory so far, for the progress line.
    pub fn epoch_memory(&self) -> u64 {
        let w = &self.windows.epoch;
        w.allocated_bytes.unwrap_or(w.rss_bytes)
    }
}
