//! What the placement levers (state, gradients, activations, parameters to the host) share.
use super::cpu::CpuFallback;
use super::lever::{Described, Lever, Situation};

/// What every placement lever checks: not engaged yet, and a device to leave.
pub fn applies(l: &dyn Lever, s: &Situation, what: &str) -> Result<(), String> {
    if s.at.engaged.contains(l.name()) {
        Err(format!("already on the host ({what})"))
    } else if s.at.engaged.contains(CpuFallback.name()) {
        Err("the run fell back to the CPU, where device and host are one memory".into())
    } else {
        Ok(())
    }
}
