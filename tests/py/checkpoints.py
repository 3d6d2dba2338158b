#!/usr/bin/env python3
"""Other libraries' checkpoints for memtrain's `model.init_from` tests (run with the bootstrap
Python, $MEMTRAIN_PYTHON: torch, torchvision, timm, transformers and safetensors).

  make KIND --out PATH [--classes K] [--image-size S] [--io io.safetensors] [--shards N]
      a small randomly initialised model of KIND, seeded, saved as that library saves it
      (a .safetensors file; a directory with config.json for Hugging Face; with --shards N a
      sharded checkpoint with model.safetensors.index.json), and with --io one input x
      [2, C, S, S] and the model's eval-mode logits (or CLIP's image embeddings) on it; with
      --val d.npz also its mean cross-entropy on that file (val_loss).
      KIND: torchvision-vit, torchvision-resnet, timm-vit, timm-resnet, hf-vit, hf-clip,
      open-clip (CLIP written with open_clip's visual.* names).
      Prints {"names": [...], "largest": bytes} as JSON.
  resample --from F --to T --dim D --out r.safetensors
      a random position embedding [1, 1 + F*F, D] and timm's resample_abs_pos_embed of it to
      a T x T grid.
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file

VIT = dict(image=32, patch=8, layers=2, heads=2, hidden=16, mlp=24)


def perturb(m):
    # Random initialisations start some tensors at zero or one (heads, tokens, norms); moved
    # off them, any name mapped to the wrong variable shows in the logits.
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m


def warm_batchnorm(m, size):
    m.train()
    with torch.no_grad():
        for _ in range(3):
            m(torch.randn(4, 3, size, size))
    return m


def make(a):
    s = a.image_size
    if a.kind == "torchvision-vit":
        from torchvision.models.vision_transformer import VisionTransformer

        m = VisionTransformer(s, VIT["patch"], VIT["layers"], VIT["heads"], VIT["hidden"], VIT["mlp"], num_classes=a.classes)
        return perturb(m), None
    if a.kind == "torchvision-resnet":
        import torchvision

        return warm_batchnorm(perturb(torchvision.models.resnet18(num_classes=a.classes)), s), None
    if a.kind == "timm-vit":
        from timm.models.vision_transformer import VisionTransformer

        m = VisionTransformer(img_size=s, patch_size=VIT["patch"], embed_dim=VIT["hidden"], depth=VIT["layers"],
                              num_heads=VIT["heads"], mlp_ratio=VIT["mlp"] / VIT["hidden"], num_classes=a.classes)
        return perturb(m), None
    if a.kind == "timm-resnet":
        import timm

        return warm_batchnorm(perturb(timm.create_model("resnet18", num_classes=a.classes)), s), None
    if a.kind == "hf-vit":
        from transformers import ViTConfig, ViTForImageClassification

        c = ViTConfig(hidden_size=VIT["hidden"], num_hidden_layers=VIT["layers"], num_attention_heads=VIT["heads"],
                      intermediate_size=VIT["mlp"], image_size=s, patch_size=VIT["patch"], num_labels=a.classes,
                      layer_norm_eps=a.eps)
        return perturb(ViTForImageClassification(c)), "hf"
    if a.kind in ("hf-clip", "open-clip"):
        from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

        c = CLIPVisionConfig(hidden_size=VIT["hidden"], num_hidden_layers=VIT["layers"], num_attention_heads=VIT["heads"],
                             intermediate_size=VIT["mlp"], image_size=s, patch_size=VIT["patch"], projection_dim=12)
        return perturb(CLIPVisionModelWithProjection(c)), "hf"
    raise SystemExit(f"unknown kind {a.kind}")


def open_clip_names(sd):
    """CLIPVisionModelWithProjection's state dict under open_clip's visual.* names."""
    out = {}
    for k, v in sd.items():
        k = k.replace("vision_model.", "")
        if k == "embeddings.class_embedding":
            out["visual.class_embedding"] = v
        elif k == "embeddings.patch_embedding.weight":
            out["visual.conv1.weight"] = v
        elif k == "embeddings.position_embedding.weight":
            out["visual.positional_embedding"] = v
        elif k.startswith("pre_layrnorm."):
            out["visual.ln_pre." + k.split(".")[-1]] = v
        elif k.startswith("post_layernorm."):
            out["visual.ln_post." + k.split(".")[-1]] = v
        elif k == "visual_projection.weight":
            out["visual.proj"] = v.t().contiguous()
        elif k.startswith("encoder.layers."):
            n, rest = k[len("encoder.layers."):].split(".", 1)
            p = f"visual.transformer.resblocks.{n}."
            if rest.startswith("self_attn.q_proj."):
                kind = rest.split(".")[-1]
                q = sd[f"vision_model.encoder.layers.{n}.self_attn.q_proj.{kind}"]
                kk = sd[f"vision_model.encoder.layers.{n}.self_attn.k_proj.{kind}"]
                vv = sd[f"vision_model.encoder.layers.{n}.self_attn.v_proj.{kind}"]
                out[p + f"attn.in_proj_{kind}"] = torch.cat([q, kk, vv])
            elif rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                pass
            else:
                for theirs, ours in [("self_attn.out_proj.", "attn.out_proj."), ("layer_norm1.", "ln_1."),
                                     ("layer_norm2.", "ln_2."), ("mlp.fc1.", "mlp.c_fc."), ("mlp.fc2.", "mlp.c_proj.")]:
                    if rest.startswith(theirs):
                        out[p + ours + rest[len(theirs):]] = v
        # position_ids and the like: not weights.
    return out


def save(m, how, a):
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if a.kind == "open-clip":
        sd = open_clip_names(sd)
    if how == "hf" and a.kind != "open-clip":
        m.save_pretrained(a.out)
        with open(os.path.join(a.out, "model.safetensors"), "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
        return names, sd
    if a.shards > 1:
        if a.out.endswith(".json"):
            a.out = os.path.dirname(a.out)
        os.makedirs(a.out, exist_ok=True)
        names = list(sd)
        weight_map = {}
        for i in range(a.shards):
            part = {k: sd[k] for k in names[i::a.shards]}
            file = f"model-{i + 1:05d}-of-{a.shards:05d}.safetensors"
            save_file(part, os.path.join(a.out, file))
            weight_map.update({k: file for k in part})
        with open(os.path.join(a.out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        return names, sd
    save_file(sd, a.out)
    return list(sd), sd


def cmd_make(a):
    torch.manual_seed(a.seed)
    m, how = make(a)
    names, sd = save(m, how, a)
    if a.io:
        torch.manual_seed(a.seed + 1)
        x = torch.randn(2, 3, a.image_size, a.image_size)
        m.eval()
        with torch.no_grad():
            out = m(x)
            if hasattr(out, "logits"):
                out = out.logits
            elif hasattr(out, "image_embeds"):
                out = out.image_embeds
        save_file({"x": x, "logits": out.contiguous()}, a.io)
    largest = max(v.numel() * v.element_size() for v in sd.values())
    out = {"names": names, "largest": largest}
    if a.val:
        # The mean cross-entropy over a data file, in eval mode: memtrain's validation loss.
        import numpy as np

        d = np.load(a.val)
        m.eval()
        with torch.no_grad():
            logits = m(torch.from_numpy(d["x"]))
            logits = getattr(logits, "logits", logits)
            out["val_loss"] = torch.nn.functional.cross_entropy(logits, torch.from_numpy(d["y"])).item()
    print(json.dumps(out))


def cmd_resample(a):
    from timm.layers import resample_abs_pos_embed

    torch.manual_seed(a.seed)
    pos = torch.randn(1, 1 + a.from_ * a.from_, a.dim)
    out = resample_abs_pos_embed(pos, new_size=[a.to, a.to], num_prefix_tokens=1)
    save_file({"pos": pos, "resampled": out.contiguous()}, a.out)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("kind")
    m.add_argument("--out", required=True)
    m.add_argument("--classes", type=int, default=5)
    m.add_argument("--image-size", type=int, default=VIT["image"])
    m.add_argument("--io")
    m.add_argument("--shards", type=int, default=1)
    m.add_argument("--eps", type=float, default=1e-6)
    m.add_argument("--val")
    m.add_argument("--seed", type=int, default=7)
    r = sub.add_parser("resample")
    r.add_argument("--from", dest="from_", type=int, required=True)
    r.add_argument("--to", type=int, required=True)
    r.add_argument("--dim", type=int, default=16)
    r.add_argument("--out", required=True)
    r.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    {"make": cmd_make, "resample": cmd_resample}[a.cmd](a)


if __name__ == "__main__":
    main()
