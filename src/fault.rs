//! Fault injection for the tests that must produce a failure at one exact place (an OOM inside
//! the optimizer step). Off unless its environment variable is set; documented in the README's
//! environment section as test-only.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::shim;

/// `MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP=N`: at global step N's first attempt, the CPU cap is
/// lowered to the bytes allocated when the optimizer step begins, so its first allocation fails
/// for real in the counting allocator. The guard puts the cap back when the step ends or unwinds.
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
    let wanted = *WANTED.get_or_init(|| std::env::var(OOM_IN_OPTIMIZER).ok().and_then(|v| v.parse().ok()));
    if wanted != Some(step) || FIRED.swap(true, Ordering::SeqCst) {
        return Squeeze { restore: None };
    }
    let s = shim::cpu_alloc_stats();
    shim::cpu_alloc_set_cap(Some(s.allocated.max(1)));
    Squeeze { restore: Some(s.cap) }
}
