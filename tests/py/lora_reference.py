"""LoRA as peft does it, for the comparison with memtrain's [model.lora]: a tiny, randomly
initialised Hugging Face ViTForImageClassification with peft adapters on q_proj and v_proj (and
the classifier trained beside them), trained with AdamW on an npz set in memtrain's batch order.

  init  --out init.safetensors --data d.npz   writes the base and the adapters under memtrain's
                                              vit names, and the data
  train --init init.safetensors --data d.npz  prints {"losses": [...], "base_unchanged": bool}
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import ViTConfig, ViTForImageClassification

sys.path.insert(0, os.path.dirname(__file__))
from reference import epoch_order  # noqa: E402

LAYERS, RANK, ALPHA = 2, 4, 8


def model():
    cfg = ViTConfig(
        hidden_size=16, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=32,
        image_size=16, patch_size=8, num_channels=3, num_labels=4, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    base = ViTForImageClassification(cfg)
    config = LoraConfig(
        r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
        modules_to_save=["classifier"], init_lora_weights=False,
    )
    return get_peft_model(base, config)


P = "base_model.model."


def pairs():
    """(memtrain name, peft name) for every tensor but the packed in-projections."""
    e = P + "vit.embeddings."
    out = [
        ("conv_proj.weight", e + "patch_embeddings.projection.weight"),
        ("conv_proj.bias", e + "patch_embeddings.projection.bias"),
        ("class_token", e + "cls_token"),
        ("encoder.pos_embedding", e + "position_embeddings"),
    ]
    for n in ("weight", "bias"):
        out.append((f"encoder.ln.{n}", P + f"vit.layernorm.{n}"))
        out.append((f"heads.head.{n}", P + f"classifier.modules_to_save.default.{n}"))
    for i in range(LAYERS):
        h = P + f"vit.layers.{i}."
        m = f"encoder.layers.encoder_layer_{i}."
        for n in ("weight", "bias"):
            out += [
                (m + f"self_attention.out_proj.{n}", h + f"attention.o_proj.{n}"),
                (m + f"ln_1.{n}", h + f"layernorm_before.{n}"),
                (m + f"ln_2.{n}", h + f"layernorm_after.{n}"),
                (m + f"mlp.0.{n}", h + f"mlp.fc1.{n}"),
                (m + f"mlp.3.{n}", h + f"mlp.fc2.{n}"),
            ]
        for part in ("q", "v"):
            for ab in ("A", "B"):
                out.append((m + f"self_attention.in_proj_{part}.lora_{ab}.weight",
                            h + f"attention.{part}_proj.lora_{ab}.default.weight"))
    return out


def in_proj(i, n):
    """memtrain's packed in-projection of block i, and peft's three parts in order."""
    h = P + f"vit.layers.{i}.attention."
    return (f"encoder.layers.encoder_layer_{i}.self_attention.in_proj_{n}",
            [h + f"q_proj.base_layer.{n}", h + f"k_proj.{n}", h + f"v_proj.base_layer.{n}"])


def to_memtrain(sd):
    out = {ours: sd[theirs] for ours, theirs in pairs()}
    for i in range(LAYERS):
        for n in ("weight", "bias"):
            ours, parts = in_proj(i, n)
            out[ours] = torch.cat([sd[p] for p in parts])
    return {k: v.contiguous() for k, v in out.items()}


def from_memtrain(m, tensors):
    sd = m.state_dict()
    with torch.no_grad():
        for ours, theirs in pairs():
            sd[theirs].copy_(tensors[ours])
        for i in range(LAYERS):
            for n in ("weight", "bias"):
                ours, parts = in_proj(i, n)
                for p, t in zip(parts, tensors[ours].chunk(3)):
                    sd[p].copy_(t)


def cmd_init(a):
    torch.manual_seed(0)
    m = model()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "layernorm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    save_file(to_memtrain(m.state_dict()), a.out)
    g = torch.Generator().manual_seed(1)
    x = torch.rand(40, 3, 16, 16, generator=g)
    y = torch.randint(0, 4, (40,), generator=g)
    np.savez(a.data, x=x.numpy(), y=y.numpy())


def cmd_train(a):
    torch.set_num_threads(1)
    m = model()
    from_memtrain(m, load_file(a.init))
    frozen = {k: v.clone() for k, v in m.named_parameters() if not v.requires_grad}
    d = np.load(a.data)
    x, y = torch.from_numpy(d["x"]), torch.from_numpy(d["y"])
    params = [p for _, p in sorted(m.named_parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=a.weight_decay, foreach=False, fused=False)
    m.train()
    losses = []
    for epoch in range(a.epochs):
        order = epoch_order(len(y), a.seed, epoch)
        for s in range(0, len(y), a.batch_size):
            idx = torch.tensor(order[s : s + a.batch_size])
            opt.zero_grad()
            logits = m(pixel_values=x[idx]).logits
            loss = torch.nn.functional.cross_entropy(logits, y[idx], reduction="sum")
            (loss / len(idx)).backward()
            opt.step()
            losses.append(loss.item() / len(idx))
    now = dict(m.named_parameters())
    unchanged = all(torch.equal(v, now[k]) for k, v in frozen.items())
    trainable = sum(p.numel() for p in params)
    print(json.dumps({"losses": losses, "base_unchanged": unchanged, "trainable": trainable}))


def cmd_load(a):
    """Loads an exported directory with the named library, as its users do, and writes its
    logits on the set's first four samples."""
    torch.set_num_threads(1)
    x = torch.from_numpy(np.load(a.data)["x"][:4])
    path = os.path.join(a.dir, "model.safetensors")
    if a.format == "huggingface":
        m = ViTForImageClassification.from_pretrained(a.dir)
        run = lambda: m(pixel_values=x).logits
    elif a.format == "timm":
        import timm.models.vision_transformer as vt

        m = vt.VisionTransformer(img_size=16, patch_size=8, embed_dim=16, depth=LAYERS, num_heads=2,
                                 mlp_ratio=2.0, num_classes=4)
        m.load_state_dict(load_file(path), strict=True)
        run = lambda: m(x)
    else:
        from torchvision.models.vision_transformer import VisionTransformer

        m = VisionTransformer(image_size=16, patch_size=8, num_layers=LAYERS, num_heads=2, hidden_dim=16,
                              mlp_dim=32, num_classes=4)
        m.load_state_dict(load_file(path), strict=True)
        run = lambda: m(x)
    m.eval()
    with torch.no_grad():
        save_file({"x": x.contiguous(), "logits": run().contiguous()}, a.out)


def main():
    p = argparse.ArgumentParser()
    s = p.add_subparsers(dest="cmd", required=True)
    i = s.add_parser("init")
    i.add_argument("--out", required=True)
    i.add_argument("--data", required=True)
    t = s.add_parser("train")
    t.add_argument("--init", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--batch-size", type=int, default=4)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--weight-decay", type=float, default=0.01)
    t.add_argument("--seed", type=int, default=3)
    ld = s.add_parser("load")
    ld.add_argument("dir")
    ld.add_argument("--format", required=True)
    ld.add_argument("--data", required=True)
    ld.add_argument("--out", required=True)
    a = p.parse_args()
    {"init": cmd_init, "train": cmd_train, "load": cmd_load}[a.cmd](a)


if __name__ == "__main__":
    main()
