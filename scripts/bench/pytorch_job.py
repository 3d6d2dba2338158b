#!/usr/bin/env python3
"""One benchmark job in plain PyTorch, written the way a PyTorch user writes it: torch.nn modules
(torchvision's ResNet and VisionTransformer), torch.optim, torch.autocast and torch.amp.GradScaler
for mixed precision, torch.utils.checkpoint for recomputation. The driver (driver.py) runs it
beside `memtrain run` of the same job; the two are equivalent:

- the same initial weights: this script writes them (`init`), memtrain reads them through
  model.init_from;
- the same data in the same order: memtrain's epoch order (SplitMix64, reimplemented in
  tests/py/reference.py), the same groups;
- the same step: forward, cross-entropy summed over the micro-batch and divided by the group
  size, backward, for each micro-batch of the group (the job's accumulation steps), clipping
  where the job clips, the optimizer step, one host read of the loss per step;
- the same threads (torch.set_num_threads).

Memory on the CPU is counted by memtrain's own counting allocator: driver.py compiles
src/shim/shim.cpp into a shared library, and this script installs it (c10::SetCPUAllocator)
before the model is built, so both sides count the same bytes the same way. On CUDA it reads the
caching allocator's peak.

Subcommands:
  init  --job J --out init.safetensors           the job's model, seeded, as safetensors
  train --job J --init F --data d.npz ...        trains, writes a JSON result (--result)

With --compile MODE the model runs through torch.compile(model, mode=MODE) (reduce-overhead:
Inductor's kernels replayed as CUDA graphs, forward and backward; the optimizer step stays
torch.optim's). Compilation happens in the first calls, inside the untimed first epoch; the
result's warmup_seconds is that epoch's wall time, compilation included.
"""
import argparse
import ctypes
import json
import os
import sys
import time

T_START = time.time()

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "py"))
import reference  # noqa: E402  (Mlp, epoch_order, safetensors)

import darts_twin  # noqa: E402
import jobs  # noqa: E402


def sdpa_block_forward(self, x):
    """torchvision's EncoderBlock with its attention written as the fastest plain PyTorch has it:
    one packed in-projection, scaled_dot_product_attention, the out-projection (what timm's
    Attention does, and what memtrain's vit preset runs). The same parameters, so the same
    initial weights load."""
    a = self.self_attention
    h = self.ln_1(x)
    b, n, c = h.shape
    heads = a.num_heads
    qkv = torch.nn.functional.linear(h, a.in_proj_weight, a.in_proj_bias)
    q, k, v = qkv.view(b, n, 3, heads, c // heads).permute(2, 0, 3, 1, 4).unbind(0)
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=a.dropout if self.training else 0.0)
    o = torch.nn.functional.linear(o.transpose(1, 2).reshape(b, n, c), a.out_proj.weight, a.out_proj.bias)
    x = x + self.dropout(o)
    return x + self.mlp(self.ln_2(x))


def build(job, attention="module"):
    """The job's model; for a ViT, `attention` "sdpa" swaps torchvision's nn.MultiheadAttention
    call for sdpa_block_forward."""
    spec = jobs.JOBS[job]
    if spec["preset"] == "darts":
        return darts_twin.Darts(**spec["options"])
    if spec["preset"] == "mlp":
        o = spec["options"]
        return reference.Mlp([o["inputs"]] + o["hidden"] + [o["num_classes"]])
    import torchvision

    o = spec["options"]
    if spec["preset"] in ("resnet18", "resnet50"):
        return getattr(torchvision.models, spec["preset"])(num_classes=o["num_classes"])
    if spec["preset"] == "vit":
        m = torchvision.models.VisionTransformer(
            image_size=o["image_size"], patch_size=o["patch_size"], num_layers=o["layers"],
            num_heads=o["heads"], hidden_dim=o["hidden_dim"], mlp_dim=o["mlp_dim"],
            dropout=o["dropout"], attention_dropout=o["attention_dropout"], num_classes=o["num_classes"])
        if attention == "sdpa":
            import types

            for layer in m.encoder.layers:
                layer.forward = types.MethodType(sdpa_block_forward, layer)
        return m
    raise SystemExit(f"no PyTorch twin for {job}")


def blocks(model, job):
    """The model as a chain of blocks, the same chain memtrain checkpoints."""
    preset = jobs.JOBS[job]["preset"]
    if preset in ("resnet18", "resnet50"):
        m = model
        stem = torch.nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool)
        body = [b for layer in (m.layer1, m.layer2, m.layer3, m.layer4) for b in layer]
        head = lambda h: m.fc(torch.flatten(m.avgpool(h), 1))  # noqa: E731
        return [stem] + body + [head]
    if preset == "vit":
        m = model

        def embed(x):
            x = m._process_input(x)
            x = torch.cat([m.class_token.expand(x.shape[0], -1, -1), x], dim=1)
            return m.encoder.dropout(x + m.encoder.pos_embedding)

        layers = list(m.encoder.layers)
        head = lambda h: m.heads(m.encoder.ln(h)[:, 0])  # noqa: E731
        return [embed] + layers + [head]
    return None


def forward(model, chain, x, checkpointing, compiled=None):
    if compiled is not None:
        # A new step for torch.compile's CUDA graphs: the previous call's outputs (already
        # consumed: the loss and backward are done) may be overwritten by this replay.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x, checkpointing) if isinstance(model, darts_twin.Darts) else compiled(x)
    if isinstance(model, darts_twin.Darts):
        return model(x, checkpointing)
    if not checkpointing or chain is None:
        return model(x)
    from torch.utils.checkpoint import checkpoint

    h = x
    for i, block in enumerate(chain):
        # Every block but the head, as memtrain checkpoints its chain.
        h = checkpoint(block, h, use_reentrant=False) if i < len(chain) - 1 else block(h)
    return h


class Counting:
    """memtrain's counting CPU allocator, from the shim built as a shared library."""

    # Field for field src/shim/shim.cpp's MtCpuStats: mt_cpu_alloc_stats writes the whole struct,
    # and a shorter one here let it write past the buffer into Python's heap (the process then
    # died in the garbage collector at exit).
    class Stats(ctypes.Structure):
        _fields_ = [("allocated", ctypes.c_int64), ("peak", ctypes.c_int64), ("cap", ctypes.c_int64),
                    ("num_ooms", ctypes.c_int64), ("installed", ctypes.c_int),
                    ("host_allocated", ctypes.c_int64), ("host_peak", ctypes.c_int64)]

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.lib.mt_cpu_alloc_install.restype = ctypes.c_void_p
        err = self.lib.mt_cpu_alloc_install()
        if err:
            raise SystemExit("could not install the counting allocator")

    def reset(self):
        self.lib.mt_cpu_alloc_reset_peak()

    def peak(self):
        s = Counting.Stats()
        self.lib.mt_cpu_alloc_stats(ctypes.byref(s))
        return s.peak


def rss_peak_reset():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rss_peak():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def cmd_init(a):
    torch.manual_seed(a.seed)
    model = build(a.job)
    state = model.state_for_memtrain() if isinstance(model, darts_twin.Darts) else model.state_dict()
    reference.write_safetensors(state, a.out)


def median(xs):
    # (A segfault at exit once blamed on importing the statistics module here was Counting.Stats
    # being shorter than the shim's struct.)
    xs = sorted(xs)
    n = len(xs)
    return (xs[(n - 1) // 2] + xs[n // 2]) / 2


def set_deterministic():
    """PyTorch's deterministic settings, as memtrain's MEMTRAIN_TEST_DETERMINISTIC hook makes them:
    cuBLAS needs its workspace setting before its first handle, so it goes in the environment
    here, before any CUDA work."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def make_optimizer(params, o, impl_name):
    # torch.optim's implementations: the for-loop one, foreach (multi-tensor), fused (one kernel);
    # "default" leaves the choice to torch (foreach on CUDA).
    impl = {"single": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True},
            "default": {}}[impl_name]
    if o["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=o["lr"], momentum=o["momentum"], weight_decay=o["weight_decay"], **impl)
    return torch.optim.AdamW(params, lr=o["lr"], weight_decay=o["weight_decay"], **impl)


def run_order(n, batch, seed, steps):
    """The groups of indices the run trains on, in memtrain's epoch order, `steps` of them."""
    out, epoch = [], 0
    while len(out) < steps:
        order = reference.epoch_order(n, seed, epoch)
        out += [order[s:s + batch] for s in range(0, n, batch)][:steps - len(out)]
        epoch += 1
    return out


class Samples(torch.utils.data.Dataset):
    """One sample per item, as a user's Dataset serves them to a DataLoader."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def batches(a, x_all, y_all, groups, device):
    """The run's (x, y) batches on the device, fetched as --data-mode says:
    host      each batch gathered on the host and copied over (pageable memory);
    resident  the whole set copied to the device once, each batch gathered there (memtrain's
              rule for data that fits a sixteenth of the card);
    loader    a torch.utils.data.DataLoader with workers and pinned memory, copied non-blocking
              (how PyTorch users feed a GPU)."""
    if a.data_mode == "resident":
        xd, yd = x_all.to(device), y_all.to(device)
        pin = device.type == "cuda"
        for g in groups:
            # The indices go over from pinned memory without waiting, as memtrain sends them.
            idx = torch.tensor(g)
            idx = idx.pin_memory().to(device, non_blocking=True) if pin else idx
            yield xd[idx], yd[idx]
    elif a.data_mode == "loader":
        loader = torch.utils.data.DataLoader(Samples(x_all, y_all), batch_sampler=groups, num_workers=a.workers,
                                             pin_memory=device.type == "cuda", persistent_workers=a.workers > 0)
        for x, y in loader:
            yield x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    else:
        for g in groups:
            idx = torch.tensor(g)
            yield x_all[idx].to(device), y_all[idx].to(device)


def backward_and_step(loss, opt, scaler):
    """Backward and an optimizer step, through the GradScaler for fp16-mixed."""
    if scaler:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    else:
        loss.backward()
        opt.step()


def train_group(x, y, loss_of, o, opt, scaler, params):
    """One optimizer step over a group: forward and backward of each micro-batch (the job's
    accumulation steps), each loss divided by the group's size, gradients clipped to the job's
    norm, the step. Gives the group's loss (the micro-batches' sum), still on the device."""
    micro, n = o["batch_size"], len(y)
    total = None
    for s in range(0, n, micro):
        loss = loss_of(x[s:s + micro], y[s:s + micro], n)
        (scaler.scale(loss) if scaler else loss).backward()
        total = loss.detach() if total is None else total + loss.detach()
    if "grad_clip_norm" in o:
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, o["grad_clip_norm"])
    if scaler:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return total


def arch_stepper(a, model, opt, loss_of, device):
    """DARTS (first order): before each weight step, an Adam step of the architecture weights on
    the next held-out micro-batch, as memtrain's extra step; its own scaler for fp16."""
    import numpy as np

    v = np.load(a.val)
    xv_all, yv_all = torch.from_numpy(v["x"]).clone(), torch.from_numpy(v["y"]).clone()
    opts = jobs.JOBS[a.job]["options"]
    arch_opt = torch.optim.Adam(model.arch_parameters(), lr=opts["arch_lr"], betas=(0.5, 0.999),
                                weight_decay=opts["arch_weight_decay"])
    scaler = torch.amp.GradScaler(device.type) if a.precision == "fp16-mixed" else None
    state = {"cursor": 0, "orders": {}}
    batch = jobs.JOBS[a.job]["train"]["batch_size"]

    def step():
        nv = len(yv_all)
        b = min(batch, nv)
        ks = range(state["cursor"], state["cursor"] + b)
        for k in ks:
            state["orders"].setdefault(k // nv, reference.epoch_order(nv, a.seed + 7919, k // nv))
        idx = torch.tensor([state["orders"][k // nv][k % nv] for k in ks])
        state["cursor"] += b
        x, y = xv_all[idx].to(device), yv_all[idx].to(device)
        if a.precision == "bf16":
            x = x.to(torch.bfloat16)
        arch_opt.zero_grad()
        opt.zero_grad()
        backward_and_step(loss_of(x, y), arch_opt, scaler)
        arch_opt.zero_grad()

    return step


def cmd_train(a):
    torch.set_num_threads(a.threads)
    if a.deterministic:
        set_deterministic()
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    counting = Counting(a.counting) if a.counting and not cuda else None
    model = build(a.job, a.attention)
    init = reference.read_safetensors(a.init)
    darts = isinstance(model, darts_twin.Darts)
    if darts:
        model.load_from_memtrain(init)
    else:
        model.load_state_dict(init)
    del init  # the loaded copies would otherwise count against PyTorch's peak
    precision = a.precision
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    model = model.to(device)
    model.train()
    chain = blocks(model, a.job)
    import numpy as np

    d = np.load(a.data)
    # Copied into tensors of their own, as memtrain holds its data: counted on both sides alike.
    x_all, y_all = torch.from_numpy(d["x"]).clone(), torch.from_numpy(d["y"]).clone()
    params = model.weight_parameters() if darts else [p for _, p in sorted(model.named_parameters())]
    o = jobs.JOBS[a.job]["train"]
    opt = make_optimizer(params, o, a.optimizer_impl)
    autocast_dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16-mixed" else None
    if a.compile and a.checkpointing and not darts:
        # The chain's blocks run outside the model's forward, which is what torch.compile wraps.
        raise SystemExit("--compile compiles the model's forward, which recomputation does not run through: "
                         "leave out --checkpointing")
    compiled = torch.compile(model, mode=a.compile) if a.compile else None

    def loss_of(x, y, group=None):
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = forward(model, chain, x, a.checkpointing, compiled)
        return torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum") / (group or len(y))

    arch_step = arch_stepper(a, model, opt, loss_of, device) if darts else None
    # Data on the device: memtrain keeps the held-out set there too (it validates at epoch ends),
    # so this side holds it as well and both peaks count the same data.
    held_out = None
    if a.data_mode == "resident" and a.val and not darts:
        v = np.load(a.val)
        held_out = (torch.from_numpy(v["x"]).to(device), torch.from_numpy(v["y"]).to(device))
    groups = run_order(len(y_all), jobs.group_size(a.job), a.seed, a.steps)
    if counting:
        counting.reset()
    if cuda:
        if a.memory_snapshot:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        torch.cuda.reset_peak_memory_stats(device)
    rss_peak_reset()
    # Each step's time runs from the previous step's loss read to its own (the first from the
    # loop's start): the read waits for the device, so the time covers its work, and a
    # DataLoader's wait for the next batch falls into the step that waited. memtrain's step
    # records run likewise from the end of one step to the end of the next (on CUDA on the
    # device's clock).
    started = time.time()
    stamps, losses = [started], []
    for x, y in batches(a, x_all, y_all, groups, device):
        if precision == "bf16":
            x = x.to(torch.bfloat16)
        if arch_step:
            arch_step()
        opt.zero_grad(set_to_none=not a.keep_grads)
        loss = train_group(x, y, loss_of, o, opt, scaler, params)
        losses.append(loss.item())
        stamps.append(time.time())
    step_times = [b - t for t, b in zip(stamps, stamps[1:])]
    step_samples = [len(g) for g in groups]
    # The steps after the first epoch (after the first step with one epoch), as the driver times
    # memtrain's.
    per_epoch = -(-len(y_all) // jobs.group_size(a.job))
    timed = slice(per_epoch if len(groups) > per_epoch else 1, None)
    result = {
        "startup_seconds": started - a.launched if a.launched else started - T_START,
        "warmup_seconds": sum(step_times[:timed.start]),
        "samples_per_s": sum(step_samples[timed]) / max(sum(step_times[timed]), 1e-12),
        "median_step_samples_per_s": median(
            [n / max(t, 1e-12) for n, t in zip(step_samples[timed], step_times[timed])]),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda
        else (counting.peak() if counting else None),
        "peak_requested_bytes": torch.cuda.memory_stats(device).get("requested_bytes.all.peak") if cuda else None,
        "peak_rss_bytes": rss_peak(),
        "steps": len(losses),
        "step_seconds": step_times,
        "losses": losses,
    }
    if cuda and a.memory_snapshot:
        # After the peaks are read: building the pickle raises the process's RSS.
        torch.cuda.memory._dump_snapshot(a.memory_snapshot)
    with open(a.result, "w") as f:
        json.dump(result, f)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("init")
    s.add_argument("--job", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("train")
    s.add_argument("--job", required=True)
    s.add_argument("--init", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--val", default=None, help="held-out data (darts' architecture step)")
    s.add_argument("--precision", default="fp32")
    s.add_argument("--checkpointing", action="store_true")
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--device", default="cpu")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--counting", default=None, help="the shim as a shared library (CPU memory)")
    s.add_argument("--keep-grads", action="store_true",
                   help="zero_grad(set_to_none=False), as memtrain does: to measure what dropping them saves")
    s.add_argument("--optimizer-impl", default="default", choices=["single", "foreach", "fused", "default"],
                   help="torch.optim's implementation (scripts/gpu_check.py compares memtrain's with each)")
    s.add_argument("--launched", type=float, default=None, help="when the driver started this process")
    s.add_argument("--attention", default="module", choices=["module", "sdpa"],
                   help="ViT: torchvision's nn.MultiheadAttention (module) or a packed in-projection with "
                        "scaled_dot_product_attention (sdpa)")
    s.add_argument("--data-mode", default="host", choices=["host", "resident", "loader"],
                   help="how batches reach the device (see batches())")
    s.add_argument("--workers", type=int, default=8, help="--data-mode loader: the DataLoader's workers")
    s.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms and cuDNN's deterministic mode (scripts/gpu_check.py)")
    s.add_argument("--memory-snapshot", default=None,
                   help="CUDA: record the allocator's history over the steps and write its snapshot here"
                        " (as memtrain's memory.record_history writes snapshot.pickle; scripts/bench/peak_diff.py)")
    s.add_argument("--compile", default=None, metavar="MODE",
                   help="run the model through torch.compile(model, mode=MODE), e.g. reduce-overhead (CUDA graphs)")
    s.add_argument("--result", required=True)
    a = p.parse_args()
    {"init": cmd_init, "train": cmd_train}[a.cmd](a)


if __name__ == "__main__":
    main()
