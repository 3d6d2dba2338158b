#!/usr/bin/env python3
"""Benchmark (not a test): memtrain's data path on a generated imagefolder (default 20,000 JPEGs
of 80×80 in 10 classes, trained at 64 px).

1. First pass: memtrain decodes the tree into its cache with data.workers = 1 (the time from its
   own log line), beside torchvision's ImageFolder with PIL (Resize(64), CenterCrop(64),
   PILToTensor, one thread) over the same files: images/s per core.
2. Training a small ResNet (resnet18 at 64 px, batch 32, crop and flip augmentation, normalized)
   from the cache, in fresh processes, alternating in each rep: the cache read through a memory
   map (data.memory_map = true), read whole into memory (false), and mapped with the batches made
   in the step (data.prefetch = 0). Per run, after the warm-up steps: samples/s from the step
   records' `seconds`, and the data wait (step records' data_wait_seconds) as a share of step
   time. Medians over the reps, with the mapped / in-memory ratio.
3. Peak anonymous memory (RssAnon, polled) of the mapped and the in-memory run on a tenth of the
   images and on all of them, and what the tenfold set added.

  scripts/bench/data-loader [--memtrain BIN] [--images 20000] [--reps 3] [--steps 30] [--warmup 5]
                            [--threads 2] [--work DIR]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

SIZE = 64
SOURCE = 80
CLASSES = 10


def generate(root, n):
    """n JPEGs of SOURCE² in CLASSES directories: a class tint over noise and a gradient."""
    import numpy as np
    from PIL import Image

    if os.path.isdir(root) and sum(len(f) for _, _, f in os.walk(root)) >= n:
        return
    rng = np.random.default_rng(0)
    ramp = np.linspace(0, 255, SOURCE, dtype=np.float32)
    for i in range(n):
        c = i % CLASSES
        d = os.path.join(root, f"class{c}")
        os.makedirs(d, exist_ok=True)
        noise = rng.integers(0, 96, (SOURCE, SOURCE, 3), dtype=np.uint8)
        img = noise + np.stack([np.full((SOURCE, SOURCE), 16 * c), ramp[None, :].repeat(SOURCE, 0), ramp[:, None].repeat(SOURCE, 1)], -1).astype(np.uint8) // 2
        Image.fromarray(img.astype(np.uint8)).save(os.path.join(d, f"{i:06}.jpg"), quality=90)


def subset(root, sub, n):
    """The first n images of root (by name, as many per class), hard-linked into sub."""
    if os.path.isdir(sub):
        return
    for c in sorted(os.listdir(root)):
        os.makedirs(os.path.join(sub, c))
        for f in sorted(os.listdir(os.path.join(root, c)))[: n // CLASSES]:
            os.link(os.path.join(root, c, f), os.path.join(sub, c, f))


def spec(root, a, memory_map, prefetch, workers=0):
    return (
        f'[job]\nname = "data-loader"\nthreads = {a.threads}\ndevice = "cpu"\nseed = 0\n'
        f'[model]\npreset = "resnet18"\n[model.resnet18]\nnum_classes = {CLASSES}\nimage_size = {SIZE}\n'
        f'[data]\nsource = "imagefolder"\npath = "{root}"\nval_fraction = 0.02\nmemory_map = {str(memory_map).lower()}\n'
        f'prefetch = {prefetch}\nworkers = {workers}\nmean = [0.5, 0.5, 0.5]\nstd = [0.25, 0.25, 0.25]\n'
        f'[data.augment]\ncrop_padding = 4\nhorizontal_flip = true\n'
        f'[train]\nepochs = 1\nbatch_size = 32\noptimizer = "sgd"\nlr = 0.05\nmomentum = 0.9\n'
        f'[checkpoint]\nevery_epochs = 0\n[log]\nevery_steps = 1\nprogress = "off"\n'
    )


def peak_rss_anon(pid, out):
    peak = 0
    while True:
        try:
            with open(f"/proc/{pid}/status") as f:
                status = f.read()
        except OSError:
            break
        if re.search(r"^State:\s+Z", status, re.M):
            break
        m = re.search(r"^RssAnon:\s+(\d+)", status, re.M)
        peak = max(peak, int(m.group(1)) * 1024 if m else 0)
        time.sleep(0.01)
    out.append(peak)


def run(a, work, name, text, steps, verbose=False):
    path = os.path.join(work, f"{name}.toml")
    with open(path, "w") as f:
        f.write(text)
    out = os.path.join(work, "runs", name)
    shutil.rmtree(out, ignore_errors=True)
    argv = [a.memtrain, "-v" if verbose else "-q", "run", path, "--out", out, "--max-steps", str(steps)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = []
    poll = threading.Thread(target=peak_rss_anon, args=(p.pid, peak))
    poll.start()
    stdout, stderr = p.communicate()
    poll.join()
    if p.returncode != 0:
        raise SystemExit(f"memtrain ({name}) failed ({p.returncode}):\n{stderr}")
    records = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    return [r for r in records if r.get("type") == "step"], stderr, peak[0]


def first_pass(a, work, root):
    """memtrain's decode rate with one worker, from its log line; then PIL's."""
    shutil.rmtree(root.rstrip("/") + ".memtrain-cache", ignore_errors=True)
    _, stderr, _ = run(a, work, "decode", spec(root, a, True, 2, workers=1), 1, verbose=True)
    m = re.search(r"decoded (\d+) images in ([\d.]+) s", stderr)
    if not m:
        raise SystemExit(f"no decode line in memtrain's log:\n{stderr}")
    ours = int(m.group(1)) / float(m.group(2))
    import torch
    import torchvision
    from torchvision import transforms as T

    torch.set_num_threads(1)
    ds = torchvision.datasets.ImageFolder(root, transform=T.Compose([T.Resize(SIZE), T.CenterCrop(SIZE), T.PILToTensor()]))
    t0 = time.perf_counter()
    for i in range(len(ds)):
        ds[i]
    pil = len(ds) / (time.perf_counter() - t0)
    return ours, pil


def timed(steps, a):
    """samples/s over the steps after the warm-up, and the data wait's share of their time."""
    after = steps[a.warmup:]
    span = sum(s["seconds"] for s in after)
    rate = sum(s["samples"] for s in after) / span
    share = sum(s["data_wait_seconds"] for s in after) / span
    return rate, share


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--memtrain", default=os.path.join(repo, "target", "release", "memtrain"))
    p.add_argument("--images", type=int, default=20000)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="timed steps (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first, at least 1 (default 5)")
    p.add_argument("--threads", type=int, default=2, help="libtorch's threads (job.threads)")
    p.add_argument("--work", help="where the images and runs go (kept); default a temporary directory")
    a = p.parse_args()
    if a.reps < 1 or a.steps < 1 or a.warmup < 1:
        raise SystemExit("--reps, --steps and --warmup must be at least 1")
    work = a.work or tempfile.mkdtemp(prefix="memtrain-data-loader-")
    os.makedirs(work, exist_ok=True)
    root, small = os.path.join(work, "images"), os.path.join(work, "tenth")
    t0 = time.perf_counter()
    generate(root, a.images)
    print(f"# {a.images} images of {SOURCE}x{SOURCE} in {root} ({time.perf_counter() - t0:.0f} s to make)", flush=True)
    ours, pil = first_pass(a, work, root)
    print("\n## First pass: decoding to 64 px, images/s per core\n")
    print("| memtrain (data.workers = 1) | torchvision ImageFolder + PIL (1 thread) | ratio |\n|---|---|---|")
    print(f"| {ours:.0f} | {pil:.0f} | {ours / pil:.2f}x |", flush=True)

    configs = [("mapped", True, 2), ("in memory", False, 2), ("mapped, in the step", True, 0)]
    results = {c[0]: [] for c in configs}
    for rep in range(a.reps):
        for name, mapped, prefetch in configs[rep % len(configs):] + configs[: rep % len(configs)]:
            steps, _, _ = run(a, work, f"{name}-{rep}".replace(" ", "-").replace(",", ""), spec(root, a, mapped, prefetch), a.warmup + a.steps)
            results[name].append(timed(steps, a))
    med = {n: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for n, v in results.items()}
    print(f"\n## resnet18 at 64 px, batch 32, {a.threads} threads, median of {a.reps} ({a.steps} steps after {a.warmup})\n")
    print("| data | samples/s | ratio to in memory | data wait, share of step time |\n|---|---|---|---|")
    for name, _, _ in configs:
        rate, share = med[name]
        print(f"| {name} | {rate:.1f} | {rate / med['in memory'][0]:.3f} | {100 * share:.1f}% |")

    subset(root, small, a.images // 10)
    print(f"\n## Peak anonymous memory (RssAnon), {a.warmup} steps\n")
    print(f"| data | {a.images // 10} images | {a.images} images | added | pixels added |\n|---|---|---|---|---|")
    pixels = (a.images - a.images // 10 // CLASSES * CLASSES) * 3 * SIZE * SIZE
    for name, mapped in [("mapped", True), ("in memory", False)]:
        peaks = [run(a, work, f"rss-{name}-{i}".replace(" ", "-"), spec(r, a, mapped, 2), a.warmup)[2] for i, r in enumerate([small, root])]
        print(f"| {name} | {peaks[0] >> 20} MiB | {peaks[1] >> 20} MiB | {(peaks[1] - peaks[0]) >> 20} MiB | {pixels >> 20} MiB |")


if __name__ == "__main__":
    main()
