//! Ctrl-C and SIGTERM: the first asks the loop to stop after the current step (it saves a
//! checkpoint and exits 130); a second Ctrl-C ends the process at once.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Result;
use signal_hook::consts::{SIGINT, SIGTERM};

#[derive(Clone)]
pub struct StopFlag(Arc<AtomicBool>);

impl StopFlag {
    pub fn install() -> Result<Self> {
        let flag = Arc::new(AtomicBool::new(false));
        for sig in [SIGINT, SIGTERM] {
            // Registered first, so it sees the flag before the second handler sets it: the
            // second signal terminates with 130 instead of setting an already-set flag.
            signal_hook::flag::register_conditional_shutdown(sig, 130, Arc::clone(&flag))?;
            signal_hook::flag::register(sig, Arc::clone(&flag))?;
        }
        Ok(StopFlag(flag))
    }

    pub fn requested(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}
