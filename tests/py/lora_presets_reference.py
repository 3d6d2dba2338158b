"""LoRA as peft does it on torchvision's resnet18 (its convolutions and fc) and on a small MLP (its
linear layers), for the comparison with memtrain's [model.lora] on the resnet18 and mlp presets.
The models are randomly initialised and trained with AdamW on an npz set in memtrain's batch
order.

  init  --model M --out init.safetensors --data d.npz   writes the base and peft's initial
                                                        adapters under memtrain's names, and the data
  train --model M --init init.safetensors --data d.npz [--bn-eval] [--out final.safetensors]
        prints {"losses": [...], "base_unchanged": bool, "trainable": n}; --out writes the trained
        model under memtrain's names; --bn-eval runs the BatchNorm layers in eval mode
  load  DIR --model M --data d.npz --out io.safetensors [--init I --trained T]
        loads an exported directory strictly in torchvision (resnet18, torchvision.ops.MLP) and
        writes its logits on the set's first four samples; with --init and --trained, also the
        logits and the weights of peft's merge_and_unload() of that base and those adapters
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(__file__))
from reference import epoch_order  # noqa: E402

RANK, ALPHA = 4, 8
IMAGE, CLASSES, MLP_IN, MLP_HIDDEN = 16, 4, 12, [16, 16]
# memtrain's targets ["conv1", "layer*.conv2", "downsample.0", "fc"] as peft's full-match regex:
# the stem's and every block's conv1, the blocks' conv2, the downsampling convolutions and fc.
RESNET_TARGETS = r"conv1|layer\d\.\d\.conv[12]|layer\d\.\d\.downsample\.0|fc"


class Mlp(torch.nn.Module):
    """memtrain's mlp preset: fc0, fc1, … with ReLU between."""

    def __init__(self):
        super().__init__()
        dims = [MLP_IN] + MLP_HIDDEN + [CLASSES]
        for i in range(len(dims) - 1):
            setattr(self, f"fc{i}", torch.nn.Linear(dims[i], dims[i + 1]))
        self.n = len(dims) - 1

    def forward(self, x):
        h = x.flatten(1)
        for i in range(self.n):
            h = getattr(self, f"fc{i}")(h)
            if i < self.n - 1:
                h = h.relu()
        return h


def base(kind):
    if kind == "resnet":
        from torchvision.models import resnet18

        return resnet18(num_classes=CLASSES)
    return Mlp()


def model(kind):
    if kind == "resnet":
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=RESNET_TARGETS,
                            init_lora_weights=False)
    else:
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["fc0", "fc1"],
                            modules_to_save=["fc2"], init_lora_weights=False)
    return get_peft_model(base(kind), config)


def memtrain_name(peft_name):
    """memtrain's name for a peft state_dict entry; None for peft's copy of a saved module."""
    n = peft_name.removeprefix("base_model.model.")
    if ".original_module." in n:
        return None
    for a, b in ((".base_layer.", "."), (".modules_to_save.default.", "."),
                 (".lora_A.default.", ".lora_A."), (".lora_B.default.", ".lora_B.")):
        n = n.replace(a, b)
    return n


def to_memtrain(sd):
    return {memtrain_name(k): v.contiguous() for k, v in sd.items() if memtrain_name(k) is not None}


def from_memtrain(m, tensors):
    sd = m.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            ours = memtrain_name(k) or memtrain_name(k.replace(".original_module.", ".modules_to_save.default."))
            v.copy_(tensors[ours])


def cmd_init(a):
    torch.manual_seed(0)
    m = model(a.model)
    with torch.no_grad():
        # BatchNorm away from its identity start, so that eval and training modes differ.
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.add_(torch.randn_like(mod.weight) * 0.1)
                mod.bias.add_(torch.randn_like(mod.bias) * 0.1)
                mod.running_mean.add_(torch.randn_like(mod.running_mean) * 0.1)
                mod.running_var.uniform_(0.5, 1.5)
    save_file(to_memtrain(m.state_dict()), a.out)
    g = torch.Generator().manual_seed(1)
    shape = (3, IMAGE, IMAGE) if a.model == "resnet" else (MLP_IN,)
    x = torch.rand(40, *shape, generator=g)
    y = torch.randint(0, CLASSES, (40,), generator=g)
    np.savez(a.data, x=x.numpy(), y=y.numpy())


def cmd_train(a):
    torch.set_num_threads(1)
    m = model(a.model)
    from_memtrain(m, load_file(a.init))
    frozen = {k: v.clone() for k, v in m.named_parameters() if not v.requires_grad}
    d = np.load(a.data)
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    params = [p for _, p in sorted(m.named_parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay, foreach=False, fused=False)
    m.train()
    if a.bn_eval:
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.eval()
    losses = []
    for epoch in range(a.epochs):
        order = epoch_order(len(y), a.seed, epoch)
        for s in range(0, len(y), a.batch_size):
            idx = torch.tensor(order[s : s + a.batch_size])
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(x[idx]), y[idx], reduction="sum")
            (loss / len(idx)).backward()
            opt.step()
            losses.append(loss.item() / len(idx))
    now = dict(m.named_parameters())
    unchanged = all(torch.equal(v, now[k]) for k, v in frozen.items())
    trainable = sum(p.numel() for p in params)
    if a.out:
        save_file(to_memtrain(m.state_dict()), a.out)
    print(json.dumps({"losses": losses, "base_unchanged": unchanged, "trainable": trainable}))


def exported(kind):
    """The library's own model that the export loads into."""
    if kind == "resnet":
        return base(kind)
    from torchvision.ops import MLP

    return MLP(MLP_IN, MLP_HIDDEN + [CLASSES])


def cmd_load(a):
    torch.set_num_threads(1)
    x = torch.from_numpy(np.load(a.data)["x"][:4])
    m = exported(a.model)
    m.load_state_dict(load_file(os.path.join(a.dir, "model.safetensors")), strict=True)
    m.eval()
    out = {"x": x.contiguous()}
    with torch.no_grad():
        out["logits"] = m(x).contiguous()
    if a.trained:
        # peft's own merge of the same base and trained adapters, in the exported model's names.
        p = model(a.model)
        tensors = load_file(a.init)
        tensors.update(load_file(a.trained))
        from_memtrain(p, tensors)
        merged = p.merge_and_unload()
        merged.eval()
        with torch.no_grad():
            out["peft_logits"] = merged(x).contiguous()
        sd, theirs = m.state_dict(), merged.state_dict()
        if a.model == "mlp":
            theirs = {f"{3 * int(k[2:].split('.')[0])}.{k.split('.', 1)[1]}": v for k, v in theirs.items()}
        gap = max(((sd[k].double() - v.double()).abs().max() / v.double().abs().max().clamp(min=1e-12)).item()
                  for k, v in theirs.items() if v.is_floating_point())
        out["weight_gap"] = torch.tensor([gap], dtype=torch.float64)
    save_file(out, a.out)


def main():
    p = argparse.ArgumentParser()
    s = p.add_subparsers(dest="cmd", required=True)
    i = s.add_parser("init")
    i.add_argument("--model", choices=["resnet", "mlp"], required=True)
    i.add_argument("--out", required=True)
    i.add_argument("--data", required=True)
    t = s.add_parser("train")
    t.add_argument("--model", choices=["resnet", "mlp"], required=True)
    t.add_argument("--init", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--bn-eval", action="store_true")
    t.add_argument("--out")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--seed", type=int, default=3)
    ld = s.add_parser("load")
    ld.add_argument("dir")
    ld.add_argument("--model", choices=["resnet", "mlp"], required=True)
    ld.add_argument("--data", required=True)
    ld.add_argument("--out", required=True)
    ld.add_argument("--init")
    ld.add_argument("--trained")
    a = p.parse_args()
    {"init": cmd_init, "train": cmd_train, "load": cmd_load}[a.cmd](a)


if __name__ == "__main__":
    main()
