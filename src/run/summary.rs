//! The session's end: `summary.json` from the records so far and what only the end knows
//! (data-parallel, every rank's peaks), and the allocator's history when it was recorded.
use anyhow::Result;
use tch::Device;

use super::terminal::{Lost, Notice};
use super::trainer::Trainer;
use crate::memory;
use crate::readback;
use crate::records::{Closing, EpochResult, PrecisionSummary, RankPeak, Status};
use crate::shim;

impl Trainer {
    /// The optimizer steps done so far, the run's position.
    pub fn global_step(&self) -> i64 {
        self.state.global_step
    }

    /// The last completed epoch's result, for the run's last words.
    pub fn last(&self) -> Option<&EpochResult> {
        self.run.last.as_ref()
    }

    /// Data-parallel: every rank's peaks (a collective); empty for a single process.
    pub(super) fn rank_peaks(&self, allocated: Option<u64>, reserved: Option<u64>, rss: u64) -> Result<Vec<RankPeak>> {
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
    fn write_end_snapshot(&mut self) {
        if !self.settings.record_history || !matches!(self.device(), Device::Cuda(_)) || !self.execution.leads() {
            return;
        }
        let written = shim::memory_snapshot().and_then(|bytes| self.recorder.write_end_snapshot(&bytes));
        if let Err(e) = written {
            self.say(Notice::Lost(Lost::EndSnapshot, e));
        }
    }

    /// Every status it is called with is reached by all data-parallel ranks together, so the
    /// ranks' peaks can be gathered here. `unfinished`: the samples and seconds of an epoch the
    /// session stopped in (`--max-steps`).
    pub fn write_summary(&mut self, status: Status, unfinished: Option<(u64, f64)>) -> Result<()> {
        self.flush_record_or_warn();
        let mut memory = memory::sample(self.place());
        memory.include(&self.stager.windows.epoch);
        let (allocated, reserved, rss) = self.recorder.summary_so_far().peaks_with(&memory);
        let ranks = match self.rank_peaks(allocated, reserved, rss) {
            Ok(r) => r,
            Err(e) => {
                self.say(Notice::Lost(Lost::RankPeaks, e));
                Vec::new()
            }
        };
        let scalers = [self.state.scaler, self.arch.as_ref().and_then(|a| a.state.arch_scaler)];
        let closing = Closing {
            status,
            device: self.device_name(),
            epochs_completed: self.state.epoch,
            global_steps: self.state.global_step,
            wall_seconds: self.run.t_start.elapsed().as_secs_f64(),
            unfinished_epoch: unfinished,
            configured: self.recovery.configured(),
            shape: self.shape(),
            memory,
            step_readings: self.stager.windows.readings,
            step_reading_seconds: self.stager.windows.reading_seconds,
            ranks,
            cache: (&self.cache).into(),
            oom: self.recovery.counts().clone(),
            precision: PrecisionSummary {
                mode: self.pipeline.forward.precision.precision,
                loss_scale: self.state.scaler.map(|s| s.scale),
                skipped_steps: scalers.iter().flatten().map(|s| s.skipped_steps).sum(),
                activation_checkpointing: self
                    .recovery
                    .engaged()
                    .contains(crate::policy::levers::Recompute::ABOUT.name),
                optimizer_impl: Some(self.model.opt.implementation().name().into()),
            },
            host_reads: readback::count(),
            training: Some(self.model.training_summary()),
        };
        // After the peaks are read: building the pickle raises the process's RSS.
        self.write_end_snapshot();
        self.recorder.close(closing)
    }
}
