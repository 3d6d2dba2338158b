//! Out of memory in every phase of a run (docs/guide.md, "Out of memory in every phase"): one row per
//! phase, each a real allocation failure at that exact place (`MEMTRAIN_FAULT_OOM_IN` squeezes
//! the CPU cap to what is allocated when the phase begins), and the answer the table promises:
//! recovered, skipped with a warning, or exit 3 naming the phase, the sizes and what to change.
//! Never a panic or a C++ backtrace, and a checkpoint already written stays good.
use crate::common::*;
use memtrain::oom::Decision;
use toml::Value;

/// Large weights, tiny activations, two epochs of 4 steps (32 training samples at 8), a
/// checkpoint after each epoch.
fn job() -> Test {
    Test::new().spec(table(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 256\nhidden = [512]\n\
         num_classes = 4\n[data]\nsamples = 40\nval_fraction = 0.2\n[train]\nepochs = 2\nbatch_size = 8\n\
         optimizer = \"adam\"\nlr = 0.01\n[log]\nprogress = \"lines\"\nevery_steps = 1\n[memory]\nlimit = \"1GiB\"\n",
    ))
}

fn darts() -> Test {
    Test::darts().set("memory.limit", "1GiB")
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Answer {
    /// `memory.on_oom` engages (backoff under the default policy) and the run completes.
    Recovered,
    /// The run goes on without the failed work and completes; a warning says so.
    Skipped,
    /// Exit 3: the run ends, naming the phase, the sizes and what to change.
    Exit3,
    /// The phase allocates no tensor memory: a squeezed cap leaves it be.
    Unaffected,
}

/// What a row's run starts from: nothing, a finished one-epoch run whose final weights
/// `model.init_from` reads, or one whose checkpoint the row resumes.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Before {
    Nothing,
    InitFrom,
    Resume,
}

struct Row {
    /// `MEMTRAIN_FAULT_OOM_IN`'s value.
    fault: &'static str,
    job: fn() -> Test,
    /// What the row changes in its job (`memory.on_oom`).
    with: fn(Test) -> Test,
    before: Before,
    answer: Answer,
    /// What the terminal says, in this order of importance: the phase, the sizes, what to change.
    says: &'static [&'static str],
    /// The phase the `oom` record names (None: the run had no records open yet, or none was due).
    recorded: Option<&'static str>,
}

fn default_policy(t: Test) -> Test {
    t
}

fn fail(t: Test) -> Test {
    t.set("memory.on_oom", Value::Array(vec![Value::from("fail")]))
}

fn rows() -> Vec<Row> {
    vec![
        Row {
            fault: "data",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Exit3,
            says: &[
                "out of memory while reading the data",
                "40 samples of [256] are 40.00 KiB",
                "of tensors were allocated under the",
                "To fix: raise memory.limit",
            ],
            recorded: None,
        },
        Row {
            fault: "model",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Exit3,
            says: &[
                "out of memory while building the model",
                "its parameters are 522 KiB",
                "of tensors were allocated under the",
                "To fix: raise memory.limit",
                "memory.parameters = \"host\"",
            ],
            recorded: None,
        },
        Row {
            fault: "init_from",
            job,
            with: default_policy,
            before: Before::InitFrom,
            answer: Answer::Exit3,
            says: &[
                "out of memory while reading model.init_from",
                "522 KiB on disk",
                "raise memory.limit",
            ],
            recorded: None,
        },
        Row {
            fault: "resume",
            job,
            with: default_policy,
            before: Before::Resume,
            answer: Answer::Exit3,
            says: &[
                "out of memory while resuming a checkpoint from",
                "on disk",
                "the checkpoint is untouched: raise memory.limit",
                "run --resume again",
            ],
            recorded: None,
        },
        Row {
            fault: "preflight",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Recovered,
            says: &[
                "out of memory in forward (preflight)",
                "backing off: micro-batch 8 -> 4",
            ],
            recorded: Some("forward (preflight)"),
        },
        Row {
            fault: "forward:2",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Recovered,
            says: &[
                "out of memory in forward at epoch 1 step 1",
                "backing off: micro-batch 8 -> 4",
            ],
            recorded: Some("forward"),
        },
        Row {
            fault: "backward:2",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Recovered,
            says: &[
                "out of memory in backward at epoch 1 step 1",
                "backing off: micro-batch 8 -> 4",
            ],
            recorded: Some("backward"),
        },
        Row {
            fault: "optimizer:2",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Recovered,
            says: &[
                "out of memory in optimizer step at epoch 1 step 1",
                "tried to allocate",
                "backing off",
            ],
            recorded: Some("optimizer step"),
        },
        Row {
            fault: "arch:2",
            job: darts,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Recovered,
            says: &["out of memory in architecture step", "backing off: micro-batch 4 -> 2"],
            recorded: Some("architecture step"),
        },
        Row {
            fault: "backward:2",
            job,
            with: fail,
            before: Before::Nothing,
            answer: Answer::Exit3,
            says: &[
                "error: out of memory in backward",
                "tried to allocate",
                "last good state saved to",
                "adding \"backoff\" to memory.on_oom, or with a smaller train.batch_size",
            ],
            recorded: Some("backward"),
        },
        Row {
            fault: "validation:4",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Recovered,
            says: &[
                "out of memory in validation at epoch 1",
                "validation's micro-batch 8 -> 4 (train.eval_batch_size)",
                "training's stays 8 x 1",
            ],
            recorded: Some("validation"),
        },
        Row {
            fault: "checkpoint:4",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Skipped,
            says: &[
                "out of memory in writing a checkpoint at step 4",
                "the model is 522 KiB and the optimizer state 1.02 MiB",
                "no earlier checkpoint exists",
                "Raise memory.limit",
                "skipped this checkpoint, training goes on",
            ],
            recorded: Some("writing a checkpoint"),
        },
        Row {
            fault: "checkpoint:8",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Exit3,
            says: &[
                "error: out of memory in writing a checkpoint at step 8",
                "the model is 522 KiB and the optimizer state 1.02 MiB",
                "step-000000004 is intact",
                "Raise memory.limit",
            ],
            recorded: Some("writing a checkpoint"),
        },
        Row {
            fault: "report",
            job,
            with: default_policy,
            before: Before::Nothing,
            answer: Answer::Unaffected,
            says: &["report: "],
            recorded: None,
        },
    ]
}

#[test]
fn every_phase_has_its_answer_to_an_out_of_memory() {
    for (i, row) in rows().into_iter().enumerate() {
        let label = format!("row {i} ({})", row.fault);
        let name = format!("row{i}");
        let t = (row.with)((row.job)().name(&name));
        // Where the row starts from, and the checkpoint files that must come through untouched.
        let first = match row.before {
            Before::Nothing => None,
            Before::InitFrom | Before::Resume => {
                Some((row.job)().name(&format!("{name}-first")).set("train.epochs", 1).run())
            }
        };
        let kept = first.as_ref().map(|f| {
            let model = f.final_model();
            (model.clone(), file_bytes(&model))
        });
        let t = match (row.before, &first) {
            (Before::InitFrom, Some(f)) => t.set("model.init_from", f.final_model().to_str().unwrap()),
            (Before::Resume, Some(f)) => f.resume().args(&["--set", "train.epochs=2"]),
            _ => t,
        };
        let code = if row.answer == Answer::Exit3 { 3 } else { 0 };
        let r = t.env("MEMTRAIN_FAULT_OOM_IN", row.fault).exit(code).run();

        // The terminal: the phase, the sizes, what to change; nothing a crash would print.
        for s in row.says {
            assert!(r.stderr.contains(s), "{label}: stderr lacks {s:?}:\n{}", r.stderr);
        }
        for crash in ["panicked at", "Exception raised from", "frame #", "RUST_BACKTRACE"] {
            assert!(!r.stderr.contains(crash), "{label}: {crash:?} in stderr:\n{}", r.stderr);
        }

        // The records, where the run got that far.
        let ooms = if r.out.join("metrics.jsonl").exists() {
            r.ooms()
        } else {
            vec![]
        };
        match row.recorded {
            Some(phase) => {
                assert_eq!(ooms.len(), 1, "{label}: {ooms:?}");
                assert_eq!(ooms[0].phase, phase, "{label}");
                let action = &ooms[0].decision.action;
                match row.answer {
                    Answer::Recovered if phase == "validation" => {
                        assert_eq!(action, Decision::EVAL_BACKOFF, "{label}")
                    }
                    Answer::Recovered => assert_eq!(action, "backoff", "{label}"),
                    Answer::Skipped => assert_eq!(action, Decision::SKIP, "{label}"),
                    _ => assert_eq!(action, Decision::FAIL, "{label}"),
                }
            }
            None => assert!(ooms.is_empty(), "{label}: {ooms:?}"),
        }
        match row.answer {
            Answer::Recovered | Answer::Skipped | Answer::Unaffected => {
                let s = r.summary();
                assert_eq!(s.status, Status::Completed, "{label}");
                assert!(r.out.join("report.html").exists(), "{label}: the report");
            }
            Answer::Exit3 if row.before != Before::Resume && r.out.join("summary.json").exists() => {
                assert_eq!(r.summary().status, Status::Oom, "{label}");
            }
            Answer::Exit3 => {}
        }
        if row.before == Before::Nothing && row.recorded.is_none() && row.answer == Answer::Exit3 {
            assert!(!r.out.join("metrics.jsonl").exists(), "{label}: nothing was started");
        }

        // Checkpoints: no half-written save left behind, and whatever was written resumes.
        if let Some((model, bytes)) = &kept {
            assert_eq!(&file_bytes(model), bytes, "{label}: the checkpoint read changed");
        }
        let ck_dir = r.out.join("checkpoints");
        if ck_dir.exists() {
            let partial: Vec<_> = std::fs::read_dir(&ck_dir)
                .unwrap()
                .filter_map(|e| e.ok())
                .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
                .collect();
            assert!(partial.is_empty(), "{label}: a half-written save is left: {partial:?}");
            let _ = tensors(&r.final_model());
        }
        match (row.answer, row.before) {
            (Answer::Exit3, Before::Resume) => {
                let f = first.as_ref().unwrap();
                f.resume().args(&["--set", "train.epochs=2"]).run();
                assert_eq!(f.summary().status, Status::Completed, "{label}");
            }
            (Answer::Exit3, _) if ck_dir.exists() => {
                r.resume().run();
                assert_eq!(r.summary().status, Status::Completed, "{label}: resumed");
            }
            _ => {}
        }
    }
}

/// A periodic checkpoint that could not be written is only a skipped one: the next is written
/// as usual, and the run's last is the run's result.
#[test]
fn a_skipped_checkpoint_leaves_the_next_one_to_be_written() {
    let r = job()
        .env("MEMTRAIN_FAULT_OOM_IN", "checkpoint:4")
        .stderr_has("skipped this checkpoint")
        .run();
    let ck = r.checkpoints();
    assert_eq!(ck.len(), 1, "{ck:?}");
    assert_eq!(ck[0].step, 8);
    let clean = job().name("clean").run();
    assert_eq!(
        r.final_bytes(),
        clean.final_bytes(),
        "skipping a save changes no weights"
    );
}
