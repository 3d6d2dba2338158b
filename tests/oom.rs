//! Real allocation failures on the CPU: `memory.limit` caps the data segment (RLIMIT_DATA), so
//! libtorch's allocator fails for real and every OOM path runs as it would on a small GPU.
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
        r.stderr.contains("Memory cap: 100 MiB of process data memory"),
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
    assert!(report["error"].as_str().unwrap().contains("DefaultCPUAllocator"));
    assert!(report["cpu_data_limit_bytes"].as_u64().is_some());
    assert!(capped.join("oom/spec.toml").exists());

    // Preflight reports the measured first step against the cap.
    let pre = &records(&capped, "preflight")[0];
    assert_eq!(pre["micro_batch"], micro);
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
