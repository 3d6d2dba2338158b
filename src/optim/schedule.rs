//! Learning-rate schedules: warmup, then constant, step decay or cosine decay.
use crate::spec::schema::{Schedule, Train};

/// The learning rate as a function of the optimizer step.
///
/// `lr_at(step)` takes `step`, the number of optimizer steps already taken (0 for the first
/// update):
///
/// * Warmup: for `step < warmup_steps`, `base_lr * (step + 1) / warmup_steps`, rising linearly
///   to `base_lr` at the last warmup step (no warmup when `warmup_steps <= 0`).
/// * After warmup:
///   * `Constant`: `base_lr`.
///   * `Step`: `base_lr * gamma^floor(epoch / step_epochs)`, with `epoch = floor(step /
///     steps_per_epoch)` counted from step 0 (warmup steps included).
///   * `Cosine`: `min_lr + (base_lr - min_lr) * (1 + cos(pi * t / T)) / 2` with
///     `t = step - warmup_steps` clamped to `T = max(1, total_steps - warmup_steps)`, so the
///     rate reaches `min_lr` at `total_steps` and stays there.
///
/// `steps_per_epoch` and `step_epochs` below 1 are treated as 1; a negative `step` as 0.
#[derive(Debug, Clone)]
pub struct LrSchedule {
    pub base_lr: f64,
    pub schedule: Schedule,
    pub warmup_steps: i64,
    pub step_epochs: i64,
    pub gamma: f64,
    pub min_lr: f64,
    pub total_steps: i64,
    pub steps_per_epoch: i64,
}

impl LrSchedule {
    /// The schedule of a job's `[train]` table, for a run of `total_steps` optimizer steps with
    /// `steps_per_epoch` of them per epoch.
    pub fn from_train(t: &Train, total_steps: i64, steps_per_epoch: i64) -> Self {
        LrSchedule {
            base_lr: t.lr,
            schedule: t.schedule,
            warmup_steps: t.warmup_steps,
            step_epochs: t.lr_step_epochs,
            gamma: t.lr_gamma,
            min_lr: t.min_lr,
            total_steps,
            steps_per_epoch,
        }
    }

    /// Learning rate for the update after `step` steps have been taken (see the type's docs).
    pub fn lr_at(&self, step: i64) -> f64 {
        let step = step.max(0);
        if step < self.warmup_steps {
            return self.base_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.schedule {
            Schedule::Constant => self.base_lr,
            Schedule::Step => {
                let epoch = step / self.steps_per_epoch.max(1);
                let decays = epoch / self.step_epochs.max(1);
                self.base_lr * self.gamma.powf(decays as f64)
            }
            Schedule::Cosine => {
                let warmup = self.warmup_steps.max(0);
                let total = (self.total_steps - warmup).max(1);
                let t = (step - warmup).min(total);
                let cos = (std::f64::consts::PI * t as f64 / total as f64).cos();
                self.min_lr + (self.base_lr - self.min_lr) * (1.0 + cos) / 2.0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(kind: Schedule, warmup: i64) -> LrSchedule {
        LrSchedule {
            base_lr: 0.1,
            schedule: kind,
            warmup_steps: warmup,
            step_epochs: 2,
            gamma: 0.5,
            min_lr: 0.01,
            total_steps: 14,
            steps_per_epoch: 3,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12
    }

    #[test]
    fn lr_constant() {
        let s = schedule(Schedule::Constant, 0);
        for step in [0, 1, 5, 100] {
            assert_eq!(s.lr_at(step), 0.1);
        }
        // Warmup: 0.1 * (step + 1) / 4 for steps 0..4.
        let s = schedule(Schedule::Constant, 4);
        let want = [0.025, 0.05, 0.075, 0.1, 0.1, 0.1];
        for (step, w) in want.iter().enumerate() {
            assert!(close(s.lr_at(step as i64), *w), "step {step}: {}", s.lr_at(step as i64));
        }
    }

    #[test]
    fn lr_step() {
        // 3 steps per epoch, halved every 2 epochs: steps 0-5 -> 0.1, 6-11 -> 0.05, 12-17 -> 0.025.
        let s = schedule(Schedule::Step, 0);
        for (step, w) in [(0, 0.1), (5, 0.1), (6, 0.05), (11, 0.05), (12, 0.025), (18, 0.0125)] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
        // Warmup first (steps 0, 1), then the epoch count runs from step 0.
        let s = schedule(Schedule::Step, 2);
        for (step, w) in [(0, 0.05), (1, 0.1), (2, 0.1), (6, 0.05)] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
    }

    #[test]
    fn lr_cosine() {
        // No warmup: T = 14; t = 0 -> 0.1, t = 7 (half) -> 0.055, t >= 14 -> 0.01.
        let s = schedule(Schedule::Cosine, 0);
        for (step, w) in [(0, 0.1), (7, 0.055), (14, 0.01), (20, 0.01)] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
        // Warmup 2: steps 0, 1 warm up; then T = 12, so step 5 (t = 3) is a quarter of the way:
        // 0.01 + 0.09 * (1 + cos(pi/4)) / 2 = 0.01 + 0.045 * (1 + 0.70710678...) = 0.0868198051533946.
        let s = schedule(Schedule::Cosine, 2);
        for (step, w) in [
            (0, 0.05),
            (1, 0.1),
            (2, 0.1),
            (5, 0.0868198051533946),
            (8, 0.055),
            (14, 0.01),
        ] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
    }
}
