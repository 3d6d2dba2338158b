//! Model state off the device: optimizer state, gradients and activations in host memory, each
//! a spec key and an "offload" answer to an OOM. Under the counting CPU allocator host tensors
//! are counted apart from the capped device count, so every lever is measured here as on a GPU
//! machine, and each must train byte-identically to the run without it with the same
//! `train.optimizer_impl` (the jobs name one: "auto" picks "fused" for state on the host).
use memtrain::records::Summary;
use toml::Value;

use crate::common::*;

/// A small ViT (blocks, dropout) with AdamW, accumulation and clipping: every part of the step
/// that gradients, state and saved activations pass through.
fn job() -> Test {
    Test::new().spec(table(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\npreset = \"vit\"\n[model.vit]\n\
         image_size = 16\npatch_size = 4\nlayers = 4\nheads = 2\nhidden_dim = 64\nmlp_dim = 128\n\
         dropout = 0.1\nnum_classes = 4\n[data]\nsource = \"synthetic\"\nsamples = 64\nval_fraction = 0.25\n\
         [train]\nepochs = 2\nbatch_size = 8\naccumulation_steps = 2\noptimizer = \"adamw\"\nlr = 0.001\n\
         weight_decay = 0.01\ngrad_clip_norm = 1.0\noptimizer_impl = \"single\"\n[log]\nevery_steps = 1\nprogress = \"off\"\n",
    ))
}

fn host(t: Test, keys: &[&str]) -> Test {
    keys.iter().fold(t, |t, k| t.set(&format!("memory.{k}"), "host"))
}

fn policy(actions: &[&str]) -> Value {
    Value::Array(actions.iter().map(|a| Value::from(*a)).collect())
}

fn peak(s: &Summary) -> u64 {
    s.memory.peak_allocated_bytes.expect("CPU runs count device bytes")
}

/// "1.06 MiB" as bytes (`check` prints three significant digits).
fn parse_bytes(s: &str) -> f64 {
    let (n, unit) = s.trim().split_once(' ').expect("a number and a unit");
    let scale = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => panic!("unit {u}"),
    };
    n.parse::<f64>().unwrap() * scale
}

/// The size `check` gives a term in its bill ("  optimizer state   1.06 MiB  device").
fn bill_term(check_out: &str, term: &str) -> f64 {
    let line = check_out
        .lines()
        .find(|l| l.starts_with(&format!("  {term} ")))
        .unwrap_or_else(|| panic!("no {term} line in check's bill:\n{check_out}"));
    let rest = line[2 + term.len()..].trim_start();
    let bytes: String = rest.split("  ").next().unwrap().to_owned();
    parse_bytes(&bytes)
}

#[track_caller]
fn assert_within(measured: f64, predicted: f64, what: &str) {
    let off = (measured - predicted).abs() / predicted;
    assert!(
        off <= 0.05,
        "{what}: the device peak dropped by {measured} bytes, check predicted {predicted} ({:.1}% off)",
        off * 100.0
    );
}

#[test]
fn each_placement_alone_and_together_trains_byte_identically_and_saves_what_check_says() {
    let t = job();
    let base = t.clone().name("base").run();
    let bill = t.clone().name("check").command("check").run().stdout;
    let state_bytes = bill_term(&bill, "optimizer state");
    let grad_bytes = bill_term(&bill, "gradients");
    let losses = step_losses(&base);
    assert!(losses.len() >= 6, "{losses:?}");
    let mut peaks = vec![];
    for keys in [
        &["optimizer_state"][..],
        &["gradients"],
        &["activations"],
        &["optimizer_state", "gradients", "activations"],
    ] {
        let name = keys.join("+");
        let run = host(t.clone().name(&name), keys).run();
        assert_eq!(run.final_bytes(), base.final_bytes(), "{name}: final weights differ");
        assert_eq!(step_losses(&run), losses, "{name}: step losses differ");
        let s = run.summary();
        assert!(
            s.memory.peak_host_bytes.unwrap_or(0) > 0,
            "{name}: nothing was counted on the host: {:?}",
            s.memory
        );
        let page = std::fs::read_to_string(run.out.join("report.html")).unwrap();
        assert!(
            page.contains("peak on host"),
            "{name}: the memory chart shows the host's bytes"
        );
        peaks.push((name, peak(&s)));
    }
    let base_peak = peak(&base.summary());
    assert_within(
        (base_peak - peaks[0].1) as f64,
        state_bytes,
        "optimizer state on the host",
    );
    assert_within((base_peak - peaks[1].1) as f64, grad_bytes, "gradients on the host");
    assert!(
        peaks[2].1 < base_peak && peaks[3].1 < peaks.iter().take(3).map(|p| p.1).min().unwrap(),
        "activations on the host lower the peak, and all three together lower it most: base {base_peak}, {peaks:?}"
    );
    assert_eq!(
        base.summary().memory.peak_host_bytes,
        None,
        "a run without host placement records no host figures"
    );
}

/// The host update runs the implementation asked for over host tensors: foreach and fused
/// with everything on the host train the bytes they train on the device, and "auto" is
/// "fused" there.
#[test]
fn every_implementation_updates_on_the_host_byte_identically() {
    let all = ["optimizer_state", "gradients", "activations"];
    for which in ["foreach", "fused"] {
        let t = job().set("train.optimizer_impl", which).set("train.epochs", 1);
        let base = t.clone().name(&format!("{which}-device")).run();
        let placed = host(t.clone().name(&format!("{which}-host")), &all).run();
        let said = format!("Optimizer: adamw ({which} implementation");
        assert!(
            placed.stdout.contains(&said) || placed.stderr.contains(&said),
            "{which}: {}",
            placed.stdout
        );
        assert_eq!(
            placed.final_bytes(),
            base.final_bytes(),
            "{which}: final weights differ"
        );
        assert_eq!(step_losses(&placed), step_losses(&base), "{which}: step losses differ");
        if which == "fused" {
            let auto = host(t.set("train.optimizer_impl", "auto").name("auto-host"), &all[..1]).run();
            assert_eq!(
                auto.final_bytes(),
                base.final_bytes(),
                "auto with host state runs fused"
            );
        }
    }
}

#[test]
fn placements_stay_exact_in_fp16_mixed_across_an_interrupt_and_an_oom_backoff() {
    let t = job().set("train.precision", "fp16-mixed").set("train.epochs", 1);
    let all = ["optimizer_state", "gradients", "activations"];
    let base = t.clone().name("base").run();
    let placed = host(t.clone().name("placed"), &all).run();
    assert_eq!(
        placed.final_bytes(),
        base.final_bytes(),
        "fp16-mixed with every placement"
    );
    assert_eq!(step_losses(&placed), step_losses(&base));

    // Interrupted after step 1 and resumed: equal to the straight run.
    let cut = host(t.clone().name("cut"), &all)
        .interrupt_after_step(1)
        .exit(130)
        .run();
    let state = cut.final_state();
    let levers: Vec<&str> = state["levers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        levers.contains(&"host_optimizer_state") && levers.contains(&"host_activations"),
        "the checkpoint persists the engaged placements: {levers:?}"
    );
    cut.resume().stderr_has("resuming from").run();
    assert_eq!(cut.final_bytes(), base.final_bytes(), "resumed with every placement");

    // An OOM inside the optimizer step (state on the device, so its workspace is allocated
    // there) backs off mid-run; the same backoff without placements gives the same bytes.
    let oom = |t: Test| {
        t.set("memory.limit", "1GiB")
            .set("memory.on_oom", policy(&["backoff", "fail"]))
            .env("MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP", "2")
            .stderr_has("backing off: micro-batch 8 -> 4")
    };
    let plain = oom(t.clone().name("plain-backoff")).run();
    let moved = oom(host(t.clone().name("placed-backoff"), &["gradients", "activations"])).run();
    assert_eq!(moved.ooms().len(), 1);
    assert_eq!(
        moved.final_bytes(),
        plain.final_bytes(),
        "backoff with gradients and activations on the host"
    );
    assert_eq!(step_losses(&moved), step_losses(&plain));
}

#[test]
fn an_oom_answered_by_offload_ends_as_if_the_state_had_been_on_the_host_from_the_start() {
    let t = job().set("train.epochs", 1);
    let from_start = host(t.clone().name("from-start"), &["optimizer_state"]).run();
    let base_peak = peak(&t.clone().name("uncapped").run().summary());
    let placed_peak = peak(&from_start.summary());
    // A cap between the two peaks: the first step fails for real, offload moves the state.
    let cap = (base_peak + placed_peak) / 2;
    let offloaded = t
        .clone()
        .name("offloaded")
        .set("memory.limit", cap as i64)
        .set("memory.on_oom", policy(&["offload", "fail"]))
        .stderr_has("offloading: the optimizer state moves to host memory")
        .run();
    let ooms = offloaded.ooms();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert_eq!(ooms[0].decision.action, "host_optimizer_state");
    assert_eq!(offloaded.final_bytes(), from_start.final_bytes());
    assert_eq!(step_losses(&offloaded), step_losses(&from_start));
    assert!(peak(&offloaded.summary()) <= cap);
    let state = offloaded.final_state();
    assert!(
        state["levers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|v| v == "host_optimizer_state"),
        "persisted for a resume: {state}"
    );
    assert_eq!(offloaded.summary().oom.engaged.get("state_offloads"), Some(&1));

    // Nothing left to move: offload gives way to the next action, and says why.
    let everything = ["optimizer_state", "gradients", "activations", "parameters"];
    let all_peak = peak(&host(t.clone().name("all-uncapped"), &everything).run().summary());
    let all = host(t.clone().name("nothing-left"), &everything)
        .set("memory.limit", (all_peak * 9 / 10) as i64)
        .set("memory.on_oom", policy(&["offload", "fail"]))
        .exit(3)
        .stderr_has("skipped host_optimizer_state: already on the host (the optimizer state)")
        .run();
    assert_eq!(all.ooms()[0].decision.action, "fail");
}

#[test]
fn check_warns_when_the_device_part_cannot_fit_and_names_the_placements_that_would() {
    let out = job()
        .command("check")
        .args(&["--set", "memory.limit=2MiB"])
        .run()
        .stdout;
    assert!(out.contains("WARNING: the device part of the bill"), "{out}");
    assert!(out.contains("to fit, set memory.optimizer_state = \"host\""), "{out}");
    let placed = job()
        .command("check")
        .args(&["--set", "memory.limit=2MiB", "--set", "memory.optimizer_state=\"host\""])
        .run()
        .stdout;
    assert!(!placed.contains("WARNING"), "{placed}");
    assert!(placed.contains("host (memory.optimizer_state)"), "{placed}");
}

#[test]
fn fit_climbs_the_placement_ladder_only_as_far_as_the_budget_needs() {
    fit_climbs_the_ladder(job());
}

/// An explicit `train.optimizer_impl = "fused"` updates state on the host too: the probes and
/// the tuned spec that move it there keep it.
#[test]
fn fit_moving_the_state_of_a_fused_spec_keeps_it_fused() {
    let text = fit_climbs_the_ladder(job().set("train.optimizer_impl", "fused"));
    assert!(text.contains("optimizer_impl = \"fused\""), "{text}");
}

/// The tuned spec's text.
fn fit_climbs_the_ladder(t: Test) -> String {
    // 2.11 MiB of static state (541 KiB weights, as much gradient, 1.06 MiB AdamW moments) under
    // a 2 MiB budget: nothing fits with everything on the device; with the moments on the host
    // 1.06 MiB stays and the activations have the rest.
    let t = t.set("train.epochs", 1);
    // fit writes the tuned spec where this run reads its spec file.
    let tuned_run = t.clone().name("tuned").spec_written();
    let tuned = tuned_run.spec_path();
    let o = t
        .clone()
        .command("fit")
        .args(&[
            "--limit",
            "2MiB",
            "--margin",
            "0%",
            "--precision",
            "fp32",
            "--checkpointing",
            "off",
            "--steps",
            "3",
            "--json",
            "--write",
            tuned.to_str().unwrap(),
        ])
        .stderr_has("host_optimizer_state: a rung of the placement ladder")
        .stderr_has("micro-batch 1 does not fit: moving more to the host (state)")
        .run();
    let r: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    let rec = &r["recommendation"];
    assert_eq!(rec["placement"], "state", "the least placement that fits: {rec}");
    assert_eq!(r["settings"][0]["placement"], "state");
    let probes = r["probes"].as_array().unwrap();
    assert_eq!(probes[0]["placement"], "none");
    assert_eq!(probes[0]["fits"], false);
    let text = std::fs::read_to_string(&tuned).unwrap();
    assert!(text.contains("optimizer_state = \"host\""), "{text}");
    // The tuned spec trains under the budget, with no OOM recovery to hide behind.
    let run = tuned_run
        .args(&["--max-steps", "3", "--set", "memory.on_oom=[\"fail\"]"])
        .run();
    let s = run.summary();
    assert!(peak(&s) <= 2 << 20, "{:?}", s.memory);
    assert!(s.memory.peak_host_bytes.unwrap() > 0);
    text
}

#[test]
fn eight_bit_state_moves_to_the_host_with_its_codes_and_scales_unchanged() {
    let t = job().set("train.epochs", 1).set("train.optimizer_state_bits", 8);
    let device = t.clone().name("device").run();
    let host = host(t.clone().name("host"), &["optimizer_state", "gradients"]).run();
    assert_eq!(host.final_bytes(), device.final_bytes());
    assert_eq!(
        file_bytes(&host.final_model().with_file_name("optimizer.safetensors")),
        file_bytes(&device.final_model().with_file_name("optimizer.safetensors")),
        "the quantized moments and their absmax are the same bytes"
    );
    assert!(peak(&host.summary()) < peak(&device.summary()));
}

#[test]
fn sharded_state_on_the_host_trains_the_same_weights_on_two_ranks() {
    // ZeRO-1 with each rank's shard of the optimizer state in host memory; gradients stay on the
    // device there (the Reducer reduces them as backward makes them), and the lever says so.
    let t = Test::new()
        .set("train.epochs", 1)
        .set("train.batch_size", 64)
        .set("train.accumulation_steps", 2)
        .set("train.optimizer", "adamw")
        .set("train.grad_clip_norm", 1.0)
        .set("train.shard_optimizer_state", true)
        // "auto" would be "fused" on the host and "single" on the device.
        .set("train.optimizer_impl", "single")
        .arg("--nproc")
        .arg("2");
    let device = t.clone().name("device").run();
    let host = t.clone().name("host").set("memory.optimizer_state", "host").run();
    assert_eq!(step_losses(&host), step_losses(&device));
    assert_eq!(host.final_bytes(), device.final_bytes());
    assert!(host.summary().memory.peak_host_bytes.unwrap_or(0) > 0);
    t.clone()
        .name("grads")
        .set("memory.gradients", "host")
        .stderr_has("data-parallel runs reduce the gradients on the device as backward makes them")
        .run();
}

/// With the state on the host, each step record says how long its host update took, the first
/// record too: an update by block finishes in the next step's forward, so the record waits for
/// it, whether records are written at once (the CPU) or a step late (as on a GPU).
#[test]
fn every_step_record_with_the_state_on_the_host_has_its_update_time() {
    for late in ["0", "1"] {
        let r = host(job().set("train.epochs", 1), &["optimizer_state"])
            .name(&format!("late-{late}"))
            .env("MEMTRAIN_FAULT_LATE_READS", late)
            .run();
        let steps = r.steps();
        assert!(steps.len() >= 3, "{steps:?}");
        for s in &steps {
            assert!(
                s.host_update_seconds.is_some_and(|t| t > 0.0),
                "late reads {late}: step {} has no host update time: {s:?}",
                s.step
            );
        }
    }
}
