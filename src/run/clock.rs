//! The clock step records are timed by. On the CPU a step's work is done when the host has run
//! it, so the host's clock says when. On CUDA the host runs ahead and only learns that a step is
//! done when it next waits for the device, which may be later: a timed event behind the step's
//! work says when the device got there, on the device's own clock.
use std::time::Instant;

use tch::Device;

use crate::shim::copies::CudaEvent;

/// A point in a run: when the host stamped it and, on CUDA, where the device's compute stream
/// was (the work queued before the stamp done).
pub struct Stamp {
    at: Instant,
    device: Option<CudaEvent>,
}

impl Stamp {
    /// Now on the host's clock and, on CUDA, behind the work queued so far.
    pub fn now(device: Device) -> Stamp {
        let device = match device {
            // Without the event the host's clock stands in.
            Device::Cuda(i) => CudaEvent::timed_on_compute(i).ok(),
            _ => None,
        };
        Stamp {
            at: Instant::now(),
            device,
        }
    }

    /// The host waits until the device has reached the stamp; the host's time becomes when it
    /// was seen.
    pub fn wait(&mut self) -> anyhow::Result<()> {
        if let Some(d) = &self.device {
            d.synchronize()?;
            self.at = Instant::now();
        }
        Ok(())
    }

    /// Whether the work before the stamp is done already (no device to wait for).
    pub fn reached(&self) -> bool {
        self.device.is_none()
    }

    /// Seconds from `earlier` to this stamp, both reached: on the device's clock where both have
    /// one, else on the host's.
    pub fn seconds_since(&self, earlier: &Stamp) -> f64 {
        if let (Some(now), Some(then)) = (&self.device, &earlier.device) {
            if let Ok(s) = now.seconds_since(then) {
                return s.max(0.0);
            }
        }
        self.at.saturating_duration_since(earlier.at).as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn on_the_cpu_a_stamp_is_reached_at_once_and_timed_by_the_host() {
        let a = Stamp::now(Device::Cpu);
        std::thread::sleep(std::time::Duration::from_millis(20));
        let mut b = Stamp::now(Device::Cpu);
        assert!(b.reached());
        b.wait().unwrap();
        let s = b.seconds_since(&a);
        assert!((0.02..1.0).contains(&s), "{s}");
        assert_eq!(a.seconds_since(&b), 0.0, "never negative");
    }
}
