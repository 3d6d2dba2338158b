//! The run's records. The training loop emits typed events; the one `Recorder` turns them into
//! `metrics.jsonl` (one JSON object per line, flushed as it happens, so a killed run keeps
//! everything up to its last line), `summary.json`, `genotype.json` and `oom/`. Every whole-file
//! write goes through `atomic`.
mod clock;
mod events;
mod read;
#[cfg(test)]
pub(crate) mod samples;
mod summary;
mod tensorboard;

use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde_json::Value;

pub use crate::atomic::{write_atomic, write_json};
pub use clock::unix_time;
pub use events::*;
pub use read::{read, read_oom_report, RunRecords};
pub use summary::{Closing, SummarySink};
pub use tensorboard::EventWriter;

pub struct Recorder {
    run_dir: PathBuf,
    metrics: BufWriter<File>,
    spec_toml: String,
    tensorboard: Option<EventWriter>,
    summary: SummarySink,
}

/// A run killed in the middle of a write leaves metrics.jsonl without its last newline: the
/// next session's first record starts on a line of its own, so only the cut line is lost.
fn end_the_cut_line(f: &mut File) -> std::io::Result<()> {
    use std::io::{Read, Seek, SeekFrom, Write};
    if f.metadata()?.len() == 0 {
        return Ok(());
    }
    f.seek(SeekFrom::End(-1))?;
    let mut last = [0u8];
    f.read_exact(&mut last)?;
    if last[0] != b'\n' {
        f.write_all(b"\n")?;
    }
    Ok(())
}

impl Recorder {
    /// Appends to the run directory's metrics.jsonl (a resumed run continues the same file);
    /// with `tensorboard`, also writes a new event file under `tensorboard/`.
    pub fn open(run_dir: &Path, spec_toml: &str, tensorboard: bool) -> Result<Self> {
        let path = run_dir.join("metrics.jsonl");
        let mut f = OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .open(&path)
            .with_context(|| format!("opening {}", path.display()))?;
        end_the_cut_line(&mut f).with_context(|| format!("appending to {}", path.display()))?;
        let tensorboard = match tensorboard {
            true => Some(EventWriter::create(&run_dir.join("tensorboard"))?),
            false => None,
        };
        Ok(Recorder {
            run_dir: run_dir.to_owned(),
            metrics: BufWriter::new(f),
            spec_toml: spec_toml.to_owned(),
            tensorboard,
            summary: SummarySink::default(),
        })
    }

    /// `snapshot.pickle`: the caching allocator's state at the session's end, with the history
    /// recorded since `memory.record_history` started it (PyTorch's memory_viz page reads it).
    pub fn write_end_snapshot(&self, bytes: &[u8]) -> Result<()> {
        write_atomic(&self.run_dir.join("snapshot.pickle"), bytes)
    }

    /// What the summary would say of the session so far (its peaks, for the ranks' gathering).
    pub fn summary_so_far(&self) -> &SummarySink {
        &self.summary
    }

    /// Ends the session: `summary.json` and the `end` record, from the session's events and
    /// what only the end knows.
    pub fn close(&mut self, closing: Closing) -> Result<()> {
        let s = self.summary.summary(closing);
        self.emit(&Event::End(s))
    }

    pub fn emit(&mut self, event: &Event) -> Result<()> {
        self.summary.observe(event);
        match event {
            Event::Epoch(e) => {
                if let Some(g) = &e.genotype {
                    write_json(
                        &self.run_dir.join("genotype.json"),
                        &serde_json::json!({"epoch": e.epoch, "genotype": g}),
                    )?;
                }
            }
            Event::Oom(o) => {
                if let Some(report) = &o.report {
                    if let Err(e) = self.write_oom_report(o, report) {
                        tracing::warn!("could not write the OOM report: {e:#}");
                    }
                }
            }
            Event::End(s) => write_json(&self.run_dir.join("summary.json"), s)?,
            _ => {}
        }
        if let Some(tb) = &mut self.tensorboard {
            if let Some((step, values)) = scalars(event) {
                tb.scalars(step, unix_time(), &values)?;
            }
        }
        self.line(event)
    }

    fn line(&mut self, event: &Event) -> Result<()> {
        let mut v = serde_json::to_value(event)?;
        if let Value::Object(o) = &mut v {
            o.insert("time".into(), unix_time().into());
        }
        serde_json::to_writer(&mut self.metrics, &v)?;
        self.metrics.write_all(b"\n")?;
        self.metrics.flush().context("writing metrics.jsonl")
    }

    /// `oom/` at the first OOM of a run: what failed, where, with which allocator state.
    fn write_oom_report(&self, o: &OomEvent, r: &OomReport) -> Result<()> {
        let dir = self.run_dir.join("oom");
        fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let snapshot = match &r.snapshot {
            Some(bytes) => {
                write_atomic(&dir.join("snapshot.pickle"), bytes)?;
                Some("snapshot.pickle")
            }
            None => None,
        };
        let file = OomReportFile {
            phase: o.phase.clone(),
            epoch: o.epoch,
            step: o.step,
            device: o.device.clone(),
            failing_batch_shape: o.batch_shape.clone(),
            micro_batch: o.micro_batch_before,
            accumulation_steps: o.accumulation_before,
            error: o.error.clone(),
            allocator_stats: r.allocator_stats.clone(),
            memory: r.memory.clone(),
            cap: r.cap.clone(),
            allocator_conf: r.allocator_conf.clone(),
            snapshot: snapshot.map(str::to_owned),
            record_history: r.record_history,
        };
        // Through a JSON value, whose keys are sorted: the file keeps the layout it always had.
        write_json(&dir.join("report.json"), &serde_json::to_value(&file)?)?;
        write_atomic(&dir.join("spec.toml"), self.spec_toml.as_bytes())
    }
}

type Scalar = (&'static str, Option<f64>);

/// The TensorBoard scalars of an event: per step and per epoch, at the global step. `None`
/// values are absent (no reserved memory on the CPU); a NaN loss is written as NaN.
fn scalars(event: &Event) -> Option<(i64, Vec<Scalar>)> {
    let bytes = |v: Option<u64>| v.map(|b| b as f64);
    match event {
        Event::Step(s) => Some((
            s.step,
            vec![
                ("train/loss", Some(s.loss)),
                ("train/lr", Some(s.lr)),
                ("train/samples_per_s", Some(s.samples_per_s)),
                ("train/micro_batch", Some(s.micro_batch as f64)),
                ("train/loss_scale", s.loss_scale),
                ("memory/allocated_bytes", bytes(s.memory.allocated_bytes)),
                ("memory/peak_allocated_bytes", bytes(s.memory.peak_allocated_bytes)),
                ("memory/reserved_bytes", bytes(s.memory.reserved_bytes)),
                ("memory/peak_reserved_bytes", bytes(s.memory.peak_reserved_bytes)),
                ("memory/rss_bytes", Some(s.memory.rss_bytes as f64)),
            ],
        )),
        Event::Epoch(e) => Some((
            e.step,
            vec![
                ("epoch/train_loss", Some(e.train_loss)),
                ("epoch/train_acc", Some(e.train_acc)),
                ("epoch/val_loss", e.val_loss),
                ("epoch/val_acc", e.val_acc),
                ("epoch/lr", Some(e.lr)),
                ("epoch/samples_per_s", Some(e.samples_per_s)),
                ("epoch/peak_allocated_bytes", bytes(e.memory.peak_allocated_bytes)),
            ],
        )),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A grow-back record and the run's end.
    fn grow_back_and_end(r: &mut Recorder) {
        r.emit(&Event::GrowBack(GrowBackEvent {
            step: 7,
            micro_batch_before: 4,
            micro_batch: 8,
            micro_batch_of: MicroBatchOf::Training,
        }))
        .unwrap();
        r.emit(&Event::End(Summary::default())).unwrap();
    }

    #[test]
    fn events_become_typed_lines_and_the_end_writes_the_summary() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Recorder::open(dir.path(), "[job]\n", false).unwrap();
        grow_back_and_end(&mut r);
        let text = fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
        let lines: Vec<Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
        assert_eq!(lines[0]["type"], "grow_back");
        assert_eq!(lines[0]["micro_batch"], 8);
        assert!(lines[0]["time"].as_f64().unwrap() > 0.0);
        assert_eq!(lines[1]["type"], "end");
        let summary: Value = serde_json::from_slice(&fs::read(dir.path().join("summary.json")).unwrap()).unwrap();
        assert_eq!(summary["status"], "completed");
        assert!(!dir.path().join("summary.json.tmp").exists());
    }

    #[test]
    fn a_killed_runs_cut_line_costs_only_itself() {
        let dir = tempfile::tempdir().unwrap();
        let cut = "{\"type\":\"step\",\"job\":\"\u{e9}".as_bytes();
        fs::write(dir.path().join("metrics.jsonl"), &cut[..cut.len() - 1]).unwrap();
        let mut r = Recorder::open(dir.path(), "[job]\n", false).unwrap();
        grow_back_and_end(&mut r);
        let records = read::read(dir.path()).unwrap();
        assert_eq!(records.unreadable_lines, 1);
        assert!(matches!(records.events[0], Event::GrowBack(_)), "{:?}", records.events);
        assert_eq!(records.events.len(), 2);
    }
}
