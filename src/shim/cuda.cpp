// The CUDA caching allocator's own interface: the cap set on the allocator, and the snapshot kept
// at the moment of an OOM. A translation unit of its own: with c10/cuda/CUDACachingAllocator.h
// in view the compiler may devirtualize the allocator's inline members (getMemoryInfo calls
// cudaMemGetInfo), and nothing may reference libcudart directly: the binary reaches it only
// through libtorch_cuda. Compiled with the CUDA runtime's headers (MEMTRAIN_HAVE_CUDA_RUNTIME);
// without them every entry says so.
#include <ATen/Context.h>
#include <ATen/Functions.h>
#include <ATen/core/CachingHostAllocator.h>
#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#endif

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <array>
#include <mutex>
#include <optional>
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

// ---------------------------------------------------------------------------------------------
// Host <-> device copies beside the compute stream.
//
// One copy stream per device, taken from the pool the first time it is asked for, so a copy
// can run while kernels run. Ordering is explicit: the copy stream waits for the compute
// stream's work so far before a batch of copies (mt_cuda_copies_after_compute), and the compute
// stream waits for an event on the copy stream before it reads what came up
// (mt_cuda_event_block_compute). A device tensor a copy reads or writes is marked as used by the
// copy stream, so the caching allocator does not hand its memory to a kernel before the copy
// has run; a pinned host buffer is marked by the copy kernel itself (the host allocator records
// an event on the stream the copy ran on).

// Events and stream guards go through c10's device-generic interface (virtual calls into
// libc10_cuda), never c10::cuda's inline ones, which would reference libcudart directly.
struct MtEvent {
#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
  c10::Event event;
  explicit MtEvent(c10::EventFlag flag = c10::EventFlag::PYTORCH_DEFAULT) : event(c10::DeviceType::CUDA, flag) {}
#endif
};

#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
namespace {
std::mutex copy_streams_mutex;
std::array<std::optional<c10::cuda::CUDAStream>, 64> copy_streams;

c10::cuda::CUDAStream copy_stream(int64_t device) {
  if (device < 0 || device >= static_cast<int64_t>(copy_streams.size())) {
    throw std::invalid_argument("no copy stream for CUDA device " + std::to_string(device));
  }
  std::lock_guard<std::mutex> lock(copy_streams_mutex);
  auto &s = copy_streams[device];
  if (!s) s = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
  return *s;
}

void used_by(const at::Tensor &t, c10::cuda::CUDAStream stream) {
  if (t.is_cuda() && t.storage().data_ptr().get()) {
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
  }
}
}  // namespace
#endif

#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
#define MT_CUDA_ONLY(body) body
#else
#define MT_CUDA_ONLY(body) throw std::runtime_error("this memtrain was built without the CUDA runtime's headers: no copy stream");
#endif

// An uninitialised CPU tensor in pinned (page-locked) memory from the CUDA host allocator: the
// only memory a copy to or from the device can run from without blocking the host.
char *mt_pinned_empty(const int64_t *sizes, int64_t n, int32_t dtype, at::Tensor **out) {
  return guarded([&] {
    auto options = at::TensorOptions()
                       .dtype(static_cast<c10::ScalarType>(dtype))
                       .device(at::kCPU)
                       .pinned_memory(true);
    *out = new at::Tensor(at::empty(c10::IntArrayRef(sizes, static_cast<size_t>(n)), options));
  });
}

// From now on every synchronizing CUDA call (a blocking copy, a stream synchronize) throws, with
// where it came from: a diagnostic for finding a wait the step does not mean to make.
char *mt_cuda_sync_debug_error() {
  return guarded([&] {
    MT_CUDA_ONLY({ c10::cuda::warning_state().set_sync_debug_mode(c10::cuda::SyncDebugMode::L_ERROR); })
  });
}

// The copy stream of `device` waits for everything the compute stream has queued so far.
char *mt_cuda_copies_after_compute(int64_t device) {
  return guarded([&] {
    MT_CUDA_ONLY({
      auto copies = copy_stream(device);
      c10::Event e(c10::DeviceType::CUDA);
      e.record(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).unwrap());
      e.block(copies.unwrap());
    })
  });
}

// dst.copy_(src, non_blocking=true) on the copy stream. One side is pinned host memory, the
// other on `device`.
char *mt_cuda_copy(int64_t device, at::Tensor *dst, at::Tensor *src) {
  return guarded([&] {
    MT_CUDA_ONLY({
      auto copies = copy_stream(device);
      c10::StreamGuard guard(copies.unwrap());
      dst->copy_(*src, true);
      used_by(*dst, copies);
      used_by(*src, copies);
    })
  });
}

// An event marking the copies queued so far on the copy stream of `device`.
char *mt_cuda_copies_event(int64_t device, MtEvent **out) {
  return guarded([&] {
    MT_CUDA_ONLY({
      auto e = std::make_unique<MtEvent>();
      e->event.record(copy_stream(device).unwrap());
      *out = e.release();
    })
  });
}

// A timed event on the compute stream of `device`: the device's own clock when it reaches the
// work queued so far, so the time between two steps' ends is the device's, whenever the host
// gets to look.
char *mt_cuda_compute_mark(int64_t device, MtEvent **out) {
  return guarded([&] {
    MT_CUDA_ONLY({
      auto e = std::make_unique<MtEvent>(c10::EventFlag::BACKEND_DEFAULT);
      e->event.record(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).unwrap());
      *out = e.release();
    })
  });
}

// Milliseconds from timed event `from` to timed event `to`, both reached.
char *mt_cuda_event_elapsed_ms(MtEvent *from, MtEvent *to, double *ms) {
  return guarded([&] { MT_CUDA_ONLY(*ms = from->event.elapsedTime(to->event);) });
}

// The compute stream of `device` waits for `e` (the host does not).
char *mt_cuda_event_block_compute(MtEvent *e, int64_t device) {
  return guarded([&] {
    MT_CUDA_ONLY(e->event.block(c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).unwrap());)
  });
}

// The host waits for `e`.
char *mt_cuda_event_synchronize(MtEvent *e) {
  return guarded([&] { MT_CUDA_ONLY(e->event.synchronize();) });
}

void mt_cuda_event_free(MtEvent *e) { delete e; }

// Pinned host memory from the CUDA host allocator: bytes in use now and their peak since the
// last reset. Zeros where CUDA is not available.
char *mt_cuda_host_stats(uint64_t *active, uint64_t *peak_active) {
  return guarded([&] {
    *active = 0;
    *peak_active = 0;
    if (!at::hasCUDA()) return;
    auto s = at::getHostAllocator(at::kCUDA)->get_stats();
    *active = static_cast<uint64_t>(s.active_bytes.current);
    *peak_active = static_cast<uint64_t>(s.active_bytes.peak);
  });
}

char *mt_cuda_host_reset_peak() {
  return guarded([&] {
    if (at::hasCUDA()) at::getHostAllocator(at::kCUDA)->reset_peak_stats();
  });
}

} // extern "C"
