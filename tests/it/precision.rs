//! Mixed precision, loss scaling and activation recomputation, driven through the binary.
use crate::common::*;
use memtrain::spec::Precision;
use toml::Value;

#[test]
fn mixed_precision_trains_the_digits_mlp() {
    for (p, mode) in [
        ("bf16-mixed", Precision::Bf16Mixed),
        ("fp16-mixed", Precision::Fp16Mixed),
    ] {
        let r = Test::new()
            .name(p)
            .set("train.precision", p)
            .set("train.epochs", 5)
            .run();
        let s = r.summary();
        let acc = val_acc(&s);
        assert!(acc >= 0.9, "{p}: validation accuracy {acc}");
        assert_eq!(s.precision.mode, mode);
        // Master weights stay fp32.
        assert!(tensors(&r.final_model())
            .iter()
            .all(|(_, t)| t.kind() == tch::Kind::Float));
        // state.json is the checkpoint's, not a record: read as JSON.
        let scaler = &r.final_state()["scaler"];
        if p == "fp16-mixed" {
            assert_eq!(s.precision.loss_scale, Some(65536.0), "no overflow on this job");
            assert_eq!(scaler["scale"], 65536.0);
            assert_eq!(scaler["growth_tracker"], 5 * 45);
        } else {
            assert!(scaler.is_null(), "bf16 needs no scaler: {scaler}");
        }
    }
}

fn fp16() -> Test {
    Test::new()
        .set("train.precision", "fp16-mixed")
        .set("log.every_steps", 1)
        .set("train.epochs", 2)
}

#[test]
fn an_inf_gradient_skips_the_step_and_halves_the_scale_and_resume_is_exact() {
    // Step 3's gradients overflow: that step is skipped (no optimizer step, no schedule step),
    // the scale halves, and the run goes on.
    let inf = |t: Test| t.env("MEMTRAIN_FAULT_INF_GRAD_AT_STEP", "3");
    let straight = inf(fp16().name("straight")).run();
    let steps = straight.steps();
    let at = |n: i64| steps.iter().find(|s| s.step == n).unwrap().clone();
    assert!(!at(2).skipped);
    assert!(at(3).skipped);
    assert_eq!(at(2).loss_scale, Some(65536.0));
    assert_eq!(at(4).loss_scale, Some(32768.0));
    let s = straight.summary();
    assert_eq!(s.precision.skipped_steps, 1);
    assert_eq!(s.precision.loss_scale, Some(32768.0));
    assert_eq!(s.global_steps, 90, "a skipped step is still a step of the loop");
    // state.json is the checkpoint's, not a record: read as JSON.
    let state = straight.final_state();
    assert_eq!(state["scaler"]["scale"], 32768.0);
    assert_eq!(state["scaler"]["growth_tracker"], 90 - 3);
    assert_eq!(state["scaler"]["skipped_steps"], 1);
    // The optimizer took one step fewer than the loop (Adam's step count is in its state).
    assert_eq!(state["weight_steps"], 89);

    // The same run stopped after epoch 1 and resumed: the scaler's state comes back from the
    // checkpoint and the weights end byte-identical.
    let part = inf(fp16().name("part")).set("train.epochs", 1).run();
    assert_eq!(part.final_state()["scaler"]["scale"], 32768.0);
    part.resume().args(&["--set", "train.epochs=2"]).run();
    assert_eq!(straight.final_bytes(), part.final_bytes());
}

fn darts() -> Test {
    Test::darts()
        .set("train.accumulation_steps", 2)
        .set("log.progress", "lines")
}

#[test]
fn checkpointed_darts_equals_the_plain_run_bit_for_bit() {
    // Weight and architecture steps, accumulation, BatchNorm, attention: with SGD a weight
    // differs if any gradient does.
    let plain = darts().name("plain").run();
    let ck = darts().name("ck").set("train.activation_checkpointing", true).run();
    assert_eq!(
        plain.final_bytes(),
        ck.final_bytes(),
        "weights and BatchNorm statistics"
    );
    let opt = |o: &Outcome| file_bytes(&o.final_model().with_file_name("optimizer.safetensors"));
    assert_eq!(opt(&plain), opt(&ck), "momentum buffers");
    assert!(ck.summary().precision.activation_checkpointing);
}

#[test]
fn mixed_precision_and_checkpointing_run_darts_with_its_architecture_step() {
    for p in ["fp16-mixed", "bf16-mixed", "bf16"] {
        let r = darts()
            .name(p)
            .set("train.precision", p)
            .set("train.activation_checkpointing", true)
            .run();
        let loss = r.summary().last.expect("the final epoch").train_loss;
        assert!(loss.is_finite(), "{p}: {loss}");
    }
}

/// Activations dominate: a longer signal at micro-batch 8 needs about 46 MiB without
/// recomputation and 19 MiB with it; the cap sits between.
fn wide_darts() -> Test {
    darts()
        .set("model.darts.input_length", 512)
        .set("train.batch_size", 8)
        .set("train.accumulation_steps", 1)
        .set("data.samples", 40)
        .set("train.epochs", 1)
}

#[test]
fn recompute_turns_checkpointing_on_and_keeps_the_batch() {
    let actions = Value::Array(["recompute", "fail"].iter().map(|a| Value::from(*a)).collect());
    let capped = wide_darts()
        .name("capped")
        .set("memory.limit", "32MiB")
        .set("memory.on_oom", actions)
        .stderr_has("recomputing: activation checkpointing is on for the rest of the run, micro-batch stays 8")
        .run();
    let s = capped.summary();
    assert_eq!(s.oom.of("recomputes"), 1);
    // Listed, at 0: `of` would read a missing lever as 0 too.
    assert_eq!(s.oom.engaged.get("backoffs"), Some(&0));
    assert_eq!(s.batch.final_micro_batch, 8);
    assert!(s.precision.activation_checkpointing);
    let ooms = capped.ooms();
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].decision.action, "recompute");
    // Kept for a resume, under the lever's name (state.json is the checkpoint's, not a record:
    // read as JSON).
    assert_eq!(
        json(&capped.final_model().with_file_name("state.json"))["levers"],
        serde_json::json!(["recompute"])
    );
    // Same weights as a run with checkpointing from the start: the failed attempt left nothing.
    let reference = wide_darts()
        .name("reference")
        .set("train.activation_checkpointing", true)
        .run();
    assert_eq!(capped.final_bytes(), reference.final_bytes());

    // The MLP is not a sequence of blocks: the policy says so and moves on.
    let mlp_actions = Value::Array(["recompute", "fail"].iter().map(|a| Value::from(*a)).collect());
    Test::new()
        .name("mlp")
        .spec(table(
            "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 8\n\
             hidden = [262144]\nnum_classes = 2\n[data]\nsamples = 160\n[train]\nepochs = 1\nbatch_size = 32\n\
             optimizer = \"sgd\"\n",
        ))
        .set("memory.limit", "100MiB")
        .set("memory.on_oom", mlp_actions)
        .exit(3)
        .stderr_has("skipped recompute: the model is not a sequence of blocks")
        .run();
}

#[test]
fn a_skipped_step_peaks_as_high_as_an_applied_one() {
    // fit's fp16-mixed probes may see nothing but skipped steps (the first scales overflow); a
    // skipped step still makes the optimizer's allocations, so its peak is what training needs.
    // One step of the digits MLP with Adam (two moments; its workspace is parameter-sized).
    let one = |t: Test| {
        t.set("train.optimizer", "adam")
            .set("train.batch_size", 4)
            .args(&["--max-steps", "1"])
    };
    let applied = one(fp16().name("applied")).run().steps();
    let skipped = one(fp16().name("skipped"))
        .env("MEMTRAIN_FAULT_INF_GRAD_AT_STEP", "1")
        .run()
        .steps();
    assert!(!applied[0].skipped && skipped[0].skipped);
    let peak = |s: &memtrain::records::StepEvent| s.memory.peak_allocated_bytes.unwrap();
    assert!(
        peak(&skipped[0]) >= peak(&applied[0]),
        "skipped step peaked at {}, the applied one at {}",
        peak(&skipped[0]),
        peak(&applied[0])
    );
}
