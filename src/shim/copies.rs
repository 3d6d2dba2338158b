//! Copies between pinned host memory and a CUDA device on a copy stream of its own, the events
//! that order them against the compute stream, and the pinned host allocator's figures.
use std::ffi::c_char;

use anyhow::Result;
use torch_sys::C_tensor;

use super::check;

#[repr(C)]
struct MtEvent {
    _opaque: [u8; 0],
}

extern "C" {
    fn mt_pinned_empty(sizes: *const i64, n: i64, dtype: i32, out: *mut *mut C_tensor) -> *mut c_char;
    fn mt_cuda_copies_after_compute(device: i64) -> *mut c_char;
    fn mt_cuda_sync_debug_error() -> *mut c_char;
    fn mt_cuda_copy(device: i64, dst: *const C_tensor, src: *const C_tensor) -> *mut c_char;
    fn mt_cuda_copies_event(device: i64, out: *mut *mut MtEvent) -> *mut c_char;
    fn mt_cuda_event_block_compute(e: *mut MtEvent, device: i64) -> *mut c_char;
    fn mt_cuda_compute_mark(device: i64, out: *mut *mut MtEvent) -> *mut c_char;
    fn mt_cuda_event_elapsed_ms(from: *mut MtEvent, to: *mut MtEvent, ms: *mut f64) -> *mut c_char;
    fn mt_cuda_event_synchronize(e: *mut MtEvent) -> *mut c_char;
    fn mt_cuda_event_free(e: *mut MtEvent);
    fn mt_cuda_host_stats(active: *mut u64, peak_active: *mut u64) -> *mut c_char;
    fn mt_cuda_host_reset_peak() -> *mut c_char;
}

/// An uninitialised CPU tensor in pinned memory (needs a CUDA runtime).
pub fn pinned_empty(size: &[i64], kind: tch::Kind) -> Result<tch::Tensor> {
    let mut out = std::ptr::null_mut();
    check(unsafe { mt_pinned_empty(size.as_ptr(), size.len() as i64, scalar_type(kind)?, &mut out) })?;
    // SAFETY: on success `out` is a new'd at::Tensor that tch's Tensor takes over.
    Ok(unsafe { tch::Tensor::from_ptr(out) })
}

/// c10's ScalarType code of `kind` (tch keeps its own conversion private).
fn scalar_type(kind: tch::Kind) -> Result<i32> {
    use tch::Kind::*;
    Ok(match kind {
        Uint8 => 0,
        Int8 => 1,
        Int16 => 2,
        Int => 3,
        Int64 => 4,
        Half => 5,
        Float => 6,
        Double => 7,
        Bool => 11,
        BFloat16 => 15,
        other => anyhow::bail!("no pinned host tensors of kind {other:?}"),
    })
}

/// Every synchronizing CUDA call from now on fails, saying where it came from (a diagnostic).
pub fn cuda_sync_debug_error() -> Result<()> {
    check(unsafe { mt_cuda_sync_debug_error() })
}

/// The copy stream of CUDA device `device` waits for the work the compute stream has queued
/// so far: copies issued next read what that work wrote, and write memory it may still read.
pub fn copies_after_compute(device: usize) -> Result<()> {
    check(unsafe { mt_cuda_copies_after_compute(device as i64) })
}

/// `dst.copy_(src, non_blocking=True)` on the copy stream; one side pinned, the other on
/// `device`. Both stay reserved for the copy until it has run.
pub fn copy_async(device: usize, dst: &tch::Tensor, src: &tch::Tensor) -> Result<()> {
    check(unsafe { mt_cuda_copy(device as i64, dst.as_ptr(), src.as_ptr()) })
}

/// A CUDA event: the copies queued so far on a device's copy stream, or a timed point behind
/// the work queued so far on its compute stream.
pub struct CudaEvent {
    ptr: *mut MtEvent,
    device: usize,
}

// SAFETY: a CUDA event may be waited on from any thread; the handle is owned.
unsafe impl Send for CudaEvent {}

impl CudaEvent {
    /// Marks the copies queued so far on the copy stream.
    pub fn after_copies(device: usize) -> Result<Self> {
        let mut ptr = std::ptr::null_mut();
        check(unsafe { mt_cuda_copies_event(device as i64, &mut ptr) })?;
        Ok(CudaEvent { ptr, device })
    }

    /// A timed event behind the compute stream's work so far: the device's own clock when it
    /// gets there, so the time between two is the device's, whenever the host looks.
    pub fn timed_on_compute(device: usize) -> Result<Self> {
        let mut ptr = std::ptr::null_mut();
        check(unsafe { mt_cuda_compute_mark(device as i64, &mut ptr) })?;
        Ok(CudaEvent { ptr, device })
    }

    /// The compute stream waits for the event (the host goes on).
    pub fn block_compute(&self) -> Result<()> {
        check(unsafe { mt_cuda_event_block_compute(self.ptr, self.device as i64) })
    }

    /// The host waits until the device has reached the event.
    pub fn synchronize(&self) -> Result<()> {
        check(unsafe { mt_cuda_event_synchronize(self.ptr) })
    }

    /// Seconds on the device's clock from `earlier` to this event, both timed and reached.
    pub fn seconds_since(&self, earlier: &CudaEvent) -> Result<f64> {
        let mut ms = 0.0;
        check(unsafe { mt_cuda_event_elapsed_ms(earlier.ptr, self.ptr, &mut ms) })?;
        Ok(ms / 1e3)
    }
}

impl Drop for CudaEvent {
    fn drop(&mut self) {
        unsafe { mt_cuda_event_free(self.ptr) }
    }
}

/// Pinned host memory in use now and its peak since the last reset, in bytes (zeros without
/// CUDA).
pub fn cuda_host_stats() -> Result<(u64, u64)> {
    let (mut active, mut peak) = (0, 0);
    check(unsafe { mt_cuda_host_stats(&mut active, &mut peak) })?;
    Ok((active, peak))
}

/// Starts a new peak window for pinned host memory.
pub fn cuda_host_reset_peak() -> Result<()> {
    check(unsafe { mt_cuda_host_reset_peak() })
}
