//! The training loss and correct count, summed on the device and read only when something
//! needs them: a logged step's record, the epoch's line, a checkpoint. Unlogged steps read
//! nothing, so the host never waits on the GPU between them.
use anyhow::{Context, Result};
use tch::{Device, Kind, Tensor};

use super::clock::Stamp;
use crate::readback;

/// What a loss sum averages over: samples, or a language model's counted target tokens.
#[derive(Debug)]
pub enum Count {
    /// Known on the host (a batch's samples, a group's tokens counted before its step).
    Known(f64),
    /// Counted where the loss was computed (int64 scalar).
    Counted(Tensor),
}

/// One step's loss sum (fp32), correct count (int64) and what the loss counts, where the step
/// computed them.
#[derive(Debug)]
pub struct Totals {
    loss_sum: Tensor,
    correct: Tensor,
    count: Count,
}

impl Totals {
    pub fn new(loss_sum: Tensor, correct: Tensor, count: Count) -> Totals {
        Totals {
            loss_sum,
            correct,
            count,
        }
    }

    /// The same tensors again: a captured step's totals are rewritten in place by each replay.
    pub fn alias(&self) -> Totals {
        let count = match &self.count {
            Count::Known(n) => Count::Known(*n),
            Count::Counted(t) => Count::Counted(t.shallow_clone()),
        };
        Totals::new(self.loss_sum.shallow_clone(), self.correct.shallow_clone(), count)
    }

    pub fn zero(device: Device) -> Totals {
        Totals::new(
            Tensor::zeros([], (Kind::Float, device)),
            Tensor::zeros([], (Kind::Int64, device)),
            Count::Known(0.0),
        )
    }

    /// The loss sum and correct count, in one read.
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
    /// What the step's and the epoch's loss sums count (samples, or target tokens).
    pub step_count: f64,
    pub epoch_count: f64,
}

/// The epoch's running sums and the last step's loss, on the device, in one f64 tensor made
/// once (`[step loss, epoch loss sum, step correct count, epoch correct count, step count,
/// epoch count]`, the counts being what the loss sums average over): a step adds to
/// it in place, before its optimizer step writes, so nothing of the step's attempt outlives it
/// and adding allocates nothing. The loss is summed in f64 in step order, which is exactly what
/// adding each step's value read as f64 on the host gave; counts below 2^53 stay exact in f64.
#[derive(Debug)]
pub struct Tally {
    sums: Tensor,
    /// A step was added since the last read (or staged read).
    pending: bool,
}

impl Tally {
    /// Sums that start from what is already known (a resumed epoch's); the counts are not
    /// summed (they read 0).
    pub fn new(device: Device, loss_sum: f64, correct: i64) -> Tally {
        // Filled where it lives: an upload from pageable memory would make the host wait for the
        // device's queued work.
        let sums = Tensor::zeros([4], (Kind::Double, device));
        tch::no_grad(|| {
            let _ = sums.narrow(0, 1, 1).fill_(loss_sum);
            let _ = sums.narrow(0, 3, 1).fill_(correct as f64);
        });
        Tally { sums, pending: false }
    }

    /// Sums from zero that sum the counts too (a language model's validation, whose tokens are
    /// counted on the device).
    pub fn counting(device: Device) -> Tally {
        Tally {
            sums: Tensor::zeros([6], (Kind::Double, device)),
            pending: false,
        }
    }

    fn counts(&self) -> bool {
        self.sums.size()[0] == 6
    }

    /// Adds a step's totals where they are: nothing is read. (After a CPU fallback the step's
    /// totals are on the CPU and the sums on the GPU: one-value CPU tensors take part in GPU
    /// kernels as scalars.)
    pub fn add(&mut self, step: Totals) {
        tch::no_grad(|| {
            // Widened into the step's f64 slots first: adding the f32 loss or the int64 count
            // straight to an f64 sum would make a widened temporary, while the optimizer's
            // workspace is allocated.
            let mut step_loss = self.sums.get(0);
            step_loss.copy_(&step.loss_sum);
            let _ = self.sums.get(1).g_add_(&step_loss);
            let mut step_correct = self.sums.get(2);
            step_correct.copy_(&step.correct);
            let _ = self.sums.get(3).g_add_(&step_correct);
            if !self.counts() {
                return;
            }
            let mut step_count = self.sums.get(4);
            match &step.count {
                // A host value fills in a kernel: a copy from the host would wait for the device.
                Count::Known(n) => {
                    let _ = step_count.fill_(*n);
                }
                Count::Counted(t) => step_count.copy_(t),
            }
            let _ = self.sums.get(5).g_add_(&step_count);
        });
        self.pending = true;
    }

    /// Adds values already on the host (a data-parallel step agreed on them).
    pub fn add_values(&mut self, loss_sum: f64, correct: i64, count: f64) {
        tch::no_grad(|| {
            let _ = self.sums.get(0).fill_(loss_sum);
            let _ = self.sums.get(1).g_add_scalar_(loss_sum);
            let _ = self.sums.get(2).fill_(correct as f64);
            let _ = self.sums.get(3).g_add_scalar_(correct as f64);
            if self.counts() {
                let _ = self.sums.get(4).fill_(count);
                let _ = self.sums.get(5).g_add_scalar_(count);
            }
        });
        self.pending = true;
    }

    /// A step was added since the last read.
    pub fn pending(&self) -> bool {
        self.pending
    }

    /// The last step's loss sum and the epoch's sums, in one read.
    pub fn read(&mut self) -> Result<Read> {
        let v = readback::all(&self.sums)?;
        self.pending = false;
        Ok(Read::of(&v))
    }

    /// The sums as they stand after the work queued so far, copied to the host behind that work
    /// without waiting for it: the host goes on queueing the next step while the device
    /// finishes this one, and collects the values when it next needs them.
    pub fn stage(&mut self) -> Result<Staged> {
        let device = self.sums.device();
        let host = match device {
            // The next step's adds come after it; the stamp behind it says when the copy is done,
            // on the device's clock.
            Device::Cuda(_) => crate::host::pinned_behind_compute(&self.sums)?,
            _ => self.sums.copy(),
        };
        let done = Stamp::now(device);
        if let (Device::Cuda(i), true) = (device, done.reached()) {
            // No event to wait on later (it could not be recorded): the copy is waited for now.
            crate::shim::synchronize(i)?;
        }
        readback::staged();
        self.pending = false;
        Ok(Staged { host, done })
    }
}

/// A read of the tally on its way to the host (see [`Tally::stage`]).
#[must_use = "a staged read holds values until it is collected"]
pub struct Staged {
    host: Tensor,
    /// The device's work up to the copy, done: on the CPU when it was staged.
    done: Stamp,
}

impl Staged {
    /// The values are on the host already: on the CPU, or on CUDA without an event to wait on,
    /// the copy was done when staged.
    pub fn ready(&self) -> bool {
        self.done.reached()
    }

    /// The values, and the stamp of the work before them, reached.
    pub fn collect(self) -> Result<(Read, Stamp)> {
        let Staged { host, mut done } = self;
        done.wait()?;
        let v = Vec::<f64>::try_from(&host).context("reading the staged training loss")?;
        Ok((Read::of(&v), done))
    }
}

impl Read {
    fn of(v: &[f64]) -> Read {
        Read {
            step_loss_sum: v[0],
            epoch_loss_sum: v[1],
            epoch_correct: v[3] as i64,
            step_count: v.get(4).copied().unwrap_or(0.0),
            epoch_count: v.get(5).copied().unwrap_or(0.0),
        }
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
            tally.add(Totals::new(Tensor::from(l), Tensor::from(i as i64), Count::Known(8.0)));
        }
        assert!(tally.pending());
        let r = tally.read().unwrap();
        assert!(!tally.pending());
        assert_eq!(r.epoch_loss_sum.to_bits(), host.to_bits());
        assert_eq!(r.step_loss_sum, (1.0f32 / 3.0) as f64);
        assert_eq!(r.epoch_correct, 4 + 10);
        // The agreed values of a data-parallel step add alike.
        tally.add_values(2.5, 3, 8.0);
        let r = tally.read().unwrap();
        assert_eq!(r.epoch_loss_sum.to_bits(), (host + 2.5).to_bits());
        assert_eq!((r.step_loss_sum, r.epoch_correct), (2.5, 17));
        assert_eq!(
            (r.step_count, r.epoch_count),
            (0.0, 0.0),
            "a plain tally sums no counts"
        );
    }

    #[test]
    fn a_counting_tally_sums_known_and_device_counts() {
        let mut tally = Tally::counting(Device::Cpu);
        tally.add(Totals::new(Tensor::from(1.5f32), Tensor::from(2i64), Count::Known(8.0)));
        tally.add(Totals::new(
            Tensor::from(0.5f32),
            Tensor::from(1i64),
            Count::Counted(Tensor::from(300i64)),
        ));
        let r = tally.read().unwrap();
        assert_eq!((r.step_count, r.epoch_count), (300.0, 308.0));
        assert_eq!((r.epoch_loss_sum, r.epoch_correct), (2.0, 3));
        tally.add_values(2.5, 3, 6.0);
        let r = tally.read().unwrap();
        assert_eq!((r.step_count, r.epoch_count), (6.0, 314.0));
    }
}
