#!/usr/bin/env python3
"""Reproduces, in plain PyTorch, the CPU kernel fault memtrain works around in `model::layers::Conv`.

oneDNN's bf16 backward-weights convolution (ONEDNN_VERBOSE names it `jit_bf16:avx512_core_bf16`,
chosen on CPUs with AVX512-BF16) leaves part of the weight gradient unwritten when the output is
one wide, the stride is above 1 and some kernel columns meet only padding: a 3x3 stride-2
convolution on a 1x1 map (ResNet18's layer4 on 16-pixel images) gets nothing written at taps
(1,0) and (1,2). Their true gradient is exactly 0; what comes back is whatever the buffer held.
A fresh mmap holds zeros, which hides it. Recycled heap memory holds old floats, NaN among them.

Run with the venv's python (`$MEMTRAIN_PYTHON scripts/onednn_dead_taps.py`). It re-executes
itself with MALLOC_PERTURB_=128 (glibc fills each block it hands out with 0x7f: bf16 3.4e38) and a
32 MiB mmap threshold (so the 576 KiB buffer comes from the heap, as after glibc raises its
threshold by itself). Exit status 1 when the gradient holds anything but 0 at the padding-only
taps, 0 when it is right (another CPU, another oneDNN).
"""
import os
import sys

if os.environ.get("MALLOC_PERTURB_") is None:
    env = dict(os.environ, MALLOC_PERTURB_="128", MALLOC_MMAP_THRESHOLD_=str(32 << 20))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)

import torch  # noqa: E402

torch.manual_seed(0)
torch.set_num_threads(1)
F = torch.nn.functional
bad = 0
for cin, cout, stride in [(128, 256, 2), (256, 512, 2), (64, 64, 3)]:
    x = torch.randn(2, cin, 1, 1, dtype=torch.bfloat16)
    w = torch.randn(cout, cin, 3, 3, dtype=torch.bfloat16, requires_grad=True)
    y = F.conv2d(x, w, None, stride, 1)
    (gw,) = torch.autograd.grad(y, (w,), torch.randn_like(y))
    # Only the centre tap meets the 1x1 input; every other tap's gradient is a sum of zeros.
    dead = gw.float().clone()
    dead[:, :, 1, 1] = 0
    wrong = int((dead != 0).sum()) + int(dead.isnan().sum())
    print(
        f"conv2d bf16 {cin}->{cout} 3x3 stride {stride} pad 1 on 1x1: "
        f"{wrong} of {dead.numel() - cout * cin} padding-only gradient values are not 0 "
        f"(largest magnitude {dead.nan_to_num(0).abs().max().item():.3g})"
    )
    bad += wrong
sys.exit(1 if bad else 0)
