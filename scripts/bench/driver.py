#!/usr/bin/env python3
"""memtrain beside plain PyTorch, for every preset with a PyTorch twin and every precision: a
benchmark, not a test. Run it through scripts/bench/run, which builds memtrain and picks the
bootstrap environment's Python.

For each job (jobs.py) and setting, REPS pairs of fresh processes, the order alternating
(memtrain first in even pairs, PyTorch first in odd ones), each training the same steps from the
same initial weights on the same data in the same order. Per process:

  samples/s      over the steps after the first (each side times its own steps)
  median step    samples/s of the median step after the first: a step the scheduler preempted
                 (other work on a shared machine) moves the total above but not this
  peak alloc     tensor bytes at their peak over the training steps: on the CPU both sides count
                 with memtrain's counting allocator (src/shim/shim.cpp, built into a shared
                 library for the Python side and installed with c10::SetCPUAllocator); on CUDA the
                 caching allocator's max_memory_allocated
  peak RSS       the kernel's high-water mark (VmHWM), reset when training starts
  start-up       from the process's launch to the start of its first step (imports, libtorch,
                 model, data)

and prints medians, the memtrain/PyTorch ratios (median of the per-pair ratios, with their
range over the pairs), and the machine.
"""
import argparse
import json
import os
import platform
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


def run_memtrain(a, work, job, setting, rep):
    name, precision, ckpt = setting
    spec = os.path.join(work, f"{job}-{name}.toml")
    with open(spec, "w") as f:
        f.write(jobs.memtrain_spec(job, os.path.join(work, "init.safetensors"), os.path.join(work, "data.npz"),
                                   os.path.join(work, "val.npz"), precision, ckpt, a.threads, a.device))
    out = os.path.join(work, f"mt-{job}-{name}-{rep}")
    launched = time.time()
    p = subprocess.run([a.memtrain, "-q", "run", spec, "--out", out, "--max-steps", str(jobs.JOBS[job]["steps"])],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"memtrain {job} {name} failed ({p.returncode}):\n{p.stderr}")
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    steps = [l for l in lines if l["type"] == "step"]
    summary = json.load(open(os.path.join(out, "summary.json")))
    first_start = steps[0]["time"] - steps[0]["seconds"]
    timed = steps[1:]
    return {
        "startup_seconds": first_start - launched,
        "samples_per_s": sum(s["samples"] for s in timed) / max(sum(s["seconds"] for s in timed), 1e-12),
        "median_step_samples_per_s": statistics.median(s["samples"] / max(s["seconds"], 1e-12) for s in timed),
        "peak_allocated_bytes": max(s["memory"].get("peak_allocated_bytes", 0) for s in steps),
        "peak_rss_bytes": summary["memory"]["peak_rss_bytes"],
        "checkpointing": summary["precision"]["activation_checkpointing"],
        "losses": [s["loss"] for s in steps],
    }


def run_pytorch(a, work, job, setting, rep, counting):
    name, precision, ckpt = setting
    result = os.path.join(work, f"pt-{job}-{name}-{rep}.json")
    cmd = [sys.executable, os.path.join(HERE, "pytorch_job.py"), "train", "--job", job,
           "--init", os.path.join(work, "init.safetensors"), "--data", os.path.join(work, "data.npz"),
           "--val", os.path.join(work, "val.npz"),
           "--precision", precision, "--steps", str(jobs.JOBS[job]["steps"]), "--threads", str(a.threads),
           "--device", a.device, "--result", result]
    if ckpt:
        cmd.append("--checkpointing")
    if counting:
        cmd += ["--counting", counting]
    launched = time.time()
    p = subprocess.run(cmd + ["--launched", str(launched)], capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"PyTorch {job} {name} failed ({p.returncode}):\n{p.stderr}")
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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtrain", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", default=",".join(jobs.JOBS))
    p.add_argument("--settings", default=",".join(s[0] for s in jobs.SETTINGS))
    a = p.parse_args()
    cuda = a.device.startswith("cuda")
    counting = None if cuda else build_counting_lib(cuda)
    wanted = set(a.settings.split(","))
    settings = [s for s in jobs.SETTINGS if s[0] in wanted]
    import torch

    print(f"# memtrain vs plain PyTorch {torch.__version__} on {a.device}: {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, {a.threads} threads, {a.reps} alternating pairs per row; {time.strftime('%Y-%m-%d')}")
    if cuda:
        print(f"# GPU: {torch.cuda.get_device_name(0)}")
    header = ("| job | setting | samples/s memtrain | PyTorch | ratio (range) | median-step ratio (range) "
              "| peak alloc memtrain | PyTorch | ratio | peak RSS ratio | start-up memtrain | PyTorch | loss gap |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    with tempfile.TemporaryDirectory() as tmp:
        for job in a.jobs.split(","):
            work = os.path.join(tmp, job)
            prepare_job(job, work)
            for setting in settings:
                if setting[2] and jobs.JOBS[job]["preset"] == "mlp":
                    continue  # not a chain of blocks: memtrain skips checkpointing, so would PyTorch
                mt, pt = [], []
                for rep in range(a.reps):
                    order = ["mt", "pt"] if rep % 2 == 0 else ["pt", "mt"]
                    for side in order:
                        if side == "mt":
                            mt.append(run_memtrain(a, work, job, setting, rep))
                        else:
                            pt.append(run_pytorch(a, work, job, setting, rep, counting))
                rate = [m["samples_per_s"] / q["samples_per_s"] for m, q in zip(mt, pt)]
                step = [m["median_step_samples_per_s"] / q["median_step_samples_per_s"] for m, q in zip(mt, pt)]
                alloc = [m["peak_allocated_bytes"] / q["peak_allocated_bytes"] for m, q in zip(mt, pt)]
                rss = [m["peak_rss_bytes"] / q["peak_rss_bytes"] for m, q in zip(mt, pt)]
                mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
                print(f"| {job} | {setting[0]} | {med([m['samples_per_s'] for m in mt]):.1f} "
                      f"| {med([q['samples_per_s'] for q in pt]):.1f} | {med(rate):.2f} ({spread(rate)}) "
                      f"| {med(step):.2f} ({spread(step)}) "
                      f"| {mib(med([m['peak_allocated_bytes'] for m in mt]))} "
                      f"| {mib(med([q['peak_allocated_bytes'] for q in pt]))} | {med(alloc):.2f} "
                      f"| {med(rss):.2f} | {med([m['startup_seconds'] for m in mt]):.2f} s "
                      f"| {med([q['startup_seconds'] for q in pt]):.2f} s "
                      f"| {max(loss_gap(m, q) for m, q in zip(mt, pt)):.0e} |", flush=True)
    print("# ratio = memtrain / PyTorch (samples/s: above 1 is faster; memory: below 1 is less), median of the pairs;"
          " start-up: launch to the first step; loss gap: the largest relative difference between the two sides'"
          " per-step losses")


if __name__ == "__main__":
    main()
