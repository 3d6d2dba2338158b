// The CUDA caching allocator's own interface: the cap set on the allocator, and the snapshot kept
// at the moment of an OOM. A translation unit of its own: with c10/cuda/CUDACachingAllocator.h
// in view the compiler may devirtualize the allocator's inline members (getMemoryInfo calls
// cudaMemGetInfo), and nothing may reference libcudart directly: the binary reaches it only
// through libtorch_cuda. Compiled with the CUDA runtime's headers (MEMTRAIN_HAVE_CUDA_RUNTIME);
// without them every entry says so.
#include <ATen/Context.h>
#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>

#include "guard.h"

using mt::guarded;

#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
namespace {
std::mutex oom_snapshot_mutex;
std::string oom_snapshot;  // the last CUDA OOM's, until taken
bool oom_snapshot_held = false;
}  // namespace
#endif

extern "C" {

// From now on every CUDA OOM keeps the allocator snapshot of its moment: the observer runs
// inside the failed allocation, before the attempt's tensors are freed and before recovery
// clears anything, so the segment map shows the memory that did not fit. Initialises CUDA.
char *mt_cuda_keep_oom_snapshots() {
  return guarded([&] {
#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::cuda::CUDACachingAllocator::attachOutOfMemoryObserver([](int64_t, size_t, size_t, size_t) {
      std::string s;
      try {
        s = torch::cuda::_memory_snapshot_pickled();
      } catch (...) {
        return;  // no snapshot; the OOM itself goes on as it would
      }
      std::lock_guard<std::mutex> lock(oom_snapshot_mutex);
      oom_snapshot = std::move(s);
      oom_snapshot_held = true;
    });
#else
    throw std::runtime_error("this memtrain was built without the CUDA runtime's headers: no snapshot at the OOM");
#endif
  });
}

// The snapshot kept at the last CUDA OOM, handed over once; *len = 0 when there is none.
char *mt_cuda_take_oom_snapshot(char **data, uint64_t *len) {
  return guarded([&] {
    *data = nullptr;
    *len = 0;
#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
    std::lock_guard<std::mutex> lock(oom_snapshot_mutex);
    if (!oom_snapshot_held) return;
    char *buf = static_cast<char *>(std::malloc(oom_snapshot.size() ? oom_snapshot.size() : 1));
    if (!buf) throw std::bad_alloc();
    std::memcpy(buf, oom_snapshot.data(), oom_snapshot.size());
    *data = buf;
    *len = oom_snapshot.size();
    oom_snapshot.clear();
    oom_snapshot_held = false;
#endif
  });
}

// The cap as a fraction of a CUDA device, set on the allocator itself once CUDA is
// initialised (the allocator settings are read then, so the plan's environment must be set
// first). PYTORCH_CUDA_ALLOC_CONF's per_process_memory_fraction is the native allocator's
// option; backend:cudaMallocAsync honours only this call, which both backends implement.
char *mt_cuda_set_memory_fraction(double fraction, int64_t device) {
  return guarded([&] {
#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
    at::globalContext().lazyInitDevice(c10::DeviceType::CUDA);
    c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
#else
    throw std::runtime_error(
        "this memtrain was built without the CUDA runtime's headers, so it cannot cap the CUDA allocator; "
        "rebuild after scripts/bootstrap (it installs nvidia-cuda-crt and nvidia-cuda-cccl beside torch)");
#endif
  });
}

} // extern "C"
