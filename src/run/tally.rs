//! The training loss and correct count, summed on the device and read only when something
//! needs them: a logged step's record, the epoch's line, a checkpoint. Unlogged steps read
//! nothing, so the host never waits on the GPU between them.
use anyhow::Result;
use tch::{Device, Kind, Tensor};

use crate::readback;

/// One step's loss sum (fp32) and correct count (int64), where the step computed them.
#[derive(Debug)]
pub struct Totals {
    loss_sum: Tensor,
    correct: Tensor,
}

impl Totals {
    pub fn new(loss_sum: Tensor, correct: Tensor) -> Totals {
        Totals { loss_sum, correct }
    }

    pub fn zero(device: Device) -> Totals {
        Totals::new(
            Tensor::zeros([], (Kind::Float, device)),
            Tensor::zeros([], (Kind::Int64, device)),
        )
    }

    /// Both values, in one read.
    pub fn read(&self) -> Result<(f64, i64)> {
        let v = readback::values(&[&self.loss_sum, &self.correct])?;
        Ok((v[0], v[1] as i64))
    }
}

/// What a read of the tally gives: the step's own loss sum and the epoch's sums so far.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Read {
    pub step_loss_sum: f64,
    pub epoch_loss_sum: f64,
    pub epoch_correct: i64,
}

/// The epoch's running sums and the last step's loss, on the device, in tensors made once: a
/// step adds to them in place, before its optimizer step writes, so nothing of the step's
/// attempt outlives it and adding allocates nothing. The loss is summed in f64 in step order,
/// which is exactly what adding each step's value read as f64 on the host gave.
#[derive(Debug)]
pub struct Tally {
    loss_sum: Tensor,
    correct: Tensor,
    step_loss: Tensor,
    /// A step was added since the last read.
    pending: bool,
}

impl Tally {
    /// Sums that start from what is already known (a resumed epoch's).
    pub fn new(device: Device, loss_sum: f64, correct: i64) -> Tally {
        Tally {
            loss_sum: Tensor::from(loss_sum).to_device(device),
            correct: Tensor::from(correct).to_device(device),
            step_loss: Tensor::zeros([], (Kind::Double, device)),
            pending: false,
        }
    }

    /// Adds a step's totals where they are: nothing is read. (After a CPU fallback the step's
    /// totals are on the CPU and the sums on the GPU: one-value CPU tensors take part in GPU
    /// kernels as scalars.)
    pub fn add(&mut self, step: Totals) {
        tch::no_grad(|| {
            // Widened into the f64 tensor first: adding the f32 value straight to an f64 sum
            // would make a widened temporary, while the optimizer's workspace is allocated.
            self.step_loss.copy_(&step.loss_sum);
            let _ = self.loss_sum.g_add_(&self.step_loss);
            let _ = self.correct.g_add_(&step.correct);
        });
        self.pending = true;
    }

    /// Adds values already on the host (a data-parallel step agreed on them).
    pub fn add_values(&mut self, loss_sum: f64, correct: i64) {
        let _ = self.loss_sum.g_add_scalar_(loss_sum);
        let _ = self.correct.g_add_scalar_(correct);
        let _ = self.step_loss.fill_(loss_sum);
        self.pending = true;
    }

    /// A step was added since the last read.
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// The last step's loss sum and the epoch's sums, in one read.
    pub fn read(&mut self) -> Result<Read> {
        let v = readback::values(&[&self.step_loss, &self.loss_sum, &self.correct])?;
        self.pending = false;
        Ok(Read {
            step_loss_sum: v[0],
            epoch_loss_sum: v[1],
            epoch_correct: v[2] as i64,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_device_sum_equals_the_hosts_step_by_step_sum() {
        let steps = [0.1f32, 1e8, 3.3, -7.25e-3, 1.0 / 3.0];
        let mut host = 12.5f64;
        let mut tally = Tally::new(Device::Cpu, 12.5, 4);
        for (i, &l) in steps.iter().enumerate() {
            host += l as f64;
            tally.add(Totals::new(Tensor::from(l), Tensor::from(i as i64)));
        }
        assert!(tally.pending());
        let r = tally.read().unwrap();
        assert!(!tally.pending());
        assert_eq!(r.epoch_loss_sum.to_bits(), host.to_bits());
        assert_eq!(r.step_loss_sum, (1.0f32 / 3.0) as f64);
        assert_eq!(r.epoch_correct, 4 + 10);
        // The agreed values of a data-parallel step add alike.
        tally.add_values(2.5, 3);
        let r = tally.read().unwrap();
        assert_eq!(r.epoch_loss_sum.to_bits(), (host + 2.5).to_bits());
        assert_eq!((r.step_loss_sum, r.epoch_correct), (2.5, 17));
    }
}
