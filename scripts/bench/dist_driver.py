#!/usr/bin/env python3
"""Data-parallel training, memtrain beside PyTorch's DistributedDataParallel: a benchmark, not a
test. Run it through scripts/bench/dist, which builds memtrain and picks the bootstrap
environment's Python.

For each job and each of 1 and 2 ranks, with and without sharded optimizer state, REPS pairs of
fresh launches, alternating which side goes first: `memtrain run --nproc N` (with
train.shard_optimizer_state) against `torchrun --nproc-per-node N ddp_job.py` (DDP, with
ZeroRedundancyOptimizer). Both train the same steps from the same weights on the same groups, the
effective batch split across ranks the same way, the machine's threads split between the ranks.
Per launch:

  samples/s       global (all ranks), over the steps after the first, as rank 0 times them
  peak alloc      per rank, tensor bytes at their peak over the training steps, counted on both
                  sides by memtrain's counting CPU allocator; the table shows the largest rank
  peak RSS        per rank (VmHWM); the largest rank

Prints medians, memtrain/PyTorch ratios (median of the per-pair ratios, with their range) and the
largest relative gap between the two sides' per-step losses.
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
import driver  # noqa: E402
import jobs  # noqa: E402

# memtrain splits a group at micro-batch boundaries when it has a micro-batch per rank.
ACCUMULATION = 2


def micro_of(job):
    return jobs.JOBS[job]["train"]["batch_size"] // ACCUMULATION


def run_memtrain(a, work, job, ranks, sharded, rep):
    spec = os.path.join(work, f"mt-{ranks}-{sharded}.toml")
    text = jobs.memtrain_spec(job, os.path.join(work, "init.safetensors"), os.path.join(work, "data.npz"),
                              os.path.join(work, "val.npz"), "fp32", False, a.threads // ranks, "cpu",
                              batch_size=micro_of(job), accumulation=ACCUMULATION, shard_optimizer_state=sharded)
    with open(spec, "w") as f:
        f.write(text)
    out = os.path.join(work, f"mt-{ranks}-{sharded}-{rep}")
    cmd = [a.memtrain, "-q", "run", spec, "--out", out, "--max-steps", str(jobs.JOBS[job]["steps"])]
    if ranks > 1:
        cmd += ["--nproc", str(ranks)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"memtrain {job} x{ranks} failed ({p.returncode}):\n{p.stderr}")
    lines = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    steps = [l for l in lines if l["type"] == "step"]
    mem = json.load(open(os.path.join(out, "summary.json")))["memory"]
    ranks_mem = mem.get("ranks") or [mem]
    timed = steps[1:]
    return {
        "samples_per_s": sum(s["samples"] for s in timed) / max(sum(s["seconds"] for s in timed), 1e-12),
        "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in ranks_mem),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks_mem),
        "losses": [s["loss"] for s in steps],
    }


def run_ddp(a, work, job, ranks, sharded, rep, counting):
    result = os.path.join(work, f"pt-{ranks}-{sharded}-{rep}.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
           "--master-port", str(29500 + rep % 50), os.path.join(HERE, "ddp_job.py"), "--job", job,
           "--init", os.path.join(work, "init.safetensors"), "--data", os.path.join(work, "data.npz"),
           "--micro", str(micro_of(job)), "--accumulation", str(ACCUMULATION),
           "--steps", str(jobs.JOBS[job]["steps"]), "--threads", str(a.threads // ranks),
           "--counting", counting, "--result", result]
    if sharded:
        cmd.append("--zero")
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS=str(a.threads // ranks))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"DDP {job} x{ranks} failed ({p.returncode}):\n{p.stderr[-4000:]}")
    r = json.load(open(result))
    return {
        "samples_per_s": r["samples_per_s"],
        "peak_allocated_bytes": max(x["peak_allocated_bytes"] for x in r["ranks"]),
        "peak_rss_bytes": max(x["peak_rss_bytes"] for x in r["ranks"]),
        "losses": r["losses"],
    }


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtrain", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--jobs", default="mlp,vit")
    a = p.parse_args()
    counting = driver.build_counting_lib(False)
    import torch

    print(f"# data-parallel: memtrain --nproc vs torchrun + DistributedDataParallel, PyTorch {torch.__version__}, "
          f"Gloo on the CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, {a.threads} threads "
          f"split between the ranks, {a.reps} alternating pairs per row; {time.strftime('%Y-%m-%d')}")
    header = ("| job | ranks | sharded state | samples/s memtrain | DDP | ratio (range) | peak alloc per rank memtrain "
              "| DDP | ratio | peak RSS per rank ratio | loss gap |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
    med = driver.med
    with tempfile.TemporaryDirectory() as tmp:
        for job in a.jobs.split(","):
            work = os.path.join(tmp, job)
            driver.prepare_job(job, work)
            for ranks, sharded in [(1, False), (2, False), (2, True)]:
                mt, pt = [], []
                for rep in range(a.reps):
                    for side in (["mt", "pt"] if rep % 2 == 0 else ["pt", "mt"]):
                        if side == "mt":
                            mt.append(run_memtrain(a, work, job, ranks, sharded, rep))
                        else:
                            pt.append(run_ddp(a, work, job, ranks, sharded, rep, counting))
                rate = [m["samples_per_s"] / q["samples_per_s"] for m, q in zip(mt, pt)]
                alloc = [m["peak_allocated_bytes"] / q["peak_allocated_bytes"] for m, q in zip(mt, pt)]
                rss = [m["peak_rss_bytes"] / q["peak_rss_bytes"] for m, q in zip(mt, pt)]
                gap = max(driver.loss_gap(m, q) for m, q in zip(mt, pt))
                print(f"| {job} | {ranks} | {'yes' if sharded else 'no'} "
                      f"| {med([m['samples_per_s'] for m in mt]):.1f} | {med([q['samples_per_s'] for q in pt]):.1f} "
                      f"| {med(rate):.2f} ({driver.spread(rate)}) "
                      f"| {mib(med([m['peak_allocated_bytes'] for m in mt]))} "
                      f"| {mib(med([q['peak_allocated_bytes'] for q in pt]))} | {med(alloc):.2f} "
                      f"| {med(rss):.2f} | {gap:.0e} |", flush=True)
    print("# ratio = memtrain / DDP (samples/s: above 1 is faster; memory: below 1 is less), median of the pairs; "
          "memory: the largest rank's peak; loss gap: the largest relative difference between the two sides' "
          "per-step losses")


if __name__ == "__main__":
    main()
