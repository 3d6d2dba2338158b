//! `watch` and `clean`, driven as a person uses them: against live runs kept at a known step by
//! the await-signal fault hook, `watch` in a real terminal (tmux) and as `--once` frames, and
//! `clean` on a run whose launcher has gone. Each test has its own registry directory
//! (MEMTRAIN_RUNS_DIR), so the runs of other tests never show up in it.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use memtrain::human::human_bytes;
use memtrain::procs::Proc;
use serde_json::Value;

use crate::common::{alone, digits_spec, Running, Test};

const RUNS_DIR: &str = "MEMTRAIN_RUNS_DIR";
const AWAIT: &str = "MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP";
/// How long a test waits for something a live process must do; far above what it takes.
const PATIENCE: Duration = Duration::from_secs(120);

/// Processes a test started that must not outlive it, whatever happens: a failing test would
/// otherwise leave its live runs waiting for a signal. Each is named by pid and start time, so a
/// reused pid is spared.
#[derive(Default)]
struct Reap(Vec<(u32, u64)>);

impl Reap {
    fn add(&mut self, pid: u32) {
        if let Some(p) = Proc::read(pid) {
            self.0.push((pid, p.started));
        }
    }
}

impl Drop for Reap {
    fn drop(&mut self) {
        for &(pid, started) in &self.0 {
            if Proc::read(pid).is_some_and(|p| p.started == started) {
                unsafe {
                    libc::kill(pid as i32, libc::SIGKILL);
                    // Reaps it where it is this process's child; harmless where it is not.
                    libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG);
                }
            }
        }
    }
}

fn registry(t: &Test) -> String {
    t.dir().join("registry").display().to_string()
}

/// The digits job `name` (45 steps an epoch, 3 epochs) under a 64 MiB cap, registered in the
/// test's registry, waiting for a signal after global step `step`; `reap` ends it should the
/// test fail first.
fn live_run(t: &Test, name: &str, step: i64, reap: &mut Reap) -> Running {
    let mut r = t
        .clone()
        .name(name)
        .set("job.name", name)
        .set("memory.limit", "64MiB")
        .env(RUNS_DIR, &registry(t))
        .env(AWAIT, &step.to_string())
        .exit(130)
        .spawn();
    reap.add(r.pid() as u32);
    r.await_stderr(&format!("fault: waiting for a signal at step {step}"));
    r
}

/// A memtrain command without a spec (watch, clean, info) that reads the test's registry.
fn command(t: &Test, args: &[&str]) -> Test {
    let cmd = args[0];
    t.clone()
        .no_spec()
        .command(cmd)
        .args(&args[1..])
        .env(RUNS_DIR, &registry(t))
}

/// The last step record of a run directory, through the typed reader.
fn last_step(run_dir: &Path) -> memtrain::records::StepEvent {
    let r = memtrain::records::read(run_dir).expect("the run's records");
    r.steps().last().cloned().expect("a step record")
}

fn registered_files(t: &Test) -> Vec<PathBuf> {
    match std::fs::read_dir(registry(t)) {
        Ok(d) => d.flatten().map(|e| e.path()).collect(),
        Err(_) => vec![],
    }
}

#[test]
fn watch_once_shows_a_live_run_from_its_records_and_a_finished_one_from_its_summary() {
    let t = Test::new();
    let mut reap = Reap::default();
    let run = live_run(&t, "t", 50, &mut reap);
    let run_dir = t.dir().join("t");
    let step = last_step(&run_dir);
    assert_eq!(step.step, 50);
    let allocated = step.memory.allocated_bytes.expect("a CPU run counts its tensors");

    let frame = command(&t, &["watch", "--once"]).run().stdout;
    assert!(frame.contains("Host RAM: "), "{frame}");
    assert!(frame.contains("GPUs: none") || frame.contains("GPU 0"), "{frame}");
    let row = frame
        .lines()
        .find(|l| l.contains("> t "))
        .unwrap_or_else(|| panic!("no row for job t:\n{frame}"));
    for want in [
        "running",
        "cpu",
        "50/135 (2/3)",
        &human_bytes(allocated),
        "64.00 MiB",
        &run.pid().to_string(),
    ] {
        assert!(row.contains(want), "the job's row lacks {want:?}: {row}\n{frame}");
    }
    assert!(frame.contains("t memory by step"), "{frame}");
    assert!(frame.contains("step 45: checkpoint (epoch)"), "{frame}");
    assert!(!frame.contains('\x1b'), "--once prints no terminal control:\n{frame:?}");

    let json: Value = serde_json::from_str(&command(&t, &["watch", "--once", "--json"]).run().stdout).unwrap();
    assert!(json["host"]["ram_total_bytes"].as_u64().unwrap() > 0);
    assert!(json["host"]["ram_available_bytes"].as_u64().unwrap() > 0);
    let jobs = json["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{json:#}");
    let j = &jobs[0];
    assert_eq!(j["job"], "t");
    assert_eq!(j["status"], "running");
    assert_eq!(j["stale"], Value::Null, "its launcher (this test) lives");
    assert_eq!(j["pids"], serde_json::json!([run.pid()]));
    assert_eq!(
        j["run_dir"],
        std::fs::canonicalize(&run_dir).unwrap().display().to_string()
    );
    assert_eq!((j["step"].as_i64(), j["epoch"].as_i64()), (Some(50), Some(2)));
    assert_eq!(
        (j["steps_per_epoch"].as_i64(), j["epochs"].as_i64()),
        (Some(45), Some(3))
    );
    assert_eq!(j["memory"]["allocated_bytes"].as_u64(), Some(allocated));
    assert_eq!(
        j["memory"]["peak_allocated_bytes"].as_u64(),
        step.memory.peak_allocated_bytes
    );
    assert_eq!(j["memory"]["cap_bytes"].as_u64(), Some(64 << 20));
    assert!(j["eta_seconds"].as_f64().unwrap() > 0.0, "{j:#}");
    assert_eq!((j["samples_per_s"].as_f64()), Some(step.samples_per_s));
    let timeline = j["timeline"].as_array().unwrap();
    let steps: Vec<i64> = timeline.iter().map(|p| p["step"].as_i64().unwrap()).collect();
    assert_eq!(steps, (1..=50).collect::<Vec<_>>());
    assert_eq!(timeline[49]["allocated_bytes"].as_u64(), Some(allocated));
    let kinds: Vec<&str> = j["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["start", "preflight", "epoch", "checkpoint"]);

    // Interrupted: the registration goes with it, and the directory, given, shows its summary.
    run.signal(libc::SIGINT);
    run.finish();
    assert_eq!(
        registered_files(&t),
        Vec::<PathBuf>::new(),
        "the run removed its registration"
    );
    let dir = run_dir.display().to_string();
    let json: Value = serde_json::from_str(&command(&t, &["watch", "--once", "--json", &dir]).run().stdout).unwrap();
    let j = &json["jobs"][0];
    assert_eq!(
        (j["status"].as_str(), j["pids"].as_array().map(Vec::len)),
        (Some("interrupted"), Some(0))
    );
    assert_eq!(j["eta_seconds"], Value::Null);
    assert_eq!(j["events"].as_array().unwrap().last().unwrap()["kind"], "end");
    let frame = command(&t, &["watch", "--once", &dir]).run().stdout;
    assert!(frame.contains("interrupted"), "{frame}");
}

#[test]
fn watch_counts_the_time_left_to_max_steps() {
    let t = Test::new();
    let mut reap = Reap::default();
    let spawned = Instant::now();
    // 135 steps in all; this session stops after 6, and waits after its 5th.
    let mut run = t
        .clone()
        .name("t")
        .args(&["--max-steps", "6"])
        .env(RUNS_DIR, &registry(&t))
        .env(AWAIT, "5")
        .exit(130)
        .spawn();
    reap.add(run.pid() as u32);
    run.await_stderr("fault: waiting for a signal at step 5");
    let json: Value = serde_json::from_str(&command(&t, &["watch", "--once", "--json"]).run().stdout).unwrap();
    let since_spawn = spawned.elapsed().as_secs_f64();
    let eta = json["jobs"][0]["eta_seconds"]
        .as_f64()
        .expect("a running job's time left");
    // One step left at the pace of five: at most a fifth of the time the session has run, where
    // the 130 steps to the last epoch would take 26 times it.
    assert!(
        eta > 0.0 && eta <= since_spawn / 5.0,
        "{eta} s left after {since_spawn} s: {json:#}"
    );
    run.signal(libc::SIGINT);
    run.finish();
}

#[test]
fn watch_refuses_what_is_not_a_run_directory() {
    let t = Test::new();
    let missing = t.dir().join("nowhere").display().to_string();
    command(&t, &["watch", "--once", &missing])
        .exit(2)
        .stderr_has(&format!("{missing} does not exist"))
        .run();
    let empty = t.dir().display().to_string();
    command(&t, &["watch", "--once", &empty])
        .exit(2)
        .stderr_has(&format!("{empty} is not a run directory"))
        .run();
    let file = t.dir().join("notes.txt");
    std::fs::write(&file, "").unwrap();
    let file = file.display().to_string();
    command(&t, &["watch", "--once", &file])
        .exit(2)
        .stderr_has(&format!("{file} is not a directory"))
        .run();
    command(&t, &["watch", "--json"]).exit(2).stderr_has("--once").run();
    // Not on a terminal, the live view says what to use instead.
    command(&t, &["watch"]).exit(2).stderr_has("use --once").run();
}

/// A tmux server of the test's own, killed however the test ends.
struct Tmux {
    socket: String,
}

impl Tmux {
    fn cmd(&self) -> Command {
        let mut c = Command::new("tmux");
        c.args(["-L", &self.socket]);
        c
    }

    #[track_caller]
    fn run(&self, args: &[&str]) -> String {
        let o = self.cmd().args(args).output().expect("tmux starts (is it installed?)");
        assert!(
            o.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8_lossy(&o.stdout).into_owned()
    }

    fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "w"])
    }

    /// Waits until `done` holds for what tmux prints for `args`; fails with the last of it.
    #[track_caller]
    fn await_output(&self, args: &[&str], what: &str, done: impl Fn(&str) -> bool) -> String {
        let until = Instant::now() + PATIENCE;
        loop {
            let out = self.run(args);
            if done(&out) {
                return out;
            }
            assert!(
                Instant::now() < until,
                "tmux {args:?} never showed {what}; last:\n{out}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Tmux {
    fn drop(&mut self) {
        let _ = self.cmd().arg("kill-server").output();
    }
}

#[test]
fn watch_in_a_terminal_draws_the_live_run_switches_jobs_and_quits_on_q() {
    let t = Test::new();
    // A finished run to switch to, given as a RUN_DIR.
    t.clone()
        .name("done")
        .set("job.name", "done")
        .args(&["--max-steps", "3"])
        .run();
    let mut reap = Reap::default();
    let run = live_run(&t, "t", 50, &mut reap);
    let allocated = last_step(&t.dir().join("t")).memory.allocated_bytes.unwrap();
    let conf = t.dir().join("tmux.conf");
    // The pane stays after watch exits, so the test can read how it exited.
    std::fs::write(&conf, "set -g remain-on-exit on\n").unwrap();
    let tmux = Tmux {
        socket: format!("memtrain-watch-test-{}", std::process::id()),
    };
    // The pane's shell writes watch's exit status: tmux's own #{pane_dead_status} is sometimes
    // left empty for a pane that exited 0 (seen with the shell exec'ing the command).
    let status = t.dir().join("watch.status");
    let watch = format!(
        "env {RUNS_DIR}={} {} watch {}; echo $? > {}",
        registry(&t),
        env!("CARGO_BIN_EXE_memtrain"),
        t.dir().join("done").display(),
        status.display()
    );
    tmux.run(&[
        "-f",
        conf.to_str().unwrap(),
        "new-session",
        "-d",
        "-x",
        "160",
        "-y",
        "50",
        "-s",
        "w",
        &watch,
    ]);
    let frame = tmux.await_output(&["capture-pane", "-p", "-t", "w"], "the live job", |s| {
        s.contains("t memory by step")
    });
    assert!(frame.contains("Host RAM: "), "{frame}");
    let row = frame
        .lines()
        .find(|l| l.contains("> t "))
        .unwrap_or_else(|| panic!("{frame}"));
    for want in ["running", "50/135 (2/3)", &human_bytes(allocated), "64.00 MiB"] {
        assert!(row.contains(want), "the live job's row lacks {want:?}:\n{frame}");
    }
    assert!(frame.contains("  done "), "the given run is listed:\n{frame}");
    assert!(frame.contains("step_limit"), "{frame}");

    tmux.run(&["send-keys", "-t", "w", "Down"]);
    tmux.await_output(&["capture-pane", "-p", "-t", "w"], "the second job selected", |s| {
        s.contains("done memory by step") && s.lines().any(|l| l.contains("> done "))
    });
    tmux.run(&["send-keys", "-t", "w", "Up"]);
    tmux.await_output(
        &["capture-pane", "-p", "-t", "w"],
        "the first job selected again",
        |s| s.contains("t memory by step"),
    );

    tmux.run(&["send-keys", "-t", "w", "q"]);
    tmux.await_output(
        &["display-message", "-p", "-t", "w", "#{pane_dead}"],
        "watch exiting",
        |s| s.trim() == "1",
    );
    let code = std::fs::read_to_string(&status).unwrap_or_else(|e| panic!("{}: {e}", status.display()));
    assert_eq!(code.trim(), "0", "watch exits 0 on q");
    // The terminal is given back: no alternate screen left behind, the last frame gone with it.
    let after = tmux.screen();
    assert!(
        !after.contains("memory by step"),
        "the alternate screen was left:\n{after}"
    );

    run.signal(libc::SIGINT);
    run.finish();
}

#[test]
fn clean_ends_an_orphaned_run_spares_the_rest_and_refuses_others_processes() {
    alone(
        "watch::clean_ends_an_orphaned_run_spares_the_rest_and_refuses_others_processes",
        clean_orphans,
    );
}

#[test]
fn clean_refuses_a_grace_it_cannot_wait_and_signals_nothing() {
    let t = Test::new();
    for grace in ["-1", "nan", "1e20"] {
        command(&t, &["clean", "--yes", &format!("--grace={grace}")])
            .exit(2)
            .stderr_has(&format!(
                "--grace {}: expected seconds, from 0 to an hour (3600)",
                grace.parse::<f64>().unwrap()
            ))
            .run();
    }
}

fn clean_orphans() {
    // Alone in its process, this test may adopt what is orphaned below it, to reap it and read
    // its exit status: the orphaned run becomes its child instead of init's.
    assert_eq!(unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) }, 0);
    let t = Test::new();
    let mut reap = Reap::default();

    // A run started by a shell that exits as soon as the run waits at step 5: orphaned.
    let spec = t.dir().join("orphan.toml");
    let mut table = digits_spec();
    table["job"]["name"] = "orphan".into();
    std::fs::write(&spec, toml::to_string(&table).unwrap()).unwrap();
    let orphan_dir = t.dir().join("orphan");
    let err = t.dir().join("orphan.err");
    let script = format!(
        "{RUNS_DIR}='{reg}' {AWAIT}=5 '{bin}' run '{spec}' --out '{out}' 2>'{err}' >/dev/null </dev/null &
         echo $!
         while kill -0 $! 2>/dev/null && ! grep -q 'fault: waiting for a signal at step 5' '{err}'; do sleep 0.05; done",
        reg = registry(&t),
        bin = env!("CARGO_BIN_EXE_memtrain"),
        spec = spec.display(),
        out = orphan_dir.display(),
        err = err.display(),
    );
    let o = Command::new("sh").arg("-c").arg(&script).output().unwrap();
    let orphan: u32 = String::from_utf8_lossy(&o.stdout).trim().parse().unwrap();
    reap.add(orphan);
    let alive = |pid: u32| Proc::read(pid).is_some_and(|p| p.state != 'Z');
    assert!(
        alive(orphan),
        "the orphaned run is not running: {}",
        std::fs::read_to_string(&err).unwrap_or_default()
    );
    let held = {
        let m = last_step(&orphan_dir).memory;
        m.allocated_bytes.unwrap() + m.host_bytes.unwrap_or(0)
    };

    // A run of this user under its live launcher (this test).
    let kept = live_run(&t, "kept", 5, &mut reap);
    let kept_pid = kept.pid() as u32;

    let stale_of = |pid: u32| {
        let info: Value = serde_json::from_str(&command(&t, &["info", "--json"]).run().stdout).unwrap();
        let r = info["runs"].as_array().unwrap().iter().find(|r| r["pid"] == pid);
        r.unwrap_or_else(|| panic!("pid {pid} not among info's runs: {info:#}"))["stale"].clone()
    };
    assert_eq!(stale_of(orphan), "orphaned");
    assert_eq!(stale_of(kept_pid), Value::Null);
    let human = command(&t, &["info"]).run().stdout;
    let line = human.lines().find(|l| l.contains(&format!("pid {orphan}:"))).unwrap();
    assert!(line.contains("STALE: orphaned"), "{human}");

    // Dry run: listed, not touched.
    let dry = command(&t, &["clean"]).run().stdout;
    assert!(dry.contains("would end 1 process"), "{dry}");
    let line = dry
        .lines()
        .find(|l| l.contains(&format!("pid {orphan} ")))
        .unwrap_or_else(|| panic!("{dry}"));
    for want in [
        "job orphan",
        &orphan_dir.display().to_string(),
        "orphaned",
        &human_bytes(held),
    ] {
        assert!(line.contains(want), "clean's line lacks {want:?}: {line}");
    }
    assert!(
        !dry.contains(&format!("pid {kept_pid} ")),
        "a run under its launcher is not an orphan:\n{dry}"
    );
    // It is named as spared, so a run whose launcher ended before it registered can be found.
    let spared = dry
        .split("spared, under a live launcher (end one with --pid PID):")
        .nth(1)
        .unwrap_or_else(|| panic!("no spared runs listed:\n{dry}"));
    assert!(spared.contains(&format!("  {kept_pid} (job ")), "{dry}");
    assert!(alive(orphan), "a dry run ends nothing");

    // Stopped too (Ctrl-Z, SIGSTOP): flagged as stopped, and still an orphan to clean, which
    // lets it run again after SIGTERM so that it can act on it.
    assert_eq!(unsafe { libc::kill(orphan as i32, libc::SIGSTOP) }, 0);
    let until = Instant::now() + PATIENCE;
    while Proc::read(orphan).is_some_and(|p| p.state != 'T') {
        assert!(Instant::now() < until, "pid {orphan} never stopped");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(stale_of(orphan), "stopped");
    let dry = command(&t, &["clean"]).run().stdout;
    assert!(
        dry.contains(&format!("pid {orphan} ")) && dry.contains("has gone), stopped"),
        "{dry}"
    );

    // Other users' processes and missing ones are refused, before anything is done.
    let mut nobody = None;
    let other = if memtrain::procs::my_uid() == 0 {
        use std::os::unix::process::CommandExt;
        let child = Command::new("sleep").arg("600").uid(65534).gid(65534).spawn().unwrap();
        reap.add(child.id());
        let pid = child.id();
        nobody = Some(child);
        Some(pid)
    } else if Proc::read(1).is_some_and(|p| p.uid != memtrain::procs::my_uid()) {
        Some(1)
    } else {
        eprintln!(
            "skipping the other-user assertion: pid 1 is this user's and only root can start a process as another user"
        );
        None
    };
    if let Some(pid) = other {
        let owner = memtrain::procs::user_name(Proc::read(pid).unwrap().uid);
        command(&t, &["clean", "--yes", "--pid", &pid.to_string()])
            .exit(2)
            .stderr_has(&format!("belongs to user {owner}"))
            .stderr_has("never ends another user's process")
            .run();
        assert!(alive(pid), "another user's process is left alone");
    }
    if let Some(mut c) = nobody {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    let pid_max: u32 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    command(&t, &["clean", "--pid", &pid_max.to_string()])
        .exit(2)
        .stderr_has(&format!("--pid {pid_max}: no such process"))
        .run();
    // Named with --pid, this user's live run would be ended; the dry run says so.
    let named = command(&t, &["clean", "--pid", &kept_pid.to_string()]).run().stdout;
    assert!(
        named.contains(&format!("pid {kept_pid} ")) && named.contains("job kept"),
        "{named}"
    );

    // --yes: SIGTERM; the run saves its checkpoint and exits 130.
    let done = command(&t, &["clean", "--yes", "--grace", "120"]).run().stdout;
    assert!(done.contains(&format!("sent SIGTERM to pid {orphan} ")), "{done}");
    assert!(done.contains(&format!("pid {orphan} ended")), "{done}");
    assert!(
        done.contains(&format!("freed {} (1 process ended)", human_bytes(held))),
        "{done}"
    );
    let mut status = 0;
    assert_eq!(unsafe { libc::waitpid(orphan as i32, &mut status, 0) }, orphan as i32);
    assert_eq!(libc::WEXITSTATUS(status), 130, "the run stops as on Ctrl-C");
    let summary: memtrain::records::Summary = crate::common::typed(&orphan_dir.join("summary.json"));
    assert_eq!(summary.status, memtrain::records::Status::Interrupted);
    assert!(orphan_dir.join("checkpoints/step-000000005").is_dir());
    assert!(alive(kept_pid), "clean --yes spares a run whose launcher lives");
    let again = command(&t, &["clean"]).run().stdout;
    assert!(again.starts_with("nothing to clean"), "{again}");

    kept.signal(libc::SIGINT);
    kept.finish();
    assert_eq!(registered_files(&t), Vec::<PathBuf>::new());
}

#[test]
fn a_run_that_cannot_register_warns_and_trains() {
    let t = Test::new();
    let blocked = t.dir().join("a-file");
    std::fs::write(&blocked, "").unwrap();
    let o = t
        .clone()
        .env(RUNS_DIR, &blocked.join("runs").display().to_string())
        .args(&["--max-steps", "2"])
        .stderr_has("this run is not registered for `memtrain watch` and `clean`")
        .run();
    assert_eq!(o.summary().global_steps, 2);
}
