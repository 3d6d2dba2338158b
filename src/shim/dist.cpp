// Data-parallel training on PyTorch's own c10d: a TCPStore for rendezvous, a ProcessGroup with
// the Gloo backend (CPU) or NCCL (CUDA), and DDP's Reducer for gradient synchronisation
// (buckets, all-reduce launched from autograd hooks while backward still runs).
//
// Compiled only when build.rs finds Gloo's headers (MEMTRAIN_HAVE_GLOO) or NCCL's
// (MEMTRAIN_HAVE_NCCL). Same conventions as shim.cpp: extern "C", every exception returned as a
// malloc'd message.
#include <ATen/Functions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#ifdef MEMTRAIN_HAVE_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef MEMTRAIN_HAVE_NCCL
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "guard.h"

using mt::guarded;

namespace {

// What the communication hook launched in the current backward pass, by bucket index, so a rank
// whose pass failed can launch the rest and keep every rank's collectives in the same order.
struct Launched {
  std::mutex mutex;
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
};

// Sums each bucket across ranks. Unlike DDP's default it does not divide by the world size:
// every rank already divides its loss by the global group size, so the sum is the group's
// gradient, as one process would compute it.
class SumHook : public c10d::CommHookInterface {
 public:
  SumHook(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<Launched> launched)
      : pg_(std::move(pg)), launched_(std::move(launched)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket &bucket) override {
    std::vector<at::Tensor> tensors{bucket.getBufferRef()};
    auto future = pg_->allreduce(tensors)->getFuture();
    std::lock_guard<std::mutex> lock(launched_->mutex);
    auto i = bucket.getIndex();
    if (launched_->futures.size() <= i) launched_->futures.resize(i + 1);
    launched_->futures[i] = future;
    return future;
  }

  at::Tensor parseHookResult(const c10::IValue &result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<Launched> launched_;
};

} // namespace

extern "C" {

struct MtGroup {
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
};

struct MtReducer {
  std::unique_ptr<c10d::Reducer> reducer;
  std::shared_ptr<Launched> launched;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
};

int mt_dist_backends() {
  int b = 0;
#ifdef MEMTRAIN_HAVE_GLOO
  b |= 1;
#endif
#ifdef MEMTRAIN_HAVE_NCCL
  b |= 2;
#endif
  return b;
}

// Joins the group: rank 0 hosts the TCPStore at host:port unless `server` is 0 (torchrun's
// agent already hosts it). `prefix` keeps this group's keys apart from the launcher's and
// from earlier groups. `cuda` picks NCCL (on device `device`), otherwise Gloo, whose pairs use
// the interfaces named in `gloo_ifaces` (comma-separated, GLOO_SOCKET_IFNAME's form) or, when it
// is empty, the local address `gloo_host` (the one that reaches the rendezvous host).
char *mt_dist_group_new(const char *host, int port, int rank, int size, int server, const char *prefix,
                        int cuda, int64_t device, const char *gloo_ifaces, const char *gloo_host,
                        int64_t timeout_ms, MtGroup **out) {
  return guarded([&] {
    auto timeout = std::chrono::milliseconds(timeout_ms);
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<std::uint16_t>(port);
    opts.isServer = server != 0;
    opts.numWorkers = static_cast<std::size_t>(size);
    opts.waitWorkers = true;  // every rank counts itself in; rank 0 waits for all
    opts.timeout = timeout;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
    auto store = c10::make_intrusive<c10d::PrefixStore>(std::string(prefix), tcp);
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, rank, size);
    if (cuda) {
#ifdef MEMTRAIN_HAVE_NCCL
      // NCCL refuses two ranks on one GPU, and without a bound device it picks the current one
      // (device 0 on every rank) for its communicators and barriers: make the rank's device
      // current and bind the group to it, as init_process_group(device_id=...) does.
      auto index = static_cast<c10::DeviceIndex>(device);
      c10::cuda::set_device(index);
      pg->setBoundDeviceId(at::Device(at::kCUDA, index));
      auto o = c10d::ProcessGroupNCCL::Options::create();
      o->timeout = timeout;
      auto backend = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, o);
      pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, backend);
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
#else
      throw std::runtime_error("this memtrain was built without NCCL's headers: no data-parallel training on CUDA");
#endif
    } else {
#ifdef MEMTRAIN_HAVE_GLOO
      auto o = c10d::ProcessGroupGloo::Options::create(timeout);
      // Not createDefaultDevice: it binds to what this machine's hostname resolves to, which
      // may be an address the other nodes cannot reach (127.0.1.1 on Debian, a docker bridge).
      std::string ifaces(gloo_ifaces);
      if (ifaces.empty()) {
        o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(std::string(gloo_host)));
      } else {
        std::size_t start = 0;
        while (start <= ifaces.size()) {
          auto end = ifaces.find(',', start);
          if (end == std::string::npos) end = ifaces.size();
          auto name = ifaces.substr(start, end - start);
          if (!name.empty()) o->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(name));
          start = end + 1;
        }
      }
      auto backend = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, o);
      pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
#else
      throw std::runtime_error("this memtrain was built without Gloo's headers: no data-parallel training on the CPU");
#endif
    }
    *out = new MtGroup{store, pg};
  });
}

// Shut down before the last reference goes: 2.11's NCCL backend warns (a [W line) when it is
// destroyed without it, as Python's destroy_process_group() would have. Gloo's is a no-op.
void mt_dist_group_free(MtGroup *g) {
  if (!g) return;
  try {
    g->pg->shutdown();
  } catch (...) {
    // A group whose peers are gone cannot shut down cleanly; it is freed all the same.
  }
  delete g;
}

// Every tensor takes rank `root`'s values, in place (coalesced into few messages).
char *mt_dist_broadcast(MtGroup *g, at::Tensor **tensors, int64_t n, int root) {
  return guarded([&] {
    std::vector<at::Tensor> ts;
    for (int64_t i = 0; i < n; ++i) ts.push_back(*tensors[i]);
    c10d::broadcast_coalesced(g->pg, ts, 256 << 20, root);
  });
}

// Tensor i takes rank roots[i]'s values, in place and uncoalesced (no flat copy is allocated):
// the updated parameters of a sharded optimizer step, each from the rank that owns it. All
// broadcasts are launched before any is waited for.
char *mt_dist_broadcast_each(MtGroup *g, at::Tensor **tensors, const int64_t *roots, int64_t n) {
  return guarded([&] {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int64_t i = 0; i < n; ++i) {
      std::vector<at::Tensor> ts{*tensors[i]};
      c10d::BroadcastOptions o;
      o.rootRank = roots[i];
      works.push_back(g->pg->broadcast(ts, o));
    }
    for (auto &w : works) w->wait();
  });
}

// Point to point: `t` to rank `dst`, or `t` from rank `src`, matched by `tag`.
char *mt_dist_send(MtGroup *g, at::Tensor *t, int dst, int tag) {
  return guarded([&] {
    std::vector<at::Tensor> ts{*t};
    g->pg->send(ts, dst, tag)->wait();
  });
}

char *mt_dist_recv(MtGroup *g, at::Tensor *t, int src, int tag) {
  return guarded([&] {
    std::vector<at::Tensor> ts{*t};
    g->pg->recv(ts, src, tag)->wait();
  });
}

// In-place sum across ranks.
char *mt_dist_allreduce_sum(MtGroup *g, at::Tensor *t) {
  return guarded([&] {
    std::vector<at::Tensor> ts{*t};
    g->pg->allreduce(ts)->wait();
  });
}

// out[r] takes rank r's `input`; every out[r] has input's shape.
char *mt_dist_allgather(MtGroup *g, at::Tensor *input, at::Tensor **out, int64_t n) {
  return guarded([&] {
    std::vector<at::Tensor> in{*input};
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int64_t i = 0; i < n; ++i) outs[0].push_back(*out[i]);
    g->pg->allgather(outs, in)->wait();
  });
}

char *mt_dist_barrier(MtGroup *g) {
  return guarded([&] { g->pg->barrier()->wait(); });
}

// Key-value through the group's store: small facts every rank must see (process ids).
char *mt_dist_store_set(MtGroup *g, const char *key, const char *value) {
  return guarded([&] {
    std::string v(value);
    g->store->set(key, std::vector<uint8_t>(v.begin(), v.end()));
  });
}

char *mt_dist_store_get(MtGroup *g, const char *key, char *buf, int64_t cap, int64_t *len) {
  return guarded([&] {
    auto v = g->store->get(key);
    *len = static_cast<int64_t>(v.size());
    std::memcpy(buf, v.data(), std::min<int64_t>(cap, *len));
  });
}

// DDP's Reducer over `params` (the order every rank gives them in), with DDP's bucket sizes:
// `first_cap` bytes for the first bucket (reduced first), `cap` for the others. Buckets are
// assigned over the parameters in reverse, as DDP does, so the parameters nearest the loss are
// reduced first; after the first synchronised step the Reducer rebuilds them in the order
// their gradients actually became ready.
char *mt_reducer_new(MtGroup *g, at::Tensor **params, int64_t n, int64_t first_cap, int64_t cap,
                     MtReducer **out) {
  return guarded([&] {
    std::vector<at::Tensor> ps;
    for (int64_t i = 0; i < n; ++i) ps.push_back(*params[i]);
    std::vector<at::Tensor> reversed(ps.rbegin(), ps.rend());
    std::vector<int64_t> idx;
    for (int64_t i = n - 1; i >= 0; --i) idx.push_back(i);
    auto [buckets, limits] = c10d::compute_bucket_assignment_by_size(
        reversed, {static_cast<size_t>(first_cap), static_cast<size_t>(cap)}, {}, idx);
    std::vector<int64_t> limit_list(limits.begin(), limits.end());
    auto reducer = std::make_unique<c10d::Reducer>(
        ps, buckets, g->pg, std::vector<bool>{}, cap, /*find_unused_parameters=*/false,
        /*gradient_as_bucket_view=*/false, std::unordered_map<size_t, std::string>{}, first_cap,
        /*skip_all_reduce_unused_params=*/false, /*use_python_reducer=*/false, limit_list);
    auto launched = std::make_shared<Launched>();
    reducer->register_comm_hook(std::make_unique<SumHook>(g->pg, launched));
    *out = new MtReducer{std::move(reducer), launched, g->pg};
  });
}

void mt_reducer_free(MtReducer *r) { delete r; }

// Start of a weight step, on every rank before anything that can fail: DDP's once-only bucket
// rebuild (a broadcast the first time after a synchronised step), as DDP's forward does.
char *mt_reducer_enter(MtReducer *r) {
  return guarded([&] {
    {
      std::lock_guard<std::mutex> lock(r->launched->mutex);
      r->launched->futures.clear();
    }
    r->reducer->rebuild_buckets();
  });
}

// The next backward pass synchronises: its gradients are summed across ranks bucket by bucket
// while it runs (DDP outside no_sync).
char *mt_reducer_arm(MtReducer *r) {
  return guarded([&] {
    r->reducer->prepare_for_forward();
    r->reducer->prepare_for_backward({});
  });
}

// End of a weight step's backward work: every bucket launched is waited for; then a rank whose
// work failed (`failed`) runs every bucket its backward did not launch (a suffix: buckets
// launch in index order), so all ranks run the same collectives in the same order.
char *mt_reducer_settle(MtReducer *r, int failed) {
  return guarded([&] {
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> pending;
    {
      std::lock_guard<std::mutex> lock(r->launched->mutex);
      pending = r->launched->futures;
    }
    for (auto &f : pending) {
      if (f) f->wait();
    }
    if (failed) {
      // Every rank discards a failed step (they agree on it before any optimizer writes, and
      // each attempt starts by dropping the gradients), so this rank's buckets are zeroed in
      // place and sent: nothing is allocated, for memory is what just ran out (zero tensors,
      // one per bucket, did not fit where the step had not), and the others sum finite values.
      auto buckets = r->reducer->get_grad_buckets(/*return_zero_tensors=*/false);
      for (size_t i = 0; i < buckets.size(); ++i) {
        if (i < pending.size() && pending[i]) continue;
        std::vector<at::Tensor> zeroed{buckets[i].getBuffer().zero_()};
        r->pg->allreduce(zeroed)->getFuture()->wait();
      }
    }
  });
}

} // extern "C"
