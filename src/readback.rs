//! Reading values off the device, counted.
//!
//! On a GPU every read of a value the device computed waits for the device to finish all the
//! work queued before it: the host stops feeding the GPU until then. The step pipeline keeps
//! such reads out of the step (the loss stays on the device until a logged step, the clip norm
//! is never read, validation sums on the device), and every read it does make goes through
//! here, so that a run's records can show how many there were (`host_reads` in step and epoch
//! records and in the summary) and a test can hold the pipeline to it. The count is the same
//! on the CPU, where a read costs nothing, so the CPU tests check what a GPU run would do.
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

static READS: AtomicU64 = AtomicU64::new(0);

/// Reads made by this process so far.
pub fn count() -> u64 {
    READS.load(Ordering::Relaxed)
}

/// The values of scalar tensors, in one read: stacked as f64 where they are, then copied to
/// the host together. Integer counts below 2^53 come back exact.
pub fn values(ts: &[&Tensor]) -> Result<Vec<f64>> {
    let Some(first) = ts.first() else {
        return Ok(vec![]);
    };
    let device = first.device();
    let parts: Vec<Tensor> = ts
        .iter()
        .map(|t| t.reshape([-1]).to_kind(Kind::Double).to_device(device))
        .collect();
    READS.fetch_add(1, Ordering::Relaxed);
    Vec::<f64>::try_from(Tensor::cat(&parts, 0).to_device(Device::Cpu)).context("reading values off the device")
}

/// A whole tensor's values (a collective's result, say), in one read.
pub fn all(t: &Tensor) -> Result<Vec<f64>> {
    READS.fetch_add(1, Ordering::Relaxed);
    Vec::<f64>::try_from(t.to_kind(Kind::Double).to_device(Device::Cpu)).context("reading values off the device")
}

/// A read staged to the host without waiting (the tally's, see `Tally::stage`): it takes the
/// values the device has when its work so far is done, so it counts as a read, but the host
/// collects them later instead of stalling the device now.
pub fn staged() {
    READS.fetch_add(1, Ordering::Relaxed);
}

/// Whether a one-value flag (the scaler's found-inf) is set, in one read.
pub fn flag(t: &Tensor) -> bool {
    READS.fetch_add(1, Ordering::Relaxed);
    t.double_value(&[0]) > 0.0
}

/// Reads since a mark: what one stretch of the run (the steps since the last record) made.
#[derive(Debug, Clone, Copy)]
pub struct Mark(u64);

impl Mark {
    pub fn now() -> Mark {
        Mark(count())
    }

    /// Reads since this mark; the mark moves to now.
    pub fn take(&mut self) -> u64 {
        let now = count();
        let n = now.saturating_sub(self.0);
        self.0 = now;
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_reads_once_and_keeps_counts_exact() {
        let loss = Tensor::from(1.5f32);
        let correct = Tensor::from((1i64 << 40) + 3);
        let before = count();
        let v = values(&[&loss, &correct]).unwrap();
        // Other tests in this binary may read at the same time: at least ours is counted.
        assert!(count() > before);
        assert_eq!(v, vec![1.5, ((1i64 << 40) + 3) as f64]);
    }

    #[test]
    fn a_mark_counts_what_came_after_it() {
        let mut m = Mark::now();
        let _ = flag(&Tensor::from_slice(&[1.0f32]));
        let _ = all(&Tensor::from_slice(&[2.0f32, 3.0]));
        assert!(m.take() >= 2);
    }
}
