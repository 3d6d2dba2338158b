//! `memtrain report RUN_DIR`: the run's records (metrics.jsonl, summary.json, oom/) drawn as
//! one self-contained `report.html` (inline SVG, no scripts) and summed up as text.
//! `memtrain run` calls it at the end of every run, failed and interrupted ones included.
mod charts;
mod page;
mod segments;

use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

use crate::exit::UsageError;
use crate::human::{human_bytes, human_duration};

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
    pub rss: Option<f64>,
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
}

/// Something that happened at a step, marked on the memory timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MarkKind {
    Oom,
    Backoff,
    Recompute,
    CpuFallback,
    Fail,
    GrowBack,
    CacheClear,
    Checkpoint,
    Resume,
}

impl MarkKind {
    pub fn label(self) -> &'static str {
        match self {
            MarkKind::Oom => "OOM",
            MarkKind::Backoff => "backoff",
            MarkKind::Recompute => "recompute",
            MarkKind::CpuFallback => "CPU fallback",
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

/// One data-parallel rank's peaks over the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RankPeaks {
    pub rank: u64,
    pub allocated: Option<u64>,
    pub reserved: Option<u64>,
    pub rss: u64,
}

/// A run directory's records, parsed leniently: a killed run's last line may be cut short,
/// and older runs lack newer fields.
#[derive(Debug, Default)]
pub struct Run {
    pub dir: PathBuf,
    pub job: String,
    pub device: String,
    pub cap_bytes: Option<f64>,
    pub steps: Vec<StepPoint>,
    pub epochs: Vec<EpochPoint>,
    pub marks: Vec<Mark>,
    pub summary: Option<Value>,
    /// oom/report.json and the allocator's segments from oom/snapshot.pickle.
    pub oom_report: Option<Value>,
    pub segments: Option<SegmentMap>,
    /// Why oom/snapshot.pickle could not be drawn, when it could not.
    pub snapshot_error: Option<String>,
    pub unreadable_lines: usize,
}

impl Run {
    pub fn load(dir: &Path) -> Result<Self> {
        let metrics = dir.join("metrics.jsonl");
        let text = fs::read_to_string(&metrics).map_err(|e| {
            UsageError(format!(
                "{} has no readable metrics.jsonl ({e}); pass a run directory that `memtrain run` wrote (runs/<job> by default)",
                dir.display()
            ))
        })?;
        let mut run = Run {
            dir: dir.to_owned(),
            ..Default::default()
        };
        let mut last_step = 0.0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(v) = serde_json::from_str::<Value>(line) else {
                run.unreadable_lines += 1;
                continue;
            };
            let f = |k: &str| v.get(k).and_then(Value::as_f64);
            let mem = |k: &str| v.get("memory").and_then(|m| m.get(k)).and_then(Value::as_f64);
            let step = f("step").unwrap_or(last_step);
            match v["type"].as_str().unwrap_or_default() {
                "start" => {
                    run.job = v["job"].as_str().unwrap_or_default().to_owned();
                    run.device = v["device"].as_str().unwrap_or_default().to_owned();
                    run.cap_bytes = v.get("cap").and_then(|c| c.get("bytes")).and_then(Value::as_f64);
                    if v["resumed"].as_bool() == Some(true) {
                        // A session resumed from an earlier checkpoint (after a crash) redoes the
                        // steps after it: the new records replace the old ones from there.
                        let from = f("step").unwrap_or(last_step);
                        run.steps.retain(|p| p.step <= from);
                        run.epochs.retain(|e| e.step <= from);
                        run.marks.retain(|m| m.step <= from);
                        run.mark(
                            from,
                            MarkKind::Resume,
                            format!("resumed from the checkpoint at step {from}"),
                        );
                        last_step = from;
                    }
                }
                "step" => {
                    last_step = step;
                    run.steps.push(StepPoint {
                        step,
                        epoch: v["epoch"].as_i64().unwrap_or(0),
                        loss: f("loss").unwrap_or(f64::NAN),
                        lr: f("lr").unwrap_or(f64::NAN),
                        samples_per_s: f("samples_per_s").unwrap_or(f64::NAN),
                        allocated: mem("allocated_bytes"),
                        reserved: mem("reserved_bytes"),
                        peak_allocated: mem("peak_allocated_bytes"),
                        peak_reserved: mem("peak_reserved_bytes"),
                        rss: mem("rss_bytes"),
                    });
                }
                "epoch" => {
                    last_step = step;
                    run.epochs.push(EpochPoint {
                        epoch: v["epoch"].as_i64().unwrap_or(0),
                        step,
                        train_loss: f("train_loss").unwrap_or(f64::NAN),
                        train_acc: f("train_acc").unwrap_or(f64::NAN),
                        val_loss: f("val_loss"),
                        val_acc: f("val_acc"),
                        lr: f("lr").unwrap_or(f64::NAN),
                        samples_per_s: f("samples_per_s").unwrap_or(f64::NAN),
                    });
                }
                "oom" => {
                    let before = format!("micro-batch {} x {}", v["micro_batch_before"], v["accumulation_before"]);
                    let d = &v["decision"];
                    let (kind, what) = match d["action"].as_str().unwrap_or_default() {
                        "backoff" => (
                            MarkKind::Backoff,
                            format!(
                                "backoff from {before} to {} x {}",
                                d["to"]["micro_batch"], d["to"]["accumulation_steps"]
                            ),
                        ),
                        "recompute" => (MarkKind::Recompute, format!("recompute at {before}")),
                        "move_to_cpu" => (MarkKind::CpuFallback, "moved to the CPU".into()),
                        "fail" => (MarkKind::Fail, format!("failed at {before}")),
                        _ => (MarkKind::Oom, before),
                    };
                    let error = v["error"].as_str().unwrap_or_default();
                    let phase = v["phase"].as_str().unwrap_or("step");
                    run.mark(
                        step,
                        kind,
                        format!("OOM in {phase}: {what}; {}", crate::shim::first_line(error)),
                    );
                }
                "grow_back" => run.mark(
                    step,
                    MarkKind::GrowBack,
                    format!("micro-batch {} -> {}", v["micro_batch_before"], v["micro_batch"]),
                ),
                "cache_clear" => run.mark(
                    step,
                    MarkKind::CacheClear,
                    format!(
                        "{} clear, {}{}",
                        v["reason"].as_str().unwrap_or("a"),
                        human_duration(f("seconds").unwrap_or(0.0)),
                        f("released_bytes")
                            .map(|b| format!(", released {}", human_bytes(b as u64)))
                            .unwrap_or_default()
                    ),
                ),
                "checkpoint" => run.mark(
                    step,
                    MarkKind::Checkpoint,
                    format!(
                        "{} checkpoint, {} in {}",
                        v["reason"].as_str().unwrap_or_default(),
                        human_bytes(f("bytes").unwrap_or(0.0) as u64),
                        human_duration(f("seconds").unwrap_or(0.0))
                    ),
                ),
                "end" => run.summary = Some(v),
                _ => {}
            }
        }
        // summary.json is the last word when present (metrics.jsonl holds one per session).
        if let Ok(bytes) = fs::read(dir.join("summary.json")) {
            if let Ok(v) = serde_json::from_slice(&bytes) {
                run.summary = Some(v);
            }
        }
        if let Ok(bytes) = fs::read(dir.join("oom/report.json")) {
            run.oom_report = serde_json::from_slice(&bytes).ok();
        }
        let pickle = dir.join("oom/snapshot.pickle");
        if pickle.exists() {
            let error = run
                .oom_report
                .as_ref()
                .and_then(|r| r["error"].as_str())
                .unwrap_or_default()
                .to_owned();
            // A snapshot that cannot be read costs the segment map, not the report.
            match fs::read(&pickle)
                .context("reading it")
                .and_then(|b| SegmentMap::from_pickle(&b, &error))
            {
                Ok(m) => run.segments = Some(m),
                Err(e) => run.snapshot_error = Some(format!("{}: {e:#}", pickle.display())),
            }
        }
        Ok(run)
    }

    fn mark(&mut self, step: f64, kind: MarkKind, detail: String) {
        self.marks.push(Mark { step, kind, detail });
    }

    /// A field of the summary by JSON pointer (`/memory/peak_rss_bytes`).
    pub(crate) fn summary_at(&self, pointer: &str) -> Option<&Value> {
        self.summary.as_ref()?.pointer(pointer)
    }

    fn summary_f64(&self, pointer: &str) -> Option<f64> {
        self.summary_at(pointer)?.as_f64()
    }

    pub(crate) fn status(&self) -> &str {
        self.summary
            .as_ref()
            .and_then(|s| s["status"].as_str())
            .unwrap_or("no summary (the run was killed or is still running)")
    }

    /// The largest reading of one memory series over the run's step lines.
    fn step_max(&self, f: impl Fn(&StepPoint) -> Option<f64>) -> Option<f64> {
        self.steps.iter().filter_map(f).reduce(f64::max)
    }

    pub fn peak_allocated(&self) -> Option<f64> {
        let from_steps = self.step_max(|p| p.peak_allocated.or(p.allocated));
        let from_summary = self.summary_f64("/memory/peak_allocated_bytes");
        from_steps.into_iter().chain(from_summary).reduce(f64::max)
    }

    pub fn peak_reserved(&self) -> Option<f64> {
        let from_steps = self.step_max(|p| p.peak_reserved.or(p.reserved));
        let from_summary = self.summary_f64("/memory/peak_reserved_bytes");
        from_steps.into_iter().chain(from_summary).reduce(f64::max)
    }

    /// Data-parallel runs: each rank's peaks over the run (summary.json's `memory.ranks`).
    pub(crate) fn rank_peaks(&self) -> Vec<RankPeaks> {
        let Some(list) = self.summary_at("/memory/ranks").and_then(|v| v.as_array()) else {
            return Vec::new();
        };
        list.iter()
            .map(|r| RankPeaks {
                rank: r["rank"].as_u64().unwrap_or_default(),
                allocated: r["peak_allocated_bytes"].as_u64(),
                reserved: r["peak_reserved_bytes"].as_u64(),
                rss: r["peak_rss_bytes"].as_u64().unwrap_or_default(),
            })
            .collect()
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
        if let Some(r) = self.summary_f64("/memory/peak_rss_bytes") {
            mem += &format!(", {} RSS", human_bytes(r as u64));
        }
        if let Some(c) = self.cap_bytes {
            mem += &format!(" (cap {})", human_bytes(c as u64));
        }
        line(mem);
        for r in self.rank_peaks() {
            line(format!(
                "  rank {}: {} allocated, {} RSS",
                r.rank,
                r.allocated.map(human_bytes).unwrap_or_else(|| "-".into()),
                human_bytes(r.rss)
            ));
        }
        let clears = self.summary_f64("/cache/clears").unwrap_or(0.0);
        let clear_s = self.summary_f64("/cache/clear_seconds").unwrap_or(0.0);
        let syncs = self.summary_f64("/cache/syncs").unwrap_or(0.0);
        let sync_s = self.summary_f64("/cache/sync_seconds").unwrap_or(0.0);
        line(format!(
            "cache clearing: {clears} clears took {}; {syncs} synchronisations took {}",
            human_duration(clear_s),
            human_duration(sync_s)
        ));
        let ooms: Vec<&Mark> = self
            .marks
            .iter()
            .filter(|m| {
                matches!(
                    m.kind,
                    MarkKind::Oom | MarkKind::Backoff | MarkKind::Recompute | MarkKind::CpuFallback | MarkKind::Fail
                )
            })
            .collect();
        line(format!("OOM events: {}", ooms.len()));
        for m in ooms {
            line(format!("  step {}: {}", m.step, m.detail));
        }
        for m in self.marks.iter().filter(|m| m.kind == MarkKind::GrowBack) {
            line(format!("  step {}: grew back, {}", m.step, m.detail));
        }
        let rate = self.summary_f64("/samples_per_s");
        let wall = self.summary_f64("/wall_seconds");
        line(format!(
            "throughput: {} samples/s over {} steps{}",
            rate.map(|r| format!("{r:.1}")).unwrap_or_else(|| "-".into()),
            self.summary_f64("/global_steps")
                .or(self.steps.last().map(|s| s.step))
                .unwrap_or(0.0),
            wall.map(|w| format!(", wall {}", human_duration(w)))
                .unwrap_or_default()
        ));
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_steps_epochs_and_marks_and_skips_a_cut_line() {
        let dir = tempfile::tempdir().unwrap();
        let lines = [
            r#"{"type":"start","job":"j","device":"cpu","resumed":false,"cap":{"kind":"cpu_tensor_bytes","bytes":1000}}"#,
            r#"{"type":"step","epoch":1,"step":1,"loss":2.0,"lr":0.1,"samples_per_s":10,"memory":{"allocated_bytes":100,"peak_allocated_bytes":400,"rss_bytes":9}}"#,
            r#"{"type":"oom","epoch":1,"step":1,"phase":"training step","error":"CPU cap\nmore","micro_batch_before":8,"accumulation_before":1,"decision":{"action":"backoff","to":{"micro_batch":4,"accumulation_steps":2}}}"#,
            r#"{"type":"step","epoch":1,"step":2,"loss":1.5,"lr":0.1,"samples_per_s":12,"memory":{"allocated_bytes":120,"peak_allocated_bytes":300,"rss_bytes":9}}"#,
            r#"{"type":"epoch","epoch":1,"step":2,"train_loss":1.7,"train_acc":0.5,"val_loss":1.6,"val_acc":0.6,"lr":0.1}"#,
            r#"{"type":"cache_clear","step":2,"reason":"every","seconds":0.5,"released_bytes":2048}"#,
            r#"{"type":"step","epoch":2,"st"#,
        ];
        fs::write(dir.path().join("metrics.jsonl"), lines.join("\n")).unwrap();
        let run = Run::load(dir.path()).unwrap();
        assert_eq!(run.steps.len(), 2);
        assert_eq!(run.steps[1].loss, 1.5);
        assert_eq!(run.epochs[0].step, 2.0);
        assert_eq!(run.epochs[0].val_acc, Some(0.6));
        assert_eq!(run.unreadable_lines, 1);
        assert_eq!(run.peak_allocated(), Some(400.0));
        assert_eq!(run.cap_bytes, Some(1000.0));
        let kinds: Vec<MarkKind> = run.marks.iter().map(|m| m.kind).collect();
        assert_eq!(kinds, [MarkKind::Backoff, MarkKind::CacheClear]);
        assert!(
            run.marks[0].detail.contains("backoff from micro-batch 8 x 1 to 4 x 2"),
            "{:?}",
            run.marks[0]
        );
        let text = run.text_summary();
        assert!(text.contains("OOM events: 1"), "{text}");
        assert!(text.contains("peak memory: 400 B allocated"), "{text}");
        assert!(text.contains("1 unreadable line"), "{text}");
    }

    #[test]
    fn a_session_resumed_from_an_earlier_checkpoint_replaces_the_steps_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let step = |s: i64, loss: f64| {
            format!(r#"{{"type":"step","epoch":1,"step":{s},"loss":{loss},"lr":0.1,"samples_per_s":1,"memory":{{}}}}"#)
        };
        let mut lines = vec![r#"{"type":"start","job":"j","device":"cpu","resumed":false,"step":0}"#.to_owned()];
        lines.extend((1..=5).map(|s| step(s, 1.0)));
        lines.push(r#"{"type":"start","job":"j","device":"cpu","resumed":true,"step":3}"#.to_owned());
        lines.extend((4..=6).map(|s| step(s, 2.0)));
        fs::write(dir.path().join("metrics.jsonl"), lines.join("\n")).unwrap();
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
