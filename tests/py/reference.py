#!/usr/bin/env python3
"""Plain PyTorch references for memtrain's integration tests (run with the bootstrap Python,
$MEMTRAIN_PYTHON, which has torch 2.11 and torchvision 0.26).

Subcommands:
  script      --out model.pt --classes K [--channels C]
              a small CNN with BatchNorm (conv → BN → ReLU → pool → linear), seeded, saved with
              torch.jit.script(model).save(out)
  torchvision --model resnet18 --classes K --out init.safetensors
              a torchvision model's state_dict, as safetensors; prints {"parameters": n, "names": [...]}
  vit         --image-size S --patch-size P --layers L --heads H --hidden D --mlp M --classes K
              --out init.safetensors [--logits io.safetensors]
              torchvision's VisionTransformer(S, P, L, H, D, M, num_classes=K) (the constructor
              vit_b_16, vit_l_16 and vit_h_14 call), seeded, every weight then moved off its
              initial value (torchvision starts the head and the class token at zero, which would
              make any two models' logits agree), its state_dict as safetensors; with --logits
              also one input x [2, 3, S, S] and the model's eval-mode logits on it. Prints
              {"parameters": n, "names": [...]}
  vit-names   --model vit_l_16
              a torchvision ViT built on the meta device (nothing allocated, no weights
              downloaded): {"parameters": n, "names": [...], "shapes": {...}, "constructor":
              [S, P, L, H, D, M], "same_as_constructor": bool}, the last telling whether
              VisionTransformer at those sizes has the same names and shapes
  data        --out d.npz --n N --shape C,H,W --classes K --seed S
              random float32 images x and int64 labels y
  mlp         --inputs N --hidden H1,H2 --classes K --out init.safetensors
              an MLP as memtrain's mlp preset builds it (fc0, fc1, ... Linear layers with ReLU
              between them), seeded, its state_dict as safetensors
  train       --model (script:PATH | torchvision:NAME:INIT.safetensors | mlp:INIT.safetensors)
              --train d.npz [--autocast bf16|fp16] [--optimizer sgd|adam|adamw]
              [--impl single|foreach|fused] [--nesterov] [--inf-at-step N] ...
              trains as memtrain does (same epoch order, same groups and micro-batches, the
              loss summed and divided by the group size, clipping, torch.optim with the
              implementation --impl; with --autocast the forward under torch.autocast("cpu",
              bfloat16 or float16), fp16 with torch.amp.GradScaler) and prints
              {"losses": [...], "buffers": {name: [...]}, "scales": [...] (fp16),
              "params": {name: [...]} (the final weights)} as JSON
  tensorboard DIR
              the scalars of DIR's event files as TensorBoard's own reader sees them:
              {tag: [[step, value], ...]} as JSON
  snapshot    --out snapshot.pickle
              a CUDA caching-allocator snapshot in the format torch.cuda.memory._snapshot()
              returns (segments with blocks, device_traces with an "oom" entry), pickled as
              PyTorch pickles it; fragmented so that the failed 6 MiB request exceeds the
              largest free block (4 MiB) but not all free memory (13.5 MiB)
"""
import argparse
import fnmatch
import json
import math
import struct
import sys

import numpy as np
import torch

MASK = (1 << 64) - 1


class SplitMix64:
    """memtrain's data-order generator (src/data.rs), bit for bit."""

    def __init__(self, state):
        self.s = state & MASK

    def next(self):
        self.s = (self.s + 0x9E3779B97F4A7C15) & MASK
        z = self.s
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
        return z ^ (z >> 31)

    def below(self, n):
        limit = MASK - MASK % n
        while True:
            r = self.next()
            if r < limit:
                return r % n


TAG_EPOCH = 0x6570_6F63_685F_6F72


def stream(seed, tag, index):
    a = SplitMix64((seed & MASK) ^ tag)
    b = SplitMix64(a.next() ^ ((index * 0xD1B54A32D192ED03) & MASK))
    return SplitMix64(b.next())


def epoch_order(n, seed, epoch):
    rng = stream(seed, TAG_EPOCH, epoch)
    v = list(range(n))
    for i in range(n - 1, 0, -1):
        j = rng.below(i + 1)
        v[i], v[j] = v[j], v[i]
    return v


DTYPES = {torch.float32: "F32", torch.int64: "I64", torch.float16: "F16", torch.bfloat16: "BF16"}


def write_safetensors(tensors, path):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    names = {v: k for k, v in DTYPES.items()}
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        b, e = h["data_offsets"]
        raw = torch.frombuffer(bytearray(data[b:e]), dtype=torch.uint8) if e > b else torch.empty(0, dtype=torch.uint8)
        out[name] = raw.view(names[h["dtype"]]).reshape(h["shape"]).clone()
    return out


class SmallNet(torch.nn.Module):
    def __init__(self, channels, classes):
        super().__init__()
        self.conv = torch.nn.Conv2d(channels, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, classes)

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(torch.flatten(torch.nn.functional.adaptive_avg_pool2d(h, 1), 1))


class Mlp(torch.nn.Module):
    """memtrain's mlp preset: flatten, Linear fc0..fcN with ReLU between them."""

    def __init__(self, sizes):
        super().__init__()
        for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
            self.add_module(f"fc{i}", torch.nn.Linear(a, b))
        self.n = len(sizes) - 1

    def forward(self, x):
        h = torch.flatten(x, 1)
        for i in range(self.n):
            h = getattr(self, f"fc{i}")(h)
            if i + 1 < self.n:
                h = torch.relu(h)
        return h


def mlp_from(state):
    sizes = [state["fc0.weight"].shape[1]]
    i = 0
    while f"fc{i}.weight" in state:
        sizes.append(state[f"fc{i}.weight"].shape[0])
        i += 1
    m = Mlp(sizes)
    m.load_state_dict(state)
    return m


def cmd_mlp(a):
    torch.manual_seed(a.seed)
    sizes = [a.inputs] + [int(h) for h in a.hidden.split(",") if h] + [a.classes]
    write_safetensors(Mlp(sizes).state_dict(), a.out)


def torchvision_model(name, classes):
    import torchvision

    return getattr(torchvision.models, name)(num_classes=classes)


class Pair(torch.nn.Module):
    """A module whose forward returns (logits, features), as detection and NLP models often do."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        y = self.net(x)
        return y, y


def cmd_script(a):
    torch.manual_seed(a.seed)
    m = SmallNet(a.channels, a.classes)
    if a.frozen:
        for p in m.parameters():
            p.requires_grad_(False)
    if a.pair:
        m = Pair(m)
    torch.jit.script(m).save(a.out)


def cmd_torchvision(a):
    torch.manual_seed(a.seed)
    m = torchvision_model(a.model, a.classes)
    write_safetensors(m.state_dict(), a.out)
    print(json.dumps({"parameters": sum(p.numel() for p in m.parameters()), "names": list(m.state_dict())}))


def param_groups(a, named, frozen):
    """--groups: JSON [[patterns, lr_scale, weight_decay or null], ...]; a parameter joins the
    first entry one of whose patterns matches its name, and the rest form one group at --lr and
    --weight-decay."""
    if not a.groups:
        return [p for n, p in named if n not in frozen]
    spec = json.loads(a.groups)
    groups = {}
    for n, p in named:
        if n in frozen:
            continue
        k = next((i for i, (pats, _, _) in enumerate(spec) if any(fnmatch.fnmatchcase(n, x) for x in pats)), None)
        groups.setdefault(k, []).append(p)
    out = []
    for k, ps in groups.items():
        scale, wd = (1.0, None) if k is None else (spec[k][1], spec[k][2])
        out.append({"params": ps, "lr_scale": scale, "weight_decay": a.weight_decay if wd is None else wd})
    return out


def cmd_vit(a):
    from torchvision.models.vision_transformer import VisionTransformer

    torch.manual_seed(a.seed)
    m = VisionTransformer(a.image_size, a.patch_size, a.layers, a.heads, a.hidden, a.mlp, num_classes=a.classes)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    write_safetensors(m.state_dict(), a.out)
    if a.logits:
        x = torch.randn(2, 3, a.image_size, a.image_size)
        m.eval()
        with torch.no_grad():
            write_safetensors({"x": x, "logits": m(x)}, a.logits)
    print(json.dumps({"parameters": sum(p.numel() for p in m.parameters()), "names": list(m.state_dict())}))


# The sizes torchvision's builders pass to VisionTransformer: (image, patch, layers, heads, hidden, mlp).
VIT_SIZES = {
    "vit_b_16": (224, 16, 12, 12, 768, 3072),
    "vit_b_32": (224, 32, 12, 12, 768, 3072),
    "vit_l_16": (224, 16, 24, 16, 1024, 4096),
    "vit_l_32": (224, 32, 24, 16, 1024, 4096),
    "vit_h_14": (224, 14, 32, 16, 1280, 5120),
}


def cmd_vit_names(a):
    import torchvision
    from torchvision.models.vision_transformer import VisionTransformer

    with torch.device("meta"):
        m = getattr(torchvision.models, a.model)()
        c = VisionTransformer(*VIT_SIZES[a.model])
    shapes = {k: list(v.shape) for k, v in m.state_dict().items()}
    same = shapes == {k: list(v.shape) for k, v in c.state_dict().items()}
    print(json.dumps({"parameters": sum(p.numel() for p in m.parameters()), "names": list(shapes),
                      "shapes": shapes, "constructor": VIT_SIZES[a.model], "same_as_constructor": same}))


def cmd_data(a):
    g = np.random.default_rng(a.seed)
    shape = [int(s) for s in a.shape.split(",")]
    x = g.standard_normal([a.n] + shape).astype(np.float32)
    y = (np.arange(a.n) % a.classes).astype(np.int64)
    g.shuffle(y)
    np.savez(a.out, x=x, y=y)


def cmd_train(a):
    torch.set_num_threads(1)
    kind, _, rest = a.model.partition(":")
    if kind == "script":
        scripted = torch.jit.load(rest)
        channels = scripted.state_dict()["conv.weight"].shape[1]
        classes = scripted.state_dict()["head.weight"].shape[0]
        model = SmallNet(channels, classes)
        model.load_state_dict(scripted.state_dict())
    elif kind == "mlp":
        model = mlp_from(read_safetensors(rest))
    else:
        name, _, init = rest.partition(":")
        state = read_safetensors(init)
        model = torchvision_model(name, state["fc.weight"].shape[0])
        model.load_state_dict(state)
    d = np.load(a.train)
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    named = sorted(model.named_parameters())
    # --freeze: comma-separated name patterns of parameters that do not train.
    frozen = {n for n, _ in named if any(fnmatch.fnmatchcase(n, f) for f in a.freeze.split(",") if f)}
    for n, p in named:
        p.requires_grad_(n not in frozen)
    params = [p for n, p in named if n not in frozen]
    impl = {
        "single": dict(foreach=False, fused=False),
        "foreach": dict(foreach=True, fused=False),
        "fused": dict(foreach=False, fused=True),
    }[a.impl]
    groups = param_groups(a, named, frozen)
    if a.optimizer == "sgd":
        opt = torch.optim.SGD(
            groups, lr=a.lr, momentum=a.momentum, nesterov=a.nesterov, weight_decay=a.weight_decay, **impl
        )
    elif a.optimizer == "adam":
        opt = torch.optim.Adam(groups, lr=a.lr, weight_decay=a.weight_decay, **impl)
    else:
        opt = torch.optim.AdamW(groups, lr=a.lr, weight_decay=a.weight_decay, **impl)
    # fp16: GradScaler's defaults, as memtrain's scaler (init 2^16, growth interval 2000).
    scaler = torch.amp.GradScaler("cpu") if a.autocast == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.autocast)
    effective = a.batch_size * a.accumulation_steps
    n = len(y)
    losses = []
    scales = []
    model.train()
    for epoch in range(a.epochs):
        order = epoch_order(n, a.seed, epoch)
        for s in range(0, n, effective):
            group = order[s : s + effective]
            opt.zero_grad()
            total = 0.0
            for m in range(0, len(group), a.batch_size):
                idx = torch.tensor(group[m : m + a.batch_size])
                if a.autocast:
                    with torch.autocast("cpu", dtype=dtype):
                        logits = model(x[idx])
                else:
                    logits = model(x[idx])
                loss = torch.nn.functional.cross_entropy(logits.float(), y[idx], reduction="sum")
                scaled = loss / len(group)
                (scaler.scale(scaled) if scaler else scaled).backward()
                total += loss.item()
            if a.inf_at_step == len(losses) + 1:
                # As memtrain's MEMTRAIN_FAULT_INF_GRAD_AT_STEP: an overflow in one gradient.
                params[0].grad.fill_(float("inf"))
            if scaler:
                # With clipping, unscale_ first (the kernel then gets found_inf only); without,
                # a fused optimizer gets grad_scale and found_inf and unscales in the kernel.
                if a.clip > 0:
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(params, a.clip)
                scaler.step(opt)
                scaler.update()
                scales.append(scaler.get_scale())
            else:
                if a.clip > 0:
                    torch.nn.utils.clip_grad_norm_(params, a.clip)
                if a.groups or a.warmup:
                    # memtrain's schedule (linear warmup, then constant) times each group's scale.
                    step = len(losses)
                    lr = a.lr * (step + 1) / a.warmup if step < a.warmup else a.lr
                    for g in opt.param_groups:
                        g["lr"] = lr * g["lr_scale"]
                opt.step()
            losses.append(total / len(group))
    # JSON has no NaN: a non-finite value becomes null.
    finite = lambda xs: [None if isinstance(x, float) and not math.isfinite(x) else x for x in xs]
    buffers = {k: finite(v.flatten().tolist()) for k, v in model.named_buffers()}
    weights = {k: finite(v.detach().flatten().tolist()) for k, v in model.named_parameters()}
    print(json.dumps({"losses": finite(losses), "buffers": buffers, "scales": scales, "params": weights}))


def cmd_tensorboard(a):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(a.dir, size_guidance={"scalars": 0})
    acc.Reload()
    out = {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    print(json.dumps(out))


def cmd_imagefolder(a):
    """What torchvision's ImageFolder finds in a tree: its class names and image count."""
    import torchvision

    ds = torchvision.datasets.ImageFolder(a.root)
    print(json.dumps({"classes": ds.classes, "images": len(ds)}))


def cmd_snapshot(a):
    import pickle

    MiB = 1 << 20

    def segment(address, kind, blocks):
        at, out = address, []
        for size, state in blocks:
            out.append({"address": at, "size": size, "requested_size": size, "state": state, "frames": []})
            at += size
        total = sum(b[0] for b in blocks)
        used = sum(b[0] for b in blocks if b[1] == "active_allocated")
        return {"device": 0, "address": address, "total_size": total, "allocated_size": used,
                "active_size": used, "requested_size": used, "stream": 0, "segment_type": kind,
                "segment_pool_id": (0, 0), "expandable": False, "frames": [], "blocks": out}

    A, F = "active_allocated", "inactive"
    snap = {
        "segments": [
            segment(0x7F0000000000, "large", [(8 * MiB, A), (2 * MiB, F), (6 * MiB, A), (4 * MiB, F)]),
            segment(0x7F0010000000, "large", [(4 * MiB, A), (3 * MiB, F), (10 * MiB, A), (3 * MiB, F)]),
            segment(0x7F0020000000, "small", [(MiB // 2, A), (3 * MiB // 2, F)]),
        ],
        "device_traces": [[
            {"action": "alloc", "addr": 0x7F0000000000, "size": 8 * MiB, "stream": 0, "time_us": 1, "frames": []},
            {"action": "oom", "addr": 0, "size": 6 * MiB, "stream": 0, "time_us": 2, "frames": []},
        ]],
        "allocator_settings": {},
    }
    with open(a.out, "wb") as f:
        pickle.dump(snap, f, protocol=2)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("script")
    s.add_argument("--out", required=True)
    s.add_argument("--classes", type=int, default=4)
    s.add_argument("--channels", type=int, default=3)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--pair", action="store_true", help="forward returns a tuple")
    s.add_argument("--frozen", action="store_true", help="no parameter requires a gradient")
    s = sub.add_parser("torchvision")
    s.add_argument("--model", required=True)
    s.add_argument("--classes", type=int, default=1000)
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("vit")
    for k in ["image-size", "patch-size", "layers", "heads", "hidden", "mlp", "classes"]:
        s.add_argument(f"--{k}", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--logits")
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("vit-names")
    s.add_argument("--model", required=True, choices=sorted(VIT_SIZES))
    s = sub.add_parser("data")
    s.add_argument("--out", required=True)
    s.add_argument("--n", type=int, required=True)
    s.add_argument("--shape", required=True)
    s.add_argument("--classes", type=int, required=True)
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("train")
    s.add_argument("--model", required=True)
    s.add_argument("--train", required=True)
    s.add_argument("--epochs", type=int, default=1)
    s.add_argument("--batch-size", type=int, required=True)
    s.add_argument("--accumulation-steps", type=int, default=1)
    s.add_argument("--optimizer", choices=["sgd", "adam", "adamw"], default="sgd")
    s.add_argument("--impl", choices=["single", "foreach", "fused"], default="single")
    s.add_argument("--nesterov", action="store_true")
    s.add_argument("--inf-at-step", type=int, default=0)
    s.add_argument("--lr", type=float, default=0.1)
    s.add_argument("--momentum", type=float, default=0.0)
    s.add_argument("--weight-decay", type=float, default=0.0)
    s.add_argument("--clip", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--autocast", choices=["bf16", "fp16"], default=None)
    s.add_argument("--freeze", default="")
    s.add_argument("--groups", default=None)
    s.add_argument("--warmup", type=int, default=0)
    s = sub.add_parser("mlp")
    s.add_argument("--inputs", type=int, required=True)
    s.add_argument("--hidden", required=True)
    s.add_argument("--classes", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s = sub.add_parser("tensorboard")
    s.add_argument("dir")
    s = sub.add_parser("snapshot")
    s.add_argument("--out", required=True)
    s = sub.add_parser("imagefolder")
    s.add_argument("root")
    a = p.parse_args()
    cmds = {"script": cmd_script, "torchvision": cmd_torchvision, "data": cmd_data, "train": cmd_train,
            "tensorboard": cmd_tensorboard, "snapshot": cmd_snapshot, "mlp": cmd_mlp,
            "vit": cmd_vit, "vit-names": cmd_vit_names, "imagefolder": cmd_imagefolder}
    cmds[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
