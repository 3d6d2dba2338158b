#!/usr/bin/env python3
"""Reference numbers for the tests in src/optim/tests.rs, produced by PyTorch's own optimizers.

Usage: ~/.cache/memtrain/venv-torch-2.11.0/bin/python scripts/optim_reference.py

Runs torch.optim.SGD / Adam / AdamW (single-tensor path: foreach=False, fused=False) for 3 steps
with lr 0.1 on a fixed 2x3 float32 parameter and a fixed sequence of 3 gradients (and two of
them again in bfloat16), the same with foreach=True (asserted equal to the single-tensor
numbers bit for bit in float32: on the CPU the foreach ops loop over the same per-tensor
kernels; in bfloat16 they are printed too, Nesterov's differ) and with
fused=True (its own constants: the fused CPU kernels compute in another order), and
torch.nn.utils.clip_grad_norm_ on fixed gradients, then prints the results as Rust constants.
Every float32 is printed in its shortest round-trip form, so the Rust literals are the exact
same float32 values PyTorch produced. Paste the output into the tests of src/optim/tests.rs.
"""
import numpy as np
import torch

PARAM = [[0.5, -1.25, 0.3], [2.0, -0.7, 0.05]]
GRADS = [
    [[0.1, -0.2, 0.3], [-0.4, 0.5, -0.6]],
    [[0.05, 0.15, -0.25], [0.35, -0.45, 0.55]],
    [[-0.3, 0.2, -0.1], [0.0, 0.25, -0.5]],
]
LR = 0.1

SINGLE = dict(foreach=False, fused=False)
FOREACH = dict(foreach=True, fused=False)
FUSED = dict(foreach=False, fused=True)

CASES = {
    "SGD_MOMENTUM": lambda p, impl=SINGLE: torch.optim.SGD(
        [p], lr=LR, momentum=0.9, weight_decay=0.01, **impl
    ),
    "SGD_NESTEROV": lambda p, impl=SINGLE: torch.optim.SGD(
        [p], lr=LR, momentum=0.9, nesterov=True, weight_decay=0.01, **impl
    ),
    "ADAM": lambda p, impl=SINGLE: torch.optim.Adam(
        [p], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **impl
    ),
    "ADAMW": lambda p, impl=SINGLE: torch.optim.AdamW(
        [p], lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, **impl
    ),
}

BF16_CASES = ["SGD_MOMENTUM", "ADAM"]

# clip_grad_norm_: two params with grads, one without (skipped).
CLIP_GRADS = [
    [[0.1, -0.2, 0.3], [-0.4, 0.5, -0.6]],
    [1.5, -2.0, 0.75],
]
CLIP_MAX_NORM = 1.0


def f32(x: float) -> str:
    s = str(np.float32(x))
    return s if any(c in s for c in ".eE") or s in ("inf", "-inf", "nan") else s + ".0"


def rust_array(name: str, values) -> str:
    flat = [float(v) for v in torch.as_tensor(values).flatten().tolist()]
    return f"const {name}: [f32; {len(flat)}] = [{', '.join(f32(v) for v in flat)}];"


def run(make, dtype: torch.dtype, impl=SINGLE) -> torch.Tensor:
    p = torch.tensor(PARAM, dtype=dtype, requires_grad=True)
    opt = make(p, impl)
    for g in GRADS:
        opt.zero_grad()
        p.grad = torch.tensor(g, dtype=dtype)
        opt.step()
    return p.detach()


def main() -> None:
    print(f"// torch {torch.__version__}, produced by scripts/optim_reference.py")
    for name, make in CASES.items():
        print(rust_array(name, run(make, torch.float32)))
    # bfloat16 parameters (precision = "bf16"): state and grads in bf16 too, as PyTorch does.
    for name in BF16_CASES:
        print(rust_array(f"{name}_BF16", run(CASES[name], torch.bfloat16).float()))
    for name, make in CASES.items():
        assert torch.equal(run(make, torch.float32), run(make, torch.float32, FOREACH)), name
    print("// foreach=True in bfloat16 (in float32 the single-tensor numbers above, bit for bit)")
    for name, make in CASES.items():
        print(rust_array(f"{name}_FOREACH_BF16", run(make, torch.bfloat16, FOREACH).float()))
    print("// fused=True")
    for name, make in CASES.items():
        print(rust_array(f"{name}_FUSED", run(make, torch.float32, FUSED)))
        print(rust_array(f"{name}_FUSED_BF16", run(make, torch.bfloat16, FUSED).float()))

    params = [
        torch.zeros(2, 3, requires_grad=True),
        torch.zeros(3, requires_grad=True),
        torch.zeros(4, requires_grad=True),
    ]
    for p, g in zip(params, CLIP_GRADS):
        p.grad = torch.tensor(g, dtype=torch.float32)
    total = torch.nn.utils.clip_grad_norm_(params, CLIP_MAX_NORM)
    print(rust_array("CLIP_TOTAL_NORM", [total.item()]))
    print(rust_array("CLIP_GRAD0", params[0].grad))
    print(rust_array("CLIP_GRAD1", params[1].grad))


if __name__ == "__main__":
    main()
