"""The benchmark's jobs, shared by driver.py (memtrain's spec) and pytorch_job.py (the same job in
plain PyTorch). CPU_JOBS are sized for a 2-core CPU (a few seconds of steps each); GPU_JOBS for
one H100/H200 (ImageNet-sized images and batches that keep the card busy, synthetic data small
enough to stay resident: under a sixteenth of an 80 GB card, memtrain's rule)."""

def darts_options(input_length, num_classes, init_channels):
    """A DARTS job's [model.darts] options: configs/darts_4gb.toml's operations, 3 cells of 2
    nodes and its architecture step, at the given sizes."""
    return {"in_channels": 1, "input_length": input_length, "num_classes": num_classes,
            "init_channels": init_channels, "num_cells": 3, "num_nodes": 2,
            "ops": ["none", "skip_connect", "max_pool_3", "avg_pool_3", "sep_conv_3", "sep_conv_5", "dil_conv_3",
                    "dil_conv_5", "attention_light"],
            "arch_lr": 3e-4, "arch_weight_decay": 1e-3}


JOBS = {
    "mlp": {
        "preset": "mlp",
        "options": {"inputs": 256, "hidden": [1024, 1024], "num_classes": 10},
        "shape": [256],
        "samples": 2048,
        "train": {"batch_size": 128, "optimizer": "adamw", "lr": 1e-3, "momentum": 0.0, "weight_decay": 0.01},
        "steps": 40,
    },
    # configs/darts_4gb.toml's operations at a CPU size (scripts/gpu_check.py compares it with
    # PyTorch on CUDA).
    "darts": {
        "preset": "darts",
        "options": darts_options(input_length=256, num_classes=5, init_channels=8),
        "shape": [1, 256],
        "samples": 256,
        "train": {"batch_size": 16, "optimizer": "sgd", "lr": 0.025, "momentum": 0.9, "weight_decay": 3e-4},
        "steps": 12,
    },
    # The same operations at a size for tests/py/test_gpu_check.py's CPU rehearsal.
    "darts_tiny": {
        "preset": "darts",
        "options": darts_options(input_length=64, num_classes=3, init_channels=4),
        "shape": [1, 64],
        "samples": 64,
        "train": {"batch_size": 8, "optimizer": "sgd", "lr": 0.025, "momentum": 0.9, "weight_decay": 3e-4},
        "steps": 10,
    },
    "resnet18": {
        "preset": "resnet18",
        "options": {"num_classes": 10, "image_size": 32},
        "shape": [3, 32, 32],
        "samples": 512,
        "train": {"batch_size": 32, "optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4},
        "steps": 12,
    },
    "vit": {
        "preset": "vit",
        "options": {"image_size": 32, "patch_size": 4, "layers": 4, "heads": 4, "hidden_dim": 128,
                    "mlp_dim": 256, "dropout": 0.0, "attention_dropout": 0.0, "num_classes": 10},
        "shape": [3, 32, 32],
        "samples": 512,
        "train": {"batch_size": 32, "optimizer": "adamw", "lr": 1e-3, "momentum": 0.0, "weight_decay": 0.05},
        "steps": 12,
    },
    # GPU sizes. 1024 images of 224 px are 588 MiB: resident on the device on both sides.
    "mlp_wide": {
        "preset": "mlp",
        "options": {"inputs": 1024, "hidden": [8192, 8192, 8192], "num_classes": 1000},
        "shape": [1024],
        "samples": 65536,
        "train": {"batch_size": 4096, "optimizer": "adamw", "lr": 1e-4, "momentum": 0.0, "weight_decay": 0.01},
        "steps": 24,
    },
    "resnet18_224": {
        "preset": "resnet18",
        "options": {"num_classes": 1000, "image_size": 224},
        "shape": [3, 224, 224],
        "samples": 1024,
        "train": {"batch_size": 256, "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4},
        "steps": 16,
    },
    "resnet50_224": {
        "preset": "resnet50",
        "options": {"num_classes": 1000, "image_size": 224},
        "shape": [3, 224, 224],
        "samples": 1024,
        "train": {"batch_size": 128, "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4},
        "steps": 16,
    },
    "vit_b16_224": {
        "preset": "vit",
        "options": {"image_size": 224, "patch_size": 16, "layers": 12, "heads": 12, "hidden_dim": 768,
                    "mlp_dim": 3072, "dropout": 0.0, "attention_dropout": 0.0, "num_classes": 1000},
        "shape": [3, 224, 224],
        "samples": 1024,
        "train": {"batch_size": 128, "optimizer": "adamw", "lr": 1e-3, "momentum": 0.0, "weight_decay": 0.05},
        "steps": 16,
    },
    # The CUDA-graph benchmark's jobs (scripts/bench/graphs): small micro-batches, where a GPU step
    # is bound by launching kernels. Each epoch is 10 steps, untimed (warm-up, memtrain's capture
    # after two eager steps, torch.compile's compilation and recording); 30 timed steps follow.
    # configs/darts_4gb.toml's model and step: micro-batch 2, 2 accumulation steps, clipping at
    # 5, SGD with momentum (at a constant rate: a schedule is a host-side scalar on both sides).
    "darts_main": {
        "preset": "darts",
        "options": darts_options(input_length=3000, num_classes=5, init_channels=24),
        "shape": [1, 3000],
        "samples": 40,
        "train": {"batch_size": 2, "accumulation": 2, "grad_clip_norm": 5.0, "optimizer": "sgd", "lr": 0.1,
                  "momentum": 0.9, "weight_decay": 3e-4},
        "steps": 40,
    },
    # darts_main's step (2 x 2 accumulation, clipping) at darts_tiny's size: a CPU rehearsal.
    "darts_main_tiny": {
        "preset": "darts",
        "options": darts_options(input_length=64, num_classes=3, init_channels=4),
        "shape": [1, 64],
        "samples": 40,
        "train": {"batch_size": 2, "accumulation": 2, "grad_clip_norm": 5.0, "optimizer": "sgd", "lr": 0.1,
                  "momentum": 0.9, "weight_decay": 3e-4},
        "steps": 14,
    },
    "resnet18_224_b8": {
        "preset": "resnet18",
        "options": {"num_classes": 1000, "image_size": 224},
        "shape": [3, 224, 224],
        "samples": 80,
        "train": {"batch_size": 8, "optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4},
        "steps": 40,
    },
    "vit_b16_224_b8": {
        "preset": "vit",
        "options": {"image_size": 224, "patch_size": 16, "layers": 12, "heads": 12, "hidden_dim": 768,
                    "mlp_dim": 3072, "dropout": 0.0, "attention_dropout": 0.0, "num_classes": 1000},
        "shape": [3, 224, 224],
        "samples": 80,
        "train": {"batch_size": 8, "optimizer": "adamw", "lr": 1e-3, "momentum": 0.0, "weight_decay": 0.05},
        "steps": 40,
    },
}

CPU_JOBS = ["mlp", "darts", "resnet18", "vit"]
GPU_JOBS = ["mlp_wide", "resnet18_224", "resnet50_224", "vit_b16_224"]
GRAPH_JOBS = ["darts_main", "resnet18_224_b8", "vit_b16_224_b8"]


def group_size(job):
    """Samples per optimizer step: the micro-batch times the accumulation steps."""
    t = JOBS[job]["train"]
    return t["batch_size"] * t.get("accumulation", 1)

# (name, precision, activation checkpointing): every precision, and recomputation on its own and
# with bf16-mixed.
SETTINGS = [
    ("fp32", "fp32", False),
    ("fp16-mixed", "fp16-mixed", False),
    ("bf16-mixed", "bf16-mixed", False),
    ("bf16", "bf16", False),
    ("fp32+ckpt", "fp32", True),
    ("bf16-mixed+ckpt", "bf16-mixed", True),
]


def toml_value(v):
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    if isinstance(v, list):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def memtrain_spec(job, init, data, val, precision, checkpointing, threads, device, seed=0,
                  batch_size=None, accumulation=None, shard_optimizer_state=False, saves=True):
    """The job as a memtrain spec; `batch_size` (the micro-batch) and `accumulation` default to
    the job's. Without `saves`, no checkpoint at epoch ends (the PyTorch side writes none either)."""
    j = JOBS[job]
    t = j["train"]
    accumulation = accumulation or t.get("accumulation", 1)
    lines = [
        "[job]", f'name = "bench-{job}"', f"threads = {threads}", f'device = "{device}"', f"seed = {seed}",
        "[model]", f'preset = "{j["preset"]}"', f'init_from = "{init}"',
        f"[model.{j['preset']}]", *[f"{k} = {toml_value(v)}" for k, v in j["options"].items()],
        "[data]", 'source = "npz"', f'path = "{data}"', f'val_path = "{val}"',
        "[train]", "epochs = 100", f"batch_size = {batch_size or t['batch_size']}",
        f"accumulation_steps = {accumulation}", f"shard_optimizer_state = {toml_value(shard_optimizer_state)}",
        f'optimizer = "{t["optimizer"]}"', f"lr = {t['lr']}", f"weight_decay = {t['weight_decay']}",
        f'precision = "{precision}"', f"activation_checkpointing = {toml_value(checkpointing)}",
    ]
    if t["optimizer"] == "sgd":
        lines.append(f"momentum = {t['momentum']}")
    if "grad_clip_norm" in t:
        lines.append(f"grad_clip_norm = {t['grad_clip_norm']}")
    if not saves:
        lines += ["[checkpoint]", "every_epochs = 0"]
    lines += ["[log]", "every_steps = 1", 'progress = "off"']
    return "\n".join(lines) + "\n"
