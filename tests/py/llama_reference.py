#!/usr/bin/env python3
"""Hugging Face decoders for memtrain's llama preset tests (run with $MEMTRAIN_PYTHON).

  make --out DIR [--kind llama|qwen2] [--kv-heads K] [--tie] [--llama3] [--head-dim D]
       [--attention-bias] [--shards N] [--io io.safetensors]
      a tiny randomly initialised LlamaForCausalLM (or Qwen2ForCausalLM), seeded and moved off
      its initialisation, written by save_pretrained (config.json + safetensors); with --io,
      fixed token ids `ids` [2, 12] and the model's fp32 logits on them (`logits`).
  logits --dir DIR --io io.safetensors
      loads DIR with AutoModelForCausalLM.from_pretrained and writes its logits on the ids of
      io.safetensors into it as `theirs`.
  train --dir DIR --data train.bin --seq-len T --batch B --steps N --lr LR --weight-decay WD --seed S
      the plain PyTorch loop memtrain's full fine-tune must equal: DIR loaded by
      AutoModelForCausalLM, the uint16 token file cut into back-to-back windows of T + 1, groups
      of B windows in memtrain's epoch order, the summed cross-entropy of the next tokens divided
      by the group's token count, backward, torch.optim.AdamW (foreach=False). Prints
      {"losses": [...]}.
  lora-init --dir DIR --out init.safetensors
      peft's LoRA (rank 4, alpha 8, q_proj and v_proj, init_lora_weights=False: B random too)
      over DIR, written with the base under memtrain's names (Hugging Face's, adapters without
      peft's ".default").
  lora-train --dir DIR --init init.safetensors --data train.bin --seq-len T --batch B --steps N
             --lr LR --weight-decay WD --seed S
      the loop of `train` over that peft model, its adapters from init.safetensors.
  pairs-train --dir DIR --tokenizer tokenizer.json --eos E --data pairs.jsonl --seq-len T --batch B
              --steps N --lr LR --weight-decay WD --seed S
      the loop of `train` over prompt/completion pairs with labels -100 over the prompt. Prints
      {"losses": [...], "unmasked": the first loss with the prompt counted, "counted": targets}.
make and logits print {"names": [...], "config": {...}} as JSON.
"""
import argparse
import json

import torch
from safetensors.torch import load_file, save_file

SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=256)


def make(a):
    import transformers

    torch.manual_seed(0)
    kw = dict(SIZES, num_key_value_heads=a.kv_heads, tie_word_embeddings=a.tie, rms_norm_eps=1e-5,
              rope_theta=5000.0)
    if a.head_dim:
        kw["head_dim"] = a.head_dim
    if a.llama3:
        # Frequencies on every side of the scaling's bands at head_dim 8 (wavelengths 6 to 1e3).
        kw["rope_scaling"] = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                  original_max_position_embeddings=64)
    if a.kind == "qwen2":
        config = transformers.Qwen2Config(**kw)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(attention_bias=a.attention_bias, **kw)
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    model.eval()
    shard = {} if a.shards <= 1 else {"max_shard_size": "10KB"}
    model.save_pretrained(a.out, **shard)
    if a.io:
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, SIZES["vocab_size"], (2, 12), generator=g)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        save_file({"ids": ids, "logits": logits.contiguous()}, a.io)
    names = sorted(model.state_dict().keys())
    print(json.dumps({"names": names, "config": json.load(open(f"{a.out}/config.json"))}))


def logits(a):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32)
    model.eval()
    io = load_file(a.io)
    with torch.no_grad():
        io["theirs"] = model(input_ids=io["ids"]).logits.contiguous()
    save_file(io, a.io)
    print(json.dumps({"architectures": model.config.architectures, "class": type(model).__name__}))


def train(a):
    import numpy as np

    ids = torch.from_numpy(np.fromfile(a.data, dtype=np.uint16).astype(np.int64))
    w = a.seq_len + 1
    n = len(ids) // w
    windows = ids[: n * w].view(n, w)
    print(json.dumps({"losses": loop(a, windows[:, :-1], windows[:, 1:])}))


def loop(a, xs, ys):
    """AdamW over the windows `xs` with targets `ys` (-100: no loss), groups of a.batch in
    memtrain's epoch order: the summed cross-entropy of the counted targets divided by their
    count. Returns the per-step losses."""
    import os
    import sys

    import transformers

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import reference

    torch.set_num_threads(1)
    model = getattr(a, "model", None) or transformers.AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.float32)
    model.train()
    n = len(xs)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=a.lr, weight_decay=a.weight_decay, foreach=False)
    losses, epoch = [], 0
    while len(losses) < a.steps:
        order = reference.epoch_order(n, a.seed, epoch)
        for s in range(0, n, a.batch):
            if len(losses) == a.steps:
                break
            pick = torch.tensor(order[s:s + a.batch])
            x, y = xs[pick], ys[pick]
            logits = model(input_ids=x).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                     reduction="sum", ignore_index=-100) / (y != -100).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        epoch += 1
    return losses


def pairs_train(a):
    """`train` over a jsonl file of prompt/completion pairs, each a window as Hugging Face's
    fine-tuning recipes make one: the prompt's and the completion's ids, then EOS, padded with
    EOS to seq_len + 1; labels -100 except where the next token is the completion's or the EOS
    after it. Also gives the first group's loss had the prompt's targets counted too."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(a.tokenizer)
    xs, ys, everything = [], [], []
    for line in open(a.data):
        if not line.strip():
            continue
        pair = json.loads(line)
        prompt = tok.encode(pair["prompt"]).ids
        ids = (prompt + tok.encode(pair["completion"]).ids + [a.eos])[: a.seq_len + 1]
        ids += [a.eos] * (a.seq_len + 1 - len(ids))
        full = len(prompt) + len(tok.encode(pair["completion"]).ids) + 1
        xs.append(ids[:-1])
        ys.append([t if len(prompt) <= i + 1 < full else -100 for i, t in enumerate(ids[1:])])
        everything.append([t if i + 1 < full else -100 for i, t in enumerate(ids[1:])])
    xs, ys, everything = torch.tensor(xs), torch.tensor(ys), torch.tensor(everything)
    counted = int((ys != -100).sum())
    a.steps, steps = 1, a.steps
    unmasked = loop(a, xs, everything)[0]
    a.steps = steps
    print(json.dumps({"losses": loop(a, xs, ys), "unmasked": unmasked, "counted": counted}))


LORA = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], init_lora_weights=False)


def peft_model(path):
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return get_peft_model(base, LoraConfig(**LORA))


def memtrain_name(peft_name):
    return peft_name.removeprefix("base_model.model.").replace(".default.", ".").replace(".base_layer.", ".")


def lora_init(a):
    m = peft_model(a.dir)
    save_file({memtrain_name(k): v.contiguous() for k, v in m.state_dict().items()}, a.out)
    print(json.dumps({"trainable": sum(p.numel() for p in m.parameters() if p.requires_grad)}))


def lora_train(a):
    m = peft_model(a.dir)
    init = load_file(a.init)
    with torch.no_grad():
        for k, v in m.state_dict().items():
            if ".lora_" in k:
                v.copy_(init[memtrain_name(k)])
    a.model = m
    train(a)


def add_train_args(t):
    t.add_argument("--data", required=True)
    t.add_argument("--seq-len", type=int, required=True)
    t.add_argument("--batch", type=int, required=True)
    t.add_argument("--steps", type=int, required=True)
    t.add_argument("--lr", type=float, required=True)
    t.add_argument("--weight-decay", type=float, required=True)
    t.add_argument("--seed", type=int, default=0)



def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--out", required=True)
    m.add_argument("--kind", default="llama", choices=["llama", "qwen2"])
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=0)
    m.add_argument("--tie", action="store_true")
    m.add_argument("--llama3", action="store_true")
    m.add_argument("--attention-bias", action="store_true")
    m.add_argument("--shards", type=int, default=1)
    m.add_argument("--io")
    l = sub.add_parser("logits")
    l.add_argument("--dir", required=True)
    l.add_argument("--io", required=True)
    li = sub.add_parser("lora-init")
    li.add_argument("--dir", required=True)
    li.add_argument("--out", required=True)
    for name in ("train", "lora-train", "pairs-train"):
        t = sub.add_parser(name)
        t.add_argument("--dir", required=True)
        t.add_argument("--init", default=None)
        t.add_argument("--tokenizer")
        t.add_argument("--eos", type=int, default=1)
        add_train_args(t)
    a = p.parse_args()
    {"make": make, "logits": logits, "train": train, "lora-init": lora_init, "lora-train": lora_train,
     "pairs-train": pairs_train}[a.cmd](a)


if __name__ == "__main__":
    main()
