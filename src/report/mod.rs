//! `memtrain report RUN_DIR`: the run's records (metrics.jsonl, summary.json, oom/) drawn as
//! one self-contained `report.html` (inline SVG, no scripts) and summed up as text.
//! `memtrain run` calls it at the end of every run, failed and interrupted ones included.
mod charts;
mod page;
mod segments;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::human::{human_bytes, human_duration};
use crate::memory::ClearReason;
use crate::oom::Decision;
use crate::policy::levers::{by_action, lever, Described};
use crate::records::{Event, MicroBatchOf, OomEvent, RankPeak, Summary};

pub use segments::{Block, BlockState, Segment, SegmentMap};

/// What `write` produced.
pub struct Written {
    pub html: PathBuf,
    pub text: String,
}

/// Reads the run directory's records, writes `report.html` into it, and returns the text summary.
pub fn write(run_dir: &Path) -> Result<Written> {
    let run = Run::load(run_dir)?;
    let html = page::render(&run)?;
    let path = run_dir.join("report.html");
    crate::atomic::write_atomic(&path, html.as_bytes())?;
    Ok(Written {
        html: path,
        text: run.text_summary(),
    })
}

/// One step line of metrics.jsonl.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPoint {
    pub step: f64,
    pub epoch: i64,
    pub loss: f64,
    pub lr: f64,
    pub samples_per_s: f64,
    pub allocated: Option<f64>,
    pub reserved: Option<f64>,
    pub peak_allocated: Option<f64>,
    pub peak_reserved: Option<f64>,
    /// Host tensor bytes (what the placement levers moved off the device).
    pub host: Option<f64>,
    pub peak_host: Option<f64>,
    pub rss: f64,
}

/// One epoch line.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EpochPoint {
    pub epoch: i64,
    /// The global step the epoch ended at.
    pub step: f64,
    pub train_loss: f64,
    pub train_acc: f64,
    pub val_loss: Option<f64>,
    pub val_acc: Option<f64>,
    pub lr: f64,
    pub samples_per_s: f64,
    /// The epoch's training time, and the part of it the steps waited for their batches.
    pub seconds: f64,
    pub data_wait_seconds: f64,
}

/// Something that happened at a step, marked on the memory timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MarkKind {
    /// An OOM that engaged this lever (by name).
    Lever(&'static str),
    /// An OOM in validation: its own micro-batch halved, or the pass skipped.
    Validation,
    Fail,
    GrowBack,
    CacheClear,
    Checkpoint,
    Resume,
}

impl MarkKind {
    pub fn label(self) -> &'static str {
        match self {
            MarkKind::Lever(name) => lever(name).map_or(name, |l| l.label()),
            MarkKind::Validation => "OOM in validation",
            MarkKind::Fail => "OOM, failed",
            MarkKind::GrowBack => "grow-back",
            MarkKind::CacheClear => "cache clear",
            MarkKind::Checkpoint => "checkpoint",
            MarkKind::Resume => "resume",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    pub step: f64,
    pub kind: MarkKind,
    pub detail: String,
}

/// A run directory's records as the report draws them. The records are read leniently (a
/// killed run's last line may be cut short); oom/ may be missing or unreadable.
#[derive(Debug, Default)]
pub struct Run {
    pub dir: PathBuf,
    pub job: String,
    pub device: String,
    pub cap_bytes: Option<f64>,
    pub steps: Vec<StepPoint>,
    pub epochs: Vec<EpochPoint>,
    pub marks: Vec<Mark>,
    pub summary: Option<Summary>,
    /// The allocator's segments from oom/snapshot.pickle.
    pub segments: Option<SegmentMap>,
    /// Why oom/snapshot.pickle could not be drawn, when it could not.
    pub snapshot_error: Option<String>,
    pub unreadable_lines: usize,
}

impl Run {
    pub fn load(dir: &Path) -> Result<Self> {
        let records = crate::records::read(dir)?;
        if records.events.is_empty() && records.summary.is_none() {
            return Err(crate::exit::UsageError(format!(
                "{}/metrics.jsonl holds no records{}: the run stopped before it wrote any, so there is nothing to report",
                dir.display(),
                match records.unreadable_lines {
                    0 => String::new(),
                    n => format!(" ({n} unreadable line(s))"),
                }
            ))
            .into());
        }
        let mut run = Run {
            dir: dir.to_owned(),
            unreadable_lines: records.unreadable_lines,
            ..Default::default()
        };
        for event in &records.events {
            run.add(event);
        }
        run.summary = records.summary;
        let pickle = dir.join("oom/snapshot.pickle");
        if pickle.exists() {
            // A snapshot that cannot be read costs the segment map, not the report.
            match fs::read(&pickle)
                .context("reading it")
                .and_then(|b| SegmentMap::from_pickle(&b, &oom_error(dir)))
            {
                Ok(m) => run.segments = Some(m),
                Err(e) => run.snapshot_error = Some(format!("{}: {e:#}", pickle.display())),
            }
        }
        Ok(run)
    }

    fn add(&mut self, event: &Event) {
        match event {
            Event::Start(s) => {
                self.job = s.job.clone();
                self.device = s.device.clone();
                self.cap_bytes = s.cap.as_ref().map(|c| c.bytes as f64);
                if s.resumed {
                    let from = s.step as f64;
                    self.mark(
                        from,
                        MarkKind::Resume,
                        format!("resumed from the checkpoint at step {from}"),
                    );
                }
            }
            Event::Step(s) => {
                let bytes = |b: Option<u64>| b.map(|b| b as f64);
                self.steps.push(StepPoint {
                    step: s.step as f64,
                    epoch: s.epoch,
                    loss: s.loss,
                    lr: s.lr,
                    samples_per_s: s.samples_per_s,
                    allocated: bytes(s.memory.allocated_bytes),
                    reserved: bytes(s.memory.reserved_bytes),
                    peak_allocated: bytes(s.memory.peak_allocated_bytes),
                    peak_reserved: bytes(s.memory.peak_reserved_bytes),
                    host: bytes(s.memory.host_bytes),
                    peak_host: bytes(s.memory.peak_host_bytes),
                    rss: s.memory.rss_bytes as f64,
                });
            }
            Event::Epoch(e) => self.epochs.push(EpochPoint {
                epoch: e.epoch,
                step: e.step as f64,
                train_loss: e.train_loss,
                train_acc: e.train_acc,
                val_loss: e.val_loss,
                val_acc: e.val_acc,
                lr: e.lr,
                samples_per_s: e.samples_per_s,
                seconds: e.seconds,
                data_wait_seconds: e.data_wait_seconds,
            }),
            Event::Oom(o) => {
                let (kind, what) = decision_mark(o);
                self.mark(
                    o.step as f64,
                    kind,
                    format!("OOM in {}: {what}; {}", o.phase, crate::shim::first_line(&o.error)),
                );
            }
            Event::GrowBack(g) => self.mark(
                g.step as f64,
                MarkKind::GrowBack,
                format!(
                    "{}micro-batch {} -> {}",
                    match g.micro_batch_of {
                        MicroBatchOf::Training => "",
                        MicroBatchOf::Validation => "validation ",
                    },
                    g.micro_batch_before,
                    g.micro_batch
                ),
            ),
            Event::CacheClear(c) => self.mark(
                c.step as f64,
                MarkKind::CacheClear,
                format!(
                    "{} clear, {}{}",
                    clear_reason_name(c.cleared.reason),
                    human_duration(c.cleared.seconds),
                    c.cleared
                        .released_bytes
                        .map(|b| format!(", released {}", human_bytes(b)))
                        .unwrap_or_default()
                ),
            ),
            Event::Checkpoint(c) => self.mark(
                c.step as f64,
                MarkKind::Checkpoint,
                format!(
                    "{} checkpoint, {} in {}",
                    c.reason,
                    human_bytes(c.bytes),
                    human_duration(c.seconds)
                ),
            ),
            Event::Preflight(_) | Event::Prefetch(_) | Event::Graph(_) | Event::End(_) => {}
        }
    }

    fn mark(&mut self, step: f64, kind: MarkKind, detail: String) {
        self.marks.push(Mark { step, kind, detail });
    }

    pub(crate) fn status(&self) -> &str {
        self.summary
            .as_ref()
            .map(|s| s.status.name())
            .unwrap_or("no summary (the run was killed or is still running)")
    }

    /// The largest reading of one memory series over the run's step lines.
    fn step_max(&self, f: impl Fn(&StepPoint) -> Option<f64>) -> Option<f64> {
        self.steps.iter().filter_map(f).reduce(f64::max)
    }

    /// A summary figure, where there is a summary.
    fn summary_f64(&self, f: impl Fn(&Summary) -> Option<f64>) -> Option<f64> {
        self.summary.as_ref().and_then(f)
    }

    pub fn peak_allocated(&self) -> Option<f64> {
        let from_steps = self.step_max(|p| p.peak_allocated.or(p.allocated));
        let from_summary = self.summary_f64(|s| s.memory.peak_allocated_bytes.map(|b| b as f64));
        from_steps.into_iter().chain(from_summary).reduce(f64::max)
    }

    pub fn peak_reserved(&self) -> Option<f64> {
        let from_steps = self.step_max(|p| p.peak_reserved.or(p.reserved));
        let from_summary = self.summary_f64(|s| s.memory.peak_reserved_bytes.map(|b| b as f64));
        from_steps.into_iter().chain(from_summary).reduce(f64::max)
    }

    /// Data-parallel runs: each rank's peaks over the run (summary.json's `memory.ranks`).
    pub(crate) fn rank_peaks(&self) -> &[RankPeak] {
        self.summary.as_ref().map_or(&[], |s| &s.memory.ranks)
    }

    /// The optimizer steps done: the summary's count, else the last step line's.
    pub(crate) fn global_steps(&self) -> f64 {
        self.summary_f64(|s| Some(s.global_steps as f64))
            .or(self.steps.last().map(|s| s.step))
            .unwrap_or(0.0)
    }

    /// The steps' wait for their batches over every epoch, as "2.1 s of 40.0 s training (5.2%)";
    /// None before the first epoch's record.
    pub fn data_wait(&self) -> Option<String> {
        if self.epochs.is_empty() {
            return None;
        }
        let wait: f64 = self.epochs.iter().map(|e| e.data_wait_seconds).sum();
        let train: f64 = self.epochs.iter().map(|e| e.seconds).sum();
        Some(format!(
            "{} of {} training ({:.1}%)",
            human_duration(wait),
            human_duration(train),
            100.0 * wait / train.max(1e-9)
        ))
    }

    /// The lines `memtrain report` prints: peak memory, cache-clear cost, OOMs and what was
    /// done about them, throughput.
    pub fn text_summary(&self) -> String {
        let mut out = String::new();
        let mut line = |s: String| {
            out.push_str(&s);
            out.push('\n');
        };
        line(format!(
            "run {}: job {}, {}, status {}",
            self.dir.display(),
            self.job,
            self.device,
            self.status()
        ));
        let bytes = |v: Option<f64>| v.map(|b| human_bytes(b as u64)).unwrap_or_else(|| "-".into());
        let mut mem = format!("peak memory: {} allocated", bytes(self.peak_allocated()));
        if let Some(r) = self.peak_reserved() {
            mem += &format!(", {} reserved", human_bytes(r as u64));
        }
        if let Some(s) = &self.summary {
            if let Some(h) = s.memory.peak_host_bytes {
                mem += &format!(", {} on the host", human_bytes(h));
            }
            mem += &format!(", {} RSS", human_bytes(s.memory.peak_rss_bytes));
        }
        if let Some(c) = self.cap_bytes {
            mem += &format!(" (cap {})", human_bytes(c as u64));
        }
        line(mem);
        for r in self.rank_peaks() {
            line(format!(
                "  rank {}: {} allocated, {} RSS",
                r.rank,
                r.peak_allocated_bytes.map(human_bytes).unwrap_or_else(|| "-".into()),
                human_bytes(r.peak_rss_bytes)
            ));
        }
        let cache = self.summary.as_ref().and_then(|s| s.cache).unwrap_or_default();
        line(format!(
            "cache clearing: {} clears took {}; {} synchronisations took {}",
            cache.clears,
            human_duration(cache.clear_seconds),
            cache.syncs,
            human_duration(cache.sync_seconds)
        ));
        let ooms: Vec<&Mark> = self
            .marks
            .iter()
            .filter(|m| matches!(m.kind, MarkKind::Lever(_) | MarkKind::Validation | MarkKind::Fail))
            .collect();
        line(format!("OOM events: {}", ooms.len()));
        for m in ooms {
            line(format!("  step {}: {}", m.step, m.detail));
        }
        for m in self.marks.iter().filter(|m| m.kind == MarkKind::GrowBack) {
            line(format!("  step {}: grew back, {}", m.step, m.detail));
        }
        let rate = self.summary_f64(|s| Some(s.samples_per_s));
        let wall = self.summary_f64(|s| Some(s.wall_seconds));
        line(format!(
            "throughput: {} samples/s over {} steps{}",
            rate.map(|r| format!("{r:.1}")).unwrap_or_else(|| "-".into()),
            self.global_steps(),
            wall.map(|w| format!(", wall {}", human_duration(w)))
                .unwrap_or_default()
        ));
        if let Some(w) = self.data_wait() {
            line(format!("data wait: {w}"));
        }
        if let Some(t) = self.summary.as_ref().and_then(|s| s.training.as_ref()) {
            let plain = t.frozen_parameters == 0
                && t.groups.len() == 1
                && t.groups[0].lr_scale == 1.0
                && t.groups[0].start_step == 0;
            if !plain {
                t.lines().into_iter().for_each(&mut line);
            }
        }
        if let Some(s) = &self.segments {
            line(format!(
                "allocator at the OOM: {} segments, {} reserved, {} allocated, largest free block {}{}",
                s.segments.len(),
                human_bytes(s.reserved()),
                human_bytes(s.allocated()),
                human_bytes(s.largest_free()),
                s.request
                    .map(|r| format!(" for a request of {}", human_bytes(r)))
                    .unwrap_or_default()
            ));
        }
        if let Some(e) = &self.snapshot_error {
            line(format!("note: the allocator snapshot could not be drawn: {e}"));
        }
        if self.unreadable_lines > 0 {
            line(format!(
                "note: {} unreadable line(s) in metrics.jsonl were skipped",
                self.unreadable_lines
            ));
        }
        out
    }
}

/// The memory timeline's mark for an OOM and what was done about it.
fn decision_mark(o: &OomEvent) -> (MarkKind, String) {
    let before = format!("micro-batch {} x {}", o.micro_batch_before, o.accumulation_before);
    match o.decision.action.as_str() {
        Decision::EVAL_BACKOFF => {
            let to = o.decision.to.map_or(0, |t| t.micro_batch);
            return (
                MarkKind::Validation,
                format!("validation micro-batch {} -> {to}", o.micro_batch_before),
            );
        }
        Decision::SKIP_VALIDATION => {
            return (
                MarkKind::Validation,
                format!("validation skipped at micro-batch {}", o.micro_batch_before),
            );
        }
        _ => {}
    }
    match (by_action(&o.decision.action), o.decision.to) {
        (Some(l), Some(to)) => (
            MarkKind::Lever(l.name()),
            format!(
                "{} from {before} to {} x {}",
                l.label(),
                to.micro_batch,
                to.accumulation_steps
            ),
        ),
        (Some(l), None) => (MarkKind::Lever(l.name()), format!("{} at {before}", l.label())),
        (None, _) if o.decision.action == crate::oom::Decision::SKIP => {
            (MarkKind::Fail, format!("skipped at {before}; the run went on"))
        }
        (None, _) if o.decision.action == crate::oom::Decision::EAGER => (
            MarkKind::Fail,
            format!("CUDA graph capture at {before}; the step ran eager"),
        ),
        (None, _) => (MarkKind::Fail, format!("failed at {before}")),
    }
}

/// A cache clear's reason as its record spells it.
fn clear_reason_name(r: ClearReason) -> &'static str {
    match r {
        ClearReason::Every => "every",
        ClearReason::Auto => "auto",
        ClearReason::EpochEnd => "epoch_end",
        ClearReason::Checkpoint => "checkpoint",
        ClearReason::Oom => "oom",
    }
}

/// The error oom/report.json names: the segment map marks the request that failed with it.
fn oom_error(dir: &Path) -> String {
    crate::records::read_oom_report(dir)
        .map(|r| r.error)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::samples::{self, lines};

    #[test]
    fn reads_steps_epochs_and_marks_and_skips_a_cut_line() {
        let dir = tempfile::tempdir().unwrap();
        let events = [
            Event::Start(samples::start(0, false, Some(1000))),
            Event::Step(samples::step(1, 2.0, 100, 400)),
            Event::Oom(samples::oom(1, samples::backoff())),
            Event::Step(samples::step(2, 1.5, 120, 300)),
            Event::Epoch(samples::epoch(2, 0.6)),
            Event::CacheClear(samples::cache_clear(2)),
        ];
        let text = lines(&events) + r#"{"type":"step","epoch":2,"st"#;
        fs::write(dir.path().join("metrics.jsonl"), text).unwrap();
        let run = Run::load(dir.path()).unwrap();
        assert_eq!(run.steps.len(), 2);
        assert_eq!(run.steps[1].loss, 1.5);
        assert_eq!(run.epochs[0].step, 2.0);
        assert_eq!(run.epochs[0].val_acc, Some(0.6));
        assert_eq!(run.unreadable_lines, 1);
        assert_eq!(run.peak_allocated(), Some(400.0));
        assert_eq!(run.cap_bytes, Some(1000.0));
        let kinds: Vec<MarkKind> = run.marks.iter().map(|m| m.kind).collect();
        assert_eq!(kinds, [MarkKind::Lever("backoff"), MarkKind::CacheClear]);
        assert_eq!(
            run.marks[0].detail,
            "OOM in backward: backoff from micro-batch 8 x 1 to 4 x 2; CPU cap"
        );
        assert_eq!(run.marks[1].detail, "every clear, 500 ms, released 2.00 KiB");
        let text = run.text_summary();
        assert!(text.contains("OOM events: 1"), "{text}");
        assert!(text.contains("peak memory: 400 B allocated"), "{text}");
        assert!(text.contains("1 unreadable line"), "{text}");
    }

    #[test]
    fn every_decision_and_event_has_its_mark() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("metrics.jsonl"), lines(&samples::every_kind())).unwrap();
        let run = Run::load(dir.path()).unwrap();
        let marks: Vec<(f64, MarkKind, &str)> = run.marks.iter().map(|m| (m.step, m.kind, m.detail.as_str())).collect();
        assert_eq!(
            marks,
            [
                (
                    1.0,
                    MarkKind::Lever("recompute"),
                    "OOM in backward: recompute at micro-batch 8 x 1; CPU cap"
                ),
                (
                    1.0,
                    MarkKind::Lever("backoff"),
                    "OOM in backward: backoff from micro-batch 8 x 1 to 4 x 2; CPU cap"
                ),
                (
                    1.0,
                    MarkKind::Lever("cpu"),
                    "OOM in backward: CPU fallback at micro-batch 8 x 1; CPU cap"
                ),
                (
                    1.0,
                    MarkKind::Validation,
                    "OOM in validation: validation micro-batch 8 -> 4; CPU cap"
                ),
                (2.0, MarkKind::CacheClear, "every clear, 500 ms, released 2.00 KiB"),
                (2.0, MarkKind::GrowBack, "micro-batch 4 -> 8"),
                (2.0, MarkKind::GrowBack, "validation micro-batch 16 -> 32"),
                (2.0, MarkKind::Checkpoint, "epoch checkpoint, 4.00 KiB in 125 ms"),
                (
                    3.0,
                    MarkKind::Fail,
                    "OOM in backward: failed at micro-batch 8 x 1; CPU cap"
                ),
            ]
        );
        let text = run.text_summary();
        for line in [
            "status oom",
            "cache clearing: 1 clears took 500 ms; 2 synchronisations took 250 ms",
            "OOM events: 5",
            "  step 1: OOM in validation: validation micro-batch 8 -> 4; CPU cap",
            "  step 2: grew back, micro-batch 4 -> 8",
            "  step 2: grew back, validation micro-batch 16 -> 32",
            "  rank 0: 400 B allocated, 10 B RSS",
            "throughput: 24.0 samples/s over 3 steps, wall 3.0 s",
        ] {
            assert!(text.contains(line), "{line}\n{text}");
        }
    }

    #[test]
    fn clear_reasons_are_named_as_their_records_spell_them() {
        use ClearReason::*;
        for r in [Every, Auto, EpochEnd, Checkpoint, Oom] {
            assert_eq!(serde_json::to_value(r).unwrap(), clear_reason_name(r));
        }
    }

    #[test]
    fn a_session_resumed_from_an_earlier_checkpoint_replaces_the_steps_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let step = |s: i64, loss: f64| Event::Step(samples::step(s, loss, 1, 1));
        let mut events = vec![Event::Start(samples::start(0, false, None))];
        events.extend((1..=5).map(|s| step(s, 1.0)));
        events.push(Event::Start(samples::start(3, true, None)));
        events.extend((4..=6).map(|s| step(s, 2.0)));
        fs::write(dir.path().join("metrics.jsonl"), lines(&events)).unwrap();
        let run = Run::load(dir.path()).unwrap();
        let steps: Vec<(f64, f64)> = run.steps.iter().map(|p| (p.step, p.loss)).collect();
        assert_eq!(
            steps,
            [(1.0, 1.0), (2.0, 1.0), (3.0, 1.0), (4.0, 2.0), (5.0, 2.0), (6.0, 2.0)]
        );
        assert_eq!(run.marks.len(), 1);
        assert_eq!((run.marks[0].kind, run.marks[0].step), (MarkKind::Resume, 3.0));
    }

    #[test]
    fn a_directory_without_metrics_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = Run::load(dir.path()).unwrap_err();
        assert_eq!(crate::exit::code_for(&e), crate::exit::USAGE);
        assert!(e.to_string().contains("metrics.jsonl"));
    }
}
