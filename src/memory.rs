//! Memory as the run sees it: samples (the device allocator's figures on CUDA, the counting CPU
//! allocator's on the CPU, and host RSS on both), peak windows, OOM counters, and the cache
//! policy with what it cost.
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::shim;
use crate::spec::schema::CacheClear;
use crate::sysmem;

/// One reading. `allocated`/`peak_allocated` are tensor bytes on the run's device (the CUDA
/// allocator's, or the counting CPU allocator's); the reserved and device fields are CUDA-only.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemorySample {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocated_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_allocated_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_reserved_bytes: Option<u64>,
    /// CUDA's native allocator: the peak of the bytes tensors asked for, before the allocator
    /// rounds them to its blocks (see `shim::DeviceStats::requested`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_requested_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_total_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub num_alloc_retries: Option<u64>,
    /// Host tensor bytes, counted apart from `allocated_bytes` and never against the cap: on the
    /// CPU what the memory levers moved off the device, on CUDA the pinned host memory in use.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_host_bytes: Option<u64>,
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
}

/// The reading taken after every optimizer step: the allocator's own counters (no device
/// synchronisation, no driver call) and RSS from /proc/self/statm. Peaks are since the previous
/// reading, which resets the allocator's peak counters; `fold` keeps the largest over a window.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMemory {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allocated_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_allocated_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_reserved_bytes: Option<u64>,
    /// CUDA (see `MemorySample::peak_requested_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_requested_bytes: Option<u64>,
    /// Host tensor bytes (see `MemorySample::host_bytes`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_host_bytes: Option<u64>,
    pub rss_bytes: u64,
}

impl StepMemory {
    /// Takes `later`'s current figures and the larger of both peaks.
    pub fn fold(&mut self, later: &StepMemory) {
        self.allocated_bytes = later.allocated_bytes;
        self.reserved_bytes = later.reserved_bytes;
        self.rss_bytes = later.rss_bytes;
        self.peak_allocated_bytes = max_opt(self.peak_allocated_bytes, later.peak_allocated_bytes);
        self.peak_reserved_bytes = max_opt(self.peak_reserved_bytes, later.peak_reserved_bytes);
        self.peak_requested_bytes = max_opt(self.peak_requested_bytes, later.peak_requested_bytes);
        self.host_bytes = later.host_bytes;
        self.peak_host_bytes = max_opt(self.peak_host_bytes, later.peak_host_bytes);
    }
}

impl MemorySample {
    /// Widens this sample's peaks by a window of step readings (which reset the counters).
    pub fn include(&mut self, steps: &StepMemory) {
        self.peak_allocated_bytes = max_opt(self.peak_allocated_bytes, steps.peak_allocated_bytes);
        self.peak_reserved_bytes = max_opt(self.peak_reserved_bytes, steps.peak_reserved_bytes);
        self.peak_requested_bytes = max_opt(self.peak_requested_bytes, steps.peak_requested_bytes);
        self.peak_host_bytes = max_opt(self.peak_host_bytes, steps.peak_host_bytes);
    }
}

pub fn max_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(x), Some(y)) => Some(x.max(y)),
        (x, y) => x.or(y),
    }
}

/// The per-step reading; starts the next step's peak window.
pub fn step_reading(place: Place) -> StepMemory {
    let mut m = StepMemory {
        rss_bytes: sysmem::rss_now(),
        ..Default::default()
    };
    match place {
        Place::Cpu => {
            let s = shim::cpu_alloc_stats();
            if s.installed {
                m.allocated_bytes = Some(s.allocated);
                m.peak_allocated_bytes = Some(s.peak_allocated);
                (m.host_bytes, m.peak_host_bytes) = host_figures(&s);
                shim::cpu_alloc_reset_peak();
            }
        }
        Place::Cuda(i) => {
            if let Ok(Some(s)) = shim::device_stats(i) {
                m.allocated_bytes = Some(s.allocated);
                m.reserved_bytes = Some(s.reserved);
                m.peak_allocated_bytes = Some(s.peak_allocated);
                m.peak_reserved_bytes = Some(s.peak_reserved);
                m.peak_requested_bytes = requested(&s);
                let _ = shim::reset_peak_stats(i);
            }
            (m.host_bytes, m.peak_host_bytes) = pinned_figures();
            let _ = shim::copies::cuda_host_reset_peak();
        }
    }
    m
}

/// The requested peak where the allocator counts it: cudaMallocAsync leaves it at zero.
fn requested(s: &shim::DeviceStats) -> Option<u64> {
    (s.peak_requested > 0 || s.peak_allocated == 0).then_some(s.peak_requested)
}

/// On CUDA, host memory is what the pinned host allocator holds for tensors (host levers'
/// buffers, the inputs' staging, the copy of the model's buffers a step keeps for a retry),
/// recorded once something has been pinned.
fn pinned_figures() -> (Option<u64>, Option<u64>) {
    match shim::copies::cuda_host_stats() {
        Ok((now, peak)) if now > 0 || peak > 0 => (Some(now), Some(peak)),
        _ => (None, None),
    }
}

/// Host figures are recorded once something has lived on the host, so runs without a host
/// lever keep their records as they were.
fn host_figures(s: &shim::CpuStats) -> (Option<u64>, Option<u64>) {
    match s.host_peak > 0 || s.host_allocated > 0 {
        true => (Some(s.host_allocated), Some(s.host_peak)),
        false => (None, None),
    }
}

/// The memory limit in force for a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Cap {
    /// "cuda_fraction" (the CUDA allocator's per-process fraction) or "cpu_tensor_bytes" (the
    /// counting CPU allocator's cap on live tensor bytes). Owned, so records read back.
    pub kind: String,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
}

/// Where a run trains and its tensors live: a CUDA device index, or the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place {
    Cpu,
    Cuda(usize),
}

impl Place {
    pub fn of(d: tch::Device) -> Self {
        match d {
            tch::Device::Cuda(i) => Place::Cuda(i),
            _ => Place::Cpu,
        }
    }

    pub fn tch(self) -> tch::Device {
        match self {
            Place::Cpu => tch::Device::Cpu,
            Place::Cuda(i) => tch::Device::Cuda(i),
        }
    }
}

pub fn sample(place: Place) -> MemorySample {
    let (rss, peak_rss) = sysmem::rss();
    let mut m = MemorySample {
        rss_bytes: rss,
        peak_rss_bytes: peak_rss,
        ..Default::default()
    };
    if place == Place::Cpu {
        let s = shim::cpu_alloc_stats();
        if s.installed {
            m.allocated_bytes = Some(s.allocated);
            m.peak_allocated_bytes = Some(s.peak_allocated);
            (m.host_bytes, m.peak_host_bytes) = host_figures(&s);
        }
    }
    if let Place::Cuda(i) = place {
        if let Ok(Some(s)) = shim::device_stats(i) {
            m.allocated_bytes = Some(s.allocated);
            m.reserved_bytes = Some(s.reserved);
            m.peak_allocated_bytes = Some(s.peak_allocated);
            m.peak_reserved_bytes = Some(s.peak_reserved);
            m.peak_requested_bytes = requested(&s);
            m.num_alloc_retries = Some(s.num_alloc_retries);
        }
        (m.host_bytes, m.peak_host_bytes) = pinned_figures();
        if let Ok(Some((free, total))) = shim::memory_info(i) {
            m.device_free_bytes = Some(free);
            m.device_total_bytes = Some(total);
        }
    }
    m
}

/// What the preflight compares with the cap: on CUDA the peak *reserved* (the per-process
/// fraction binds on what the caching allocator holds, not on what tensors use), on the CPU the
/// counted tensor bytes, else RSS.
pub fn preflight_measure(m: &MemorySample) -> (u64, &'static str) {
    match (m.peak_reserved_bytes, m.peak_allocated_bytes) {
        (Some(r), _) => (r, "peak reserved"),
        (None, Some(a)) => (a, "peak allocated"),
        (None, None) => (m.peak_rss_bytes, "peak RSS"),
    }
}

/// Starts a new peak window (allocator peak counters and the kernel's RSS high-water mark).
pub fn reset_peaks(place: Place) {
    match place {
        Place::Cuda(i) => {
            let _ = shim::reset_peak_stats(i);
            let _ = shim::copies::cuda_host_reset_peak();
        }
        Place::Cpu => shim::cpu_alloc_reset_peak(),
    }
    sysmem::reset_peak_rss();
}

/// The peak allocated tensor bytes the current window saw (peak RSS where nothing counts them).
pub fn window_peak(place: Place) -> u64 {
    let s = sample(place);
    s.peak_allocated_bytes.unwrap_or(s.peak_rss_bytes)
}

/// How many allocations the run's allocator has refused so far; a rise during a step marks
/// its failure as an OOM whatever the message says.
pub fn oom_count(place: Place) -> u64 {
    match place {
        Place::Cuda(i) => shim::device_stats(i).ok().flatten().map_or(0, |s| s.num_ooms),
        Place::Cpu => shim::cpu_alloc_stats().num_ooms,
    }
}

/// Why the cache was cleared; counted separately in the summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClearReason {
    Every,
    Auto,
    EpochEnd,
    Checkpoint,
    Oom,
}

/// `memory.cache_clear_every` and friends, with the time spent so users see what it costs.
#[derive(Debug, Clone, Serialize)]
pub struct CachePolicy {
    #[serde(skip)]
    every: CacheClear,
    #[serde(skip)]
    auto_threshold: u64,
    #[serde(skip)]
    sync_every: u64,
    #[serde(skip)]
    last_retries: u64,
    pub clears: u64,
    pub auto_clears: u64,
    pub clear_seconds: f64,
    pub syncs: u64,
    pub sync_seconds: f64,
}

impl CachePolicy {
    pub fn new(every: CacheClear, auto_threshold: u64, sync_every: u64) -> Self {
        CachePolicy {
            every,
            auto_threshold,
            sync_every,
            last_retries: 0,
            clears: 0,
            auto_clears: 0,
            clear_seconds: 0.0,
            syncs: 0,
            sync_seconds: 0.0,
        }
    }

    /// Whether "auto" sees allocator pressure on the device.
    pub fn pressure(&mut self, place: Place) -> bool {
        let Place::Cuda(i) = place else { return false };
        let Ok(Some(s)) = shim::device_stats(i) else {
            return false;
        };
        self.pressure_in(&s)
    }

    /// Pressure: allocation retries rose since the last look (the allocator had to free cached
    /// blocks and try again), or more than the threshold is reserved but not allocated.
    fn pressure_in(&mut self, s: &shim::DeviceStats) -> bool {
        let retried = s.num_alloc_retries > self.last_retries;
        self.last_retries = s.num_alloc_retries;
        retried || s.reserved.saturating_sub(s.allocated) > self.auto_threshold
    }

    /// Called after every optimizer step (1-based count); the clear it made, if any.
    pub fn after_step(&mut self, place: Place, step: u64) -> Option<Cleared> {
        if self.sync_every > 0 && step.is_multiple_of(self.sync_every) {
            if let Place::Cuda(i) = place {
                let t = Instant::now();
                if shim::synchronize(i).unwrap_or(false) {
                    self.syncs += 1;
                    self.sync_seconds += t.elapsed().as_secs_f64();
                }
            }
        }
        let reason = match self.every {
            CacheClear::Every(n) => due(n, step).then_some(ClearReason::Every),
            CacheClear::Auto => self.pressure(place).then_some(ClearReason::Auto),
        };
        self.clear(place, reason?)
    }

    /// Empties the device cache and accounts for the time. A no-op on the CPU (libtorch's CPU
    /// allocator keeps no cache), so nothing is counted there.
    pub fn clear(&mut self, place: Place, reason: ClearReason) -> Option<Cleared> {
        let Place::Cuda(i) = place else { return None };
        let before = shim::device_stats(i).ok().flatten().map(|s| s.reserved);
        let t = Instant::now();
        if !shim::empty_cache().unwrap_or(false) {
            return None;
        }
        let seconds = t.elapsed().as_secs_f64();
        self.clears += 1;
        if reason == ClearReason::Auto {
            self.auto_clears += 1;
        }
        self.clear_seconds += seconds;
        let after = shim::device_stats(i).ok().flatten().map(|s| s.reserved);
        Some(Cleared {
            reason,
            seconds,
            released_bytes: before.zip(after).map(|(b, a)| b.saturating_sub(a)),
        })
    }
}

/// One cache clear: why, what it cost, and what it gave back to the device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Cleared {
    pub reason: ClearReason,
    pub seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub released_bytes: Option<u64>,
}

/// A step-count policy fires on multiples of its period; 0 never fires.
fn due(every: u64, step: u64) -> bool {
    every > 0 && step.is_multiple_of(every)
}

/// The bytes a tensor's elements take (its storage may hold more).
pub fn tensor_bytes(t: &tch::Tensor) -> u64 {
    (t.numel() * t.kind().elt_size_in_bytes()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_requested_peak_of_zero_beside_allocated_bytes_is_no_reading() {
        let stats = |peak_allocated, peak_requested| shim::DeviceStats {
            peak_allocated,
            peak_requested,
            ..Default::default()
        };
        assert_eq!(requested(&stats(4096, 4000)), Some(4000));
        // cudaMallocAsync counts allocated bytes but leaves requested at zero.
        assert_eq!(requested(&stats(4096, 0)), None);
        assert_eq!(
            requested(&stats(0, 0)),
            Some(0),
            "nothing allocated yet: zero is the reading"
        );
    }

    #[test]
    fn every_n_fires_on_multiples_only() {
        let fired: Vec<u64> = (1..=25).filter(|&s| due(10, s)).collect();
        assert_eq!(fired, [10, 20]);
        assert!(!(1..=100).any(|s| due(0, s)));
    }

    #[test]
    fn auto_fires_on_new_retries_or_idle_reserved_memory() {
        let mut p = CachePolicy::new(CacheClear::Auto, 100, 0);
        let stats = |allocated, reserved, retries| shim::DeviceStats {
            allocated,
            reserved,
            num_alloc_retries: retries,
            ..Default::default()
        };
        assert!(
            !p.pressure_in(&stats(1000, 1050, 0)),
            "50 idle bytes is under the threshold"
        );
        assert!(p.pressure_in(&stats(1000, 1200, 0)), "200 idle bytes is over it");
        assert!(p.pressure_in(&stats(1000, 1000, 1)), "a new retry");
        assert!(
            !p.pressure_in(&stats(1000, 1000, 1)),
            "the same retry count again is no news"
        );
    }

    #[test]
    fn cpu_clears_cost_nothing_and_count_nothing() {
        let mut p = CachePolicy::new(CacheClear::Every(1), 0, 1);
        for s in 1..=5 {
            assert_eq!(p.after_step(Place::Cpu, s), None);
        }
        assert_eq!((p.clears, p.syncs), (0, 0));
        assert!(!p.pressure(Place::Cpu));
    }

    #[test]
    fn step_readings_fold_into_window_peaks_and_reset_the_counter() {
        shim::cpu_alloc_install().unwrap();
        let _ = step_reading(Place::Cpu);
        // 1 GiB, never touched: counted at allocation, and far above anything the other unit
        // tests allocate meanwhile in this process.
        let big = tch::Tensor::empty([1 << 28], tch::kind::FLOAT_CPU);
        drop(big);
        let first = step_reading(Place::Cpu);
        let second = step_reading(Place::Cpu);
        assert!(first.peak_allocated_bytes.unwrap() >= 1 << 30, "{first:?}");
        assert!(
            second.peak_allocated_bytes.unwrap() < first.peak_allocated_bytes.unwrap(),
            "the first reading started a new window: {second:?}"
        );
        let mut window = StepMemory::default();
        window.fold(&first);
        window.fold(&second);
        assert_eq!(window.peak_allocated_bytes, first.peak_allocated_bytes);
        assert_eq!(window.allocated_bytes, second.allocated_bytes);
        assert!(window.rss_bytes > 0);
    }

    #[test]
    fn preflight_measures_what_the_cap_binds() {
        let cuda = MemorySample {
            peak_allocated_bytes: Some(100),
            peak_reserved_bytes: Some(160),
            peak_rss_bytes: 900,
            ..Default::default()
        };
        assert_eq!(preflight_measure(&cuda), (160, "peak reserved"));
        let cpu = MemorySample {
            peak_reserved_bytes: None,
            ..cuda.clone()
        };
        assert_eq!(preflight_measure(&cpu), (100, "peak allocated"));
        let uncounted = MemorySample {
            peak_allocated_bytes: None,
            ..cpu
        };
        assert_eq!(preflight_measure(&uncounted), (900, "peak RSS"));
    }

    #[test]
    fn cpu_sample_has_tensor_bytes_once_counted_and_no_device_fields() {
        shim::cpu_alloc_install().unwrap();
        let _t = tch::Tensor::zeros([1024], tch::kind::FLOAT_CPU);
        let m = sample(Place::Cpu);
        assert!(m.rss_bytes > 0);
        assert!(m.allocated_bytes.unwrap() >= 4096);
        assert!(m.peak_allocated_bytes.unwrap() >= m.allocated_bytes.unwrap());
        let v = serde_json::to_value(&m).unwrap();
        assert!(v.get("reserved_bytes").is_none() && v.get("device_total_bytes").is_none());
    }
}
