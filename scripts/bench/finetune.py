"""Fine-tuning in memtrain beside the same fine-tune in plain PyTorch (transformers and peft): a
benchmark, not a test. Run it through scripts/bench/finetune, which builds memtrain and picks the
bootstrap environment's Python.

Each job (finetune_jobs.py) is a Hugging Face model, a ViTForImageClassification or a
LlamaForCausalLM, built randomly initialised and saved with save_pretrained; memtrain reads the
saved directory through model.init_from, the PyTorch side (finetune_job.py) with from_pretrained.
Each is trained three ways (--modes):

  full     every parameter
  lora     rank-16 adapters on every attention and MLP linear (a ViT's head trained beside
           them); PyTorch: peft's LoraConfig, both sides from the same initial adapters
  frozen   the head alone over a frozen backbone; PyTorch: requires_grad_(False)

with the same AdamW, learning rate, batch, steps and precision, the data resident on the device.
The rounds are scripts/bench/run's (driver.py): REPS rounds of fresh processes, one memtrain and
one PyTorch, the order reversed in odd rounds; samples/s (a decoder's tokens/s: samples times
seq_len target tokens) over the steps after the first epoch, from the wall time between steps;
peak allocated tensor memory over the steps (the counting allocator on the CPU, the caching
allocator's peak on CUDA); medians, and the memtrain/PyTorch ratios per round. The loss gap is
the largest relative difference between the two sides' per-step losses: within about 1e-6 in fp32, as
the two compute the same steps in a different order of operations (a packed in-projection
against three, a chunked loss against whole logits).

--dry-run prints the commands instead of running them (no GPU or torch needed).
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import driver  # noqa: E402  (the counting allocator, memtrain's records, medians, the loss gap)
import finetune_jobs as fj  # noqa: E402

JOB_SCRIPT = os.path.join(HERE, "finetune_job.py")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtrain", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", default=None, help=f"default: {','.join(fj.CPU_JOBS)} on the CPU, "
                                                f"{','.join(fj.GPU_JOBS)} on CUDA; all: {','.join(fj.JOBS)}")
    p.add_argument("--modes", default=None,
                   help="full, lora, frozen, comma-separated (default: all three for a ViT, full,lora for a decoder)")
    p.add_argument("--precisions", default=None, help="fp32, bf16-mixed, fp16-mixed (default: fp32 on the CPU, "
                                                      "bf16-mixed on CUDA)")
    p.add_argument("--seq-len", type=int, default=0, help="a decoder's window (default: the job's)")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds: start no new round after this; rows print with the rounds they have")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = p.parse_args(argv)
    cuda = a.device.startswith("cuda")
    a.jobs = (a.jobs or ",".join(fj.GPU_JOBS if cuda else fj.CPU_JOBS)).split(",")
    unknown = [j for j in a.jobs if j not in fj.JOBS]
    if unknown:
        p.error(f"no job {', '.join(unknown)}; the jobs: {', '.join(fj.JOBS)}")
    a.modes = a.modes.split(",") if a.modes else None
    bad = [m for m in a.modes or [] if m not in fj.MODES]
    if bad:
        p.error(f"no mode {', '.join(bad)}: {', '.join(fj.MODES)}")
    a.precisions = (a.precisions or ("bf16-mixed" if cuda else "fp32")).split(",")
    bad = [x for x in a.precisions if x not in fj.PRECISIONS]
    if bad:
        p.error(f"no precision {', '.join(bad)}: {', '.join(fj.PRECISIONS)}")
    return a


def seq_len(a, job):
    return a.seq_len or fj.JOBS[job].get("seq_len", 0)


def rows(a):
    for job in a.jobs:
        for mode in a.modes or fj.DEFAULT_MODES[fj.JOBS[job]["kind"]]:
            for precision in a.precisions:
                yield job, mode, precision


def window(a, job):
    """A decoder's --seq-len argument; nothing for a ViT."""
    return ["--seq-len", str(seq_len(a, job))] if fj.JOBS[job]["kind"] == "llama" else []


def make_argv(a, job, work):
    return [sys.executable, JOB_SCRIPT, "make", "--job", job, "--out", work] + window(a, job)


def memtrain_argv(a, work, job, mode, precision, rep):
    """Writes the row's spec (once) and gives memtrain's command line and its run directory."""
    spec = os.path.join(work, f"{job}-{mode}-{precision}.toml")
    if not os.path.exists(spec):
        os.makedirs(work, exist_ok=True)
        with open(spec, "w") as f:
            f.write(fj.memtrain_spec(job, work, mode, precision, a.threads, a.device, seq_len(a, job)))
    out = os.path.join(work, f"mt-{mode}-{precision}-{rep}")
    return [a.memtrain, "-q", "run", spec, "--out", out, "--max-steps", str(fj.JOBS[job]["steps"])], out


def pytorch_argv(a, work, job, mode, precision, rep, counting):
    result = os.path.join(work, f"pt-{mode}-{precision}-{rep}.json")
    cmd = [sys.executable, JOB_SCRIPT, "train", "--job", job, "--work", work, "--mode", mode,
           "--precision", precision, "--steps", str(fj.JOBS[job]["steps"]), *window(a, job), "--threads", str(a.threads), "--device", a.device, "--result", result]
    if counting:
        cmd += ["--counting", counting]
    return cmd, result


def run_side(a, work, job, mode, precision, rep, counting, side):
    if side == "mt":
        argv, out = memtrain_argv(a, work, job, mode, precision, rep)
    else:
        argv, out = pytorch_argv(a, work, job, mode, precision, rep, counting)
    launched = time.time()
    p = subprocess.run(argv + ([] if side == "mt" else ["--launched", str(launched)]), capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{'memtrain' if side == 'mt' else 'PyTorch'} {job} {mode} {precision} failed "
                         f"({p.returncode}):\n{' '.join(argv)}\n{p.stderr}")
    if side == "mt":
        got = driver.read_memtrain(out, launched)
        got["trained_parameters"] = trained_parameters(out)
        return got
    return json.load(open(out))


def trained_parameters(out):
    """The parameters memtrain's run trained, from its summary.json."""
    return json.load(open(os.path.join(out, "summary.json")))["training"]["trainable_parameters"]


def describe(a, job):
    j = fj.JOBS[job]
    size = f"seq_len {seq_len(a, job)}, {j['samples']} windows" if j["kind"] == "llama" else f"{j['samples']} images"
    return (f"# {job}: {j['kind']} {j['config']}, {size}, batch {j['batch_size']}, {j['steps']} steps "
            f"({fj.steps_per_epoch(job)} a epoch), AdamW lr {j['lr']} weight decay {j['weight_decay']}")


def dry_run(a):
    work = tempfile.mkdtemp(prefix="memtrain-finetune-dry.")
    print(f"# dry run: {a.device}, jobs {','.join(a.jobs)}, precisions {','.join(a.precisions)}, {a.reps} rounds; "
          f"specs written under {work}")
    counting = None if a.device.startswith("cuda") else os.path.join(driver.ROOT, "target", "bench",
                                                                     "libmemtrain_shim.so")
    for job in a.jobs:
        print(describe(a, job))
        print(" ".join(make_argv(a, job, os.path.join(work, job))))
    for job, mode, precision in rows(a):
        print(f"# {job} {mode} {precision}")
        for rep in range(a.reps):
            for side in (["mt", "pt"] if rep % 2 == 0 else ["pt", "mt"]):
                w = os.path.join(work, job)
                argv = (memtrain_argv(a, w, job, mode, precision, rep)[0] if side == "mt"
                        else pytorch_argv(a, w, job, mode, precision, rep, counting)[0])
                print(" ".join(argv))


def header(a, kind):
    import torch
    import transformers
    import peft

    rate = "tokens/s" if kind == "llama" else "samples/s"
    print(f"# memtrain vs PyTorch {torch.__version__} (transformers {transformers.__version__}, peft "
          f"{peft.__version__}) on {a.device}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"{a.threads} threads, {a.reps} alternating rounds per row; {time.strftime('%Y-%m-%d')}")
    if a.device.startswith("cuda"):
        print(f"# GPU: {torch.cuda.get_device_name(0)}")
    cols = ["job", "mode", "precision", "trained params", f"{rate} memtrain", "PyTorch", "ratio (range)",
            "median-step ratio", "peak alloc memtrain", "PyTorch", "ratio", "Δ peak alloc", "loss gap"]
    print("| " + " | ".join(cols) + " |")
    print("|---" * len(cols) + "|")


def count(n):
    return "-" if n is None else f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def print_row(a, job, mode, precision, mt, pt):
    med, spread = driver.med, driver.spread
    per = seq_len(a, job) if fj.JOBS[job]["kind"] == "llama" else 1
    rate = [m["samples_per_s"] / q["samples_per_s"] for m, q in zip(mt, pt)]
    step = [m["median_step_samples_per_s"] / q["median_step_samples_per_s"] for m, q in zip(mt, pt)]
    alloc = [m["peak_allocated_bytes"] / q["peak_allocated_bytes"] for m, q in zip(mt, pt)]
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    trained = {m.get("trained_parameters") for m in mt}, {q["trained_parameters"] for q in pt}
    ours, theirs = (count(next(iter(t))) for t in trained)
    gap = max(driver.loss_gap(m, q) for m, q in zip(mt, pt))
    cells = [job, mode, precision, ours if ours == theirs or ours == "-" else f"{ours} / {theirs}",
             f"{med([m['samples_per_s'] for m in mt]) * per:.1f}", f"{med([q['samples_per_s'] for q in pt]) * per:.1f}",
             f"{med(rate):.2f} ({spread(rate)})", f"{med(step):.2f}", mib(med([m["peak_allocated_bytes"] for m in mt])),
             mib(med([q["peak_allocated_bytes"] for q in pt])), f"{med(alloc):.2f}",
             driver.delta(mt, pt, "peak_allocated_bytes"),
             f"{gap:.0e}" + ("" if len(mt) == a.reps else f" ({len(mt)} of {a.reps} rounds)")]
    print("| " + " | ".join(cells) + " |", flush=True)


def main(argv=None):
    a = parse_args(argv)
    if a.dry_run:
        return dry_run(a)
    cuda = a.device.startswith("cuda")
    counting = None if cuda else driver.build_counting_lib(cuda)
    t0 = time.time()
    spent = lambda: a.budget and time.time() - t0 > a.budget  # noqa: E731
    left_out, shown = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for job, mode, precision in rows(a):
            if spent():
                left_out.append(f"{job} {mode} {precision}")
                continue
            work = os.path.join(tmp, job)
            if not os.path.exists(work):
                subprocess.run(make_argv(a, job, work), check=True, capture_output=True)
            if shown != job:
                shown = job
                print(describe(a, job))
                header(a, fj.JOBS[job]["kind"])
            mt, pt = [], []
            for rep in range(a.reps):
                if rep and spent():
                    break
                for side in (["mt", "pt"] if rep % 2 == 0 else ["pt", "mt"]):
                    got = run_side(a, work, job, mode, precision, rep, counting, side)
                    (mt if side == "mt" else pt).append(got)
            print_row(a, job, mode, precision, mt, pt)
    print("# ratio = memtrain / PyTorch (throughput: above 1 is faster; memory: below 1 is less), median of the rounds"
          " with their range; Δ peak alloc: memtrain's minus PyTorch's; loss gap: the largest relative difference"
          " between the two sides' per-step losses")
    if left_out:
        print(f"# not measured (--budget {a.budget:.0f} s spent): {', '.join(left_out)}")


if __name__ == "__main__":
    main()
