// CUDA graphs of a whole training step (train.cuda_graph): a capture stream of the shim's own,
// capture into a private memory pool, replay, and a failed capture undone so that nothing of it
// stays (no stream left capturing, no pool left routing allocations). at::cuda::CUDAGraph does
// the work; the shim adds the stream discipline PyTorch's `torch.cuda.graph` context adds in
// Python, and the clean-up after a capture that threw.
#include <ATen/Context.h>
#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <cstdint>
#include <memory>
#include <stdexcept>

#include "guard.h"

using mt::guarded;

#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
namespace {

// at::cuda::CUDAGraph, with what its capture_begin or capture_end leaves standing when it
// throws part-way undone: CUDA ended the capture, but CUDAGraph stopped before it stopped routing
// allocations to the pool, before it released the pool, and before it told the generators the
// capture was over.
struct Graph : at::cuda::CUDAGraph {
  Graph() : at::cuda::CUDAGraph(false) {}

  // capture_end from the stream the capture began on, whatever stream is current: CUDA ends a
  // capture only there, and a stream left capturing would swallow every later launch on it.
  void end_on_capture_stream() {
    c10::StreamGuard on(capture_stream_.unwrap());
    capture_end();
  }

  // After capture_begin or capture_end threw. Once capture_end got as far as marking the capture
  // ended, reset() (or the destructor) releases the pool and the generators were told already.
  void undo_failed() {
    if (capture_ended_) return;
    // A generator still marked capturing refuses every eager draw afterwards ("Offset increment
    // outside graph capture encountered unexpectedly"): dropout in the eager step that follows.
    for (auto &entry : captured_generator_states_) entry.first->capturing_ = false;
    if (capture_dev_ == UNDEFINED_DEVICE) return;
    // Each step on its own: one that was never begun must not keep the others from running.
    try { c10::cuda::CUDACachingAllocator::endAllocateToPool(capture_dev_, mempool_id_); } catch (...) {}
    try { at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(mempool_id_); } catch (...) {}
    try { c10::cuda::CUDACachingAllocator::releasePool(capture_dev_, mempool_id_); } catch (...) {}
    try { at::getHostAllocator(at::kCUDA)->release_pool(mempool_id_); } catch (...) {}
  }
};

// `to` waits for the work queued on `from` so far.
void order(c10::cuda::CUDAStream from, c10::cuda::CUDAStream to) {
  c10::Event e(c10::DeviceType::CUDA);
  e.record(from.unwrap());
  e.block(to.unwrap());
}

}  // namespace

// A stream to capture on (captures must not use the default stream), made current for a while:
// eager warm-up steps run on it too, so the libraries' per-stream workspaces exist before a
// capture needs them.
struct MtSideStream {
  c10::cuda::CUDAStream side;
  std::optional<c10::cuda::CUDAStream> outer;
  // The device current before entering: the side stream's is made current too, since a capture
  // begins on the current device's current stream (on another device, its default stream).
  c10::DeviceIndex outer_device = -1;
};

struct MtGraph {
  std::unique_ptr<Graph> graph;
  bool capturing = false;
};
#else
struct MtSideStream {};
struct MtGraph {};
#endif

#ifdef MEMTRAIN_HAVE_CUDA_RUNTIME
#define MT_GRAPH_ONLY(...) __VA_ARGS__
#else
#define MT_GRAPH_ONLY(...) throw std::runtime_error("this memtrain was built without the CUDA runtime's headers: no CUDA graphs");
#endif

extern "C" {

char *mt_side_stream_new(int64_t device, MtSideStream **out) {
  return guarded([&] {
    MT_GRAPH_ONLY({
      auto s = c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device));
      *out = new MtSideStream{s, std::nullopt};
    })
  });
}

// The side stream (and its device) becomes current, after the work queued on the stream that was.
char *mt_side_stream_enter(MtSideStream *s) {
  return guarded([&] {
    MT_GRAPH_ONLY({
      if (s->outer) throw std::logic_error("the capture stream is current already");
      auto outer = c10::cuda::getCurrentCUDAStream(s->side.device_index());
      order(outer, s->side);
      s->outer_device = c10::cuda::ExchangeDevice(s->side.device_index());
      c10::cuda::setCurrentCUDAStream(s->side);
      s->outer = outer;
    })
  });
}

// The stream and device that were current are again, after the work queued on the side stream.
char *mt_side_stream_leave(MtSideStream *s) {
  return guarded([&] {
    MT_GRAPH_ONLY({
      if (!s->outer) return;
      c10::cuda::setCurrentCUDAStream(*s->outer);
      auto outer = *s->outer;
      s->outer.reset();
      c10::cuda::ExchangeDevice(s->outer_device);
      order(s->side, outer);
    })
  });
}

void mt_side_stream_free(MtSideStream *s) { delete s; }

// Capture begins on the current stream (the side stream, entered), into a private pool.
char *mt_graph_begin(MtGraph **out) {
  return guarded([&] {
    MT_GRAPH_ONLY({
      auto g = std::make_unique<MtGraph>();
      g->graph = std::make_unique<Graph>();
      try {
        g->graph->capture_begin();
      } catch (...) {
        g->graph->undo_failed();
        throw;
      }
      g->capturing = true;
      *out = g.release();
    })
  });
}

// Capture ends and the graph is instantiated, ready to replay. If that throws, nothing of the
// capture stays but what freeing the graph releases.
char *mt_graph_end(MtGraph *g) {
  return guarded([&] {
    MT_GRAPH_ONLY({
      g->capturing = false;
      try {
        g->graph->end_on_capture_stream();
      } catch (...) {
        g->graph->undo_failed();
        throw;
      }
    })
  });
}

// A capture that failed part-way (the step threw inside it) is ended and its pool given back,
// whatever state it was left in; the graph can then only be freed.
char *mt_graph_abandon(MtGraph *g) {
  return guarded([&] {
    MT_GRAPH_ONLY({
      if (!g->capturing) return;
      g->capturing = false;
      try {
        g->graph->end_on_capture_stream();
      } catch (...) {
        g->graph->undo_failed();
      }
      g->graph->reset();
    })
  });
}

// One launch of the whole captured work, on the current stream.
char *mt_graph_replay(MtGraph *g) {
  return guarded([&] { MT_GRAPH_ONLY(g->graph->replay();) });
}

void mt_graph_free(MtGraph *g) { delete g; }

}  // extern "C"
