//! Validation never shrinks training: it has its own micro-batch (`train.eval_batch_size`), and
//! an OOM in validation halves only that one. The failures are real: a CPU cap the validation
//! pass's activations do not fit under, or (data-parallel, on one rank) the fault hook's
//! squeezed cap.
use crate::common::*;
use memtrain::oom::OomKind;
use memtrain::records::MicroBatchOf;
use toml::Value;

/// One hidden layer of 262,144 units: 1 MiB per sample per activation. Training at micro-batch
/// 8 fits a 100 MiB cap with room to spare; a validation pass at 128 samples does not (no
/// gradients are kept, but its activations alone are 256 MiB). 640 samples: 512 train (64
/// steps an epoch), 128 held out.
fn wide() -> Test {
    Test::new()
        .spec(table(
            "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 8\n\
             hidden = [262144]\nnum_classes = 2\n[data]\nsamples = 640\n[train]\nepochs = 2\nbatch_size = 8\n\
             optimizer = \"sgd\"\nlr = 0.01\n[log]\nprogress = \"lines\"\n",
        ))
        .set("memory.limit", "100MiB")
        .set("memory.on_oom", Value::Array(vec!["backoff".into(), "fail".into()]))
}

#[test]
fn a_validation_oom_halves_only_validations_micro_batch() {
    let fits = wide().name("fits").set("train.eval_batch_size", 8).run();
    assert!(fits.ooms().is_empty(), "{:?}", fits.ooms());

    let r = wide()
        .name("halves")
        .set("train.eval_batch_size", 128)
        .stderr_has("out of memory in validation")
        .stderr_has("training's stays 8 x 1")
        .run();
    let ooms = r.ooms();
    assert!(!ooms.is_empty(), "validation at 128 samples must not fit the cap");
    let mut expected_before = 128;
    for o in &ooms {
        assert_eq!(o.phase, "validation", "{o:?}");
        assert_eq!(o.epoch, 1, "the halved micro-batch stays for epoch 2: {o:?}");
        assert_eq!(o.kind, OomKind::Cpu);
        assert_eq!(o.decision.action, "eval_backoff", "{o:?}");
        assert_eq!(o.micro_batch_before, expected_before);
        let to = o.decision.to.expect("the halved micro-batch");
        assert_eq!(to.micro_batch, expected_before / 2);
        expected_before /= 2;
    }
    // Training is untouched: its micro-batch, accumulation and levers.
    let s = r.summary();
    assert_eq!(s.status, Status::Completed);
    assert_eq!((s.batch.final_micro_batch, s.batch.final_accumulation_steps), (8, 1));
    assert_eq!(s.oom.of("backoffs"), 0);
    assert_eq!(s.oom.eval_backoffs, ooms.len() as u64);
    assert_eq!(s.oom.events, ooms.len() as u64);
    assert!(!s.precision.activation_checkpointing);
    assert!(r.steps().iter().all(|e| e.micro_batch == 8));
    assert!(r
        .epochs()
        .iter()
        .all(|e| e.micro_batch == 8 && e.accumulation_steps == 1));
    // Every epoch was validated, and the weights are those of the run that never ran out.
    for (a, b) in r.epochs().iter().zip(fits.epochs()) {
        let (va, vb) = (
            a.result.val_loss.expect("validated"),
            b.result.val_loss.expect("validated"),
        );
        assert!((va - vb).abs() <= 1e-6 * vb.abs(), "val loss {va} vs {vb}");
        assert_eq!(a.result.val_acc, b.result.val_acc);
        assert_eq!(a.result.train_loss.to_bits(), b.result.train_loss.to_bits());
    }
    assert_eq!(r.final_bytes(), fits.final_bytes(), "final weights byte for byte");
    // The checkpoint keeps validation's micro-batch, and a resumed run starts from it.
    let state = r.final_state();
    assert_eq!(state["eval_micro_batch"], expected_before, "{state}");
    assert_eq!(state["micro_batch"], 8);
    // The first OOM's report is validation's.
    assert_eq!(r.oom_report().micro_batch, 128);
}

#[test]
fn validations_micro_batch_is_saved_and_grows_back_like_trainings() {
    // Epoch 1 halves validation down to what fits. The resumed run starts there: epoch 2's pass
    // is clean (a pass that met an OOM counts nothing, so data-parallel ranks count alike), and
    // epoch 3's tries twice as many again, which does not fit, and halves back.
    let one = wide()
        .name("grow")
        .set("train.eval_batch_size", 128)
        .set("train.epochs", 1)
        .set("memory.grow_back_after", 1)
        .run();
    let fitted = one.final_state()["eval_micro_batch"].as_i64().expect("saved");
    assert!(fitted < 128, "{fitted}");
    let more = one.resume().set("train.epochs", 3).run();
    let grown: Vec<_> = more.grow_backs();
    assert_eq!(grown.len(), 1, "{grown:?}");
    let g = &grown[0];
    assert_eq!(g.micro_batch_of, MicroBatchOf::Validation);
    assert_eq!((g.micro_batch_before, g.micro_batch), (fitted, fitted * 2));
    assert_eq!(g.step, 192, "at epoch 3's validation, after its 64 steps");
    let epochs: Vec<i64> = more.ooms().iter().map(|o| o.epoch).collect();
    let count = |e: i64| epochs.iter().filter(|&&x| x == e).count();
    assert_eq!((count(2), count(3)), (0, 1), "epochs of the OOMs: {epochs:?}");
    let s = more.summary();
    assert_eq!((s.oom.eval_grow_backs, s.oom.grow_backs), (1, 0));
    assert_eq!(s.batch.final_micro_batch, 8);
    assert_eq!(more.final_state()["eval_micro_batch"], fitted);
}

#[test]
fn data_parallel_ranks_halve_validation_together() {
    let t = wide()
        .set("memory.limit", Value::from("1GiB"))
        .set("train.eval_batch_size", 16)
        .set("train.epochs", 1)
        .arg("--nproc")
        .arg("2");
    let clean = t.clone().name("clean").run();
    // Rank 1's cap is squeezed as its first validation micro-batch starts.
    let hit = t.clone().name("hit").env("MEMTRAIN_FAULT_OOM_IN", "validation@1").run();
    let ooms = hit.ooms();
    assert_eq!(ooms.len(), 1, "{ooms:?}");
    assert_eq!(
        ooms[0].kind,
        OomKind::Peer,
        "rank 0 records rank 1's OOM: {:?}",
        ooms[0]
    );
    assert!(
        ooms[0].error.contains("rank 1 ran out of memory in validation"),
        "{:?}",
        ooms[0]
    );
    assert_eq!(ooms[0].decision.action, "eval_backoff");
    assert_eq!(hit.final_state()["eval_micro_batch"], 8, "rank 0 halved with rank 1");
    assert_eq!(hit.summary().batch.final_micro_batch, 8);
    assert_eq!(hit.final_bytes(), clean.final_bytes(), "training is untouched");
    let (a, b) = (&hit.epochs()[0].result, &clean.epochs()[0].result);
    assert!((a.val_loss.unwrap() - b.val_loss.unwrap()).abs() <= 1e-6 * b.val_loss.unwrap().abs());
}

#[test]
fn eval_batch_size_must_be_positive() {
    Test::new()
        .set("train.eval_batch_size", 0)
        .exit(2)
        .stderr_has("train.eval_batch_size")
        .stderr_has("must be at least 1, got 0")
        .run();
}
