//! What a failed step attempt must give back before its retry: the model's buffers and the
//! generators' states, as they were before the step (parameters and optimizer state need
//! nothing: the optimizer step is transactional).
use tch::{nn, Device, Tensor};

use crate::fault::Phase;
use crate::memory::{self, Place};
use crate::oom::{self, StepError};
use crate::shim;

/// The work a retry wraps: the weight step, the session's first (measured) weight step and
/// DARTS's architecture step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    WeightStep,
    Preflight,
    ArchStep,
}

impl Attempt {
    pub fn name(self) -> &'static str {
        match self {
            Attempt::WeightStep => "training step",
            Attempt::Preflight => "preflight",
            Attempt::ArchStep => "architecture step",
        }
    }

    /// The phase an OOM's message and record name: the weight step's stage (forward, backward,
    /// optimizer step), marked "(preflight)" on the session's first step; other work by its name.
    pub fn phase_name(self, at: Option<Phase>) -> String {
        match (self, at) {
            (Attempt::WeightStep, Some(p)) => p.label().into(),
            (Attempt::Preflight, Some(p)) => format!("{} (preflight)", p.label()),
            _ => self.name().into(),
        }
    }
}

/// The model's buffers and the generators' states, as they were before a step attempt.
pub struct Rollback {
    buffers: Packed,
    rng: Vec<(Device, Vec<u8>)>,
}

impl Rollback {
    /// Taken before an attempt; the copy itself may run out of memory, which the caller answers
    /// as it answers the attempt's own.
    pub fn take(vs: &nn::VarStore, device: Device) -> Result<Rollback, StepError> {
        let place = Place::of(device);
        // Not by requires_grad: a frozen parameter is no buffer, and copying it would cost its size.
        let buffers: Vec<Tensor> = crate::model::buffers(vs).into_iter().map(|(_, t)| t).collect();
        oom::guarded_counting(
            || memory::oom_count(place),
            || {
                let packed = Packed::of(buffers);
                let mut rng = vec![(
                    Device::Cpu,
                    shim::rng_state(Device::Cpu).unwrap_or_else(|e| panic!("{e}")),
                )];
                if device != Device::Cpu {
                    rng.push((device, shim::rng_state(device).unwrap_or_else(|e| panic!("{e}"))));
                }
                Rollback { buffers: packed, rng }
            },
        )
    }

    pub fn restore(&self) {
        self.buffers.restore();
        for (d, s) in &self.rng {
            if let Err(e) = shim::set_rng_state(*d, s) {
                tracing::warn!("restoring the generator state after a failed step: {e}");
            }
        }
    }
}

/// Copies of many small tensors (BatchNorm's running statistics), packed into one flat tensor
/// per device and kind: taken before every step, so a few kernels rather than one per buffer,
/// which on a GPU would leave it idle while they launch. A device's copy waits in pinned host
/// memory, so the step's peak holds no device bytes for a retry that rarely comes.
struct Packed(Vec<(Vec<Tensor>, Tensor)>);

impl Packed {
    fn of(live: Vec<Tensor>) -> Packed {
        let mut groups: Vec<((Device, tch::Kind), Vec<Tensor>)> = Vec::new();
        for t in live {
            let key = (t.device(), t.kind());
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, g)) => g.push(t),
                None => groups.push((key, vec![t])),
            }
        }
        Packed(
            groups
                .into_iter()
                .map(|(_, g)| {
                    let flat: Vec<Tensor> = g.iter().map(|t| t.reshape([-1])).collect();
                    let packed = tch::no_grad(|| Tensor::cat(&flat, 0));
                    (g, off_the_device(packed))
                })
                .collect(),
        )
    }

    /// On CUDA the copy back is queued on the compute stream behind the copy out, so it reads
    /// the values as they were when the step began.
    fn restore(&self) {
        tch::no_grad(|| {
            for (live, packed) in &self.0 {
                let sizes: Vec<i64> = live.iter().map(|t| t.numel() as i64).collect();
                for (t, saved) in live.iter().zip(packed.split_with_sizes(&sizes, 0)) {
                    t.shallow_clone().copy_(&saved.view(t.size().as_slice()));
                }
            }
        });
    }
}

/// A CUDA tensor moved to pinned host memory behind the compute stream's work: its device block
/// goes back to the allocator at once. Kept on the device when the host copy cannot be made.
fn off_the_device(t: Tensor) -> Tensor {
    match t.device() {
        Device::Cuda(_) => crate::host::pinned_behind_compute(&t).unwrap_or(t),
        _ => t,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_buffers_come_back_exactly_whatever_their_kinds_and_shapes() {
        let live = vec![
            Tensor::from_slice(&[0.5f32, -1.25, 3.0]),
            Tensor::from(7i64),
            Tensor::from_slice(&[1e-30f32, 2.0, 4.0, 8.0]).reshape([2, 2]),
        ];
        let before: Vec<Tensor> = live.iter().map(Tensor::copy).collect();
        let packed = Packed::of(live.iter().map(Tensor::shallow_clone).collect());
        assert_eq!(packed.0.len(), 2, "one pack per kind");
        for t in &live {
            let _ = t.shallow_clone().fill_(42);
        }
        packed.restore();
        for (t, b) in live.iter().zip(&before) {
            assert!(t.equal(b), "{t:?} vs {b:?}");
        }
    }
}
