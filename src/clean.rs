//! `memtrain clean`: ends processes that hold memory for nothing. By default this user's
//! orphaned memtrain runs (their launcher has gone); any other process only when named with
//! `--pid`, and only this user's. Without `--yes` it only says what it would end.
use std::time::{Duration, Instant};

use anyhow::Result;

use crate::cli::CleanArgs;
use crate::exit::UsageError;
use crate::human::human_bytes;
use crate::procs::{my_uid, user_name, Proc, Stale};
use crate::registry::{self, Entry};

/// How long `--yes` waits for a process to go after SIGKILL before it reports failure.
const AFTER_KILL: Duration = Duration::from_secs(5);

/// Memory a process holds, in the best measure there is for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Held {
    /// Device memory as NVML counts it (all GPUs together).
    Gpu(u64),
    /// A CPU run's tensor bytes as its records count them (device and host tensors).
    CpuTensors(u64),
    /// The process's resident memory: nothing better is known.
    Rss(u64),
}

impl Held {
    fn bytes(self) -> u64 {
        match self {
            Held::Gpu(b) | Held::CpuTensors(b) | Held::Rss(b) => b,
        }
    }

    fn describe(self) -> String {
        match self {
            Held::Gpu(b) => format!("{} of GPU memory", human_bytes(b)),
            Held::CpuTensors(b) => format!("{} of CPU tensor memory (its records' count)", human_bytes(b)),
            Held::Rss(b) => format!("{} resident (RSS)", human_bytes(b)),
        }
    }
}

struct Target {
    proc: Proc,
    run: Option<Entry>,
    why: String,
    held: Held,
}

impl Target {
    fn line(&self) -> String {
        let p = &self.proc;
        let run = match &self.run {
            Some(e) => {
                let rank = e.rank.map(|r| format!(" rank {r}")).unwrap_or_default();
                format!("  job {}{rank}  run {}", e.job, e.run_dir.display())
            }
            None => String::new(),
        };
        format!(
            "pid {}  user {}  {}{run}  {}  holds {}",
            p.pid,
            p.user(),
            p.name,
            self.why,
            self.held.describe()
        )
    }
}

pub fn clean(args: &CleanArgs) -> Result<()> {
    if !(args.grace.is_finite() && (0.0..=3600.0).contains(&args.grace)) {
        return Err(UsageError(format!(
            "--grace {}: expected seconds, from 0 to an hour (3600), e.g. --grace 10",
            args.grace
        ))
        .into());
    }
    let runs = registry::live();
    let gpu = gpu_bytes_by_pid(&runs);
    let targets = match args.pids.is_empty() {
        true => orphans(&runs, &gpu),
        false => named(&args.pids, &runs, &gpu)?,
    };
    // A run whose launcher ended within its first second, before it registered, was recorded
    // under the parent it was handed to and cannot be told from one under a live launcher:
    // the runs spared are named, so that one can be ended with --pid.
    let spared = if args.pids.is_empty() { spared(&runs) } else { vec![] };
    if targets.is_empty() {
        crate::outln!(
            "nothing to clean: no orphaned memtrain processes of user {} (registry {})",
            user_name(my_uid()),
            registry::dir().display()
        )?;
        print_spared(&spared)?;
        return Ok(());
    }
    if !args.yes {
        crate::outln!("would end {} (dry run; pass --yes to end):", count(targets.len()))?;
        for t in &targets {
            crate::outln!("  {}", t.line())?;
        }
        print_spared(&spared)?;
        return Ok(());
    }
    end(&targets, Duration::from_secs_f64(args.grace))
}

fn count(n: usize) -> String {
    match n {
        1 => "1 process".into(),
        n => format!("{n} processes"),
    }
}

/// This user's registered memtrain processes whose launcher has gone.
fn orphans(runs: &[Entry], gpu: &[(u32, u64)]) -> Vec<Target> {
    runs.iter()
        .filter(|e| e.orphaned())
        .filter_map(|e| {
            // A zombie has already ended and holds nothing; a stopped orphan is still an orphan.
            let proc = Proc::read(e.pid).filter(|p| p.uid == my_uid() && p.started == e.started && p.state != 'Z')?;
            let stopped = if proc.state() == Some(Stale::Stopped) {
                ", stopped"
            } else {
                ""
            };
            Some(Target {
                held: held(&proc, Some(e), gpu),
                why: format!("orphaned (launcher pid {} has gone){stopped}", e.launcher_pid),
                run: Some(e.clone()),
                proc,
            })
        })
        .collect()
}

/// This user's live runs that are not orphaned: left alone unless named with `--pid`.
fn spared(runs: &[Entry]) -> Vec<(Entry, String)> {
    runs.iter()
        .filter(|e| !e.orphaned())
        .filter(|e| Proc::read(e.pid).is_some_and(|p| p.uid == my_uid() && p.started == e.started))
        .map(|e| {
            let launcher = Proc::read(e.launcher_pid).map_or_else(|| "?".into(), |p| p.name);
            (e.clone(), launcher)
        })
        .collect()
}

fn print_spared(spared: &[(Entry, String)]) -> Result<()> {
    if spared.is_empty() {
        return Ok(());
    }
    crate::outln!("spared, under a live launcher (end one with --pid PID):")?;
    for (e, launcher) in spared {
        crate::outln!(
            "  {} (job {}, {}) under launcher pid {} ({launcher})",
            e.pid,
            e.job,
            e.run_dir.display(),
            e.launcher_pid
        )?;
    }
    Ok(())
}

/// The processes named with `--pid`: each must exist and be this user's.
fn named(pids: &[u32], runs: &[Entry], gpu: &[(u32, u64)]) -> Result<Vec<Target>> {
    let me = my_uid();
    let mut out = vec![];
    for &pid in pids {
        let Some(proc) = Proc::read(pid) else {
            return Err(UsageError(format!("--pid {pid}: no such process")).into());
        };
        if proc.uid != me {
            return Err(UsageError(format!(
                "--pid {pid}: {} belongs to user {}, not to you ({}); memtrain clean never ends another user's process",
                proc.name,
                proc.user(),
                user_name(me)
            ))
            .into());
        }
        if pid == 1 || pid == std::process::id() {
            return Err(UsageError(format!(
                "--pid {pid}: {} is {}; memtrain clean will not end it",
                proc.name,
                if pid == 1 {
                    "the init process"
                } else {
                    "this memtrain clean itself"
                }
            ))
            .into());
        }
        if proc.state == 'Z' {
            return Err(UsageError(format!(
                "--pid {pid}: {} has already ended (a zombie: it holds no memory); its parent, pid {}, has not reaped it",
                proc.name, proc.ppid
            ))
            .into());
        }
        let run = runs.iter().find(|e| e.pid == pid && e.started == proc.started).cloned();
        let why = match (proc.state(), run.as_ref().and_then(Entry::stale)) {
            (Some(s), _) | (None, Some(s)) => s.name().to_owned(),
            (None, None) => "named with --pid".to_owned(),
        };
        if !out.iter().any(|t: &Target| t.proc.pid == pid) {
            out.push(Target {
                held: held(&proc, run.as_ref(), gpu),
                why,
                run,
                proc,
            });
        }
    }
    Ok(out)
}

/// GPU memory per pid, all GPUs together; empty without NVML.
fn gpu_bytes_by_pid(runs: &[Entry]) -> Vec<(u32, u64)> {
    let Some(n) = crate::info::nvml() else {
        return vec![];
    };
    let mut out: Vec<(u32, u64)> = vec![];
    for g in crate::info::gpus_without_cuda(&n, runs) {
        for p in g.processes {
            let b = p.used_bytes.unwrap_or(0);
            match out.iter_mut().find(|(pid, _)| *pid == p.pid) {
                Some((_, total)) => *total += b,
                None => out.push((p.pid, b)),
            }
        }
    }
    out
}

fn held(proc: &Proc, run: Option<&Entry>, gpu: &[(u32, u64)]) -> Held {
    if let Some(&(_, b)) = gpu.iter().find(|(pid, _)| *pid == proc.pid) {
        return Held::Gpu(b);
    }
    // Rank 0 writes the records; another rank's figures are not in them.
    let cpu = run
        .filter(|e| e.device == "cpu" && e.rank.unwrap_or(0) == 0)
        .and_then(|e| crate::records::read(&e.run_dir).ok())
        .and_then(|r| r.steps().last().map(|s| s.memory))
        .and_then(|m| Some(m.allocated_bytes? + m.host_bytes.unwrap_or(0)));
    match cpu {
        Some(b) => Held::CpuTensors(b),
        None => Held::Rss(proc.rss_bytes),
    }
}

/// SIGTERM (a memtrain run then saves a checkpoint and exits), SIGKILL after the grace period.
fn end(targets: &[Target], grace: Duration) -> Result<()> {
    // A stdout that fails (a full disk) must not stop the signals half-way: its error waits.
    let mut unsaid = Ok(());
    let mut say = |r: Result<()>| {
        if unsaid.is_ok() {
            unsaid = r;
        }
    };
    for t in targets {
        signal(&t.proc, libc::SIGTERM);
        if t.proc.state() == Some(Stale::Stopped) {
            // A stopped process acts on SIGTERM only once it runs again.
            signal(&t.proc, libc::SIGCONT);
        }
        say(crate::outln!("sent SIGTERM to {}", t.line()));
    }
    let mut left = wait_for(targets.iter().collect(), grace);
    for t in &left {
        say(crate::outln!(
            "pid {} still runs {:.0} s after SIGTERM: sending SIGKILL",
            t.proc.pid,
            grace.as_secs_f64()
        ));
        signal(&t.proc, libc::SIGKILL);
    }
    if !left.is_empty() {
        left = wait_for(left, AFTER_KILL);
    }
    let ended: Vec<&Target> = targets
        .iter()
        .filter(|t| !left.iter().any(|l| l.proc.pid == t.proc.pid))
        .collect();
    for t in &ended {
        say(crate::outln!("pid {} ended", t.proc.pid));
    }
    let freed: u64 = ended.iter().map(|t| t.held.bytes()).sum();
    say(crate::outln!(
        "freed {} ({} ended)",
        human_bytes(freed),
        count(ended.len())
    ));
    if !left.is_empty() {
        let pids: Vec<String> = left.iter().map(|t| t.proc.pid.to_string()).collect();
        anyhow::bail!(
            "{} still running after SIGKILL (pid {}): in uninterruptible sleep, or ending slowly; look again with `memtrain info`",
            count(left.len()),
            pids.join(", ")
        );
    }
    unsaid
}

fn signal(p: &Proc, sig: i32) {
    // The pid is checked to still name the same process just before, so a reused pid is spared.
    if Proc::alive(p.pid, p.started) {
        // SAFETY: kill has no memory-safety preconditions.
        unsafe { libc::kill(p.pid as i32, sig) };
    }
}

/// Waits until every target has ended (or become a zombie, which holds no memory), or `limit`
/// has passed; returns those still running.
fn wait_for(mut left: Vec<&Target>, limit: Duration) -> Vec<&Target> {
    let until = Instant::now() + limit;
    loop {
        left.retain(|t| Proc::alive(t.proc.pid, t.proc.started));
        if left.is_empty() || Instant::now() >= until {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
