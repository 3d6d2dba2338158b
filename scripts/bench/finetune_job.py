#!/usr/bin/env python3
"""One fine-tuning benchmark job in plain PyTorch, as its users write it: a transformers model
loaded with from_pretrained, peft's LoraConfig for LoRA, requires_grad_(False) for a frozen
backbone, torch.optim.AdamW, torch.autocast for mixed precision. finetune.py runs it beside
`memtrain run` of the same job (finetune_jobs.py); the two are equivalent:

- the same initial weights: `make` builds the model randomly initialised and writes it with
  save_pretrained (hf/), which both sides load; for LoRA it also writes peft's initial adapters
  (A as peft draws it, B zero) with the base under memtrain's names (lora-init*), and this
  side copies the same adapters into its peft model;
- the same data in the same order (memtrain's epoch order, tests/py/reference.py), resident on
  the device;
- the same step: forward, the cross-entropy summed over the group and divided by its count (of
  samples, or of target tokens), backward, AdamW, one host read of the loss.

Memory on the CPU is counted by memtrain's counting allocator (see pytorch_job.py). transformers
leaves a model's weights in the safetensors file's memory map on the CPU, outside any
allocator; this side copies them into allocated memory, as a move to a GPU would, so that both
sides count the model's bytes.

Subcommands:
  make  --job J --out WORK [--seq-len T]     the model (WORK/hf), LoRA's initial adapters, the data
  train --job J --work WORK --mode M ...     trains, writes a JSON result (--result)
"""
import argparse
import json
import os
import sys
import time

T_START = time.time()

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import finetune_jobs as fj  # noqa: E402
import pytorch_job  # noqa: E402  (Counting, run_order, median, RSS)


def hf_model(job):
    import transformers

    c = fj.JOBS[job]["config"]
    if fj.JOBS[job]["kind"] == "vit":
        return transformers.ViTForImageClassification(transformers.ViTConfig(**c))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**c))


def lora_config(job):
    from peft import LoraConfig

    vit = fj.JOBS[job]["kind"] == "vit"
    return LoraConfig(r=fj.RANK, lora_alpha=fj.ALPHA, lora_dropout=0.0,
                      target_modules=fj.VIT_LORA_PEFT if vit else fj.LLAMA_LORA_PEFT,
                      modules_to_save=["classifier"] if vit else None)


VIT_MEMTRAIN = {"q_proj": "self_attention.in_proj_q", "k_proj": "self_attention.in_proj_k",
                "v_proj": "self_attention.in_proj_v", "o_proj": "self_attention.out_proj",
                "fc1": "mlp.0", "fc2": "mlp.3"}


def adapter_name(job, peft_name):
    """memtrain's name for one of peft's adapter tensors."""
    name = peft_name.removeprefix("base_model.model.").replace(".default.", ".")
    if fj.JOBS[job]["kind"] == "llama":
        return name
    # vit.layers.I.attention.q_proj.lora_A.weight -> encoder.layers.encoder_layer_I.self_attention.in_proj_q...
    parts = name.split(".")
    layer, module, rest = parts[2], parts[-3], ".".join(parts[-2:])
    return f"encoder.layers.encoder_layer_{layer}.{VIT_MEMTRAIN[module]}.{rest}"


def vit_to_memtrain(sd, layers):
    """A Hugging Face ViT's saved tensors under the vit preset's (torchvision's) names, the query,
    key and value projections joined into the packed in-projection."""
    e = "vit.embeddings."
    out = {"conv_proj.weight": sd[e + "patch_embeddings.projection.weight"],
           "conv_proj.bias": sd[e + "patch_embeddings.projection.bias"],
           "class_token": sd[e + "cls_token"], "encoder.pos_embedding": sd[e + "position_embeddings"]}
    for n in ("weight", "bias"):
        out[f"encoder.ln.{n}"] = sd[f"vit.layernorm.{n}"]
        out[f"heads.head.{n}"] = sd[f"classifier.{n}"]
        for i in range(layers):
            h, m = f"vit.encoder.layer.{i}.", f"encoder.layers.encoder_layer_{i}."
            out[m + f"self_attention.in_proj_{n}"] = torch.cat(
                [sd[h + f"attention.attention.{p}.{n}"] for p in ("query", "key", "value")])
            out[m + f"self_attention.out_proj.{n}"] = sd[h + f"attention.output.dense.{n}"]
            out[m + f"ln_1.{n}"] = sd[h + f"layernorm_before.{n}"]
            out[m + f"ln_2.{n}"] = sd[h + f"layernorm_after.{n}"]
            out[m + f"mlp.0.{n}"] = sd[h + f"intermediate.dense.{n}"]
            out[m + f"mlp.3.{n}"] = sd[h + f"output.dense.{n}"]
    return out


def write_lora_init(job, model, work):
    """peft's initial adapters over the saved base, under memtrain's names: for a ViT one file
    with the base (memtrain reads no config.json beside it; the spec gives the sizes), for a
    decoder a directory whose index names the saved base and a file of adapters."""
    from peft import get_peft_model
    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    peft = get_peft_model(model, lora_config(job))
    adapters = {adapter_name(job, k): v.detach().contiguous() for k, v in peft.state_dict().items() if ".lora_" in k}
    if fj.JOBS[job]["kind"] == "vit":
        base = vit_to_memtrain(load_file(f"{work}/hf/model.safetensors"), fj.JOBS[job]["config"]["num_hidden_layers"])
        save_file({**{k: v.contiguous() for k, v in base.items()}, **adapters}, f"{work}/lora-init.safetensors")
        return
    d = f"{work}/lora-init"
    os.makedirs(d)
    save_file(adapters, f"{d}/adapters.safetensors")
    os.symlink(os.path.abspath(f"{work}/hf/model.safetensors"), f"{d}/base.safetensors")
    with open(f"{work}/hf/config.json") as f:
        config = f.read()
    with open(f"{d}/config.json", "w") as f:
        f.write(config)
    from safetensors import safe_open

    with safe_open(f"{work}/hf/model.safetensors", "pt") as f:
        base_names = list(f.keys())
    weight_map = {**{n: "base.safetensors" for n in base_names}, **{n: "adapters.safetensors" for n in adapters}}
    with open(f"{d}/model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def write_data(job, work, seq_len):
    """Random images and labels (ViT), or random token ids (decoder), and a small held-out set:
    memtrain validates at epoch ends, outside the timed steps."""
    j = fj.JOBS[job]
    g = np.random.default_rng(0)
    c = j["config"]
    if j["kind"] == "vit":
        for name, n in (("data", j["samples"]), ("val", 8)):
            x = g.standard_normal([n, 3, c["image_size"], c["image_size"]]).astype(np.float32)
            y = (np.arange(n) % c["num_labels"]).astype(np.int64)
            g.shuffle(y)
            np.savez(f"{work}/{name}.npz", x=x, y=y)
        return
    dtype = np.uint16 if fj.token_dtype(job) == "uint16" else np.uint32
    for name, n in (("train", j["samples"]), ("val", 2)):
        g.integers(0, c["vocab_size"], n * (seq_len + 1), dtype=np.int64).astype(dtype).tofile(f"{work}/{name}.bin")


def cmd_make(a):
    os.makedirs(a.out, exist_ok=True)
    torch.manual_seed(0)
    model = hf_model(a.job)
    model.save_pretrained(f"{a.out}/hf")
    write_lora_init(a.job, model, a.out)
    write_data(a.job, a.out, a.seq_len or fj.JOBS[a.job].get("seq_len", 0))


def load(a, device):
    """The saved model, trained as --mode says, on the device."""
    import transformers

    vit = fj.JOBS[a.job]["kind"] == "vit"
    cls = transformers.ViTForImageClassification if vit else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(f"{a.work}/hf", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            # Out of the file's memory map (see the top) and onto the device.
            p.data = p.data.to(device, copy=True)
    if a.mode == "lora":
        from peft import get_peft_model
        from safetensors.torch import load_file

        model = get_peft_model(model, lora_config(a.job))
        init = load_file(f"{a.work}/lora-init.safetensors" if vit else f"{a.work}/lora-init/adapters.safetensors")
        with torch.no_grad():
            for k, v in model.state_dict().items():
                if ".lora_" in k:
                    v.copy_(init[adapter_name(a.job, k)])
        del init
    elif a.mode == "frozen":
        (model.vit if vit else model.model).requires_grad_(False)
        head = model.classifier if vit else model.lm_head
        head.requires_grad_(True)
    return model.to(device)


def batches(a, device, seq_len):
    """(input, target) groups on the device, in memtrain's order: the data set copied over once."""
    j = fj.JOBS[a.job]
    if j["kind"] == "vit":
        d = np.load(f"{a.work}/data.npz")
        x_all, y_all = torch.from_numpy(d["x"]).to(device, copy=True), torch.from_numpy(d["y"]).to(device, copy=True)
    else:
        dtype = np.uint16 if fj.token_dtype(a.job) == "uint16" else np.uint32
        ids = torch.from_numpy(np.fromfile(f"{a.work}/train.bin", dtype=dtype).astype(np.int64))
        n = len(ids) // (seq_len + 1)
        windows = ids[: n * (seq_len + 1)].view(n, seq_len + 1).to(device, copy=True)
        x_all, y_all = windows[:, :-1], windows[:, 1:]
    groups = pytorch_job.run_order(len(y_all), j["batch_size"], a.seed, a.steps)
    return [(x_all, y_all, torch.tensor(g, device=device)) for g in groups], len(y_all)


def cmd_train(a):
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    counting = pytorch_job.Counting(a.counting) if a.counting and not cuda else None
    j = fj.JOBS[a.job]
    vit = j["kind"] == "vit"
    seq_len = a.seq_len or j.get("seq_len", 0)
    model = load(a, device)
    model.train()
    params = [p for _, p in sorted(model.named_parameters()) if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=j["lr"], weight_decay=j["weight_decay"])
    autocast = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(a.precision)
    scaler = torch.amp.GradScaler(device.type) if a.precision == "fp16-mixed" else None
    groups, n = batches(a, device, seq_len)

    def loss_of(x, y):
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            logits = model(pixel_values=x).logits if vit else model(input_ids=x).logits
        logits = logits.float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 reduction="sum") / y.numel()

    if counting:
        counting.reset()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    pytorch_job.rss_peak_reset()
    # Each step from the previous step's loss read to its own, as pytorch_job.py times it.
    started = time.time()
    stamps, losses = [started], []
    for x_all, y_all, idx in groups:
        x, y = x_all[idx], y_all[idx]
        opt.zero_grad(set_to_none=True)
        loss = loss_of(x, y)
        pytorch_job.backward_and_step(loss, opt, scaler)
        losses.append(loss.item())
        stamps.append(time.time())
    write_result(a, j, n, groups, stamps, losses, counting, cuda, device, params, seq_len, started)


def write_result(a, j, n, groups, stamps, losses, counting, cuda, device, params, seq_len, started):
    step_times = [b - t for t, b in zip(stamps, stamps[1:])]
    step_samples = [len(g[2]) for g in groups]
    per_epoch = -(-n // j["batch_size"])
    # The steps after the first epoch, as finetune.py times memtrain's.
    timed = slice(per_epoch if len(groups) > per_epoch else 1, None)
    result = {
        "startup_seconds": started - a.launched if a.launched else started - T_START,
        "samples_per_s": sum(step_samples[timed]) / max(sum(step_times[timed]), 1e-12),
        "median_step_samples_per_s": pytorch_job.median(
            [s / max(t, 1e-12) for s, t in zip(step_samples[timed], step_times[timed])]),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda
        else (counting.peak() if counting else None),
        "peak_rss_bytes": pytorch_job.rss_peak(),
        "trained_parameters": sum(p.numel() for p in params),
        "seq_len": seq_len,
        "step_seconds": step_times,
        "losses": losses,
    }
    with open(a.result, "w") as f:
        json.dump(result, f)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("make")
    s.add_argument("--job", required=True, choices=list(fj.JOBS))
    s.add_argument("--out", required=True)
    s.add_argument("--seq-len", type=int, default=0, help="a decoder's window (default: the job's)")
    s = sub.add_parser("train")
    s.add_argument("--job", required=True, choices=list(fj.JOBS))
    s.add_argument("--work", required=True, help="the directory `make` wrote")
    s.add_argument("--mode", required=True, choices=fj.MODES)
    s.add_argument("--precision", default="fp32", choices=fj.PRECISIONS)
    s.add_argument("--steps", type=int, required=True)
    s.add_argument("--seq-len", type=int, default=0)
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--device", default="cpu")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--counting", default=None, help="the shim as a shared library (CPU memory)")
    s.add_argument("--launched", type=float, default=None, help="when the driver started this process")
    s.add_argument("--result", required=True)
    a = p.parse_args()
    {"make": cmd_make, "train": cmd_train}[a.cmd](a)


if __name__ == "__main__":
    main()
