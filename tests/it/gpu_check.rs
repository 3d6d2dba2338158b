//! scripts/gpu-check on a machine without a GPU: its self-test (the readers, judges and table,
//! and a CPU rehearsal of the checks whose meaning survives the move, against this build), and
//! its refusal, fast and saying why, to run the CUDA checks.
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;

fn gpu_check() -> Command {
    let mut c = Command::new(repo().join("scripts/gpu-check"));
    c.current_dir(repo())
        .env("PYTHON", python())
        .env("MEMTRAIN_BIN", env!("CARGO_BIN_EXE_memtrain"))
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF");
    c
}

#[test]
fn gpu_check_passes_its_self_test() {
    let o = gpu_check().arg("--self-test").output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "scripts/gpu-check --self-test failed:\n{err}");
    assert!(err.contains("OK"), "{err}");
    assert!(
        !err.contains("skipped"),
        "the rehearsal must run here (MEMTRAIN_BIN is set):\n{err}"
    );
}

#[test]
fn gpu_check_without_a_gpu_stops_at_once_and_says_why() {
    if tch::Cuda::is_available() {
        eprintln!("skipped: this machine has a CUDA device");
        return;
    }
    let t = Instant::now();
    let o = gpu_check().output().unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("gpu-check: no CUDA device: torch.cuda.is_available() is False"),
        "{err}"
    );
    assert!(o.stdout.is_empty(), "no table without checks");
    assert!(t.elapsed() < Duration::from_secs(60), "took {:?}", t.elapsed());
}
