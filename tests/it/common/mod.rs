//! One fixture for driving the built binary the way a user does, in the style of just's `Test`
//! builder: a spec as a TOML table, the command and its arguments, the environment, the expected
//! exit code; then assertions on the records the run left behind. Every run checks its exit
//! code, and every `Test` works in its own temporary directory (clones share it, so a test can
//! compare a run with its reference runs).
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::rc::Rc;

use toml::{Table, Value};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn digits() -> String {
    repo().join("data/digits.npz").display().to_string()
}

/// The binary with a clean environment: no allocator settings or backtraces from the caller.
pub fn memtrain() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memtrain"));
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

pub fn table(text: &str) -> Table {
    text.parse()
        .unwrap_or_else(|e| panic!("fixture spec does not parse: {e}\n{text}"))
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

enum SpecSource {
    Table(Table),
    /// Verbatim text, for the tests whose errors point at a line and column.
    Text(String),
    None,
}

#[derive(Clone)]
pub struct Test {
    dir: Rc<tempfile::TempDir>,
    name: String,
    command: String,
    spec: Rc<SpecSource>,
    args: Vec<String>,
    env: Vec<(String, String)>,
    out: bool,
    expected: i32,
    stderr: Vec<String>,
    interrupt: Option<i64>,
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
            dir: Rc::new(tempfile::tempdir().unwrap()),
            name: "run".into(),
            command: "run".into(),
            spec: Rc::new(SpecSource::Table(digits_spec())),
            args: vec![],
            env: vec![],
            out: true,
            expected: 0,
            stderr: vec![],
            interrupt: None,
        }
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

    /// No spec file: the arguments say everything.
    pub fn no_spec(mut self) -> Self {
        self.spec = Rc::new(SpecSource::None);
        self.out = false;
        self
    }

    /// Sets a dotted key in the spec table (`"memory.limit"`), creating tables on the way.
    pub fn set(self, key: &str, value: impl Into<Value>) -> Self {
        let mut t = self.table().clone();
        let parts: Vec<&str> = key.split('.').collect();
        let mut cur = &mut t;
        for p in &parts[..parts.len() - 1] {
            cur = cur
                .entry(p.to_string())
                .or_insert_with(|| Value::Table(Table::new()))
                .as_table_mut()
                .unwrap_or_else(|| panic!("{key}: {p} is not a table"));
        }
        cur.insert(parts[parts.len() - 1].to_string(), value.into());
        self.spec(t)
    }

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

    pub fn exit(mut self, code: i32) -> Self {
        self.expected = code;
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

    pub fn spec_path(&self) -> PathBuf {
        self.dir().join(format!("{}.toml", self.name))
    }

    pub fn out_dir(&self) -> PathBuf {
        self.dir().join(&self.name)
    }

    /// Runs the command, checks the exit code and the expected stderr lines, and hands back what
    /// the run left behind.
    pub fn run(self) -> Outcome {
        let mut argv: Vec<String> = vec![self.command.clone()];
        match &*self.spec {
            SpecSource::Table(t) => {
                std::fs::write(self.spec_path(), toml::to_string(t).unwrap()).unwrap();
                argv.push(self.spec_path().display().to_string());
            }
            SpecSource::Text(s) => {
                std::fs::write(self.spec_path(), s).unwrap();
                argv.push(self.spec_path().display().to_string());
            }
            SpecSource::None => {}
        }
        if self.out && self.command == "run" {
            argv.push("--out".into());
            argv.push(self.out_dir().display().to_string());
        }
        argv.extend(self.args.iter().cloned());
        let mut cmd = memtrain();
        cmd.args(&argv);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        let (code, stdout, stderr) = match self.interrupt {
            None => {
                let o = cmd.output().expect("memtrain starts");
                (
                    o.status.code().unwrap_or(-1),
                    String::from_utf8_lossy(&o.stdout).into_owned(),
                    String::from_utf8_lossy(&o.stderr).into_owned(),
                )
            }
            Some(step) => interrupted(cmd, step),
        };
        assert_eq!(
            code, self.expected,
            "memtrain {argv:?} exited {code}, expected {}\nstdout:\n{stdout}\nstderr:\n{stderr}",
            self.expected
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

fn interrupted(mut cmd: Command, step: i64) -> (i32, String, String) {
    use std::io::{BufRead, BufReader, Read};
    cmd.env("MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP", step.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("memtrain starts");
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut stderr = String::new();
    let marker = format!("fault: waiting for a signal at step {step}");
    loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("the run ended before step {step}:\n{stderr}");
        }
        stderr.push_str(&line);
        if line.contains(&marker) {
            break;
        }
    }
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    err.read_to_string(&mut stderr).unwrap();
    let o = child.wait_with_output().unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr,
    )
}

pub struct Outcome {
    pub test: Test,
    /// The run directory (`--out`).
    pub out: PathBuf,
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Outcome {
    pub fn summary(&self) -> serde_json::Value {
        json(&self.out.join("summary.json"))
    }

    pub fn records(&self, kind: &str) -> Vec<serde_json::Value> {
        records(&self.out, kind)
    }

    pub fn final_model(&self) -> PathBuf {
        final_model(&self.out)
    }

    pub fn final_bytes(&self) -> Bytes {
        Bytes(std::fs::read(self.final_model()).unwrap())
    }

    /// The same spec again, resuming this run directory.
    pub fn resume(&self) -> Test {
        self.test
            .clone()
            .out(false)
            .args_replaced(&["--resume", self.out.to_str().unwrap()])
    }
}

impl Test {
    pub fn args_replaced(mut self, a: &[&str]) -> Self {
        self.args = a.iter().map(|s| s.to_string()).collect();
        self.expected = 0;
        self.stderr.clear();
        self.interrupt = None;
        self.env.retain(|(k, _)| !k.starts_with("MEMTRAIN_FAULT_"));
        self
    }
}

pub fn json(path: &Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

pub fn records(run_dir: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["type"] == kind)
        .collect()
}

/// The newest checkpoint's model file.
pub fn final_model(run_dir: &Path) -> PathBuf {
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(run_dir.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("step-"))
        .collect();
    dirs.sort();
    dirs.pop().expect("a checkpoint").join("model.safetensors")
}

pub fn tensors(path: &Path) -> Vec<(String, tch::Tensor)> {
    let mut v = tch::Tensor::read_safetensors(path).unwrap();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Largest absolute difference between two model files with the same names.
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

/// File contents that compare byte for byte and print only their size and first difference.
#[derive(PartialEq, Eq)]
pub struct Bytes(pub Vec<u8>);

impl std::fmt::Debug for Bytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} bytes", self.0.len())
    }
}

pub fn file_bytes(p: &Path) -> Bytes {
    Bytes(std::fs::read(p).unwrap_or_else(|e| panic!("reading {}: {e}", p.display())))
}

/// Runs tests/py/reference.py with the bootstrap environment's Python (torch 2.11 and
/// torchvision), the reference implementation the tests compare memtrain with, and returns its
/// standard output. `scripts/bootstrap` exports MEMTRAIN_PYTHON; without it these tests fail.
pub fn reference(dir: &Path, args: &[&str]) -> String {
    let python = std::env::var("MEMTRAIN_PYTHON").unwrap_or_else(|_| {
        panic!("MEMTRAIN_PYTHON is not set: run the tests through scripts/test, or eval \"$(scripts/bootstrap)\" first")
    });
    let o = Command::new(&python)
        .arg(repo().join("tests/py/reference.py"))
        .args(args)
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap_or_else(|e| panic!("cannot start {python}: {e}"));
    assert!(
        o.status.success(),
        "reference.py {args:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8(o.stdout).unwrap()
}

/// torchvision's `model` with `classes` outputs, seeded, written by reference.py as
/// `dir/init.safetensors`; returns its `{"parameters", "names"}`.
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
    serde_json::from_str(&out).unwrap()
}

/// The per-step training losses a run recorded (with `log.every_steps = 1`).
pub fn step_losses(o: &Outcome) -> Vec<f64> {
    o.records("step").iter().map(|r| r["loss"].as_f64().unwrap()).collect()
}

/// Asserts two loss curves agree within `rel` relative difference, step by step.
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
