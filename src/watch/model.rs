//! What one frame of `watch` shows, gathered from NVML, /proc, the registry and run
//! directories: plain data, serialized as-is by `--once --json`. The field names are a stable
//! interface (documented in docs/outputs.md).
use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::Result;
use serde::Serialize;

use crate::exit::UsageError;
use crate::human::{human_bytes, human_duration};
use crate::info::GpuInfo;
use crate::procs::Stale;
use crate::records::{Event, RunRecords, StartEvent, StepEvent, Summary};
use crate::registry::{self, Entry};

/// The timeline keeps this many of the latest step records: more than a terminal is wide.
const TIMELINE_POINTS: usize = 300;
/// The events listed per job.
const LAST_EVENTS: usize = 8;

#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    /// Unix time of the frame.
    pub time: f64,
    pub host: HostView,
    /// Whether NVML answered; without it there are no GPUs to show.
    pub nvml: bool,
    pub gpus: Vec<GpuView>,
    pub jobs: Vec<JobView>,
}

#[derive(Debug, Clone, Serialize)]
pub struct HostView {
    pub ram_total_bytes: u64,
    pub ram_available_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct GpuView {
    pub index: usize,
    pub name: String,
    pub total_bytes: u64,
    pub used_bytes: u64,
    pub utilization_percent: Option<u32>,
    pub processes: Vec<ProcessView>,
}

/// A process holding memory on a GPU; the memtrain fields are null for anyone else's.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessView {
    pub pid: u32,
    pub user: Option<String>,
    pub name: String,
    pub used_bytes: Option<u64>,
    pub stale: Option<Stale>,
    pub job: Option<String>,
    pub run_dir: Option<PathBuf>,
    pub rank: Option<usize>,
    pub step: Option<i64>,
    pub status: Option<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct JobView {
    pub job: String,
    pub run_dir: PathBuf,
    pub device: Option<String>,
    /// "running" while a process of it is registered, else summary.json's status
    /// ("completed", "interrupted", "oom", "step_limit"), else "ended" (killed, no summary).
    pub status: String,
    /// Stopped, zombie or orphaned processes of a running job.
    pub stale: Option<Stale>,
    /// Its running processes (one per data-parallel rank).
    pub pids: Vec<u32>,
    pub epoch: Option<i64>,
    pub epochs: Option<i64>,
    /// The global optimizer step of its latest step record.
    pub step: Option<i64>,
    pub steps_per_epoch: Option<i64>,
    pub samples_per_s: Option<f64>,
    /// Seconds left at the pace of the session so far (its steps over its wall time);
    /// running jobs only.
    pub eta_seconds: Option<f64>,
    /// The share of its latest step record's time its steps waited for their batches.
    pub data_wait_share: Option<f64>,
    pub memory: Option<MemoryNow>,
    /// The latest step records' memory, oldest first.
    pub timeline: Vec<TimelinePoint>,
    /// The latest events other than steps, oldest first.
    pub events: Vec<JobEvent>,
}

/// The latest step record's memory, with the cap it runs under.
#[derive(Debug, Clone, Serialize)]
pub struct MemoryNow {
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub peak_allocated_bytes: Option<u64>,
    pub peak_reserved_bytes: Option<u64>,
    pub host_bytes: Option<u64>,
    pub peak_host_bytes: Option<u64>,
    pub rss_bytes: u64,
    pub cap_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct TimelinePoint {
    pub step: i64,
    pub allocated_bytes: Option<u64>,
    pub reserved_bytes: Option<u64>,
    pub peak_allocated_bytes: Option<u64>,
    pub host_bytes: Option<u64>,
}

#[derive(Debug, Clone, Serialize)]
pub struct JobEvent {
    pub step: Option<i64>,
    /// The record's type: "start", "preflight", "oom", "grow_back", "cache_clear",
    /// "checkpoint", "epoch", "end".
    pub kind: String,
    pub text: String,
}

/// Gathers snapshots, keeping what it has read of each run's metrics.jsonl between frames.
pub struct Gatherer {
    given: Vec<PathBuf>,
    followers: BTreeMap<PathBuf, Follower>,
    nvml: Option<nvml_wrapper::Nvml>,
}

impl Gatherer {
    /// `run_dirs` must each be a run directory (hold metrics.jsonl): a usage error names the first that is not.
    pub fn new(run_dirs: &[PathBuf]) -> Result<Self> {
        let mut given = vec![];
        for d in run_dirs {
            if !d.join("metrics.jsonl").is_file() {
                let what = if d.is_dir() {
                    "is not a run directory (it has no metrics.jsonl)"
                } else if d.exists() {
                    "is not a directory"
                } else {
                    "does not exist"
                };
                return Err(UsageError(format!(
                    "{} {what}; pass a directory that `memtrain run` wrote (runs/<job> by default), or none to watch the running jobs",
                    d.display()
                ))
                .into());
            }
            given.push(key(d));
        }
        Ok(Gatherer {
            given,
            followers: BTreeMap::new(),
            nvml: crate::info::nvml(),
        })
    }

    pub fn snapshot(&mut self) -> Snapshot {
        let now = crate::records::unix_time();
        let runs = registry::live();
        let host = crate::sysmem::host_memory().unwrap_or_default();
        // Registered runs first, in pid order, then the given directories not running.
        let mut dirs: Vec<PathBuf> = vec![];
        for e in &runs {
            let k = key(&e.run_dir);
            if !dirs.contains(&k) {
                dirs.push(k);
            }
        }
        for d in &self.given {
            if !dirs.contains(d) {
                dirs.push(d.clone());
            }
        }
        let jobs: Vec<JobView> = dirs
            .iter()
            .map(|d| {
                let mine: Vec<&Entry> = runs.iter().filter(|e| key(&e.run_dir) == *d).collect();
                let f = self.followers.entry(d.clone()).or_insert_with(|| Follower::new(d));
                f.refresh();
                job_view(d, f, &mine, now)
            })
            .collect();
        let gpus = match &self.nvml {
            Some(n) => crate::info::gpus_without_cuda(n, &runs)
                .into_iter()
                .map(|g| gpu_view(g, &runs, &jobs))
                .collect(),
            None => vec![],
        };
        Snapshot {
            time: now,
            host: HostView {
                ram_total_bytes: host.ram_total_bytes,
                ram_available_bytes: host.ram_available_bytes,
            },
            nvml: self.nvml.is_some(),
            gpus,
            jobs,
        }
    }
}

/// One name for a run directory, however it was written.
fn key(d: &Path) -> PathBuf {
    fs::canonicalize(d).unwrap_or_else(|_| d.to_owned())
}

fn gpu_view(g: GpuInfo, runs: &[Entry], jobs: &[JobView]) -> GpuView {
    GpuView {
        index: g.index,
        name: g.name,
        total_bytes: g.total_bytes,
        used_bytes: g.used_bytes,
        utilization_percent: g.utilization_percent,
        processes: g
            .processes
            .into_iter()
            .map(|p| {
                let run = runs.iter().find(|e| e.pid == p.pid);
                let job = run.and_then(|e| jobs.iter().find(|j| j.run_dir == key(&e.run_dir)));
                ProcessView {
                    pid: p.pid,
                    user: p.user,
                    name: p.name,
                    used_bytes: p.used_bytes,
                    stale: p.stale,
                    job: run.map(|e| e.job.clone()),
                    run_dir: run.map(|e| e.run_dir.clone()),
                    rank: run.and_then(|e| e.rank),
                    step: job.and_then(|j| j.step),
                    status: job.map(|j| j.status.clone()),
                }
            })
            .collect(),
    }
}

/// A run's metrics.jsonl read as it grows: each refresh reads only the bytes added since the
/// last, and keeps a partly written last line for the next.
struct Follower {
    dir: PathBuf,
    offset: u64,
    pending: Vec<u8>,
    records: RunRecords,
    summary: Option<Summary>,
    epochs: Option<i64>,
}

impl Follower {
    fn new(dir: &Path) -> Self {
        Follower {
            dir: dir.to_owned(),
            offset: 0,
            pending: vec![],
            records: RunRecords::default(),
            summary: None,
            epochs: None,
        }
    }

    fn refresh(&mut self) {
        if let Ok(mut f) = File::open(self.dir.join("metrics.jsonl")) {
            let len = f.metadata().map_or(0, |m| m.len());
            if len < self.offset {
                // Replaced by a new run in the same directory: start over.
                *self = Follower::new(&self.dir);
            }
            let mut more = vec![];
            if f.seek(SeekFrom::Start(self.offset)).is_ok() && f.read_to_end(&mut more).is_ok() {
                self.offset += more.len() as u64;
                self.pending.extend_from_slice(&more);
                if let Some(end) = self.pending.iter().rposition(|&b| b == b'\n') {
                    let whole: Vec<u8> = self.pending.drain(..=end).collect();
                    self.records.push_lines(&String::from_utf8_lossy(&whole));
                }
            }
        }
        self.summary = fs::read(self.dir.join("summary.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok());
        if self.epochs.is_none() {
            self.epochs = configured_epochs(&self.dir);
        }
    }
}

/// `train.epochs` of the spec the run wrote as config.resolved.toml.
fn configured_epochs(dir: &Path) -> Option<i64> {
    let text = fs::read_to_string(dir.join("config.resolved.toml")).ok()?;
    let t: toml::Table = text.parse().ok()?;
    t.get("train")?.get("epochs")?.as_integer()
}

/// Time left at the session's pace so far: its steps over the wall time since the process
/// registered, so validation, checkpoints and stalls count, which a step's samples/s leaves out.
/// A session under `--max-steps` ends after that many steps when its epochs do not end first.
fn eta(e: &Entry, from_step: i64, step: i64, total_steps: i64, now: f64) -> Option<f64> {
    let total_steps = e.max_steps.map_or(total_steps, |m| total_steps.min(from_step + m));
    let done = step - from_step;
    let elapsed = now - e.started_at;
    (done > 0 && elapsed > 0.0).then(|| (total_steps - step).max(0) as f64 * elapsed / done as f64)
}

fn job_view(dir: &Path, f: &Follower, running: &[&Entry], now: f64) -> JobView {
    let r = &f.records;
    let start: Option<&StartEvent> = r.starts().last();
    let last: Option<&StepEvent> = r.steps().last();
    let status = match (running.is_empty(), &f.summary) {
        (false, _) => "running".to_owned(),
        (true, Some(s)) => s.status.name().to_owned(),
        (true, None) => "ended".to_owned(),
    };
    let steps_per_epoch = start
        .filter(|s| s.effective_batch > 0)
        .map(|s| (s.train_samples + s.effective_batch - 1) / s.effective_batch);
    // The furthest step any record reached: a run that logs every N steps writes no step
    // record between them, and a finished run's summary counts every step it took.
    let recorded = r.events.iter().filter_map(|e| e.at_step()).max();
    let step = match (running.is_empty(), &f.summary) {
        (true, Some(s)) => Some(recorded.map_or(s.global_steps, |x| x.max(s.global_steps))),
        _ => recorded,
    };
    let samples_per_s = last.map(|s| s.samples_per_s).filter(|v| v.is_finite() && *v > 0.0);
    let eta_seconds = match (running.first(), steps_per_epoch, f.epochs, step, start) {
        (Some(e), Some(spe), Some(epochs), Some(step), Some(s)) => eta(e, s.step, step, spe * epochs, now),
        _ => None,
    };
    let steps: Vec<&StepEvent> = r.steps().collect();
    let timeline = steps[steps.len().saturating_sub(TIMELINE_POINTS)..]
        .iter()
        .map(|s| TimelinePoint {
            step: s.step,
            allocated_bytes: s.memory.allocated_bytes,
            reserved_bytes: s.memory.reserved_bytes,
            peak_allocated_bytes: s.memory.peak_allocated_bytes,
            host_bytes: s.memory.host_bytes,
        })
        .collect();
    let events: Vec<JobEvent> = r.events.iter().filter_map(describe).collect();
    JobView {
        job: running
            .first()
            .map(|e| e.job.clone())
            .or(start.map(|s| s.job.clone()))
            .unwrap_or_else(|| dir.file_name().unwrap_or_default().to_string_lossy().into_owned()),
        run_dir: dir.to_owned(),
        device: running
            .first()
            .map(|e| e.device.clone())
            .or(start.map(|s| s.device.clone())),
        status,
        stale: running.iter().find_map(|e| e.stale()),
        pids: running.iter().map(|e| e.pid).collect(),
        epoch: last.map(|s| s.epoch),
        epochs: f.epochs,
        step,
        steps_per_epoch,
        samples_per_s,
        eta_seconds,
        data_wait_share: last
            .filter(|s| s.seconds.is_finite() && s.seconds > 0.0)
            .map(|s| s.data_wait_seconds / s.seconds),
        memory: last.map(|s| MemoryNow {
            allocated_bytes: s.memory.allocated_bytes,
            reserved_bytes: s.memory.reserved_bytes,
            peak_allocated_bytes: s.memory.peak_allocated_bytes,
            peak_reserved_bytes: s.memory.peak_reserved_bytes,
            host_bytes: s.memory.host_bytes,
            peak_host_bytes: s.memory.peak_host_bytes,
            rss_bytes: s.memory.rss_bytes,
            cap_bytes: start.and_then(|s| s.cap.as_ref()).map(|c| c.bytes),
        }),
        timeline,
        events: events[events.len().saturating_sub(LAST_EVENTS)..].to_vec(),
    }
}

/// A line for each event worth seeing beside the timeline; None for steps.
fn describe(e: &Event) -> Option<JobEvent> {
    let (kind, text) = match e {
        Event::Step(_) => return None,
        Event::Start(s) => (
            "start",
            format!(
                "{} on {}, micro-batch {} x {}{}",
                if s.resumed { "resumed" } else { "started" },
                s.device,
                s.micro_batch,
                s.accumulation_steps,
                s.cap
                    .as_ref()
                    .map(|c| format!(", cap {}", human_bytes(c.bytes)))
                    .unwrap_or_default()
            ),
        ),
        Event::Preflight(p) => (
            "preflight",
            format!(
                "first step: {} {}{}",
                p.measure,
                human_bytes(p.peak_bytes),
                p.cap_bytes
                    .map(|c| format!(" of cap {}", human_bytes(c)))
                    .unwrap_or_default()
            ),
        ),
        Event::Oom(o) => (
            "oom",
            format!(
                "OOM in {} at micro-batch {}: {}{}",
                o.phase,
                o.micro_batch_before,
                o.decision.action,
                o.decision
                    .to
                    .as_ref()
                    .map(|t| format!(" to micro-batch {} x {}", t.micro_batch, t.accumulation_steps))
                    .unwrap_or_default()
            ),
        ),
        Event::GrowBack(g) => (
            "grow_back",
            format!("grow-back: micro-batch {} -> {}", g.micro_batch_before, g.micro_batch),
        ),
        Event::CacheClear(c) => (
            "cache_clear",
            format!(
                "cache cleared{}",
                c.cleared
                    .released_bytes
                    .map(|b| format!(", released {}", human_bytes(b)))
                    .unwrap_or_default()
            ),
        ),
        Event::Checkpoint(c) => (
            "checkpoint",
            format!(
                "checkpoint ({}): {} in {}",
                c.reason,
                human_bytes(c.bytes),
                human_duration(c.seconds)
            ),
        ),
        Event::Epoch(e) => (
            "epoch",
            format!(
                "epoch {}: train loss {:.4}{}",
                e.epoch,
                e.train_loss,
                e.val_acc
                    .map(|a| format!(", val acc {:.1}%", a * 100.0))
                    .unwrap_or_default()
            ),
        ),
        Event::Prefetch(p) => (
            "prefetch",
            format!(
                "host memory low ({} available): data.prefetch {} -> {}",
                human_bytes(p.available_bytes),
                p.prefetch_before,
                p.prefetch
            ),
        ),
        Event::Graph(g) => ("graph", graph_text(g)),
        Event::End(s) => ("end", format!("ended: {}", s.status.name())),
    };
    Some(JobEvent {
        step: e.at_step(),
        kind: kind.into(),
        text,
    })
}

/// A `graph` record's line: what was captured, or why steps run eager.
fn graph_text(g: &crate::records::GraphEvent) -> String {
    match &g.reason {
        Some(why) => format!("{} step runs eager: {why}", g.of),
        None => format!(
            "{} step captured at micro-batch {} x {}{}",
            g.of,
            g.micro_batch,
            g.micro_batches,
            g.pool_bytes
                .map(|b| format!(", pool {}", human_bytes(b)))
                .unwrap_or_default()
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::samples::{self, lines};
    use crate::records::Status;

    #[test]
    fn a_growing_metrics_file_is_read_as_it_grows_and_a_cut_line_waits_for_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let first = lines(&[
            Event::Start(samples::start(0, false, Some(1 << 20))),
            Event::Step(samples::step(1, 2.0, 100, 150)),
        ]);
        let second = lines(&[Event::Step(samples::step(2, 1.5, 200, 250))]);
        let (head, tail) = second.split_at(second.len() / 2);
        fs::write(&path, format!("{first}{head}")).unwrap();
        let mut f = Follower::new(dir.path());
        f.refresh();
        assert_eq!(f.records.steps().count(), 1);
        assert_eq!(
            f.records.unreadable_lines, 0,
            "half a line is kept for later, not counted"
        );
        let mut file = fs::OpenOptions::new().append(true).open(&path).unwrap();
        std::io::Write::write_all(&mut file, tail.as_bytes()).unwrap();
        f.refresh();
        let steps: Vec<i64> = f.records.steps().map(|s| s.step).collect();
        assert_eq!((steps, f.records.unreadable_lines), (vec![1, 2], 0));
        let offset = f.offset;
        f.refresh();
        assert_eq!(
            (f.offset, f.records.steps().count()),
            (offset, 2),
            "nothing new, nothing read"
        );
        // A new run in the same directory starts the file again.
        fs::write(&path, lines(&[Event::Start(samples::start(0, false, None))])).unwrap();
        f.refresh();
        assert_eq!((f.records.starts().count(), f.records.steps().count()), (1, 0));
    }

    #[test]
    fn a_finished_run_shows_its_summary_status_its_memory_and_its_events() {
        let dir = tempfile::tempdir().unwrap();
        let mut events = vec![
            Event::Start(samples::start(0, false, Some(1 << 20))),
            Event::Preflight(samples::preflight()),
        ];
        events.extend((1..=4).map(|s| Event::Step(samples::step(s, 1.0, 100 * s as u64, 150 * s as u64))));
        events.push(Event::Oom(samples::oom(4, samples::backoff())));
        fs::write(dir.path().join("metrics.jsonl"), lines(&events)).unwrap();
        crate::atomic::write_json(&dir.path().join("summary.json"), &samples::summary(Status::Oom, 4)).unwrap();
        fs::write(dir.path().join("config.resolved.toml"), "[train]\nepochs = 2\n").unwrap();
        let mut f = Follower::new(dir.path());
        f.refresh();
        let j = job_view(dir.path(), &f, &[], 0.0);
        assert_eq!((j.job.as_str(), j.status.as_str()), ("j", "oom"));
        // 48 samples in batches of 8: 6 steps an epoch.
        assert_eq!((j.step, j.steps_per_epoch, j.epochs), (Some(4), Some(6), Some(2)));
        assert_eq!(j.eta_seconds, None, "no time left to a run that is not running");
        let m = j.memory.unwrap();
        assert_eq!(
            (m.allocated_bytes, m.peak_allocated_bytes, m.cap_bytes),
            (Some(400), Some(600), Some(1 << 20))
        );
        assert_eq!(j.timeline.iter().map(|p| p.step).collect::<Vec<_>>(), [1, 2, 3, 4]);
        let kinds: Vec<&str> = j.events.iter().map(|e| e.kind.as_str()).collect();
        assert_eq!(kinds, ["start", "preflight", "oom"]);
        let oom = &j.events[2].text;
        assert!(
            oom.contains("OOM in backward") && oom.contains("backoff to micro-batch 4"),
            "{oom}"
        );
    }

    #[test]
    fn the_time_left_ends_at_max_steps_when_they_end_the_session_first() {
        let entry = |max_steps| Entry {
            pid: 1,
            started: 1,
            launcher_pid: 0,
            launcher_started: 0,
            rank: None,
            job: "j".into(),
            run_dir: "/r".into(),
            device: "cpu".into(),
            started_at: 100.0,
            max_steps,
        };
        // 5 steps in 10 s: 2 s a step.
        assert_eq!(
            eta(&entry(None), 0, 5, 100, 110.0),
            Some(190.0),
            "95 steps to the epochs' end"
        );
        assert_eq!(
            eta(&entry(Some(6)), 0, 5, 100, 110.0),
            Some(2.0),
            "one step to --max-steps 6"
        );
        assert_eq!(
            eta(&entry(Some(10)), 40, 45, 100, 110.0),
            Some(10.0),
            "a resumed session counts its steps from where it started"
        );
        assert_eq!(
            eta(&entry(Some(500)), 0, 5, 100, 110.0),
            Some(190.0),
            "the epochs end first"
        );
    }

    #[test]
    fn a_finished_run_that_logged_no_step_shows_the_steps_its_summary_counts() {
        let dir = tempfile::tempdir().unwrap();
        let events = vec![Event::Start(samples::start(0, false, None))];
        fs::write(dir.path().join("metrics.jsonl"), lines(&events)).unwrap();
        let summary = Summary {
            global_steps: 2,
            ..samples::summary(Status::StepLimit, 2)
        };
        crate::atomic::write_json(&dir.path().join("summary.json"), &summary).unwrap();
        let mut f = Follower::new(dir.path());
        f.refresh();
        let j = job_view(dir.path(), &f, &[], 0.0);
        assert_eq!((j.status.as_str(), j.step), ("step_limit", Some(2)));
    }
}
