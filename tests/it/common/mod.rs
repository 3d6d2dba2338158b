//! One fixture for driving the built binary the way a user does, in the style of just's `Test`
//! builder: a spec as a TOML table, the command and its arguments, the environment, the expected
//! exit code; then assertions on the records the run left behind. Every run checks its exit
//! code, and every `Test` works in its own temporary directory (clones share it, so a test can
//! compare a run with its reference runs). A failing test keeps that directory and prints where.
//!
//! Records and the summary are read here only, through the typed reader (`Outcome::run_records`,
//! `Outcome::steps` and the other kinds, `Outcome::summary`), so that a renamed record field is a
//! compile error in the tests as well.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStderr, Command, Stdio};
use std::rc::Rc;
use std::sync::mpsc;
use std::time::Duration;

pub use memtrain::records::{
    CheckpointEvent, EpochEvent, Event, GrowBackEvent, OomEvent, OomReportFile, PreflightEvent, RunRecords, StartEvent,
    Status, StepEvent, Summary,
};
use toml::{Table, Value};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn digits() -> String {
    repo().join("data/digits.npz").display().to_string()
}

/// `program` with a clean environment: no allocator settings, backtraces or fault hooks from
/// the caller, which would change what memtrain does.
fn clean(program: impl AsRef<std::ffi::OsStr>) -> Command {
    let mut c = Command::new(program);
    c.current_dir(repo());
    c.env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .env_remove("RUST_BACKTRACE")
        .env_remove("MEMTRAIN_LOG");
    for (k, _) in std::env::vars() {
        if k.starts_with("MEMTRAIN_FAULT_") {
            c.env_remove(k);
        }
    }
    c
}

#[track_caller]
pub fn table(text: &str) -> Table {
    match text.parse() {
        Ok(t) => t,
        Err(e) => panic!("fixture spec does not parse: {e}\n{text}"),
    }
}

/// A small, fast, deterministic MLP job on the shipped digits data: 1438 training samples,
/// 45 steps an epoch.
pub fn digits_spec() -> Table {
    table(&format!(
        r#"[job]
name = "t"
threads = 1
device = "cpu"
[model]
preset = "mlp"
[model.mlp]
inputs = 64
hidden = [32]
num_classes = 10
[data]
source = "npz"
path = "{}"
val_fraction = 0.2
[train]
epochs = 3
batch_size = 32
optimizer = "adam"
lr = 0.01
[log]
progress = "lines"
"#,
        digits()
    ))
}

/// The DARTS supernet the tests train, small enough for seconds on a CPU: signals of 32 samples,
/// three cells of two nodes over five candidate operations (pooling, a separable convolution
/// and attention among them), 24 synthetic samples, SGD with momentum. Tests set what they vary.
pub fn darts_spec() -> Table {
    table(
        r#"[job]
threads = 1
device = "cpu"
[model]
preset = "darts"
[model.darts]
input_length = 32
init_channels = 8
num_cells = 3
num_nodes = 2
num_classes = 3
ops = ["none", "skip_connect", "max_pool_3", "sep_conv_3", "attention_light"]
[data]
samples = 24
[train]
epochs = 2
batch_size = 4
optimizer = "sgd"
lr = 0.05
momentum = 0.9
"#,
    )
}

/// Where the spec file comes from.
enum SpecSource {
    Table(Table),
    /// Verbatim text, for the tests whose errors point at a line and column.
    Text(String),
    /// A file another command wrote at `spec_path()` (`fit --write`), run as it is.
    Written,
    None,
}

/// The directory a test's runs share. A failing test keeps it, with its spec files, run
/// directories and reports, and prints its path.
struct TestDir(Option<tempfile::TempDir>);

impl TestDir {
    fn path(&self) -> &Path {
        self.0
            .as_ref()
            .expect("the directory lives as long as its tests")
            .path()
    }
}

impl Drop for TestDir {
    fn drop(&mut self) {
        if std::thread::panicking() {
            if let Some(d) = self.0.take() {
                eprintln!("the failed test's files are kept in {}", d.keep().display());
            }
        }
    }
}

/// A program that starts memtrain, such as torchrun: its arguments come before memtrain's path.
#[derive(Clone)]
struct Launcher {
    program: String,
    args: Vec<String>,
}

#[derive(Clone)]
#[must_use = "a Test does nothing until it is run"]
pub struct Test {
    dir: Rc<TestDir>,
    name: String,
    command: String,
    spec: Rc<SpecSource>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    out: bool,
    expected: Vec<i32>,
    stderr: Vec<String>,
    interrupt: Option<i64>,
    launcher: Option<Launcher>,
}

impl Default for Test {
    fn default() -> Self {
        Self::new()
    }
}

impl Test {
    /// `memtrain run` of the digits job in a fresh temporary directory, expected to succeed.
    pub fn new() -> Self {
        Test {
            dir: Rc::new(TestDir(Some(tempfile::tempdir().expect("a temporary directory")))),
            name: "run".into(),
            command: "run".into(),
            spec: Rc::new(SpecSource::Table(digits_spec())),
            args: vec![],
            env: vec![],
            out: true,
            expected: vec![0],
            stderr: vec![],
            interrupt: None,
            launcher: None,
        }
    }

    /// `memtrain run` of the DARTS job (`darts_spec`).
    pub fn darts() -> Self {
        Self::new().spec(darts_spec())
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The name of the spec file (`<name>.toml`) and of the run directory (`<name>/`).
    pub fn name(mut self, name: &str) -> Self {
        self.name = name.into();
        self
    }

    pub fn command(mut self, command: &str) -> Self {
        self.command = command.into();
        self
    }

    pub fn spec(mut self, spec: Table) -> Self {
        self.spec = Rc::new(SpecSource::Table(spec));
        self
    }

    pub fn spec_text(mut self, text: &str) -> Self {
        self.spec = Rc::new(SpecSource::Text(text.into()));
        self
    }

    /// The spec file at `spec_path()` is already there (another command wrote it): run it as
    /// it is.
    pub fn spec_written(mut self) -> Self {
        self.spec = Rc::new(SpecSource::Written);
        self
    }

    /// No spec file: the arguments say everything.
    pub fn no_spec(mut self) -> Self {
        self.spec = Rc::new(SpecSource::None);
        self.out = false;
        self
    }

    /// Sets a dotted key in the spec table (`"memory.limit"`), creating tables on the way.
    #[track_caller]
    pub fn set(self, key: &str, value: impl Into<Value>) -> Self {
        let mut t = self.table().clone();
        let parts: Vec<&str> = key.split('.').collect();
        let mut cur = &mut t;
        for p in &parts[..parts.len() - 1] {
            let entry = cur.entry(p.to_string()).or_insert_with(|| Value::Table(Table::new()));
            cur = match entry.as_table_mut() {
                Some(t) => t,
                None => panic!("{key}: {p} is not a table"),
            };
        }
        cur.insert(parts[parts.len() - 1].to_string(), value.into());
        self.spec(t)
    }

    #[track_caller]
    pub fn remove(self, key: &str) -> Self {
        let mut t = self.table().clone();
        let parts: Vec<&str> = key.split('.').collect();
        let mut cur = &mut t;
        for p in &parts[..parts.len() - 1] {
            cur = cur.get_mut(*p).and_then(Value::as_table_mut).expect(key);
        }
        cur.remove(parts[parts.len() - 1]);
        self.spec(t)
    }

    #[track_caller]
    pub fn table(&self) -> &Table {
        match &*self.spec {
            SpecSource::Table(t) => t,
            _ => panic!("this test's spec is not a table"),
        }
    }

    pub fn arg(mut self, a: &str) -> Self {
        self.args.push(a.into());
        self
    }

    pub fn args(mut self, a: &[&str]) -> Self {
        self.args.extend(a.iter().map(|s| s.to_string()));
        self
    }

    pub fn env(mut self, k: &str, v: &str) -> Self {
        self.env.push((k.into(), v.into()));
        self
    }

    /// Whether `run` gets `--out <dir>/<name>` (on by default for specs).
    pub fn out(mut self, on: bool) -> Self {
        self.out = on;
        self
    }

    pub fn exit(self, code: i32) -> Self {
        self.exit_in(&[code])
    }

    /// Any of these exit codes passes, for a probe whose outcome the test reads from the code.
    pub fn exit_in(mut self, codes: &[i32]) -> Self {
        self.expected = codes.to_vec();
        self
    }

    pub fn stderr_has(mut self, needle: &str) -> Self {
        self.stderr.push(needle.into());
        self
    }

    /// Sends SIGINT once the run has finished global step `step` (the run waits for it there,
    /// through a test hook), so the interruption lands at a known place without a race.
    pub fn interrupt_after_step(mut self, step: i64) -> Self {
        self.interrupt = Some(step);
        self
    }

    /// memtrain started by `program args... <memtrain> <command> ...`, as torchrun starts its
    /// workers.
    pub fn launched_by(mut self, program: &str, args: &[&str]) -> Self {
        self.launcher = Some(Launcher {
            program: program.into(),
            args: args.iter().map(|s| s.to_string()).collect(),
        });
        self
    }

    pub fn spec_path(&self) -> PathBuf {
        self.dir().join(format!("{}.toml", self.name))
    }

    pub fn out_dir(&self) -> PathBuf {
        self.dir().join(&self.name)
    }

    pub fn args_replaced(mut self, a: &[&str]) -> Self {
        self.args = a.iter().map(|s| s.to_string()).collect();
        self.expected = vec![0];
        self.stderr.clear();
        self.interrupt = None;
        self.env.retain(|(k, _)| !k.starts_with("MEMTRAIN_FAULT_"));
        self
    }

    /// Writes the spec file and builds the command line.
    #[track_caller]
    fn command_line(&self) -> (Vec<String>, Command) {
        let mut argv: Vec<String> = vec![self.command.clone()];
        let spec = match &*self.spec {
            SpecSource::Table(t) => Some(toml::to_string(t).expect("a spec table serializes")),
            SpecSource::Text(s) => Some(s.clone()),
            SpecSource::Written => None,
            SpecSource::None => None,
        };
        if let Some(text) = spec {
            if let Err(e) = std::fs::write(self.spec_path(), text) {
                panic!("writing {}: {e}", self.spec_path().display());
            }
        }
        if !matches!(&*self.spec, SpecSource::None) {
            argv.push(self.spec_path().display().to_string());
        }
        if self.out && self.command == "run" {
            argv.push("--out".into());
            argv.push(self.out_dir().display().to_string());
        }
        argv.extend(self.args.iter().cloned());
        let memtrain = env!("CARGO_BIN_EXE_memtrain");
        let mut cmd = match &self.launcher {
            None => clean(memtrain),
            Some(l) => {
                let mut c = clean(&l.program);
                c.args(&l.args).arg(memtrain);
                c
            }
        };
        cmd.args(&argv);
        // Each test's runs register in its own directory, never in the user's registry, where
        // `memtrain watch` and `clean` would find them.
        cmd.env("MEMTRAIN_RUNS_DIR", self.dir().join("registry"));
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        if let Some(step) = self.interrupt {
            cmd.env("MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP", step.to_string());
        }
        (argv, cmd)
    }

    /// Runs the command, checks the exit code and the expected stderr lines, and hands back what
    /// the run left behind.
    #[track_caller]
    pub fn run(self) -> Outcome {
        if let Some(step) = self.interrupt {
            let mut running = self.spawn();
            running.await_stderr(&format!("fault: waiting for a signal at step {step}"));
            running.signal(libc::SIGINT);
            return running.finish();
        }
        let (argv, mut cmd) = self.command_line();
        let o = match cmd.output() {
            Ok(o) => o,
            Err(e) => panic!("memtrain {argv:?} does not start: {e}"),
        };
        self.check(
            argv,
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    }

    /// Starts the command and returns while it runs, for a test that acts on it (a signal, a
    /// killed rank) when it prints a given line; `Running::finish` checks it as `run` does.
    #[track_caller]
    pub fn spawn(self) -> Running {
        let (argv, mut cmd) = self.command_line();
        cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => panic!("memtrain {argv:?} does not start: {e}"),
        };
        let stderr = BufReader::new(child.stderr.take().expect("stderr is piped"));
        let guard = HangGuard::start(child.id() as i32);
        Running {
            test: self,
            argv,
            child,
            stderr,
            seen: String::new(),
            guard,
        }
    }

    #[track_caller]
    fn check(self, argv: Vec<String>, code: i32, stdout: String, stderr: String) -> Outcome {
        assert!(
            self.expected.contains(&code),
            "memtrain {argv:?} exited {code}, expected {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            self.expected
                .iter()
                .map(i32::to_string)
                .collect::<Vec<_>>()
                .join(" or ")
        );
        for needle in &self.stderr {
            assert!(stderr.contains(needle.as_str()), "stderr lacks {needle:?}:\n{stderr}");
        }
        assert!(!stderr.contains("panicked"), "memtrain panicked:\n{stderr}");
        Outcome {
            out: self.out_dir(),
            code,
            stdout,
            stderr,
            test: self,
        }
    }
}

/// How long a started command may run before the fixture kills it: a test waiting for a line
/// that never comes fails instead of hanging the suite. Far above any test's run.
const HANG_GUARD: Duration = Duration::from_secs(900);

/// Kills a started command, and every process under it, once `HANG_GUARD` has passed; dropping
/// it disarms it.
struct HangGuard {
    _armed: mpsc::Sender<()>,
}

impl HangGuard {
    fn start(pid: i32) -> Self {
        let (armed, disarmed) = mpsc::channel::<()>();
        std::thread::spawn(move || {
            if disarmed.recv_timeout(HANG_GUARD) == Err(mpsc::RecvTimeoutError::Timeout) {
                eprintln!("memtrain (pid {pid}) still runs after {HANG_GUARD:?}: killing it");
                let mut all = descendants(pid);
                all.push(pid);
                for p in all {
                    unsafe { libc::kill(p, libc::SIGKILL) };
                }
            }
        });
        HangGuard { _armed: armed }
    }
}

/// The processes under `pid`, children before grandchildren, each level oldest first.
pub fn descendants(pid: i32) -> Vec<i32> {
    let mut out = children(pid);
    let mut i = 0;
    while i < out.len() {
        let more = children(out[i]);
        out.extend(more);
        i += 1;
    }
    out
}

/// The child processes of `pid`, oldest first (a launcher starts rank 0 first).
pub fn children(pid: i32) -> Vec<i32> {
    let mut out = vec![];
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        if let Ok(s) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(s.split_whitespace().filter_map(|p| p.parse::<i32>().ok()));
        }
    }
    out.sort();
    out
}

/// A started command (`Test::spawn`): its stderr is read as it comes.
#[must_use = "a started command is checked by `finish`"]
pub struct Running {
    test: Test,
    argv: Vec<String>,
    child: Child,
    stderr: BufReader<ChildStderr>,
    /// Its stderr so far.
    seen: String,
    guard: HangGuard,
}

impl Running {
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Reads stderr until a line holds `needle`; fails if the command ends first.
    #[track_caller]
    pub fn await_stderr(&mut self, needle: &str) {
        loop {
            let mut line = String::new();
            let n = match self.stderr.read_line(&mut line) {
                Ok(n) => n,
                Err(e) => panic!("reading the stderr of memtrain {:?}: {e}", self.argv),
            };
            if n == 0 {
                panic!(
                    "memtrain {:?} ended before printing {needle:?}; stderr:\n{}",
                    self.argv, self.seen
                );
            }
            self.seen.push_str(&line);
            if line.contains(needle) {
                return;
            }
        }
    }

    #[track_caller]
    pub fn signal(&self, signal: i32) {
        let rc = unsafe { libc::kill(self.pid(), signal) };
        assert_eq!(
            rc,
            0,
            "signal {signal} to pid {}: {}",
            self.pid(),
            std::io::Error::last_os_error()
        );
    }

    /// Waits for the command to end and checks it as `Test::run` does.
    #[track_caller]
    pub fn finish(self) -> Outcome {
        let Running {
            test,
            argv,
            child,
            mut stderr,
            mut seen,
            guard,
        } = self;
        if let Err(e) = stderr.read_to_string(&mut seen) {
            panic!("reading the stderr of memtrain {argv:?}: {e}");
        }
        // Its stderr is closed: it has ended, or is ending. Disarmed before it is reaped, so
        // the guard never signals a pid that may have been reused.
        drop(guard);
        let o = match child.wait_with_output() {
            Ok(o) => o,
            Err(e) => panic!("waiting for memtrain {argv:?}: {e}"),
        };
        test.check(
            argv,
            o.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&o.stdout).into_owned(),
            seen,
        )
    }
}

/// What a run left behind. Dropping it is fine: `run` has checked the exit code and stderr.
pub struct Outcome {
    pub test: Test,
    /// The run directory (`--out`).
    pub out: PathBuf,
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// One accessor per event kind: the run's events of that kind, in order, as their types.
macro_rules! events_of {
    ($($(#[$doc:meta])* $name:ident: $variant:ident($ty:ty);)*) => {$(
        $(#[$doc])*
        #[track_caller]
        #[must_use]
        pub fn $name(&self) -> Vec<$ty> {
            self.run_records()
                .events
                .into_iter()
                .filter_map(|e| match e {
                    Event::$variant(x) => Some(x),
                    _ => None,
                })
                .collect()
        }
    )*};
}

impl Outcome {
    /// summary.json, as the type that wrote it. Read strictly: a summary.json that is missing or
    /// does not read back fails the test (the reader would fall back to the `end` record).
    #[track_caller]
    #[must_use]
    pub fn summary(&self) -> Summary {
        typed(&self.out.join("summary.json"))
    }

    /// The run directory's records through the typed reader (`memtrain::records::read`): every
    /// line must read back as an event. Records a resumed session redid are dropped, as the
    /// report sees them: a test that must see them reads metrics.jsonl's lines itself.
    #[track_caller]
    #[must_use]
    pub fn run_records(&self) -> RunRecords {
        let r = match memtrain::records::read(&self.out) {
            Ok(r) => r,
            Err(e) => panic!("reading the records of {}: {e:#}", self.out.display()),
        };
        assert_eq!(
            r.unreadable_lines,
            0,
            "{}: lines that do not read back as an event",
            self.out.join("metrics.jsonl").display()
        );
        r
    }

    events_of! {
        starts: Start(StartEvent);
        preflights: Preflight(PreflightEvent);
        steps: Step(StepEvent);
        epochs: Epoch(EpochEvent);
        checkpoints: Checkpoint(CheckpointEvent);
        ooms: Oom(OomEvent);
        grow_backs: GrowBack(GrowBackEvent);
    }

    /// oom/report.json (the run's first OOM), as the type that wrote it.
    #[track_caller]
    #[must_use]
    pub fn oom_report(&self) -> OomReportFile {
        typed(&self.out.join("oom/report.json"))
    }

    /// The newest checkpoint's model file.
    #[track_caller]
    #[must_use]
    pub fn final_model(&self) -> PathBuf {
        final_model(&self.out)
    }

    /// The newest checkpoint's training state (`state.json` beside its model file). A checkpoint
    /// file, not a record, with no public type: read as JSON.
    #[track_caller]
    #[must_use]
    pub fn final_state(&self) -> serde_json::Value {
        json(&self.final_model().with_file_name("state.json"))
    }

    #[track_caller]
    #[must_use]
    pub fn final_bytes(&self) -> Bytes {
        file_bytes(&self.final_model())
    }

    /// The same spec again, resuming this run directory.
    pub fn resume(&self) -> Test {
        self.test
            .clone()
            .out(false)
            .args_replaced(&["--resume", self.out.to_str().expect("a UTF-8 path")])
    }
}

/// A JSON file as `T`, strictly: a file that is missing or does not read back fails the test.
#[track_caller]
#[must_use]
pub fn typed<T: serde::de::DeserializeOwned>(path: &Path) -> T {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => panic!(
            "{} does not read back as {}: {e}",
            path.display(),
            std::any::type_name::<T>()
        ),
    }
}

#[track_caller]
#[must_use]
pub fn json(path: &Path) -> serde_json::Value {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    match serde_json::from_str(&text) {
        Ok(v) => v,
        Err(e) => panic!("{} is not JSON: {e}", path.display()),
    }
}

/// The newest checkpoint's model file in a run directory.
#[track_caller]
#[must_use]
pub fn final_model(run_dir: &Path) -> PathBuf {
    let ck = run_dir.join("checkpoints");
    let entries = match std::fs::read_dir(&ck) {
        Ok(e) => e,
        Err(e) => panic!("reading {}: {e}", ck.display()),
    };
    let mut dirs: Vec<PathBuf> = entries
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("step-")))
        .collect();
    dirs.sort();
    match dirs.pop() {
        Some(d) => d.join("model.safetensors"),
        None => panic!("no checkpoint in {}", ck.display()),
    }
}

/// A run directory `dir` holding only `run_dir`'s resolved spec less its lines that set any of
/// the keys `drop` (as "limit ="): the run's weights read (`--checkpoint`) under another spec by
/// the commands that read a run directory. Its path, as an argument.
#[track_caller]
pub fn respecced(run_dir: &Path, dir: &Path, drop: &[&str]) -> String {
    let resolved = std::fs::read_to_string(run_dir.join("config.resolved.toml")).unwrap();
    std::fs::create_dir_all(dir).unwrap();
    let kept: Vec<&str> = resolved
        .lines()
        .filter(|l| !drop.iter().any(|k| l.trim_start().starts_with(k)))
        .collect();
    std::fs::write(dir.join("config.resolved.toml"), kept.join("\n")).unwrap();
    dir.display().to_string()
}

#[track_caller]
#[must_use]
pub fn tensors(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut v = match tch::Tensor::read_safetensors(path) {
        Ok(v) => v,
        Err(e) => panic!("reading {}: {e}", path.display()),
    };
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Largest absolute difference between two model files with the same names.
#[track_caller]
#[must_use]
pub fn max_abs_diff(a: &Path, b: &Path) -> f64 {
    let (ta, tb) = (tensors(a), tensors(b));
    assert_eq!(
        ta.iter().map(|t| &t.0).collect::<Vec<_>>(),
        tb.iter().map(|t| &t.0).collect::<Vec<_>>()
    );
    ta.iter()
        .zip(&tb)
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max)
}

/// File contents that compare byte for byte and print only their size.
#[derive(PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

#[track_caller]
#[must_use]
pub fn file_bytes(p: &Path) -> Bytes {
    match std::fs::read(p) {
        Ok(b) => Bytes(b),
        Err(e) => panic!("reading {}: {e}", p.display()),
    }
}

/// Runs tests/py/reference.py with the bootstrap environment's Python (torch 2.11 and
/// torchvision), the reference implementation the tests compare memtrain with, and returns its
/// standard output. `scripts/bootstrap` exports MEMTRAIN_PYTHON; without it these tests fail.
#[track_caller]
pub fn reference(dir: &Path, args: &[&str]) -> String {
    reference_with(dir, args, &[])
}

/// `reference` with extra environment variables.
#[track_caller]
pub fn reference_with(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> String {
    let python = python();
    let o = match Command::new(&python)
        .arg(repo().join("tests/py/reference.py"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .envs(env.iter().copied())
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!("cannot start {python}: {e}"),
    };
    assert!(
        o.status.success(),
        "reference.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).expect("reference.py prints UTF-8")
}

/// The bootstrap environment's Python (`MEMTRAIN_PYTHON`).
#[track_caller]
/// A benchmark script under scripts/bench (its dry runs need no GPU), with the bootstrap's
/// Python and this build's memtrain.
pub fn bench_script(script: &str, args: &[&str]) -> std::process::Output {
    Command::new(repo().join("scripts/bench").join(script))
        .current_dir(repo())
        .env("BENCH_PYTHON", python())
        .env("MEMTRAIN_BIN", env!("CARGO_BIN_EXE_memtrain"))
        .args(args)
        .output()
        .unwrap()
}

/// The command lines of a dry run that run `program` (comments left out).
pub fn command_lines<'a>(out: &'a str, program: &str) -> Vec<&'a str> {
    out.lines()
        .filter(|l| !l.starts_with('#') && l.contains(program))
        .collect()
}

/// A JSON array of numbers.
#[track_caller]
pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect()
}

/// A word-level tokenizer.json of `words`, their ids in order after `<unk>` = 0 and `</s>` = 1.
pub fn word_tokenizer<S: AsRef<str>>(path: &std::path::Path, words: &[S]) {
    let mut vocab = serde_json::json!({"<unk>": 0, "</s>": 1});
    for (i, w) in words.iter().enumerate() {
        vocab[w.as_ref()] = serde_json::json!(i + 2);
    }
    let t = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(path, t.to_string()).unwrap();
}

pub fn python() -> String {
    match std::env::var("MEMTRAIN_PYTHON") {
        Ok(p) => p,
        Err(_) => panic!(
            "MEMTRAIN_PYTHON is not set: run the tests through scripts/test, or eval \"$(scripts/bootstrap)\" first"
        ),
    }
}

/// torchvision's `model` with `classes` outputs, seeded, written by reference.py as
/// `dir/init.safetensors`; returns its `{"parameters", "names"}`.
#[track_caller]
pub fn torchvision_init(dir: &Path, model: &str, classes: &str) -> serde_json::Value {
    let out = reference(
        dir,
        &[
            "torchvision",
            "--model",
            model,
            "--classes",
            classes,
            "--out",
            "init.safetensors",
        ],
    );
    serde_json::from_str(&out).expect("reference.py prints JSON")
}

/// The per-step training losses a run recorded (with `log.every_steps = 1`).
#[track_caller]
#[must_use]
pub fn step_losses(o: &Outcome) -> Vec<f64> {
    o.steps().iter().map(|s| s.loss).collect()
}

/// The last epoch's validation accuracy in a summary.
#[track_caller]
#[must_use]
pub fn val_acc(s: &Summary) -> f64 {
    match s.last.as_ref().and_then(|e| e.val_acc) {
        Some(a) => a,
        None => panic!("the summary has no final validation accuracy: {s:?}"),
    }
}

/// Asserts two loss curves agree within `rel` relative difference, step by step.
#[track_caller]
pub fn assert_close(ours: &[f64], theirs: &[f64], rel: f64) {
    assert_eq!(ours.len(), theirs.len(), "step counts differ: {ours:?} vs {theirs:?}");
    for (i, (a, b)) in ours.iter().zip(theirs).enumerate() {
        let d = (a - b).abs() / b.abs().max(1e-12);
        assert!(
            d <= rel,
            "step {}: memtrain {a} vs PyTorch {b} (relative {d:e} > {rel:e})",
            i + 1
        );
    }
}

/// Set in a child process of this test binary that runs one test alone; its value is the test.
const ALONE: &str = "MEMTRAIN_TEST_ALONE";

/// Runs `body` as the only test in a fresh process of this test binary, for a test that changes
/// process-wide state (the CPU allocator's cap) or counts every allocation the process makes,
/// which the other tests' threads would disturb. `test` is its path as the harness names it
/// (`module::function`); the child must report that one test passed.
#[track_caller]
pub fn alone(test: &str, body: fn()) {
    if std::env::var(ALONE).as_deref() == Ok(test) {
        return body();
    }
    let exe = std::env::current_exe().expect("the test binary's path");
    let o = match Command::new(&exe)
        .args([test, "--exact", "--test-threads=1", "--nocapture"])
        .env(ALONE, test)
        .output()
    {
        Ok(o) => o,
        Err(e) => panic!("{} does not start again: {e}", exe.display()),
    };
    let (stdout, stderr) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(
        o.status.success(),
        "{test}, alone in its own process, failed:\n{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("test result: ok. 1 passed"),
        "{test} did not run in its own process (is that its path?):\n{stdout}"
    );
}
