//! The step pipeline's reads off the device, counted in the records: one per logged step (the
//! loss, read after the optimizer step is launched), none on the steps between, one more per
//! step for fp16-mixed's found-inf check. On the CPU a read costs nothing, but the count is the
//! one a GPU run makes, where each read stops the host until the device has caught up.
use crate::common::*;

/// Digits MLP, one epoch of 45 steps of two micro-batches each (so the next micro-batch's copy
/// is issued while one runs), clipping on, a step record every 4 steps.
fn counted() -> Test {
    Test::new()
        .set("train.epochs", 1)
        .set("train.batch_size", 16)
        .set("train.accumulation_steps", 2)
        .set("train.grad_clip_norm", 1.0)
        .set("log.every_steps", 4)
}

#[test]
fn a_logged_step_reads_once_and_the_steps_between_read_nothing() {
    let r = counted().run();
    let steps = r.steps();
    // Steps 4, 8, ..., 44.
    assert_eq!(steps.len(), 11);
    for s in &steps {
        assert_eq!(
            s.host_reads, 1,
            "step {}: {} reads in its window of 4 steps",
            s.step, s.host_reads
        );
        assert!(s.loss.is_finite(), "step {}", s.step);
    }
    // The epoch's end: validation's sums (one read) and the training sums of step 45, which no
    // step record read (one more).
    let epochs = r.epochs();
    assert_eq!(epochs[0].host_reads, 2);
    assert_eq!(r.summary().host_reads, 11 + 2);
}

#[test]
fn reading_the_loss_less_often_changes_nothing_it_trains() {
    let sparse = counted().name("sparse").run();
    let every = counted().name("every").set("log.every_steps", 1).run();
    assert_eq!(sparse.final_bytes(), every.final_bytes());
    // The epoch's sums, read once at its end, equal those read after every step.
    let (a, b) = (&sparse.epochs()[0], &every.epochs()[0]);
    assert_eq!(a.train_loss.to_bits(), b.train_loss.to_bits());
    assert_eq!(a.train_acc, b.train_acc);
    assert_eq!(a.val_loss, b.val_loss);
    // The logged steps' losses are the same steps' losses.
    let by_step = |o: &Outcome, n: i64| o.steps().into_iter().find(|s| s.step == n).unwrap().loss;
    for n in [4, 20, 44] {
        assert_eq!(by_step(&sparse, n).to_bits(), by_step(&every, n).to_bits(), "step {n}");
    }
    assert!(every.steps().iter().all(|s| s.host_reads == 1));
}

#[test]
fn fp16_mixed_adds_one_read_per_step_for_the_scalers_check() {
    let r = counted()
        .set("train.precision", "fp16-mixed")
        .args(&["--max-steps", "8"])
        .run();
    let steps = r.steps();
    assert_eq!(steps.len(), 2);
    for s in &steps {
        assert_eq!(s.host_reads, 1 + 4, "step {}", s.step);
    }
}

/// What a run's records tell, apart from their timing: each record's kind, in order, with its
/// step and, for steps and epochs, the loss bit for bit.
fn told(o: &Outcome) -> Vec<String> {
    use memtrain::records::Event;
    let r = memtrain::records::read(&o.out).expect("the run's records");
    r.events
        .iter()
        .map(|e| match e {
            Event::Step(s) => format!("step {} loss {:x}", s.step, s.loss.to_bits()),
            Event::Epoch(e) => format!("epoch {} loss {:x}", e.step, e.result.train_loss.to_bits()),
            Event::Checkpoint(c) => format!("checkpoint {} at {}", c.reason, c.step),
            Event::Oom(o) => format!("oom in {} at {}", o.phase, o.step),
            other => format!("{other:?}").split('(').next().unwrap_or_default().to_string(),
        })
        .collect()
}

/// On a GPU a step record waits for its loss until the next step is queued (so the device never
/// idles between steps), and whatever else writes a record, reads the sums or ends the run
/// writes it first. `MEMTRAIN_FAULT_LATE_READS` makes the CPU wait the same way: the records
/// must come out as they do when each is written at once, in the same order, through an OOM the
/// run recovers from, epoch ends with their checkpoints, an OOM that ends the run, a
/// `--max-steps` stop, and an interrupt and its resume.
#[test]
fn records_that_wait_for_the_next_step_come_out_the_same_and_in_order() {
    let job = || {
        Test::new().spec(table(
            "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 256\nhidden = [512]\n\
             num_classes = 4\n[data]\nsamples = 40\nval_fraction = 0.2\n[train]\nepochs = 2\nbatch_size = 8\n\
             optimizer = \"adam\"\nlr = 0.01\n[log]\nprogress = \"lines\"\nevery_steps = 1\n[memory]\nlimit = \"1GiB\"\n",
        ))
    };
    let fail = toml::Value::Array(vec![toml::Value::from("fail")]);
    let cases: Vec<(&str, Test)> = vec![
        ("recovered", job().env("MEMTRAIN_FAULT_OOM_IN", "backward:3")),
        (
            "ended",
            job()
                .env("MEMTRAIN_FAULT_OOM_IN", "backward:3")
                .set("memory.on_oom", fail)
                .exit(3),
        ),
        ("limited", job().args(&["--max-steps", "6"])),
        ("interrupted", job().interrupt_after_step(3).exit(130)),
    ];
    for (name, t) in cases {
        let at_once = t.clone().name(&format!("{name}-at-once")).run();
        let late = t
            .name(&format!("{name}-late"))
            .env("MEMTRAIN_FAULT_LATE_READS", "1")
            .run();
        let told_late = told(&late);
        assert_eq!(told_late, told(&at_once), "{name}");
        assert!(
            told_late.iter().filter(|l| l.starts_with("step ")).count() >= 2,
            "{name}: {told_late:?}"
        );
        assert!(late.steps().iter().all(|s| s.seconds.is_finite() && s.seconds >= 0.0));
        if name == "interrupted" {
            // The checkpoint the interrupt saved holds the epoch's sums as they stood: resumed,
            // both runs end alike.
            let (a, b) = (
                at_once.resume().run(),
                late.resume().env("MEMTRAIN_FAULT_LATE_READS", "1").run(),
            );
            assert_eq!(told(&b), told(&a), "{name}, resumed");
            assert_eq!(b.final_bytes(), a.final_bytes());
        }
    }
}
