#!/usr/bin/env python3
"""One command for a GPU: every CUDA claim memtrain makes, checked against what the
machine itself says (PyTorch, nvidia-smi), in 8 minutes or less on one H100. Run it through
scripts/gpu-check, which picks the Python and puts its torch/lib on LD_LIBRARY_PATH.

It needs the built binary (dist/memtrain from scripts/package-device, or target/release/memtrain,
or MEMTRAIN_BIN) and a python3 with PyTorch 2.11 (no cargo, no network). It prints one table,
`check | expected | seen | result`, and exits 1 if any check failed (2 when it cannot start: no
CUDA device, no torch, no binary). Every check runs even when an earlier one failed; each is
given what is left of the time budget (GPU_CHECK_BUDGET seconds, default 480), and a check the
budget no longer covers fails as "not run".

The file has two halves. The first is pure: reading memtrain's outputs (metrics.jsonl,
summary.json, the OOM report and snapshot, `info --json`, `fit --json`, nvidia-smi's CSV) and
judging them, one `judge_*` function per check, returning `Check` rows; tests/py/test_gpu_check.py
tests it on the CPU (CI runs it through tests/it/gpu_check.rs). The second half runs the
commands. This process never touches CUDA itself: torch's own figures come from short child
processes, so no CUDA context of ours sits beside the runs nvidia-smi watches.
"""
import argparse
import json
import math
import os
import pickle
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, ".."))
GiB = 1 << 30
MiB = 1 << 20

# Tolerances, stated once.
LOSS_REL_RECOMPUTE = 1e-5  # recomputation replays the same kernels; CUDA's atomics may reorder sums
LOSS_REL_OPTIMIZER = 1e-5  # memtrain's step vs torch.optim's same implementation, both on CUDA
LOSS_REL_RESUME = 1e-5  # a resumed run vs the uncut one (0 where the kernels are deterministic)
LOSS_REL_GROUP = 1e-6  # a one-rank NCCL group vs no group: the all-reduce of one rank is a copy
# A host update runs libtorch's fused CPU kernel where the all-device run runs CUDA's foreach
# kernels: the same math rounded apart (a few ulps a step), which 10 steps of AdamW carry into
# the loss at about 1e-6; the tolerance leaves a decade and a half above that.
LOSS_REL_HOST = 5e-5
INFO_BYTES_TOL = GiB  # one CUDA context (~0.5 GiB) may be held by one side and not the other
INFO_TOTAL_REL = 0.02  # NVML's total includes memory the driver reserves; cudaMemGetInfo's does not
SMI_OVERHEAD = 3 * GiB // 2  # CUDA context, cuBLAS/cuDNN workspaces: outside the caching allocator
# memtrain vs its PyTorch twin, 10 fp32 steps on CUDA, deterministic kernels on both sides. The
# two build the same ops in the same order, so on the CPU they agree to ~1e-7. On CUDA both
# convolve in TF32 (cuDNN's default, the same in libtorch and PyTorch), whose inputs keep 10
# mantissa bits (2^-11, about 5e-4 relative): where the two reach a kernel through different but
# equal op sequences (a layout copy, another algorithm for another workspace) the rounding can
# fall differently by up to that much, and 10 optimizer steps carry it without growing it by
# much. A defect (a wrong stride or padding, a term left out, another data order) moves the
# loss by percent from the first step, far past this.
LOSS_REL_TWIN = 1e-3
# A step retried at half the micro-batch vs a run set to that micro-batch: the same kernels on
# the same samples, deterministic, but under the cap cuDNN may find less room for a workspace and
# take another algorithm, which rounds apart in TF32 as the twins do. Statistics left as the failed
# attempt made them (one more BatchNorm update at momentum 0.1) are apart by percent, and their
# update counts by one.
LOSS_REL_RETRY = LOSS_REL_TWIN
STEP_TIME_REL = 0.05  # step seconds summed vs the epochs' wall time: both tile the same loop


# --------------------------------------------------------------------------------------------
# Pure half: reading and judging.
# --------------------------------------------------------------------------------------------


class Check:
    """One row of the table. `ok` is True (pass) or False (fail)."""

    def __init__(self, name, expected, seen, ok):
        self.name, self.expected, self.seen, self.ok = name, expected, seen, bool(ok)

    def __repr__(self):
        return f"Check({self.name!r}, ok={self.ok}, seen={self.seen!r})"


def get(d, dotted, default=None):
    """d["a"]["b"]["c"] for "a.b.c"; `default` where any part is missing."""
    for k in dotted.split("."):
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def size(n):
    """Bytes for a human: 1.50 GiB, 12.0 MiB, 512 B; "none" for None."""
    if n is None:
        return "none"
    n = float(n)
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def read_json(path):
    with open(path) as f:
        return json.load(f)


def parse_jsonl(text):
    """metrics.jsonl's records; a torn last line (a killed run) is left out."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def read_jsonl(path):
    with open(path) as f:
        return parse_jsonl(f.read())


def of_type(records, kind):
    return [r for r in records if r.get("type") == kind]


def step_losses(records):
    return [r["loss"] for r in of_type(records, "step")]


def max_rel_gap(a, b):
    """Largest |x - y| / |y| over two equally long lists; inf when their lengths differ or one is
    empty (nothing to compare is no agreement)."""
    if len(a) != len(b) or not a:
        return float("inf")
    gap = 0.0
    for x, y in zip(a, b):
        if x != y:
            gap = max(gap, abs(x - y) / max(abs(y), 1e-30))
    return gap


def gap_text(g):
    return "lengths differ" if g == float("inf") else f"{g:.1e}"


def safetensors_header(data):
    """A safetensors file's JSON header and the offset its tensors' bytes start at (no library
    needed)."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), 8 + n


def safetensors_keys(path):
    """The tensor names in a safetensors file."""
    with open(path, "rb") as f:
        header, _ = safetensors_header(f.read())
    return sorted(k for k in header if k != "__metadata__")


def batchnorm_state(data):
    """BatchNorm's buffers in a model.safetensors file's bytes: {name: [values]} for every
    running_mean, running_var (f32) and num_batches_tracked (i64)."""
    header, start = safetensors_header(data)
    fmt = {"F32": "f", "I64": "q"}
    out = {}
    for name, t in header.items():
        if name == "__metadata__" or not name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            continue
        a, b = t["data_offsets"]
        raw = data[start + a:start + b]
        out[name] = list(struct.unpack(f"<{len(raw) // struct.calcsize(fmt[t['dtype']])}{fmt[t['dtype']]}", raw))
    return out


def parse_smi_apps(text):
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`: {pid:
    bytes}. Rows whose memory is not a number ("[N/A]" in some containers) are left out."""
    out = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 2:
            continue
        try:
            out[int(parts[0])] = int(float(parts[1]) * MiB)
        except ValueError:
            continue
    return out


def parse_smi_used(text):
    """`nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0`: bytes."""
    for line in text.splitlines():
        try:
            return int(float(line.strip()) * MiB)
        except ValueError:
            continue
    return None


def render(checks):
    """The table, as Markdown (pasteable into an issue), then a count line."""
    rows = [("check", "expected", "seen", "result")]
    rows += [(c.name, c.expected, c.seen, "PASS" if c.ok else "FAIL") for c in checks]
    widths = [max(len(r[i]) for r in rows) for i in range(3)] + [6]

    def line(r):
        return "| " + " | ".join(str(v).replace("|", "/").ljust(w) for v, w in zip(r, widths)) + " |"

    out = [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(r) for r in rows[1:]]
    failed = sum(not c.ok for c in checks)
    out.append(f"{len(checks) - failed} passed, {failed} failed")
    return "\n".join(out)


def exit_status(checks):
    return 1 if any(not c.ok for c in checks) else 0


def no_cuda_message(probe):
    """Why this machine cannot run the checks, or None when it can. `probe` is torch_probe()'s."""
    if probe.get("error"):
        return f"gpu-check: cannot use PyTorch: {probe['error']}"
    if not probe.get("available"):
        return (
            f"gpu-check: no CUDA device: torch.cuda.is_available() is False (torch {probe.get('version')}, "
            f"built for CUDA {probe.get('cuda_built')}, {probe.get('count', 0)} device(s) visible). "
            "Run it on a machine with an NVIDIA GPU and its driver; on this one, only its self-test runs "
            "(scripts/gpu-check --self-test)."
        )
    return None


def failure(name, expected, proc):
    """A command that did not do what the check needs: its exit and last message."""
    return Check(name, expected, proc.why(), False)


# -- the judges, one per check ----------------------------------------------------------------


def judge_info(info, probe):
    """`memtrain info --json` against torch.cuda's own figures for device 0."""
    name = "info vs torch.cuda"
    expected = (
        f"cuda available, same device count and name; total within {INFO_TOTAL_REL:.0%}, "
        f"free/used within {size(INFO_BYTES_TOL)}"
    )
    gpus = info.get("gpus") or []
    if get(info, "cuda.available") is not True or not gpus:
        seen = f"cuda.available={get(info, 'cuda.available')}, {len(gpus)} GPU(s)"
        if probe.get("available"):
            # torch sees the GPU and the binary does not: every CUDA run below fails for that reason.
            seen += (f" although torch sees {probe.get('count')}: is the binary linked with libtorch_cuda "
                     "(ldd memtrain | grep torch_cuda) and LD_LIBRARY_PATH at a CUDA torch/lib?")
        return Check(name, expected, seen, False)
    g = gpus[0]
    problems = []
    if get(info, "cuda.device_count") != probe.get("count"):
        problems.append(f"device count {get(info, 'cuda.device_count')} vs torch {probe.get('count')}")
    their_name = probe.get("name") or ""
    if their_name and their_name not in (g.get("name") or "") and (g.get("name") or "") not in their_name:
        problems.append(f"name {g.get('name')!r} vs torch {their_name!r}")
    total, t_total = g.get("total_bytes"), probe.get("total")
    if not isinstance(total, int) or abs(total - t_total) > INFO_TOTAL_REL * t_total:
        problems.append(f"total {size(total)} vs torch {size(t_total)}")
    for key, theirs in (("free_bytes", probe.get("free")), ("used_bytes", probe.get("total", 0) - probe.get("free", 0))):
        ours = g.get(key)
        if not isinstance(ours, int) or abs(ours - theirs) > INFO_BYTES_TOL:
            problems.append(f"{key} {size(ours)} vs torch {size(theirs)}")
    seen = (
        f"{g.get('name')}: total {size(total)} (torch {size(t_total)}), free {size(g.get('free_bytes'))} "
        f"(torch {size(probe.get('free'))}), used {size(g.get('used_bytes'))}; driver {get(info, 'cuda.driver')}, "
        f"runtime {get(info, 'cuda.runtime')}"
    )
    if problems:
        seen += "; MISMATCH: " + "; ".join(problems)
    return Check(name, expected, seen, not problems)


def judge_backoff(summary, micro):
    """A capped CUDA OOM that halving the micro-batch recovered from."""
    ok = (
        (get(summary, "oom.backoffs") or 0) >= 1
        and (get(summary, "batch.final_micro_batch") or micro) < micro
        and get(summary, "batch.effective_batch") == micro
        and str(summary.get("device", "")).startswith("cuda")
        and summary.get("status") == "completed"
    )
    seen = (
        f"{get(summary, 'oom.backoffs')} backoff(s), micro-batch {micro} -> {get(summary, 'batch.final_micro_batch')}"
        f" x {get(summary, 'batch.final_accumulation_steps')}, effective {get(summary, 'batch.effective_batch')},"
        f" {summary.get('status')} on {summary.get('device')}, peak reserved {size(get(summary, 'memory.peak_reserved_bytes'))}"
    )
    return Check("OOM backoff (1 GiB cap)", f">= 1 backoff, micro-batch < {micro}, effective {micro}, completed on cuda", seen, ok)


SETUP_OOM = "set-up OOM under a cap"


def judge_setup_oom(rc, stderr):
    """A model whose weights exceed the CUDA cap, built on the host and moved: exit 3, the phase
    named, the cap the advice to raise (libtorch's CUDA message says what it allowed), and no
    count of host tensors, which says nothing of the device."""
    expected = 'exit 3, "out of memory while building the model", "To fix: raise memory.limit", no host tensor count'
    said = [s for s in ("out of memory while building the model", "To fix: raise memory.limit") if s in stderr]
    wrong = [s for s in ("of tensors were allocated", "own memory ran out", "panicked") if s in stderr]
    line = next((l for l in stderr.splitlines() if "out of memory" in l), stderr.strip()[-300:])
    seen = f"exit {rc}; {line[:300]}"
    return Check(SETUP_OOM, expected, seen, rc == 3 and len(said) == 2 and not wrong)


BN_RETRY = "OOM retry restores BatchNorm"


def judge_bn_retry(capped, capped_bn, small_bn, micro):
    """ResNet18 capped so its first step runs out of memory at `micro` and is retried at half:
    the retry must start from the BatchNorm statistics the failed attempt found, so the run ends
    with those of a run set to the smaller micro-batch from the start: the same update counts
    (num_batches_tracked; the failed attempt's forward counted one more in every layer it
    reached) and running statistics within the tolerance."""
    expected = (f">= 1 backoff from {micro}; the final BatchNorm buffers equal the run set to {micro // 2}'s"
                f" (counts exactly, statistics within {LOSS_REL_RETRY:g} rel.)")
    backed = (get(capped, "oom.backoffs") or 0) >= 1 and get(capped, "batch.final_micro_batch") == micro // 2
    seen = f"{get(capped, 'oom.backoffs')} backoff(s), micro-batch {micro} -> {get(capped, 'batch.final_micro_batch')}"
    if not backed or capped.get("status") != "completed":
        return Check(BN_RETRY, expected, seen + f", {capped.get('status')}", False)
    if not capped_bn or sorted(capped_bn) != sorted(small_bn or {}):
        return Check(BN_RETRY, expected, seen + f"; BatchNorm buffers {len(capped_bn or {})} vs {len(small_bn or {})}", False)
    counts = [k for k in capped_bn if k.endswith("num_batches_tracked") and capped_bn[k] != small_bn[k]]
    stats = [k for k in capped_bn if not k.endswith("num_batches_tracked")]
    scale = max((abs(v) for k in stats for v in small_bn[k]), default=1.0) or 1.0
    gap = max((abs(a - b) for k in stats for a, b in zip(capped_bn[k], small_bn[k])), default=0.0) / scale
    seen += f"; {len(stats)} statistics, largest gap {gap:.1e} of their largest; {len(counts)} update count(s) apart"
    return Check(BN_RETRY, expected, seen, not counts and gap <= LOSS_REL_RETRY)


def bn_retry_bounds(records_big, records_small):
    """Where to look for a cap under which the first step at the big micro-batch fails and the
    halved shape fits: (low, high, first try), or None with why. High is the big run's first
    step's peak allocated (reserved never falls below allocated, so a cap under it cannot be
    met as it ran uncapped); low is the halved run's peak allocated. The first try lies between
    high and the halved run's peak reserved, which it never needed more than. Under a cap cuDNN
    picks leaner algorithms and the allocator frees its cache and retries, so a step can fit in
    less than it took uncapped: bn_retry_verdict judges each try and the search moves on."""
    steps = of_type(records_big, "step")
    high = get(steps[0], "memory.peak_allocated_bytes") if steps else None
    small = of_type(records_small, "step")
    low = max((get(r, "memory.peak_allocated_bytes") or 0 for r in small), default=0)
    fits = [get(r, "memory.peak_reserved_bytes", get(r, "memory.peak_allocated_bytes")) for r in small]
    fits += [r.get("peak_bytes") for r in of_type(records_small, "preflight")]
    if not isinstance(high, int) or not low or not all(isinstance(x, int) for x in fits):
        return None, f"no peak figures in the step records (first step's peak allocated {high}, halved run's {fits})"
    if high <= low:
        return None, f"the first step's peak allocated {size(high)} is not above the halved run's {size(low)}"
    first = max(fits) + (high - max(fits)) // 2 if high > max(fits) else low + (high - low) // 2
    return (low, high, first), ""


def bn_retry_verdict(rc, records, summary, micro):
    """A capped try: "high" when the first step at `micro` ran (the cap let it squeeze in; an
    OOM at a later step would retry from statistics the halved run never had), "low" when the
    halved shape did not fit either, "ok" otherwise."""
    ooms = of_type(records, "oom")
    if not ooms or ooms[0].get("step") != 0 or ooms[0].get("micro_batch_before") != micro:
        return "high"
    if rc != 0 or get(summary, "batch.final_micro_batch") != micro // 2:
        return "low"
    return "ok"


def judge_cpu_fallback(summary):
    ok = get(summary, "oom.cpu_fallbacks") == 1 and summary.get("device") == "cpu" and summary.get("status") == "completed"
    seen = (
        f"{get(summary, 'oom.cpu_fallbacks')} CPU fallback(s), {summary.get('status')} on {summary.get('device')},"
        f" {summary.get('epochs_completed')} epoch(s)"
    )
    return Check("OOM CPU fallback", "1 fallback, completed on cpu", seen, ok)


def snapshot_reserved(snapshot, device=None):
    """Bytes in the snapshot's segments (on `device`, when given): what the allocator reserved."""
    segs = [s for s in snapshot.get("segments", []) if device is None or s.get("device") == device]
    return sum(int(s.get("total_size", 0)) for s in segs), len(segs)


def snapshot_allocated(snapshot, device=None, field="size"):
    """Bytes in the snapshot's live blocks: their block sizes, or (`field="requested_size"`) what
    their tensors asked for."""
    total = 0
    for s in snapshot.get("segments", []):
        if device is not None and s.get("device") != device:
            continue
        for b in s.get("blocks", []):
            if b.get("state") == "active_allocated":
                total += int(b.get(field, b.get("size", 0)))
    return total


def judge_snapshot(rc, report, snapshot):
    """exit 3; oom/report.json; the snapshot's segments add up to the reserved bytes the report's
    allocator statistics give (both taken at the OOM, one after the other)."""
    name = "OOM snapshot vs reserved"
    expected = "exit 3; sum of segment sizes == allocator_stats.reserved"
    if rc != 3:
        return Check(name, expected, f"exit {rc}", False)
    if report is None:
        return Check(name, expected, "exit 3 but no oom/report.json", False)
    if snapshot is None:
        return Check(name, expected, "exit 3, report.json, but no readable oom/snapshot.pickle", False)
    device = None
    m = re.match(r"cuda:(\d+)", str(report.get("device", "")))
    if m:
        device = int(m.group(1))
    seg_bytes, segs = snapshot_reserved(snapshot, device)
    reserved = get(report, "allocator_stats.reserved")
    allocated = get(report, "allocator_stats.allocated")
    events = sum(len(t) for t in snapshot.get("device_traces") or [])
    ok = isinstance(reserved, int) and segs > 0 and seg_bytes == reserved
    seen = (
        f"{segs} segment(s) = {size(seg_bytes)} ({seg_bytes} B) vs reserved {size(reserved)} ({reserved} B); "
        f"active blocks {size(snapshot_allocated(snapshot, device))} vs allocated {size(allocated)}; "
        f"{events} trace event(s)"
    )
    return Check(name, expected, seen, ok)


def requested_at_oom(snapshot, device=0):
    """The bytes live tensors had asked for when the snapshot's trace recorded its last OOM,
    replayed back from the blocks live at the snapshot (a trace event's size is the request's, so
    the live blocks count their requested_size): up at alloc, down at free_requested, when the
    tensor let go (a block still in use on another stream is freed later, at free_completed).
    None without an OOM in the trace."""
    traces = snapshot.get("device_traces") or []
    trace = traces[device] if device < len(traces) else []
    total = snapshot_allocated(snapshot, device, "requested_size")
    for e in reversed(trace):
        if e.get("action") == "oom":
            return total
        total += {"alloc": -1, "free_requested": 1}.get(e.get("action"), 0) * int(e.get("size", 0))
    return None


def judge_end_snapshot(oom_snapshot, end_snapshot):
    """memory.record_history: snapshot.pickle, written at the run's end, carries the history: its
    trace replayed back to the OOM gives the tensor bytes the OOM's own snapshot shows live."""
    name = "end snapshot"
    expected = "snapshot.pickle at the end; its trace replayed to the OOM == the OOM snapshot's live requested bytes"
    if end_snapshot is None:
        return Check(name, expected, "no readable snapshot.pickle in the run directory", False)
    if oom_snapshot is None:
        return Check(name, expected, "no OOM snapshot to compare with", False)
    at_oom = requested_at_oom(end_snapshot)
    live = snapshot_allocated(oom_snapshot, field="requested_size")
    events = sum(len(t) for t in end_snapshot.get("device_traces") or [])
    ok = at_oom is not None and at_oom == live
    seen = f"{events} trace event(s); replayed to the OOM {at_oom} B vs the OOM snapshot's {live} B"
    return Check(name, expected, seen, ok)


def judge_inf_step(records, summary, at):
    """fp16-mixed with an inf planted at step `at`: that step skipped, the scale halved, the others
    not skipped."""
    steps = {r["step"]: r for r in of_type(records, "step")}
    name = "fp16 inf: skip + halve"
    expected = f"step {at} skipped, scale halves there, steps {at - 1} and {at + 1} not skipped, 1 skipped in summary"
    if at - 1 not in steps or at not in steps or at + 1 not in steps:
        return Check(name, expected, f"step records for {sorted(steps)[:12]}", False)
    before, hit, after = steps[at - 1], steps[at], steps[at + 1]
    s0, s1 = before.get("loss_scale"), hit.get("loss_scale")
    ok = (
        hit.get("skipped") is True
        and not before.get("skipped")
        and not after.get("skipped")
        and isinstance(s0, (int, float))
        and s1 == s0 / 2
        and get(summary, "precision.skipped_steps") == 1
    )
    seen = (
        f"skipped {before.get('skipped')}/{hit.get('skipped')}/{after.get('skipped')} at steps {at - 1}/{at}/{at + 1};"
        f" scale {s0} -> {s1}; summary skipped_steps {get(summary, 'precision.skipped_steps')},"
        f" final scale {get(summary, 'precision.loss_scale')}"
    )
    return Check(name, expected, seen, ok)


def judge_recompute(model, plain_records, plain_summary, ckpt_records, ckpt_summary):
    """Activation checkpointing: the same losses as the plain run, a lower peak."""
    gap = max_rel_gap(step_losses(ckpt_records), step_losses(plain_records))
    p, c = get(plain_summary, "memory.peak_allocated_bytes"), get(ckpt_summary, "memory.peak_allocated_bytes")
    on = get(ckpt_summary, "precision.activation_checkpointing")
    ok = gap <= LOSS_REL_RECOMPUTE and isinstance(p, int) and isinstance(c, int) and c < p and on is True
    seen = (
        f"{len(step_losses(ckpt_records))} steps, loss gap {gap_text(gap)}; peak allocated {size(c)} vs plain "
        f"{size(p)}" + (f" ({c / p:.2f}x)" if isinstance(p, int) and p and isinstance(c, int) else "")
        + ("" if on else "; checkpointing was not on")
    )
    return Check(f"recompute {model}", f"losses within {LOSS_REL_RECOMPUTE:g} rel. of plain, lower peak", seen, ok)


def libtorch_warnings(stderr):
    """libtorch's own warning lines ("[W1126 03:04:05.000 ...]", "[W Memory.cpp:46] ...")."""
    return [l for l in (stderr or "").splitlines() if l.startswith("[W")]


def warnings_text(warns):
    return f"; {len(warns)} libtorch [W line(s): {warns[0][:100]}" if warns else ""


def judge_host_lever(combo, base_records, records, summary, cap, stderr, floor=1):
    """A host lever on CUDA: the all-device run's losses within LOSS_REL_HOST, the device peak
    under the cap, at least `floor` pinned host bytes at the peak (host_floor: what the lever must
    hold there), no libtorch warning."""
    gap = max_rel_gap(step_losses(records), step_losses(base_records))
    peak, host = get(summary, "memory.peak_allocated_bytes"), get(summary, "memory.peak_host_bytes")
    warns = libtorch_warnings(stderr)
    ok = gap <= LOSS_REL_HOST and isinstance(peak, int) and peak <= cap and (host or 0) >= floor and not warns
    seen = (f"{len(step_losses(records))} steps, loss gap {gap_text(gap)}; device peak {size(peak)} of {size(cap)}; "
            f"host peak {size(host)} (at least {size(floor)})" + warnings_text(warns))
    return Check(f"host levers: {combo}", f"losses within {LOSS_REL_HOST:g} rel. of all-device, peak under the cap, "
                 "the lever's bytes on the host, no [W", seen, ok)


def vit_parameters(v):
    """The parameter count of torchvision's VisionTransformer for a spec's [model.vit] table."""
    d, m, classes = v["hidden_dim"], v["mlp_dim"], v.get("num_classes", 1000)
    tokens = (v["image_size"] // v["patch_size"]) ** 2 + 1
    embed = 3 * v["patch_size"] ** 2 * d + d + d + tokens * d  # patch convolution, class token, positions
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)  # 2 norms, attention, MLP
    return embed + v["layers"] * block + 2 * d + d * classes + classes


def host_floor(levers, parameters, block_input):
    """The fewest host bytes fp32 AdamW with `levers` on the host must hold at its peak: the two
    moments (8 bytes a parameter) and the weights (4) for as long as they live there, and on top
    either every gradient (4, at the update) or one block's input (during the forward), whichever
    is larger. A lever that leaves its tensors on the device would come in under it."""
    steady = 8 * parameters * ("optimizer_state" in levers) + 4 * parameters * ("parameters" in levers)
    passing = max(4 * parameters * ("gradients" in levers), block_input * ("activations" in levers))
    return steady + passing


def wall_rate(records, warmup):
    """Samples per second over the step records after `warmup` steps, from their `seconds`: each
    runs from the end of the step before to the end of its own (on CUDA on the device's clock),
    so the GPU's work is inside. (A record's `time` is when it was written, on CUDA once the next
    step is queued: the gaps between them are not the steps'.)"""
    steps = of_type(records, "step")
    if len(steps) <= warmup or warmup < 1:
        return None
    timed = steps[warmup:]
    seconds = sum(r["seconds"] for r in timed)
    return sum(r["samples"] for r in timed) / seconds if seconds > 0 else None


def host_update_bandwidth(records, parameters, warmup, bytes_per_parameter=28):
    """GB/s the host update moved (AdamW reads and writes 28 bytes a parameter), from the step
    records' host_update_seconds; None where they have none."""
    secs = [r.get("host_update_seconds") for r in of_type(records, "step")[warmup:]]
    secs = [x for x in secs if x]
    if not secs:
        return None
    secs.sort()
    return parameters * bytes_per_parameter / secs[len(secs) // 2] / 1e9


def judge_offload_speed(name, base_records, records, summary, cap, warmup, target, parameters):
    """A speed row: both runs trained, the capped one under its cap, and the ratio of their
    samples/s (device-clock step seconds) meets its target. A row that passed on completion
    alone would prove nothing."""
    base, rate = wall_rate(base_records, warmup), wall_rate(records, warmup)
    peak = get(summary, "memory.peak_allocated_bytes")
    trained = base is not None and rate is not None and isinstance(peak, int) and peak <= cap
    ratio = rate / base if trained and base > 0 else None
    bw = host_update_bandwidth(records, parameters, warmup)
    seen = ("-" if ratio is None else f"{rate:.1f} vs {base:.1f} samples/s = {ratio:.2f}x (target {target:.2f}x)") \
        + f"; device peak {size(peak)}" + (f"; host update {bw:.1f} GB/s" if bw else "")
    ok = ratio is not None and ratio >= target
    return Check(f"offload speed: {name}", f"trains under the cap at >= {target:.2f}x the uncapped speed", seen, ok)


def judge_async_cap(start, summary, micro):
    """The cap under cudaMallocAsync: the backend is in force, the fraction with it, and an OOM at
    the cap is recovered by backoff."""
    conf = (start or {}).get("allocator_conf") or get(summary, "memory.allocator_conf") or ""
    # The fraction reaches cudaMallocAsync through the allocator call, not its string.
    fraction = get(start or {}, "cap.fraction") or get(summary, "memory.cap.fraction")
    ok = (
        "backend:cudaMallocAsync" in conf
        and fraction is not None
        and (get(summary, "oom.backoffs") or 0) >= 1
        and summary.get("status") == "completed"
        and str(summary.get("device", "")).startswith("cuda")
    )
    seen = (
        f"allocator {conf or 'none'}, cap fraction {fraction}; {get(summary, 'oom.backoffs')} backoff(s), micro-batch {micro} -> "
        f"{get(summary, 'batch.final_micro_batch')}, {summary.get('status')} on {summary.get('device')}"
    )
    return Check(
        "cudaMallocAsync cap", "backend:cudaMallocAsync + fraction in force; OOM at 1 GiB, backoff, completed", seen, ok
    )


def judge_fit(fit, run_summary, smi_peak, how):
    """fit's recommendation, run, watched by nvidia-smi: what the driver sees used is the
    allocator's peak plus a context's worth at most."""
    name = "fit vs nvidia-smi"
    expected = f"rec. runs; fit peak <= smi used <= fit peak + {size(SMI_OVERHEAD)}; run peak <= budget"
    rec = (fit or {}).get("recommendation")
    if not rec:
        return Check(name, expected, "fit made no recommendation", False)
    peak = rec.get("peak_bytes")
    budget = get(fit, "budget.bytes")
    run_peak = get(run_summary, "memory.peak_reserved_bytes")
    ok = (
        isinstance(peak, int)
        and smi_peak is not None
        and peak <= smi_peak <= peak + SMI_OVERHEAD
        and isinstance(run_peak, int)
        and isinstance(budget, int)
        and run_peak <= budget
    )
    seen = (
        f"rec. micro-batch {rec.get('batch_size')} x {rec.get('accumulation_steps')}, fit peak {size(peak)}; "
        f"nvidia-smi {size(smi_peak)} ({how}); run peak reserved {size(run_peak)} of budget {size(budget)}"
    )
    return Check(name, expected, seen, ok)


FIT_GRAPH_ROW = "fit measures CUDA graphs"


def fit_graph_pairs(fit):
    """The (eager, captured) probe pairs of `fit --json`: the same setting at the same
    micro-batch, probed with train.cuda_graph "off" and "on" (the first of each)."""
    probes = (fit or {}).get("probes") or []

    def key(p):
        return (p.get("precision"), p.get("activation_checkpointing"), p.get("placement"), p.get("micro_batch"))

    on = {}
    for p in probes:
        if p.get("cuda_graph") == "on":
            on.setdefault(key(p), p)
    pairs, seen = [], set()
    for p in probes:
        if p.get("cuda_graph") == "off" and key(p) in on and key(p) not in seen:
            seen.add(key(p))
            pairs.append((p, on[key(p)]))
    return pairs


def judge_fit_graph(fit, rc, records, summary):
    """`fit` on CUDA of a spec asking for graphs ("auto"): some setting was probed eager and
    captured at one micro-batch, and the spec fit wrote runs to its step limit under the budget,
    capturing its step exactly when fit recommended the captured one."""
    expected = "a setting probed eager and captured at one micro-batch; the written spec runs under the budget"
    pairs = fit_graph_pairs(fit)
    rec = (fit or {}).get("recommendation") or {}
    budget, peak = get(fit, "budget.bytes"), get(summary, "memory.peak_reserved_bytes")
    captured = bool(graph_events(records, "captured"))
    wants = rec.get("cuda_graph") == "on"

    def rate(p):
        r = p.get("samples_per_s")
        return "OOM" if not p.get("fits") else ("-" if r is None else f"{r:.0f}/s")

    said = "; ".join(f"{e.get('precision')} at {e.get('micro_batch')}: eager {rate(e)}, captured {rate(c)}"
                     for e, c in pairs) or "no setting probed both ways"
    seen = (f"{said}; rec. cuda_graph {rec.get('cuda_graph', '-')} at micro-batch {rec.get('batch_size', '-')}; "
            f"run exit {rc}, peak reserved {size(peak)} of {size(budget)}, captured: {'yes' if captured else 'no'}")
    ok = (bool(pairs) and bool(rec) and rc == 0 and isinstance(peak, int) and isinstance(budget, int)
          and peak <= budget and captured == wants)
    return Check(FIT_GRAPH_ROW, expected, seen, ok)


def judge_resume(whole_records, resumed_records, cut_code, rng_keys, want="rng/cuda"):
    """A run cut by Ctrl-C and resumed trains the uncut run's steps: dropout draws from the CUDA
    generator, whose state the checkpoint must carry."""
    whole = step_losses(whole_records)
    resumed = step_losses(resumed_records)
    gap = max_rel_gap(resumed, whole)
    ok = cut_code == 130 and want in rng_keys and gap <= LOSS_REL_RESUME
    seen = (
        f"cut exit {cut_code}; checkpoint rng keys {rng_keys}; {len(resumed)} vs {len(whole)} steps, "
        f"loss gap {gap_text(gap)}" + (" (bit for bit)" if gap == 0.0 else "")
    )
    return Check("CUDA resume (rng)", f"exit 130, {want} saved, losses within {LOSS_REL_RESUME:g} of uncut", seen, ok)


def judge_expandable(start, records, summary):
    """Expandable segments, a clear after every step: the clears give memory back."""
    conf = (start or {}).get("allocator_conf") or ""
    clears = of_type(records, "cache_clear")
    released = [c.get("released_bytes") for c in clears]
    total = sum(r for r in released if isinstance(r, int))
    ok = "expandable_segments:True" in conf and clears and total > 0 and summary.get("status") == "completed"
    seen = (
        f"allocator {conf or 'none'}; {len(clears)} clear(s) released {size(total)} in all "
        f"(largest {size(max([r for r in released if isinstance(r, int)] or [0]))})"
    )
    return Check("expandable segments clear", "expandable_segments:True; clears release > 0 bytes", seen, ok)


def judge_host_reads(records, summary, fp16):
    """The host-read counter: at most one device-to-host read per logged step on the plain path
    (the loss), one more per step with fp16-mixed (the scaler's found-inf), none on unlogged
    steps. A step record covers the steps since the previous record; an epoch record the reads
    at the epoch's end (validation's sums and the epoch's: at most 2) plus, with fp16-mixed, the
    unlogged steps since the last step record. The summary counts every phase."""
    name = "host reads " + ("fp16-mixed" if fp16 else "fp32")
    expected = "<= 1 per step record, <= 2 per epoch record" + (" + 1 per step covered" if fp16 else "") + "; summary total <= their sum"
    steps = of_type(records, "step")
    if not steps:
        return Check(name, expected, "no step records", False)
    if not all("host_reads" in r for r in steps) or "host_reads" not in summary:
        return Check(name, expected, "binary has no host-read counter (no host_reads in step records/summary.json)", False)
    prev = 0
    allowed_sum, bad = 0, []
    for r in records:
        if r.get("type") not in ("step", "epoch"):
            continue
        covered = r["step"] - prev
        prev = r["step"]
        allowed = (1 if r["type"] == "step" else 2) + (covered if fp16 else 0)
        allowed_sum += allowed
        reads = r.get("host_reads", 0)
        if reads > allowed:
            bad.append(f"{r['type']} {r['step']}: {reads} > {allowed}")
    total = summary.get("host_reads")
    trailing = (summary.get("global_steps") or prev) - prev
    allowed_sum += trailing if fp16 else 0
    ok = not bad and isinstance(total, int) and total <= allowed_sum
    seen = (
        f"{len(steps)} records, reads per record {sorted(set(r['host_reads'] for r in steps))}; summary {total} "
        f"(allowed {allowed_sum})" + ("; OVER: " + ", ".join(bad[:3]) if bad else "")
    )
    return Check(name, expected, seen, ok)


def judge_optimizer(impl, torch_impl, ours, theirs, note=""):
    gap = max_rel_gap(ours, theirs)
    ok = gap <= LOSS_REL_OPTIMIZER
    seen = f"{len(ours)} steps vs {len(theirs)}, loss gap {gap_text(gap)}" + (" (bit for bit)" if gap == 0.0 else "")
    return Check(f"optimizer {impl}", f"losses within {LOSS_REL_OPTIMIZER:g} rel. of torch.optim {torch_impl}",
                 seen + note, ok)


def judge_single_rank(plain_records, group_records, group_summary, stderr, backend="NCCL"):
    gap = max_rel_gap(step_losses(group_records), step_losses(plain_records))
    ranks = len(get(group_summary, "memory.ranks") or [])
    said = f"one-rank {backend} group" in stderr
    ok = said and ranks == 1 and gap <= LOSS_REL_GROUP
    seen = f"{'said' if said else 'did not say'} 'one-rank {backend} group'; {ranks} rank(s) recorded; loss gap {gap_text(gap)}"
    return Check(f"{backend} one-rank group",
                 f"a one-rank {backend} group trains; losses within {LOSS_REL_GROUP:g} of no group", seen, ok)


def judge_group_oom(plain, group, plain_records, group_records, backend="NCCL"):
    """A one-rank group capped as `backoff` caps: its step runs out of memory with the gradient
    buckets armed, so the rank sends the buckets it never launched (zeroed in place, nothing
    allocated) before it backs off; it ends where the same capped run without a group ends."""
    name = f"{backend} group backs off"
    gap = max_rel_gap(step_losses(group_records), step_losses(plain_records))
    micro = [get(s, "batch.final_micro_batch") for s in (plain, group)]
    ok = (
        group.get("status") == "completed"
        and (get(group, "oom.backoffs") or 0) >= 1
        and micro[0] == micro[1]
        and len(get(group, "memory.ranks") or []) == 1
        and gap <= LOSS_REL_GROUP
    )
    seen = (f"{get(group, 'oom.backoffs')} backoff(s), micro-batch {micro[1]} (without a group {micro[0]}),"
            f" {group.get('status')}; loss gap {gap_text(gap)}")
    return Check(name, f"backs off and completes as the run without a group; losses within {LOSS_REL_GROUP:g}",
                 seen, ok)


STATIC_OFFLOAD = "static bill: offload first"
STATIC_ADVICE = "static bill: exit 3 with advice"
ADVICE_RESUME = "static bill: advice followed"
STATE_ON_HOST = 'memory.optimizer_state="host"'  # the advice's setting, as `--set` takes it


def advice_ways(stderr):
    """The settings the advice of a run that ran out of options offers, as `--set KEY=VALUE`
    arguments, word for word ("resume with --resume ... after setting KEY = VALUE, or ...")."""
    line = next((l for l in stderr.splitlines() if "resume with --resume" in l), None)
    if line is None:
        return []
    ways = []
    for way in line.split("resume with --resume", 1)[1].split(", or "):
        _, found, setting = way.partition("after setting ")
        if found and " = " in setting:
            key, value = setting.split(" = ", 1)
            ways.append(f"{key.strip()}={value.strip()}")
    return ways


def judge_static_offload(rc, records, summary, micro):
    """Parameters, gradients and Adam state over the cap at any micro-batch: with "offload" in
    memory.on_oom the first OOM (the first update's) moves the state to the host at the
    configured micro-batch, no backoff tried first, and the run trains to its end."""
    expected = f"first OOM's decision host_optimizer_state at micro-batch {micro}, no backoff; exit 0, completed"
    ooms = of_type(records, "oom")
    first = ooms[0] if ooms else {}
    starts = of_type(records, "start")
    trained, wanted = (summary or {}).get("samples_trained"), (starts[0].get("train_samples") if starts else None)
    ok = (
        rc == 0
        and get(first, "decision.action") == "host_optimizer_state"
        and first.get("micro_batch_before") == micro
        and (get(summary, "oom.backoffs") or 0) == 0
        and get(summary, "batch.final_micro_batch") == micro
        and (summary or {}).get("status") == "completed"
        and str((summary or {}).get("device", "")).startswith(DEVICE)
        and trained is not None and trained == wanted
    )
    seen = (
        f"exit {rc}; {len(ooms)} OOM(s), first in {first.get('phase')!r} at micro-batch {first.get('micro_batch_before')}"
        f" -> {get(first, 'decision.action')}; {get(summary, 'oom.backoffs')} backoff(s), final micro-batch "
        f"{get(summary, 'batch.final_micro_batch')}, {(summary or {}).get('status')} on {(summary or {}).get('device')},"
        f" {trained} of {wanted} samples"
    )
    return Check(STATIC_OFFLOAD, expected, seen, ok)


def judge_static_advice(rc, records, stderr):
    """The same without "offload": the first OOM ends the run (exit 3) without backing off, and
    the advice names the setting that moves the state off the device."""
    expected = f'exit 3, no backoff, the advice\'s first way {STATE_ON_HOST}'
    ooms = of_type(records, "oom")
    decisions = [get(o, "decision.action") for o in ooms]
    ways = advice_ways(stderr)
    ok = rc == 3 and decisions == ["fail"] and ways[:1] == [STATE_ON_HOST]
    seen = f"exit {rc}; OOM decisions {decisions}; advice ways {ways}"
    return Check(STATIC_ADVICE, expected, seen, ok)


def judge_advice_resume(failed_rc, way, rc, records, summary):
    """The failed run resumed with --set exactly as its advice printed it: the checkpoint's
    optimizer state is read into host memory and the run trains to its end."""
    expected = f"exit 3, then --resume --set {STATE_ON_HOST}: exit 0, resumed, every sample trained"
    starts = of_type(records, "start")
    last = starts[-1] if starts else {}
    trained, wanted = (summary or {}).get("samples_trained"), last.get("train_samples")
    ok = (
        failed_rc == 3
        and way == STATE_ON_HOST
        and rc == 0
        and last.get("resumed") is True
        and (summary or {}).get("status") == "completed"
        and str((summary or {}).get("device", "")).startswith(DEVICE)
        and trained is not None and trained == wanted
    )
    seen = (
        f"failed with exit {failed_rc}, way {way!r}; resumed exit {rc}, {len(starts)} start(s), last resumed "
        f"{last.get('resumed')}; {(summary or {}).get('status')} on {(summary or {}).get('device')}, "
        f"{trained} of {wanted} samples"
    )
    return Check(ADVICE_RESUME, expected, seen, ok)


COLLECTIVE_SAID = "this rank ran out of memory inside a collective with the other ranks"


def judge_collective_oom(rc, records, stderr, at, backend="NCCL"):
    """A one-rank group whose rank runs out of memory making its part of the outcome exchange at
    step `at` (the hook refuses the host buffer the exchange is built from): a collective cannot
    be retried, so the run ends as an OOM does, exit 3, the last completed step saved as `oom`."""
    name = f"{backend} collective OOM"
    expected = f"one-rank {backend} group; exit 3, said why, one checkpoint: reason oom at step {at - 1}"
    ckpts = [(c.get("reason"), c.get("step")) for c in of_type(records, "checkpoint")]
    group = f"one-rank {backend} group" in stderr
    said = COLLECTIVE_SAID in stderr
    ok = group and rc == 3 and said and ckpts == [("oom", at - 1)]
    seen = (f"{'formed' if group else 'no'} one-rank {backend} group; exit {rc}; "
            f"{'said' if said else 'did not say'} it ran out inside a collective; checkpoints {ckpts}")
    return Check(name, expected, seen, ok)


def judge_eval_oom(clean, hit, clean_records, hit_records, weights_equal, eval_batch):
    """A CUDA OOM in validation halves validation's micro-batch only: training's shape, its losses
    and its final weights are those of the run whose validation fitted."""
    ooms = of_type(hit_records, "oom")
    gap = max_rel_gap(step_losses(hit_records), step_losses(clean_records))
    micro = get(clean, "batch.final_micro_batch")
    eval_ooms = [o for o in ooms if o.get("phase") == "validation" and get(o, "decision.action") == "eval_backoff"]
    last = get(eval_ooms[-1], "decision.to.micro_batch") if eval_ooms else None
    ok = (
        bool(clean) and bool(hit)
        and clean.get("status") == "completed" and hit.get("status") == "completed"
        and str(hit.get("device", "")).startswith("cuda")
        and len(ooms) >= 1 and len(eval_ooms) == len(ooms)
        and get(hit, "oom.eval_backoffs") == len(ooms)
        and get(hit, "oom.backoffs") == 0
        and get(hit, "batch.final_micro_batch") == micro
        and gap <= LOSS_REL_GROUP
        and weights_equal
    )
    seen = (
        f"{len(eval_ooms)} validation backoff(s) of {len(ooms)} OOM(s), validation micro-batch {eval_batch} -> {last};"
        f" training micro-batch {get(hit, 'batch.final_micro_batch') if hit else None} (clean {micro}),"
        f" {get(hit, 'oom.backoffs') if hit else None} training backoff(s); loss gap {gap_text(gap)};"
        f" final weights {'byte-identical' if weights_equal else 'differ'}; {hit.get('status') if hit else 'no summary'}"
        f" on {hit.get('device') if hit else None}"
    )
    expected = "validation OOMs halve eval micro-batch only; training shape, losses, weights equal to the clean run"
    return Check("validation OOM (1 GiB cap)", expected, seen, ok)


def judge_darts_cap(summary, cap):
    peak = get(summary, "memory.peak_reserved_bytes")
    ok = isinstance(peak, int) and peak < cap and str(summary.get("device", "")).startswith("cuda")
    seen = (
        f"peak reserved {size(peak)}, allocated {size(get(summary, 'memory.peak_allocated_bytes'))}, "
        f"cap {size(get(summary, 'memory.cap.bytes'))}, {get(summary, 'oom.events')} OOM(s), on {summary.get('device')}"
    )
    return Check("darts_4gb under 4 GiB", f"peak reserved < {size(cap)}, on cuda", seen, ok)


def judge_cache_clear_cost(summary):
    clears = get(summary, "cache.clears") or 0
    secs = get(summary, "cache.clear_seconds") or 0.0
    seen = (
        f"{clears} clears took {secs:.4f} s ({1e6 * secs / max(clears, 1):.1f} us each) of "
        f"{summary.get('train_seconds') or 0:.3f} s training over {summary.get('global_steps')} steps on {summary.get('device')}"
    )
    return Check("cache clear cost", "clears > 0 (a measurement)", seen, clears > 0)


def judge_twin(model, ours, theirs, note=""):
    """memtrain's per-step losses against its PyTorch twin's on the same device (fp32, 10 steps,
    deterministic algorithms on both sides)."""
    gap = max_rel_gap(ours, theirs)
    seen = f"max rel gap {gap_text(gap)} over {len(ours)} steps"
    if ours and theirs:
        seen += f" (step 1: {ours[0]:.5f} vs {theirs[0]:.5f}; last: {ours[-1]:.5f} vs {theirs[-1]:.5f})"
    return Check(f"{DEVICE.upper()} vs PyTorch {model}", f"{len(theirs)} step losses within {LOSS_REL_TWIN:g}",
                 seen + note, len(ours) == len(theirs) == 10 and gap <= LOSS_REL_TWIN)


def judge_step_time(records, summary):
    """A run with a record every step: its step records' seconds add up to its epochs' wall time
    (summary.json's train_seconds). A step timed before the loss read, where the host waits for
    the GPU, leaves the GPU's time out and falls short."""
    name = "step seconds vs wall time"
    steps = of_type(records, "step")
    if not summary or not steps:
        return Check(name, f"within {STEP_TIME_REL:.0%}", "no step records or no summary", False)
    summed = sum(s["seconds"] for s in steps)
    wall = summary.get("train_seconds") or 0.0
    gap = abs(summed - wall) / wall if wall > 0 else float("inf")
    seen = f"{len(steps)} steps sum to {summed:.3f} s, the epochs to {wall:.3f} s ({gap:.1%} apart)"
    complete = len(steps) == summary.get("global_steps")
    if not complete:
        seen += f"; {len(steps)} records for {summary.get('global_steps')} steps"
    # On CUDA a step record waits for its loss until the next step is queued: the records must
    # still come in step order, each with its loss, and each epoch's after its last step's.
    ordered = [s.get("step") for s in steps] == list(range(1, len(steps) + 1))
    losses = all(isinstance(s.get("loss"), (int, float)) and math.isfinite(s["loss"]) for s in steps)
    last_step, epochs_after = 0, True
    for rec in records:
        if rec.get("type") == "step":
            last_step = rec.get("step")
        elif rec.get("type") == "epoch":
            epochs_after = epochs_after and rec.get("step") == last_step
    if not (ordered and losses and epochs_after):
        seen += "; records out of order or without a loss"
    # On CUDA each step is timed on the device's clock, from the end of the step before: none can
    # come out at a fraction of the others, as a step timed when the host next looks can. (A CPU
    # rehearsal on a shared machine has steps that vary that much for real.)
    later = [s["seconds"] for prev, s in zip(steps, steps[1:]) if s.get("epoch") == prev.get("epoch")]
    floor = statistics.median(later) / 2 if later else 0.0
    on_gpu = str(summary.get("device", "")).startswith("cuda")
    short = [s for s in later if s < floor] if on_gpu else []
    if short:
        seen += f"; {len(short)} step(s) under half the median step ({min(short):.4f} s)"
    ok = complete and ordered and losses and epochs_after and not short and gap <= STEP_TIME_REL
    return Check(name, f"within {STEP_TIME_REL:.0%}, in order, no step under half the median", seen, ok)


def judge_requested(records, summary):
    """CUDA: every step record reads the peak of the bytes tensors asked for, above zero and at
    most the peak reserved (a block freed while another stream uses it can count as requested a
    little after it stopped counting as allocated, never outside a segment), and the summary keeps
    at least the records' largest (its epoch readings also cover validation)."""
    name = "peak requested bytes"
    expected = "every step: 0 < peak_requested <= peak_reserved; summary's >= the records' largest"
    steps = of_type(records, "step")
    pairs = [(get(s, "memory.peak_requested_bytes"), get(s, "memory.peak_allocated_bytes")) for s in steps]
    reserved = [get(s, "memory.peak_reserved_bytes") for s in steps]
    bad = [i + 1 for i, ((q, a), r) in enumerate(zip(pairs, reserved))
           if not (isinstance(q, int) and isinstance(a, int) and isinstance(r, int) and 0 < q <= r)]
    top = max((q for q, _ in pairs if isinstance(q, int)), default=None)
    kept = get(summary or {}, "memory.peak_requested_bytes")
    rounding = [a - q for q, a in pairs if isinstance(q, int) and isinstance(a, int)]
    seen = (f"{len(steps)} steps, {len(bad)} without a sound reading; largest {size(top)}, summary {size(kept)}; "
            f"allocated above requested by {size(min(rounding, default=0))}..{size(max(rounding, default=0))}")
    ok = bool(steps) and not bad and isinstance(kept, int) and top is not None and kept >= top
    return Check(name, expected, seen, ok)


def judge_step_syncs(rc, stderr, records, steps, model="vit"):
    """A run in which every synchronizing CUDA call after step 3 fails
    (MEMTRAIN_FAULT_CUDA_SYNC_ERROR_AFTER_STEP): the steps after it must make none, so the
    run completes with every step recorded. A blocking copy or a value read inside a step would
    stop the host until the GPU is idle; on failure the row names libtorch's op."""
    name = f"no wait inside a step: {model}"
    done = len(of_type(records, "step"))
    if rc == 0 and done == steps:
        return Check(name, f"steps 4-{steps} make no synchronizing call", f"{done} steps, none", True)
    # libtorch's frames, innermost first: the first one outside c10 (its error and the sync
    # check) is the op that waited.
    frames = [l.strip().split(": ", 1)[-1] for l in (stderr or "").splitlines() if l.strip().startswith("frame #")]
    where = next((f for f in frames if not f.startswith("c10::")), "")
    said = "a synchronizing CUDA call" if "synchronizing CUDA operation" in (stderr or "") else f"exit {rc}"
    seen = f"{said} after {done} step records" + (f"; from {where[:200]}" if where else "")
    return Check(name, f"steps 4-{steps} make no synchronizing call", seen, False)


def judge_loader(plain_records, loaded_records):
    """Augmented images on the device through the prefetching loader (threads, staging, the
    copies to the device) against the same run making each batch when the step asks: the same
    batches, so the same losses (deterministic kernels on both sides), and the steps' data wait
    recorded."""
    name = "loader on the device"
    a, b = step_losses(plain_records), step_losses(loaded_records)
    gap = max_rel_gap(b, a)
    waits = [s.get("data_wait_seconds") for s in of_type(loaded_records, "step")]
    timed = bool(waits) and all(isinstance(w, (int, float)) and w >= 0 for w in waits)
    seen = f"{len(b)} steps, loss gap {gap:.1e}; data wait {'in every step record' if timed else 'missing'}"
    return Check(name, "losses equal to prefetch 0, data wait recorded", seen, gap == 0.0 and timed)


def warning_lines(text):
    """libtorch's warnings: c10's log lines that start `[W` (`[W1126 12:00:00.000 file.cpp:12] ...`)."""
    return [l.strip() for l in (text or "").splitlines() if l.lstrip().startswith("[W")]


def judge_no_warnings(stderrs):
    """Every memtrain run's stderr: no libtorch warning line. `stderrs`: (run, text) pairs."""
    name = "no libtorch [W lines"
    if not stderrs:
        return Check(name, "none in any run", "no memtrain run to look at", False)
    hits = [(run, lines) for run, lines in ((r, warning_lines(t)) for r, t in stderrs) if lines]
    if not hits:
        return Check(name, "none in any run", f"none in {len(stderrs)} runs", True)
    count = sum(len(l) for _, l in hits)
    runs = ", ".join(r for r, _ in hits[:4]) + (" ..." if len(hits) > 4 else "")
    return Check(name, "none in any run", f"{count} in {len(hits)} of {len(stderrs)} runs ({runs}); first: "
                 f"{hits[0][1][0][:200]}", False)


# --------------------------------------------------------------------------------------------
# Running half.
# --------------------------------------------------------------------------------------------

PROBE = r"""
import json, os
out = {}
try:
    import torch
    out["version"] = torch.__version__
    out["lib"] = os.path.join(os.path.dirname(torch.__file__), "lib")
    out["cuda_built"] = torch.version.cuda
    out["available"] = bool(torch.cuda.is_available())
    out["count"] = torch.cuda.device_count() if out["available"] else 0
    if out["available"]:
        free, total = torch.cuda.mem_get_info(0)
        out.update(name=torch.cuda.get_device_name(0), free=free, total=total)
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def torch_probe(python, timeout=120):
    """torch's view of the machine, from a child process (this one holds no CUDA context)."""
    try:
        p = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{python}: {e}"}
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"{python} -c 'import torch' failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"}


class Proc:
    """A finished command: its exit, its output, and why it failed in one line."""

    def __init__(self, argv, rc, stdout, stderr, timed_out=False, timeout=None):
        self.argv, self.rc, self.stdout, self.stderr = argv, rc, stdout, stderr
        self.timed_out, self.timeout = timed_out, timeout

    def why(self):
        if self.timed_out:
            return f"timed out after {self.timeout:.0f} s: {' '.join(self.argv[1:4])} ..."
        lines = [l for l in (self.stderr or "").splitlines() if l.strip()] or \
            [l for l in (self.stdout or "").splitlines() if l.strip()]
        return f"exit {self.rc}" + (f": {lines[-1][:300]}" if lines else "")


class OverBudget(Exception):
    pass


EXPANDABLE = "memory.allocator.expandable_segments=true"


class Runner:
    def __init__(self, binary, python, tmp, budget, cmd_timeout, expandable=False):
        self.bin, self.python, self.tmp = binary, python, tmp
        # --expandable: every run and fit with expandable segments on, unless the check sets
        # the allocator itself (the question is whether the whole table passes with them).
        self.expandable = expandable
        self.deadline = time.time() + budget
        self.cmd_timeout = cmd_timeout
        # Every memtrain run's stderr, (run, text), for the check that no run printed a libtorch
        # warning; runs under a test hook that warns by design (deterministic mode) are left out.
        self.stderrs = []

    def note_stderr(self, name, argv, env, text):
        if argv and argv[0] == self.bin and not (env or {}).get("MEMTRAIN_TEST_DETERMINISTIC"):
            self.stderrs.append((name, text))

    def left(self):
        return self.deadline - time.time()

    def timeout(self):
        left = self.left()
        if left <= 5:
            raise OverBudget()
        return min(self.cmd_timeout, left)

    def path(self, *parts):
        return os.path.join(self.tmp, *parts)

    def env(self, extra=None):
        e = dict(os.environ)
        e.update(extra or {})
        return e

    def cmd(self, argv, env=None, log=None):
        t = self.timeout()
        try:
            p = subprocess.run(argv, capture_output=True, text=True, timeout=t, env=self.env(env), cwd=ROOT)
            proc = Proc(argv, p.returncode, p.stdout, p.stderr)
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
            proc = Proc(argv, 124, out, err, timed_out=True, timeout=t)
        self.note_stderr(log or " ".join(argv[1:3]), argv, env, proc.stderr)
        if log:
            with open(self.path(log + ".log"), "w") as f:
                f.write(f"$ {' '.join(argv)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}\n")
        return proc

    def mt(self, name, args, env=None):
        return self.cmd([self.bin] + self.with_expandable(args, env), env=env, log=name)

    def with_expandable(self, args, env):
        own = any("memory.allocator" in a for a in args) or "PYTORCH_CUDA_ALLOC_CONF" in (env or {})
        if not self.expandable or own or not args or args[0] not in ("run", "fit"):
            return list(args)
        return list(args) + ["--set", EXPANDABLE]

    def run(self, name, spec, sets=(), extra=(), env=None):
        """`memtrain run SPEC --set ... --out TMP/name`; returns (proc, run directory)."""
        out = self.path(name)
        args = ["run", spec, "--out", out]
        for s in sets:
            args += ["--set", s]
        return self.mt(name, args + list(extra), env=env), out

    def spawn_until(self, name, argv, needle, env=None):
        """Starts a command, waits for `needle` on its stderr, sends SIGINT, waits for the end."""
        t = self.timeout()
        err_path = self.path(name + ".err")
        with open(err_path, "w") as err, open(self.path(name + ".out"), "w") as out:
            if argv and argv[0] == self.bin:
                argv = argv[:1] + self.with_expandable(argv[1:], env)
            p = subprocess.Popen(argv, stdout=out, stderr=err, env=self.env(env), cwd=ROOT)
        end = time.time() + t
        seen = False
        while time.time() < end and p.poll() is None:
            with open(err_path) as f:
                if needle in f.read():
                    seen = True
                    break
            time.sleep(0.05)
        if seen:
            p.send_signal(signal.SIGINT)
        try:
            rc = p.wait(timeout=max(end - time.time(), 10))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        with open(err_path) as f:
            stderr = f.read()
        self.note_stderr(name, argv, env, stderr)
        return Proc(argv, rc, "", stderr, timeout=t), seen


def records_of(out):
    path = os.path.join(out, "metrics.jsonl")
    return read_jsonl(path) if os.path.exists(path) else []


def summary_of(out):
    path = os.path.join(out, "summary.json")
    return read_json(path) if os.path.exists(path) else None


# Where the runs train: "cuda" here; the self-test rehearses some checks with "cpu". Every CUDA
# run pins job.device, so no check can pass by quietly training on the CPU.
DEVICE = "cuda"
DIGITS = "configs/digits_mlp.toml"


def dev():
    return f'job.device="{DEVICE}"'


def big():
    """An MLP whose first activation alone is 1 GiB at micro-batch 1024 (262144 x 1024 x 4 bytes):
    with ~0.3 GiB of weights, gradients and Adam state it cannot train under a 1 GiB cap."""
    return ["model.mlp.hidden=[262144]", "train.batch_size=1024", "train.epochs=1", 'memory.limit="1GiB"', dev()]


def spec_file(r, name, text):
    path = r.path(name + ".toml")
    with open(path, "w") as f:
        f.write(text)
    return path


RESNET = """[job]
name = "gpu-check-resnet"
device = "{device}"
[model]
preset = "resnet18"
[model.resnet18]
num_classes = 10
image_size = 128
[data]
source = "synthetic"
samples = 320
[train]
epochs = 1
batch_size = 64
optimizer = "sgd"
lr = 0.05
momentum = 0.9
[log]
progress = "off"
"""

VIT = """[job]
name = "gpu-check-vit"
device = "{device}"
[model]
preset = "vit"
[model.vit]
image_size = 64
patch_size = 8
layers = 6
heads = 8
hidden_dim = 256
mlp_dim = 1024
dropout = {dropout}
attention_dropout = {dropout}
num_classes = 10
[data]
source = "synthetic"
samples = {samples}
[train]
epochs = {epochs}
batch_size = 32
optimizer = "adamw"
lr = 0.001
[log]
progress = "off"
"""


ALL_HOST = [f'memory.{k}="host"' for k in ("optimizer_state", "gradients", "activations", "parameters")]
# (name, lever settings, settings both runs share): accumulation brings the host gradients' later
# pieces, which are added on the host once they have landed.
HOST_COMBOS = [
    ("state", ["memory.optimizer_state=\"host\""], []),
    ("gradients", ["memory.gradients=\"host\""], []),
    ("activations", ["memory.activations=\"host\""], []),
    ("parameters", ["memory.parameters=\"host\""], []),
    ("all four", ALL_HOST, []),
    ("all four, accumulation 2", ALL_HOST, ["train.accumulation_steps=2", "train.batch_size=16"]),
]
HOST_CAP = GiB


def check_host_levers(r, probe):
    """Each host lever alone and all four together, 10 steps of a small ViT against the
    all-device run of the same spec (dropout off: the two runs draw the same batches)."""
    spec = spec_file(r, "host-vit", VIT.format(device=DEVICE, dropout=0.0, samples=640, epochs=1))
    steps = ["--max-steps", "10"]
    bases = {}
    rows = []
    for combo, sets, shared in HOST_COMBOS:
        key = tuple(shared)
        if key not in bases:
            bases[key] = r.run(f"host-base-{len(bases)}", spec, shared, extra=steps)
        p, base = bases[key]
        if p.rc != 0:
            rows.append(failure(f"host levers: {combo}", "the all-device run completes", p))
            continue
        name = "host-" + combo.replace(" ", "-").replace(",", "")
        p, out = r.run(name, spec, shared + sets + ['memory.limit="1GiB"'], extra=steps)
        if p.rc != 0:
            rows.append(failure(f"host levers: {combo}", "completes", p))
            continue
        rows.append(judge_host_lever(combo, records_of(base), records_of(out), summary_of(out), HOST_CAP, p.stderr,
                                     host_lever_floor(VIT, sets, shared)))
    return rows


def host_lever_floor(template, sets, shared):
    """host_floor for the ViT `template` with the `memory.X="host"` settings `sets`, at the
    micro-batch `shared` leaves it."""
    import tomllib

    spec = tomllib.loads(template.format(device=DEVICE, dropout=0.0, samples=640, epochs=1))
    v = spec["model"]["vit"]
    batch = spec["train"]["batch_size"]
    for kv in shared:
        if kv.startswith("train.batch_size="):
            batch = int(kv.split("=", 1)[1])
    levers = {kv.split("=", 1)[0].removeprefix("memory.") for kv in sets}
    block_input = batch * ((v["image_size"] // v["patch_size"]) ** 2 + 1) * v["hidden_dim"] * 4
    return host_floor(levers, vit_parameters(v), block_input)


def check_vit_l16_config(r, probe):
    """The shipped ViT-L/16 config, as a user would run it on a GPU."""
    name = "configs/vit_l16_4gb.toml on CUDA"
    p, out = r.run("vit-l16-config", "configs/vit_l16_4gb.toml", [dev()])
    if p.rc != 0:
        return [failure(name, "completes", p)]
    s = summary_of(out)
    peak, host = get(s, "memory.peak_allocated_bytes"), get(s, "memory.peak_host_bytes")
    warns = libtorch_warnings(p.stderr)
    ok = isinstance(peak, int) and peak <= 4 * GiB and (host or 0) > 0 and not warns
    seen = f"{len(step_losses(records_of(out)))} steps; device peak {size(peak)}; host peak {size(host)}" + warnings_text(warns)
    return [Check(name, "trains, device peak under 4 GiB, host bytes reported, no [W", seen, ok)]


VIT_L16 = {"image_size": 224, "patch_size": 16, "layers": 24, "heads": 16, "hidden_dim": 1024, "mlp_dim": 4096}
VIT_L16_PARAMETERS = 304_326_632
SPEED_WARMUP, SPEED_STEPS = 2, 6


def vit_l16_spec(r, batch):
    m = "\n".join(f"{k} = {v}" for k, v in VIT_L16.items())
    text = f"""[job]
name = "gpu-check-vit-l16-b{batch}"
device = "{DEVICE}"
seed = 0
[model]
preset = "vit"
[model.vit]
{m}
dropout = 0.0
attention_dropout = 0.0
num_classes = 1000
[data]
source = "synthetic"
samples = {batch * 2 * (SPEED_WARMUP + SPEED_STEPS)}
[train]
epochs = 1
batch_size = {batch}
optimizer = "adamw"
lr = 1e-4
weight_decay = 0.05
[memory]
on_oom = ["fail"]
[checkpoint]
every_epochs = 0
[log]
every_steps = 1
progress = "off"
"""
    return spec_file(r, f"vit-l16-b{batch}", text)


SPEED_ROWS = [
    # name, batch, baseline sets (uncapped), lever sets (capped), target ratio
    ("ViT-L/16 b4, state on host", 4, [], ['memory.optimizer_state="host"'], 0.4),
    ("ViT-L/16 b32, state+grads+acts on host vs recompute", 32, ["train.activation_checkpointing=true"],
     [f'memory.{k}="host"' for k in ("optimizer_state", "gradients", "activations")], 0.85),
]


def check_offload_speed(r, probe):
    rows = []
    steps = ["--max-steps", str(SPEED_WARMUP + SPEED_STEPS)]
    for name, batch, base_sets, sets, target in SPEED_ROWS:
        spec = vit_l16_spec(r, batch)
        tag = f"speed-b{batch}"
        p, base = r.run(tag + "-base", spec, base_sets, extra=steps)
        if p.rc != 0:
            rows.append(failure(f"offload speed: {name}", "the uncapped run completes", p))
            continue
        p, out = r.run(tag + "-host", spec, sets + ['memory.limit="4GiB"'], extra=steps)
        if p.rc != 0:
            rows.append(failure(f"offload speed: {name}", "completes under 4 GiB", p))
            continue
        rows.append(judge_offload_speed(name, records_of(base), records_of(out), summary_of(out), 4 * GiB,
                                        SPEED_WARMUP, target, VIT_L16_PARAMETERS))
    return rows


def check_info(r, probe):
    p = r.mt("info", ["info", "--json"])
    if p.rc != 0:
        return [failure("info vs torch.cuda", "memtrain info --json runs", p)]
    return [judge_info(json.loads(p.stdout), probe)]


def check_backoff(r, probe):
    p, out = r.run("backoff", DIGITS, big() + ['memory.on_oom=["backoff","fail"]'])
    if p.rc != 0:
        return [failure("OOM backoff (1 GiB cap)", "completes", p)]
    return [judge_backoff(summary_of(out), 1024)]


BN_RETRY_TRIES = 5
BN_RETRY_CAP = "a cap under which the first step fails at 64 and the run completes at 32"


def check_setup_oom(r, probe):
    # 64 x 500,000 + 500,000 x 250 weights: 630 MB, built on the host, moved under a 256 MiB cap.
    p, _ = r.run("setup-oom", DIGITS, [dev(), "model.mlp.hidden=[500000, 250]", 'memory.limit="256MiB"'])
    return [judge_setup_oom(p.rc, p.stderr)]


def check_bn_retry(r, probe):
    # A cap under which the first step fails at micro-batch 64 and 32 x 2 fits, searched for
    # between the two runs' peaks (bn_retry_bounds, bn_retry_verdict).
    spec = spec_file(r, "bn-retry", RESNET.format(device=DEVICE))
    sets = ["train.epochs=1", "checkpoint.every_epochs=1", "train.batch_size=64", "log.every_steps=1"]
    halved = ["train.batch_size=32", "train.accumulation_steps=2"]
    p64, o64 = r.run("bn-64", spec, sets, env=DETERMINISTIC_ENV)
    p32, o32 = r.run("bn-32", spec, sets + halved, env=DETERMINISTIC_ENV)
    if p64.rc != 0 or p32.rc != 0:
        return [failure(BN_RETRY, "completes", p64 if p64.rc else p32)]
    bounds, why = bn_retry_bounds(records_of(o64), records_of(o32))
    if bounds is None:
        return [Check(BN_RETRY, "micro-batch 64's first step needs more than 32 x 2", why, False)]
    low, high, cap = bounds
    tries = []
    for i in range(BN_RETRY_TRIES):
        pc, oc = r.run(f"bn-capped-{i + 1}", spec, sets + [f"memory.limit={cap}", 'memory.on_oom=["backoff","fail"]'],
                       env=DETERMINISTIC_ENV)
        verdict = bn_retry_verdict(pc.rc, records_of(oc), summary_of(oc), 64)
        tries.append(f"{size(cap)}: {verdict}")
        if verdict == "ok":
            break
        if verdict == "high" and pc.rc != 0:
            return [failure(BN_RETRY, "completes or runs out of memory in its first step", pc)]
        low, high = (low, cap) if verdict == "high" else (cap, high)
        cap = low + (high - low) // 2
        if not low < cap < high:
            return [Check(BN_RETRY, BN_RETRY_CAP, "no cap left between the bounds; caps tried: " + ", ".join(tries), False)]
    else:
        return [Check(BN_RETRY, BN_RETRY_CAP, "caps tried: " + ", ".join(tries), False)]
    state = [final_model_bytes(o) for o in (oc, o32)]
    if None in state:
        return [Check(BN_RETRY, "a final checkpoint on both sides", f"checkpoints found: {[s is not None for s in state]}", False)]
    row = judge_bn_retry(summary_of(oc), batchnorm_state(state[0]), batchnorm_state(state[1]), 64)
    row.seen += f"; cap {tries[-1].split(':')[0]} ({len(tries)} tried)"
    return [row]


def check_cpu_fallback(r, probe):
    p, out = r.run("cpu", DIGITS, big() + ['memory.on_oom=["cpu"]'])
    if p.rc != 0:
        return [failure("OOM CPU fallback", "completes", p)]
    return [judge_cpu_fallback(summary_of(out))]


def read_pickle(path):
    """A pickled snapshot, or None where there is none to read."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except Exception:
        return None


def check_snapshot(r, probe):
    p, out = r.run("fail", DIGITS, big() + ['memory.on_oom=["fail"]', "memory.record_history=true"])
    report = None
    if os.path.exists(os.path.join(out, "oom", "report.json")):
        report = read_json(os.path.join(out, "oom", "report.json"))
    if p.rc not in (0, 3):
        return [failure("OOM snapshot vs reserved", "exit 3", p), failure("end snapshot", "exit 3", p)]
    snapshot = read_pickle(os.path.join(out, "oom", "snapshot.pickle"))
    end = read_pickle(os.path.join(out, "snapshot.pickle"))
    return [judge_snapshot(p.rc, report, snapshot), judge_end_snapshot(snapshot, end)]


def check_fp16_inf(r, probe):
    p, out = r.run("fp16", DIGITS, [dev(), 'train.precision="fp16-mixed"'], extra=["--max-steps", "6"],
                   env={"MEMTRAIN_FAULT_INF_GRAD_AT_STEP": "3"})
    if p.rc != 0:
        return [failure("fp16 inf: skip + halve", "completes", p)]
    return [judge_inf_step(records_of(out), summary_of(out), 3)]


def check_recompute(r, probe):
    rows = []
    for model, text in (("resnet18", RESNET.format(device=DEVICE)),
                        ("vit", VIT.format(device=DEVICE, dropout=0.0, samples=640, epochs=1))):
        spec = spec_file(r, model, text)
        runs = {}
        for ckpt in ("false", "true"):
            p, out = r.run(f"{model}-ckpt-{ckpt}", spec, [f"train.activation_checkpointing={ckpt}"],
                           extra=["--max-steps", "4"])
            runs[ckpt] = (p, out)
        bad = [p for p, _ in runs.values() if p.rc != 0]
        if bad:
            rows.append(failure(f"recompute {model}", "both runs complete", bad[0]))
            continue
        (_, plain), (_, ckpt) = runs["false"], runs["true"]
        rows.append(judge_recompute(model, records_of(plain), summary_of(plain), records_of(ckpt), summary_of(ckpt)))
    return rows


def check_async_cap(r, probe):
    p, out = r.run("async", DIGITS, big() + ['memory.on_oom=["backoff","fail"]'],
                   env={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync", "PYTORCH_ALLOC_CONF": ""})
    if p.rc != 0:
        return [failure("cudaMallocAsync cap", "completes", p)]
    recs = records_of(out)
    start = (of_type(recs, "start") or [None])[0]
    return [judge_async_cap(start, summary_of(out), 1024)]


def smi(args):
    try:
        p = subprocess.run(["nvidia-smi"] + args, capture_output=True, text=True, timeout=20)
        return p.stdout if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def check_fit(r, probe):
    name = "fit vs nvidia-smi"
    if shutil.which("nvidia-smi") is None:
        return [Check(name, "nvidia-smi on PATH", "nvidia-smi not found", False)]
    sets = [dev(), "model.mlp.hidden=[131072]", "train.batch_size=256", "train.epochs=1"]
    args = ["fit", DIGITS]
    for s in sets:
        args += ["--set", s]
    args += ["--limit", "512MiB", "--steps", "2", "--precision", "fp32", "--checkpointing", "off", "--json"]
    p = r.mt("fit", args)
    if p.rc != 0:
        return [failure(name, "fit recommends", p)]
    fit = json.loads(p.stdout)
    rec = fit.get("recommendation") or {}
    if not rec:
        return [judge_fit(fit, None, None, "")]
    baseline = parse_smi_used(smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]) or "")
    out = r.path("fit-run")
    argv = [r.bin, "run", DIGITS, "--out", out, "--max-steps", "40"]
    for s in sets + [f"train.batch_size={rec['batch_size']}", f"train.accumulation_steps={rec['accumulation_steps']}",
                     'memory.limit="512MiB"', 'log.progress="off"', "train.epochs=10"]:
        argv += ["--set", s]
    t = r.timeout()
    with open(r.path("fit-run.log"), "w") as log:
        child = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=r.env())
        per_pid, device = None, None
        end = time.time() + t
        while child.poll() is None and time.time() < end:
            apps = parse_smi_apps(smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]) or "")
            if child.pid in apps:
                per_pid = max(per_pid or 0, apps[child.pid])
            used = parse_smi_used(smi(["--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"]) or "")
            if used is not None and baseline is not None:
                device = max(device or 0, used - baseline)
            time.sleep(0.1)
        if child.poll() is None:
            child.kill()
        rc = child.wait()
    with open(r.path("fit-run.log")) as log:
        r.note_stderr("fit-run", argv, None, log.read())
    if rc != 0:
        return [Check(name, "the recommendation runs", f"exit {rc} (log {r.path('fit-run.log')})", False)]
    if per_pid is not None:
        seen, how = per_pid, "its process"
    else:
        seen, how = device, "device used less the baseline"
    return [judge_fit(fit, summary_of(out), seen, how)]


def check_fit_graph(r, probe):
    # The digits MLP at an effective batch of 32: small enough that its step is bound by
    # launches, where capture pays; fp32 alone keeps the search to about a dozen probes.
    sets = [dev(), 'train.cuda_graph="auto"', "train.epochs=1"]
    tuned = r.path("fit-graph.toml")
    args = ["fit", DIGITS]
    for s in sets:
        args += ["--set", s]
    args += ["--limit", "2GiB", "--steps", "4", "--precision", "fp32", "--checkpointing", "off", "--json",
             "--write", tuned]
    p = r.mt("fit-graph", args)
    if p.rc != 0:
        return [failure(FIT_GRAPH_ROW, "fit recommends", p)]
    fit = json.loads(p.stdout)
    q, out = r.run("fit-graph-run", tuned, ["log.every_steps=1"], extra=["--max-steps", "20"])
    return [judge_fit_graph(fit, q.rc, records_of(out), summary_of(out))]


def check_resume(r, probe):
    name = "CUDA resume (rng)"
    spec = spec_file(r, "vit-dropout", VIT.format(device=DEVICE, dropout=0.1, samples=320, epochs=2))
    p, whole = r.run("whole", spec, [])
    if p.rc != 0:
        return [failure(name, "the uncut run completes", p)]
    cut = r.path("cut")
    argv = [r.bin, "run", spec, "--out", cut]
    p, seen = r.spawn_until("cut", argv, "fault: waiting for a signal at step 5",
                            env={"MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP": "5"})
    if not seen:
        return [failure(name, "the run reaches step 5", p)]
    ckpts = sorted(os.listdir(os.path.join(cut, "checkpoints"))) if os.path.isdir(os.path.join(cut, "checkpoints")) else []
    steps = [c for c in ckpts if c.startswith("step-")]
    keys = []
    if steps:
        keys = [k for k in safetensors_keys(os.path.join(cut, "checkpoints", steps[-1], "optimizer.safetensors"))
                if k.startswith("rng/")]
    q = r.mt("resume", ["run", spec, "--resume", cut])
    if q.rc != 0:
        return [failure(name, "the resumed run completes", q)]
    return [judge_resume(records_of(whole), records_of(cut), p.rc, keys, f"rng/{DEVICE}")]


def check_expandable(r, probe):
    sets = [dev(), "model.mlp.hidden=[65536]", "train.batch_size=512", "train.epochs=1",
            "memory.allocator.expandable_segments=true", "memory.cache_clear_every=1"]
    p, out = r.run("expandable", DIGITS, sets)
    if p.rc != 0:
        return [failure("expandable segments clear", "completes", p)]
    recs = records_of(out)
    return [judge_expandable((of_type(recs, "start") or [None])[0], recs, summary_of(out))]


def check_host_reads(r, probe):
    rows = []
    for fp16 in (False, True):
        sets = [dev(), "train.epochs=1", "log.every_steps=4"]
        if fp16:
            sets.append('train.precision="fp16-mixed"')
        name = "host reads " + ("fp16-mixed" if fp16 else "fp32")
        p, out = r.run("reads-fp16" if fp16 else "reads", DIGITS, sets)
        if p.rc != 0:
            rows.append(failure(name, "completes", p))
            continue
        rows.append(judge_host_reads(records_of(out), summary_of(out), fp16))
    return rows


# memtrain's train.optimizer_impl -> the torch.optim implementation it is compared with.
OPTIMIZER_IMPLS = [("single", "single"), ("foreach", "foreach"), ("fused", "fused"), ("auto", "default")]


def check_optimizers(r, probe):
    sys.path.insert(0, os.path.join(HERE, "bench"))
    try:
        import numpy  # noqa: F401  (the job's data and the PyTorch side's data order need it)

        import driver
        import jobs
    except ImportError as e:
        return [Check(f"optimizer {i}", "torch.optim comparison", f"cannot import the bench helpers: {e}", False)
                for i, _ in OPTIMIZER_IMPLS]
    work = r.path("optim")
    steps = "10"
    try:
        driver.prepare_job("mlp", work)
    except Exception as e:
        return [Check(f"optimizer {i}", "torch.optim comparison", f"preparing the job failed: {e}", False)
                for i, _ in OPTIMIZER_IMPLS]
    files = {k: os.path.join(work, f"{k}.safetensors" if k == "init" else f"{k}.npz") for k in ("init", "data", "val")}
    spec = spec_file(r, "optim", jobs.memtrain_spec("mlp", files["init"], files["data"], files["val"], "fp32", False,
                                                     2, DEVICE))
    rows = []
    for impl, theirs in OPTIMIZER_IMPLS:
        name = f"optimizer {impl}"
        p, out = r.run(f"optim-{impl}", spec, [f'train.optimizer_impl="{impl}"'], extra=["--max-steps", steps])
        if p.rc != 0:
            missing = "unknown field `optimizer_impl`" in p.stderr
            seen = f"binary has no train.optimizer_impl (exit {p.rc}: unknown field)" if missing else p.why()
            rows.append(Check(name, "memtrain trains with it", seen, False))
            continue
        result = r.path(f"torch-{impl}.json")
        q = r.cmd([r.python, os.path.join(HERE, "bench", "pytorch_job.py"), "train", "--job", "mlp", "--init",
                   files["init"], "--data", files["data"], "--steps", steps, "--device", DEVICE, "--threads", "2",
                   "--optimizer-impl", theirs, "--result", result], log=f"torch-{impl}")
        if q.rc != 0:
            rows.append(failure(name, "torch.optim trains", q))
            continue
        rows.append(judge_optimizer(impl, theirs, step_losses(records_of(out)), read_json(result)["losses"]))
    return rows


def check_single_rank(r, probe):
    name = "NCCL one-rank group"
    p, plain = r.run("plain", DIGITS, [dev(), "train.epochs=1"])
    if p.rc != 0:
        return [failure(name, "the plain run completes", p)]
    q, group = r.run("group", DIGITS, [dev(), "train.epochs=1"], env={"MEMTRAIN_TEST_SINGLE_RANK_GROUP": "1"})
    if q.rc != 0:
        note = " (binary built without NCCL)" if "without NCCL" in q.stderr else ""
        return [Check(name, "a one-rank NCCL group trains", q.why() + note, False)]
    backend = "NCCL" if DEVICE == "cuda" else "Gloo"
    return [judge_single_rank(records_of(plain), records_of(group), summary_of(group), q.stderr, backend)]


def check_group_oom(r, probe):
    sets = big() + ['memory.on_oom=["backoff","fail"]']
    backend = "NCCL" if DEVICE == "cuda" else "Gloo"
    p, plain = r.run("group-oom-plain", DIGITS, sets)
    if p.rc != 0:
        return [failure(f"{backend} group backs off", "the run without a group completes", p)]
    q, group = r.run("group-oom", DIGITS, sets, env={"MEMTRAIN_TEST_SINGLE_RANK_GROUP": "1"})
    if q.rc != 0:
        return [failure(f"{backend} group backs off", "completes", q)]
    return [judge_group_oom(summary_of(plain), summary_of(group), records_of(plain), records_of(group), backend)]


# An MLP whose first weight is all but the whole model: 8192 x 8192 fp32, P = 256 MiB. The
# weights and Adam's state (3P) are made at set-up and the gradients (P) in the first backward;
# the first update then asks for its workspace (foreach Adam: one temporary the size of the
# largest parameter, P). The cap, 4P + P/2, holds the first 4P with room for the activations,
# the data and cuBLAS's workspace (tens of MiB) but not the update's: at that OOM what is held
# with the workspace is over the cap, which is how memtrain tells an OOM of the static bill
# (no micro-batch makes room). With the state on the host the device holds about 2P.
STATIC_BILL_MLP = (8192, 8192)
STATIC_BILL = """[job]
name = "gpu-check-static-bill"
device = "{device}"
[model]
preset = "mlp"
[model.mlp]
inputs = {inputs}
hidden = [{hidden}]
num_classes = 4
[data]
samples = 64
[train]
epochs = 1
batch_size = 16
optimizer = "adam"
lr = 0.001
[log]
progress = "off"
[memory]
limit = "{limit}MiB"
"""


def static_bill_spec(r):
    inputs, hidden = STATIC_BILL_MLP
    params = inputs * hidden + hidden + hidden * 4 + 4
    limit = -(-(18 * params) // MiB)  # 4P + P/2 (P = 4 bytes a parameter), in MiB, rounded up
    return spec_file(r, "static-bill", STATIC_BILL.format(device=DEVICE, inputs=inputs, hidden=hidden, limit=limit))


def check_static_bill(r, probe):
    spec = static_bill_spec(r)
    p, out = r.run("static-bill-offload", spec, ['memory.on_oom=["backoff","offload","fail"]'])
    rows = [judge_static_offload(p.rc, records_of(out), summary_of(out), 16)]
    q, failed = r.run("static-bill-fails", spec, ['memory.on_oom=["backoff","fail"]'])
    rows.append(judge_static_advice(q.rc, records_of(failed), q.stderr))
    return rows


def check_advice_resume(r, probe):
    spec = static_bill_spec(r)
    p, out = r.run("advice-fails", spec, ['memory.on_oom=["backoff","fail"]'])
    ways = advice_ways(p.stderr)
    if p.rc != 3 or not ways:
        return [judge_advice_resume(p.rc, ways[0] if ways else None, None, [], None)]
    # The advice's first way, word for word, as `--set` takes it.
    q = r.mt("advice-resume", ["run", spec, "--resume", out, "--set", ways[0]])
    return [judge_advice_resume(p.rc, ways[0], q.rc, records_of(out), summary_of(out))]


def check_collective_oom(r, probe):
    backend = "NCCL" if DEVICE == "cuda" else "Gloo"
    env = {"MEMTRAIN_TEST_SINGLE_RANK_GROUP": "1", "MEMTRAIN_FAULT_OOM_IN_COLLECTIVE_AT_STEP": "2"}
    p, out = r.run("collective-oom", DIGITS, [dev(), "train.epochs=1"], env=env)
    return [judge_collective_oom(p.rc, records_of(out), p.stderr, 2, backend)]


def check_darts(r, probe):
    # configs/darts_4gb.toml sets memory.fraction, which memtrain refuses beside memory.limit
    # (and --set cannot remove a key), so the check runs a copy without that line.
    with open(os.path.join(ROOT, "configs", "darts_4gb.toml")) as f:
        text = "".join(l for l in f if not re.match(r"\s*fraction\s*=", l))
    spec = spec_file(r, "darts_4gb", text)
    p, out = r.run("darts", spec, ['memory.limit="4GiB"', "train.epochs=1", "data.samples=20", dev()])
    if p.rc != 0:
        return [failure("darts_4gb under 4 GiB", "completes", p)]
    return [judge_darts_cap(summary_of(out), 4 * GiB)]


def final_model_bytes(out):
    ck = os.path.join(out, "checkpoints")
    steps = sorted(d for d in os.listdir(ck) if d.startswith("step-")) if os.path.isdir(ck) else []
    if not steps:
        return None
    with open(os.path.join(ck, steps[-1], "model.safetensors"), "rb") as f:
        return f.read()


def check_eval_oom(r, probe):
    # Training at 64 samples fits the 1 GiB cap; validating all 359 held-out samples at once
    # (a 262144-wide activation of 1 MiB per sample, twice) does not.
    common = ["model.mlp.hidden=[262144]", "train.batch_size=64", "train.epochs=1", 'memory.limit="1GiB"', dev()]
    p, clean = r.run("eval_clean", DIGITS, common + ["train.eval_batch_size=64"])
    if p.rc != 0:
        return [failure("validation OOM (1 GiB cap)", "completes", p)]
    p, hit = r.run("eval_hit", DIGITS, common + ["train.eval_batch_size=512"])
    if p.rc != 0:
        return [failure("validation OOM (1 GiB cap)", "completes", p)]
    a, b = final_model_bytes(clean), final_model_bytes(hit)
    return [judge_eval_oom(summary_of(clean), summary_of(hit), records_of(clean), records_of(hit),
                           a is not None and a == b, 512)]


def check_cache_clear(r, probe):
    p, out = r.run("cache", DIGITS, ["memory.cache_clear_every=1", "train.epochs=2", dev()])
    if p.rc != 0:
        return [failure("cache clear cost", "completes", p)]
    return [judge_cache_clear_cost(summary_of(out))]


# The settings both sides of a twin comparison run under: libtorch's deterministic algorithms
# (memtrain's test hook; PyTorch's --deterministic sets the same), and the cuBLAS workspace that
# deterministic cuBLAS needs, read when its first handle is made.
DETERMINISTIC_ENV = {"MEMTRAIN_TEST_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
TWINS = [("darts", "darts"), ("vit", "vit")]  # row name -> scripts/bench/jobs.py job


def twin_row(r, model, job, driver, jobs):
    """One twin comparison: memtrain and scripts/bench/pytorch_job.py from the same weights, data
    and order, 10 fp32 steps each on DEVICE."""
    name = f"{DEVICE.upper()} vs PyTorch {model}"
    work = r.path(f"twin-{job}")
    try:
        driver.prepare_job(job, work)
    except Exception as e:
        return Check(name, "PyTorch twin comparison", f"preparing the job failed: {e}", False)
    files = {k: os.path.join(work, f"{k}.safetensors" if k == "init" else f"{k}.npz") for k in ("init", "data", "val")}
    spec = spec_file(r, f"twin-{job}", jobs.memtrain_spec(job, files["init"], files["data"], files["val"], "fp32",
                                                          False, 1, DEVICE, saves=False))
    p, out = r.run(f"twin-{job}", spec, [], extra=["--max-steps", "10"], env=DETERMINISTIC_ENV)
    if p.rc != 0:
        return failure(name, "memtrain trains", p)
    result = r.path(f"twin-torch-{job}.json")
    q = r.cmd([r.python, os.path.join(HERE, "bench", "pytorch_job.py"), "train", "--job", job, "--init", files["init"],
               "--data", files["data"], "--val", files["val"], "--steps", "10", "--device", DEVICE, "--threads", "1",
               "--deterministic", "--result", result], env=DETERMINISTIC_ENV, log=f"twin-torch-{job}")
    if q.rc != 0:
        return failure(name, "PyTorch trains", q)
    return judge_twin(model, step_losses(records_of(out)), read_json(result)["losses"])


def check_twins(r, probe):
    sys.path.insert(0, os.path.join(HERE, "bench"))
    try:
        import numpy  # noqa: F401  (the jobs' data)

        import driver
        import jobs
    except ImportError as e:
        return [Check(f"{DEVICE.upper()} vs PyTorch {m}", "PyTorch twin comparison",
                      f"cannot import the bench helpers: {e}", False) for m, _ in TWINS]
    return [twin_row(r, model, job, driver, jobs) for model, job in TWINS]


def check_step_time(r, probe):
    # ResNet18 at 128 px, micro-batch 64: the GPU, not the host, sets the pace, so a step timed
    # before its loss read would fall well short of the wall time.
    spec = spec_file(r, "step-time", RESNET.format(device=DEVICE))
    p, out = r.run("step-time", spec, ["train.epochs=2", "log.every_steps=1", "checkpoint.every_epochs=0"])
    if p.rc != 0:
        return [failure("step seconds vs wall time", "completes", p)]
    records, summary = records_of(out), summary_of(out)
    return [judge_step_time(records, summary), judge_requested(records, summary)]


def check_loader(r, probe):
    # Augmented data is never kept on the device: every batch is made on the host and copied.
    spec = spec_file(r, "loader", RESNET.format(device=DEVICE))
    sets = ["data.augment.horizontal_flip=true", "data.augment.crop_padding=8", "log.every_steps=1",
            "checkpoint.every_epochs=0"]
    runs = {}
    for name, extra in (("loader-plain", ["data.prefetch=0"]), ("loader-ahead", ["data.prefetch=3", "data.workers=4"])):
        p, out = r.run(name, spec, sets + extra, env=DETERMINISTIC_ENV)
        if p.rc != 0:
            return [failure("loader on the device", f"{name} completes", p)]
        runs[name] = records_of(out)
    return [judge_loader(runs["loader-plain"], runs["loader-ahead"])]


def check_step_syncs(r, probe):
    # The 6-block ViT, 8 steps of an epoch of 16 (no epoch end, whose validation reads): after
    # step 3 (the preflight and the first steps are done) libtorch fails every synchronizing call.
    spec = spec_file(r, "syncs", VIT.format(device=DEVICE, dropout=0.0, samples=640, epochs=1))
    env = {"MEMTRAIN_FAULT_CUDA_SYNC_ERROR_AFTER_STEP": "3", "TORCH_SHOW_CPP_STACKTRACES": "1"}
    p, out = r.run("syncs", spec, ["log.every_steps=1"], extra=["--max-steps", "8"], env=env)
    rows = [judge_step_syncs(p.rc, p.stderr, records_of(out), 8)]
    # ResNet18, 10 steps an epoch: BatchNorm's buffers, whose copy for a retry goes to the host
    # every step.
    spec = spec_file(r, "syncs-resnet", RESNET.format(device=DEVICE))
    p, out = r.run("syncs-resnet", spec, ["log.every_steps=1", "data.samples=800"], extra=["--max-steps", "8"], env=env)
    return rows + [judge_step_syncs(p.rc, p.stderr, records_of(out), 8, "resnet18")]


def check_no_warnings(r, probe):
    # Judges every memtrain run the checks before it made; alone (--only), it makes one.
    if not r.stderrs:
        r.run("warnings", DIGITS, [dev(), "train.epochs=1"])
    return [judge_no_warnings(r.stderrs)]


RESIDENT_NAN = "resident set: NaN named"


def write_nan_safetensors(path, n=64, bad=5):
    """A float32 set `x` [n, 8, 8] (0.5 everywhere, NaN in sample `bad`) and int64 labels `y`
    of 10 classes, as a .safetensors file, which memtrain reads in place (mapped)."""
    x = [0.5] * (n * 64)
    x[bad * 64 + 3] = float("nan")
    xb = struct.pack(f"<{len(x)}f", *x)
    yb = struct.pack(f"<{n}q", *[i % 10 for i in range(n)])
    header = {
        "x": {"dtype": "F32", "shape": [n, 8, 8], "data_offsets": [0, len(xb)]},
        "y": {"dtype": "I64", "shape": [n], "data_offsets": [len(xb), len(xb) + len(yb)]},
    }
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + xb + yb)


def judge_resident_nan(rc, stderr, path, bad=5):
    """A mapped float32 set is checked for NaN as it is read; kept resident on the GPU, it is
    read when copied there, and the first batch names the file and the sample."""
    want = f"data.path {path}: x contains NaN or infinite values (sample {bad},"
    expected = f"exit 1-3 naming {want!r}, no panic"
    line = next((l for l in stderr.splitlines() if "NaN" in l), stderr.strip()[-300:])
    ok = rc in (1, 2, 3) and want in stderr and "panicked" not in stderr
    return Check(RESIDENT_NAN, expected, f"exit {rc}; {line[:300]}", ok)


def check_resident_nan(r, probe):
    path = r.path("nan.safetensors")
    write_nan_safetensors(path)
    sets = [dev(), 'data.source="safetensors"', f'data.path="{path}"', "data.val_fraction=0.25", "train.epochs=1"]
    p, _ = r.run("resident-nan", DIGITS, sets)
    return [judge_resident_nan(p.rc, p.stderr, path)]


FINETUNE = "frozen + groups, then eval"


def judge_finetune(rc, summary, eval_rc, report):
    """Frozen parameters and two parameter groups train with the fused AdamW on the device, and
    `memtrain eval` of the run, on the device under its cap, gives the run's own validation
    accuracy and loss."""
    expected = "exit 0; fc0 frozen, 2 groups; eval = the run's val acc and loss"
    if rc != 0 or not summary:
        return Check(FINETUNE, expected, f"run exit {rc}", False)
    t = summary.get("training") or {}
    last = summary.get("final") or {}
    frozen, groups = t.get("frozen_parameters", 0), len(t.get("groups") or [])
    if eval_rc != 0 or not report:
        return Check(FINETUNE, expected, f"{frozen} frozen, {groups} groups; eval exit {eval_rc}", False)
    acc, loss = report.get("accuracy"), report.get("loss")
    same_acc = acc is not None and last.get("val_acc") is not None and abs(acc - last["val_acc"]) < 1e-9
    same_loss = loss is not None and last.get("val_loss") is not None and abs(loss - last["val_loss"]) <= 1e-5 * max(1.0, abs(last["val_loss"]))
    seen = f"{frozen} frozen, {groups} groups; eval acc {acc} loss {loss} vs run {last.get('val_acc')} {last.get('val_loss')}"
    return Check(FINETUNE, expected, seen, frozen > 0 and groups >= 2 and same_acc and same_loss)


def check_finetune(r, probe):
    sets = [dev(), "train.epochs=2", 'train.optimizer="adamw"', 'train.optimizer_impl="fused"',
            'train.freeze=["fc0.*"]', "train.no_decay=true",
            'train.param_groups=[{match=["fc1.*"], lr_scale=2.0}]']
    p, out = r.run("finetune", DIGITS, sets)
    report_path = os.path.join(out, "eval-check.json")
    e = r.mt("finetune-eval", ["eval", out, "--json", report_path]) if p.rc == 0 else p
    report = read_json(report_path) if os.path.exists(report_path) else None
    return [judge_finetune(p.rc, summary_of(out), e.rc, report)]


LLAMA_GENERATE = "llama trains, then generates"
SENTENCE = "one two three four five six seven eight"


def word_tokenizer(path):
    """A word-level tokenizer.json of SENTENCE's words after <unk> = 0 and </s> = 1."""
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate(SENTENCE.split())}}
    t = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
         "pre_tokenizer": {"type": "Whitespace"}, "post_processor": None, "decoder": None,
         "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}}
    with open(path, "w") as f:
        json.dump(t, f)


def judge_llama_generate(rc, summary, gen_rc, text):
    """A small decoder trained on one repeated sentence on the device (the chunked next-token loss)
    continues it through its key/value cache and stops at the end-of-text token."""
    want = "three four five six seven eight"
    ok = rc == 0 and gen_rc == 0 and (text or "").strip() == want and str((summary or {}).get("device", "")) == DEVICE
    seen = (f"train exit {rc}, final train loss {get(summary, 'final.train_loss')}, perplexity "
            f"{get(summary, 'final.train_perplexity')}; generate exit {gen_rc}: {(text or '').strip()!r}")
    return Check(LLAMA_GENERATE, f"on {DEVICE}: generate prints {want!r}", seen, ok)


def check_llama_generate(r, probe):
    data, tok = r.path("sentence.jsonl"), r.path("words.json")
    word_tokenizer(tok)
    with open(data, "w") as f:
        f.write("\n".join(json.dumps({"text": SENTENCE}) for _ in range(300)) + "\n")
    spec = spec_file(r, "llama_small", f"""[job]
name = "gpu-check-llama"
[model]
preset = "llama"
[model.llama]
vocab_size = 16
hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
max_position_embeddings = 64
[data]
source = "jsonl"
path = "{data}"
tokenizer = "{tok}"
text_field = "text"
seq_len = 16
[train]
epochs = 3
batch_size = 8
optimizer = "adamw"
lr = 0.01
[log]
progress = "off"
""")
    p, out = r.run("llama_small", spec, [dev()])
    g = r.mt("llama_generate", ["generate", out, "--prompt", "three four", "--max-new-tokens", "10"]) if p.rc == 0 else p
    return [judge_llama_generate(p.rc, summary_of(out), g.rc, g.stdout if p.rc == 0 else None)]


# A Llama-3.1-8B shape: bf16 base streamed from host memory, rank-16 LoRA on every projection,
# seq_len 2048, under a 12 GiB cap with no quantisation (the rehearsal shrinks it).
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                seq_len=2048, cap=12 * GiB, steps=4)
LLAMA_8B_ROW = "Llama-8B LoRA, bf16 base streamed, under 12 GiB"
LLAMA_8B_GENERATE = "Llama-8B generate, layers streamed, under 12 GiB"
# The streamed run's generate: token ids in (the run has no tokenizer), a few greedy tokens out.
LLAMA_8B_PROMPT, LLAMA_8B_NEW = "1 2 3 4", 4


def streamed_run(rc, records, summary, cap):
    """A streamed language-model run: whether it completed under `cap` with finite losses and
    its weights in host memory, what was seen, and its losses."""
    steps = of_type(records, "step")
    losses = [s.get("loss") for s in steps]
    finite = bool(losses) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses)
    key = "memory.peak_reserved_bytes" if DEVICE == "cuda" else "memory.peak_allocated_bytes"
    peak, host = get(summary, key), get(summary, "memory.peak_host_bytes")
    secs = sorted(s["seconds"] for s in steps[1:]) or [None]
    ok = rc == 0 and finite and isinstance(peak, int) and peak <= cap and isinstance(host, int) and host > 0
    seen = (f"exit {rc}, {len(steps)} steps, losses {[round(x, 3) for x in losses if isinstance(x, float)]}, "
            f"peak {size(peak)} ({key.split('.')[-1]}), host {size(host)}, median step {secs[len(secs) // 2]} s")
    return ok, seen, losses if finite else []


def judge_llama_streamed(rc, records, summary, cap):
    ok, seen, _ = streamed_run(rc, records, summary, cap)
    return Check(LLAMA_8B_ROW, f"trains with its base on the host, device peak <= {size(cap)}", seen, ok)


def llama_tokens(r, name, t, windows=8):
    """A token file of `t`'s vocabulary with `windows` windows of its seq_len, and `t`'s sizes as
    `[model.llama]` lines."""
    import array

    n = t["seq_len"] + 1
    data = r.path(f"tokens-{name}.bin")
    with open(data, "wb") as f:
        array.array("I", [(i * 7919) % t["vocab_size"] for i in range(windows * n)]).tofile(f)
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings")
    return data, "\n".join(f"{k} = {t[k]}" for k in keys)


LLAMA_8B_FLOOR_ROW = "Llama-8B streamed step vs two base transfers"
LLAMA_8B_FLOOR_TARGET = 1.5


def streamed_bytes(t, bytes_per=2):
    """What one pass streams, in bf16: every decoder layer's weights (attention, SwiGLU MLP, two
    norms), and an untied model's input embedding, the chain's first block. The output
    projection (tied: the embedding itself) stays on the device."""
    h, i = t["hidden_size"], t["intermediate_size"]
    kv = h // t["num_attention_heads"] * t["num_key_value_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
    embedding = 0 if t.get("tie_word_embeddings") else t["vocab_size"] * h
    return (per_layer * t["num_hidden_layers"] + embedding) * bytes_per


H2D_PROBE = """
import json, torch
n = 1 << 30
src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
dst = torch.empty(n, dtype=torch.uint8, device="cuda")
secs = []
for _ in range(6):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(); dst.copy_(src, non_blocking=True); b.record(); b.synchronize()
    secs.append(a.elapsed_time(b) / 1000)
secs = sorted(secs[1:])
print(json.dumps({"gbps": n / secs[len(secs) // 2] / 1e9}))
"""


def h2d_bandwidth(r):
    """GB/s of one pinned 1 GiB host-to-device copy (median of five after one warm-up), measured
    by torch in a child process; None where it could not be measured."""
    p = r.cmd([r.python, "-c", H2D_PROBE], log="h2d_bandwidth")
    try:
        return float(json.loads(p.stdout.strip().splitlines()[-1])["gbps"]) if p.rc == 0 else None
    except (ValueError, KeyError, IndexError):
        return None


def judge_llama_streamed_floor(records, streamed_bytes, gbps, target=LLAMA_8B_FLOOR_TARGET):
    """A streamed base crosses the bus twice a step (forward, and backward's recomputed pass),
    whatever the batch: the step's median seconds (after the first) over that floor, at the
    bandwidth measured on this machine, must be at most `target`."""
    secs = sorted(s["seconds"] for s in of_type(records, "step")[1:] if isinstance(s.get("seconds"), (int, float)))
    floor = 2 * streamed_bytes / (gbps * 1e9) if gbps else None
    median = secs[len(secs) // 2] if secs else None
    ratio = median / floor if median and floor else None
    seen = (f"median step {median:.3f} s over {len(secs)} steps" if median else "no timed step") \
        + (f"; floor {floor:.3f} s (2 x {size(streamed_bytes)} at {gbps:.1f} GB/s)" if floor else "; bandwidth not measured") \
        + (f" = {ratio:.2f}x (target <= {target:.2f}x)" if ratio else "")
    return Check(LLAMA_8B_FLOOR_ROW, f"a step within {target:.2f}x two transfers of the streamed layers", seen,
                 ratio is not None and ratio <= target)


def judge_llama_streamed_generate(rc, text, new, why=""):
    """generate on the streamed run, with its spec's cap: the layers stream from the host as they
    did in training (the whole model would not fit), and it prints the prompt and `new` ids."""
    prompt, _, added = (text or "").strip().partition(" | ")
    ids = added.split()
    ok = rc == 0 and prompt == LLAMA_8B_PROMPT and len(ids) == new and all(i.isdigit() for i in ids)
    seen = f"exit {rc}: {(text or '').strip()[-200:]!r}" + (f" ({why})" if rc != 0 and why else "")
    return Check(LLAMA_8B_GENERATE, f"exit 0 and {new} new token ids after the prompt", seen, ok)


def check_llama_streamed(r, probe):
    t = dict(LLAMA_8B)
    # One window a step and one held out: the epoch ends after the steps, with a checkpoint.
    data, sizes = llama_tokens(r, "8b", t, windows=t["steps"] + 1)
    spec = spec_file(r, "llama_8b", f"""[job]
name = "gpu-check-llama-8b"
[model]
preset = "llama"
[model.llama]
{sizes}
rope_theta = 500000.0
[model.llama.rope_scaling]
rope_type = "llama3"
factor = 8.0
[model.lora]
rank = 16
alpha = 32.0
targets = ["q", "k", "v", "o", "gate", "up", "down"]
[data]
source = "tokens"
path = "{data}"
token_dtype = "uint32"
seq_len = {t["seq_len"]}
[train]
epochs = 1
batch_size = 1
optimizer = "adamw"
lr = 1e-4
precision = "bf16-mixed"
frozen_dtype = "bf16"
[memory]
limit = "{t["cap"] >> 20}MiB"
parameters = "host"
[checkpoint]
every_epochs = 0
[log]
every_steps = 1
progress = "off"
""")
    p, out = r.run("llama_8b", spec, [dev()])
    if p.rc != 0:
        return [failure(LLAMA_8B_ROW, "completes", p), failure(LLAMA_8B_GENERATE, "a trained run", p),
                failure(LLAMA_8B_FLOOR_ROW, "a trained run", p)]
    g = r.mt("llama_8b_generate", ["generate", out, "--prompt-ids", LLAMA_8B_PROMPT,
                                   "--max-new-tokens", str(LLAMA_8B_NEW), "--ignore-eos"])
    return [judge_llama_streamed(p.rc, records_of(out), summary_of(out), t["cap"]),
            judge_llama_streamed_generate(g.rc, g.stdout, LLAMA_8B_NEW, g.why()),
            judge_llama_streamed_floor(records_of(out), streamed_bytes(t), h2d_bandwidth(r))]


# A Llama-3.2-1B shape (tied embeddings): a full fine-tune in fp32 with AdamW, seq_len 1024,
# under a 4 GiB cap: the layers stream from host memory, the optimizer state and gradients live
# there, and the tied embedding trains on the device (the rehearsal shrinks it).
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                seq_len=1024, cap=4 * GiB, steps=6)
LLAMA_1B_ROW = "Llama-1B full fine-tune fp32, streamed, under 4 GiB"
LLAMA_1B_SPEED_ROW = "Llama-1B streamed vs uncapped with recompute"
LLAMA_1B_SPEED_TARGET = 0.8
# The streamed run recomputes each layer in backward (its weights come back for it), so its twin
# is the all-device run with activation checkpointing and no cap.
LLAMA_1B_TWIN_MEMORY = "[memory]\n"


def judge_llama_full_1b(rc, records, summary, cap):
    ok, seen, losses = streamed_run(rc, records, summary, cap)
    if losses:
        seen += f"; losses {'fell' if losses[-1] < losses[0] else 'did not fall'}"
    return Check(LLAMA_1B_ROW, f"every weight trains, the layers streamed, device peak <= {size(cap)}", seen, ok)


def judge_llama_1b_speed(twin_rc, twin_records, records, target=LLAMA_1B_SPEED_TARGET):
    """Claim 1's speed: the capped, streamed run's samples/s (after its first step) over the
    uncapped all-device run's with the same recomputation."""
    if twin_rc != 0:
        return Check(LLAMA_1B_SPEED_ROW, f">= {target:.2f}x the uncapped run", f"the uncapped twin exited {twin_rc}", False)
    base, rate = wall_rate(twin_records, 1), wall_rate(records, 1)
    ratio = rate / base if base and rate else None
    seen = "-" if ratio is None else f"{rate:.3f} vs {base:.3f} samples/s = {ratio:.2f}x (target {target:.2f}x)"
    return Check(LLAMA_1B_SPEED_ROW, f">= {target:.2f}x the uncapped run's samples/s", seen,
                 ratio is not None and ratio >= target)


def check_llama_full_1b(r, probe):
    t = dict(LLAMA_1B)
    data, sizes = llama_tokens(r, "1b", t)
    streamed = f'[memory]\nlimit = "{t["cap"] >> 20}MiB"\nparameters = "host"\n'
    spec, twin_spec = (spec_file(r, name, llama_1b_spec(t, data, sizes, memory, recompute))
                       for name, memory, recompute in (("llama_1b", streamed, ""),
                                                       ("llama_1b_uncapped", LLAMA_1B_TWIN_MEMORY,
                                                        "activation_checkpointing = true\n")))
    steps = ["--max-steps", str(t["steps"])]
    p, out = r.run("llama_1b", spec, [dev()], extra=steps)
    if p.rc != 0:
        return [failure(LLAMA_1B_ROW, "completes", p), failure(LLAMA_1B_SPEED_ROW, "the capped run completes", p)]
    twin, twin_out = r.run("llama_1b_uncapped", twin_spec, [dev()], extra=steps)
    return [judge_llama_full_1b(p.rc, records_of(out), summary_of(out), t["cap"]),
            judge_llama_1b_speed(twin.rc, records_of(twin_out), records_of(out))]


def llama_1b_spec(t, data, sizes, memory, recompute):
    return f"""[job]
name = "gpu-check-llama-1b"
[model]
preset = "llama"
[model.llama]
{sizes}
tie_word_embeddings = true
rope_theta = 500000.0
[model.llama.rope_scaling]
rope_type = "llama3"
factor = 32.0
[data]
source = "tokens"
path = "{data}"
token_dtype = "uint32"
seq_len = {t["seq_len"]}
[train]
epochs = 1
batch_size = 1
optimizer = "adamw"
lr = 1e-5
{recompute}{memory}[checkpoint]
every_epochs = 0
[log]
every_steps = 1
progress = "off"
"""


# In order of what matters most when the budget runs short; (name, function, rows it yields).
# ViT-L/16 fine-tuned with LoRA (rank 16 on every block's attention and MLP linears, the head
# trained) with its base in bf16 (train.frozen_dtype) in bf16-mixed, micro-batch 32, under a 4 GiB
# cap and no host lever: the memory a LoRA fine-tune of a large ViT needs on a small card. With
# recomputation: without it each block keeps about a quarter GiB of activations at micro-batch 32
# (its MLP's GELU input and output alone are 98.5 MiB in bf16), over 5 GiB for the 24 blocks on any
# device; with it the CPU's counted peak is 1.65 GiB (tests/it/lora_vit_l16.rs).
VIT_L16_LORA_ROW = "ViT-L/16 LoRA mb32 under 4 GiB"
VIT_L16_LORA_CAP = 4 * GiB
VIT_L16_LORA_STEPS = 6


def vit_l16_lora_spec(r, vit=None, batch=32):
    m = "\n".join(f"{k} = {v}" for k, v in (vit or VIT_L16).items())
    return spec_file(r, "vit-l16-lora", f"""[job]
name = "gpu-check-vit-l16-lora"
device = "{DEVICE}"
[model]
preset = "vit"
[model.vit]
{m}
dropout = 0.0
attention_dropout = 0.0
num_classes = 10
[model.lora]
rank = 16
alpha = 32.0
targets = ["in_proj_q", "in_proj_k", "in_proj_v", "out_proj", "mlp.0", "mlp.3"]
extras = ["heads.head"]
[data]
source = "synthetic"
samples = {batch * (VIT_L16_LORA_STEPS + 1)}
val_fraction = 0.1
[train]
epochs = 1
batch_size = {batch}
optimizer = "adamw"
lr = 1e-3
precision = "bf16-mixed"
frozen_dtype = "bf16"
activation_checkpointing = true
[memory]
limit = "{VIT_L16_LORA_CAP >> 20}MiB"
on_oom = ["fail"]
[checkpoint]
every_epochs = 0
[log]
every_steps = 1
progress = "off"
""")


def judge_vit_l16_lora(rc, records, summary, cap, batch=32):
    """It trains at the spec's micro-batch (no backoff: on_oom = fail), with finite losses, a
    device peak under the cap and nothing on the host but the data."""
    steps = of_type(records, "step")
    losses = [s.get("loss") for s in steps]
    finite = bool(losses) and all(isinstance(x, (int, float)) and math.isfinite(x) for x in losses)
    key = "memory.peak_reserved_bytes" if DEVICE == "cuda" else "memory.peak_allocated_bytes"
    peak = get(summary, key)
    micro = sorted({s.get("micro_batch") for s in steps})
    ok = rc == 0 and finite and isinstance(peak, int) and peak <= cap and micro == [batch]
    seen = (f"exit {rc}, {len(steps)} steps at micro-batch {micro}, peak {size(peak)} ({key.split('.')[-1]}), "
            f"losses {[round(x, 3) for x in losses if isinstance(x, float)]}")
    return Check(VIT_L16_LORA_ROW, f"trains at micro-batch {batch}, device peak <= {size(cap)}", seen, ok)


def check_vit_l16_lora(r, probe, vit=None, batch=32, cap=None):
    cap = cap or VIT_L16_LORA_CAP
    spec = vit_l16_lora_spec(r, vit, batch)
    sets = [f'memory.limit="{cap >> 20}MiB"'] if cap != VIT_L16_LORA_CAP else []
    p, out = r.run("vit-l16-lora", spec, sets)
    if p.rc != 0:
        return [failure(VIT_L16_LORA_ROW, "completes under the cap", p)]
    return [judge_vit_l16_lora(p.rc, records_of(out), summary_of(out), cap, batch)]


# --- CUDA graphs (train.cuda_graph) ---------------------------------------------------------
# Each row runs a job eager ("off") and captured ("on") from the same spec, with the fused
# optimizer (what a captured step needs) and deterministic algorithms. The fused kernels (SGD's
# and Adam's alike) compute with the learning rate in double precision; "off" hands it over as a
# double, while "on" has every step, eager warm-ups included, read it from the device as
# float32. So the compared jobs use rates float32 holds exactly, at a constant schedule.
GRAPH_STEPS = 8
GRAPH_COMMON = ['train.optimizer_impl="fused"', "log.every_steps=1"]
# The digits MLP's Adam at 2^-7 (its config's 0.01 is no float32), the ViT's AdamW at 2^-10
# (for 0.001), DARTS's architecture Adam at 2^-12 (for 3e-4).
# A linear warm-up over the compared steps: the rate changes at every step, replays included
# (the schedule goes on inside the graph), and each value (k/8 of a power of two) is a float32.
GRAPH_SCHEDULE = ['train.schedule="constant"', f"train.warmup_steps={GRAPH_STEPS}"]
GRAPH_MLP = ['train.optimizer="adam"', "train.lr=0.0078125"] + GRAPH_SCHEDULE
GRAPH_VIT = ["train.lr=0.0009765625"] + GRAPH_SCHEDULE
GRAPH_DARTS_ARCH = ["model.darts.arch_lr=0.000244140625"]


def darts_text():
    # configs/darts_4gb.toml sets memory.fraction, which memtrain refuses beside memory.limit.
    with open(os.path.join(ROOT, "configs", "darts_4gb.toml")) as f:
        return "".join(l for l in f if not re.match(r"\s*fraction\s*=", l))


def graph_jobs(r):
    """(row name, spec path, settings both runs share)."""
    exact_sgd = ["train.lr=0.0625"] + GRAPH_SCHEDULE
    return [
        ("mlp", DIGITS, [dev(), "train.epochs=1"] + GRAPH_MLP),
        ("resnet18", spec_file(r, "graph-resnet", RESNET.format(device=DEVICE)), exact_sgd),
        ("vit", spec_file(r, "graph-vit", VIT.format(device=DEVICE, dropout=0.1, samples=640, epochs=1)), GRAPH_VIT),
        ("darts", spec_file(r, "graph-darts", darts_text()),
         exact_sgd + GRAPH_DARTS_ARCH + [dev(), "data.samples=60", "train.epochs=1"]),
    ]


def graph_events(records, action=None):
    return [e for e in of_type(records, "graph") if action is None or e.get("action") == action]


def judge_graph_exact(model, eager_records, graph_records, need=("weights",)):
    """A captured run's per-step losses equal the eager run's bit for bit, and each step kind
    in `need` was captured."""
    eager, graphed = step_losses(eager_records), step_losses(graph_records)
    captured = {e.get("of") for e in graph_events(graph_records, "captured")}
    missing = [k for k in need if k not in captured]
    said = (of_type(graph_records, "start") or [{}])[0].get("cuda_graph") or "-"
    same = bool(eager) and eager == graphed
    gap = max_rel_gap(graphed, eager) if eager and len(eager) == len(graphed) else None
    seen = (f"{len(graphed)} steps vs {len(eager)}, " + ("bit for bit" if same else f"loss gap {gap_text(gap)}")
            + (f"; not captured: {', '.join(missing)} ({said})" if missing else
               f"; captured: {', '.join(sorted(c for c in captured if c))}"))
    return Check(f"graph exact: {model}", "captured losses equal the eager run's bit for bit", seen,
                 same and not missing)


GRAPH_STEADY = "graph replays allocate nothing"


def judge_graph_steady(graphed):
    """`graphed`: {model: records of its captured run}. After the last capture every step is a
    replay, whose memory was set aside at the capture: the device memory the allocator holds
    (reserved) stays what it was at the first replay, at every step and at every step's peak.
    A run that ends within a step of its capture (ResNet18's 4-step epoch) has nothing to
    judge; at least one run must."""
    bad, seen, judged = [], [], 0
    for model, records in graphed.items():
        caught = [e.get("step", 0) for e in graph_events(records, "captured")]
        replays = [s.get("memory") or {} for s in of_type(records, "step") if caught and s.get("step", 0) > max(caught)]
        held = [(m.get("reserved_bytes"), m.get("peak_reserved_bytes")) for m in replays]
        if len(held) < 2:
            seen.append(f"{model}: {len(held)} replays, not judged")
            continue
        judged += 1
        if any(not isinstance(x, int) for pair in held for x in pair):
            bad.append(model)
            seen.append(f"{model}: replays without a reserved reading")
            continue
        first = held[0][0]
        grew = max(max(pair) for pair in held) - first
        seen.append(f"{model}: {len(held)} replays at {size(first)}" + (f", grew {size(grew)}" if grew else ""))
        if grew:
            bad.append(model)
    return Check(GRAPH_STEADY, "reserved memory flat over every replay, peaks included", "; ".join(seen) or "-",
                 judged > 0 and not bad)


def check_graph_exact(r, probe):
    rows, graphed = [], {}
    steps = ["--max-steps", str(GRAPH_STEPS)]
    for model, spec, sets in graph_jobs(r):
        runs = {}
        for mode in ("off", "on"):
            runs[mode] = r.run(f"graph-{model}-{mode}", spec, GRAPH_COMMON + sets + [f'train.cuda_graph="{mode}"'],
                               extra=steps, env=DETERMINISTIC_ENV)
        bad = [p for p, _ in runs.values() if p.rc != 0]
        if bad:
            rows.append(failure(f"graph exact: {model}", "both runs complete", bad[0]))
            continue
        need = ("weights", "architecture") if model == "darts" else ("weights",)
        graphed[model] = records_of(runs["on"][1])
        rows.append(judge_graph_exact(model, records_of(runs["off"][1]), graphed[model], need))
    return rows + [judge_graph_steady(graphed)]


def judge_graph_capture_oom(eager_records, records):
    """An OOM inside the capture leaves no graph: the step runs eager (a `graph` record says
    why, an `oom` record answers "eager") and the run trains on exactly as the eager run."""
    eager_steps = graph_events(records, "eager")
    why = (eager_steps or [{}])[0].get("reason") or ""
    ooms = [o for o in of_type(records, "oom") if get(o, "decision.action") == "eager"]
    same = step_losses(records) == step_losses(eager_records) and bool(step_losses(records))
    oom_said = "out of memory" in why
    ok = same and bool(eager_steps) and oom_said and bool(ooms) and not graph_events(records, "captured")
    seen = (f"{len(step_losses(records))} steps, " + ("losses equal the eager run's" if same else "losses differ")
            + f"; graph record: {why[:90] or 'none'}; oom records answered eager: {len(ooms)}")
    return Check("graph capture OOM", "no graph kept, the step runs eager with an oom record", seen, ok)


def check_graph_capture_oom(r, probe):
    sets = GRAPH_COMMON + [dev(), "train.epochs=1"] + GRAPH_MLP
    steps = ["--max-steps", str(GRAPH_STEPS)]
    p, eager = r.run("graph-oom-off", DIGITS, sets + ['train.cuda_graph="off"'], extra=steps, env=DETERMINISTIC_ENV)
    if p.rc != 0:
        return [failure("graph capture OOM", "the eager run completes", p)]
    env = dict(DETERMINISTIC_ENV, MEMTRAIN_FAULT_OOM_IN_CAPTURE="1")
    p, out = r.run("graph-oom-on", DIGITS, sets + ['train.cuda_graph="on"'], extra=steps, env=env)
    if p.rc != 0:
        return [failure("graph capture OOM", "the run completes", p)]
    return [judge_graph_capture_oom(records_of(eager), records_of(out))]


GRAPH_CAPTURE_FAILURE = "graph capture failure"


def judge_graph_capture_failure(eager_records, records):
    """A capture that fails with an error other than an OOM (CUDA refuses a wait on the device
    inside it and invalidates the capture) leaves no graph and no generator still capturing: a
    `graph` record says the capture failed, no `oom` record is written, and the run trains on
    eager, dropout included, exactly as the eager run."""
    eager_steps = graph_events(records, "eager")
    why = (eager_steps or [{}])[0].get("reason") or ""
    ooms = of_type(records, "oom")
    losses = step_losses(records)
    same = bool(losses) and losses == step_losses(eager_records)
    failed = why.startswith("the capture failed") and "out of memory" not in why
    ok = same and failed and not ooms and not graph_events(records, "captured")
    seen = (f"{len(losses)} steps, " + ("losses equal the eager run's" if same else "losses differ")
            + f"; graph record: {why[:90] or 'none'}; oom records: {len(ooms)}")
    return Check(GRAPH_CAPTURE_FAILURE, "no graph kept, the step and the run go on eager, bit for bit", seen, ok)


def check_graph_capture_failure(r, probe):
    # The ViT with dropout: the eager steps after the failed capture draw from the generator the
    # capture had marked capturing.
    spec, sets = {m: (spec, sets) for m, spec, sets in graph_jobs(r)}["vit"]
    sets = GRAPH_COMMON + sets
    steps = ["--max-steps", str(GRAPH_STEPS)]
    p, eager = r.run("graph-fail-off", spec, sets + ['train.cuda_graph="off"'], extra=steps, env=DETERMINISTIC_ENV)
    if p.rc != 0:
        return [failure(GRAPH_CAPTURE_FAILURE, "the eager run completes", p)]
    env = dict(DETERMINISTIC_ENV, MEMTRAIN_FAULT_HOST_READ_IN_CAPTURE="1")
    p, out = r.run("graph-fail-on", spec, sets + ['train.cuda_graph="on"'], extra=steps, env=env)
    if p.rc != 0:
        return [failure(GRAPH_CAPTURE_FAILURE, "the run completes", p)]
    return [judge_graph_capture_failure(records_of(eager), records_of(out))]


GRAPH_BETWEEN = "graph kept over an eager step"


def judge_graph_between(eager_records, records):
    """A short last group runs eager between replays and leaves the graph in place: its backward
    makes the gradients anew outside the graph's pool and its dropout draws between the graph's,
    and the replays after it still train exactly as the eager run (one capture, the short step
    after it, replays after that)."""
    steps = of_type(records, "step")
    caught = [e.get("step", 0) for e in graph_events(records, "captured") if e.get("of") == "weights"]
    full = max((s.get("samples", 0) for s in steps), default=0)
    short = [s.get("step", 0) for s in steps if caught and s.get("samples", 0) < full and s.get("step", 0) > caught[0]]
    after = [s for s in steps if short and s.get("step", 0) > short[0]]
    losses = step_losses(records)
    same = bool(losses) and losses == step_losses(eager_records)
    ok = same and len(caught) == 1 and bool(short) and bool(after)
    seen = (f"{len(losses)} steps, " + ("losses equal the eager run's" if same else "losses differ")
            + f"; captured at step {', '.join(map(str, caught)) or 'none'}; short group at step "
            + (f"{short[0]}, {len(after)} step(s) after it" if short else "none after the capture"))
    return Check(GRAPH_BETWEEN, "one capture; a short group eager after it, replays after that; bit for bit", seen, ok)


def check_graph_between(r, probe):
    # 190 samples, 38 of them validation: 4 groups of 32 and one of 24 an epoch, so the capture
    # (step 4) is followed by the short group (step 5) and the next epoch's replays.
    spec = spec_file(r, "graph-between-vit", VIT.format(device=DEVICE, dropout=0.1, samples=190, epochs=2))
    sets = GRAPH_COMMON + GRAPH_VIT
    steps = ["--max-steps", str(GRAPH_STEPS)]
    runs = {}
    for mode in ("off", "on"):
        runs[mode] = r.run(f"graph-between-{mode}", spec, sets + [f'train.cuda_graph="{mode}"'], extra=steps,
                           env=DETERMINISTIC_ENV)
    bad = [p for p, _ in runs.values() if p.rc != 0]
    if bad:
        return [failure(GRAPH_BETWEEN, "both runs complete", bad[0])]
    return [judge_graph_between(records_of(runs["off"][1]), records_of(runs["on"][1]))]


def judge_graph_backoff(records, configured):
    """After an OOM halves the micro-batch, the new shape is captured; after a grow-back that
    fails again, it is captured anew."""
    backed = [o for o in of_type(records, "oom") if get(o, "decision.action") == "backoff"]
    captured = [e for e in graph_events(records, "captured") if e.get("of") == "weights"]
    smaller = [e for e in captured if e.get("micro_batch", configured) < configured]
    ok = bool(backed) and len(smaller) >= 2
    seen = (f"{len(backed)} backoff(s), {len(of_type(records, 'grow_back'))} grow-back(s); captured at micro-batch "
            + (", ".join(str(e.get("micro_batch")) for e in captured) or "none"))
    return Check("graph after backoff", "the backed-off shape is captured, and again after a failed grow-back",
                 seen, ok)


def check_graph_backoff(r, probe):
    sets = big() + GRAPH_COMMON + ['train.optimizer="adam"', "train.epochs=12", "memory.grow_back_after=3",
                                   'train.cuda_graph="on"']
    p, out = r.run("graph-backoff", DIGITS, sets)
    if p.rc != 0:
        return [failure("graph after backoff", "completes", p)]
    return [judge_graph_backoff(records_of(out), 1024)]


def judge_graph_declines(records):
    """"auto" beside a host lever runs eager and says which setting rules capture out."""
    said = (of_type(records, "start") or [{}])[0].get("cuda_graph") or ""
    captured = graph_events(records, "captured")
    ok = said.startswith("eager:") and "memory.optimizer_state" in said and not captured and bool(step_losses(records))
    return Check("graph declines a host lever", "\"auto\" runs eager and names memory.optimizer_state",
                 f"start: {said[:100] or 'nothing said'}; captured: {len(captured)}", ok)


def check_graph_declines(r, probe):
    sets = [dev(), "train.epochs=1", 'train.cuda_graph="auto"', 'memory.optimizer_state="host"']
    p, out = r.run("graph-declines", DIGITS, sets, extra=["--max-steps", "4"])
    if p.rc != 0:
        return [failure("graph declines a host lever", "completes", p)]
    return [judge_graph_declines(records_of(out))]


def judge_graph_resume(whole_records, resumed_records, cut_code):
    """A captured run cut by Ctrl-C and resumed trains the uncut captured run's steps bit for
    bit, and the resumed session captures its step again."""
    whole, resumed = step_losses(whole_records), step_losses(resumed_records)
    starts = [i for i, e in enumerate(resumed_records) if e.get("type") == "start"]
    after = resumed_records[starts[-1]:] if len(starts) > 1 else []
    recaptured = bool(graph_events(after, "captured"))
    same = bool(whole) and resumed == whole
    seen = (f"cut exit {cut_code}; {len(resumed)} vs {len(whole)} steps, "
            + ("bit for bit" if same else f"loss gap {gap_text(max_rel_gap(resumed, whole))}")
            + ("; captured again after the resume" if recaptured else "; no capture after the resume"))
    return Check("graph resume", "exit 130, then the uncut captured run's losses bit for bit",
                 seen, cut_code == 130 and same and recaptured)


def check_graph_resume(r, probe):
    spec = spec_file(r, "graph-resume-vit", VIT.format(device=DEVICE, dropout=0.1, samples=320, epochs=2))
    sets = GRAPH_COMMON + ['train.cuda_graph="on"']
    p, whole = r.run("graph-whole", spec, sets, env=DETERMINISTIC_ENV)
    if p.rc != 0:
        return [failure("graph resume", "the uncut run completes", p)]
    cut = r.path("graph-cut")
    argv = [r.bin, "run", spec, "--out", cut] + [x for s in sets for x in ("--set", s)]
    p, seen = r.spawn_until("graph-cut", argv, "fault: waiting for a signal at step 5",
                            env=dict(DETERMINISTIC_ENV, MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP="5"))
    if not seen:
        return [failure("graph resume", "the run reaches step 5", p)]
    q = r.mt("graph-resume", ["run", spec, "--resume", cut], env=DETERMINISTIC_ENV)
    if q.rc != 0:
        return [failure("graph resume", "the resumed run completes", q)]
    return [judge_graph_resume(records_of(whole), records_of(cut), p.rc)]


# (row name, job, settings, target speed-up of the captured run over the eager one)
GRAPH_SPEED_ROWS = [
    ("darts main job", "darts", [], 2.0),
    ("resnet18 224 px b8", "resnet18", ["model.resnet18.image_size=224", "train.batch_size=8"], 1.3),
    ("vit-b16 b8", "vit", ["model.vit.image_size=224", "model.vit.patch_size=16", "model.vit.layers=12",
                           "model.vit.heads=12", "model.vit.hidden_dim=768", "model.vit.mlp_dim=3072",
                           "train.batch_size=8"], 1.3),
]
GRAPH_SPEED_WARMUP, GRAPH_SPEED_STEPS = 5, 30


def judge_graph_speed(name, eager_records, graph_records, eager_summary, graph_summary, target):
    """A speed row: both runs trained, the captured one at >= `target` times the eager one's
    samples/s (device-clock step seconds after the warm-up, which includes the capture)."""
    base, rate = wall_rate(eager_records, GRAPH_SPEED_WARMUP), wall_rate(graph_records, GRAPH_SPEED_WARMUP)
    captured = bool(graph_events(graph_records, "captured"))
    ratio = rate / base if base and rate else None
    pe, pg = get(eager_summary, "memory.peak_reserved_bytes"), get(graph_summary, "memory.peak_reserved_bytes")
    seen = ("-" if ratio is None else f"{rate:.1f} vs {base:.1f} samples/s = {ratio:.2f}x (target {target:.2f}x)") \
        + f"; peak reserved {size(pg)} vs eager {size(pe)}" + ("" if captured else "; never captured")
    ok = ratio is not None and ratio >= target and captured
    return Check(f"graph speed: {name}", f"captured at >= {target:.2f}x the eager run's samples/s", seen, ok)


def check_graph_speed(r, probe):
    rows = []
    jobs = {m: (spec, sets) for m, spec, sets in graph_jobs(r)}
    steps = ["--max-steps", str(GRAPH_SPEED_WARMUP + GRAPH_SPEED_STEPS)]
    for name, job, extra_sets, target in GRAPH_SPEED_ROWS:
        spec, sets = jobs[job]
        if job == "darts":
            sets = [dev(), "train.epochs=1"]  # the main job itself, SGD and its schedule as shipped
        runs = {}
        for mode in ("off", "on"):
            runs[mode] = r.run(f"graph-speed-{job}-{mode}", spec,
                               GRAPH_COMMON + sets + extra_sets + [f'train.cuda_graph="{mode}"'], extra=steps)
        bad = [p for p, _ in runs.values() if p.rc != 0]
        if bad:
            rows.append(failure(f"graph speed: {name}", "both runs complete", bad[0]))
            continue
        (_, eager), (_, graphed) = runs["off"], runs["on"]
        rows.append(judge_graph_speed(name, records_of(eager), records_of(graphed), summary_of(eager),
                                      summary_of(graphed), target))
    return rows


CHECKS = [
    ("info", check_info, ["info vs torch.cuda"]),
    ("backoff", check_backoff, ["OOM backoff (1 GiB cap)"]),
    ("cpu_fallback", check_cpu_fallback, ["OOM CPU fallback"]),
    ("bn_retry", check_bn_retry, [BN_RETRY]),
    ("setup_oom", check_setup_oom, [SETUP_OOM]),
    ("snapshot", check_snapshot, ["OOM snapshot vs reserved", "end snapshot"]),
    ("fp16_inf", check_fp16_inf, ["fp16 inf: skip + halve"]),
    ("recompute", check_recompute, ["recompute resnet18", "recompute vit"]),
    ("async_cap", check_async_cap, ["cudaMallocAsync cap"]),
    ("fit", check_fit, ["fit vs nvidia-smi"]),
    ("fit_graph", check_fit_graph, [FIT_GRAPH_ROW]),
    ("resume", check_resume, ["CUDA resume (rng)"]),
    ("expandable", check_expandable, ["expandable segments clear"]),
    ("host_reads", check_host_reads, ["host reads fp32", "host reads fp16-mixed"]),
    ("optimizers", check_optimizers, [f"optimizer {i}" for i, _ in OPTIMIZER_IMPLS]),
    ("single_rank", check_single_rank, ["NCCL one-rank group"]),
    ("group_oom", check_group_oom, ["NCCL group backs off"]),
    ("static_bill", check_static_bill, [STATIC_OFFLOAD, STATIC_ADVICE]),
    ("advice_resume", check_advice_resume, [ADVICE_RESUME]),
    ("collective_oom", check_collective_oom, ["NCCL collective OOM"]),
    ("resident_nan", check_resident_nan, [RESIDENT_NAN]),
    ("finetune", check_finetune, [FINETUNE]),
    ("llama_generate", check_llama_generate, [LLAMA_GENERATE]),
    ("llama_streamed", check_llama_streamed, [LLAMA_8B_ROW, LLAMA_8B_GENERATE, LLAMA_8B_FLOOR_ROW]),
    ("llama_full_1b", check_llama_full_1b, [LLAMA_1B_ROW, LLAMA_1B_SPEED_ROW]),
    ("darts", check_darts, ["darts_4gb under 4 GiB"]),
    ("graph_exact", check_graph_exact, [f"graph exact: {m}" for m in ("mlp", "resnet18", "vit", "darts")] + [GRAPH_STEADY]),
    ("graph_capture_oom", check_graph_capture_oom, ["graph capture OOM"]),
    ("graph_capture_failure", check_graph_capture_failure, [GRAPH_CAPTURE_FAILURE]),
    ("graph_between", check_graph_between, [GRAPH_BETWEEN]),
    ("graph_backoff", check_graph_backoff, ["graph after backoff"]),
    ("graph_declines", check_graph_declines, ["graph declines a host lever"]),
    ("graph_resume", check_graph_resume, ["graph resume"]),
    ("graph_speed", check_graph_speed, [f"graph speed: {n}" for n, *_ in GRAPH_SPEED_ROWS]),
    ("eval_oom", check_eval_oom, ["validation OOM (1 GiB cap)"]),
    ("cache_clear", check_cache_clear, ["cache clear cost"]),
    ("host_levers", check_host_levers, [f"host levers: {c}" for c, *_ in HOST_COMBOS]),
    ("vit_l16_config", check_vit_l16_config, ["configs/vit_l16_4gb.toml on CUDA"]),
    ("vit_l16_lora", check_vit_l16_lora, [VIT_L16_LORA_ROW]),
    ("offload_speed", check_offload_speed, [f"offload speed: {n}" for n, *_ in SPEED_ROWS]),
    ("twins", check_twins, [f"{DEVICE.upper()} vs PyTorch {m}" for m, _ in TWINS]),
    ("step_time", check_step_time, ["step seconds vs wall time", "peak requested bytes"]),
    ("loader", check_loader, ["loader on the device"]),
    ("step_syncs", check_step_syncs, ["no wait inside a step: vit", "no wait inside a step: resnet18"]),
    # Last: it reads the stderr of every run before it.
    ("warnings", check_no_warnings, ["no libtorch [W lines"]),
]


def run_checks(r, probe, only=None, log=print):
    rows = []
    chosen = [c for c in CHECKS if not only or c[0] in only]
    for i, (key, fn, names) in enumerate(chosen, 1):
        t = time.time()
        try:
            got = fn(r, probe)
        except OverBudget:
            got = [Check(n, "runs", "not run: the time budget (GPU_CHECK_BUDGET) was spent", False) for n in names]
        except Exception as e:  # a check's own bug must not stop the others
            got = [Check(n, "runs", f"gpu-check error: {type(e).__name__}: {e}", False) for n in names]
        rows += got
        verdict = "ok" if all(c.ok for c in got) else "FAIL"
        log(f"gpu-check: [{i}/{len(chosen)}] {key}: {verdict} ({time.time() - t:.1f} s)")
    return rows


def find_binary():
    b = os.environ.get("MEMTRAIN_BIN")
    if b:
        return os.path.abspath(b) if os.sep in b else (shutil.which(b) or os.path.abspath(b))
    for c in (os.path.join(ROOT, "dist", "memtrain"), os.path.join(ROOT, "target", "release", "memtrain")):
        if os.access(c, os.X_OK):
            return c
    return os.path.join(ROOT, "target", "release", "memtrain")


def self_test():
    import unittest

    suite = unittest.defaultTestLoader.discover(os.path.join(ROOT, "tests", "py"), pattern="test_gpu_check.py")
    result = unittest.TextTestRunner(verbosity=1).run(suite)
    return 0 if result.wasSuccessful() else 1


def main(argv=None):
    p = argparse.ArgumentParser(description="memtrain's checks on a CUDA machine (see the module docstring)")
    p.add_argument("--only", default="", help="comma-separated check names: " + ",".join(c[0] for c in CHECKS))
    p.add_argument("--keep", action="store_true", help="keep the run directories even when all passed")
    p.add_argument("--expandable", action="store_true",
                   help="run every check with memory.allocator.expandable_segments = true (where it does not set the allocator itself)")
    p.add_argument("--self-test", action="store_true", help="test the parsing and table code (no GPU needed)")
    a = p.parse_args(argv)
    if a.self_test:
        return self_test()
    python = os.environ.get("PYTHON") or sys.executable

    def note(msg):
        print(msg, file=sys.stderr, flush=True)

    probe = torch_probe(python)
    why = no_cuda_message(probe)
    if why:
        note(why)
        return 2
    lib = probe.get("lib")
    if lib and os.path.isdir(lib):
        os.environ["LD_LIBRARY_PATH"] = lib + (":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")
    if not str(probe.get("version", "")).startswith("2.11"):
        note(f"gpu-check: warning: memtrain is built against libtorch 2.11; this torch is {probe.get('version')}")
    binary = find_binary()
    if not os.access(binary, os.X_OK):
        note(f"gpu-check: no memtrain binary at {binary} (set MEMTRAIN_BIN, or build one with scripts/package-device)")
        return 2
    note(f"gpu-check: {probe.get('name')}, torch {probe.get('version')} (libraries from {lib}); binary {binary}")
    only = set(s.strip() for s in a.only.split(",") if s.strip())
    unknown = only - set(c[0] for c in CHECKS)
    if unknown:
        note(f"gpu-check: no check named {', '.join(sorted(unknown))}; the checks: {', '.join(c[0] for c in CHECKS)}")
        return 2
    tmp = tempfile.mkdtemp(prefix="memtrain-gpu-check.")
    r = Runner(binary, python, tmp, float(os.environ.get("GPU_CHECK_BUDGET", "480")),
               float(os.environ.get("GPU_CHECK_TIMEOUT", "180")), expandable=a.expandable)
    rows = run_checks(r, probe, only, log=note)
    print(render(rows), flush=True)
    status = exit_status(rows)
    if status or a.keep:
        note(f"gpu-check: run directories and logs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
