#!/usr/bin/env python3
"""What two CUDA runs held at their allocated peak, and where they differ.

Reads two allocator snapshots with recorded history (memtrain's snapshot.pickle, written at a
run's end with memory.record_history = true; PyTorch's torch.cuda.memory._dump_snapshot, as
scripts/bench/pytorch_job.py --memory-snapshot writes it), replays each trace backwards from the
blocks live at the snapshot to the moment the live tensors' bytes were highest, and prints the
blocks live then that one side has and the other has not, by size, with the first frames of
the stack that allocated them.

    peak_diff.py A.pickle B.pickle [--names memtrain,pytorch] [--top 20]

Bytes are the requests' (a trace event's size is what was asked for, before the allocator rounds
it to a block): up at `alloc`, down at `free_requested`, when the tensor let go. Only the trace's
window is seen (memtrain keeps the last 100,000 events); a block allocated before it shows the
stack the snapshot's segments keep for it, or none.
"""
import argparse
import collections
import pickle
import sys

# Frames that say nothing of which op asked: the allocator, the dispatcher, tensor factories.
PLUMBING = ("torch::unwind", "torch::CapturedTraceback", "??", "c10::", "at::detail::empty", "at::empty", "at::native::empty", "at::TensorBase",
            "torch::autograd::", "at::_ops::", "c10_cuda", "CUDACachingAllocator", "std::",
            "at::(anonymous", "torch::jit", "_PyEval", "PyObject", "at::Tensor::", "at::native::resize",
            "at::native::(anonymous namespace)::wrapper", "at::meta::", "at::impl::")


def load(path):
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError) as e:
        sys.exit(f"peak_diff: cannot read the snapshot {path}: {e}. Write one with memory.record_history = true "
                 "(memtrain's snapshot.pickle) or scripts/bench/pytorch_job.py --memory-snapshot FILE")


def live_blocks(snapshot, device):
    live = {}
    for seg in snapshot.get("segments", []):
        if seg.get("device") != device:
            continue
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                # A trace event's size is the request's, so the live blocks count theirs too.
                live[b["address"]] = (int(b.get("requested_size", b["size"])), b.get("frames") or [])
    return live


def trace_of(snapshot, device):
    traces = snapshot.get("device_traces") or []
    return traces[device] if device < len(traces) else []


def peak_moment(snapshot, device=0):
    """(peak bytes, {addr: (size, frames)} live then, events seen) over the trace's window."""
    live = live_blocks(snapshot, device)
    trace = trace_of(snapshot, device)
    total = sum(s for s, _ in live.values())
    best, best_at = total, len(trace)
    for i in range(len(trace) - 1, -1, -1):
        e = trace[i]
        if e["action"] == "alloc":
            total -= int(e["size"])
        elif e["action"] == "free_requested":
            total += int(e["size"])
        if total > best:
            best, best_at = total, i
    # Walk back again to the peak, this time keeping the blocks. A block brought back at its
    # free_requested takes the stack of the alloc that made it (the free's own stack says where
    # it was let go).
    allocated_by = {}
    for e in trace[:best_at]:
        if e["action"] == "alloc":
            allocated_by[e["addr"]] = e.get("frames") or []
    for i in range(len(trace) - 1, best_at - 1, -1):
        e = trace[i]
        if e["action"] == "alloc":
            live.pop(e["addr"], None)
        elif e["action"] == "free_requested":
            live[e["addr"]] = (int(e["size"]), allocated_by.get(e["addr"], []))
    return best, live, len(trace)


def origin(frames, depth=3):
    """The first few frames that are not allocator or dispatch plumbing."""
    names = []
    for f in frames:
        name = str(f.get("name", ""))
        if not name or any(name.startswith(p) or p in name[:40] for p in PLUMBING):
            continue
        where = f.get("filename", "")
        if where.endswith(".py"):
            name = f"{where.rsplit('/', 1)[-1]}:{f.get('line')} {name}"
        names.append(name[:90])
        if len(names) == depth:
            break
    return " < ".join(names) or "(no frames)"


def mib(b):
    return f"{b / 2**20:.2f} MiB"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--names", default="memtrain,pytorch")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=20)
    a = p.parse_args()
    names = a.names.split(",")
    sides = []
    for path, name in zip([a.a, a.b], names):
        peak, live, events = peak_moment(load(path), a.device)
        sizes = collections.Counter(s for s, _ in live.values())
        print(f"{name}: peak {mib(peak)} ({peak} B), {len(live)} blocks live then, {events} trace events")
        sides.append((name, peak, live, sizes))
    (na, pa, la, ca), (nb, pb, lb, cb) = sides
    print(f"\n{na} - {nb} at the peak: {pa - pb:+d} B ({(pa - pb) / 2**20:+.2f} MiB)\n")
    for this, other, live, name in [(ca, cb, la, na), (cb, ca, lb, nb)]:
        extra = this - other
        rows = sorted(extra.items(), key=lambda kv: -kv[0] * kv[1])
        total = sum(s * n for s, n in extra.items())
        print(f"## live only in {name} (by size; {mib(total)} in all)")
        for s, n in rows[: a.top]:
            where = collections.Counter(origin(f) for sz, f in live.values() if sz == s)
            print(f"  {n} x {s} B  from: " + "; ".join(f"{w} ({k})" for w, k in where.most_common(2)))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
