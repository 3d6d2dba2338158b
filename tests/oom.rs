//! Real allocation failures on the CPU: `memory.limit` caps live tensor bytes in the counting CPU
//! allocator, so libtorch's allocations fail for real, deterministically, and every OOM path
//! runs as it would on a small GPU.
mod common;

use std::path::{Path, PathBuf};

use common::*;

/// Activations dominate: one hidden layer of 262,144 units is 1 MiB per sample per tensor,
/// so micro-batch 32 needs far more than a 100 MiB cap allows, and 8 fits easily.
fn wide_spec(memory: &str) -> String {
    format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 8\nhidden = [262144]\n\
         num_classes = 2\n[data]\nsamples = 160\n[train]\nepochs = 1\nbatch_size = 32\noptimizer = \"sgd\"\nlr = 0.01\n\
         [log]\nprogress = \"lines\"\n[memory]\n{memory}"
    )
}

const CAP: &str = "limit = \"100MiB\"\n";

fn run_wide(dir: &Path, name: &str, memory: &str, extra: &[&str]) -> (Run, PathBuf) {
    run_spec(dir, name, &wide_spec(memory), extra)
}

#[test]
fn backoff_keeps_the_effective_batch_and_the_weights_of_the_smaller_batch() {
    let dir = tempfile::tempdir().unwrap();
    let (r, capped) = run_wide(
        dir.path(),
        "capped",
        &format!("{CAP}on_oom = [\"backoff\", \"fail\"]\n"),
        &[],
    );
    let r = r.ok();
    assert!(r.stderr.contains("backing off: micro-batch 32 -> 16"), "{}", r.stderr);
    assert!(r.stderr.contains("effective batch stays 32"), "{}", r.stderr);
    assert!(
        r.stderr.contains("Memory cap: 100 MiB of CPU tensor memory"),
        "{}",
        r.stderr
    );

    let s = json(&capped.join("summary.json"));
    assert_eq!(s["status"], "completed");
    let micro = s["batch"]["final_micro_batch"].as_i64().unwrap();
    let acc = s["batch"]["final_accumulation_steps"].as_i64().unwrap();
    assert!(micro < 32 && micro * acc == 32, "micro {micro} x {acc}");
    assert_eq!(s["batch"]["effective_batch"], 32);
    assert!(s["oom"]["backoffs"].as_u64().unwrap() >= 1);
    // Every training sample exactly once: 128 of the 160 (32 are held out).
    assert_eq!(s["samples_trained"], 128);

    let ooms = records(&capped, "oom");
    assert!(!ooms.is_empty());
    assert_eq!(ooms[0]["kind"], "cpu");
    assert_eq!(ooms[0]["decision"]["action"], "backoff");
    assert!(ooms[0]["error"].as_str().unwrap().contains("can't allocate memory"));
    assert_eq!(ooms[0]["batch_shape"], serde_json::json!([32, 8]));

    // The first OOM leaves a report.
    let report = json(&capped.join("oom/report.json"));
    assert_eq!(report["micro_batch"], 32);
    assert!(report["error"].as_str().unwrap().contains("CPU out of memory"));
    assert_eq!(report["cap"]["bytes"], 100 << 20);
    assert_eq!(report["cap"]["kind"], "cpu_tensor_bytes");
    assert!(report["allocator_stats"]["num_ooms"].as_u64().unwrap() >= 1);
    assert!(capped.join("oom/spec.toml").exists());

    // Preflight reports the measured first step against the cap, in exact tensor bytes.
    let pre = &records(&capped, "preflight")[0];
    assert_eq!(pre["micro_batch"], micro);
    assert_eq!(pre["measure"], "peak allocated");
    let peak = pre["peak_bytes"].as_i64().unwrap();
    assert!(peak > 0 && peak <= 100 << 20, "{pre}");
    assert_eq!(pre["headroom_bytes"].as_i64().unwrap(), (100 << 20) - peak);
    assert_eq!(pre["cap_bytes"], 100 << 20);
    assert!(pre["headroom_bytes"].as_i64().is_some());

    // The same job configured at the micro-batch it backed off to, with no cap, ends with
    // exactly the same weights: the failed attempts left no trace.
    let (r, reference) = run_wide(
        dir.path(),
        "reference",
        "",
        &[
            "--set",
            &format!("train.batch_size={micro}"),
            "--set",
            &format!("train.accumulation_steps={acc}"),
        ],
    );
    r.ok();
    assert!(records(&reference, "oom").is_empty());
    assert_eq!(
        std::fs::read(final_model(&capped)).unwrap(),
        std::fs::read(final_model(&reference)).unwrap(),
        "backed-off run and {micro} x {acc} run differ"
    );

    // A resumed run keeps the micro-batch it had backed off to.
    let p = dir.path().join("capped.toml");
    run(&[
        "run",
        p.to_str().unwrap(),
        "--resume",
        capped.to_str().unwrap(),
        "--set",
        "train.epochs=2",
    ])
    .ok();
    let starts = records(&capped, "start");
    assert_eq!(starts.last().unwrap()["micro_batch"], micro);
    assert_eq!(starts.last().unwrap()["resumed"], true);
}

#[test]
fn fail_exits_3_and_writes_the_oom_report() {
    let dir = tempfile::tempdir().unwrap();
    let (r, out) = run_wide(dir.path(), "fail", &format!("{CAP}on_oom = [\"fail\"]\n"), &[]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(
        r.stderr.contains("error: out of memory in training step"),
        "{}",
        r.stderr
    );
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    let s = json(&out.join("summary.json"));
    assert_eq!(s["status"], "oom");
    assert_eq!(s["exit_code"], 3);
    assert!(out.join("oom/report.json").exists() && out.join("oom/spec.toml").exists());
    // The last good state is saved and can be resumed with a policy that can cope.
    let ck = records(&out, "checkpoint");
    assert_eq!(ck.len(), 1);
    assert_eq!(ck[0]["reason"], "oom");
    let p = dir.path().join("fail.toml");
    let r = run(&[
        "run",
        p.to_str().unwrap(),
        "--resume",
        out.to_str().unwrap(),
        "--set",
        "memory.on_oom=[\"backoff\",\"fail\"]",
    ])
    .ok();
    assert!(r.stderr.contains("backing off"), "{}", r.stderr);
    assert_eq!(json(&out.join("summary.json"))["status"], "completed");
}

#[test]
fn reaching_min_batch_size_ends_the_run_as_the_policy_says() {
    let dir = tempfile::tempdir().unwrap();
    let (r, out) = run_wide(
        dir.path(),
        "min",
        &format!("{CAP}on_oom = [\"backoff\", \"fail\"]\nmin_batch_size = 32\n"),
        &[],
    );
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("cannot be halved without going below memory.min_batch_size 32"),
        "{}",
        r.stderr
    );
    let ooms = records(&out, "oom");
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0]["decision"]["action"], "fail");
}

#[test]
fn cpu_fallback_on_a_cpu_run_is_skipped_with_a_notice() {
    let dir = tempfile::tempdir().unwrap();
    let (r, _) = run_wide(dir.path(), "cpu", &format!("{CAP}on_oom = [\"cpu\", \"fail\"]\n"), &[]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(
        r.stderr.contains("skipped cpu: the run is already on the CPU"),
        "{}",
        r.stderr
    );
}

#[test]
fn grow_back_returns_to_the_configured_micro_batch_after_clean_steps() {
    let dir = tempfile::tempdir().unwrap();
    // A cap that 32 does not fit: growing back OOMs again and backs off again; the run still
    // finishes with every sample trained once.
    let (r, out) = run_wide(dir.path(), "grow", &format!("{CAP}grow_back_after = 1\n"), &[]);
    r.ok();
    let s = json(&out.join("summary.json"));
    assert!(s["oom"]["grow_backs"].as_u64().unwrap() >= 1, "{s}");
    assert!(s["oom"]["backoffs"].as_u64().unwrap() >= 2, "{s}");
    assert_eq!(s["samples_trained"], 128);
    assert!(!records(&out, "grow_back").is_empty());
}

#[test]
fn allocator_settings_merge_with_the_environment_and_conflicts_are_reported() {
    let dir = tempfile::tempdir().unwrap();
    let spec = digits_spec(
        "[memory.allocator]\nexpandable_segments = true\nmax_split_size_mb = 256\ngarbage_collection_threshold = 0.6\n",
    )
    .replace("epochs = 3", "epochs = 1");
    let p = write(dir.path(), "alloc.toml", &spec);
    let out = dir.path().join("alloc");
    let o = memtrain()
        .args(["run", p.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .env(
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size_mb:128,roundup_power2_divisions:4",
        )
        .output()
        .unwrap();
    let r = Run::from(o).ok();
    assert!(
        r.stderr
            .contains("allocator setting max_split_size_mb: the environment says 128, the spec says 256"),
        "{}",
        r.stderr
    );
    let start = &records(&out, "start")[0];
    assert_eq!(
        start["allocator_conf"],
        "max_split_size_mb:256,roundup_power2_divisions:4,expandable_segments:True,garbage_collection_threshold:0.6"
    );
    assert_eq!(start["allocator_conflicts"][0]["key"], "max_split_size_mb");
}

/// A model whose weights are large and activations tiny: Adam's step is where memory runs out.
fn adam_spec(extra: &str) -> String {
    format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 256\nhidden = [512]\n\
         num_classes = 4\n[data]\nsamples = 40\nval_fraction = 0.2\n[train]\nepochs = 2\nbatch_size = 8\n\
         optimizer = \"adam\"\nweight_decay = 0.01\nlr = 0.01\ngrad_clip_norm = 1.0\n[log]\nprogress = \"lines\"\n\
         every_steps = 1\n[memory]\nlimit = \"1GiB\"\n{extra}"
    )
}

fn run_with_fault(dir: &Path, name: &str, spec: &str, step: i64) -> (Run, PathBuf) {
    let p = write(dir, &format!("{name}.toml"), spec);
    let out = dir.join(name);
    let o = memtrain()
        .args(["run", p.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .env("MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP", step.to_string())
        .output()
        .unwrap();
    (Run::from(o), out)
}

#[test]
fn an_oom_inside_the_optimizer_step_leaves_no_trace() {
    let dir = tempfile::tempdir().unwrap();
    // The first step's optimizer update fails for real (its workspace allocation passes the
    // squeezed cap); backoff retries the group at micro-batch 4 x 2.
    let (r, faulted) = run_with_fault(
        dir.path(),
        "faulted",
        &adam_spec("on_oom = [\"backoff\", \"fail\"]\n"),
        1,
    );
    let r = r.ok();
    assert!(r.stderr.contains("backing off: micro-batch 8 -> 4"), "{}", r.stderr);
    let ooms = records(&faulted, "oom");
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0]["kind"], "cpu");
    assert!(
        ooms[0]["error"].as_str().unwrap().contains("CPU out of memory"),
        "{}",
        ooms[0]
    );
    // The same job configured at 4 x 2 from the start, no fault: byte-identical weights, and the
    // optimizer counted each step once (Adam's bias correction would differ otherwise).
    let (r, clean) = run_spec(
        dir.path(),
        "clean",
        &adam_spec(""),
        &["--set", "train.batch_size=4", "--set", "train.accumulation_steps=2"],
    );
    r.ok();
    assert!(records(&clean, "oom").is_empty());
    assert_eq!(
        std::fs::read(final_model(&faulted)).unwrap(),
        std::fs::read(final_model(&clean)).unwrap(),
        "a failed optimizer step must leave parameters and state untouched"
    );
    let steps = |d: &Path| json(&d.join("summary.json"))["global_steps"].clone();
    assert_eq!(steps(&faulted), steps(&clean));
}

#[test]
fn with_fail_the_exit_checkpoint_holds_the_weights_from_before_the_failed_step() {
    let dir = tempfile::tempdir().unwrap();
    // 32 training samples at 8 per step: 4 steps an epoch. Step 5 (epoch 2's first) fails.
    let (r, failed) = run_with_fault(dir.path(), "failed", &adam_spec("on_oom = [\"fail\"]\n"), 5);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(r.stderr.contains("out of memory in training step"), "{}", r.stderr);
    let ck = records(&failed, "checkpoint");
    assert_eq!(ck.last().unwrap()["reason"], "oom");
    assert_eq!(ck.last().unwrap()["step"], 4);
    let (r, one_epoch) = run_spec(dir.path(), "one", &adam_spec(""), &["--set", "train.epochs=1"]);
    r.ok();
    assert_eq!(
        std::fs::read(final_model(&failed)).unwrap(),
        std::fs::read(final_model(&one_epoch)).unwrap(),
        "the exit checkpoint must hold the weights of step 4"
    );
    let opt = |d: &Path| std::fs::read(final_model(d).with_file_name("optimizer.safetensors")).unwrap();
    assert_eq!(opt(&failed), opt(&one_epoch), "and the optimizer state of step 4");
}

#[test]
fn init_weights_larger_than_the_cap_exit_3_naming_the_sizes() {
    let dir = tempfile::tempdir().unwrap();
    // A first run makes a weight file of about half a MiB; with the model built, a 1 MiB cap
    // cannot hold it as well.
    let spec = adam_spec("").replace("limit = \"1GiB\"", "");
    let (r, first) = run_spec(dir.path(), "first", &spec, &["--set", "train.epochs=1"]);
    r.ok();
    let init = final_model(&first);
    let capped = format!(
        "{}\n",
        spec.replace(
            "preset = \"mlp\"",
            &format!("preset = \"mlp\"\ninit_from = \"{}\"", init.display())
        )
    )
    .replace("[memory]\n", "[memory]\nlimit = \"1MiB\"\n");
    let (r, out) = run_spec(dir.path(), "capped", &capped, &[]);
    assert_eq!(r.code, 3, "{}", r.stderr);
    assert!(r.stderr.contains("out of memory while"), "{}", r.stderr);
    assert!(r.stderr.contains("1.00 MiB"), "names the cap: {}", r.stderr);
    assert!(
        !r.stderr.contains("frame #") && !r.stderr.contains("panicked"),
        "{}",
        r.stderr
    );
    assert!(!out.join("metrics.jsonl").exists(), "nothing was started");
}
