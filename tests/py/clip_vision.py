"""A tiny, randomly initialised Hugging Face CLIP vision tower with a head, for the vit preset's
CLIP options: writes its weights under memtrain's vit names (--out), one input and its logits
(--io), and prints the [model.vit] options that describe it as JSON."""
import argparse
import json

import torch
from safetensors.torch import save_file
from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection


def memtrain_names(sd, layers):
    """Hugging Face CLIPVisionModelWithProjection names -> memtrain's (torchvision's) vit names."""
    out = {}
    e = "vision_model.embeddings."
    out["conv_proj.weight"] = sd[e + "patch_embedding.weight"]
    out["class_token"] = sd[e + "class_embedding"].reshape(1, 1, -1)
    out["encoder.pos_embedding"] = sd[e + "position_embedding.weight"].unsqueeze(0)
    for n in ("weight", "bias"):
        out[f"ln_pre.{n}"] = sd[f"vision_model.pre_layrnorm.{n}"]
        out[f"encoder.ln.{n}"] = sd[f"vision_model.post_layernorm.{n}"]
    for i in range(layers):
        h = f"vision_model.encoder.layers.{i}."
        m = f"encoder.layers.encoder_layer_{i}."
        for n in ("weight", "bias"):
            out[m + f"self_attention.in_proj_{n}"] = torch.cat(
                [sd[h + f"self_attn.{p}_proj.{n}"] for p in "qkv"]
            )
            out[m + f"self_attention.out_proj.{n}"] = sd[h + f"self_attn.out_proj.{n}"]
            out[m + f"ln_1.{n}"] = sd[h + f"layer_norm1.{n}"]
            out[m + f"ln_2.{n}"] = sd[h + f"layer_norm2.{n}"]
            out[m + f"mlp.0.{n}"] = sd[h + f"mlp.fc1.{n}"]
            out[m + f"mlp.3.{n}"] = sd[h + f"mlp.fc2.{n}"]
    out["projection.weight"] = sd["visual_projection.weight"]
    return out


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--out", required=True)
    a.add_argument("--io", required=True)
    args = a.parse_args()
    torch.manual_seed(0)
    cfg = CLIPVisionConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8, projection_dim=24, layer_norm_eps=1e-5,
        hidden_act="quick_gelu", num_channels=3,
    )
    model = CLIPVisionModelWithProjection(cfg).eval()
    head = torch.nn.Linear(cfg.projection_dim, 5)
    # Non-trivial norms, so that a swapped or missing LayerNorm shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        logits = head(model(pixel_values=x).image_embeds)
    sd = memtrain_names(model.state_dict(), cfg.num_hidden_layers)
    sd["heads.head.weight"] = head.weight.detach()
    sd["heads.head.bias"] = head.bias.detach()
    save_file({k: v.contiguous() for k, v in sd.items()}, args.out)
    save_file({"x": x, "logits": logits}, args.io)
    print(json.dumps({
        "image_size": 32, "patch_size": 8, "layers": 2, "heads": 4, "hidden_dim": 32,
        "mlp_dim": 48, "num_classes": 5, "layer_norm_eps": 1e-5, "activation": "quick_gelu",
        "pre_norm": True, "patch_bias": False, "projection_dim": 24,
    }))


if __name__ == "__main__":
    main()
