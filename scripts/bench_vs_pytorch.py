#!/usr/bin/env python3
"""memtrain vs plain PyTorch on the same job: a benchmark, not a test.

Run it through scripts/bench-vs-pytorch (which builds memtrain and picks the right Python).
Subcommands:

  init     --out FILE            write the MLP's initial weights (torch.manual_seed) as safetensors,
                                 with memtrain's names (fc0.weight, fc0.bias, ...)
  pytorch  --result FILE ...     train the job in plain PyTorch in this process, write a JSON result
  bench    --memtrain BIN ...    R repetitions, memtrain and PyTorch alternating (ABBA), each in a
                                 fresh process; prints medians and ratios

The job (defaults): mlp 64 -> 1024 -> 1024 -> 10 on data/digits.npz (val_fraction 0.2, so 1438
training samples), batch 64, Adam lr 1e-3 (PyTorch defaults otherwise), 5 epochs, 2 CPU threads.
Both sides start from the same weights (memtrain reads them with model.init_from) and do the same
work per step: forward, sum cross-entropy / mean over the batch, backward, Adam step, one read of
the batch's loss and correct count. Both validate after every epoch; validation is not timed.
Data order differs (memtrain shuffles with its own generator, PyTorch with randperm); the number
of samples per epoch and the batch size are the same.

Measures, per process:
  train_seconds     sum over epochs of the training loop's wall time (no validation, no startup)
  samples_per_s     samples trained / train_seconds
  peak RSS (train)  the kernel's VmHWM over the training window, reset (/proc/self/clear_refs 5) at
                    the start of training: memtrain's summary.json memory.peak_rss_bytes measures
                    the same way (reset each epoch, max over epochs)
  baseline RSS      PyTorch: the process's RSS right after `import torch`; memtrain: the RSS that
                    `memtrain info --json` reports (libtorch loaded, nothing trained)
  ru_maxrss         PyTorch only: lifetime peak (getrusage); memtrain resets the high-water mark
                    itself, so its lifetime peak is not available the same way
  CUDA              peak allocated / reserved of the caching allocator over training
"""
import argparse
import json
import math
import os
import platform
import statistics
import struct
import subprocess
import sys
import tempfile
import time

# ---------------------------------------------------------------------------------------------
# /proc helpers (no torch needed)


def proc_status_bytes(field, pid="self"):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ---------------------------------------------------------------------------------------------
# safetensors by hand (the venv has no safetensors package)


def write_safetensors(path, named_arrays):
    import numpy as np

    header, offset, blobs = {}, 0, []
    for name, a in named_arrays:
        a = np.ascontiguousarray(a, dtype="<f4")
        b = a.tobytes()
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_safetensors(path):
    import numpy as np

    dtypes = {"F32": "<f4", "F64": "<f8", "I64": "<i8", "I32": "<i4", "F16": "<f2"}
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        s, e = info["data_offsets"]
        a = np.frombuffer(data, dtype=dtypes[info["dtype"]], count=(e - s) // np.dtype(dtypes[info["dtype"]]).itemsize,
                          offset=8 + n + s)
        out[name] = a.reshape(info["shape"]).copy()
    return out


# ---------------------------------------------------------------------------------------------
# The PyTorch side


def build_mlp(torch, inputs, hidden, classes):
    dims = [inputs] + hidden + [classes]
    layers = []
    for i in range(len(dims) - 1):
        layers.append(torch.nn.Linear(dims[i], dims[i + 1]))
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def linear_layers(model):
    import torch

    return [m for m in model if isinstance(m, torch.nn.Linear)]


def cmd_init(a):
    import torch

    torch.manual_seed(a.seed)
    model = build_mlp(torch, a.inputs, parse_hidden(a.hidden), a.classes)
    named = []
    for i, lin in enumerate(linear_layers(model)):
        named.append((f"fc{i}.weight", lin.weight.detach().numpy()))
        named.append((f"fc{i}.bias", lin.bias.detach().numpy()))
    write_safetensors(a.out, named)


def cmd_pytorch(a):
    t_proc = time.perf_counter()
    import numpy as np
    import torch
    import torch.nn.functional as F

    baseline_rss = proc_status_bytes("VmRSS")
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    if dev.type == "cuda":
        torch.cuda.init()
    torch.manual_seed(a.seed)

    hidden = parse_hidden(a.hidden)
    model = build_mlp(torch, a.inputs, hidden, a.classes)
    if a.init:
        w = read_safetensors(a.init)
        with torch.no_grad():
            for i, lin in enumerate(linear_layers(model)):
                lin.weight.copy_(torch.from_numpy(w[f"fc{i}.weight"]))
                lin.bias.copy_(torch.from_numpy(w[f"fc{i}.bias"]))
    model.to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr)

    # Data on the CPU, one batch moved to the device per step (as memtrain does).
    with np.load(a.data) as z:
        x_all = torch.from_numpy(np.asarray(z["x"], dtype=np.float32).reshape(len(z["y"]), -1).copy())
        y_all = torch.from_numpy(np.asarray(z["y"], dtype=np.int64).copy())
    n = len(y_all)
    n_val = min(max(1, int(math.floor(n * a.val_fraction + 0.5))), n - 1)  # Rust's f64::round
    g = torch.Generator().manual_seed(a.seed)
    split = torch.randperm(n, generator=g)
    val_idx, train_idx = split[:n_val], split[n_val:]
    x_tr, y_tr = x_all[train_idx].contiguous(), y_all[train_idx].contiguous()
    x_va, y_va = x_all[val_idx].contiguous(), y_all[val_idx].contiguous()
    n_train = len(y_tr)
    B = a.batch_size

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    rss_before_training = proc_status_bytes("VmRSS")
    hwm_reset = reset_peak_rss()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)

    epochs, train_seconds, samples = [], 0.0, 0
    cpu0 = time.process_time()
    for epoch in range(a.epochs):
        order = torch.randperm(n_train, generator=g)
        model.train()
        sync()
        t0 = time.perf_counter()
        loss_sum, correct = 0.0, 0
        for s in range(0, n_train, B):
            idx = order[s : s + B]
            x = x_tr.index_select(0, idx).to(dev)
            y = y_tr.index_select(0, idx).to(dev)
            opt.zero_grad()
            logits = model(x)
            loss = F.cross_entropy(logits, y)
            loss.backward()
            opt.step()
            # One read of the step's loss and correct count, like memtrain's per-step records.
            loss_sum += loss.item() * len(idx)
            correct += int((logits.argmax(-1) == y).sum().item())
        sync()
        secs = time.perf_counter() - t0
        train_seconds += secs
        samples += n_train

        # Validation, untimed: eval mode, no grad, batches of B.
        model.eval()
        vloss, vcorrect = 0.0, 0
        with torch.no_grad():
            for s in range(0, len(y_va), B):
                x = x_va[s : s + B].to(dev)
                y = y_va[s : s + B].to(dev)
                logits = model(x)
                vloss += F.cross_entropy(logits, y, reduction="sum").item()
                vcorrect += int((logits.argmax(-1) == y).sum().item())
        epochs.append({
            "epoch": epoch + 1, "seconds": secs, "samples_per_s": n_train / secs,
            "train_loss": loss_sum / n_train, "train_acc": correct / n_train,
            "val_loss": vloss / len(y_va), "val_acc": vcorrect / len(y_va),
        })
    sync()
    cpu_train_val = time.process_time() - cpu0
    peak_train = proc_status_bytes("VmHWM")
    import resource

    result = {
        "side": "pytorch", "device": str(dev), "torch": torch.__version__, "threads": torch.get_num_threads(),
        "train_samples": n_train, "val_samples": len(y_va), "samples_trained": samples,
        "train_seconds": train_seconds, "samples_per_s": samples / max(train_seconds, 1e-9),
        "cpu_seconds_train_val": cpu_train_val,
        "final": epochs[-1], "epochs": epochs,
        "baseline_rss_bytes": baseline_rss, "rss_before_training_bytes": rss_before_training,
        "peak_rss_train_bytes": peak_train, "peak_rss_train_window": "training" if hwm_reset else "lifetime",
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "adam_impl": "foreach (default on CUDA)" if dev.type == "cuda" else "single-tensor (default on CPU)",
        "process_seconds_after_import": time.perf_counter() - t_proc,
    }
    if dev.type == "cuda":
        result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(dev)
        result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved(dev)
    with open(a.result, "w") as f:
        json.dump(result, f, indent=1)


def parse_hidden(s):
    return [int(v) for v in str(s).split(",") if v.strip()]


# ---------------------------------------------------------------------------------------------
# The driver


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mib(b):
    return None if b is None else b / 2**20


def machine_lines(device):
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    lines = [f"machine: {platform.node()}  {os.cpu_count()} logical CPUs (nproc {len(os.sched_getaffinity(0))})  CPU: {model}"]
    try:
        with open("/proc/loadavg") as f:
            la = " ".join(f.read().split()[:3])
        lines.append(f"load average at start: {la}")
    except OSError:
        pass
    if device.startswith("cuda"):
        try:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.strip()
            lines.append(f"GPU: {gpu or 'unknown'}")
        except (OSError, subprocess.SubprocessError):
            lines.append("GPU: unknown (no nvidia-smi)")
    lines.append("NOTE: this machine may be shared with other jobs; timings are noisy. Runs are interleaved "
                 "(ABBA) and medians reported to soften that, not to remove it.")
    return lines


def proc_cpu_seconds(pid):
    """user + system CPU seconds of a live process (all threads), from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def run_timed(cmd, log, watch=None):
    """Runs cmd to completion; returns (wall seconds, CPU seconds (user + system, all threads), exit code).

    watch: (metrics.jsonl path, number of epochs): also returns the CPU seconds the process spent
    between its "start" record and its last "epoch" record (training and validation), polled."""
    t0 = time.perf_counter()
    window = {}
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        f, buf, epochs = None, "", 0
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG if watch else 0)
            if pid:
                break
            if f is None and os.path.exists(watch[0]):
                f = open(watch[0])
            if f is not None:
                buf += f.read()
                *lines, buf = buf.split("\n")
                for line in lines:
                    kind = json.loads(line).get("type") if line.strip() else None
                    if kind == "start":
                        window["start"] = proc_cpu_seconds(p.pid)
                    elif kind == "epoch":
                        epochs += 1
                        if epochs == watch[1]:
                            window["end"] = proc_cpu_seconds(p.pid)
            time.sleep(0.005)
        if f is not None:
            f.close()
        p.returncode = os.waitstatus_to_exitcode(status)
    cpu_window = None
    if window.get("start") is not None and window.get("end") is not None:
        cpu_window = window["end"] - window["start"]
    return time.perf_counter() - t0, ru.ru_utime + ru.ru_stime, p.returncode, cpu_window


def memtrain_spec(a, data_path, init_path):
    hidden = ", ".join(str(h) for h in parse_hidden(a.hidden))
    return f"""[job]
name = "bench_vs_pytorch"
seed = {a.seed}
device = "{a.device}"
threads = {a.threads}

[model]
preset = "mlp"
init_from = "{init_path}"

[model.mlp]
inputs = {a.inputs}
hidden = [{hidden}]
num_classes = {a.classes}

[data]
source = "npz"
path = "{data_path}"
val_fraction = {a.val_fraction}

[train]
epochs = {a.epochs}
batch_size = {a.batch_size}
optimizer = "adam"
lr = {a.lr}

[checkpoint]
every_epochs = 0
"""


def run_memtrain(a, work, spec, rep):
    out = os.path.join(work, f"memtrain-{rep}")
    log = os.path.join(work, f"memtrain-{rep}.log")
    wall, cpu, rc, cpu_window = run_timed([a.memtrain, "-q", "run", spec, "--out", out], log=log,
                                          watch=(os.path.join(out, "metrics.jsonl"), a.epochs))
    if rc != 0:
        sys.exit(f"memtrain failed (exit {rc}); log: {log}\n" + open(log).read()[-3000:])
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    start, epochs = {}, []
    with open(os.path.join(out, "metrics.jsonl")) as f:
        for line in f:
            r = json.loads(line)
            if r.get("type") == "start":
                start = r
            elif r.get("type") == "epoch":
                epochs.append(r["seconds"])
    m = s.get("memory", {})
    return {
        "wall_seconds": wall, "process_cpu_seconds": cpu, "train_seconds": s["train_seconds"],
        "cpu_seconds_train_val": cpu_window,
        "epoch_seconds": epochs, "fastest_epoch_seconds": min(epochs) if epochs else None, "samples_per_s": s["samples_per_s"],
        "samples_trained": s["samples_trained"], "train_samples": start.get("train_samples"),
        "peak_rss_train_bytes": m.get("peak_rss_bytes"), "val_acc": (s.get("final") or {}).get("val_acc"),
        "peak_allocated_bytes": m.get("peak_allocated_bytes"), "peak_reserved_bytes": m.get("peak_reserved_bytes"),
        "device": s.get("device"),
    }


def run_pytorch(a, work, init_path, data_path, rep):
    res = os.path.join(work, f"pytorch-{rep}.json")
    log = os.path.join(work, f"pytorch-{rep}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "pytorch", "--result", res, "--init", init_path,
           "--data", data_path] + job_args(a)
    wall, cpu, rc, _ = run_timed(cmd, log=log)
    if rc != 0:
        sys.exit(f"the PyTorch run failed (exit {rc}); log: {log}\n" + open(log).read()[-3000:])
    with open(res) as f:
        r = json.load(f)
    r["wall_seconds"] = wall
    r["process_cpu_seconds"] = cpu
    r["epoch_seconds"] = [e["seconds"] for e in r["epochs"]]
    r["fastest_epoch_seconds"] = min(r["epoch_seconds"])
    r["val_acc"] = r["final"]["val_acc"]
    return r


def job_args(a):
    return ["--device", a.device, "--threads", str(a.threads), "--epochs", str(a.epochs),
            "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--hidden", a.hidden,
            "--inputs", str(a.inputs), "--classes", str(a.classes), "--seed", str(a.seed),
            "--val-fraction", str(a.val_fraction)]


def memtrain_baseline_rss(a):
    try:
        p = subprocess.run([a.memtrain, "info", "--json"], capture_output=True, text=True, timeout=120)
        return json.loads(p.stdout)["host"]["process_rss_bytes"]
    except (OSError, subprocess.SubprocessError, ValueError, KeyError):
        return None


def cmd_bench(a):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    data_path = os.path.abspath(a.data or os.path.join(root, "data", "digits.npz"))
    work = a.work or tempfile.mkdtemp(prefix="bench-vs-pytorch-")
    os.makedirs(work, exist_ok=True)
    init_path = os.path.join(work, "init.safetensors")
    subprocess.run([sys.executable, os.path.abspath(__file__), "init", "--out", init_path, "--seed", str(a.seed),
                    "--hidden", a.hidden, "--inputs", str(a.inputs), "--classes", str(a.classes)], check=True)
    spec = os.path.join(work, "job.toml")
    with open(spec, "w") as f:
        f.write(memtrain_spec(a, data_path, init_path))

    print("\n".join(machine_lines(a.device)))
    print(f"job: mlp {a.inputs} -> {' -> '.join(str(h) for h in parse_hidden(a.hidden))} -> {a.classes}, "
          f"{os.path.relpath(data_path, root) if data_path.startswith(root) else data_path}, batch {a.batch_size}, "
          f"adam lr {a.lr}, {a.epochs} epochs, {a.threads} threads, device {a.device}; {a.reps} repetitions "
          f"(+{a.warmup} warm-up pair) in {work}")
    sys.stdout.flush()

    base_mt = memtrain_baseline_rss(a)
    for w in range(a.warmup):
        print(f"warm-up {w + 1}/{a.warmup} (not counted) ...", flush=True)
        run_memtrain(a, work, spec, f"warmup{w}")
        run_pytorch(a, work, init_path, data_path, f"warmup{w}")

    mt, pt = [], []
    for rep in range(a.reps):
        # ABBA: alternate which side goes first so slow drift in the machine's load hits both.
        order = ["memtrain", "pytorch"] if rep % 2 == 0 else ["pytorch", "memtrain"]
        for side in order:
            if side == "memtrain":
                r = run_memtrain(a, work, spec, rep)
                mt.append(r)
            else:
                r = run_pytorch(a, work, init_path, data_path, rep)
                pt.append(r)
            print(f"rep {rep + 1}/{a.reps} {side:8s}  train {r['train_seconds']:7.3f} s  "
                  f"{r['samples_per_s']:8.1f} samples/s  peak RSS {mib(r['peak_rss_train_bytes']):7.1f} MiB  "
                  f"val acc {100 * r['val_acc']:.1f}%  process {r['wall_seconds']:.1f} s", flush=True)

    if mt and pt and mt[0]["train_samples"] != pt[0]["train_samples"]:
        print(f"WARNING: training samples per epoch differ: memtrain {mt[0]['train_samples']}, "
              f"PyTorch {pt[0]['train_samples']}")
    try:
        with open("/proc/loadavg") as f:
            print("load average at end: " + " ".join(f.read().split()[:3]))
    except OSError:
        pass
    print_table(a, mt, pt, base_mt)
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"memtrain": mt, "pytorch": pt, "memtrain_baseline_rss_bytes": base_mt}, f, indent=1)


def print_table(a, mt, pt, base_mt):
    def col(rows, key):
        return median([r.get(key) for r in rows])

    base_pt = col(pt, "baseline_rss_bytes")
    rows = []

    def add(label, m, p, fmt, ratio=True, note=""):
        fm = fmt(m) if m is not None else "n/a"
        fp = fmt(p) if p is not None else "n/a"
        r = f"{m / p:.3f}" if ratio and m is not None and p not in (None, 0) else ""
        rows.append((label, fm, fp, r, note))

    f3 = lambda v: f"{v:.3f}"
    f1 = lambda v: f"{v:.1f}"
    fmib = lambda v: f"{mib(v):.1f}"
    fpct = lambda v: f"{100 * v:.2f}%"
    add("train seconds (sum of epochs)", col(mt, "train_seconds"), col(pt, "train_seconds"), f3,
        note=">1: memtrain slower")
    add("samples/s", col(mt, "samples_per_s"), col(pt, "samples_per_s"), f1, note="<1: memtrain slower")
    add("fastest epoch, seconds", col(mt, "fastest_epoch_seconds"), col(pt, "fastest_epoch_seconds"), f3,
        note="least disturbed by other load")
    add("CPU seconds, training + validation", col(mt, "cpu_seconds_train_val"), col(pt, "cpu_seconds_train_val"),
        f3, note="user+sys, all threads; less sensitive to time-slicing")
    add("process wall seconds", col(mt, "wall_seconds"), col(pt, "wall_seconds"), f3,
        note="whole process: startup, imports, data, validation, checkpoint")
    add("process CPU seconds", col(mt, "process_cpu_seconds"), col(pt, "process_cpu_seconds"), f3,
        note="user+sys, all threads, whole process")
    add("peak RSS in training, MiB", col(mt, "peak_rss_train_bytes"), col(pt, "peak_rss_train_bytes"), fmib,
        note=">1: memtrain uses more")
    add("baseline RSS, MiB", base_mt, base_pt, fmib, note="memtrain info / after import torch")
    gm = [r["peak_rss_train_bytes"] - base_mt for r in mt if r.get("peak_rss_train_bytes") and base_mt]
    gp = [r["peak_rss_train_bytes"] - r["baseline_rss_bytes"] for r in pt
          if r.get("peak_rss_train_bytes") and r.get("baseline_rss_bytes")]
    add("RSS growth over baseline, MiB", median(gm), median(gp), fmib, note="peak in training - baseline")
    gt = [r["peak_rss_train_bytes"] - r["rss_before_training_bytes"] for r in pt
          if r.get("peak_rss_train_bytes") and r.get("rss_before_training_bytes")]
    add("PyTorch RSS at training start, MiB", None, col(pt, "rss_before_training_bytes"), fmib, ratio=False,
        note="after model, Adam (imports torch._dynamo), data")
    add("PyTorch RSS growth in training, MiB", None, median(gt), fmib, ratio=False)
    add("PyTorch lifetime ru_maxrss, MiB", None, col(pt, "ru_maxrss_bytes"), fmib, ratio=False)
    if a.device.startswith("cuda"):
        add("CUDA peak allocated, MiB", col(mt, "peak_allocated_bytes"), col(pt, "peak_allocated_bytes"), fmib)
        add("CUDA peak reserved, MiB", col(mt, "peak_reserved_bytes"), col(pt, "peak_reserved_bytes"), fmib)
    add("final val accuracy", col(mt, "val_acc"), col(pt, "val_acc"), fpct, ratio=False,
        note="data order differs; should be close")

    head = ("median of %d reps" % len(mt), "memtrain", "pytorch", "mt/pt", "")
    w = [max(len(str(r[i])) for r in rows + [head]) for i in range(5)]
    line = lambda r: "  ".join([str(r[0]).ljust(w[0])] + [str(r[i]).rjust(w[i]) for i in (1, 2, 3)] + [r[4]])
    print()
    print(line(head))
    print("-" * (sum(w[:4]) + 8))
    for r in rows:
        print(line(r))
    print()
    for name, rs in (("memtrain", mt), ("pytorch", pt)):
        eps = "; ".join(" ".join(f"{v:.2f}" for v in r["epoch_seconds"]) for r in rs)
        print(f"{name} epoch seconds per rep: {eps}")
    print(f"PyTorch Adam: {pt[0].get('adam_impl') if pt else '?'}; memtrain Adam: its own single-tensor "
          f"implementation (src/optim/).")

    # A one-line answer, with the noise stated next to it.
    tm, tp = col(mt, "train_seconds"), col(pt, "train_seconds")
    rm, rp = col(mt, "peak_rss_train_bytes"), col(pt, "peak_rss_train_bytes")
    spread = max(max(r["train_seconds"] for r in rs) / min(r["train_seconds"] for r in rs) for rs in (mt, pt))
    if tm and tp:
        speed = "slower" if tm > tp else "faster"
        mem = ""
        if rm and rp:
            mem = f"; peak RSS in training {'more' if rm > rp else 'less'} by {abs(rm / rp - 1) * 100:.0f}%"
        print(f"\nanswer: memtrain is {abs(tm / tp - 1) * 100:.0f}% {speed} than plain PyTorch in median train "
              f"time{mem}. Largest max/min train time over reps of one side: {spread:.2f}x"
              + (" -- the machine is noisy; differences under that spread are not meaningful." if spread > 1.15 else "."))


# ---------------------------------------------------------------------------------------------


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def job(sp):
        sp.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
        sp.add_argument("--threads", type=int, default=2)
        sp.add_argument("--epochs", type=int, default=5)
        sp.add_argument("--batch-size", type=int, default=64)
        sp.add_argument("--lr", type=float, default=1e-3)
        sp.add_argument("--hidden", default="1024,1024")
        sp.add_argument("--inputs", type=int, default=64)
        sp.add_argument("--classes", type=int, default=10)
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--val-fraction", type=float, default=0.2)

    sp = sub.add_parser("init")
    sp.add_argument("--out", required=True)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--hidden", default="1024,1024")
    sp.add_argument("--inputs", type=int, default=64)
    sp.add_argument("--classes", type=int, default=10)

    sp = sub.add_parser("pytorch")
    job(sp)
    sp.add_argument("--result", required=True)
    sp.add_argument("--init", help="initial weights (safetensors, memtrain names)")
    sp.add_argument("--data", required=True)

    sp = sub.add_parser("bench")
    job(sp)
    sp.add_argument("--memtrain", required=True, help="the memtrain binary")
    sp.add_argument("--reps", type=int, default=int(os.environ.get("BENCH_REPS", 5)))
    sp.add_argument("--warmup", type=int, default=int(os.environ.get("BENCH_WARMUP", 1)),
                    help="untimed pairs first (page cache, CPU clocks); default 1")
    sp.add_argument("--data", help="default: data/digits.npz")
    sp.add_argument("--work", help="where runs go (default: a new temporary directory)")
    sp.add_argument("--json-out", help="also write every rep's numbers here")

    a = p.parse_args()
    {"init": cmd_init, "pytorch": cmd_pytorch, "bench": cmd_bench}[a.cmd](a)


if __name__ == "__main__":
    main()
