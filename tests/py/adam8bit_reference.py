#!/usr/bin/env python3
"""A reference of 8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise
Quantization"), written from the published algorithm and bitsandbytes' dynamic map, for
tests/it/optim8.rs (run with the bootstrap Python, $MEMTRAIN_PYTHON: torch 2.11).

  adam8bit_reference.py --out ref.safetensors [--steps N] [--lr LR] [--weight-decay WD] [--seed S]

Makes seeded parameters (two large enough for 8-bit state, one under min_8bit_size) and one
seeded gradient per step, runs N steps of 8-bit AdamW on them and writes, as safetensors:
  init/<p>, grad<k>/<p>                   the inputs (k = 1..N)
  step<k>/param/<p>                       the parameter after step k
  step<k>/<slot>/<p>                      its state after step k, in memtrain's slots:
                                          exp_avg_q8, exp_avg_absmax, exp_avg_sq_q8,
                                          exp_avg_sq_absmax (u8 codes, fp32 block scales), or
                                          exp_avg, exp_avg_sq (fp32) for the small parameter
  map_signed, map_unsigned                the two 256-entry maps

The algorithm, per step and parameter:
  1. dequantize each moment block by block: map[code] * absmax;
  2. one step of torch.optim.AdamW (foreach=False: _single_tensor_adam) with those fp32 moments
     as its state, which updates the parameter from them;
  3. quantize the updated fp32 moments back: per block of 256 values, absmax = max |x| (the
     smallest normal fp32 for a block of zeros, so that it divides to zeros), and each value's
     code is the map entry nearest to x / absmax, the midpoints between entries computed in
     fp32 and a value on a midpoint going to the larger entry.
Moments start as zero codes with zero scales (which dequantize to zeros), as torchao's and
bitsandbytes' state does.
"""
import argparse
import json
import struct

import torch

BLOCK = 256
MIN_8BIT_SIZE = 4096
TINY = torch.finfo(torch.float32).tiny


def create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    """bitsandbytes.functional.create_dynamic_map: a dynamic exponent (10^-6 .. 10^0) and a
    linear fraction whose resolution doubles with each exponent; the unsigned map spends the
    sign bit on twice the fractions. 0 and 1 are added; sorted."""
    data = []
    non_sign_bits = total_bits - 1
    additional_items = 2 ** (non_sign_bits - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        fraction_items = int(
            2 ** (i + non_sign_bits - max_exponent_bits) + 1
            if signed
            else 2 ** (i + non_sign_bits - max_exponent_bits + 1) + 1
        )
        boundaries = torch.linspace(0.1, 1, fraction_items)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
        if signed:
            data += (-(10 ** (-(max_exponent_bits - 1) + i)) * means).tolist()
    assert additional_items == 0
    data.append(0)
    data.append(1.0)
    assert len(data) == 2**total_bits
    data.sort()
    return torch.tensor(data, dtype=torch.float32)


def blocks_of(x):
    """x flattened into rows of BLOCK values, the last row padded with zeros (which change no
    block's absmax), and the value count."""
    flat = x.reshape(-1)
    n = flat.numel()
    rows = (n + BLOCK - 1) // BLOCK
    padded = torch.zeros(rows * BLOCK, dtype=torch.float32)
    padded[:n] = flat
    return padded.view(rows, BLOCK), n


def quantize(x, qmap):
    rows, n = blocks_of(x)
    absmax = rows.abs().amax(dim=1).clamp_min(TINY)
    normed = rows / absmax[:, None]
    midpoints = (qmap[:-1] + qmap[1:]) / 2
    # The nearest entry: the number of midpoints at or below the value.
    codes = (normed.unsqueeze(-1) >= midpoints).sum(-1)
    return codes.reshape(-1)[:n].to(torch.uint8).reshape(x.shape), absmax


def dequantize(codes, absmax, qmap):
    n = codes.numel()
    rows = (n + BLOCK - 1) // BLOCK
    padded = torch.zeros(rows * BLOCK, dtype=torch.long)
    padded[:n] = codes.reshape(-1).long()
    values = qmap[padded].view(rows, BLOCK) * absmax[:, None]
    return values.reshape(-1)[:n].reshape(codes.shape)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(a.seed)
    # Two 8-bit parameters (whole blocks; a short last block) and one small fp32 one.
    shapes = {"w": (80, 64), "v": (4096 + 77,), "b": (100,)}

    def spread(shape):
        # Values over several orders of magnitude, so blocks differ in scale.
        n = torch.Size(shape).numel()
        return torch.randn(shape, generator=gen) * torch.linspace(-4, 1, n).exp2().reshape(shape)

    params = {k: spread(s) for k, s in shapes.items()}
    grads = [{k: spread(s) * 0.1 for k, s in shapes.items()} for _ in range(a.steps)]
    out = {f"init/{k}": p.clone() for k, p in params.items()}
    for i, g in enumerate(grads, 1):
        out.update({f"grad{i}/{k}": t for k, t in g.items()})
    signed, unsigned = create_dynamic_map(True), create_dynamic_map(False)
    out["map_signed"], out["map_unsigned"] = signed, unsigned

    ps = {k: torch.nn.Parameter(p.clone()) for k, p in params.items()}
    opt = torch.optim.AdamW(
        list(ps.values()), lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay, foreach=False
    )
    state = {}
    for k, p in ps.items():
        if p.numel() >= MIN_8BIT_SIZE:
            nb = (p.numel() + BLOCK - 1) // BLOCK
            zeros = lambda: (torch.zeros(p.shape, dtype=torch.uint8), torch.zeros(nb))
            state[k] = {"m": zeros(), "v": zeros()}
        else:
            state[k] = {"m": torch.zeros(p.shape), "v": torch.zeros(p.shape)}
    for i, g in enumerate(grads, 1):
        for k, p in ps.items():
            p.grad = g[k].clone()
            s = state[k]
            q8 = isinstance(s["m"], tuple)
            m = dequantize(*s["m"], signed) if q8 else s["m"]
            v = dequantize(*s["v"], unsigned) if q8 else s["v"]
            opt.state[p] = {"step": torch.tensor(float(i - 1)), "exp_avg": m, "exp_avg_sq": v}
        opt.step()
        for k, p in ps.items():
            s, st = state[k], opt.state[p]
            out[f"step{i}/param/{k}"] = p.detach().clone()
            if isinstance(s["m"], tuple):
                s["m"] = quantize(st["exp_avg"], signed)
                s["v"] = quantize(st["exp_avg_sq"], unsigned)
                out[f"step{i}/exp_avg_q8/{k}"], out[f"step{i}/exp_avg_absmax/{k}"] = s["m"]
                out[f"step{i}/exp_avg_sq_q8/{k}"], out[f"step{i}/exp_avg_sq_absmax/{k}"] = s["v"]
            else:
                s["m"], s["v"] = st["exp_avg"].clone(), st["exp_avg_sq"].clone()
                # Copies: the next step updates s["m"] and s["v"] in place.
                out[f"step{i}/exp_avg/{k}"], out[f"step{i}/exp_avg_sq/{k}"] = s["m"].clone(), s["v"].clone()
    write_safetensors(out, a.out)
    print(json.dumps({"tensors": len(out)}))


DTYPES = {torch.float32: "F32", torch.uint8: "U8"}


def write_safetensors(tensors, path):
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.reshape(-1).view(torch.uint8).numpy().tobytes()
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


if __name__ == "__main__":
    main()
