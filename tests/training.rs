//! `memtrain run` end to end: accuracy on real data, records, accumulation, checkpoints,
//! resume, interruption and crash safety.
mod common;

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use common::*;

#[test]
fn digits_mlp_learns_and_leaves_complete_records() {
    let dir = tempfile::tempdir().unwrap();
    let spec = digits_spec("[checkpoint]\nkeep_last = 2\nmonitor = \"val_acc\"\n");
    let (r, out) = run_spec(dir.path(), "digits", &spec, &["--set", "train.epochs=8"]);
    let r = r.ok();
    assert!(
        r.stderr
            .contains("Effective batch size: 32 (micro-batch 32 x 1 accumulation steps)"),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr.contains("Preflight: the first step at micro-batch 32"),
        "{}",
        r.stderr
    );

    let s = json(&out.join("summary.json"));
    assert_eq!(s["status"], "completed");
    assert_eq!(s["exit_code"], 0);
    assert_eq!(s["epochs_completed"], 8);
    let acc = s["final"]["val_acc"].as_f64().unwrap();
    assert!(acc >= 0.9, "validation accuracy {acc}");
    assert!(s["memory"]["peak_rss_bytes"].as_u64().unwrap() > 0);
    assert!(s["samples_per_s"].as_f64().unwrap() > 0.0);

    let epochs = records(&out, "epoch");
    assert_eq!(epochs.len(), 8);
    for (i, e) in epochs.iter().enumerate() {
        assert_eq!(e["epoch"], i as u64 + 1);
        assert!(e["memory"]["rss_bytes"].as_u64().unwrap() > 0);
        assert!(e["memory"]["peak_rss_bytes"].as_u64().unwrap() >= e["memory"]["rss_bytes"].as_u64().unwrap() / 2);
        assert!(e["val_loss"].as_f64().is_some());
    }
    // 1438 training samples / 32 = 45 steps per epoch; a step record every 10 steps.
    assert_eq!(records(&out, "step").len(), 8 * 45 / 10);
    assert_eq!(records(&out, "preflight").len(), 1);
    assert_eq!(records(&out, "checkpoint").len(), 8);
    assert!(out.join("config.resolved.toml").exists());

    // Retention: the last two plus the best.
    let best = json(&out.join("checkpoints/best.json"));
    let kept: Vec<String> = std::fs::read_dir(out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert!(
        kept.contains(&"step-000000360".to_string()) && kept.contains(&"step-000000315".to_string()),
        "{kept:?}"
    );
    assert!(kept.contains(&best["step"].as_str().unwrap().to_string()));
    assert!(kept.len() <= 3, "{kept:?}");
    for k in &kept {
        for f in ["model.safetensors", "optimizer.safetensors", "state.json", "spec.toml"] {
            assert!(out.join("checkpoints").join(k).join(f).exists(), "{k}/{f}");
        }
    }

    // Starting the finished run again without --resume changes nothing.
    let before = std::fs::read(out.join("summary.json")).unwrap();
    let (again, _) = run_spec(dir.path(), "digits", &spec, &[]);
    assert_eq!(again.code, 2);
    assert!(
        again.stderr.contains("already holds a run; pass --resume"),
        "{}",
        again.stderr
    );
    assert_eq!(std::fs::read(out.join("summary.json")).unwrap(), before);
}

/// A tiny synthetic MLP job for comparing the same groups split into different micro-batches.
struct Split {
    samples: i64,
    val_fraction: f64,
    hidden: i64,
    epochs: i64,
    lr: f64,
}

fn split_spec(s: Split, batch: i64, accumulation: i64) -> String {
    format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 16\nhidden = [{}]\n\
         num_classes = 3\n[data]\nsamples = {}\nval_fraction = {}\n[train]\nepochs = {}\nbatch_size = {batch}\n\
         accumulation_steps = {accumulation}\noptimizer = \"sgd\"\nlr = {:?}\n",
        s.hidden, s.samples, s.val_fraction, s.epochs, s.lr
    )
}

#[test]
fn accumulation_gives_the_gradient_of_the_whole_batch() {
    // 10 samples, 2 for validation: one group of 8. SGD with lr 1 makes the weight change equal
    // to the gradient, so comparing weights after one step compares gradients.
    let dir = tempfile::tempdir().unwrap();
    let spec = |b, a| {
        split_spec(
            Split {
                samples: 10,
                val_fraction: 0.2,
                hidden: 32,
                epochs: 1,
                lr: 1.0,
            },
            b,
            a,
        )
    };
    let (_, whole) = run_spec(dir.path(), "whole", &spec(8, 1), &[]);
    let (r, split) = run_spec(dir.path(), "split", &spec(2, 4), &[]);
    assert!(
        r.stderr.contains("Effective batch size: 8 (micro-batch 2 x 4"),
        "{}",
        r.stderr
    );
    let d = max_abs_diff(&final_model(&whole), &final_model(&split));
    assert!(d <= 1e-6, "gradients differ by {d}");
}

#[test]
fn uneven_last_group_is_weighted_by_its_own_size() {
    // 13 training samples in groups of 4: the last group has 1 sample; 1 x 4 splits it the same.
    let dir = tempfile::tempdir().unwrap();
    let spec = |b, a| {
        split_spec(
            Split {
                samples: 16,
                val_fraction: 0.1875,
                hidden: 8,
                epochs: 2,
                lr: 0.5,
            },
            b,
            a,
        )
    };
    let (_, a) = run_spec(dir.path(), "a", &spec(4, 1), &[]);
    let (_, b) = run_spec(dir.path(), "b", &spec(1, 4), &[]);
    assert_eq!(json(&a.join("summary.json"))["global_steps"], 8);
    assert!(max_abs_diff(&final_model(&a), &final_model(&b)) <= 1e-6);
}

#[test]
fn k_epochs_then_resume_equals_a_straight_run() {
    let dir = tempfile::tempdir().unwrap();
    let spec = digits_spec("");
    let (_, straight) = run_spec(dir.path(), "straight", &spec, &["--set", "train.epochs=3"]);
    let (first, part) = run_spec(dir.path(), "part", &spec, &["--set", "train.epochs=1"]);
    first.ok();
    let p = dir.path().join("part.toml");
    let r = run(&[
        "run",
        p.to_str().unwrap(),
        "--resume",
        part.to_str().unwrap(),
        "--set",
        "train.epochs=3",
    ])
    .ok();
    assert!(r.stderr.contains("resuming from"), "{}", r.stderr);
    assert_eq!(json(&part.join("summary.json"))["epochs_completed"], 3);
    // Resuming a finished run without more epochs trains nothing and keeps its records.
    let summary = std::fs::read(part.join("summary.json")).unwrap();
    let r = run(&[
        "run",
        p.to_str().unwrap(),
        "--resume",
        part.to_str().unwrap(),
        "--set",
        "train.epochs=3",
    ])
    .ok();
    assert!(r.stderr.contains("already finished 3 epoch(s)"), "{}", r.stderr);
    assert_eq!(std::fs::read(part.join("summary.json")).unwrap(), summary);
    let (a, b) = (final_model(&straight), final_model(&part));
    assert_eq!(
        std::fs::read(&a).unwrap(),
        std::fs::read(&b).unwrap(),
        "weights differ after resume"
    );
}

fn wait_for(path: &Path, needle: &str, limit: Duration) {
    let t = Instant::now();
    while t.elapsed() < limit {
        if std::fs::read_to_string(path)
            .map(|s| s.contains(needle))
            .unwrap_or(false)
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    panic!("{needle} never appeared in {}", path.display());
}

#[test]
fn ctrl_c_saves_exits_130_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let spec = digits_spec("").replace("[log]\n", "[log]\nevery_steps = 1\n");
    let (_, straight) = run_spec(dir.path(), "straight", &spec, &["--set", "train.epochs=4"]);
    let p = write(dir.path(), "int.toml", &spec);
    let out = dir.path().join("int");
    let child = memtrain()
        .args([
            "run",
            p.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--set",
            "train.epochs=4",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for(&out.join("metrics.jsonl"), "\"type\":\"step\"", Duration::from_secs(60));
    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted at epoch"), "{stderr}");
    let s = json(&out.join("summary.json"));
    assert_eq!(s["status"], "interrupted");
    assert_eq!(s["exit_code"], 130);
    let steps = s["global_steps"].as_u64().unwrap();
    assert!(
        steps < 4 * 45,
        "the run finished before the signal arrived ({steps} steps)"
    );
    assert!(!records(&out, "checkpoint").iter().all(|c| c["reason"] != "interrupted"));

    // A bare --resume continues the run directory the command names (here through --out).
    let r = run(&[
        "run",
        p.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--resume",
        "--set",
        "train.epochs=4",
    ])
    .ok();
    assert!(r.stderr.contains("resuming from"), "{}", r.stderr);
    assert_eq!(json(&out.join("summary.json"))["status"], "completed");
    assert_eq!(
        std::fs::read(final_model(&straight)).unwrap(),
        std::fs::read(final_model(&out)).unwrap(),
        "interrupted + resumed weights differ from the straight run"
    );
}

#[test]
fn a_process_killed_while_saving_leaves_the_previous_checkpoint_intact() {
    let dir = tempfile::tempdir().unwrap();
    let spec = digits_spec("");
    let (_, straight) = run_spec(dir.path(), "straight", &spec, &[]);
    let p = write(dir.path(), "crash.toml", &spec);
    let out = dir.path().join("crash");
    // Epochs are 45 steps: the save after epoch 2 (step 90) dies half-way.
    let o = memtrain()
        .args(["run", p.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .env("MEMTRAIN_FAULT_ABORT_SAVE_AT_STEP", "90")
        .output()
        .unwrap();
    assert_ne!(o.status.code(), Some(0));
    let ck = out.join("checkpoints");
    assert!(ck.join("step-000000045/model.safetensors").exists());
    assert!(
        ck.join(".tmp-step-000000090").exists(),
        "the interrupted save should have left its temporary dir"
    );
    assert!(!ck.join("step-000000090").exists());
    // The surviving checkpoint loads and the run resumes to the same result as a straight run.
    let r = run(&["run", p.to_str().unwrap(), "--resume", out.to_str().unwrap()]).ok();
    assert!(r.stderr.contains("step-000000045"), "{}", r.stderr);
    assert!(!ck.join(".tmp-step-000000090").exists(), "leftovers are cleaned up");
    assert_eq!(
        std::fs::read(final_model(&straight)).unwrap(),
        std::fs::read(final_model(&out)).unwrap()
    );
}

#[test]
fn init_from_loads_weights_by_name_and_explains_mismatches() {
    let dir = tempfile::tempdir().unwrap();
    let (_, first) = run_spec(dir.path(), "first", &digits_spec(""), &["--set", "train.epochs=1"]);
    let weights = final_model(&first);
    let warm = digits_spec("").replace(
        "preset = \"mlp\"\n",
        &format!("preset = \"mlp\"\ninit_from = \"{}\"\n", weights.display()),
    );
    let (r, warm_out) = run_spec(
        dir.path(),
        "warm",
        &warm,
        &["--set", "train.epochs=1", "--set", "train.lr=1e-9"],
    );
    r.ok();
    // With a negligible learning rate the warm start keeps the loaded accuracy.
    let acc = json(&warm_out.join("summary.json"))["final"]["val_acc"]
        .as_f64()
        .unwrap();
    let acc_first = json(&first.join("summary.json"))["final"]["val_acc"].as_f64().unwrap();
    assert!((acc - acc_first).abs() < 0.01, "{acc} vs {acc_first}");

    let wrong = warm.replace("hidden = [32]", "hidden = [16]");
    let (r, _) = run_spec(dir.path(), "wrong", &wrong, &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("does not match the model") && r.stderr.contains("mis-shaped: fc0.bias"),
        "{}",
        r.stderr
    );
}

#[test]
fn darts_search_logs_its_genotype() {
    let dir = tempfile::tempdir().unwrap();
    let spec = "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"darts\"\n[model.darts]\ninput_length = 32\n\
                init_channels = 8\nnum_cells = 3\nnum_nodes = 2\nnum_classes = 3\n\
                ops = [\"none\", \"skip_connect\", \"max_pool_3\", \"sep_conv_3\", \"attention_light\"]\n\
                [data]\nsamples = 24\n[train]\nepochs = 2\nbatch_size = 4\noptimizer = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n";
    let (r, out) = run_spec(dir.path(), "darts", spec, &[]);
    let r = r.ok();
    assert!(r.stderr.contains("genotype:"), "{}", r.stderr);
    let g = json(&out.join("genotype.json"));
    assert_eq!(g["epoch"], 2);
    for kind in ["normal", "reduce"] {
        let nodes = g["genotype"][kind].as_array().unwrap();
        assert_eq!(nodes.len(), 2);
        for node in nodes {
            assert_eq!(node.as_array().unwrap().len(), 2);
            assert_ne!(node[0][0], "none");
        }
    }
    assert!(records(&out, "epoch").iter().all(|e| e["genotype"].is_object()));
    // Architecture weights are checkpointed with their own optimizer state.
    let model = tensors(&final_model(&out));
    assert!(model.iter().any(|(n, _)| n == "arch.alpha_normal"));
}

#[test]
fn bf16_trains_and_checkpoints_in_bf16() {
    let dir = tempfile::tempdir().unwrap();
    let (r, out) = run_spec(
        dir.path(),
        "bf16",
        &digits_spec(""),
        &["--set", "train.precision=\"bf16\""],
    );
    r.ok();
    let acc = json(&out.join("summary.json"))["final"]["val_acc"].as_f64().unwrap();
    assert!(acc > 0.8, "bf16 validation accuracy {acc}");
    let model = tensors(&final_model(&out));
    assert!(model.iter().all(|(_, t)| t.kind() == tch::Kind::BFloat16));
}
