//! `memtrain fit` under the exact CPU cap: its search against brute force, and the spec it
//! recommends trained for real under the same budget.
use serde_json::Value;

use crate::common::*;

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

/// The fit job in a fresh directory, its spec file written from `spec_text` (as `fit.toml`).
fn job() -> Test {
    Test::new().name("fit").spec_text(&spec_text())
}

/// `run --max-steps 3` at micro-batch `b` (no accumulation) under `cap`, as the run `name`:
/// its step peak when it fits, `None` when it exits 3 (out of memory).
fn probe_by_hand(t: &Test, name: &str, b: i64, cap: Option<u64>) -> Option<u64> {
    let mut probe = t.clone().name(name).arg("-q").args(&[
        "--max-steps",
        "3",
        "--set",
        &format!("train.batch_size={b}"),
        "--set",
        // As fit probes: two micro-batches a step below the effective batch (48), so the peak
        // holds one micro-batch's gradients while the next runs forward.
        &format!("train.accumulation_steps={}", if b < 48 { 2 } else { 1 }),
        "--set",
        "memory.on_oom=[\"fail\"]",
    ]);
    if let Some(cap) = cap {
        probe = probe.args(&["--set", &format!("memory.limit={cap}")]);
    }
    let r = probe.exit_in(&[0, 3]).run();
    (r.code == 0).then(|| {
        r.steps()
            .iter()
            .map(|s| s.memory.peak_allocated_bytes.expect("the CPU's peak is counted"))
            .max()
            .unwrap()
    })
}

/// A cap 45% of the way from micro-batch 1's step peak to micro-batch 48's.
fn cap_between(t: &Test) -> u64 {
    let p1 = probe_by_hand(t, "p1", 1, None).expect("micro-batch 1 fits without a cap");
    let p48 = probe_by_hand(t, "p48", 48, None).expect("micro-batch 48 fits without a cap");
    assert!(p48 > p1 + 500_000, "activations must matter: {p1} vs {p48}");
    p1 + (p48 - p1) * 45 / 100
}

#[test]
fn fit_lands_on_the_largest_micro_batch_that_brute_force_finds() {
    let t = job();
    let cap = cap_between(&t);
    // Brute force: every micro-batch from 1 to the effective batch, under the cap.
    let fits: Vec<bool> = (1..=48)
        .map(|b| probe_by_hand(&t, &format!("b{b}"), b, Some(cap)).is_some())
        .collect();
    let truth = fits.iter().rposition(|&f| f).unwrap() as i64 + 1;
    assert!(
        fits[..truth as usize].iter().all(|&f| f),
        "memory grows with the batch: {fits:?}"
    );
    assert!(truth > 4 && truth < 48, "the cap splits the range: {truth}");

    let o = t
        .clone()
        .command("fit")
        .args(&[
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
        ])
        .run();
    let (stdout, stderr) = (&o.stdout, &o.stderr);
    // `fit --json` prints the command's own result, not a record (its types only serialize):
    // its JSON is what users script against, so it is checked as JSON.
    let r: Value = serde_json::from_str(stdout).unwrap();
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
            // A probe's first step is its preflight: the OOM names the stage it reached there.
            let oom = p["oom"].as_str().unwrap();
            assert!(
                ["forward", "backward", "optimizer step"]
                    .iter()
                    .any(|s| oom.contains(&format!("out of memory in {s} (preflight)"))),
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
    let t = job();
    let cap = cap_between(&t);
    // fit writes the tuned spec where this run reads its spec file.
    let tuned = t.clone().name("tuned").spec_written();
    // The user's own --set lines go into the tuned spec too; the spec's floor on the
    // micro-batch (48 here) comes down to the recommendation, or the spec would not validate.
    let o = t
        .clone()
        .command("fit")
        .args(&[
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
            tuned.spec_path().to_str().unwrap(),
        ])
        .run();
    let (stdout, stderr) = (&o.stdout, &o.stderr);
    assert!(
        stderr.contains("margin") && stderr.contains("probes capped at"),
        "{stderr}"
    );
    assert!(stdout.contains("recommendation: precision "), "{stdout}");
    assert!(
        stdout.contains(&format!("written to {}", tuned.spec_path().display())),
        "{stdout}"
    );
    let text = std::fs::read_to_string(tuned.spec_path()).unwrap();
    assert!(text.starts_with("# the fit test's job: this comment must survive --write"));
    // The spec fit wrote, as TOML: what a user edits and runs.
    let spec: toml::Table = text.parse().unwrap();
    let b = spec["train"]["batch_size"].as_integer().unwrap();
    assert_eq!(b * spec["train"]["accumulation_steps"].as_integer().unwrap(), 48);
    assert_eq!(spec["memory"]["limit"].as_integer().map(|v| v as u64), Some(cap));
    assert!(b < 48, "48 does not fit under the cap");
    assert_eq!(spec["memory"]["min_batch_size"].as_integer(), Some(b));
    assert_eq!(
        std::fs::read_to_string(t.spec_path()).unwrap(),
        spec_text(),
        "the input spec is untouched"
    );

    // Trained as written, under the same budget, with no OOM recovery to hide behind.
    let run = tuned.args(&["--set", "memory.on_oom=[\"fail\"]"]).run();
    assert!(run.ooms().is_empty());
    assert_eq!(run.epochs().len(), 1);
    assert_eq!(run.starts()[0].micro_batch, b);
}

#[test]
fn fit_says_what_is_wrong_with_its_input_and_when_nothing_fits() {
    let fit = job().command("fit");
    fit.clone()
        .args(&["--fraction", "0.5"])
        .exit(2)
        .stderr_has("--fraction is a share of a GPU's memory")
        .run();
    fit.clone()
        .args(&["--limit", "8MiB", "--precision", "fp8"])
        .exit(2)
        .stderr_has("--precision fp8: not a precision; one of fp32, fp16-mixed, bf16-mixed, bf16")
        .run();
    for (write, says) in [
        ("/", "--write /: a directory; name the file the tuned spec goes to"),
        ("/no/such/dir/tuned.toml", "the directory /no/such/dir does not exist"),
    ] {
        fit.clone()
            .args(&["--limit", "8MiB", "--write", write])
            .exit(2)
            .stderr_has(says)
            .run();
    }
    fit.clone()
        .args(&["--limit", "8MiB", "--margin", "9MiB"])
        .exit(2)
        .stderr_has("is not below the budget")
        .run();
    fit.clone()
        .name("mlp")
        .spec(digits_spec())
        .args(&["--limit", "64MiB", "--checkpointing", "on"])
        .exit(2)
        .stderr_has("fit: levers: recompute: one axis of the settings, off and on; host_optimizer_state: a rung of the placement ladder")
        .stderr_has("; host_parameters: a rung of the placement ladder")
        .stderr_has("; backoff: searched by size")
        .stderr_has("; cpu: not searched (fit looks for the fastest setting on the device")
        .stderr_has("not applicable: the mlp preset is not a sequence of blocks")
        .stderr_has("the mlp preset is not a sequence of blocks")
        .stderr_has("use --checkpointing off or both")
        .run();

    // The shipped digits are a compressed .npz, inflated whole: under 300 KiB the probe refuses
    // them before any step, and fit passes on its words and its exit code.
    Test::new()
        .command("fit")
        .no_spec()
        .args(&["configs/digits_mlp.toml", "--limit", "300KiB", "--steps", "2"])
        .exit(2)
        .stderr_has("the probe at micro-batch 1 (fp32 checkpointing off on host none) failed (exit 2)")
        .stderr_has("more than the host-memory budget")
        .stderr_has("save it uncompressed with numpy.savez(path, x=x, y=y)")
        .run();

    // 512 KiB holds not even the set-up: every setting fails at micro-batch 1; the JSON says so.
    let tuned = fit.dir().join("never.toml");
    let o = fit
        .clone()
        .args(&[
            "--limit",
            "512KiB",
            "--precision",
            "fp32",
            "--json",
            "--write",
            tuned.to_str().unwrap(),
        ])
        .exit(3)
        .stderr_has("nothing fits in")
        .stderr_has("micro-batch     1  peak          -  OOM  (out of memory while ")
        .run();
    // `fit --json`'s output, as JSON (see above): a missing recommendation is spelled null.
    let r: Value = serde_json::from_str(&o.stdout).unwrap();
    assert!(r["recommendation"].is_null());
    assert_eq!(r["settings"][0]["largest_micro_batch"], Value::Null);
    assert!(!tuned.exists(), "nothing is written without a recommendation");
}

/// A small llama over a flat token file, windows of `data.seq_len` = 48 tokens: fit's probes run
/// the language model at that window, so the micro-batch it recommends under a budget too small
/// for the spec's 16 trains its epoch at 48 tokens a window without an OOM.
#[test]
fn fit_recommends_a_language_model_batch_that_trains_at_its_seq_len() {
    let t = Test::new();
    let bin = t.dir().join("tokens.bin");
    let ids: Vec<u8> = (0..12_000u32)
        .flat_map(|i| ((i * 7 % 61) as u16).to_le_bytes())
        .collect();
    std::fs::write(&bin, ids).unwrap();
    let text = format!(
        "[job]\nname = \"lm\"\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"llama\"\n\
         [model.llama]\nvocab_size = 64\nhidden_size = 32\nintermediate_size = 64\nnum_hidden_layers = 2\n\
         num_attention_heads = 4\nnum_key_value_heads = 2\nmax_position_embeddings = 64\n\
         [data]\nsource = \"tokens\"\npath = \"{}\"\ntoken_dtype = \"uint16\"\nseq_len = 48\n\
         [train]\nepochs = 1\nbatch_size = 16\noptimizer = \"adamw\"\nlr = 0.001\n[log]\nprogress = \"off\"\n",
        bin.display()
    );
    let t = t.name("lm").spec_text(&text);
    let tuned = t.clone().name("tuned").spec_written();
    let o = t
        .clone()
        .command("fit")
        .args(&[
            "--limit",
            "3MiB",
            "--precision",
            "fp32",
            "--checkpointing",
            "off",
            "--steps",
            "2",
            "--json",
            "--write",
            tuned.spec_path().to_str().unwrap(),
        ])
        .run();
    let r: Value = serde_json::from_str(&o.stdout).unwrap();
    let b = r["recommendation"]["batch_size"].as_i64().unwrap();
    assert!(b < 16, "16 windows of 48 tokens do not fit in 3 MiB: {}", o.stdout);
    let spec: toml::Table = std::fs::read_to_string(tuned.spec_path()).unwrap().parse().unwrap();
    assert_eq!(spec["data"]["seq_len"].as_integer(), Some(48));
    assert_eq!(spec["train"]["batch_size"].as_integer(), Some(b));

    let run = tuned.args(&["--set", "memory.on_oom=[\"fail\"]"]).run();
    assert!(run.ooms().is_empty());
    assert_eq!(run.epochs().len(), 1);
    assert_eq!(run.starts()[0].micro_batch, b);
    let step = &run.steps()[0];
    let tokens = step.language.expect("a language model step counts its tokens").tokens;
    assert_eq!(tokens, (step.samples * 48) as u64, "windows of 48 tokens");
}

/// On the CPU fit tries no CUDA graph: every probe runs eager and says `"cuda_graph": "off"`,
/// the JSON has no other new field, and the human output names no graph. A spec asking for
/// graphs (`"on"`) is probed with `"off"`, so the setting with recomputation, which `"on"`
/// refuses, is probed too; the tuned spec keeps the user's value unless it would refuse the
/// winner.
#[test]
fn fit_on_the_cpu_probes_no_graph_and_its_output_keeps_its_shape() {
    let t = job();
    let common = [
        "--set",
        "train.cuda_graph=\"on\"",
        "--set",
        "train.batch_size=8",
        "--set",
        "train.accumulation_steps=1",
        "--limit",
        "512MiB",
        "--precision",
        "fp32",
        "--steps",
        "2",
    ];
    let o = t.clone().command("fit").args(&common).arg("--json").run();
    let r: Value = serde_json::from_str(&o.stdout).unwrap();
    let keys = |v: &Value| {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k.join(",")
    };
    assert_eq!(
        keys(&r),
        "budget,device,effective_batch,probes,recommendation,settings,spec,steps_per_probe,written"
    );
    let probes = r["probes"].as_array().unwrap();
    let checkpointed = probes.iter().filter(|p| p["activation_checkpointing"] == true).count();
    assert!(checkpointed > 0, "recomputation is probed beside \"on\": {}", o.stdout);
    for p in probes {
        assert_eq!(p["cuda_graph"], "off", "{p}");
        assert_eq!(
            keys(p),
            "activation_checkpointing,cuda_graph,fits,micro_batch,peak_bytes,placement,precision,samples_per_s,seconds",
            "{p}"
        );
    }
    assert_eq!(
        r["settings"].as_array().unwrap().len(),
        2,
        "no setting added for graphs"
    );
    for s in r["settings"].as_array().unwrap() {
        assert_eq!(s["cuda_graph"], "off");
    }
    let rec = &r["recommendation"];
    assert_eq!(rec["cuda_graph"], "off");
    assert_eq!(
        keys(rec),
        "accumulation_steps,activation_checkpointing,batch_size,cuda_graph,effective_batch,headroom_bytes,peak_bytes,placement,precision,samples_per_s"
    );

    let tuned = t.clone().name("tuned").spec_written();
    let o = t
        .clone()
        .name("human")
        .command("fit")
        .args(&common)
        .args(&["--write", tuned.spec_path().to_str().unwrap()])
        .run();
    assert!(!o.stdout.to_lowercase().contains("graph"), "{}", o.stdout);
    assert!(!o.stderr.contains("cuda graph on"), "{}", o.stderr);
    let text = std::fs::read_to_string(tuned.spec_path()).unwrap();
    let spec: toml::Table = text.parse().unwrap();
    let ck = spec["train"]["activation_checkpointing"].as_bool().unwrap();
    // "on" stays where the winner could capture on a GPU, and becomes "off" where it would
    // refuse the winner's recomputation.
    let want = if ck { "off" } else { "on" };
    assert_eq!(spec["train"]["cuda_graph"].as_str(), Some(want), "{text}");
    tuned.args(&["--max-steps", "2"]).run();
}
