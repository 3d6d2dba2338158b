// The few libtorch calls tch does not bind: accelerator memory statistics, cache control,
// device memory info, version strings and the allocator's memory snapshot.
//
// Every entry point is `extern "C"`, catches every C++ exception and returns it as a
// malloc'd message (freed with mt_free_error), so nothing unwinds into Rust and nothing
// aborts the process. Return value: nullptr on success.
#include <ATen/DeviceAccelerator.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/version.h>
#include <c10/core/CachingDeviceAllocator.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#ifdef MEMTRAIN_HAVE_CUDA
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

namespace {

char *dup_error(const char *msg) {
  size_t n = std::strlen(msg);
  char *out = static_cast<char *>(std::malloc(n + 1));
  if (out) std::memcpy(out, msg, n + 1);
  return out;
}

template <typename F> char *guarded(F &&f) {
  try {
    f();
    return nullptr;
  } catch (const std::exception &e) {
    return dup_error(e.what());
  } catch (...) {
    return dup_error("unknown C++ exception");
  }
}

// Accelerator calls throw when no accelerator is present; callers check this first so that
// "no accelerator" is an answer, not an error.
bool have_accelerator() { return at::accelerator::getAccelerator(false).has_value(); }

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
};

void mt_free_error(char *e) { std::free(e); }

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

} // extern "C"
