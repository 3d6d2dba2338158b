//! `memtrain run` end to end: accuracy on real data, records, accumulation, checkpoints,
//! resume, interruption and crash safety.
use crate::common::*;
use memtrain::model::Genotype;

#[test]
fn digits_mlp_learns_and_leaves_complete_records() {
    let t = Test::new()
        .set("checkpoint.keep_last", 2)
        .set("checkpoint.monitor", "val_acc")
        .set("train.epochs", 8);
    let r = t
        .clone()
        .stderr_has("Effective batch size: 32 (micro-batch 32 x 1 accumulation steps)")
        .stderr_has("Preflight: the first step at micro-batch 32")
        .run();
    let out = &r.out;

    let s = r.summary();
    assert_eq!(s.status, Status::Completed);
    assert_eq!(s.exit_code, 0);
    assert_eq!(s.epochs_completed, 8);
    let acc = val_acc(&s);
    assert!(acc >= 0.9, "validation accuracy {acc}");
    assert!(s.memory.peak_rss_bytes > 0);
    assert!(s.samples_per_s > 0.0);

    let epochs = r.epochs();
    assert_eq!(epochs.len(), 8);
    for (i, e) in epochs.iter().enumerate() {
        assert_eq!(e.epoch, i as i64 + 1);
        assert!(e.memory.rss_bytes > 0);
        assert!(e.memory.peak_rss_bytes >= e.memory.rss_bytes / 2);
        assert!(e.val_loss.is_some());
    }
    // 1438 training samples / 32 = 45 steps per epoch; a step record every step.
    assert_eq!(r.steps().len(), 8 * 45);
    assert_eq!(r.preflights().len(), 1);
    assert_eq!(r.checkpoints().len(), 8);
    assert!(out.join("config.resolved.toml").exists());

    // Retention: the last two plus the best. best.json belongs to the checkpoints, not the
    // records (its type is private to memtrain's checkpoint module): read as JSON.
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
    t.exit(2).stderr_has("already holds a run; pass --resume").run();
    assert_eq!(std::fs::read(out.join("summary.json")).unwrap(), before);
}

/// A tiny synthetic MLP job for comparing the same groups split into different micro-batches.
fn split_job(samples: i64, val_fraction: f64, hidden: i64, epochs: i64, lr: f64) -> Test {
    Test::new().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 16\nhidden = [{hidden}]\n\
         num_classes = 3\n[data]\nsamples = {samples}\nval_fraction = {val_fraction:?}\n[train]\nepochs = {epochs}\n\
         batch_size = 1\noptimizer = \"sgd\"\nlr = {lr:?}\n"
    )))
}

fn split(t: &Test, name: &str, batch: i64, accumulation: i64) -> Test {
    t.clone()
        .name(name)
        .set("train.batch_size", batch)
        .set("train.accumulation_steps", accumulation)
}

#[test]
fn accumulation_gives_the_gradient_of_the_whole_batch() {
    // 10 samples, 2 for validation: one group of 8. SGD with lr 1 makes the weight change equal
    // to the gradient, so comparing weights after one step compares gradients.
    let t = split_job(10, 0.2, 32, 1, 1.0);
    let whole = split(&t, "whole", 8, 1).run();
    let parts = split(&t, "split", 2, 4)
        .stderr_has("Effective batch size: 8 (micro-batch 2 x 4")
        .run();
    let d = max_abs_diff(&whole.final_model(), &parts.final_model());
    assert!(d <= 1e-6, "gradients differ by {d}");
}

#[test]
fn uneven_last_group_is_weighted_by_its_own_size() {
    // 13 training samples in groups of 4: the last group has 1 sample; 1 x 4 splits it the same.
    let t = split_job(16, 0.1875, 8, 2, 0.5);
    let a = split(&t, "a", 4, 1).run();
    let b = split(&t, "b", 1, 4).run();
    assert_eq!(a.summary().global_steps, 8);
    assert!(max_abs_diff(&a.final_model(), &b.final_model()) <= 1e-6);
}

#[test]
fn k_epochs_then_resume_equals_a_straight_run() {
    let t = Test::new();
    let straight = t.clone().name("straight").set("train.epochs", 3).run();
    let part = t.clone().name("part").set("train.epochs", 1).run();
    // The spec on disk still says 1 epoch; the command line asks for 3.
    part.resume()
        .args(&["--set", "train.epochs=3"])
        .stderr_has("resuming from")
        .run();
    assert_eq!(part.summary().epochs_completed, 3);
    // Resuming a finished run without more epochs trains nothing and keeps its records.
    let summary = std::fs::read(part.out.join("summary.json")).unwrap();
    part.resume()
        .args(&["--set", "train.epochs=3"])
        .stderr_has("already finished 3 epoch(s)")
        .run();
    assert_eq!(std::fs::read(part.out.join("summary.json")).unwrap(), summary);
    assert_eq!(
        straight.final_bytes(),
        part.final_bytes(),
        "weights differ after resume"
    );
}

#[test]
fn ctrl_c_saves_exits_130_and_resumes_exactly() {
    let t = Test::new().set("log.every_steps", 1).set("train.epochs", 4);
    let straight = t.clone().name("straight").run();
    // 45 steps an epoch: the signal arrives after step 50, in the second epoch.
    let int = t
        .clone()
        .name("int")
        .interrupt_after_step(50)
        .exit(130)
        .stderr_has("interrupted at epoch 2 step 50")
        .run();
    let s = int.summary();
    assert_eq!(s.status, Status::Interrupted);
    assert_eq!(s.exit_code, 130);
    assert_eq!(s.global_steps, 50);
    let ck = int.checkpoints();
    assert_eq!(ck.last().unwrap().reason, "interrupted");
    assert_eq!(ck.last().unwrap().step, 50);
    let page = std::fs::read_to_string(int.out.join("report.html")).unwrap();
    assert!(
        page.contains("<td>interrupted</td>"),
        "the interrupted run has its report"
    );

    // A bare --resume continues the run directory the command names (here through --out).
    t.clone().name("int").arg("--resume").stderr_has("resuming from").run();
    assert_eq!(int.summary().status, Status::Completed);
    let page = std::fs::read_to_string(int.out.join("report.html")).unwrap();
    assert!(
        page.contains("<td>completed</td>") && page.contains("</span> resume</td>"),
        "redrawn, the resume marked"
    );
    assert_eq!(
        straight.final_bytes(),
        int.final_bytes(),
        "interrupted + resumed weights differ from the straight run"
    );
}

#[test]
fn a_process_killed_while_saving_leaves_the_previous_checkpoint_intact() {
    let t = Test::new();
    let straight = t.clone().name("straight").run();
    // Epochs are 45 steps: the save after epoch 2 (step 90) dies half-way (SIGABRT: no code).
    let crash = t
        .clone()
        .name("crash")
        .env("MEMTRAIN_FAULT_ABORT_SAVE_AT_STEP", "90")
        .exit(-1)
        .run();
    let ck = crash.out.join("checkpoints");
    assert!(ck.join("step-000000045/model.safetensors").exists());
    assert!(
        ck.join(".tmp-step-000000090").exists(),
        "the interrupted save should have left its temporary dir"
    );
    assert!(!ck.join("step-000000090").exists());
    // The surviving checkpoint loads and the run resumes to the same result as a straight run.
    crash.resume().stderr_has("step-000000045").run();
    assert!(!ck.join(".tmp-step-000000090").exists(), "leftovers are cleaned up");
    assert_eq!(straight.final_bytes(), crash.final_bytes());
}

#[test]
fn init_from_loads_weights_by_name_and_explains_mismatches() {
    let t = Test::new().set("train.epochs", 1);
    let first = t.clone().name("first").run();
    let warm = t
        .clone()
        .name("warm")
        .set("model.init_from", first.final_model().to_str().unwrap())
        .set("train.lr", 1e-9)
        .run();
    // With a negligible learning rate the warm start keeps the loaded accuracy.
    let acc = |o: &Outcome| val_acc(&o.summary());
    assert!(
        (acc(&warm) - acc(&first)).abs() < 0.01,
        "{} vs {}",
        acc(&warm),
        acc(&first)
    );

    warm.test
        .clone()
        .name("wrong")
        .set("model.mlp.hidden", vec![16])
        .exit(2)
        .stderr_has("does not match the model")
        .stderr_has("mis-shaped: fc0.bias")
        .run();
}

#[test]
fn darts_search_logs_its_genotype() {
    let r = Test::darts().stderr_has("genotype:").run();
    // genotype.json is not a record: the recorder writes it as {"epoch", "genotype"}, and the
    // genotype inside reads back as its type.
    #[derive(serde::Deserialize)]
    struct GenotypeFile {
        epoch: i64,
        genotype: Genotype,
    }
    let g: GenotypeFile = typed(&r.out.join("genotype.json"));
    assert_eq!(g.epoch, 2);
    for nodes in [&g.genotype.normal, &g.genotype.reduce] {
        assert_eq!(nodes.len(), 2);
        for node in nodes {
            assert_eq!(node.len(), 2);
            assert_ne!(node[0].0, "none");
        }
    }
    assert!(r.epochs().iter().all(|e| e.genotype.is_some()));
    // Architecture weights are checkpointed with their own optimizer state.
    let model = tensors(&r.final_model());
    assert!(model.iter().any(|(n, _)| n == "arch.alpha_normal"));
}

/// A DARTS supernet trains only from a micro-batch of 2: every operation ends in a batch norm
/// without affine parameters, so at 1 the pooled features the head sees are zero and the stem
/// and cells get no gradient, whatever the learning rate. The main job searches at 2 or more.
#[test]
fn darts_trains_from_a_micro_batch_of_two_and_the_main_job_uses_one() {
    let stem = |batch: i64, lr: f64| {
        let r = Test::darts()
            .set("train.batch_size", batch)
            .set("train.epochs", 1)
            .set("train.lr", lr)
            .run();
        let model = tensors(&r.final_model());
        let (_, w) = model
            .into_iter()
            .find(|(n, _)| n == "stem.conv.weight")
            .expect("the stem's weight is checkpointed");
        w
    };
    let moved = |batch: i64| (stem(batch, 0.05) - stem(batch, 1e-9)).abs().max().double_value(&[]);
    let (at_one, at_two) = (moved(1), moved(2));
    assert!(at_one < 1e-4, "at micro-batch 1 the stem moved by {at_one}");
    assert!(at_two > 1e-2, "at micro-batch 2 the stem moved by only {at_two}");

    let main: toml::Table = std::fs::read_to_string(repo().join("configs/darts_4gb.toml"))
        .expect("the main job reads")
        .parse()
        .expect("the main job is TOML");
    let batch = main["train"]["batch_size"].as_integer().expect("train.batch_size");
    assert!(batch >= 2, "configs/darts_4gb.toml searches at micro-batch {batch}");
}

#[test]
fn bf16_trains_and_checkpoints_in_bf16() {
    let r = Test::new().set("train.precision", "bf16").run();
    let acc = val_acc(&r.summary());
    assert!(acc > 0.8, "bf16 validation accuracy {acc}");
    let model = tensors(&r.final_model());
    assert!(model.iter().all(|(_, t)| t.kind() == tch::Kind::BFloat16));
}

#[test]
fn a_checkpoint_from_before_levers_had_names_resumes_with_its_flags_read_as_levers() {
    // The MLP is no chain of blocks: the spec's checkpointing does not apply, and says so.
    let part = Test::new()
        .name("part")
        .set("train.epochs", 1)
        .set("train.activation_checkpointing", true)
        .stderr_has("activation checkpointing does not apply")
        .run();
    assert!(!part.summary().precision.activation_checkpointing);
    // Rewrite the checkpoint's state as a memtrain from before levers wrote it: no `levers`, the
    // spec's flag saved as it was even though it never applied.
    let state = part.final_model().with_file_name("state.json");
    let mut old = part.final_state();
    let fields = old.as_object_mut().unwrap();
    assert_eq!(fields.remove("levers"), Some(serde_json::json!([])));
    fields.insert("activation_checkpointing".into(), true.into());
    fields.insert("on_cpu_fallback".into(), false.into());
    std::fs::write(&state, serde_json::to_vec(&old).unwrap()).unwrap();
    part.resume().args(&["--set", "train.epochs=2"]).run();
    assert_eq!(part.summary().epochs_completed, 2);
    assert!(
        !part.summary().precision.activation_checkpointing,
        "an old flag for a model without blocks engages nothing"
    );
    assert_eq!(part.final_state()["levers"], serde_json::json!([]));
}

/// A step record's `seconds` runs from the previous record's loss read to its own, so the
/// records tile the training loop: summed over a run they give its training time (the epochs'
/// seconds, which leave out validation and saves). With a record every 5 steps each one holds
/// the mean of its 5. Steps with the model state on the host are timed the same way. The job is
/// wide enough (about 1 s of steps) that the microseconds between an epoch's last record and
/// its end stay far under the 5% a noisy shared machine is allowed.
#[test]
fn step_seconds_add_up_to_the_training_time() {
    for (name, every, host) in [("every-1", 1i64, false), ("every-5", 5, false), ("host", 1, true)] {
        let mut t = Test::new()
            .name(name)
            .set("model.mlp.hidden", toml::Value::Array(vec![2048.into(), 2048.into()]))
            .set("train.epochs", 2)
            .set("log.every_steps", every);
        if host {
            t = t.set("memory.optimizer_state", "host").set("memory.gradients", "host");
        }
        let r = t.run();
        let s = r.summary();
        if host {
            assert!(s.memory.peak_host_bytes.unwrap_or(0) > 0, "the state was on the host");
        }
        let steps = r.steps();
        // 45 steps an epoch, a multiple of 5: every step is in some record.
        assert_eq!(steps.len() as i64 * every, 2 * 45);
        assert!(steps.iter().all(|st| st.seconds > 0.0), "every record takes time");
        let summed: f64 = steps.iter().map(|st| st.seconds * every as f64).sum();
        let train = s.train_seconds;
        let gap = (summed - train).abs() / train;
        assert!(
            gap < 0.05,
            "{name}: step seconds sum to {summed:.4} s, the epochs to {train:.4} s ({:.1}% apart)",
            gap * 100.0
        );
    }
}
