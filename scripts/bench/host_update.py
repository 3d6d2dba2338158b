#!/usr/bin/env python3
"""Benchmark (not a test): the optimizer update on the host. An MLP whose step is dominated by
its AdamW update (inputs 1024, hidden [4096, 4096, 4096, 4096]: about 55M parameters) at batch
8 with memory.optimizer_state = "host", trained with train.optimizer_impl = "single" and "auto"
("auto" is the fused kernel for state on the host) in fresh processes, paired and alternating.
Per run: the median step (wall time between step records) and the median host update
(step records' host_update_seconds) after the warm-up steps. Prints both per implementation,
and the per-rep ratios single / auto (median and range).

  scripts/bench/host-update [--memtrain BIN] [--reps 3] [--steps 8] [--warmup 2] [--threads 2]
"""
import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time

IMPLS = ["single", "auto"]
MODEL = 'preset = "mlp"\n[model.mlp]\ninputs = 1024\nhidden = [4096, 4096, 4096, 4096]\nnum_classes = 10\n'


def spec(impl, a):
    return (
        f'[job]\nname = "host-update"\nthreads = {a.threads}\ndevice = "{a.device}"\nseed = 0\n[model]\n{MODEL}'
        f'[data]\nsource = "synthetic"\nsamples = {8 * (a.steps + a.warmup + 2)}\nval_fraction = 0.05\n'
        f'[train]\nepochs = 1\nbatch_size = 8\noptimizer = "adamw"\nlr = 1e-4\nweight_decay = 0.01\n'
        f'optimizer_impl = "{impl}"\n[memory]\noptimizer_state = "host"\n'
        f'[checkpoint]\nevery_epochs = 0\n[log]\nevery_steps = 1\nprogress = "off"\n'
    )


def run(a, work, impl, rep):
    path = os.path.join(work, f"{impl}.toml")
    with open(path, "w") as f:
        f.write(spec(impl, a))
    out = os.path.join(work, f"{impl}-{rep}")
    p = subprocess.run([a.memtrain, "-q", "run", path, "--out", out, "--max-steps", str(a.warmup + a.steps)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"memtrain ({impl}) failed ({p.returncode}):\n{p.stderr}")
    steps = [r for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if r.get("type") == "step"]
    seconds = [s["seconds"] for s in steps[a.warmup:]]
    updates = [s.get("host_update_seconds") for s in steps[a.warmup:] if s.get("host_update_seconds")]
    return statistics.median(seconds), statistics.median(updates) if updates else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--memtrain", default=os.path.join(root, "target", "release", "memtrain"))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=8, help="timed steps (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first, at least 1 (default 2)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    if a.reps < 1 or a.steps < 1 or a.warmup < 1:
        raise SystemExit("--reps, --steps and --warmup must be at least 1")
    results = {i: [] for i in IMPLS}
    with tempfile.TemporaryDirectory(prefix="memtrain-host-update-") as work:
        for rep in range(a.reps):
            for impl in (IMPLS if rep % 2 == 0 else IMPLS[::-1]):
                results[impl].append(run(a, work, impl, rep))
    print(f"# host update: MLP 1024-4x4096-10 (55M parameters), AdamW, batch 8, state on the host, "
          f"{a.threads} thread(s), {a.device}, {a.reps} rep(s) alternating, {a.steps} timed steps; "
          f"{time.strftime('%Y-%m-%d')}")
    print("| implementation | median step | median host update |")
    print("|---|---|---|")
    for impl in IMPLS:
        step = statistics.median(r[0] for r in results[impl])
        upd = statistics.median(r[1] for r in results[impl])
        print(f"| {impl} | {step * 1000:.0f} ms | {upd * 1000:.0f} ms |")
    for k, what in ((0, "step"), (1, "host update")):
        ratios = [s[k] / f[k] for s, f in zip(results["single"], results["auto"])]
        print(f"single / auto, {what}: {statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
