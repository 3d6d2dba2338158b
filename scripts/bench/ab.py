#!/usr/bin/env python3
"""Benchmark (not a test): two memtrain binaries on the same jobs, alternating in fresh
processes, so a change can be measured against the build before it. Prints per job and setting
the median samples/s and peak allocated memory of each side, their ratio (B / A), and the largest
difference between the two sides' per-step losses (0 means bit-identical).

  scripts/bench/ab --a OLD_BINARY --b NEW_BINARY [--jobs mlp,resnet18] [--settings fp32] [--reps 3]

Jobs, data and timing are those of scripts/bench/run (jobs.py, driver.py): the first step is
warm-up and not timed; validation and checkpoints are outside the timed steps."""
import argparse
import json
import os
import statistics
import sys
import tempfile
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import driver  # noqa: E402
import jobs  # noqa: E402


def losses(out):
    return [json.loads(l)["loss"] for l in open(os.path.join(out, "metrics.jsonl")) if '"type":"step"' in l]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="the baseline binary")
    p.add_argument("--b", required=True, help="the binary measured against it")
    p.add_argument("--jobs", default="mlp,resnet18")
    p.add_argument("--settings", default="fp32")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    settings = [s for s in jobs.SETTINGS if s[0] in a.settings.split(",")]
    work = tempfile.mkdtemp(prefix="memtrain-ab-")
    print(f"| job | setting | samples/s A | B | ratio (range) | peak alloc A | B | ratio | loss gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for job in a.jobs.split(","):
        jw = os.path.join(work, job)
        driver.prepare_job(job, jw)
        for setting in settings:
            runs = {"a": [], "b": []}
            steps = {}
            for rep in range(a.reps):
                order = ("a", "b") if rep % 2 == 0 else ("b", "a")
                for side in order:
                    ns = SimpleNamespace(
                        memtrain=getattr(a, side), threads=a.threads, device=a.device, memtrain_set=[], alloc_conf=None
                    )
                    r = driver.run_memtrain(ns, jw, job, setting, f"{side}{rep}")
                    runs[side].append(r)
                    steps[side] = losses(os.path.join(jw, f"mt-{job}-{setting[0]}-{side}{rep}"))
            rate = {s: statistics.median(r["samples_per_s"] for r in runs[s]) for s in runs}
            ratios = [b["samples_per_s"] / x["samples_per_s"] for x, b in zip(runs["a"], runs["b"])]
            mem = {s: statistics.median(r["peak_allocated_bytes"] for r in runs[s]) for s in runs}
            gap = max((abs(x - y) / max(abs(x), 1e-12) for x, y in zip(steps["a"], steps["b"])), default=float("nan"))
            if len(steps["a"]) != len(steps["b"]):
                gap = float("nan")
            mib = lambda b: f"{b / 2**20:.1f} MiB"
            print(f"| {job} | {setting[0]} | {rate['a']:.1f} | {rate['b']:.1f} | {statistics.median(ratios):.2f} "
                  f"({min(ratios):.2f}-{max(ratios):.2f}) | {mib(mem['a'])} | {mib(mem['b'])} | "
                  f"{mem['b'] / max(mem['a'], 1):.2f} | {gap:.0e} |", flush=True)


if __name__ == "__main__":
    main()
