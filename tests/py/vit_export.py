"""Loads a vit run exported by `memtrain export` in the named library, built with the
constructor docs/commands.md gives for the run's [model.vit] options, strictly, and writes its
logits on the set's first four samples.

  data --out d.npz                                         random 16x16 images and 4 labels
  load DIR --format F --options o.json --data d.npz --out io.safetensors
"""
import argparse
import json
import os
from functools import partial

import numpy as np
import torch
from safetensors.torch import load_file, save_file


def cmd_data(a):
    g = torch.Generator().manual_seed(1)
    x = torch.rand(8, 3, 16, 16, generator=g)
    y = torch.arange(8) % 4
    np.savez(a.out, x=x.numpy(), y=y.numpy())


def timm_model(o):
    import timm
    from timm.models.vision_transformer import VisionTransformer

    sizes = dict(
        img_size=o["image_size"], patch_size=o["patch_size"], in_chans=o["in_channels"],
        embed_dim=o["hidden_dim"], depth=o["layers"], num_heads=o["heads"],
        mlp_ratio=o["mlp_dim"] / o["hidden_dim"], num_classes=o["num_classes"],
    )
    clip = o["pre_norm"] and o["activation"] == "quick_gelu" and o["layer_norm_eps"] == 1e-5
    if clip:
        # OpenAI CLIP's own tower, as timm registers it, at the run's sizes.
        return timm.create_model("vit_base_patch32_clip_quickgelu_224", pretrained=False, **sizes)
    return VisionTransformer(
        **sizes, pre_norm=o["pre_norm"], act_layer=o["activation"],
        norm_layer=partial(torch.nn.LayerNorm, eps=o["layer_norm_eps"]),
    )


def cmd_load(a):
    torch.set_num_threads(1)
    with open(a.options) as f:
        o = json.load(f)
    x = torch.from_numpy(np.load(a.data)["x"][:4])
    if a.format == "huggingface":
        from transformers import ViTForImageClassification

        m = ViTForImageClassification.from_pretrained(a.dir)
        run = lambda: m(pixel_values=x).logits
    else:
        if a.format == "timm":
            m = timm_model(o)
        else:
            from torchvision.models.vision_transformer import VisionTransformer

            m = VisionTransformer(
                image_size=o["image_size"], patch_size=o["patch_size"], num_layers=o["layers"],
                num_heads=o["heads"], hidden_dim=o["hidden_dim"], mlp_dim=o["mlp_dim"],
                num_classes=o["num_classes"],
            )
        m.load_state_dict(load_file(os.path.join(a.dir, "model.safetensors")), strict=True)
        run = lambda: m(x)
    m.eval()
    with torch.no_grad():
        save_file({"x": x.contiguous(), "logits": run().contiguous()}, a.out)


def main():
    p = argparse.ArgumentParser()
    s = p.add_subparsers(dest="cmd", required=True)
    d = s.add_parser("data")
    d.add_argument("--out", required=True)
    ld = s.add_parser("load")
    ld.add_argument("dir")
    ld.add_argument("--format", required=True)
    ld.add_argument("--options", required=True)
    ld.add_argument("--data", required=True)
    ld.add_argument("--out", required=True)
    a = p.parse_args()
    {"data": cmd_data, "load": cmd_load}[a.cmd](a)


if __name__ == "__main__":
    main()
