//! Helpers for driving the built binary the way a user does: real files, real processes.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub fn digits() -> String {
    repo().join("data/digits.npz").display().to_string()
}

pub fn memtrain() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memtrain"));
    c.current_dir(repo());
    c.env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF")
        .env_remove("RUST_BACKTRACE");
    c
}

pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    pub fn from(o: Output) -> Self {
        Run {
            code: o.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
        }
    }

    pub fn ok(self) -> Self {
        assert_eq!(
            self.code, 0,
            "expected success\nstdout:\n{}\nstderr:\n{}",
            self.stdout, self.stderr
        );
        self
    }
}

pub fn run(args: &[&str]) -> Run {
    Run::from(memtrain().args(args).output().expect("memtrain starts"))
}

pub fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

/// A small, fast, deterministic spec on the shipped digits data.
pub fn digits_spec(extra: &str) -> String {
    format!(
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
{extra}"#,
        digits()
    )
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

/// Writes `spec` as `<name>.toml` in `dir` and runs it into `<dir>/<name>`.
pub fn run_spec(dir: &Path, name: &str, spec: &str, extra: &[&str]) -> (Run, PathBuf) {
    let p = write(dir, &format!("{name}.toml"), spec);
    let out = dir.join(name);
    let mut args = vec!["run", p.to_str().unwrap(), "--out", out.to_str().unwrap()];
    args.extend_from_slice(extra);
    (run(&args), out)
}
