// The few libtorch calls tch does not bind: accelerator memory statistics, cache control,
// device memory info, version strings, the allocator's memory snapshot, the counting CPU
// allocator that gives CPU runs exact tensor-byte accounting and a cap, and the optimizer's
// in-place foreach ops and fused kernels.
//
// Every entry point is `extern "C"`, catches every C++ exception and returns it as a
// malloc'd message (freed with mt_free_error), so nothing unwinds into Rust and nothing
// aborts the process. Return value: nullptr on success.
#include <ATen/DeviceAccelerator.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <ATen/Functions.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/jit/api/module.h>
#include <torch/csrc/jit/runtime/graph_executor.h>
#include <torch/csrc/jit/serialization/import.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <dlfcn.h>
#include <cstdio>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <vector>
#include <string>

#ifdef MEMTRAIN_HAVE_CUDA
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include "guard.h"

using mt::dup_error;
using mt::guarded;
using mt::kNoMemoryForMessage;

namespace {

// ---------------------------------------------------------------------------------------------
// Counting CPU allocator
//
// Wraps libtorch's default CPU allocator. Every allocation carries a 64-byte header in front of
// the data (keeping the default's 64-byte alignment) with its size and the inner deleter, so the
// deleter can subtract exactly what was added without a lookup table. data == context, so
// raw_allocate/raw_deallocate keep working. An allocation that would pass the cap throws
// c10::OutOfMemoryError before anything is allocated: the semantics of CUDA's per-process
// memory fraction, on tensor bytes rather than on RSS.
//
// Allocations made while this thread is inside a host scope (`mt_host_scope_enter`) are counted
// apart, as "host" memory, and never against the cap: on the CPU they stand where pinned host
// buffers stand on a GPU machine, so the memory levers that move state off the device can be
// measured (and their exactness tested) without one. The header records which count an
// allocation joined, so its deleter (which may run on any thread) gives it back to the same one.

constexpr size_t kHeader = 64;

struct Header {
  uint64_t size;
  c10::DeleterFnPtr inner_deleter;
  void *inner_context;
  uint64_t host;
};
static_assert(sizeof(Header) <= kHeader, "header must fit in front of the data");

// MiB as PyTorch's own OOM messages put it; below a MiB (a tiny cap) in KiB or bytes, which
// "0.00 MiB" would hide.
std::string mib(int64_t b) {
  char buf[64];
  if (b >= 1024 * 1024) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", static_cast<double>(b) / (1024.0 * 1024.0));
  } else if (b >= 1024) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", static_cast<double>(b) / 1024.0);
  } else {
    std::snprintf(buf, sizeof buf, "%lld B", static_cast<long long>(b));
  }
  return buf;
}

struct CountingCpuAllocator final : c10::Allocator {
  c10::Allocator *inner = nullptr;
  std::atomic<int64_t> current{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> cap{0}; // 0: no cap
  std::atomic<int64_t> num_ooms{0};
  std::atomic<int64_t> host_current{0};
  std::atomic<int64_t> host_peak{0};

  static void counted_delete(void *data);

  static void raise_peak(std::atomic<int64_t> &peak, int64_t now) {
    int64_t seen = peak.load();
    while (now > seen && !peak.compare_exchange_weak(seen, now)) {
    }
  }

  // Host memory: counted on its own, never capped.
  c10::DataPtr allocate_host(size_t n) {
    const int64_t want = static_cast<int64_t>(n);
    raise_peak(host_peak, host_current.fetch_add(want) + want);
    c10::DataPtr raw;
    try {
      raw = inner->allocate(n + kHeader);
    } catch (...) {
      host_current.fetch_sub(want);
      throw;
    }
    return wrap(std::move(raw), n, true);
  }

  static c10::DataPtr wrap(c10::DataPtr raw, size_t n, bool host) {
    char *base = static_cast<char *>(raw.get());
    Header h{static_cast<uint64_t>(n), raw.get_deleter(), nullptr, host ? 1u : 0u};
    h.inner_context = raw.release_context();
    std::memcpy(base, &h, sizeof h);
    void *data = base + kHeader;
    return {data, data, &counted_delete, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DataPtr allocate(size_t n) override;
  c10::DeleterFnPtr raw_deleter() const override { return &counted_delete; }

  void copy_data(void *dest, const void *src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingCpuAllocator g_counting;
thread_local int t_host_depth = 0;

c10::DataPtr CountingCpuAllocator::allocate(size_t n) {
  if (n == 0) return inner->allocate(0);
  if (t_host_depth > 0) return allocate_host(n);
  const int64_t want = static_cast<int64_t>(n);
  const int64_t now = current.fetch_add(want) + want;
  const int64_t limit = cap.load();
  if (limit > 0 && now > limit) {
    current.fetch_sub(want);
    num_ooms.fetch_add(1);
    TORCH_CHECK_WITH(OutOfMemoryError, false, "CPU out of memory: can't allocate memory: tried to allocate ",
                     mib(want), " with ", mib(now - want), " of tensors already allocated under the run's ",
                     mib(limit), " cap (memory.limit / memory.fraction)");
  }
  raise_peak(peak, now);
  c10::DataPtr raw;
  try {
    raw = inner->allocate(n + kHeader);
  } catch (...) {
    current.fetch_sub(want);
    num_ooms.fetch_add(1);
    throw;
  }
  return wrap(std::move(raw), n, false);
}

void CountingCpuAllocator::counted_delete(void *data) {
  if (!data) return;
  char *base = static_cast<char *>(data) - kHeader;
  Header h;
  std::memcpy(&h, base, sizeof h);
  (h.host ? g_counting.host_current : g_counting.current).fetch_sub(static_cast<int64_t>(h.size));
  if (h.inner_deleter) h.inner_deleter(h.inner_context);
}

// Accelerator calls throw when no accelerator is present; callers check this first so that
// "no accelerator" is an answer, not an error.
bool have_accelerator() { return at::accelerator::getAccelerator(false).has_value(); }

} // namespace

// Helpers of the multi-tensor optimizer ops below.
namespace {
std::vector<at::Tensor> tensor_list(at::Tensor **ts, int64_t n) {
  std::vector<at::Tensor> v;
  v.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v.push_back(*ts[i]);
  return v;
}

std::optional<at::Tensor> maybe(at::Tensor *t) {
  if (!t) return std::nullopt;
  return *t;
}
} // namespace

extern "C" {

// Mirrors MtStat / MtDeviceStats in src/shim/mod.rs.
struct MtStat {
  int64_t current;
  int64_t peak;
};

struct MtDeviceStats {
  MtStat allocated;
  MtStat reserved;
  MtStat active;
  MtStat inactive_split;
  int64_t num_alloc_retries;
  int64_t num_ooms;
  MtStat requested;
};

void mt_free_error(char *e) {
  if (e != kNoMemoryForMessage) std::free(e);
}

// Mirrors MtCpuStats in src/shim/mod.rs.
struct MtCpuStats {
  int64_t allocated;
  int64_t peak;
  int64_t cap;
  int64_t num_ooms;
  int installed;
  int64_t host_allocated;
  int64_t host_peak;
};

// Installs the counting allocator as libtorch's CPU allocator (idempotent). Tensors allocated
// before keep their own deleters and are simply not counted.
char *mt_cpu_alloc_install() {
  return guarded([] {
    static bool done = false;
    if (done) return;
    g_counting.inner = c10::GetDefaultCPUAllocator();
    c10::SetCPUAllocator(&g_counting, /*priority=*/1);
    done = true;
  });
}

// cap <= 0 removes the cap.
void mt_cpu_alloc_set_cap(int64_t cap) { g_counting.cap.store(cap > 0 ? cap : 0); }

void mt_cpu_alloc_stats(MtCpuStats *out) {
  out->allocated = g_counting.current.load();
  out->peak = g_counting.peak.load();
  out->cap = g_counting.cap.load();
  out->num_ooms = g_counting.num_ooms.load();
  out->installed = g_counting.inner != nullptr ? 1 : 0;
  out->host_allocated = g_counting.host_current.load();
  out->host_peak = g_counting.host_peak.load();
}

void mt_cpu_alloc_reset_peak() {
  g_counting.peak.store(g_counting.current.load());
  g_counting.host_peak.store(g_counting.host_current.load());
}

// Host scopes nest; each enter has its exit on the same thread.
void mt_host_scope_enter() { ++t_host_depth; }
void mt_host_scope_exit() { --t_host_depth; }

// While a shape scope is open, this thread's factory calls (empty, zeros, randn...) make meta
// tensors: shapes and dtypes with no storage, so a model can be built to count its parameters
// without the gigabytes it would fill. BackendSelect is left out because it would turn the
// CPU device in the call's options back into a CPU kernel; with it gone the Meta key, the
// highest backend, picks the kernel. An op that needs values (copying data in or out) fails
// or, for tch's data constructors, reads a null pointer: only code that makes tensors by shape
// runs inside one.
//
// The scope puts back the thread's key sets exactly as it found them. An include guard would
// not: taking a key set away clears its functionality bits but keeps its backend bits, so the
// Meta backend bit would stay included and every later op on a CPU tensor (a multiply, an add)
// would pick the Meta kernel.
namespace {
c10::impl::LocalDispatchKeySet shape_keys() {
  auto keys = c10::impl::tls_local_dispatch_key_set();
  keys.included_ = keys.included_ | c10::DispatchKeySet(c10::DispatchKey::Meta);
  keys.excluded_ = keys.excluded_ | c10::DispatchKeySet(c10::DispatchKey::BackendSelect);
  return keys;
}

struct ShapeScope {
  c10::impl::ForceDispatchKeyGuard keys{shape_keys()};
};
} // namespace

char *mt_shape_scope_enter(void **out) {
  return mt::guarded([&] { *out = new ShapeScope(); });
}

void mt_shape_scope_exit(void *scope) { delete static_cast<ShapeScope *>(scope); }

int mt_accelerator_available() {
  try {
    return have_accelerator() && at::accelerator::deviceCount() > 0 ? 1 : 0;
  } catch (...) {
    return 0;
  }
}

char *mt_accelerator_device_count(int64_t *out) {
  return guarded([&] { *out = have_accelerator() ? at::accelerator::deviceCount() : 0; });
}

char *mt_device_stats(int64_t device, MtDeviceStats *out) {
  return guarded([&] {
    auto s = at::accelerator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
    constexpr auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    auto fill = [&](MtStat &dst, const c10::CachingAllocator::StatArray &src) {
      dst.current = src[agg].current;
      dst.peak = src[agg].peak;
    };
    fill(out->allocated, s.allocated_bytes);
    fill(out->reserved, s.reserved_bytes);
    fill(out->active, s.active_bytes);
    fill(out->inactive_split, s.inactive_split_bytes);
    fill(out->requested, s.requested_bytes);
    out->num_alloc_retries = s.num_alloc_retries;
    out->num_ooms = s.num_ooms;
  });
}

char *mt_empty_cache() {
  return guarded([] { at::accelerator::emptyCache(); });
}

char *mt_synchronize(int64_t device) {
  return guarded([&] { at::accelerator::synchronizeDevice(static_cast<c10::DeviceIndex>(device)); });
}

// The settings torch.use_deterministic_algorithms(True, warn_only=True) and
// torch.backends.cudnn.deterministic = True make in PyTorch, so a comparison with PyTorch on a
// GPU compares the same kernels' results and not two draws of their atomics' order.
char *mt_set_deterministic() {
  return guarded([] {
    auto &ctx = at::globalContext();
    ctx.setDeterministicAlgorithms(true, /*warn_only=*/true);
    ctx.setDeterministicCuDNN(true);
    ctx.setBenchmarkCuDNN(false);
  });
}

char *mt_reset_peak_stats(int64_t device) {
  return guarded([&] { at::accelerator::resetPeakStats(static_cast<c10::DeviceIndex>(device)); });
}

char *mt_memory_info(int64_t device, uint64_t *free_bytes, uint64_t *total_bytes) {
  return guarded([&] {
    auto [f, t] = at::accelerator::getMemoryInfo(static_cast<c10::DeviceIndex>(device));
    *free_bytes = f;
    *total_bytes = t;
  });
}

// Versions as integers; 0 where unknown (no CUDA build, no cuDNN).
void mt_versions(int64_t *torch_major, int64_t *torch_minor, int64_t *torch_patch,
                 int64_t *cuda_runtime, int64_t *cudnn) {
  *torch_major = TORCH_VERSION_MAJOR;
  *torch_minor = TORCH_VERSION_MINOR;
  *torch_patch = TORCH_VERSION_PATCH;
  *cuda_runtime = 0;
  *cudnn = 0;
  // Both are build-time facts of the CUDA runtime and cuDNN that libtorch_cuda carries; they
  // need no device, so `info` can report them on a machine without a GPU.
  try {
    *cuda_runtime = at::detail::getCUDAHooks().versionCUDART();
  } catch (...) {
  }
  try {
    *cudnn = at::detail::getCUDAHooks().versionCuDNN();
  } catch (...) {
  }
}

int mt_has_cuda_snapshot() {
#ifdef MEMTRAIN_HAVE_CUDA
  return 1;
#else
  return 0;
#endif
}

char *mt_record_memory_history(int enabled, uint64_t max_entries) {
  return guarded([&] {
#ifdef MEMTRAIN_HAVE_CUDA
    if (enabled) {
      torch::cuda::_record_memory_history(std::string("all"), std::string("all"), "all",
                                          static_cast<size_t>(max_entries));
    } else {
      torch::cuda::_record_memory_history(std::nullopt, std::string("all"), "all",
                                          static_cast<size_t>(max_entries));
    }
#else
    (void)enabled;
    (void)max_entries;
    throw std::runtime_error("this memtrain was built against a libtorch without CUDA");
#endif
  });
}

// The snapshot is returned as a malloc'd buffer the caller frees with mt_free_buffer.
char *mt_memory_snapshot(char **data, uint64_t *len) {
  return guarded([&] {
#ifdef MEMTRAIN_HAVE_CUDA
    std::string s = torch::cuda::_memory_snapshot_pickled();
    char *buf = static_cast<char *>(std::malloc(s.size() ? s.size() : 1));
    if (!buf) throw std::bad_alloc();
    std::memcpy(buf, s.data(), s.size());
    *data = buf;
    *len = s.size();
#else
    (void)data;
    (void)len;
    throw std::runtime_error("this memtrain was built against a libtorch without CUDA");
#endif
  });
}

void mt_free_buffer(char *b) { std::free(b); }

// A CUDA device's total memory and UUID from the driver API (libcuda.so.1), which needs no
// context: cudaMemGetInfo would create one, about 0.5 GiB the run could then not use, and under
// EXCLUSIVE_PROCESS compute mode the only context the device allows. The driver numbers devices
// as the runtime does (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER); the UUID is what NVML, which
// ignores both, is matched on.
char *mt_cuda_device_facts(int64_t ordinal, uint64_t *total_bytes, unsigned char *uuid16) {
  return guarded([&] {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) throw std::runtime_error("the NVIDIA driver's libcuda.so.1 cannot be loaded");
    using Init = int (*)(unsigned int);
    using DeviceGet = int (*)(int *, int);
    using TotalMem = int (*)(size_t *, int);
    using GetUuid = int (*)(unsigned char *, int);  // CUuuid: 16 bytes
    auto init = reinterpret_cast<Init>(dlsym(lib, "cuInit"));
    auto get = reinterpret_cast<DeviceGet>(dlsym(lib, "cuDeviceGet"));
    auto total = reinterpret_cast<TotalMem>(dlsym(lib, "cuDeviceTotalMem_v2"));
    auto uuid = reinterpret_cast<GetUuid>(dlsym(lib, "cuDeviceGetUuid_v2"));
    if (!uuid) uuid = reinterpret_cast<GetUuid>(dlsym(lib, "cuDeviceGetUuid"));
    if (!init || !get || !total || !uuid) throw std::runtime_error("libcuda.so.1 lacks the driver calls memtrain needs");
    auto must = [](int rc, const char *what) {
      if (rc != 0) throw std::runtime_error(std::string(what) + " failed with CUDA driver error " + std::to_string(rc));
    };
    must(init(0), "cuInit");
    int dev = 0;
    must(get(&dev, static_cast<int>(ordinal)), "cuDeviceGet");
    size_t t = 0;
    must(total(&t, dev), "cuDeviceTotalMem");
    must(uuid(uuid16, dev), "cuDeviceGetUuid");
    *total_bytes = t;
  });
}

// ---------------------------------------------------------------------------------------------
// Mixed precision, recomputation and loss scaling: the thread-local autocast state, the default
// generators' states, backward with given output gradients, and the fused unscale kernel. Tensor
// arguments are tch's tensors (`at::Tensor *`).

// Turns autocast on for `device_type` (c10::DeviceType: 0 CPU, 1 CUDA) in `dtype`
// (c10::ScalarType: 5 Half, 15 BFloat16) and reports the state it replaced, for mt_autocast_exit.
char *mt_autocast_enter(int device_type, int dtype, int *prev_enabled, int *prev_dtype) {
  return guarded([&] {
    auto dt = static_cast<c10::DeviceType>(device_type);
    *prev_enabled = at::autocast::is_autocast_enabled(dt) ? 1 : 0;
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dt));
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(dtype));
    at::autocast::set_autocast_enabled(dt, true);
    at::autocast::increment_nesting();
  });
}

// Restores what mt_autocast_enter replaced; leaving the outermost region drops the cast cache,
// as torch.autocast's __exit__ does.
char *mt_autocast_exit(int device_type, int prev_enabled, int prev_dtype) {
  return guarded([&] {
    auto dt = static_cast<c10::DeviceType>(device_type);
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    at::autocast::set_autocast_enabled(dt, prev_enabled != 0);
    at::autocast::set_autocast_dtype(dt, static_cast<at::ScalarType>(prev_dtype));
  });
}

int mt_autocast_enabled(int device_type) {
  return at::autocast::is_autocast_enabled(static_cast<c10::DeviceType>(device_type)) ? 1 : 0;
}

// The default generator's state of a device as bytes (a malloc'd buffer, freed with
// mt_free_buffer).
char *mt_rng_get_state(int device_type, int64_t index, char **data, uint64_t *len) {
  return guarded([&] {
    auto gen = at::globalContext().defaultGenerator(
        c10::Device(static_cast<c10::DeviceType>(device_type), static_cast<c10::DeviceIndex>(index)));
    at::Tensor state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = gen.get_state();
    }
    auto n = static_cast<size_t>(state.numel());
    char *buf = static_cast<char *>(std::malloc(n ? n : 1));
    if (!buf) throw std::bad_alloc();
    std::memcpy(buf, state.data_ptr(), n);
    *data = buf;
    *len = n;
  });
}

char *mt_rng_set_state(int device_type, int64_t index, const char *data, uint64_t len) {
  return guarded([&] {
    auto gen = at::globalContext().defaultGenerator(
        c10::Device(static_cast<c10::DeviceType>(device_type), static_cast<c10::DeviceIndex>(index)));
    at::Tensor state = at::empty({static_cast<int64_t>(len)}, at::TensorOptions().dtype(at::kByte));
    std::memcpy(state.data_ptr(), data, len);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(state);
  });
}

// Back-propagates `grads[i]` from `outputs[i]`, accumulating into every leaf's .grad, as
// torch.autograd.backward(outputs, grads) does.
char *mt_backward(at::Tensor **outputs, at::Tensor **grads, int64_t n) {
  return guarded([&] {
    std::vector<at::Tensor> out, g;
    for (int64_t i = 0; i < n; ++i) {
      out.push_back(*outputs[i]);
      g.push_back(*grads[i]);
    }
    torch::autograd::backward(out, g);
  });
}

// GradScaler's unscale: every gradient multiplied by inv_scale in place, found_inf set to 1 if
// any value is inf or NaN; one fused kernel per device and dtype.
char *mt_amp_unscale(at::Tensor **grads, int64_t n, at::Tensor *found_inf, at::Tensor *inv_scale) {
  return guarded([&] {
    std::vector<at::Tensor> g;
    for (int64_t i = 0; i < n; ++i) g.push_back(*grads[i]);
    at::_amp_foreach_non_finite_check_and_unscale_(g, *found_inf, *inv_scale);
  });
}

// ---------------------------------------------------------------------------------------------
// Multi-tensor optimizer ops (train.optimizer_impl = "foreach" / "fused"). Only the in-place
// forms: the update writes into state and workspaces the Rust side allocated beforehand, so
// nothing parameter-sized is allocated once the first tensor is written. (The generated
// `_foreach_*_out` variants compute a fresh result and copy it, which would allocate.)


// One in-place foreach op on `a` (with `b`, `c` where the op reads them); `scalar` is its
// Python number, `scalars` its per-tensor list (n values). Codes as in src/shim/mod.rs.
char *mt_foreach(int32_t op, at::Tensor **a, at::Tensor **b, at::Tensor **c, int64_t n, const double *scalars,
                 double scalar) {
  return guarded([&] {
    auto A = tensor_list(a, n);
    std::vector<at::Tensor> B = b ? tensor_list(b, n) : std::vector<at::Tensor>{};
    std::vector<at::Tensor> C = c ? tensor_list(c, n) : std::vector<at::Tensor>{};
    std::vector<c10::Scalar> list;
    if (scalars)
      for (int64_t i = 0; i < n; ++i) list.emplace_back(scalars[i]);
    switch (op) {
    case 0: at::_foreach_copy_(A, B); break;
    case 1: at::_foreach_mul_(A, c10::Scalar(scalar)); break;
    case 2: at::_foreach_add_(A, c10::Scalar(scalar)); break;
    case 3: at::_foreach_add_(A, B, c10::Scalar(scalar)); break;
    case 4: at::_foreach_lerp_(A, B, c10::Scalar(scalar)); break;
    case 5: at::_foreach_addcmul_(A, B, C, c10::Scalar(scalar)); break;
    case 6: at::_foreach_sqrt_(A); break;
    case 7: at::_foreach_div_(A, list); break;
    case 8: at::_foreach_addcdiv_(A, B, C, list); break;
    default: throw std::invalid_argument("mt_foreach: unknown op code " + std::to_string(op));
    }
  });
}

// torch._fused_adam_ / _fused_adamw_ (amsgrad and maximize off), in place on params and
// moments; `steps` holds one 0-dim float tensor per parameter. grad_scale and found_inf may be
// null (GradScaler's arguments); lr_t, when not null, is the learning rate as a 0-dim float32
// tensor on the parameters' device (the overload a captured step needs), in place of `lr`.
char *mt_fused_adam(at::Tensor **params, at::Tensor **grads, at::Tensor **exp_avgs, at::Tensor **exp_avg_sqs,
                    at::Tensor **steps, int64_t n, double lr, double beta1, double beta2, double weight_decay,
                    double eps, int32_t decoupled, at::Tensor *grad_scale, at::Tensor *found_inf,
                    at::Tensor *lr_t) {
  return guarded([&] {
    auto p = tensor_list(params, n), g = tensor_list(grads, n), m = tensor_list(exp_avgs, n),
         v = tensor_list(exp_avg_sqs, n), s = tensor_list(steps, n);
    std::vector<at::Tensor> none;
    if (decoupled && lr_t)
      at::_fused_adamw_(p, g, m, v, none, s, *lr_t, beta1, beta2, weight_decay, eps, false, false,
                        maybe(grad_scale), maybe(found_inf));
    else if (decoupled)
      at::_fused_adamw_(p, g, m, v, none, s, lr, beta1, beta2, weight_decay, eps, false, false, maybe(grad_scale),
                        maybe(found_inf));
    else if (lr_t)
      at::_fused_adam_(p, g, m, v, none, s, *lr_t, beta1, beta2, weight_decay, eps, false, false,
                       maybe(grad_scale), maybe(found_inf));
    else
      at::_fused_adam_(p, g, m, v, none, s, lr, beta1, beta2, weight_decay, eps, false, false, maybe(grad_scale),
                       maybe(found_inf));
  });
}

// torch._fused_sgd_ (dampening 0, maximize off); `bufs` is empty (n_bufs = 0) without momentum;
// lr_t as for mt_fused_adam.
char *mt_fused_sgd(at::Tensor **params, at::Tensor **grads, at::Tensor **bufs, int64_t n, int64_t n_bufs,
                   double weight_decay, double momentum, double lr, int32_t nesterov, int32_t first_step,
                   at::Tensor *grad_scale, at::Tensor *found_inf, at::Tensor *lr_t) {
  return guarded([&] {
    auto p = tensor_list(params, n), g = tensor_list(grads, n), b = tensor_list(bufs, n_bufs);
    if (lr_t)
      at::_fused_sgd_(p, g, b, weight_decay, momentum, *lr_t, 0.0, nesterov != 0, false, first_step != 0,
                      maybe(grad_scale), maybe(found_inf));
    else
      at::_fused_sgd_(p, g, b, weight_decay, momentum, lr, 0.0, nesterov != 0, false, first_step != 0,
                      maybe(grad_scale), maybe(found_inf));
  });
}

// optimizer.zero_grad(set_to_none=True): the parameters' gradients are released, so the next
// forward pass runs without them and backward allocates them afresh.
char *mt_drop_grads(at::Tensor **params, int64_t n) {
  return guarded([&] {
    for (int64_t i = 0; i < n; ++i) params[i]->mutable_grad().reset();
  });
}

// ---------------------------------------------------------------------------------------------
// TorchScript modules (the `torchscript` preset). The module's parameters and buffers are
// handed out as tensors sharing their storage, so the VarStore that holds them trains,
// checkpoints and moves the module's own state.

struct MtScript {
  torch::jit::Module module;
};

char *mt_script_load(const char *path, int device_type, int64_t index, MtScript **out) {
  return guarded([&] {
    // The plain interpreter over the same ATen ops as eager PyTorch: no profiling-driven
    // autodiff subgraphs or fusion, whose gradients would differ from the eager module's.
    torch::jit::setGraphExecutorOptimize(false);
    c10::Device device(static_cast<c10::DeviceType>(device_type), static_cast<c10::DeviceIndex>(index));
    auto m = std::make_unique<MtScript>();
    m->module = torch::jit::load(std::string(path), device);
    *out = m.release();
  });
}

void mt_script_free(MtScript *m) { delete m; }

// Names (joined by '\n') and tensors of the module's parameters (which = 0) or buffers (1),
// recursively, with their state_dict names. Both arrays are malloc'd; each tensor is new'd.
char *mt_script_tensors(MtScript *m, int which, char **names, at::Tensor ***tensors, int64_t *n) {
  return guarded([&] {
    std::vector<std::pair<std::string, at::Tensor>> items;
    if (which == 0) {
      for (const auto &p : m->module.named_parameters(true)) items.emplace_back(p.name, p.value);
    } else {
      for (const auto &p : m->module.named_buffers(true)) items.emplace_back(p.name, p.value);
    }
    std::string joined;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) joined += '\n';
      joined += items[i].first;
    }
    char *nb = static_cast<char *>(std::malloc(joined.size() + 1));
    auto **tb = static_cast<at::Tensor **>(std::malloc(sizeof(at::Tensor *) * (items.size() + 1)));
    if (!nb || !tb) {
      std::free(nb);
      std::free(tb);
      throw std::bad_alloc();
    }
    std::memcpy(nb, joined.c_str(), joined.size() + 1);
    for (size_t i = 0; i < items.size(); ++i) tb[i] = new at::Tensor(items[i].second);
    *names = nb;
    *tensors = tb;
    *n = static_cast<int64_t>(items.size());
  });
}

char *mt_script_train(MtScript *m, int on) {
  return guarded([&] { m->module.train(on != 0); });
}

char *mt_script_forward(MtScript *m, at::Tensor *x, at::Tensor **out) {
  return guarded([&] {
    c10::IValue r = m->module.forward({*x});
    if (!r.isTensor()) {
      throw std::runtime_error("forward returned " + r.tagKind() + ", not a Tensor of logits [N, num_classes]");
    }
    *out = new at::Tensor(r.toTensor());
  });
}

} // extern "C"
