//! Host memory: where the memory levers put what leaves the device (optimizer state, gradients,
//! saved activations, parameters), and the copies between it and the device.
//!
//! On CUDA a host tensor is pinned CPU memory, so copies run on a copy stream beside the
//! kernels, ordered by events (see [`Host`]). On the CPU the "device" is the counting allocator's capped count and a host tensor
//! is a CPU tensor allocated inside a [`HostScope`]: counted apart, never against the cap. Both
//! are plain CPU tensors to the math, so every lever computes with the same ATen calls on the
//! same values whichever side a tensor is on, and a CPU run with a lever equals one without,
//! byte for byte.
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

use crate::oom::inside_guard as ok;
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

/// `t`, on a CUDA device, copied to pinned host memory behind the work queued on the compute
/// stream, without the host waiting: a non-blocking copy to the CPU gets a pinned destination,
/// and the host allocator keeps it until the copy has run. Work queued after it cannot change
/// what it copies; the host reads it once the stream has passed this point (an event after it).
pub fn pinned_behind_compute(t: &Tensor) -> anyhow::Result<Tensor> {
    Ok(t.f_to_device_(Device::Cpu, t.kind(), true, false)?)
}

/// The host side of a run on `device`: where its host tensors are made and how they travel.
///
/// Every copy between host and device goes through here. On CUDA, host tensors are pinned and
/// copies run without blocking on the device's copy stream ([`Copies`]); on the CPU they are
/// ordinary copies. The one rule the asynchrony brings: the CPU writes a pinned buffer only
/// after [`Host::before_cpu_writes`], so no queued copy still reads (or writes) it. The
/// optimizer's host update and the host gradients' accumulation are the only CPU writers of
/// buffers that copies touch, and both call it first.
#[derive(Debug, Clone, Copy)]
pub struct Host {
    pub device: Device,
}

impl Host {
    pub fn new(device: Device) -> Self {
        Host { device }
    }

    fn cuda(&self) -> Option<usize> {
        match self.device {
            Device::Cuda(i) => Some(i),
            _ => None,
        }
    }

    /// An uninitialised host tensor: pinned memory on CUDA, counted as host memory on the CPU.
    pub fn empty(&self, size: &[i64], kind: Kind) -> Tensor {
        match self.cuda() {
            // Inside the OOM guard like any libtorch error.
            Some(_) => ok(crate::shim::copies::pinned_empty(size, kind)),
            None => {
                let _scope = HostScope::enter();
                Tensor::empty(size, (kind, Device::Cpu))
            }
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

    /// A device copy of the host tensor `h`, complete before any kernel queued after it runs.
    pub fn to_device(&self, h: &Tensor) -> Tensor {
        match self.device {
            Device::Cpu => tch::no_grad(|| h.copy()),
            d => {
                let copies = self.copies();
                let t = copies.up_new(h);
                copies.fence().compute_waits();
                debug_assert_eq!(t.device(), d);
                t
            }
        }
    }

    /// A CPU tensor (a batch of inputs) on its way to the device on the compute stream: staged
    /// in pinned memory so the copy does not block the host (the host allocator keeps the
    /// staging buffer until the copy has run). Already on the device: the tensor itself.
    pub fn input(&self, t: &Tensor) -> Tensor {
        match (t.device(), self.device) {
            (from, to) if from == to => t.shallow_clone(),
            (Device::Cpu, to) => {
                let mut staged = self.empty(&t.size(), t.kind());
                tch::no_grad(|| staged.copy_(t));
                staged.to_device_(to, t.kind(), true, false)
            }
            // Resident data after a CPU fallback, say.
            (_, to) => t.to_device(to),
        }
    }

    /// A batch of copies on the copy stream, each ordered after the compute stream's work queued
    /// before this call.
    pub fn copies(&self) -> Copies {
        if let Some(i) = self.cuda() {
            ok(crate::shim::copies::copies_after_compute(i));
        }
        Copies { device: self.device }
    }

    /// Waits until no queued copy reads or writes host memory, so the CPU may write it.
    pub fn before_cpu_writes(&self) {
        if self.cuda().is_some() {
            Copies { device: self.device }.fence().host_waits();
        }
    }
}

/// Copies issued together (see [`Host::copies`]). On CUDA they run on the copy stream without
/// blocking the host; on the CPU each is done when its call returns.
pub struct Copies {
    device: Device,
}

impl Copies {
    /// `dst` (host) takes the value of `src` (device).
    pub fn down(&self, dst: &Tensor, src: &Tensor) {
        self.copy(dst, src)
    }

    /// `dst` (device) takes the value of `src` (host).
    pub fn up(&self, dst: &Tensor, src: &Tensor) {
        self.copy(dst, src)
    }

    /// A new device tensor that takes the value of the host tensor `h`.
    pub fn up_new(&self, h: &Tensor) -> Tensor {
        let t = Tensor::empty(h.size(), (h.kind(), self.device));
        self.up(&t, h);
        t
    }

    fn copy(&self, dst: &Tensor, src: &Tensor) {
        match self.device {
            Device::Cuda(i) => ok(crate::shim::copies::copy_async(i, dst, src)),
            _ => {
                tch::no_grad(|| dst.shallow_clone().copy_(src));
            }
        }
    }

    /// Marks the copies issued so far on this device's copy stream.
    pub fn fence(&self) -> Fence {
        match self.device {
            Device::Cuda(i) => Fence(Some(ok(crate::shim::copies::CudaEvent::after_copies(i)))),
            _ => Fence(None),
        }
    }
}

/// The copies queued before it was made (nothing to wait for on the CPU).
#[must_use = "a fence orders nothing until something waits for it"]
pub struct Fence(Option<crate::shim::copies::CudaEvent>);

impl Fence {
    /// Kernels queued from now on run after the copies; the host does not wait.
    pub fn compute_waits(&self) {
        if let Some(e) = &self.0 {
            ok(e.block_compute());
        }
    }

    /// The host waits until the copies have run.
    pub fn host_waits(&self) {
        if let Some(e) = &self.0 {
            ok(e.synchronize());
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
