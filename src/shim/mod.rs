//! The bridge to the libtorch calls tch lacks (see shim.cpp): memory statistics, cache control,
//! device memory info, versions, the allocator snapshot, the counting CPU allocator, and the
//! optimizer's in-place foreach ops and fused kernels.
//! Everything C++ stays behind this module.
pub mod copies;
pub mod dist;
pub mod graph;

use std::ffi::{c_char, CStr};

use anyhow::{bail, Result};
use serde::Serialize;
use torch_sys::C_tensor;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct MtStat {
    current: i64,
    peak: i64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct MtDeviceStats {
    allocated: MtStat,
    reserved: MtStat,
    active: MtStat,
    inactive_split: MtStat,
    num_alloc_retries: i64,
    num_ooms: i64,
    requested: MtStat,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct MtCpuStats {
    allocated: i64,
    peak: i64,
    cap: i64,
    num_ooms: i64,
    installed: i32,
    host_allocated: i64,
    host_peak: i64,
}

extern "C" {
    fn mt_cpu_alloc_install() -> *mut c_char;
    fn mt_cpu_alloc_set_cap(cap: i64);
    fn mt_cpu_alloc_stats(out: *mut MtCpuStats);
    fn mt_cpu_alloc_reset_peak();
    fn mt_host_scope_enter();
    fn mt_host_scope_exit();
    fn mt_shape_scope_enter(out: *mut *mut std::ffi::c_void) -> *mut c_char;
    fn mt_shape_scope_exit(scope: *mut std::ffi::c_void);
    fn mt_cuda_device_facts(ordinal: i64, total: *mut u64, uuid: *mut u8) -> *mut c_char;
    fn mt_cuda_set_memory_fraction(fraction: f64, device: i64) -> *mut c_char;
    fn mt_free_error(e: *mut c_char);
    fn mt_accelerator_available() -> i32;
    fn mt_accelerator_device_count(out: *mut i64) -> *mut c_char;
    fn mt_device_stats(device: i64, out: *mut MtDeviceStats) -> *mut c_char;
    fn mt_empty_cache() -> *mut c_char;
    fn mt_synchronize(device: i64) -> *mut c_char;
    fn mt_reset_peak_stats(device: i64) -> *mut c_char;
    fn mt_set_deterministic() -> *mut c_char;
    fn mt_memory_info(device: i64, free: *mut u64, total: *mut u64) -> *mut c_char;
    fn mt_versions(major: *mut i64, minor: *mut i64, patch: *mut i64, cuda: *mut i64, cudnn: *mut i64);
    fn mt_has_cuda_snapshot() -> i32;
    fn mt_record_memory_history(enabled: i32, max_entries: u64) -> *mut c_char;
    fn mt_memory_snapshot(data: *mut *mut c_char, len: *mut u64) -> *mut c_char;
    fn mt_cuda_keep_oom_snapshots() -> *mut c_char;
    fn mt_cuda_take_oom_snapshot(data: *mut *mut c_char, len: *mut u64) -> *mut c_char;
    fn mt_free_buffer(b: *mut c_char);
    fn mt_autocast_enter(device_type: i32, dtype: i32, prev_enabled: *mut i32, prev_dtype: *mut i32) -> *mut c_char;
    fn mt_autocast_exit(device_type: i32, prev_enabled: i32, prev_dtype: i32) -> *mut c_char;
    fn mt_autocast_enabled(device_type: i32) -> i32;
    fn mt_rng_get_state(device_type: i32, index: i64, data: *mut *mut c_char, len: *mut u64) -> *mut c_char;
    fn mt_rng_set_state(device_type: i32, index: i64, data: *const c_char, len: u64) -> *mut c_char;
    fn mt_backward(outputs: *const *const C_tensor, grads: *const *const C_tensor, n: i64) -> *mut c_char;
    fn mt_drop_grads(params: *const *const C_tensor, n: i64) -> *mut c_char;
    fn mt_foreach(
        op: i32,
        a: *const *const C_tensor,
        b: *const *const C_tensor,
        c: *const *const C_tensor,
        n: i64,
        scalars: *const f64,
        scalar: f64,
    ) -> *mut c_char;
    fn mt_fused_adam(
        params: *const *const C_tensor,
        grads: *const *const C_tensor,
        exp_avgs: *const *const C_tensor,
        exp_avg_sqs: *const *const C_tensor,
        steps: *const *const C_tensor,
        n: i64,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        decoupled: i32,
        grad_scale: *const C_tensor,
        found_inf: *const C_tensor,
        lr_on_device: *const C_tensor,
    ) -> *mut c_char;
    fn mt_fused_sgd(
        params: *const *const C_tensor,
        grads: *const *const C_tensor,
        bufs: *const *const C_tensor,
        n: i64,
        n_bufs: i64,
        weight_decay: f64,
        momentum: f64,
        lr: f64,
        nesterov: i32,
        first_step: i32,
        grad_scale: *const C_tensor,
        found_inf: *const C_tensor,
        lr_on_device: *const C_tensor,
    ) -> *mut c_char;
    fn mt_amp_unscale(
        grads: *const *const C_tensor,
        n: i64,
        found_inf: *const C_tensor,
        inv_scale: *const C_tensor,
    ) -> *mut c_char;
    fn mt_script_load(path: *const c_char, device_type: i32, index: i64, out: *mut *mut MtScript) -> *mut c_char;
    fn mt_script_free(m: *mut MtScript);
    fn mt_script_tensors(
        m: *mut MtScript,
        which: i32,
        names: *mut *mut c_char,
        tensors: *mut *mut *mut C_tensor,
        n: *mut i64,
    ) -> *mut c_char;
    fn mt_script_train(m: *mut MtScript, on: i32) -> *mut c_char;
    fn mt_script_forward(m: *mut MtScript, x: *const C_tensor, out: *mut *mut C_tensor) -> *mut c_char;
}

#[repr(C)]
struct MtScript {
    _opaque: [u8; 0],
}

/// Turns the shim's error convention (null = ok, else a malloc'd message) into a Result.
fn check(err: *mut c_char) -> Result<()> {
    if err.is_null() {
        return Ok(());
    }
    // SAFETY: non-null errors are NUL-terminated strings allocated by the shim.
    let msg = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
    unsafe { mt_free_error(err) };
    bail!("libtorch: {}", first_line(&msg))
}

/// libtorch messages carry a C++ backtrace after the reason ("Exception raised from ..." or
/// "frame #0: ..."); users need only the reason.
pub fn first_line(msg: &str) -> &str {
    let cut = ["\nException raised from", "\nframe #0:"]
        .iter()
        .filter_map(|m| msg.find(m))
        .min()
        .unwrap_or(msg.len());
    msg[..cut].trim()
}

/// Allocator statistics of one device, in bytes (current and peak since the last reset).
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct DeviceStats {
    pub allocated: u64,
    pub peak_allocated: u64,
    pub reserved: u64,
    pub peak_reserved: u64,
    pub active: u64,
    pub peak_active: u64,
    pub inactive_split: u64,
    pub peak_inactive_split: u64,
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    /// The bytes tensors asked for, before the allocator rounds each to its block (`allocated`
    /// counts whole blocks: a request served from a cached block whose remainder is too small to
    /// split holds the whole block). Zero under cudaMallocAsync, which does not count it.
    pub requested: u64,
    pub peak_requested: u64,
}

/// Whether libtorch sees an accelerator (CUDA here) with at least one device.
pub fn accelerator_available() -> bool {
    unsafe { mt_accelerator_available() == 1 }
}

pub fn device_count() -> Result<usize> {
    let mut n = 0i64;
    check(unsafe { mt_accelerator_device_count(&mut n) })?;
    Ok(n.max(0) as usize)
}

fn no_accelerator<T>() -> Result<Option<T>> {
    Ok(None)
}

/// Allocator statistics; `None` when there is no accelerator.
pub fn device_stats(device: usize) -> Result<Option<DeviceStats>> {
    if !accelerator_available() {
        return no_accelerator();
    }
    let mut s = MtDeviceStats::default();
    check(unsafe { mt_device_stats(device as i64, &mut s) })?;
    let u = |v: i64| v.max(0) as u64;
    Ok(Some(DeviceStats {
        allocated: u(s.allocated.current),
        peak_allocated: u(s.allocated.peak),
        reserved: u(s.reserved.current),
        peak_reserved: u(s.reserved.peak),
        active: u(s.active.current),
        peak_active: u(s.active.peak),
        inactive_split: u(s.inactive_split.current),
        peak_inactive_split: u(s.inactive_split.peak),
        num_alloc_retries: u(s.num_alloc_retries),
        num_ooms: u(s.num_ooms),
        requested: u(s.requested.current),
        peak_requested: u(s.requested.peak),
    }))
}

/// Releases cached, unused blocks back to the driver. Returns false when there is no accelerator.
/// Deterministic kernels from here on, where libtorch has them (a warning names an op that has
/// none), as PyTorch's `torch.use_deterministic_algorithms(True, warn_only=True)` with cuDNN's
/// deterministic mode: for comparing a run with PyTorch's on a GPU.
pub fn set_deterministic() -> Result<()> {
    check(unsafe { mt_set_deterministic() })
}

pub fn empty_cache() -> Result<bool> {
    if !accelerator_available() {
        return Ok(false);
    }
    check(unsafe { mt_empty_cache() })?;
    Ok(true)
}

pub fn synchronize(device: usize) -> Result<bool> {
    if !accelerator_available() {
        return Ok(false);
    }
    check(unsafe { mt_synchronize(device as i64) })?;
    Ok(true)
}

pub fn reset_peak_stats(device: usize) -> Result<bool> {
    if !accelerator_available() {
        return Ok(false);
    }
    check(unsafe { mt_reset_peak_stats(device as i64) })?;
    Ok(true)
}

/// (free, total) bytes of the device as the driver sees them; `None` without an accelerator.
pub fn memory_info(device: usize) -> Result<Option<(u64, u64)>> {
    if !accelerator_available() {
        return no_accelerator();
    }
    let (mut free, mut total) = (0u64, 0u64);
    check(unsafe { mt_memory_info(device as i64, &mut free, &mut total) })?;
    Ok(Some((free, total)))
}

#[derive(Debug, Clone, Serialize)]
pub struct Versions {
    pub libtorch: String,
    /// e.g. "13.0"; None on a build or machine without CUDA.
    pub cuda: Option<String>,
    /// e.g. "9.10.2"; None without cuDNN.
    pub cudnn: Option<String>,
}

pub fn versions() -> Versions {
    let (mut a, mut b, mut c, mut cuda, mut cudnn) = (0, 0, 0, 0, 0);
    unsafe { mt_versions(&mut a, &mut b, &mut c, &mut cuda, &mut cudnn) };
    Versions {
        libtorch: format!("{a}.{b}.{c}"),
        // CUDA runtime encodes major*1000 + minor*10; cuDNN (9.x) major*10000 + minor*100 + patch.
        cuda: (cuda > 0).then(|| format!("{}.{}", cuda / 1000, (cuda % 1000) / 10)),
        cudnn: (cudnn > 0).then(|| format!("{}.{}.{}", cudnn / 10000, (cudnn % 10000) / 100, cudnn % 100)),
    }
}

/// Whether this binary was built with the CUDA allocator's snapshot support.
pub fn has_snapshot_support() -> bool {
    unsafe { mt_has_cuda_snapshot() == 1 }
}

/// Starts (or stops) recording allocator history so a later snapshot has stack traces and events.
pub fn record_memory_history(enabled: bool, max_entries: u64) -> Result<()> {
    if !accelerator_available() {
        bail!("recording memory history needs a CUDA device, and none is available");
    }
    check(unsafe { mt_record_memory_history(enabled as i32, max_entries) })
}

/// The allocator snapshot as the pickle PyTorch's memory_viz page loads.
pub fn memory_snapshot() -> Result<Vec<u8>> {
    if !accelerator_available() {
        bail!("a memory snapshot needs a CUDA device, and none is available");
    }
    let mut data: *mut c_char = std::ptr::null_mut();
    let mut len = 0u64;
    check(unsafe { mt_memory_snapshot(&mut data, &mut len) })?;
    Ok(handed_over(data, len).unwrap_or_default())
}

/// A buffer the shim handed over (malloc'd, `len` bytes), copied and freed; None for a null one.
fn handed_over(data: *mut c_char, len: u64) -> Option<Vec<u8>> {
    if data.is_null() {
        return None;
    }
    // SAFETY: the shim's contract: a non-null buffer holds `len` bytes and is ours to free.
    let out = unsafe { std::slice::from_raw_parts(data as *const u8, len as usize) }.to_vec();
    unsafe { mt_free_buffer(data) };
    Some(out)
}

/// From now on each CUDA OOM keeps the allocator snapshot of its moment, before anything is
/// freed (`take_oom_snapshot` hands it over). Initialises CUDA.
pub fn keep_oom_snapshots() -> Result<()> {
    check(unsafe { mt_cuda_keep_oom_snapshots() })
}

/// The snapshot kept at the last CUDA OOM, once; None when no OOM kept one.
pub fn take_oom_snapshot() -> Result<Option<Vec<u8>>> {
    let mut data: *mut c_char = std::ptr::null_mut();
    let mut len = 0u64;
    check(unsafe { mt_cuda_take_oom_snapshot(&mut data, &mut len) })?;
    Ok(handed_over(data, len))
}

/// Tensor bytes on the CPU as the counting allocator sees them.
#[derive(Debug, Default, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct CpuStats {
    pub allocated: u64,
    pub peak_allocated: u64,
    /// None: no cap.
    pub cap: Option<u64>,
    pub num_ooms: u64,
    /// False until `cpu_alloc_install`; then every CPU tensor allocated from here on is counted.
    pub installed: bool,
    /// Bytes allocated inside a [`HostScope`], counted apart and never capped.
    pub host_allocated: u64,
    pub host_peak: u64,
}

/// Makes libtorch's CPU allocator the counting one (idempotent). Call before loading anything.
pub fn cpu_alloc_install() -> Result<()> {
    check(unsafe { mt_cpu_alloc_install() })
}

/// What the counting CPU allocator's out-of-memory message ends with when its cap refused the
/// allocation (shim.cpp), as against the machine's own malloc failing.
pub const CPU_CAP_REFUSED: &str = "cap (memory.limit / memory.fraction)";

/// Caps live CPU tensor bytes; an allocation past it fails with PyTorch's out-of-memory error.
/// `None` removes the cap.
pub fn cpu_alloc_set_cap(bytes: Option<u64>) {
    let v = bytes.map_or(0, |b| b.min(i64::MAX as u64) as i64);
    unsafe { mt_cpu_alloc_set_cap(v) }
}

pub fn cpu_alloc_stats() -> CpuStats {
    let mut s = MtCpuStats::default();
    unsafe { mt_cpu_alloc_stats(&mut s) };
    CpuStats {
        allocated: s.allocated.max(0) as u64,
        peak_allocated: s.peak.max(0) as u64,
        cap: (s.cap > 0).then_some(s.cap as u64),
        num_ooms: s.num_ooms.max(0) as u64,
        installed: s.installed == 1,
        host_allocated: s.host_allocated.max(0) as u64,
        host_peak: s.host_peak.max(0) as u64,
    }
}

/// Starts a new peak window: the peak becomes what is allocated now (device and host).
pub fn cpu_alloc_reset_peak() {
    unsafe { mt_cpu_alloc_reset_peak() }
}

/// While alive, CPU tensors this thread allocates count as host memory: apart from the device
/// count and never against the cap. Not `Send`: a scope belongs to the thread that opened it.
pub struct HostScope(std::marker::PhantomData<*const ()>);

impl HostScope {
    pub fn enter() -> Self {
        unsafe { mt_host_scope_enter() };
        HostScope(std::marker::PhantomData)
    }
}

impl Drop for HostScope {
    fn drop(&mut self) {
        unsafe { mt_host_scope_exit() }
    }
}

/// While alive, tensors this thread makes by shape (`zeros`, `randn`, an initialiser) are meta
/// tensors: sizes and dtypes without storage or values. A model built inside one can be counted
/// at any size; nothing inside may read or copy values. Not `Send`: the scope is this thread's.
pub struct ShapeScope(*mut std::ffi::c_void);

impl ShapeScope {
    pub fn enter() -> Result<Self> {
        let mut scope = std::ptr::null_mut();
        check(unsafe { mt_shape_scope_enter(&mut scope) })?;
        Ok(ShapeScope(scope))
    }
}

impl Drop for ShapeScope {
    fn drop(&mut self) {
        unsafe { mt_shape_scope_exit(self.0) }
    }
}

/// What the driver says of a CUDA device, read without creating a context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaDeviceFacts {
    pub total_bytes: u64,
    pub uuid: [u8; 16],
}

impl CudaDeviceFacts {
    /// The UUID as NVML writes it: `GPU-` and 8-4-4-4-12 hex digits.
    pub fn nvml_uuid(&self) -> String {
        let hex: String = self.uuid.iter().map(|b| format!("{b:02x}")).collect();
        format!(
            "GPU-{}-{}-{}-{}-{}",
            &hex[0..8],
            &hex[8..12],
            &hex[12..16],
            &hex[16..20],
            &hex[20..32]
        )
    }
}

/// Caps CUDA device `device` at `fraction` of its memory on the caching allocator itself, which
/// every allocator backend honours (cudaMallocAsync ignores the allocator settings' fraction).
/// Initialises CUDA: the allocator settings must already be in the environment.
pub fn cuda_set_memory_fraction(fraction: f64, device: usize) -> Result<()> {
    check(unsafe { mt_cuda_set_memory_fraction(fraction, device as i64) })
}

/// CUDA device `ordinal`'s total memory and UUID, without a context and without starting the
/// caching allocator (whose settings must still be open to change); `None` without CUDA.
pub fn cuda_device_facts(ordinal: usize) -> Result<Option<CudaDeviceFacts>> {
    if !accelerator_available() {
        return Ok(None);
    }
    let mut f = CudaDeviceFacts {
        total_bytes: 0,
        uuid: [0; 16],
    };
    check(unsafe { mt_cuda_device_facts(ordinal as i64, &mut f.total_bytes, f.uuid.as_mut_ptr()) })?;
    Ok(Some(f))
}

/// c10::DeviceType and index of a tch device.
fn device_parts(d: tch::Device) -> (i32, i64) {
    match d {
        tch::Device::Cuda(i) => (1, i as i64),
        _ => (0, -1),
    }
}

/// An autocast region: on for the device type in `dtype` until dropped, when the previous state
/// comes back (also when an OOM unwinds the step) and the outermost region drops the cast cache.
pub struct Autocast {
    device_type: i32,
    prev_enabled: i32,
    prev_dtype: i32,
}

impl Autocast {
    pub fn enter(device: tch::Device, dtype: tch::Kind) -> Result<Self> {
        let st = match dtype {
            tch::Kind::Half => 5,
            tch::Kind::BFloat16 => 15,
            k => bail!("autocast runs in fp16 or bf16, not {k:?}"),
        };
        let (device_type, _) = device_parts(device);
        let (mut prev_enabled, mut prev_dtype) = (0, 0);
        check(unsafe { mt_autocast_enter(device_type, st, &mut prev_enabled, &mut prev_dtype) })?;
        Ok(Autocast {
            device_type,
            prev_enabled,
            prev_dtype,
        })
    }
}

impl Drop for Autocast {
    fn drop(&mut self) {
        // Restoring plain flags cannot fail in practice; an error here would only be reported.
        if let Err(e) = check(unsafe { mt_autocast_exit(self.device_type, self.prev_enabled, self.prev_dtype) }) {
            tracing::warn!("leaving autocast: {e}");
        }
    }
}

/// Sets autograd's grad mode and returns the previous one (tch does not expose this).
pub fn set_grad_enabled(on: bool) -> bool {
    // SAFETY: a plain call into libtorch's C API that toggles a thread-local flag.
    unsafe { torch_sys::at_grad_set_enabled(on as i32) != 0 }
}

pub fn grad_enabled() -> bool {
    let prev = set_grad_enabled(true);
    set_grad_enabled(prev);
    prev
}

pub fn autocast_enabled(device: tch::Device) -> bool {
    unsafe { mt_autocast_enabled(device_parts(device).0) != 0 }
}

/// The default generator's state of a device, as opaque bytes.
pub fn rng_state(device: tch::Device) -> Result<Vec<u8>> {
    let (t, i) = device_parts(device);
    let mut data: *mut c_char = std::ptr::null_mut();
    let mut len = 0u64;
    check(unsafe { mt_rng_get_state(t, i, &mut data, &mut len) })?;
    Ok(handed_over(data, len).unwrap_or_default())
}

pub fn set_rng_state(device: tch::Device, state: &[u8]) -> Result<()> {
    let (t, i) = device_parts(device);
    check(unsafe { mt_rng_set_state(t, i, state.as_ptr() as *const c_char, state.len() as u64) })
}

/// torch.autograd.backward(outputs, grads): leaves accumulate into their .grad.
pub fn backward(outputs: &[tch::Tensor], grads: &[tch::Tensor]) -> Result<()> {
    assert_eq!(outputs.len(), grads.len());
    let o: Vec<*const C_tensor> = outputs.iter().map(|t| t.as_ptr()).collect();
    let g: Vec<*const C_tensor> = grads.iter().map(|t| t.as_ptr()).collect();
    check(unsafe { mt_backward(o.as_ptr(), g.as_ptr(), o.len() as i64) })
}

/// GradScaler's fused unscale: grads *= inv_scale in place; found_inf becomes 1 on inf or NaN.
pub fn amp_unscale(grads: &[tch::Tensor], found_inf: &tch::Tensor, inv_scale: &tch::Tensor) -> Result<()> {
    let g: Vec<*const C_tensor> = grads.iter().map(|t| t.as_ptr()).collect();
    check(unsafe { mt_amp_unscale(g.as_ptr(), g.len() as i64, found_inf.as_ptr(), inv_scale.as_ptr()) })
}

/// Releases the parameters' gradients (`zero_grad(set_to_none=True)`).
pub fn drop_grads<'a>(params: impl IntoIterator<Item = &'a tch::Tensor>) -> Result<()> {
    let p: Vec<*const C_tensor> = params.into_iter().map(|t| t.as_ptr()).collect();
    check(unsafe { mt_drop_grads(p.as_ptr(), p.len() as i64) })
}

fn ptrs(ts: &[tch::Tensor]) -> Vec<*const C_tensor> {
    ts.iter().map(|t| t.as_ptr()).collect()
}

/// One in-place `torch._foreach_*_` op over tensor lists of equal length: `a` is written; `b`
/// and `c` are read where the op has them. Scalars are Python numbers (f64), as the Python
/// optimizers pass them.
#[derive(Debug, Clone, Copy)]
pub enum Foreach<'a> {
    /// `_foreach_copy_(a, b)`
    Copy,
    /// `_foreach_mul_(a, s)`
    Mul(f64),
    /// `_foreach_add_(a, s)`
    AddScalar(f64),
    /// `_foreach_add_(a, b, alpha=s)`
    Add(f64),
    /// `_foreach_lerp_(a, b, weight)`
    Lerp(f64),
    /// `_foreach_addcmul_(a, b, c, value)`
    Addcmul(f64),
    /// `_foreach_sqrt_(a)`
    Sqrt,
    /// `_foreach_div_(a, [s_i])`
    DivList(&'a [f64]),
    /// `_foreach_addcdiv_(a, b, c, [s_i])`
    AddcdivList(&'a [f64]),
}

/// Runs `op` (see [`Foreach`]); a length mismatch is an error, not undefined behaviour.
pub fn foreach(op: Foreach, a: &[tch::Tensor], b: &[tch::Tensor], c: &[tch::Tensor]) -> Result<()> {
    let n = a.len();
    let (code, reads, scalar, list): (i32, usize, f64, Option<&[f64]>) = match op {
        Foreach::Copy => (0, 1, 0.0, None),
        Foreach::Mul(s) => (1, 0, s, None),
        Foreach::AddScalar(s) => (2, 0, s, None),
        Foreach::Add(s) => (3, 1, s, None),
        Foreach::Lerp(s) => (4, 1, s, None),
        Foreach::Addcmul(s) => (5, 2, s, None),
        Foreach::Sqrt => (6, 0, 0.0, None),
        Foreach::DivList(l) => (7, 0, 0.0, Some(l)),
        Foreach::AddcdivList(l) => (8, 2, 0.0, Some(l)),
    };
    let lists = [b, c];
    if lists[..reads].iter().any(|l| l.len() != n) || list.is_some_and(|l| l.len() != n) {
        bail!("foreach {op:?}: every list must hold {n} entries");
    }
    let (pa, pb, pc) = (ptrs(a), ptrs(b), ptrs(c));
    let or_null = |p: &Vec<*const C_tensor>, used: bool| if used { p.as_ptr() } else { std::ptr::null() };
    let l = list.map_or(std::ptr::null(), |l| l.as_ptr());
    check(unsafe {
        mt_foreach(
            code,
            pa.as_ptr(),
            or_null(&pb, reads >= 1),
            or_null(&pc, reads >= 2),
            n as i64,
            l,
            scalar,
        )
    })
}

/// Adam's hyper-parameters for [`fused_adam`].
#[derive(Debug, Clone, Copy)]
pub struct FusedAdam {
    pub lr: f64,
    pub betas: [f64; 2],
    pub weight_decay: f64,
    pub eps: f64,
    /// AdamW (`_fused_adamw_`) rather than Adam.
    pub decoupled: bool,
}

/// What a fused kernel reads from the device besides its lists: GradScaler's arguments (the
/// scale the gradients still carry, None: they were unscaled already; the flag that makes the
/// kernel skip the step) and the learning rate, when it lives in a 0-dim float32 tensor on the
/// parameters' device (None: the hyper-parameters' `lr`), as a captured step needs.
#[derive(Clone, Copy, Default)]
pub struct Scaling<'a> {
    pub grad_scale: Option<&'a tch::Tensor>,
    pub found_inf: Option<&'a tch::Tensor>,
    pub lr: Option<&'a tch::Tensor>,
}

fn opt_ptr(t: Option<&tch::Tensor>) -> *const C_tensor {
    t.map_or(std::ptr::null(), |t| t.as_ptr())
}

/// `torch._fused_adam_` / `_fused_adamw_` in place (amsgrad and maximize off); `steps` holds
/// each parameter's step count, a 0-dim float tensor on its device.
pub fn fused_adam(
    h: FusedAdam,
    params: &[tch::Tensor],
    grads: &[tch::Tensor],
    state: [&[tch::Tensor]; 2],
    steps: &[tch::Tensor],
    scaling: Scaling,
) -> Result<()> {
    let n = params.len();
    if [grads.len(), state[0].len(), state[1].len(), steps.len()]
        .iter()
        .any(|&l| l != n)
    {
        bail!("fused Adam: every list must hold {n} entries");
    }
    let (p, g, m, v, s) = (ptrs(params), ptrs(grads), ptrs(state[0]), ptrs(state[1]), ptrs(steps));
    check(unsafe {
        mt_fused_adam(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            s.as_ptr(),
            n as i64,
            h.lr,
            h.betas[0],
            h.betas[1],
            h.weight_decay,
            h.eps,
            h.decoupled as i32,
            opt_ptr(scaling.grad_scale),
            opt_ptr(scaling.found_inf),
            opt_ptr(scaling.lr),
        )
    })
}

/// SGD's hyper-parameters for [`fused_sgd`].
#[derive(Debug, Clone, Copy)]
pub struct FusedSgd {
    pub lr: f64,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    /// The momentum buffers are written from the gradient rather than updated.
    pub first_step: bool,
}

/// `torch._fused_sgd_` in place (dampening 0, maximize off); `bufs` is empty without momentum.
pub fn fused_sgd(
    h: FusedSgd,
    params: &[tch::Tensor],
    grads: &[tch::Tensor],
    bufs: &[tch::Tensor],
    scaling: Scaling,
) -> Result<()> {
    let n = params.len();
    if grads.len() != n || !(bufs.is_empty() || bufs.len() == n) {
        bail!("fused SGD: every list must hold {n} entries");
    }
    let (p, g, b) = (ptrs(params), ptrs(grads), ptrs(bufs));
    check(unsafe {
        mt_fused_sgd(
            p.as_ptr(),
            g.as_ptr(),
            b.as_ptr(),
            n as i64,
            b.len() as i64,
            h.weight_decay,
            h.momentum,
            h.lr,
            h.nesterov as i32,
            h.first_step as i32,
            opt_ptr(scaling.grad_scale),
            opt_ptr(scaling.found_inf),
            opt_ptr(scaling.lr),
        )
    })
}

/// A loaded TorchScript module (`torch.jit.load`).
#[derive(Debug)]
pub struct ScriptModule {
    ptr: *mut MtScript,
}

impl Drop for ScriptModule {
    fn drop(&mut self) {
        unsafe { mt_script_free(self.ptr) }
    }
}

impl ScriptModule {
    /// Loads the module with its tensors on `device`.
    pub fn load(path: &std::path::Path, device: tch::Device) -> Result<Self> {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())?;
        let (t, i) = device_parts(device);
        let mut ptr = std::ptr::null_mut();
        check(unsafe { mt_script_load(c.as_ptr(), t, i, &mut ptr) })?;
        Ok(ScriptModule { ptr })
    }

    fn tensors(&self, which: i32) -> Result<Vec<(String, tch::Tensor)>> {
        let mut names = std::ptr::null_mut();
        let mut ts = std::ptr::null_mut();
        let mut n = 0i64;
        check(unsafe { mt_script_tensors(self.ptr, which, &mut names, &mut ts, &mut n) })?;
        // SAFETY: on success both buffers are malloc'd by the shim; each tensor pointer is a
        // new'd at::Tensor that tch's Tensor takes over.
        let joined = unsafe { CStr::from_ptr(names) }.to_string_lossy().into_owned();
        let tensors: Vec<tch::Tensor> = (0..n as usize)
            .map(|k| unsafe { tch::Tensor::from_ptr(*ts.add(k)) })
            .collect();
        unsafe {
            mt_free_buffer(names);
            mt_free_buffer(ts as *mut c_char);
        }
        let names = joined.split('\n').filter(|s| !s.is_empty()).map(str::to_owned);
        Ok(names.zip(tensors).collect())
    }

    /// Parameters with their state_dict names (sharing storage with the module).
    pub fn named_parameters(&self) -> Result<Vec<(String, tch::Tensor)>> {
        self.tensors(0)
    }

    /// Buffers (BatchNorm running statistics and the like), as above.
    pub fn named_buffers(&self) -> Result<Vec<(String, tch::Tensor)>> {
        self.tensors(1)
    }

    pub fn set_train(&self, on: bool) -> Result<()> {
        check(unsafe { mt_script_train(self.ptr, on as i32) })
    }

    pub fn forward(&self, x: &tch::Tensor) -> Result<tch::Tensor> {
        let mut out = std::ptr::null_mut();
        check(unsafe { mt_script_forward(self.ptr, x.as_ptr(), &mut out) })?;
        Ok(unsafe { tch::Tensor::from_ptr(out) })
    }
}

#[cfg(test)]
mod tests;
