//! Fault injection for the tests that must produce a failure at one exact place: an OOM inside
//! the optimizer step, a crash half-way through a save, a signal at a known step. Each is off
//! unless its environment variable is set; documented in the README's environment section as
//! test-only.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::shim;

/// `MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP=N`: at global step N's first attempt, the CPU cap is
/// lowered to the bytes allocated when the optimizer step begins, so its first allocation fails
/// for real in the counting allocator. The guard puts the cap back when the step ends or unwinds.
/// `N@R` fires on data-parallel rank R only (the RANK variable), for an OOM on one rank.
pub const OOM_IN_OPTIMIZER: &str = "MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP";

static FIRED: AtomicBool = AtomicBool::new(false);

pub struct Squeeze {
    restore: Option<Option<u64>>,
}

impl Drop for Squeeze {
    fn drop(&mut self) {
        if let Some(cap) = self.restore {
            shim::cpu_alloc_set_cap(cap);
        }
    }
}

pub fn squeeze_before_optimizer(step: i64) -> Squeeze {
    // Read once: this runs on every training step.
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(OOM_IN_OPTIMIZER, &WANTED) != Some(step) || FIRED.swap(true, Ordering::SeqCst) {
        return Squeeze { restore: None };
    }
    let s = shim::cpu_alloc_stats();
    shim::cpu_alloc_set_cap(Some(s.allocated.max(1)));
    Squeeze { restore: Some(s.cap) }
}

fn step_from(var: &'static str, cell: &'static OnceLock<Option<i64>>) -> Option<i64> {
    *cell.get_or_init(|| {
        let v = std::env::var(var).ok()?;
        match v.split_once('@') {
            Some((step, rank)) => {
                let here = std::env::var("RANK").ok()?;
                (here.trim() == rank.trim()).then(|| step.parse().ok()).flatten()
            }
            None => v.parse().ok(),
        }
    })
}

/// `MEMTRAIN_FAULT_ABORT_SAVE_AT_STEP=N`: the checkpoint save for global step N aborts the
/// process after writing its first file, as a power cut would.
pub const ABORT_SAVE: &str = "MEMTRAIN_FAULT_ABORT_SAVE_AT_STEP";

pub fn abort_save_at(step: i64) {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(ABORT_SAVE, &WANTED) == Some(step) {
        std::process::abort();
    }
}

/// `MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP=N`: after global step N the loop prints
/// `fault: waiting for a signal at step N` to stderr and waits until Ctrl-C or SIGTERM arrives,
/// so a test can interrupt a run at a known step without racing it.
pub const AWAIT_SIGNAL: &str = "MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP";

pub fn await_signal_at(step: i64, stop: impl Fn() -> bool) {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(AWAIT_SIGNAL, &WANTED) != Some(step) {
        return;
    }
    eprintln!("fault: waiting for a signal at step {step}");
    while !stop() {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// `MEMTRAIN_FAULT_INF_GRAD_AT_STEP=N`: at global step N, after backward, the first gradient of
/// the weight optimizer becomes inf, as an fp16 overflow would make it; the loss scaler must
/// skip that step and back off.
pub const INF_GRAD: &str = "MEMTRAIN_FAULT_INF_GRAD_AT_STEP";

/// `grads` lists the step's gradients; asked for only when the fault fires.
pub fn plant_inf_at(step: i64, grads: impl FnOnce() -> Vec<tch::Tensor>) {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(INF_GRAD, &WANTED) == Some(step) {
        if let Some(g) = grads().first() {
            let _ = g.shallow_clone().fill_(f64::INFINITY);
        }
    }
}
