#!/usr/bin/env python3
"""Benchmark (not a test): memtrain's optimizer implementations on the CPU,
train.optimizer_impl = "single", "foreach" and "fused", on the same jobs in fresh processes,
paired and alternating (each rep runs the three in a rotated order). Prints per job and
optimizer the median step time of each implementation (the first step is warm-up and not
timed; a step is forward, backward and the optimizer update, so the jobs are chosen with a
small batch, where the update is a large part of the step), the median and range of the
per-rep ratios against "single", and the largest relative gap between the per-step losses
and "single"'s (0: identical; fused computes in another order). One libtorch thread by default:
on a loaded machine two OpenMP threads on two cores make step times bimodal (a step waits for a
descheduled thread), which no median over five reps smooths out.

  scripts/bench/optim-impl [--memtrain target/release/memtrain] [--jobs mlp-small,mlp-large,resnet18]
                           [--optimizers adamw,sgd] [--reps 5] [--steps 30] [--threads 1]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
IMPLS = ["single", "foreach", "fused"]

# (model table, parameters in words): a small MLP (launch overhead dominates), a large one
# (memory traffic dominates), ResNet18 on 16x16 images (62 tensors of very different sizes).
JOBS = {
    "mlp-small": ('preset = "mlp"\n[model.mlp]\ninputs = 64\nhidden = [64, 32]\nnum_classes = 4\n', "6.3K parameters in 6 tensors"),
    "mlp-large": ('preset = "mlp"\n[model.mlp]\ninputs = 1024\nhidden = [2048, 2048]\nnum_classes = 10\n', "6.3M parameters in 6 tensors"),
    "resnet18": ('preset = "resnet18"\n[model.resnet18]\nnum_classes = 10\nimage_size = 16\n', "11.2M parameters in 62 tensors"),
}
OPTIMIZERS = {
    "adamw": 'optimizer = "adamw"\nlr = 0.001\nweight_decay = 0.01\n',
    "sgd": 'optimizer = "sgd"\nlr = 0.01\nmomentum = 0.9\nweight_decay = 0.0005\n',
}


def spec(job, optim, impl, threads, steps):
    model, _ = JOBS[job]
    return (
        f'[job]\nname = "bench"\nthreads = {threads}\ndevice = "cpu"\nseed = 0\n[model]\n{model}'
        f'[data]\nsource = "synthetic"\nsamples = {4 * (steps + 2)}\nval_fraction = 0.05\n'
        f'[train]\nepochs = 1\nbatch_size = 4\n{OPTIMIZERS[optim]}optimizer_impl = "{impl}"\n'
        f'[memory]\npreflight = false\n[checkpoint]\nevery_epochs = 0\n[log]\nevery_steps = 1\nprogress = "off"\n'
    )


def run(a, work, job, optim, impl, rep):
    path = os.path.join(work, f"{job}-{optim}-{impl}.toml")
    with open(path, "w") as f:
        f.write(spec(job, optim, impl, a.threads, a.steps))
    out = os.path.join(work, f"{job}-{optim}-{impl}-{rep}")
    p = subprocess.run([a.memtrain, "-q", "run", path, "--out", out, "--max-steps", str(a.steps)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"memtrain {job} {optim} {impl} failed ({p.returncode}):\n{p.stderr}")
    steps = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"type":"step"' in l]
    start = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl")) if '"type":"start"' in l][0]
    assert start.get("optimizer_impl") == impl, (impl, start.get("optimizer_impl"))
    return {
        "step_ms": statistics.median(s["seconds"] for s in steps[1:]) * 1e3,
        "losses": [s["loss"] for s in steps],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtrain", default=os.path.join(ROOT, "target", "release", "memtrain"))
    p.add_argument("--jobs", default="mlp-small,mlp-large,resnet18")
    p.add_argument("--optimizers", default="adamw,sgd")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    work = tempfile.mkdtemp(prefix="memtrain-optim-impl-")
    print("| job | optimizer | step ms single | foreach | fused | foreach / single (range) | fused / single (range) | loss gap foreach | fused |")
    print("|---|---|---|---|---|---|---|---|---|")
    for job in a.jobs.split(","):
        for optim in a.optimizers.split(","):
            runs = {i: [] for i in IMPLS}
            for rep in range(a.reps):
                order = IMPLS[rep % 3:] + IMPLS[:rep % 3]
                for impl in order:
                    runs[impl].append(run(a, work, job, optim, impl, rep))
            med = {i: statistics.median(r["step_ms"] for r in runs[i]) for i in IMPLS}

            def ratio(i):
                rs = [x["step_ms"] / s["step_ms"] for x, s in zip(runs[i], runs["single"])]
                return f"{statistics.median(rs):.2f} ({min(rs):.2f}-{max(rs):.2f})"

            def gap(i):
                a_, b_ = runs["single"][0]["losses"], runs[i][0]["losses"]
                return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a_, b_))

            print(f"| {job} ({JOBS[job][1]}) | {optim} | {med['single']:.2f} | {med['foreach']:.2f} | {med['fused']:.2f} | "
                  f"{ratio('foreach')} | {ratio('fused')} | {gap('foreach'):.0e} | {gap('fused'):.0e} |", flush=True)


if __name__ == "__main__":
    main()
