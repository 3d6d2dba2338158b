//! scripts/bench/run without a GPU: its CUDA dry run shows the GPU-sized jobs against both
//! PyTorch baselines, carries the allocator and spec overrides to the sides they are for, and
//! options that only mean something on CUDA are refused on the CPU, saying why; the CUDA-graph
//! benchmark (scripts/bench/graphs) shows its jobs, memtrain sides and compiled baseline.
use std::process::Output;

use crate::common::*;

fn bench(args: &[&str]) -> Output {
    bench_script("run", args)
}

#[test]
fn the_cuda_dry_run_shows_gpu_sized_jobs_against_both_baselines() {
    let o = bench(&["--device", "cuda", "--dry-run", "--reps", "2"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for job in ["resnet18_224", "resnet50_224", "vit_b16_224", "mlp_wide"] {
        assert!(out.contains(&format!("# {job}: ")), "no {job}:\n{out}");
    }
    let train = command_lines(&out, "pytorch_job.py train");
    let memtrain = command_lines(&out, env!("CARGO_BIN_EXE_memtrain"));
    // 4 jobs x 3 settings x 2 rounds, one memtrain run and one per baseline in each.
    assert_eq!(memtrain.len(), 24, "{out}");
    // Each baseline once a round; a ViT's twice: with the attention plain PyTorch runs fastest
    // (packed in-projection, scaled_dot_product_attention) and with torchvision's module.
    for mode in ["resident", "loader"] {
        let n = train
            .iter()
            .filter(|l| l.contains(&format!("--data-mode {mode} ")))
            .count();
        assert_eq!(n, 24 + 6, "{mode}:\n{out}");
        let sdpa: Vec<_> = train
            .iter()
            .filter(|l| l.contains(&format!("--data-mode {mode} ")) && l.contains("--attention sdpa"))
            .collect();
        assert_eq!(sdpa.len(), 6, "{mode}:\n{out}");
        assert!(sdpa.iter().all(|l| l.contains("--job vit_b16_224 ")), "{out}");
    }
    assert!(train.iter().all(|l| l.contains("--device cuda")), "{out}");
    let spec = memtrain[0].split_whitespace().nth(3).unwrap();
    let text = std::fs::read_to_string(spec).unwrap();
    assert!(text.contains("device = \"cuda\""), "{text}");
    // A round's order is reversed in the next, so neither side always runs first.
    let runs: Vec<&str> = out
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains(" init "))
        .collect();
    assert!(runs[0].contains(env!("CARGO_BIN_EXE_memtrain")), "{out}");
    assert!(runs[5].contains(env!("CARGO_BIN_EXE_memtrain")), "{out}");
}

#[test]
fn overrides_reach_the_sides_they_are_for() {
    let o = bench(&[
        "--device",
        "cuda",
        "--dry-run",
        "--reps",
        "1",
        "--jobs",
        "resnet18_224",
        "--settings",
        "fp32",
        "--baselines",
        "resident",
        "--alloc-conf",
        "expandable_segments:True",
        "--memtrain-set",
        "memory.allocator.expandable_segments=true",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let memtrain = command_lines(&out, env!("CARGO_BIN_EXE_memtrain"));
    let train = command_lines(&out, "pytorch_job.py train");
    assert_eq!((memtrain.len(), train.len()), (1, 1), "{out}");
    for l in memtrain.iter().chain(&train) {
        assert!(
            l.starts_with("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "),
            "{l}"
        );
    }
    assert!(
        memtrain[0].ends_with("--set memory.allocator.expandable_segments=true"),
        "{}",
        memtrain[0]
    );
    assert!(!train[0].contains("--set"), "{}", train[0]);
}

#[test]
fn cuda_only_options_are_refused_on_the_cpu() {
    for (args, says) in [
        (&["--peak-diff", "/tmp/x"][..], "--peak-diff needs --device cuda"),
        (
            &["--alloc-conf", "expandable_segments:True"][..],
            "--alloc-conf needs --device cuda",
        ),
        (&["--memtrain-set", "nothing"][..], "--memtrain-set takes KEY=VALUE"),
    ] {
        let o = bench(&[&["--dry-run"][..], args].concat());
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?}");
    }
}

#[test]
fn the_graph_benchmark_dry_run_names_its_jobs_sides_and_the_compiled_baseline() {
    let o = bench_script("graphs", &["--dry-run", "--reps", "2"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // configs/darts_4gb.toml's shape, ResNet18 at 224 px and ViT-B/16, both at batch 8.
    assert!(out.contains("# darts_main: darts "), "{out}");
    assert!(out.contains("'input_length': 3000"), "{out}");
    assert!(out.contains("'init_channels': 24, 'num_cells': 3"), "{out}");
    assert!(out.contains("batch 2 x 2 accumulation"), "{out}");
    assert!(out.contains("# resnet18_224_b8: resnet18 "), "{out}");
    assert!(out.contains("# vit_b16_224_b8: vit "), "{out}");
    let memtrain = command_lines(&out, env!("CARGO_BIN_EXE_memtrain"));
    let train = command_lines(&out, "pytorch_job.py train");
    // 3 jobs x 2 rounds: memtrain eager and graphed, PyTorch eager and reduce-overhead.
    assert_eq!((memtrain.len(), train.len()), (12, 12), "{out}");
    let graphed: Vec<_> = memtrain
        .iter()
        .filter(|l| l.contains(r#"--set 'train.cuda_graph="on"'"#))
        .collect();
    let eager: Vec<_> = memtrain
        .iter()
        .filter(|l| l.contains(r#"--set 'train.cuda_graph="off"'"#))
        .collect();
    assert_eq!((graphed.len(), eager.len()), (6, 6), "{out}");
    assert!(
        memtrain
            .iter()
            .all(|l| l.contains(r#"--set 'train.optimizer_impl="fused"'"#)),
        "{out}"
    );
    let compiled = train.iter().filter(|l| l.contains("--compile reduce-overhead")).count();
    assert_eq!(compiled, 6, "{out}");
    assert!(
        train
            .iter()
            .all(|l| l.contains("--data-mode resident ") && l.contains("--device cuda")),
        "{out}"
    );
    // The DARTS spec memtrain runs has the main job's step: 2 x 2, clipped at 5.
    let spec = memtrain[0].split_whitespace().nth(3).unwrap();
    let text = std::fs::read_to_string(spec).unwrap();
    for want in [
        "input_length = 3000",
        "batch_size = 2",
        "accumulation_steps = 2",
        "grad_clip_norm = 5.0",
        "device = \"cuda\"",
    ] {
        assert!(text.contains(want), "{want}:\n{text}");
    }
}
