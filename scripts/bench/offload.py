#!/usr/bin/env python3
"""Benchmark (not a test): how far the levers that move model state off the device (
memory.optimizer_state, memory.gradients, memory.activations, memory.parameters = "host") take
fp32 AdamW training of torchvision's ViT-B/16, ViT-L/16 and ViT-H/14 under a memory cap.

For each model, the same job (a few steps on tiny random 224x224 data, no checkpoint) runs
uncapped with no lever (the baseline), uncapped with activation checkpointing (the baseline of
combinations that recompute: `act` and `params` bring recomputation along) and, for each lever
combination, under the cap (default 4 GiB). Every process is fresh; within a rep the baseline and the combinations run in one order,
the next rep in the reverse order (the alternation of scripts/bench/run), and each capped run's
samples/s is divided by the baseline's of the same rep. Per run:

  outcome      trained (exit 0), OOM (exit 3), error (anything else; the first error line is
               printed below the table), timeout
  device peak  summary.json memory.peak_allocated_bytes (tensor bytes: the cap's count on the CPU,
               the caching allocator's on CUDA)
  host peak    summary.json memory.peak_host_bytes (model state the levers keep in host memory;
               absent = 0; the largest step record's figure where the summary lacks it)
  samples/s    the samples of the steps after the warm-up over their step records' `seconds`
               (each from the end of the step before to its own, on CUDA on the device's
               clock, so the GPU's work is inside)
  host update  the median step's host update (step records' host_update_seconds) as bandwidth:
               28 bytes per parameter for AdamW (parameter, gradient and two moments read,
               parameter and moments written), beside a memcpy of 1 GiB measured first

and the table shows medians over the reps (samples/s and ratio only over reps that trained), then
per combination the largest model that trained under the cap in every rep. The OOM policy is
memory.on_oom = ["fail"], so a combination is measured as it is (no backoff changes the batch).

  scripts/bench/offload --dry-run
  scripts/bench/offload --models vit_b16 --combos none --reps 1
  scripts/bench/offload --combos none,opt,opt+grad,opt+grad+act,opt+grad+act+params --reps 3

Combination names: `none`, or lever tokens joined by `+`: opt (memory.optimizer_state), grad
(memory.gradients), act (memory.activations), params (memory.parameters), each set to "host";
and oom-offload (memory.on_oom = ["offload", "fail"]). A memtrain without these keys refuses the
spec (exit 2): the row says error."""
import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# torchvision's builders: vit_b_16, vit_l_16, vit_h_14 (VisionTransformer's arguments).
MODELS = {
    "vit_b16": {"torchvision": "vit_b_16", "image_size": 224, "patch_size": 16, "layers": 12, "heads": 12,
                "hidden_dim": 768, "mlp_dim": 3072, "parameters": 86_567_656},
    "vit_l16": {"torchvision": "vit_l_16", "image_size": 224, "patch_size": 16, "layers": 24, "heads": 16,
                "hidden_dim": 1024, "mlp_dim": 4096, "parameters": 304_326_632},
    "vit_h14": {"torchvision": "vit_h_14", "image_size": 224, "patch_size": 14, "layers": 32, "heads": 16,
                "hidden_dim": 1280, "mlp_dim": 5120, "parameters": 632_045_800},
}
NUM_CLASSES = 1000

LEVERS = {
    "opt": ["memory.optimizer_state=host"],
    "grad": ["memory.gradients=host"],
    "act": ["memory.activations=host"],
    "params": ["memory.parameters=host"],
    "oom-offload": ['memory.on_oom=["offload","fail"]'],
}
# Combinations whose levers bring recomputation along: compared with the recompute baseline too.
RECOMPUTES = ("act", "params")


def combo_sets(combo):
    """The --set arguments of a combination name."""
    if combo == "none":
        return []
    sets = []
    for token in combo.split("+"):
        if token not in LEVERS:
            raise SystemExit(f"unknown lever {token!r} in combination {combo!r}; known: none, {', '.join(LEVERS)}")
        sets += LEVERS[token]
    return sets


def spec_text(model, data, val, a):
    m = MODELS[model]
    opts = {k: v for k, v in m.items() if k not in ("torchvision", "parameters")}
    lines = [
        "[job]", f'name = "offload-{model}"', f"threads = {a.threads}", f'device = "{a.device}"', "seed = 0",
        "[model]", 'preset = "vit"', "[model.vit]", *[f"{k} = {v}" for k, v in opts.items()],
        "dropout = 0.0", "attention_dropout = 0.0", f"num_classes = {NUM_CLASSES}",
        "[data]", 'source = "npz"', f'path = "{data}"', f'val_path = "{val}"',
        "[train]", "epochs = 1", f"batch_size = {a.batch_size}", 'optimizer = "adamw"', "lr = 1e-4",
        "weight_decay = 0.05", 'precision = "fp32"',
        "[memory]", 'on_oom = ["fail"]',
        "[checkpoint]", "every_epochs = 0",
        "[log]", "every_steps = 1", 'progress = "off"',
    ]
    return "\n".join(lines) + "\n"


def write_data(path, n, image_size, seed):
    """Random images and labels: the timed steps never reach the end of the epoch."""
    import numpy as np

    g = np.random.default_rng(seed)
    x = g.standard_normal([n, 3, image_size, image_size]).astype(np.float32)
    y = (np.arange(n) % NUM_CLASSES).astype(np.int64)
    np.savez(path, x=x, y=y)


def command(a, spec, out, combo, capped):
    cmd = [a.memtrain, "-q", "run", spec, "--out", out, "--max-steps", str(a.warmup + a.steps)]
    if capped:
        cmd += ["--set", f"memory.limit={a.limit}"]
    if combo == "recompute":
        cmd += ["--set", "train.activation_checkpointing=true"]
        combo = "none"
    for s in combo_sets(combo):
        cmd += ["--set", s]
    return cmd


def wall_rate(steps, warmup):
    """Samples per second over the step records after the warm-up, from their `seconds` (each from
    the end of the step before to its own; on CUDA on the device's clock)."""
    if warmup < 1 or len(steps) <= warmup:
        return None
    timed = steps[warmup:]
    seconds = sum(s["seconds"] for s in timed)
    return sum(s["samples"] for s in timed) / seconds if seconds > 0 else None


def memcpy_gbs(device):
    """GB/s of a 1 GiB copy in host memory (read and write counted), the median of 5."""
    import torch

    src = torch.ones(1 << 28)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * 4 / statistics.median(times) / 1e9


def first_error(stderr):
    for line in stderr.splitlines():
        if line.startswith("error:") or " ERROR " in f" {line}":
            return line.strip()
    lines = [l for l in stderr.splitlines() if l.strip()]
    return lines[-1].strip() if lines else "(no output)"


def read_run(out):
    """(summary or None, step records) of a run directory."""
    summary, steps = None, []
    try:
        summary = json.load(open(os.path.join(out, "summary.json")))
    except (OSError, ValueError):
        pass
    try:
        for line in open(os.path.join(out, "metrics.jsonl")):
            r = json.loads(line)
            if r.get("type") == "step":
                steps.append(r)
    except (OSError, ValueError):
        pass
    return summary, steps


def run_one(a, spec, out, combo, capped):
    cmd = command(a, spec, out, combo, capped)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        rc, stderr = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stderr = None, (e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    summary, steps = read_run(out)
    mem = (summary or {}).get("memory") or {}
    device_peak = mem.get("peak_allocated_bytes")
    if device_peak is None and steps:
        device_peak = max(s["memory"].get("peak_allocated_bytes") or 0 for s in steps)
    host_peak = mem.get("peak_host_bytes")
    if host_peak is None and (summary or steps):
        host_peak = max([s["memory"].get("peak_host_bytes") or 0 for s in steps], default=0)
    timed = steps[a.warmup:]
    updates = sorted(s["host_update_seconds"] for s in timed if s.get("host_update_seconds"))
    if rc == 0 and len(steps) >= a.warmup + a.steps:
        outcome = "trained"
    elif rc == 0:
        outcome = "error"
        stderr = f"only {len(steps)} of {a.warmup + a.steps} steps recorded"
    elif rc == 3:
        outcome = "OOM"
    elif rc is None:
        outcome = "timeout"
    else:
        outcome = "error"
    return {
        "outcome": outcome,
        "device_peak": device_peak,
        "host_peak": host_peak,
        "samples_per_s": wall_rate(steps, a.warmup) if outcome == "trained" else None,
        "host_update_s": updates[len(updates) // 2] if updates else None,
        "error": None if outcome == "trained" else first_error(stderr) if outcome != "timeout" else f"over {a.timeout} s",
    }


def gib(b):
    return "-" if b is None else f"{b / 2**30:.2f} GiB"


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def outcome_of(runs):
    kinds = sorted({r["outcome"] for r in runs})
    if len(kinds) == 1:
        return kinds[0]
    return "/".join(f"{k} {sum(r['outcome'] == k for r in runs)}" for k in kinds)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtrain", required=True)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    p.add_argument("--combos", default="none,opt,opt+grad,opt+grad+act,opt+grad+act+params",
                   help="comma-separated lever combinations (see above)")
    p.add_argument("--reps", type=int, default=3, help="runs of each row, alternating order (default 3)")
    p.add_argument("--steps", type=int, default=3, help="timed steps after the warm-up (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (at least 1: the timed steps run "
                   "from the last warm-up step's record; default 1)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--limit", default="4GiB", help="the cap of the capped runs (default 4GiB)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run before it counts as timeout")
    p.add_argument("--keep", action="store_true", help="keep the work directory (specs, data, run directories)")
    p.add_argument("--dry-run", action="store_true", help="write the specs and data, print the commands, run nothing")
    a = p.parse_args()
    models = a.models.split(",")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r}; known: {', '.join(MODELS)}")
    combos = a.combos.split(",")
    for c in combos:
        combo_sets(c)
    if a.reps < 1 or a.steps < 1 or a.warmup < 1:
        raise SystemExit("--reps, --steps and --warmup must be at least 1")

    work = tempfile.mkdtemp(prefix="memtrain-offload-")
    samples = (a.warmup + a.steps + 1) * a.batch_size
    data, val = os.path.join(work, "data.npz"), os.path.join(work, "val.npz")
    write_data(data, samples, 224, 0)
    write_data(val, 2, 224, 1)
    specs = {}
    for m in models:
        specs[m] = os.path.join(work, f"{m}.toml")
        with open(specs[m], "w") as f:
            f.write(spec_text(m, data, val, a))
    # Per rep: the baseline (uncapped, no lever) then each combination under the cap; reversed on
    # odd reps.
    baselines = [("baseline", False)]
    if any(t in RECOMPUTES for c in combos for t in c.split("+")):
        baselines.append(("recompute", False))
    runs = baselines + [(c, True) for c in combos]

    if a.dry_run:
        print(f"# work directory: {work} (specs and data written; nothing run)")
        for m in models:
            for rep in range(a.reps):
                order = runs if rep % 2 == 0 else runs[::-1]
                for combo, capped in order:
                    out = os.path.join(work, f"{m}-{combo}-{rep}")
                    print(shlex.join(command(a, specs[m], out, "none" if combo == "baseline" else combo, capped)))
        return

    import torch

    cpu = platform.processor() or platform.machine()
    print(f"# model state off the device: fp32 AdamW, batch {a.batch_size}, {a.steps} timed steps after {a.warmup} "
          f"warm-up, cap {a.limit}, on {a.device} ({cpu}, {os.cpu_count()} cores, {a.threads} threads"
          f"{', ' + torch.cuda.get_device_name(0) if a.device.startswith('cuda') else ''}), {a.reps} rep(s) "
          f"alternating; {time.strftime('%Y-%m-%d')}", flush=True)
    copy_gbs = memcpy_gbs(a.device)
    print(f"# host memcpy: {copy_gbs:.1f} GB/s (1 GiB, read + write)", flush=True)
    results = {}
    errors = []
    header = ("| model | combination | outcome | device peak | host peak | samples/s | ratio to uncapped (range) "
              "| ratio to uncapped with recompute | host update GB/s (of memcpy) |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|", flush=True)
    for m in models:
        per = {c: [] for c, _ in runs}
        for rep in range(a.reps):
            order = runs if rep % 2 == 0 else runs[::-1]
            for combo, capped in order:
                out = os.path.join(work, f"{m}-{combo}-{rep}")
                r = run_one(a, specs[m], out, "none" if combo == "baseline" else combo, capped)
                r["rep"] = rep
                per[combo].append(r)
                if not a.keep:
                    shutil.rmtree(out, ignore_errors=True)
        def ratio_to(rs, baseline):
            base = {r["rep"]: r["samples_per_s"] for r in per.get(baseline, [])}
            ratios = [r["samples_per_s"] / base[r["rep"]] for r in rs
                      if r["samples_per_s"] is not None and base.get(r["rep"])]
            return "-" if not ratios else f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"

        for combo, capped in runs:
            rs = per[combo]
            rate = med([r["samples_per_s"] for r in rs])
            label = {"baseline": "none, uncapped", "recompute": "recompute, uncapped"}.get(combo, combo)
            recomputes = capped and any(t in RECOMPUTES for t in combo.split("+"))
            upd = med([r["host_update_s"] for r in rs])
            bw = "-" if upd is None else f"{MODELS[m]['parameters'] * 28 / upd / 1e9:.1f} ({MODELS[m]['parameters'] * 28 / upd / 1e9 / copy_gbs:.0%})"
            print(f"| {m} | {label} | {outcome_of(rs)} | {gib(med([r['device_peak'] for r in rs]))} "
                  f"| {gib(med([r['host_peak'] for r in rs]))} | {'-' if rate is None else f'{rate:.2f}'} "
                  f"| {ratio_to(rs, 'baseline')} | {ratio_to(rs, 'recompute') if recomputes else '-'} | {bw} |",
                  flush=True)
            for r in rs:
                if r["error"] and r["outcome"] != "trained":
                    errors.append(f"{m} {label} rep {r['rep']}: {r['outcome']}: {r['error']}")
            results[(m, combo)] = rs
    print()
    print(f"Largest model that trained under {a.limit} (in every rep), per combination:")
    print()
    print("| combination | largest model |")
    print("|---|---|")
    by_size = sorted(models, key=lambda m: MODELS[m]["parameters"])
    for combo in combos:
        fits = [m for m in by_size if all(r["outcome"] == "trained" for r in results[(m, combo)])]
        if fits:
            largest = f"{fits[-1]} ({MODELS[fits[-1]]['parameters'] / 1e6:.0f}M parameters)"
        else:
            largest = "none of " + ", ".join(by_size)
        print(f"| {combo} | {largest} |")
    if errors:
        print()
        print("Runs that did not train:")
        for e in errors:
            print(f"- {e}")
    if a.keep:
        print(f"\n# work directory kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
