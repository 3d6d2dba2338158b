//! Host memory: where the memory levers put what leaves the device (optimizer state, gradients,
//! saved activations, parameters), and the copies between it and the device.
//!
//! On CUDA a host tensor is pinned CPU memory, so copies to the device can be issued without
//! blocking. On the CPU the "device" is the counting allocator's capped count and a host tensor
//! is a CPU tensor allocated inside a [`HostScope`]: counted apart, never against the cap. Both
//! are plain CPU tensors to the math, so every lever computes with the same ATen calls on the
//! same values whichever side a tensor is on, and a CPU run with a lever equals one without,
//! byte for byte.
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::shim::HostScope;

/// Where one term of the memory bill lives.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Home {
    #[default]
    Device,
    Host,
}

impl Home {
    pub fn is_host(self) -> bool {
        self == Home::Host
    }

    pub fn name(self) -> &'static str {
        match self {
            Home::Device => "device",
            Home::Host => "host",
        }
    }
}

/// The host side of a run on `device`: where its host tensors are made and how they travel.
#[derive(Debug, Clone, Copy)]
pub struct Host {
    pub device: Device,
}

impl Host {
    pub fn new(device: Device) -> Self {
        Host { device }
    }

    /// An uninitialised host tensor.
    pub fn empty(&self, size: &[i64], kind: Kind) -> Tensor {
        let _scope = HostScope::enter();
        let t = Tensor::empty(size, (kind, Device::Cpu));
        match self.device {
            Device::Cuda(_) => t.pin_memory(self.device),
            _ => t,
        }
    }

    /// Zeros shaped like `t`, on the host.
    pub fn zeros_like(&self, t: &Tensor) -> Tensor {
        let mut h = self.empty(&t.size(), t.kind());
        let _ = h.zero_();
        h
    }

    /// A host copy of `t` (any device), in `t`'s kind. Blocking: the copy is complete when this
    /// returns, so the CPU may read it at once.
    pub fn copy_of(&self, t: &Tensor) -> Tensor {
        let mut h = self.empty(&t.size(), t.kind());
        tch::no_grad(|| h.copy_(t));
        h
    }

    /// A device copy of the host tensor `h`. From pinned memory the copy does not block the CPU;
    /// the device's stream orders it before any kernel that reads it.
    pub fn to_device(&self, h: &Tensor) -> Tensor {
        match self.device {
            Device::Cpu => tch::no_grad(|| h.copy()),
            d => h.to_device_(d, h.kind(), true, false),
        }
    }

    /// Copies the host tensor `h` into the device tensor `dst` in place.
    pub fn copy_into_device(&self, dst: &mut Tensor, h: &Tensor) {
        tch::no_grad(|| {
            match self.device {
                Device::Cpu => {
                    dst.copy_(h);
                }
                // `_copy_from(src, dst, non_blocking)`.
                _ => {
                    let _ = h.internal_copy_from(dst, true);
                }
            }
        });
    }

    /// Waits for the device copies issued so far, before their host sources are written again.
    pub fn settle(&self) {
        if let Device::Cuda(i) = self.device {
            // A failed synchronize is a broken device; the next kernel reports it.
            let _ = crate::shim::synchronize(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shim;

    #[test]
    fn host_tensors_are_counted_apart_and_ignore_the_cap() {
        shim::cpu_alloc_install().unwrap();
        let host = Host::new(Device::Cpu);
        let before = shim::cpu_alloc_stats();
        // 64 MiB: far above what other unit tests allocate at once in this process.
        let src = Tensor::ones([16 << 20], tch::kind::FLOAT_CPU);
        let h = host.copy_of(&src);
        let during = shim::cpu_alloc_stats();
        assert!(
            during.host_allocated >= before.host_allocated + (64 << 20),
            "{during:?}"
        );
        assert!(during.host_peak >= during.host_allocated);
        assert_eq!(h.sum(Kind::Float).double_value(&[]), (16 << 20) as f64);
        let back = host.to_device(&h);
        assert!(back.equal(&src));
        drop(h);
        let after = shim::cpu_alloc_stats();
        assert!(after.host_allocated + (64 << 20) <= during.host_allocated, "{after:?}");
    }
}
