//! scripts/bench/finetune without a GPU: its dry runs name the fine-tuning jobs (a ViT in full,
//! with LoRA and over a frozen backbone; a decoder in full and with LoRA), pair each memtrain run
//! with its PyTorch twin in alternating order, and write specs that train what the PyTorch side
//! trains; unknown modes are refused, saying which there are.
use std::process::Output;

use crate::common::*;

fn finetune(args: &[&str]) -> Output {
    bench_script("finetune", args)
}

/// The value after `flag` on a command line.
fn arg<'a>(line: &'a str, flag: &str) -> &'a str {
    let words: Vec<&str> = line.split_whitespace().collect();
    let i = words
        .iter()
        .position(|w| *w == flag)
        .unwrap_or_else(|| panic!("no {flag}: {line}"));
    words[i + 1]
}

#[test]
fn the_cuda_dry_run_names_each_fine_tune_beside_its_pytorch_twin() {
    let o = finetune(&["--device", "cuda", "--dry-run", "--reps", "2", "--seq-len", "2048"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for job in ["vit_b16_224", "llama_1b"] {
        assert!(out.contains(&format!("# {job}: ")), "no {job}:\n{out}");
        assert_eq!(
            command_lines(&out, "finetune_job.py make")
                .iter()
                .filter(|l| l.contains(job))
                .count(),
            1
        );
    }
    let memtrain = command_lines(&out, env!("CARGO_BIN_EXE_memtrain"));
    let pytorch = command_lines(&out, "finetune_job.py train");
    // (3 ViT modes + 2 decoder modes) x 2 rounds.
    assert_eq!((memtrain.len(), pytorch.len()), (10, 10), "{out}");
    let rows: Vec<(&str, &str)> = pytorch
        .iter()
        .step_by(2)
        .map(|l| (arg(l, "--job"), arg(l, "--mode")))
        .collect();
    assert_eq!(
        rows,
        [
            ("vit_b16_224", "full"),
            ("vit_b16_224", "lora"),
            ("vit_b16_224", "frozen"),
            ("llama_1b", "full"),
            ("llama_1b", "lora")
        ],
        "{out}"
    );
    for l in &pytorch {
        assert_eq!(arg(l, "--device"), "cuda", "{l}");
        assert_eq!(arg(l, "--precision"), "bf16-mixed", "{l}");
        assert!(!l.contains("--counting"), "CUDA counts with its own allocator: {l}");
        if arg(l, "--job") == "llama_1b" {
            assert_eq!(arg(l, "--seq-len"), "2048", "{l}");
        }
    }
    // A round's order is reversed in the next, so neither side always runs first.
    let timed: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains(" make "))
        .collect();
    assert!(timed[0].contains(env!("CARGO_BIN_EXE_memtrain")), "{out}");
    assert!(timed[3].contains(env!("CARGO_BIN_EXE_memtrain")), "{out}");
    // Each row's spec trains what its PyTorch twin trains.
    let spec = |i: usize| std::fs::read_to_string(memtrain[i].split_whitespace().nth(3).unwrap()).unwrap();
    let vit_lora = spec(2);
    for says in [
        "device = \"cuda\"",
        "precision = \"bf16-mixed\"",
        "rank = 16",
        "targets = [\"in_proj_q\", \"in_proj_k\", \"in_proj_v\", \"out_proj\", \"mlp.0\", \"mlp.3\"]",
        "extras = [\"heads.head\"]",
        "hidden_dim = 768",
    ] {
        assert!(vit_lora.contains(says), "{says}:\n{vit_lora}");
    }
    assert!(
        spec(0).contains("/vit_b16_224/hf\""),
        "the full fine-tune reads the saved directory"
    );
    assert!(spec(4).contains("freeze = [\"conv_proj.*\", \"class_token\", \"encoder.*\"]"));
    let llama_lora = spec(8);
    for says in [
        "seq_len = 2048",
        "token_dtype = \"uint32\"",
        "targets = [\"q\", \"k\", \"v\", \"o\", \"gate\", \"up\", \"down\"]",
    ] {
        assert!(llama_lora.contains(says), "{says}:\n{llama_lora}");
    }
}

#[test]
fn the_cpu_dry_run_counts_pytorchs_memory_and_refuses_unknown_modes() {
    let o = finetune(&["--dry-run", "--reps", "1", "--modes", "frozen"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let pytorch = command_lines(&out, "finetune_job.py train");
    let jobs: Vec<&str> = pytorch.iter().map(|l| arg(l, "--job")).collect();
    assert_eq!(jobs, ["vit_ti_64", "llama_tiny"], "{out}");
    for l in &pytorch {
        assert_eq!(arg(l, "--mode"), "frozen", "{l}");
        assert_eq!(arg(l, "--precision"), "fp32", "{l}");
        assert!(arg(l, "--counting").ends_with("libmemtrain_shim.so"), "{l}");
    }
    let o = finetune(&["--dry-run", "--modes", "full,adapters"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("no mode adapters: full, lora, frozen"), "{err}");
    assert!(o.stdout.is_empty());
}
