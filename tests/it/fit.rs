//! `memtrain fit` under the exact CPU cap: its search against brute force, and the spec it
//! recommends trained for real under the same budget.
mod common;

use std::path::Path;

use common::*;
use serde_json::Value;

/// A small ViT: activations, which grow with the micro-batch, dwarf its parameters (1.0 MB of
/// peak at micro-batch 1, 6.4 MB at 48). SGD, an effective batch of 48, synthetic images.
fn spec_text() -> String {
    r#"# the fit test's job: this comment must survive --write
[job]
name = "fit"
threads = 1
device = "cpu"
[model]
preset = "vit"
[model.vit]
image_size = 16
patch_size = 4
layers = 4
heads = 2
hidden_dim = 32
mlp_dim = 64
num_classes = 4
[data]
source = "synthetic"
samples = 240
val_fraction = 0.2
[train]
epochs = 1
batch_size = 16
accumulation_steps = 3
optimizer = "sgd"
lr = 0.05
[log]
progress = "off"
"#
    .to_owned()
}

fn write_spec(dir: &Path) -> std::path::PathBuf {
    let p = dir.join("fit.toml");
    std::fs::write(&p, spec_text()).unwrap();
    p
}

/// `run --max-steps 3` at micro-batch `b` (no accumulation) under `cap`: its exit code and
/// its step peak.
fn probe_by_hand(spec: &Path, out: &Path, b: i64, cap: Option<u64>) -> (i32, Option<u64>) {
    let _ = std::fs::remove_dir_all(out);
    let mut c = memtrain();
    c.args(["-q", "run"]).arg(spec).arg("--out").arg(out).args([
        "--max-steps",
        "3",
        "--set",
        &format!("train.batch_size={b}"),
        "--set",
        "train.accumulation_steps=1",
        "--set",
        "memory.on_oom=[\"fail\"]",
    ]);
    if let Some(cap) = cap {
        c.args(["--set", &format!("memory.limit={cap}")]);
    }
    let o = c.output().unwrap();
    let code = o.status.code().unwrap();
    assert!(code == 0 || code == 3, "{}", String::from_utf8_lossy(&o.stderr));
    let peak = (code == 0).then(|| {
        records(out, "step")
            .iter()
            .map(|s| s["memory"]["peak_allocated_bytes"].as_u64().unwrap())
            .max()
            .unwrap()
    });
    (code, peak)
}

/// A cap 45% of the way from micro-batch 1's step peak to micro-batch 48's.
fn cap_between(spec: &Path, dir: &Path) -> u64 {
    let (_, p1) = probe_by_hand(spec, &dir.join("p1"), 1, None);
    let (_, p48) = probe_by_hand(spec, &dir.join("p48"), 48, None);
    let (p1, p48) = (p1.unwrap(), p48.unwrap());
    assert!(p48 > p1 + 500_000, "activations must matter: {p1} vs {p48}");
    p1 + (p48 - p1) * 45 / 100
}

fn fit(args: &[&str]) -> (i32, String, String) {
    let o = memtrain().arg("fit").args(args).output().unwrap();
    (
        o.status.code().unwrap(),
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn fit_lands_on_the_largest_micro_batch_that_brute_force_finds() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(dir.path());
    let cap = cap_between(&spec, dir.path());
    // Brute force: every micro-batch from 1 to the effective batch, under the cap.
    let fits: Vec<bool> = (1..=48)
        .map(|b| probe_by_hand(&spec, &dir.path().join("b"), b, Some(cap)).0 == 0)
        .collect();
    let truth = fits.iter().rposition(|&f| f).unwrap() as i64 + 1;
    assert!(
        fits[..truth as usize].iter().all(|&f| f),
        "memory grows with the batch: {fits:?}"
    );
    assert!(truth > 4 && truth < 48, "the cap splits the range: {truth}");

    let (code, stdout, stderr) = fit(&[
        spec.to_str().unwrap(),
        "--limit",
        &cap.to_string(),
        "--margin",
        "0%",
        "--precision",
        "fp32",
        "--checkpointing",
        "off",
        "--steps",
        "3",
        "--json",
    ]);
    assert_eq!(code, 0, "{stderr}");
    let r: Value = serde_json::from_str(&stdout).unwrap();
    let found = r["settings"][0]["largest_micro_batch"].as_i64().unwrap();
    assert!(
        found <= truth && found >= truth - 1,
        "fit found {found}, brute force {truth}\n{stderr}"
    );
    // Doubling then bisecting: far fewer probes than brute force, each printed.
    let probes = r["probes"].as_array().unwrap();
    assert!(probes.len() <= 14, "{} probes", probes.len());
    assert_eq!(stderr.matches("probe  fp32").count(), probes.len());
    for p in probes {
        let b = p["micro_batch"].as_i64().unwrap();
        assert_eq!(p["fits"], b <= truth, "probe at {b}: {p}");
        if p["fits"] == true {
            assert!(p["peak_bytes"].as_u64().unwrap() <= cap);
            assert!(p["samples_per_s"].as_f64().unwrap() > 0.0);
        } else {
            assert!(
                p["oom"].as_str().unwrap().contains("out of memory in training step"),
                "{p}"
            );
        }
    }
    // The recommendation keeps the effective batch with a micro-batch that fits.
    let rec = &r["recommendation"];
    let b = rec["batch_size"].as_i64().unwrap();
    assert_eq!(b * rec["accumulation_steps"].as_i64().unwrap(), 48);
    assert!(b <= found && 48 % b == 0);
    assert_eq!(r["budget"]["bytes"], cap);
    assert_eq!(r["budget"]["usable_bytes"], cap);
}

#[test]
fn the_recommended_spec_trains_its_first_epoch_without_an_oom() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(dir.path());
    let cap = cap_between(&spec, dir.path());
    let tuned = dir.path().join("tuned.toml");
    // The user's own --set lines go into the tuned spec too; the spec's floor on the
    // micro-batch (48 here) comes down to the recommendation, or the spec would not validate.
    let (code, stdout, stderr) = fit(&[
        spec.to_str().unwrap(),
        "--set",
        "train.batch_size=48",
        "--set",
        "train.accumulation_steps=1",
        "--set",
        "memory.min_batch_size=48",
        "--limit",
        &cap.to_string(),
        "--precision",
        "fp32",
        "--precision",
        "bf16-mixed",
        "--checkpointing",
        "off",
        "--steps",
        "3",
        "--write",
        tuned.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(
        stderr.contains("margin") && stderr.contains("probes capped at"),
        "{stderr}"
    );
    assert!(stdout.contains("recommendation: precision "), "{stdout}");
    assert!(stdout.contains(&format!("written to {}", tuned.display())), "{stdout}");
    let text = std::fs::read_to_string(&tuned).unwrap();
    assert!(text.starts_with("# the fit test's job: this comment must survive --write"));
    let t: toml::Table = text.parse().unwrap();
    let b = t["train"]["batch_size"].as_integer().unwrap();
    assert_eq!(b * t["train"]["accumulation_steps"].as_integer().unwrap(), 48);
    assert_eq!(t["memory"]["limit"].as_integer().map(|v| v as u64), Some(cap));
    assert!(b < 48, "48 does not fit under the cap");
    assert_eq!(t["memory"]["min_batch_size"].as_integer(), Some(b));
    assert_eq!(
        std::fs::read_to_string(&spec).unwrap(),
        spec_text(),
        "the input spec is untouched"
    );

    // Trained as written, under the same budget, with no OOM recovery to hide behind.
    let out = dir.path().join("tuned-run");
    let o = memtrain()
        .args(["run"])
        .arg(&tuned)
        .arg("--out")
        .arg(&out)
        .args(["--set", "memory.on_oom=[\"fail\"]"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(records(&out, "oom").is_empty());
    assert_eq!(records(&out, "epoch").len(), 1);
    assert_eq!(records(&out, "start")[0]["micro_batch"], b);
}

#[test]
fn fit_says_what_is_wrong_with_its_input_and_when_nothing_fits() {
    let dir = tempfile::tempdir().unwrap();
    let spec = write_spec(dir.path());
    let s = spec.to_str().unwrap();
    let (code, _, stderr) = fit(&[s, "--fraction", "0.5"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--fraction is a share of a GPU's memory"), "{stderr}");
    let (code, _, stderr) = fit(&[s, "--limit", "8MiB", "--precision", "fp8"]);
    assert_eq!(code, 2);
    assert!(
        stderr.contains("--precision fp8: not a precision; one of fp32, fp16-mixed, bf16-mixed, bf16"),
        "{stderr}"
    );
    let (code, _, stderr) = fit(&[s, "--limit", "8MiB", "--margin", "9MiB"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("is not below the budget"), "{stderr}");
    let mlp = dir.path().join("mlp.toml");
    std::fs::write(&mlp, toml::to_string(&digits_spec()).unwrap()).unwrap();
    let (code, _, stderr) = fit(&[mlp.to_str().unwrap(), "--limit", "64MiB", "--checkpointing", "on"]);
    assert_eq!(code, 2, "{stderr}");
    assert!(
        stderr.contains("not applicable: the mlp preset is not a sequence of blocks"),
        "{stderr}"
    );
    assert!(
        stderr.contains("the mlp preset is not a sequence of blocks"),
        "{stderr}"
    );
    assert!(stderr.contains("use --checkpointing off or both"), "{stderr}");

    // 512 KiB holds not even the set-up: every setting fails at micro-batch 1; the JSON says so.
    let tuned = dir.path().join("never.toml");
    let (code, stdout, stderr) = fit(&[
        s,
        "--limit",
        "512KiB",
        "--precision",
        "fp32",
        "--json",
        "--write",
        tuned.to_str().unwrap(),
    ]);
    assert_eq!(code, 3, "{stderr}");
    assert!(stderr.contains("nothing fits in"), "{stderr}");
    assert!(
        stderr.contains("micro-batch     1  peak          -  OOM  (out of memory while "),
        "{stderr}"
    );
    let r: Value = serde_json::from_str(&stdout).unwrap();
    assert!(r["recommendation"].is_null());
    assert_eq!(r["settings"][0]["largest_micro_batch"], Value::Null);
    assert!(!tuned.exists(), "nothing is written without a recommendation");
}
