#!/usr/bin/env python3
"""One benchmark job trained data-parallel the way a PyTorch user does it: launched by torchrun,
torch.distributed on Gloo, the model in DistributedDataParallel, optionally
ZeroRedundancyOptimizer for sharded optimizer state. dist_driver.py runs it beside
`memtrain run --nproc N` of the same job; the two are equivalent:

- the same initial weights (pytorch_job.py's `init`), data, order and groups: each optimizer
  step's group (the effective batch) is split across ranks as memtrain splits it, one
  micro-batch per rank when there are as many micro-batches as ranks, accumulated under
  no_sync() for the others;
- the same gradient: the loss is summed over a micro-batch and divided by the group size, then
  multiplied by the world size, because DDP averages where memtrain sums;
- one all-reduce of the step's loss per step (memtrain's per-step exchange does the same);
- the same threads per rank.

CPU memory per rank is counted by memtrain's counting allocator, as in pytorch_job.py. Rank 0
writes the JSON result with every rank's peaks.
"""
import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "py"))
import jobs  # noqa: E402
import pytorch_job  # noqa: E402
import reference  # noqa: E402


def share(group, micro, rank, size):
    """memtrain's parallel::share: contiguous, at micro-batch boundaries when there are enough."""
    chunks = -(-len(group) // micro)
    unit, units = (micro, chunks) if chunks >= size else (1, len(group))
    base, extra = divmod(units, size)
    first = rank * base + min(rank, extra)
    count = base + (1 if rank < extra else 0)
    return group[min(first * unit, len(group)):min((first + count) * unit, len(group))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--job", required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--micro", type=int, required=True)
    p.add_argument("--accumulation", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer")
    p.add_argument("--counting", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result", required=True)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    counting = pytorch_job.Counting(a.counting) if a.counting else None
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = pytorch_job.build(a.job)
    init = reference.read_safetensors(a.init)
    model.load_state_dict(init)
    del init
    model.train()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    import numpy as np

    d = np.load(a.data)
    x_all, y_all = torch.from_numpy(d["x"]).clone(), torch.from_numpy(d["y"]).clone()
    params = [p for _, p in sorted(model.named_parameters())]
    o = jobs.JOBS[a.job]["train"]
    kind = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[o["optimizer"]]
    kw = {"lr": o["lr"], "weight_decay": o["weight_decay"]}
    if o["optimizer"] == "sgd":
        kw["momentum"] = o["momentum"]
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt = ZeroRedundancyOptimizer(params, optimizer_class=kind, **kw)
    else:
        opt = kind(params, **kw)
    group_size = a.micro * a.accumulation
    n = len(y_all)
    times, samples, losses = [], [], []
    if counting:
        counting.reset()
    pytorch_job.rss_peak_reset()
    steps, epoch = 0, 0
    while steps < a.steps:
        order = reference.epoch_order(n, a.seed, epoch)
        for s in range(0, n, group_size):
            if steps >= a.steps:
                break
            t = time.time()
            group = order[s:s + group_size]
            mine = share(group, a.micro, rank, size)
            chunks = [mine[i:i + a.micro] for i in range(0, len(mine), a.micro)]
            opt.zero_grad(set_to_none=True)
            loss_sum = torch.zeros(())
            for i, chunk in enumerate(chunks):
                idx = torch.tensor(chunk)
                x, y = x_all[idx], y_all[idx]
                last = i + 1 == len(chunks)
                with (ddp.no_sync() if not last else torch.enable_grad()):
                    loss = torch.nn.functional.cross_entropy(ddp(x), y, reduction="sum")
                    # memtrain's loss / len(group), times the world size (a power of two here,
                    # so exact) because DDP divides the summed gradient by it.
                    (loss / len(group) * size).backward()
                loss_sum += loss.detach()
            opt.step()
            dist.all_reduce(loss_sum)
            losses.append(loss_sum.item() / len(group))
            times.append(time.time() - t)
            samples.append(len(group))
            steps += 1
        epoch += 1
    mine = {
        "peak_allocated_bytes": counting.peak() if counting else None,
        "peak_rss_bytes": pytorch_job.rss_peak(),
    }
    everyone = [None] * size
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        with open(a.result, "w") as f:
            json.dump({
                "samples_per_s": sum(samples[1:]) / max(sum(times[1:]), 1e-12),
                "ranks": everyone,
                "losses": losses,
            }, f)
    dist.barrier()
    # Seen once in a benchmark run: a rank aborted in process teardown ("terminate called without
    # an active exception") after its work was done. The result is written; skip the teardown.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
