//! Dynamic loss scaling for fp16-mixed training, with PyTorch's `GradScaler` semantics: the loss
//! is multiplied by `scale` before backward, gradients are unscaled (one fused kernel that also
//! looks for inf and NaN) before clipping, and a step whose gradients are not finite is skipped.
//! After every step the scale halves on inf/NaN, and doubles after `GROWTH_INTERVAL`
//! consecutive finite steps (`_amp_update_scale_`).
//!
//! The state lives on the host: the step reads `found_inf` anyway to decide whether to step (as
//! `GradScaler.step` does), and a host-side update is applied only after the step succeeded, so a
//! step that an OOM unwinds leaves the scaler untouched. The scale is always a power of two, so
//! multiplying by it and by its reciprocal is exact.
use serde::{Deserialize, Serialize};

pub const INIT_SCALE: f64 = 65536.0;
pub const GROWTH_FACTOR: f64 = 2.0;
pub const BACKOFF_FACTOR: f64 = 0.5;
pub const GROWTH_INTERVAL: i64 = 2000;

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GradScaler {
    pub scale: f64,
    /// Consecutive finite steps since the scale last changed.
    pub growth_tracker: i64,
    /// Steps skipped because their gradients were not finite.
    pub skipped_steps: u64,
}

impl Default for GradScaler {
    fn default() -> Self {
        GradScaler {
            scale: INIT_SCALE,
            growth_tracker: 0,
            skipped_steps: 0,
        }
    }
}

impl GradScaler {
    /// After a step: `found_inf` says whether its gradients held inf or NaN (the step was
    /// skipped).
    pub fn update(&mut self, found_inf: bool) {
        if found_inf {
            self.scale *= BACKOFF_FACTOR;
            self.growth_tracker = 0;
            self.skipped_steps += 1;
        } else {
            self.growth_tracker += 1;
            if self.growth_tracker == GROWTH_INTERVAL {
                self.scale *= GROWTH_FACTOR;
                self.growth_tracker = 0;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backs_off_on_inf_and_grows_after_the_interval() {
        let mut s = GradScaler::default();
        assert_eq!(s.scale, 65536.0);
        s.update(true);
        assert_eq!((s.scale, s.growth_tracker, s.skipped_steps), (32768.0, 0, 1));
        for _ in 0..GROWTH_INTERVAL - 1 {
            s.update(false);
        }
        assert_eq!((s.scale, s.growth_tracker), (32768.0, GROWTH_INTERVAL - 1));
        s.update(false);
        assert_eq!((s.scale, s.growth_tracker), (65536.0, 0));
        // An inf in the middle of a streak resets it.
        for _ in 0..10 {
            s.update(false);
        }
        s.update(true);
        assert_eq!((s.scale, s.growth_tracker, s.skipped_steps), (32768.0, 0, 2));
    }
}
