//! The summary, computed from the session's events as they are emitted: the last epoch, the
//! samples and seconds trained, the checkpoints and their memory spikes, and the peaks the
//! epoch records carry. What no event says (the status, the position at the end, the OOM counts
//! recovery keeps, the peaks since the last epoch) comes in with `Closing`.
use super::events::*;
use crate::memory::{max_opt, Cap, MemorySample};
use crate::oom::{BatchShape, OomCounts};

/// The facts only the end of a session knows.
pub struct Closing {
    pub status: Status,
    pub device: String,
    pub epochs_completed: i64,
    pub global_steps: i64,
    pub wall_seconds: f64,
    /// `--max-steps` ends mid-epoch: the samples and seconds of that unfinished epoch.
    pub unfinished_epoch: Option<(u64, f64)>,
    pub configured: BatchShape,
    pub shape: BatchShape,
    /// Memory now, with the peaks since the last epoch record.
    pub memory: MemorySample,
    pub step_readings: u64,
    pub step_reading_seconds: f64,
    pub ranks: Vec<RankPeak>,
    pub cache: CacheCounters,
    pub oom: OomCounts,
    pub precision: PrecisionSummary,
    pub host_reads: u64,
    pub training: Option<super::events::TrainingSummary>,
}

#[derive(Debug, Default)]
pub struct SummarySink {
    job: String,
    cap: Option<Cap>,
    allocator_conf: Option<String>,
    last: Option<EpochResult>,
    samples_trained: u64,
    train_seconds: f64,
    checkpoints: usize,
    max_spike: Option<u64>,
    peak_allocated: Option<u64>,
    peak_reserved: Option<u64>,
    peak_requested: Option<u64>,
    peak_rss: u64,
    peak_host: Option<u64>,
    init: Option<InitLoad>,
}

impl SummarySink {
    pub fn observe(&mut self, event: &Event) {
        match event {
            Event::Start(s) => {
                self.job = s.job.clone();
                self.cap = s.cap.clone();
                self.allocator_conf = s.allocator_conf.clone();
                self.init = s.init.clone();
            }
            Event::Epoch(e) => {
                self.last = Some(e.result.clone());
                self.samples_trained += e.samples;
                self.train_seconds += e.result.seconds;
                self.peaks(&e.memory);
            }
            Event::Checkpoint(c) => {
                self.checkpoints += 1;
                self.max_spike = max_opt(self.max_spike, Some(c.spike_bytes));
            }
            _ => {}
        }
    }

    fn peaks(&mut self, m: &MemorySample) {
        self.peak_allocated = max_opt(self.peak_allocated, m.peak_allocated_bytes);
        self.peak_reserved = max_opt(self.peak_reserved, m.peak_reserved_bytes);
        self.peak_requested = max_opt(self.peak_requested, m.peak_requested_bytes);
        self.peak_rss = self.peak_rss.max(m.peak_rss_bytes);
        self.peak_host = max_opt(self.peak_host, m.peak_host_bytes);
    }

    /// The session's peaks so far, `now` included (what every rank reports for the summary).
    pub fn peaks_with(&self, now: &MemorySample) -> (Option<u64>, Option<u64>, u64) {
        (
            max_opt(self.peak_allocated, now.peak_allocated_bytes),
            max_opt(self.peak_reserved, now.peak_reserved_bytes),
            self.peak_rss.max(now.peak_rss_bytes),
        )
    }

    pub fn summary(&self, c: Closing) -> Summary {
        let (peak_allocated, peak_reserved, peak_rss) = self.peaks_with(&c.memory);
        let (extra_samples, extra_seconds) = c.unfinished_epoch.unwrap_or((0, 0.0));
        let samples_trained = self.samples_trained + extra_samples;
        let train_seconds = self.train_seconds + extra_seconds;
        Summary {
            status: c.status,
            exit_code: c.status.exit_code(),
            job: self.job.clone(),
            device: c.device,
            epochs_completed: c.epochs_completed,
            global_steps: c.global_steps,
            samples_trained,
            wall_seconds: c.wall_seconds,
            train_seconds,
            samples_per_s: samples_trained as f64 / train_seconds.max(1e-9),
            last: self.last.clone(),
            batch: BatchSummary {
                configured_micro_batch: c.configured.micro_batch,
                configured_accumulation_steps: c.configured.accumulation_steps,
                effective_batch: c.configured.effective(),
                final_micro_batch: c.shape.micro_batch,
                final_accumulation_steps: c.shape.accumulation_steps,
            },
            memory: MemorySummary {
                cap: self.cap.clone(),
                allocator_conf: self.allocator_conf.clone(),
                peak_allocated_bytes: peak_allocated,
                peak_reserved_bytes: peak_reserved,
                peak_requested_bytes: max_opt(self.peak_requested, c.memory.peak_requested_bytes),
                peak_rss_bytes: peak_rss,
                peak_host_bytes: max_opt(self.peak_host, c.memory.peak_host_bytes),
                step_readings: c.step_readings,
                step_reading_seconds: c.step_reading_seconds,
                ranks: c.ranks,
            },
            cache: Some(c.cache),
            oom: c.oom,
            checkpoints: CheckpointSummary {
                saved: self.checkpoints,
                max_spike_bytes: self.max_spike,
            },
            precision: c.precision,
            host_reads: c.host_reads,
            training: c.training.map(Box::new),
            init: self.init.clone().map(Box::new),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::samples;
    use super::*;

    fn closing(status: Status, unfinished: Option<(u64, f64)>) -> Closing {
        let shape = BatchShape {
            micro_batch: 4,
            accumulation_steps: 2,
        };
        Closing {
            status,
            device: "cpu".into(),
            epochs_completed: 2,
            global_steps: 3,
            wall_seconds: 9.0,
            unfinished_epoch: unfinished,
            configured: BatchShape {
                micro_batch: 8,
                accumulation_steps: 1,
            },
            shape,
            memory: MemorySample::default(),
            step_readings: 3,
            step_reading_seconds: 0.001,
            ranks: vec![],
            cache: CacheCounters::default(),
            oom: OomCounts::default(),
            precision: PrecisionSummary::default(),
            host_reads: 4,
            training: None,
        }
    }

    #[test]
    fn the_summary_folds_what_the_events_say() {
        let mut sink = SummarySink::default();
        let events = samples::every_kind();
        for e in &events {
            sink.observe(e);
        }
        let epochs: Vec<&EpochEvent> = events
            .iter()
            .filter_map(|e| match e {
                Event::Epoch(e) => Some(e),
                _ => None,
            })
            .collect();
        let s = sink.summary(closing(Status::Completed, None));
        assert_eq!(s.last.as_ref(), Some(&epochs.last().unwrap().result));
        assert_eq!(s.samples_trained, epochs.iter().map(|e| e.samples).sum::<u64>());
        assert_eq!(s.checkpoints.saved, 1);
        assert!(s.checkpoints.max_spike_bytes.is_some());
        assert_eq!(
            s.memory.peak_rss_bytes,
            epochs.iter().map(|e| e.memory.peak_rss_bytes).max().unwrap()
        );
        assert_eq!((s.batch.final_micro_batch, s.batch.effective_batch), (4, 8));
        assert_eq!(s.job, "j");
        // --max-steps: the unfinished epoch counts too.
        let s2 = sink.summary(closing(Status::StepLimit, Some((10, 1.0))));
        assert_eq!(s2.samples_trained, s.samples_trained + 10);
        assert!((s2.train_seconds - s.train_seconds - 1.0).abs() < 1e-12);
    }
}
