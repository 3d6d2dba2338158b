//! The steps' wait for their batches, as the records carry it: per step record, per epoch, and
//! the epoch line's note when the wait takes a noticeable share of training.

/// A wait above this share of the epoch's training time is noted on the epoch line.
pub const WAIT_SHARE: f64 = 0.10;

#[derive(Debug, Default)]
pub struct DataWait {
    /// Seconds waited since the last step record, and in the epoch.
    line: f64,
    epoch: f64,
    /// Whether the note has named the keys that help, which it does once.
    told: bool,
    /// The (epoch, micro-batch) the loader's plan was made for.
    planned: Option<(i64, i64)>,
}

impl DataWait {
    pub fn add(&mut self, seconds: f64) {
        self.line += seconds;
        self.epoch += seconds;
    }

    /// The wait per step over the `steps` steps since the last step record.
    pub fn take_line(&mut self, steps: u32) -> f64 {
        std::mem::take(&mut self.line) / steps.max(1) as f64
    }

    /// The epoch's total wait.
    pub fn take_epoch(&mut self) -> f64 {
        self.line = 0.0;
        std::mem::take(&mut self.epoch)
    }

    /// Whether the loader needs a new plan for this epoch and micro-batch (and records that it
    /// gets one).
    pub fn needs_plan(&mut self, epoch: i64, micro_batch: i64) -> bool {
        let key = Some((epoch, micro_batch));
        let new = self.planned != key;
        self.planned = key;
        new
    }

    /// The epoch line's note when `wait` is over [`WAIT_SHARE`] of the epoch's `seconds`: the
    /// share, and the first time, the keys that shorten it. Empty otherwise.
    pub fn note(&mut self, wait: f64, seconds: f64) -> String {
        let share = wait / seconds.max(1e-9);
        if share <= WAIT_SHARE {
            return String::new();
        }
        let mut s = format!("  data wait {:.0}% of step time", share * 100.0);
        if !std::mem::replace(&mut self.told, true) {
            s.push_str(" (the steps wait for their batches: raise data.workers or data.prefetch)");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_note_names_the_keys_once_and_only_over_the_share() {
        let mut w = DataWait::default();
        assert_eq!(w.note(0.5, 10.0), "");
        let first = w.note(2.0, 10.0);
        assert!(
            first.contains("20%") && first.contains("data.workers") && first.contains("data.prefetch"),
            "{first}"
        );
        let second = w.note(3.0, 10.0);
        assert!(second.contains("30%") && !second.contains("data.workers"), "{second}");
        w.add(1.0);
        w.add(3.0);
        assert_eq!(w.take_line(2), 2.0);
        assert_eq!(w.take_line(2), 0.0);
        assert_eq!(w.take_epoch(), 4.0);
        assert!(w.needs_plan(0, 8) && !w.needs_plan(0, 8) && w.needs_plan(0, 4) && w.needs_plan(1, 4));
    }
}
