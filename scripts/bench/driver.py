"""memtrain beside plain PyTorch, for every preset with a PyTorch twin and every precision: a
benchmark, not a test. Run it through scripts/bench/run, which builds memtrain and picks the
bootstrap environment's Python.

For each job (jobs.py) and setting, REPS rounds of fresh processes, one memtrain and one per
PyTorch baseline, the order alternating (reversed in odd rounds), each training the same steps
from the same initial weights on the same data in the same order. The jobs default to
jobs.CPU_JOBS on the CPU and to jobs.GPU_JOBS (ImageNet-sized ResNet18, ResNet50, ViT-B/16 and a
wide MLP, synthetic data) on CUDA. The PyTorch baselines (pytorch_job.py --data-mode):

  host           each batch gathered on the host and copied over (the CPU default: on the CPU
                 the copy is nothing)
  resident       the data set (and the held-out set) copied to the GPU once, batches gathered
                 there: what memtrain does with data that fits a sixteenth of the card (CUDA
                 default)
  loader         torch.utils.data.DataLoader, --workers processes, pin_memory=True, non-blocking
                 copies: how PyTorch users feed a GPU (CUDA default)

A baseline MODE+COMPILE runs the model through torch.compile(model, mode=COMPILE), e.g.
resident+reduce-overhead: Inductor's kernels replayed as CUDA graphs. Compilation falls in the
untimed first epoch; the warm-up columns give that epoch's wall time, compilation included. On
the CPU reduce-overhead records no graphs (Inductor's CPU kernels alone); a compiled baseline that
cannot run is reported as failed, with the reason, and the other sides' rows go on.

memtrain runs as one side or several (--memtrain-sides): default (the spec as written), eager
(train.cuda_graph "off") and graphed (train.cuda_graph "on"), the last two both with the fused
optimizer, so their ratio is what capturing the step alone buys; with several, a row per side,
each with its ratio to the first. On the CPU every memtrain step runs eager, whatever the side.
scripts/bench/graphs runs the CUDA-graph comparison this way.

A ViT job has each baseline twice (--vit-twin): MODE/sdpa first, whose attention is the fastest
plain PyTorch has (one packed in-projection and scaled_dot_product_attention, as memtrain's vit
preset runs it; the same parameters and initial weights), then torchvision's own
VisionTransformer, whose nn.MultiheadAttention call is the second baseline.

Per process:

  samples/s      over the steps after the first epoch (after the first step where the run has
                 one epoch), the same steps on both sides, from the wall time between steps:
                 PyTorch's step runs from the previous step's loss read to its own; memtrain's
                 from its step records' `seconds`, which add up over an epoch to the time from
                 the start of its steps (validation between epochs left out) to its last loss
                 read. The reads wait for the GPU, so the time covers its work
  median step    samples/s of the median timed step: a step the scheduler preempted (other work
                 on a shared machine) moves the total above but not this
  peak alloc     tensor bytes at their peak over the training steps: on the CPU both sides count
                 with memtrain's counting allocator (src/shim/shim.cpp, built into a shared
                 library for the Python side and installed with c10::SetCPUAllocator); on CUDA the
                 caching allocator's max_memory_allocated, which counts whole blocks
  Δ peak         memtrain's peak minus PyTorch's, in MiB: allocated as above, and on CUDA
                 requested (the bytes tensors asked for, before the allocator rounds each to a
                 block: a request served from a cached block with under 1 MiB to spare takes the
                 whole block, so the same tensors allocated in another order count differently
                 in allocated but not in requested)
  peak RSS       the kernel's high-water mark (VmHWM), reset when training starts
  start-up       from the process's launch to the start of its first step (imports, libtorch,
                 model, data)

and prints medians, the memtrain/PyTorch ratios against each baseline (median of the per-round
ratios, with their range over the rounds), and the machine. --dry-run prints the commands
instead of running them (no GPU or torch needed). --peak-diff DIR (CUDA) adds, after each row,
an untimed pair that records the allocator's history on both sides and writes which blocks were
live at one side's peak and not at the other's (scripts/bench/peak_diff.py). --alloc-conf CONF
sets PYTORCH_CUDA_ALLOC_CONF for both sides; --memtrain-set KEY=VALUE overrides a spec key on
memtrain's side alone, to measure what changing one of its defaults would do; the table's header
names both.
"""
import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
import jobs  # noqa: E402


def build_counting_lib(cuda):
    """src/shim/shim.cpp as a shared library, for the counting allocator on the Python side."""
    import torch

    torch_dir = os.path.dirname(torch.__file__)
    out_dir = os.path.join(ROOT, "target", "bench")
    os.makedirs(out_dir, exist_ok=True)
    src = os.path.join(ROOT, "src", "shim", "shim.cpp")
    lib = os.path.join(out_dir, "libmemtrain_shim.so")
    if os.path.exists(lib) and os.path.getmtime(lib) >= os.path.getmtime(src):
        return lib
    print("building the counting allocator for the PyTorch side (src/shim/shim.cpp) ...", file=sys.stderr)
    cmd = ["g++", "-shared", "-fPIC", "-O2", "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=1", "-DGLOG_USE_GLOG_EXPORT",
           f"-I{torch_dir}/include", f"-I{torch_dir}/include/torch/csrc/api/include", src, "-o", lib,
           f"-L{torch_dir}/lib", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_dir}/lib"]
    if cuda or os.path.exists(os.path.join(torch_dir, "lib", "libtorch_cuda.so")):
        cmd[1:1] = ["-DMEMTRAIN_HAVE_CUDA"]
        cmd += ["-ltorch_cuda", "-lc10_cuda"]
    subprocess.run(cmd, check=True)
    return lib


def write_data(job, path, seed=0, samples=None):
    import numpy as np

    j = jobs.JOBS[job]
    n = samples or j["samples"]
    g = np.random.default_rng(seed)
    x = g.standard_normal([n] + j["shape"]).astype(np.float32)
    y = (np.arange(n) % j["options"]["num_classes"]).astype(np.int64)
    g.shuffle(y)
    np.savez(path, x=x, y=y)


def prepare_job(job, work):
    """`work` holds the job's initial weights (init.safetensors), data (data.npz) and a token
    validation set (val.npz): memtrain validates at epoch ends, outside the timed steps."""
    os.makedirs(work)
    subprocess.run([sys.executable, os.path.join(HERE, "pytorch_job.py"), "init", "--job", job,
                    "--out", os.path.join(work, "init.safetensors")], check=True)
    write_data(job, os.path.join(work, "data.npz"))
    write_data(job, os.path.join(work, "val.npz"), seed=1, samples=8)


# memtrain's sides (--memtrain-sides): the settings each adds to the spec. eager and graphed both
# take the fused optimizer, which capture needs, so they differ in the capture alone.
MEMTRAIN_SIDES = {
    "default": [],
    "eager": ['train.cuda_graph="off"', 'train.optimizer_impl="fused"'],
    "graphed": ['train.cuda_graph="on"', 'train.optimizer_impl="fused"'],
}


def mt_side(name):
    """A memtrain side's name in a round's order: "mt" for the default (the table of a single
    side), "mt:NAME" otherwise."""
    return "mt" if name == "default" else f"mt:{name}"


def memtrain_argv(a, work, job, setting, rep, side="mt"):
    """Writes the setting's spec (once) and gives memtrain's command line and its run directory."""
    name, precision, ckpt = setting
    spec = os.path.join(work, f"{job}-{name}.toml")
    if not os.path.exists(spec):
        os.makedirs(work, exist_ok=True)
        with open(spec, "w") as f:
            f.write(jobs.memtrain_spec(job, os.path.join(work, "init.safetensors"), os.path.join(work, "data.npz"),
                                       os.path.join(work, "val.npz"), precision, ckpt, a.threads, a.device,
                                       saves=False))
    variant = side.partition(":")[2]
    out = os.path.join(work, f"mt-{job}-{name}{'-' + variant if variant else ''}-{rep}")
    argv = [a.memtrain, "-q", "run", spec, "--out", out, "--max-steps", str(jobs.JOBS[job]["steps"])]
    for kv in MEMTRAIN_SIDES[variant or "default"] + a.memtrain_set:
        argv += ["--set", kv]
    return argv, out


def child_env(a):
    """The environment of every timed process: --alloc-conf reaches both sides' allocator the
    same way, through PYTORCH_CUDA_ALLOC_CONF (memtrain merges its spec's allocator keys over it)."""
    env = dict(os.environ)
    if a.alloc_conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf
    return env


def shown(a, argv):
    """A command as --dry-run prints it, with the environment it would add."""
    prefix = f"PYTORCH_CUDA_ALLOC_CONF={a.alloc_conf} " if a.alloc_conf is not None else ""
    return prefix + " ".join(shlex.quote(x) for x in argv)


def first_timed(epochs):
    """The index of the first timed step, given each step's epoch: the second epoch's first step
    where the run has a second epoch, else the second step. The first epoch warms up (libraries,
    the allocator); the later ones' records add up to their wall time, from the start of their
    steps to their last loss read."""
    later = [i for i, e in enumerate(epochs) if e != epochs[0]]
    return later[0] if later else min(1, len(epochs) - 1)


def run_memtrain(a, work, job, setting, rep, side="mt"):
    argv, out = memtrain_argv(a, work, job, setting, rep, side)
    launched = time.time()
    p = subprocess.run(argv, capture_output=True, text=True, env=child_env(a))
    if p.returncode != 0:
        raise SystemExit(f"memtrain ({side}) {job} {setting[0]} failed ({p.returncode}):\n{p.stderr}")
    return read_memtrain(out, launched)


def read_memtrain(out, launched):
    """A finished memtrain run's figures, from its run directory `out` (metrics.jsonl and
    summary.json); `launched`: when its process started."""
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    steps = [l for l in lines if l["type"] == "step"]
    start = next((l for l in lines if l["type"] == "start"), {})
    summary = json.load(open(os.path.join(out, "summary.json")))
    # The first record is written once the second step is queued (on CUDA), so its `time` is
    # late by part of a step: start-up here is the first step's start give or take that.
    first_start = steps[0]["time"] - steps[0]["seconds"]
    k = first_timed([s["epoch"] for s in steps])
    wall = [s["seconds"] for s in steps[k:]]
    samples = [s["samples"] for s in steps[k:]]
    return {
        "startup_seconds": first_start - launched,
        "warmup_seconds": sum(s["seconds"] for s in steps[:k]),
        "cuda_graph": start.get("cuda_graph"),
        "samples_per_s": sum(samples) / max(sum(wall), 1e-12),
        "median_step_samples_per_s": statistics.median(n / max(t, 1e-12) for n, t in zip(samples, wall)),
        "peak_allocated_bytes": max(s["memory"].get("peak_allocated_bytes", 0) for s in steps),
        "peak_requested_bytes": max((s["memory"].get("peak_requested_bytes") or 0 for s in steps), default=0) or None,
        "peak_rss_bytes": summary["memory"]["peak_rss_bytes"],
        "checkpointing": summary["precision"]["activation_checkpointing"],
        "losses": [s["loss"] for s in steps],
        "step_seconds": [s["seconds"] for s in steps],
    }


def baselines_of(a, job):
    """The PyTorch sides of a job's rows: each data mode, and for a ViT each of them twice: first
    with the attention written as the fastest plain PyTorch (`MODE/sdpa`: a packed in-projection
    and scaled_dot_product_attention, as memtrain runs it), then torchvision's own module."""
    if jobs.JOBS[job]["preset"] != "vit" or a.vit_twin == "module":
        return list(a.baselines)
    sdpa = [f"{b}/sdpa" for b in a.baselines]
    return sdpa if a.vit_twin == "sdpa" else sdpa + list(a.baselines)


def pytorch_argv(a, work, job, setting, rep, counting, side):
    name, precision, ckpt = setting
    data, _, attention = side.partition("/")
    mode, _, compile_mode = data.partition("+")
    result = os.path.join(work, f"pt-{job}-{name}-{data}-{attention or 'module'}-{rep}.json")
    cmd = [sys.executable, os.path.join(HERE, "pytorch_job.py"), "train", "--job", job,
           "--init", os.path.join(work, "init.safetensors"), "--data", os.path.join(work, "data.npz"),
           "--val", os.path.join(work, "val.npz"),
           "--precision", precision, "--steps", str(jobs.JOBS[job]["steps"]), "--threads", str(a.threads),
           "--device", a.device, "--data-mode", mode, "--workers", str(a.workers), "--result", result,
           "--attention", attention or "module"]
    if ckpt:
        cmd.append("--checkpointing")
    if compile_mode:
        cmd += ["--compile", compile_mode]
    if counting:
        cmd += ["--counting", counting]
    return cmd, result


def run_pytorch(a, work, job, setting, rep, counting, mode):
    cmd, result = pytorch_argv(a, work, job, setting, rep, counting, mode)  # mode: a side
    launched = time.time()
    p = subprocess.run(cmd + ["--launched", str(launched)], capture_output=True, text=True, env=child_env(a))
    if p.returncode != 0 and "+" in mode.partition("/")[0]:
        # A compiled baseline that cannot run here (no compiler, a model torch.compile cannot
        # trace) leaves its columns marked failed; the others still measure.
        why = [l for l in p.stderr.strip().splitlines() if l.strip()][-1:] or [f"exit status {p.returncode}"]
        print(f"# PyTorch {mode} {job} {setting[0]} failed: {why[0]}", file=sys.stderr, flush=True)
        return {"failed": why[0]}
    if p.returncode != 0:
        raise SystemExit(f"PyTorch ({mode}) {job} {setting[0]} failed ({p.returncode}):\n{p.stderr}")
    return json.load(open(result))


def loss_gap(mt, pt):
    """The largest relative difference between the two sides' per-step losses: near 1e-7 in fp32
    (same computation), larger under reduced precision, where both round differently."""
    gaps = [abs(m - q) / max(abs(q), 1e-12) for m, q in zip(mt["losses"], pt["losses"])]
    return max(gaps) if gaps and len(mt["losses"]) == len(pt["losses"]) else float("nan")


def med(xs):
    return statistics.median(xs)


def spread(xs):
    return f"{min(xs):.2f}-{max(xs):.2f}"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtrain", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", default=None, help="default: jobs.CPU_JOBS on the CPU, jobs.GPU_JOBS on CUDA")
    p.add_argument("--settings", default=None,
                   help="default: every setting on the CPU; fp32,bf16-mixed,fp16-mixed on CUDA")
    p.add_argument("--baselines", default=None,
                   help="PyTorch's data modes, comma-separated: host, resident, loader (default: host on the "
                        "CPU; resident,loader on CUDA), each optionally +COMPILE for torch.compile(model, "
                        "mode=COMPILE), e.g. resident+reduce-overhead; ratios and memory are against the first")
    p.add_argument("--memtrain-sides", default="default",
                   help="memtrain's sides, comma-separated: default (the spec as written), eager (train.cuda_graph "
                        "off), graphed (train.cuda_graph on); eager and graphed take the fused optimizer; with "
                        "several, a row per side and its ratio to the first")
    p.add_argument("--vit-twin", default="both", choices=["both", "sdpa", "module"],
                   help="ViT jobs' PyTorch model: both (ratios and memory against the SDPA one), sdpa (a packed "
                        "in-projection and scaled_dot_product_attention) or module (torchvision's nn.MultiheadAttention)")
    p.add_argument("--workers", type=int, default=8, help="the loader baseline's DataLoader workers")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds: start no new round after this; rows print with the rounds they have")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--trace", default=None,
                   help="a file to write every process's per-step wall seconds to, one JSON line each")
    p.add_argument("--peak-diff", default=None, metavar="DIR",
                   help="CUDA: after each row, one more run of each side recording the allocator's history (not "
                        "timed), and scripts/bench/peak_diff.py's account of the blocks live at one side's peak and "
                        "not the other's, written to DIR/JOB-SETTING.txt")
    p.add_argument("--alloc-conf", default=None, metavar="CONF",
                   help="CUDA: PYTORCH_CUDA_ALLOC_CONF for both sides, e.g. expandable_segments:True")
    p.add_argument("--memtrain-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a spec override for memtrain's side alone (memtrain run --set), repeatable: what a "
                        "memtrain default would change, e.g. memory.allocator.expandable_segments=true")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    if a.peak_diff and not cuda:
        p.error("--peak-diff needs --device cuda: it compares the CUDA caching allocator's snapshots")
    if a.alloc_conf is not None and not cuda:
        p.error("--alloc-conf needs --device cuda: it configures the CUDA caching allocator")
    bad = [kv for kv in a.memtrain_set if "=" not in kv]
    if bad:
        p.error(f"--memtrain-set takes KEY=VALUE (a spec key and a TOML value), not {', '.join(bad)}")
    a.jobs = (a.jobs or ",".join(jobs.GPU_JOBS if cuda else jobs.CPU_JOBS)).split(",")
    unknown = [j for j in a.jobs if j not in jobs.JOBS]
    if unknown:
        p.error(f"no job {', '.join(unknown)}; the jobs: {', '.join(jobs.JOBS)}")
    wanted = (a.settings or ("fp32,bf16-mixed,fp16-mixed" if cuda else ",".join(s[0] for s in jobs.SETTINGS)))
    a.settings = [s for s in jobs.SETTINGS if s[0] in wanted.split(",")]
    a.baselines = (a.baselines or ("resident,loader" if cuda else "host")).split(",")
    bad = [b for b in a.baselines if b.partition("+")[0] not in ("host", "resident", "loader")
           or b.endswith("+") or "/" in b]
    if bad:
        p.error(f"no baseline {', '.join(bad)}: host, resident or loader, each optionally +COMPILE "
                f"(a torch.compile mode, e.g. resident+reduce-overhead)")
    a.memtrain_sides = a.memtrain_sides.split(",")
    bad = [m for m in a.memtrain_sides if m not in MEMTRAIN_SIDES]
    if bad:
        p.error(f"no memtrain side {', '.join(bad)}: {', '.join(MEMTRAIN_SIDES)}")
    return a


def rows(a):
    """(job, setting) in order; the MLP has no chain of blocks to checkpoint."""
    for job in a.jobs:
        for setting in a.settings:
            if setting[2] and jobs.JOBS[job]["preset"] == "mlp":
                continue  # memtrain skips checkpointing it, so would PyTorch
            yield job, setting


def memtrain_sides(a):
    return [mt_side(m) for m in a.memtrain_sides]


def round_order(a, rep, job):
    sides = memtrain_sides(a) + baselines_of(a, job)
    return sides if rep % 2 == 0 else sides[::-1]


def dry_run(a):
    work = tempfile.mkdtemp(prefix="memtrain-bench-dry.")
    print(f"# dry run: {a.device}, jobs {','.join(a.jobs)}, settings {','.join(s[0] for s in a.settings)}, "
          f"memtrain sides {','.join(a.memtrain_sides)}, baselines {','.join(a.baselines)}, {a.reps} rounds; "
          f"specs written under {work}")
    counting = None if a.device.startswith("cuda") else os.path.join(ROOT, "target", "bench", "libmemtrain_shim.so")
    for job in a.jobs:
        j = jobs.JOBS[job]
        accumulation = j["train"].get("accumulation", 1)
        print(f"# {job}: {j['preset']} {j['options']}, {j['samples']} samples of {j['shape']}, "
              f"batch {j['train']['batch_size']}" + (f" x {accumulation} accumulation" if accumulation > 1 else "")
              + f", {j['steps']} steps")
        print(" ".join([sys.executable, os.path.join(HERE, "pytorch_job.py"), "init", "--job", job, "--out",
                        os.path.join(work, job, "init.safetensors")]))
    for job, setting in rows(a):
        for rep in range(a.reps):
            for side in round_order(a, rep, job):
                if side.startswith("mt"):
                    argv, _ = memtrain_argv(a, os.path.join(work, job), job, setting, rep, side)
                else:
                    argv, _ = pytorch_argv(a, os.path.join(work, job), job, setting, rep, counting, side)
                print(shown(a, argv))
        if a.peak_diff:
            for argv in snapshot_argvs(a, os.path.join(work, job), job, setting):
                print(shown(a, argv))


def extended(a):
    """Whether the table has the graph comparison's columns: a row per memtrain side, every
    baseline's peak and each side's untimed warm-up (compilation, capture)."""
    return len(a.memtrain_sides) > 1 or any("+" in b for b in a.baselines)


def header(a, baselines):
    import torch

    print(f"# memtrain vs plain PyTorch {torch.__version__} on {a.device}: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {a.threads} threads, {a.reps} alternating rounds per row, PyTorch baselines "
          f"{', '.join(baselines)}; {time.strftime('%Y-%m-%d')}")
    if a.device.startswith("cuda"):
        print(f"# GPU: {torch.cuda.get_device_name(0)}")
    elif any("+" in b for b in baselines) or "graphed" in a.memtrain_sides:
        print("# on the CPU there are no CUDA graphs: memtrain's graphed side runs eager, and torch.compile's "
              "reduce-overhead runs Inductor's CPU kernels without recording graphs")
    if a.alloc_conf is not None:
        print(f"# both sides: PYTORCH_CUDA_ALLOC_CONF={a.alloc_conf}")
    if len(a.memtrain_sides) > 1 or a.memtrain_sides != ["default"]:
        for m in a.memtrain_sides:
            print(f"# memtrain {m}: {' '.join('--set ' + kv for kv in MEMTRAIN_SIDES[m]) or 'the spec as written'}")
    if a.memtrain_set:
        print(f"# memtrain only: --set {' --set '.join(a.memtrain_set)}")
    more = extended(a)
    cols = ["job", "setting"] + (["memtrain"] if more else []) + ["samples/s memtrain"]
    for b in baselines:
        cols += [f"PyTorch {b}", "ratio (range)"]
    if len(a.memtrain_sides) > 1:
        cols += [f"vs memtrain {a.memtrain_sides[0]} (range)"]
    cols += ["median-step ratio (range)", "peak alloc memtrain", "PyTorch", "ratio", "Δ peak alloc",
             "Δ peak requested", "peak RSS ratio",
             "start-up memtrain", "PyTorch", "loss gap"]
    if more:
        cols += [f"peak alloc PyTorch {b}" for b in baselines[1:]]
        cols += ["warm-up memtrain"] + [f"warm-up PyTorch {b}" for b in baselines]
    print("| " + " | ".join(cols) + " |")
    print("|---" * len(cols) + "|")


def failed(runs):
    """A baseline's failure, if any of its rounds failed (a compiled one that cannot run)."""
    return next((q["failed"] for q in runs if "failed" in q), None)


def print_row(a, job, setting, mt, pt, side="mt", ref=None):
    """One row, for one memtrain side: medians, and ratios against each baseline (memtrain /
    PyTorch, per round) and, with several memtrain sides, against the first (`ref`). Gives the
    notes for under the table: the baselines that failed, and why."""
    baselines = baselines_of(a, job)
    usable = [b for b in baselines if not failed(pt[b])]
    n = len(mt)
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    more = extended(a)
    cells = [job, setting[0]] + ([side.partition(":")[2] or "default"] if more else [])
    cells += [f"{med([m['samples_per_s'] for m in mt]):.1f}"]
    for b in baselines:
        if b not in usable:
            cells += ["failed", "-"]
            continue
        rate = [m["samples_per_s"] / q["samples_per_s"] for m, q in zip(mt, pt[b])]
        cells += [f"{med([q['samples_per_s'] for q in pt[b]]):.1f}", f"{med(rate):.2f} ({spread(rate)})"]
    if len(a.memtrain_sides) > 1:
        own = [m["samples_per_s"] / r["samples_per_s"] for m, r in zip(mt, ref or mt)]
        cells += [f"{med(own):.2f} ({spread(own)})"]
    cells += first_cells(mt, [pt[b] for b in usable]) if usable else ["-"] * 10
    cells[-1] += "" if n == a.reps else f" ({n} of {a.reps} rounds)"
    if more:
        cells += [mib(med([q["peak_allocated_bytes"] for q in pt[b]])) if b in usable else "failed"
                  for b in baselines[1:]]
        cells += [f"{med([m['warmup_seconds'] for m in mt]):.2f} s"]
        cells += [f"{med([q['warmup_seconds'] for q in pt[b]]):.2f} s" if b in usable else "failed" for b in baselines]
    print("| " + " | ".join(cells) + " |", flush=True)
    # Said under the table, which a line of its own here would break.
    return [f"{job} {setting[0]}: PyTorch {b} failed: {failed(pt[b])}" for b in baselines if b not in usable]


def first_cells(mt, usable):
    """The cells against the first baseline that ran (`usable`: each one's rounds): median-step
    ratio, peak memory, start-up; and the loss gap against them all."""
    first = usable[0]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    step = [m["median_step_samples_per_s"] / q["median_step_samples_per_s"] for m, q in zip(mt, first)]
    alloc = [m["peak_allocated_bytes"] / q["peak_allocated_bytes"] for m, q in zip(mt, first)]
    rss = [m["peak_rss_bytes"] / q["peak_rss_bytes"] for m, q in zip(mt, first)]
    gap = max(loss_gap(m, q) for runs in usable for m, q in zip(mt, runs))
    return [f"{med(step):.2f} ({spread(step)})", mib(med([m["peak_allocated_bytes"] for m in mt])),
            mib(med([q["peak_allocated_bytes"] for q in first])), f"{med(alloc):.2f}",
            delta(mt, first, "peak_allocated_bytes"), delta(mt, first, "peak_requested_bytes"), f"{med(rss):.2f}",
            f"{med([m['startup_seconds'] for m in mt]):.2f} s", f"{med([q['startup_seconds'] for q in first]):.2f} s",
            f"{gap:.0e}"]


def delta(mt, pt, key):
    """memtrain's figure minus PyTorch's in MiB, median over the rounds; "-" where a side has
    none (requested bytes are CUDA's alone)."""
    d = [m[key] - q[key] for m, q in zip(mt, pt) if m.get(key) is not None and q.get(key) is not None]
    return f"{med(d) / 2**20:+.1f} MiB" if d else "-"


def snapshot_argvs(a, work, job, setting):
    """The untimed pair behind --peak-diff: each side's command writing its allocator snapshot,
    and the peak_diff command that compares them."""
    mt, out = memtrain_argv(a, work, job, setting, "snapshot")
    pt, _ = pytorch_argv(a, work, job, setting, "snapshot", None, "resident")
    mine, theirs = os.path.join(out, "snapshot.pickle"), os.path.join(work, f"pt-{job}-{setting[0]}-snapshot.pickle")
    diff = [sys.executable, os.path.join(HERE, "peak_diff.py"), mine, theirs]
    return mt + ["--set", "memory.record_history=true"], pt + ["--memory-snapshot", theirs], diff


def peak_diff(a, work, job, setting):
    """--peak-diff: the untimed pair and their comparison, into DIR/JOB-SETTING.txt."""
    os.makedirs(a.peak_diff, exist_ok=True)
    path = os.path.join(a.peak_diff, f"{job}-{setting[0]}.txt")
    with open(path, "w") as f:
        for argv in snapshot_argvs(a, work, job, setting):
            p = subprocess.run(argv, capture_output=True, text=True, env=child_env(a))
            f.write(p.stdout)
            if p.returncode != 0:
                f.write(f"# {' '.join(argv)} failed ({p.returncode}):\n{p.stderr}")
                break
    print(f"# peak diff of {job} {setting[0]}: {path}", flush=True)


def trace(a, job, setting, side, rep, result):
    """With --trace: one process's per-step wall seconds, to see where two totals part."""
    if not a.trace:
        return
    with open(a.trace, "a") as f:
        f.write(json.dumps({"job": job, "setting": setting[0], "side": side, "round": rep,
                            "step_seconds": result.get("step_seconds")}) + "\n")


def main(argv=None):
    a = parse_args(argv)
    if a.dry_run:
        return dry_run(a)
    cuda = a.device.startswith("cuda")
    counting = None if cuda else build_counting_lib(cuda)
    t0 = time.time()
    shown_for = None
    spent = lambda: a.budget and time.time() - t0 > a.budget  # noqa: E731
    left_out, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        prepared = set()
        for job, setting in rows(a):
            if spent():
                left_out.append(f"{job} {setting[0]}")
                continue
            work = os.path.join(tmp, job)
            if job not in prepared:
                prepare_job(job, work)
                prepared.add(job)
            if baselines_of(a, job) != shown_for:
                # A table per set of baselines: a ViT's rows have its two twins' columns.
                shown_for = baselines_of(a, job)
                header(a, shown_for)
            mt, pt = {m: [] for m in memtrain_sides(a)}, {b: [] for b in shown_for}
            for rep in range(a.reps):
                if rep and spent():
                    break
                for side in round_order(a, rep, job):
                    if side.startswith("mt"):
                        got = run_memtrain(a, work, job, setting, rep, side)
                        mt[side].append(got)
                    else:
                        got = run_pytorch(a, work, job, setting, rep, counting, side)
                        pt[side].append(got)
                    trace(a, job, setting, side, rep, got)
            ref = mt[memtrain_sides(a)[0]]
            for side, runs in mt.items():
                notes += [n for n in print_row(a, job, setting, runs, pt, side, ref) if n not in notes]
                if side != "mt" and runs:
                    notes.append(f"{job} {setting[0]} memtrain {side[3:]}: cuda_graph {runs[0].get('cuda_graph')}")
            if a.peak_diff:
                peak_diff(a, work, job, setting)
    print("# ratio = memtrain / PyTorch (samples/s: above 1 is faster; memory: below 1 is less), median of the rounds;"
          " median step, peak memory and start-up against each table's first baseline (a ViT's: the SDPA twin);"
          " MODE/sdpa: the ViT with a packed in-projection and scaled_dot_product_attention; start-up: launch to the first"
          " step; loss gap: the largest relative difference between the two sides' per-step losses"
          + ("; warm-up: the untimed first epoch's wall time (torch.compile's compilation, memtrain's capture)"
             if extended(a) else ""))
    for n in notes:
        print(f"# {n}")
    if left_out:
        print(f"# not measured (--budget {a.budget:.0f} s spent): {', '.join(left_out)}")


if __name__ == "__main__":
    main()
