//! Every `memtrain run` (each data-parallel rank too) registers itself in a per-user runtime
//! directory while it lives, so `watch`, `info` and `clean` can tell memtrain's processes from
//! others and find their run directories. One small JSON file per process, `<pid>.json`,
//! removed when the run ends; one left by a killed run is recognised by its pid and start time
//! no longer naming a live process, and ignored.
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::procs::{Proc, Stale};

/// Overrides the registry's directory (the tests give each test its own).
pub const DIR_VAR: &str = "MEMTRAIN_RUNS_DIR";

/// `$MEMTRAIN_RUNS_DIR`, else `$XDG_RUNTIME_DIR/memtrain/runs`, else `/tmp/memtrain-$UID/runs`.
pub fn dir() -> PathBuf {
    if let Some(d) = std::env::var_os(DIR_VAR).filter(|d| !d.is_empty()) {
        return d.into();
    }
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => Path::new(&d).join("memtrain/runs"),
        None => PathBuf::from(format!("/tmp/memtrain-{}/runs", crate::procs::my_uid())),
    }
}

/// A registered process, as its file says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    pub pid: u32,
    /// The process's start time (clock ticks since boot): with the pid, names it for good.
    pub started: u64,
    /// The process that started this one (a shell, `run --nproc`, torchrun), and its start time.
    pub launcher_pid: u32,
    pub launcher_started: u64,
    /// Data-parallel rank; null for a single-process run.
    pub rank: Option<usize>,
    pub job: String,
    pub run_dir: PathBuf,
    pub device: String,
    /// Unix time of registration.
    pub started_at: f64,
    /// `--max-steps`: this session stops after that many optimizer steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<i64>,
}

impl Entry {
    /// Whether the registered process still runs.
    pub fn alive(&self) -> bool {
        Proc::alive(self.pid, self.started)
    }

    /// Orphaned when its launcher has ended, or it has been handed to another parent (which
    /// happens when the launcher ends without waiting for it).
    pub fn orphaned(&self) -> bool {
        let launcher_gone = !Proc::alive(self.launcher_pid, self.launcher_started);
        let reparented = Proc::read(self.pid).is_some_and(|p| p.ppid != self.launcher_pid);
        launcher_gone || reparented
    }

    /// Stopped, a zombie or orphaned; None for a live run under its launcher.
    pub fn stale(&self) -> Option<Stale> {
        match Proc::read(self.pid).and_then(|p| p.state()) {
            Some(s) => Some(s),
            None => self.orphaned().then_some(Stale::Orphaned),
        }
    }
}

/// This process's registration; dropping it removes the file.
pub struct Registration(PathBuf);

impl Drop for Registration {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// Registers this process. A failure is a warning: watching is no reason to stop training.
pub fn register(
    rank: Option<usize>,
    job: &str,
    run_dir: &Path,
    device: &str,
    max_steps: Option<i64>,
) -> Option<Registration> {
    match try_register(rank, job, run_dir, device, max_steps) {
        Ok(r) => Some(r),
        Err(e) => {
            tracing::warn!("this run is not registered for `memtrain watch` and `clean`: {e:#}");
            None
        }
    }
}

fn try_register(
    rank: Option<usize>,
    job: &str,
    run_dir: &Path,
    device: &str,
    max_steps: Option<i64>,
) -> Result<Registration> {
    let me = Proc::read(std::process::id()).context("reading this process's /proc entry")?;
    let launcher = Proc::read(me.ppid);
    let dir = dir();
    create_private_dir(&dir)?;
    let run_dir = std::path::absolute(run_dir).unwrap_or_else(|_| run_dir.to_owned());
    let entry = Entry {
        pid: me.pid,
        started: me.started,
        launcher_pid: me.ppid,
        launcher_started: launcher.map_or(0, |l| l.started),
        rank,
        job: job.to_owned(),
        run_dir,
        device: device.to_owned(),
        started_at: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
        max_steps,
    };
    let path = dir.join(format!("{}.json", me.pid));
    crate::atomic::write_json(&path, &entry)?;
    prune_leftovers(&dir);
    Ok(Registration(path))
}

/// Removes the files of runs that were killed before they could remove their own, so the
/// directory does not grow without end. Only a run does this; readers never write.
fn prune_leftovers(dir: &Path) {
    let Ok(files) = fs::read_dir(dir) else { return };
    for f in files.flatten() {
        let path = f.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let Some(e) = fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice::<Entry>(&b).ok())
        else {
            continue;
        };
        if Proc::read(e.pid).is_none_or(|p| p.started != e.started) {
            let _ = fs::remove_file(&path);
        }
    }
}

/// The directory, readable by its user only: it says what this user runs and where. One that
/// someone else made (in a shared /tmp) is not used: they could read or plant entries there.
fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    let m = fs::symlink_metadata(dir).with_context(|| format!("reading {}", dir.display()))?;
    if !m.is_dir() || m.uid() != crate::procs::my_uid() {
        anyhow::bail!(
            "{} is not a directory of this user's (owner uid {}); set {DIR_VAR} to one that is",
            dir.display(),
            m.uid()
        );
    }
    Ok(())
}

/// The registered processes that still run, by pid; leftovers of killed runs are skipped
/// (not removed: reading the registry writes nothing).
pub fn live() -> Vec<Entry> {
    let Ok(files) = fs::read_dir(dir()) else {
        return vec![];
    };
    let mut out: Vec<Entry> = files
        .flatten()
        .filter(|f| f.path().extension().is_some_and(|e| e == "json"))
        .filter_map(|f| serde_json::from_slice::<Entry>(&fs::read(f.path()).ok()?).ok())
        .filter(|e| Proc::read(e.pid).is_some_and(|p| p.started == e.started))
        .collect();
    out.sort_by_key(|e| e.pid);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pid: u32, started: u64, launcher_pid: u32, launcher_started: u64) -> Entry {
        Entry {
            pid,
            started,
            launcher_pid,
            launcher_started,
            rank: None,
            job: "j".into(),
            run_dir: "/r".into(),
            device: "cpu".into(),
            started_at: 0.0,
            max_steps: None,
        }
    }

    #[test]
    fn a_process_under_its_live_launcher_is_not_orphaned_and_a_gone_launcher_makes_it_so() {
        let me = Proc::read(std::process::id()).unwrap();
        let parent = Proc::read(me.ppid).unwrap();
        let e = entry(me.pid, me.started, parent.pid, parent.started);
        assert!(e.alive());
        assert!(!e.orphaned());
        assert_eq!(e.stale(), None);
        // The launcher's pid taken by a later process: the launcher is gone.
        let gone = entry(me.pid, me.started, parent.pid, parent.started + 1);
        assert!(gone.orphaned());
        assert_eq!(gone.stale(), Some(Stale::Orphaned));
        // Still under the recorded launcher's pid but with a new parent: reparented.
        let moved = entry(me.pid, me.started, me.pid, me.started);
        assert!(moved.orphaned());
        // A leftover whose pid now names another process is not alive.
        assert!(!entry(me.pid, me.started + 1, parent.pid, parent.started).alive());
    }

    #[test]
    fn a_run_registering_removes_the_files_killed_runs_left_and_keeps_the_live_ones() {
        let dir = tempfile::tempdir().unwrap();
        let me = Proc::read(std::process::id()).unwrap();
        let live = entry(me.pid, me.started, me.ppid, 0);
        let leftover = entry(me.pid, me.started + 1, me.ppid, 0);
        crate::atomic::write_json(&dir.path().join("live.json"), &live).unwrap();
        crate::atomic::write_json(&dir.path().join("leftover.json"), &leftover).unwrap();
        fs::write(dir.path().join("notes.txt"), "not ours").unwrap();
        prune_leftovers(dir.path());
        let mut left: Vec<String> = fs::read_dir(dir.path())
            .unwrap()
            .map(|f| f.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["live.json", "notes.txt"]);
    }
}
