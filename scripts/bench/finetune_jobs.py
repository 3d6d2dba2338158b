"""The fine-tuning benchmark's jobs, shared by finetune.py (memtrain's spec) and finetune_job.py
(the same job in plain PyTorch with transformers and peft). CPU_JOBS are sized for a 2-core CPU;
GPU_JOBS for one H100/H200 (ViT-B/16 at 224 px; a Llama-3.2-1B shape). Each job is a Hugging
Face model built randomly initialised in Python and saved with save_pretrained, then trained
three ways (MODES): every parameter, rank-16 LoRA on the attention and MLP linears (the ViT's
head trained beside them, peft's modules_to_save), and the head alone over a frozen backbone."""

from jobs import toml_value  # one TOML writer for both benchmarks


VIT_LORA_PEFT = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]
VIT_LORA_MEMTRAIN = ["in_proj_q", "in_proj_k", "in_proj_v", "out_proj", "mlp.0", "mlp.3"]
LLAMA_LORA_PEFT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LLAMA_LORA_MEMTRAIN = ["q", "k", "v", "o", "gate", "up", "down"]
RANK, ALPHA = 16, 32.0

JOBS = {
    # ViT-Ti-like (hidden 192, 3 heads), 6 blocks at 64 px in patches of 8: 65 tokens.
    "vit_ti_64": {
        "kind": "vit",
        "config": dict(hidden_size=192, num_hidden_layers=6, num_attention_heads=3, intermediate_size=768,
                       image_size=64, patch_size=8, num_labels=10),
        "samples": 64, "batch_size": 16, "steps": 16, "lr": 2e-4, "weight_decay": 0.01,
    },
    "vit_b16_224": {
        "kind": "vit",
        "config": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       image_size=224, patch_size=16, num_labels=100),
        "samples": 1024, "batch_size": 64, "steps": 40, "lr": 2e-4, "weight_decay": 0.01,
    },
    # A small decoder with an untied head and grouped-query attention.
    "llama_tiny": {
        "kind": "llama",
        "config": dict(vocab_size=2048, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                       tie_word_embeddings=False),
        "seq_len": 128, "samples": 16, "batch_size": 4, "steps": 16, "lr": 2e-4, "weight_decay": 0.01,
    },
    # Llama-3.2-1B's shape: 1.24B parameters, tied embeddings, 128k vocabulary.
    "llama_1b": {
        "kind": "llama",
        "config": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                       tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=500000.0,
                       rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                         original_max_position_embeddings=8192)),
        "seq_len": 1024, "samples": 64, "batch_size": 8, "steps": 24, "lr": 2e-4, "weight_decay": 0.01,
    },
}

CPU_JOBS = ["vit_ti_64", "llama_tiny"]
GPU_JOBS = ["vit_b16_224", "llama_1b"]
MODES = ["full", "lora", "frozen"]
# A decoder's "frozen" trains its output projection alone: rarely what a language model needs.
DEFAULT_MODES = {"vit": ["full", "lora", "frozen"], "llama": ["full", "lora"]}
PRECISIONS = ["fp32", "bf16-mixed", "fp16-mixed"]


def steps_per_epoch(job):
    j = JOBS[job]
    return j["samples"] // j["batch_size"]


def token_dtype(job):
    return "uint16" if JOBS[job]["config"]["vocab_size"] <= 1 << 16 else "uint32"


def vit_options(job):
    """The vit preset's options for a base given as one safetensors file (LoRA's: the base and
    peft's adapters under memtrain's names), which has no config.json to read them from."""
    c = JOBS[job]["config"]
    return {"image_size": c["image_size"], "patch_size": c["patch_size"], "layers": c["num_hidden_layers"],
            "heads": c["num_attention_heads"], "hidden_dim": c["hidden_size"], "mlp_dim": c["intermediate_size"],
            "num_classes": c["num_labels"], "layer_norm_eps": 1e-12}


def frozen_patterns(job):
    """What a frozen-backbone run freezes, in memtrain's names: all but the head. A decoder with
    tied embeddings trains the embedding table, which is its output projection."""
    if JOBS[job]["kind"] == "vit":
        return ["conv_proj.*", "class_token", "encoder.*"]
    if JOBS[job]["config"].get("tie_word_embeddings"):
        return ["model.layers.*", "model.norm.*"]
    return ["model.*"]


def memtrain_spec(job, work, mode, precision, threads, device, seq_len):
    """The job as a memtrain spec over the prepared directory `work` (finetune_job.py make)."""
    j = JOBS[job]
    vit = j["kind"] == "vit"
    init = f"{work}/hf"
    if mode == "lora":
        init = f"{work}/lora-init.safetensors" if vit else f"{work}/lora-init"
    lines = ["[job]", f'name = "finetune-{job}-{mode}"', f"threads = {threads}", f'device = "{device}"', "seed = 0",
             "[model]", f'preset = "{j["kind"]}"', f'init_from = "{init}"']
    if vit and mode == "lora":
        lines += ["[model.vit]", *[f"{k} = {toml_value(v)}" for k, v in vit_options(job).items()]]
    if mode == "lora":
        targets = VIT_LORA_MEMTRAIN if vit else LLAMA_LORA_MEMTRAIN
        lines += ["[model.lora]", f"rank = {RANK}", f"alpha = {ALPHA}", f"targets = {toml_value(targets)}"]
        if vit:
            lines.append('extras = ["heads.head"]')
    if vit:
        lines += ["[data]", 'source = "npz"', f'path = "{work}/data.npz"', f'val_path = "{work}/val.npz"']
    else:
        lines += ["[data]", 'source = "tokens"', f'path = "{work}/train.bin"', f'val_path = "{work}/val.bin"',
                  f'token_dtype = "{token_dtype(job)}"', f"seq_len = {seq_len}"]
    lines += ["[train]", "epochs = 1000", f"batch_size = {j['batch_size']}", 'optimizer = "adamw"',
              f"lr = {j['lr']}", f"weight_decay = {j['weight_decay']}", f'precision = "{precision}"']
    if mode == "frozen":
        lines.append(f"freeze = {toml_value(frozen_patterns(job))}")
    lines += ["[checkpoint]", "every_epochs = 0", "[log]", "every_steps = 1", 'progress = "off"']
    return "\n".join(lines) + "\n"
