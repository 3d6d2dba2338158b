//! Real allocation failures on the CPU: `memory.limit` caps live tensor bytes in the counting CPU
//! allocator, so libtorch's allocations fail for real, deterministically, and every OOM path
//! runs as it would on a small GPU.
use crate::common::*;
use memtrain::oom::OomKind;
use toml::Value;

/// Activations dominate: one hidden layer of 262,144 units is 1 MiB per sample per tensor,
/// so micro-batch 32 needs far more than a 100 MiB cap allows, and 8 fits easily.
fn wide() -> Test {
    Test::new().spec(table(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 8\nhidden = [262144]\n\
         num_classes = 2\n[data]\nsamples = 160\n[train]\nepochs = 1\nbatch_size = 32\noptimizer = \"sgd\"\nlr = 0.01\n\
         [log]\nprogress = \"lines\"\n",
    ))
}

fn capped() -> Test {
    wide().set("memory.limit", "100MiB")
}

fn policy(actions: &[&str]) -> Value {
    Value::Array(actions.iter().map(|a| Value::from(*a)).collect())
}

#[test]
fn backoff_keeps_the_effective_batch_and_the_weights_of_the_smaller_batch() {
    let r = capped()
        .name("capped")
        .set("memory.on_oom", policy(&["backoff", "fail"]))
        .stderr_has("backing off: micro-batch 32 -> 16")
        .stderr_has("effective batch stays 32")
        .stderr_has("Memory cap: 100 MiB of CPU tensor memory")
        .run();

    let s = r.summary();
    assert_eq!(s.status, Status::Completed);
    let micro = s.batch.final_micro_batch;
    let acc = s.batch.final_accumulation_steps;
    assert!(micro < 32 && micro * acc == 32, "micro {micro} x {acc}");
    assert_eq!(s.batch.effective_batch, 32);
    assert!(s.oom.of("backoffs") >= 1);
    // Every training sample exactly once: 128 of the 160 (32 are held out).
    assert_eq!(s.samples_trained, 128);

    let ooms = r.ooms();
    assert!(!ooms.is_empty());
    assert_eq!(ooms[0].kind, OomKind::Cpu);
    assert_eq!(ooms[0].decision.action, "backoff");
    assert!(ooms[0].error.contains("can't allocate memory"));
    assert_eq!(ooms[0].batch_shape, [32, 8]);

    // The first OOM leaves a report.
    let report = r.oom_report();
    assert_eq!(report.micro_batch, 32);
    assert!(report.error.contains("CPU out of memory"));
    let cap = report.cap.expect("the report's cap");
    assert_eq!(cap.bytes, 100 << 20);
    assert_eq!(cap.kind, "cpu_tensor_bytes");
    // The allocator's statistics are libtorch's, passed through as JSON: untyped by design.
    let stats = report.allocator_stats.expect("the report's allocator statistics");
    assert!(stats["num_ooms"].as_u64().unwrap() >= 1);
    assert!(r.out.join("oom/spec.toml").exists());

    // Preflight reports the measured first step against the cap, in exact tensor bytes.
    let pre = &r.preflights()[0];
    assert_eq!(pre.micro_batch, micro);
    assert_eq!(pre.measure, "peak allocated");
    let peak = pre.peak_bytes;
    assert!(peak > 0 && peak <= 100 << 20, "{pre:?}");
    assert_eq!(pre.headroom_bytes, Some((100 << 20) - peak as i64));
    assert_eq!(pre.cap_bytes, Some(100 << 20));

    // The same job configured at the micro-batch it backed off to, with no cap, ends with
    // exactly the same weights: the failed attempts left no trace.
    let reference = wide()
        .name("reference")
        .set("train.batch_size", micro)
        .set("train.accumulation_steps", acc)
        .run();
    assert!(reference.ooms().is_empty());
    assert_eq!(
        r.final_bytes(),
        reference.final_bytes(),
        "backed-off run and {micro} x {acc} run differ"
    );

    // A resumed run keeps the micro-batch it had backed off to.
    r.resume().args(&["--set", "train.epochs=2"]).run();
    let starts = r.starts();
    assert_eq!(starts.last().unwrap().micro_batch, micro);
    assert!(starts.last().unwrap().resumed);
}

#[test]
fn fail_exits_3_and_writes_the_oom_report() {
    let r = capped()
        .set("memory.on_oom", policy(&["fail"]))
        .exit(3)
        .stderr_has("error: out of memory in backward (preflight)")
        .run();
    let s = r.summary();
    assert_eq!(s.status, Status::Oom);
    assert_eq!(s.exit_code, 3);
    assert!(r.out.join("oom/report.json").exists() && r.out.join("oom/spec.toml").exists());
    // The last good state is saved and can be resumed with a policy that can cope.
    let ck = r.checkpoints();
    assert_eq!(ck.len(), 1);
    assert_eq!(ck[0].reason, "oom");
    r.resume()
        .args(&["--set", "memory.on_oom=[\"backoff\",\"fail\"]"])
        .stderr_has("backing off")
        .run();
    assert_eq!(r.summary().status, Status::Completed);
}

#[test]
fn reaching_min_batch_size_ends_the_run_as_the_policy_says() {
    let r = capped()
        .set("memory.on_oom", policy(&["backoff", "fail"]))
        .set("memory.min_batch_size", 32)
        .exit(3)
        .stderr_has("cannot be halved without going below memory.min_batch_size 32")
        // What it suggests is what the policy does not already try, and would apply: an MLP
        // has no blocks to recompute, but its gradients can move to the host.
        .stderr_has("resume with --resume after lowering memory.min_batch_size (now 32), or after adding \"offload\" to memory.on_oom")
        .run();
    assert!(!r.stderr.contains("adding \"backoff\""), "{}", r.stderr);
    assert!(!r.stderr.contains("\"recompute\""), "{}", r.stderr);
    let ooms = r.ooms();
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].decision.action, "fail");
}

#[test]
fn cpu_fallback_on_a_cpu_run_is_skipped_with_a_notice() {
    capped()
        .set("memory.on_oom", policy(&["cpu", "fail"]))
        .exit(3)
        .stderr_has("skipped cpu: the run is already on the CPU")
        .run();
}

#[test]
fn grow_back_returns_to_the_configured_micro_batch_after_clean_steps() {
    // A cap that 32 does not fit: growing back OOMs again and backs off again; the run still
    // finishes with every sample trained once.
    let r = capped().set("memory.grow_back_after", 1).run();
    let s = r.summary();
    assert!(s.oom.grow_backs >= 1, "{s:?}");
    assert!(s.oom.of("backoffs") >= 2, "{s:?}");
    assert_eq!(s.samples_trained, 128);
    assert!(!r.grow_backs().is_empty());
    // The step that earned a grow-back ran at the smaller micro-batch, and its record says so.
    let steps = r.steps();
    for g in r.grow_backs() {
        let step = steps
            .iter()
            .find(|e| e.step == g.step)
            .expect("every step has its record");
        assert_eq!(step.micro_batch, g.micro_batch_before, "{g:?} {step:?}");
    }
}

#[test]
fn allocator_settings_merge_with_the_environment_and_conflicts_are_reported() {
    let r = Test::new()
        .set("train.epochs", 1)
        .set("memory.allocator.expandable_segments", true)
        .set("memory.allocator.max_split_size_mb", 256)
        .set("memory.allocator.garbage_collection_threshold", 0.6)
        .env(
            "PYTORCH_CUDA_ALLOC_CONF",
            "max_split_size_mb:128,roundup_power2_divisions:4",
        )
        .stderr_has("allocator setting max_split_size_mb: the environment says 128, the spec says 256")
        .run();
    let start = &r.starts()[0];
    assert_eq!(
        start.allocator_conf.as_deref(),
        Some("max_split_size_mb:256,roundup_power2_divisions:4,expandable_segments:True,garbage_collection_threshold:0.6")
    );
    assert_eq!(start.allocator_conflicts[0].key, "max_split_size_mb");
}

/// A model whose weights are large and activations tiny: Adam's step is where memory runs out.
fn adam() -> Test {
    Test::new().spec(table(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 256\nhidden = [512]\n\
         num_classes = 4\n[data]\nsamples = 40\nval_fraction = 0.2\n[train]\nepochs = 2\nbatch_size = 8\n\
         optimizer = \"adam\"\nweight_decay = 0.01\nlr = 0.01\ngrad_clip_norm = 1.0\n[log]\nprogress = \"lines\"\n\
         every_steps = 1\n[memory]\nlimit = \"1GiB\"\n",
    ))
}

fn optimizer_oom_at(t: Test, step: i64) -> Test {
    t.env("MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP", &step.to_string())
}

#[test]
fn an_oom_inside_the_optimizer_step_leaves_no_trace() {
    // The first step's optimizer update fails for real (its workspace allocation passes the
    // squeezed cap); backoff retries the group at micro-batch 4 x 2.
    let faulted = optimizer_oom_at(adam().name("faulted"), 1)
        .set("memory.on_oom", policy(&["backoff", "fail"]))
        .stderr_has("backing off: micro-batch 8 -> 4")
        .run();
    let ooms = faulted.ooms();
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].kind, OomKind::Cpu);
    assert!(ooms[0].error.contains("CPU out of memory"), "{:?}", ooms[0]);
    // The report sees memory as the OOM left it, before recovery released the gradients: as
    // much as a completed step holds (parameters, Adam's state and the gradients), not a
    // quarter less.
    let at_oom = faulted.oom_report().allocator_stats.unwrap()["allocated"]
        .as_u64()
        .unwrap();
    let after_step = faulted.steps()[0].memory.allocated_bytes.unwrap();
    assert!(
        at_oom as f64 >= 0.95 * after_step as f64,
        "the report saw {at_oom} bytes, a completed step holds {after_step}"
    );
    // The same job configured at 4 x 2 from the start, no fault: byte-identical weights, and the
    // optimizer counted each step once (Adam's bias correction would differ otherwise).
    let clean = adam()
        .name("clean")
        .set("train.batch_size", 4)
        .set("train.accumulation_steps", 2)
        .run();
    assert!(clean.ooms().is_empty());
    assert_eq!(
        faulted.final_bytes(),
        clean.final_bytes(),
        "a failed optimizer step must leave parameters and state untouched"
    );
    assert_eq!(faulted.summary().global_steps, clean.summary().global_steps);
}

/// The same real failure with the foreach and fused implementations: what their update needs
/// (foreach: the groups' workspace; fused: its step count tensor) is allocated before any
/// parameter or state tensor is written, and the in-place ops after it allocate nothing, so
/// the failed step leaves no trace either.
#[test]
fn an_oom_in_a_foreach_or_fused_step_leaves_no_trace() {
    for imp in ["foreach", "fused"] {
        let faulted = optimizer_oom_at(adam().name(&format!("faulted-{imp}")), 1)
            .set("train.optimizer_impl", imp)
            .set("memory.on_oom", policy(&["backoff", "fail"]))
            .stderr_has("backing off: micro-batch 8 -> 4")
            .run();
        let ooms = faulted.ooms();
        assert_eq!(ooms.len(), 1, "{imp}");
        assert!(ooms[0].error.contains("CPU out of memory"), "{imp}: {:?}", ooms[0]);
        let clean = adam()
            .name(&format!("clean-{imp}"))
            .set("train.optimizer_impl", imp)
            .set("train.batch_size", 4)
            .set("train.accumulation_steps", 2)
            .run();
        assert!(clean.ooms().is_empty());
        assert_eq!(
            faulted.final_bytes(),
            clean.final_bytes(),
            "{imp}: a failed optimizer step must leave parameters and state untouched"
        );
        assert_eq!(faulted.summary().precision.optimizer_impl.as_deref(), Some(imp));
    }
}

#[test]
fn with_fail_the_exit_checkpoint_holds_the_weights_from_before_the_failed_step() {
    // 32 training samples at 8 per step: 4 steps an epoch. Step 5 (epoch 2's first) fails.
    let failed = optimizer_oom_at(adam().name("failed"), 5)
        .set("memory.on_oom", policy(&["fail"]))
        .exit(3)
        .stderr_has("out of memory in optimizer step")
        .run();
    let ck = failed.checkpoints();
    assert_eq!(ck.last().unwrap().reason, "oom");
    assert_eq!(ck.last().unwrap().step, 4);
    let one_epoch = adam().name("one").set("train.epochs", 1).run();
    assert_eq!(
        failed.final_bytes(),
        one_epoch.final_bytes(),
        "the exit checkpoint must hold the weights of step 4"
    );
    let opt = |o: &Outcome| file_bytes(&o.final_model().with_file_name("optimizer.safetensors"));
    assert_eq!(opt(&failed), opt(&one_epoch), "and the optimizer state of step 4");
}

#[test]
fn init_weights_larger_than_the_cap_exit_3_naming_the_sizes() {
    // A first run makes a weight file of about half a MiB; with the model built, a 1 MiB cap
    // cannot hold it as well.
    let t = adam().remove("memory.limit");
    let first = t.clone().name("first").set("train.epochs", 1).run();
    let r = t
        .name("capped")
        .set("model.init_from", first.final_model().to_str().unwrap())
        .set("memory.limit", "1MiB")
        .exit(3)
        .stderr_has("out of memory while")
        .stderr_has("1.00 MiB")
        .run();
    assert!(!r.stderr.contains("frame #"), "{}", r.stderr);
    assert!(!r.out.join("metrics.jsonl").exists(), "nothing was started");
}

/// A grow-back follows the step that earned it: its record comes after that step's, whether the
/// step's record is written at once or waits for the next step (as on a GPU).
#[test]
fn a_grow_back_record_comes_after_the_record_of_the_step_it_follows() {
    for late in ["0", "1"] {
        let r = capped()
            .name(&format!("late-{late}"))
            .set("memory.grow_back_after", 1)
            .set("log.every_steps", 1)
            .env("MEMTRAIN_FAULT_LATE_READS", late)
            .run();
        let events = r.run_records().events;
        let at = |want: &dyn Fn(&Event) -> bool| events.iter().position(want);
        let grow_backs = r.grow_backs();
        assert!(!grow_backs.is_empty(), "late reads {late}");
        for g in grow_backs {
            let step = at(&|e| matches!(e, Event::Step(s) if s.step == g.step)).expect("every step has its record");
            let grow = at(&|e| matches!(e, Event::GrowBack(x) if x == &g)).expect("the grow-back's record");
            assert!(
                step < grow,
                "late reads {late}: {g:?} is record {grow}, its step's is {step}"
            );
        }
    }
}

/// The run's peak takes in the attempts that failed: a run that ends at its first OOM reports
/// at least the peak its OOM report saw.
#[test]
fn the_summarys_peak_counts_the_peaks_of_failed_steps() {
    let r = capped().set("memory.on_oom", policy(&["fail"])).exit(3).run();
    let at_oom = r.oom_report().memory.peak_allocated_bytes.expect("a counted CPU peak");
    let summary = r.summary().memory.peak_allocated_bytes.expect("a counted CPU peak");
    assert!(
        summary >= at_oom,
        "summary.json's peak {summary} is below the OOM report's {at_oom}"
    );
}

/// A static bill of 128 MiB (an MLP of 8.4M weights under Adam: parameters, gradients and two
/// moments) under a 135 MiB cap: the first optimizer step's update cannot find its workspace
/// at any micro-batch.
fn static_bill() -> Test {
    Test::new().spec(table(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 2048\nhidden = [4096]\n\
         num_classes = 4\n[data]\nsamples = 64\n[train]\nepochs = 1\nbatch_size = 16\noptimizer = \"adam\"\nlr = 0.001\n\
         [log]\nprogress = \"lines\"\n[memory]\nlimit = \"135MiB\"\n",
    ))
}

/// The ways the advice of a run that ran out of options offers, as `--set` arguments for the
/// resume (`spec_on_oom`: the policy the run had); the ways no setting can follow (a larger
/// cap or a smaller model) are left out.
fn advice_as_settings(stderr: &str, spec_on_oom: &[&str]) -> Vec<String> {
    let advice = stderr
        .lines()
        .find_map(|l| l.split_once("resume with --resume ").map(|(_, a)| a))
        .unwrap_or_else(|| panic!("no advice in\n{stderr}"));
    advice
        .split(", or ")
        .filter_map(|way| {
            if let Some(setting) = way.strip_prefix("after setting ") {
                let (key, value) = setting.split_once(" = ").expect("KEY = VALUE");
                Some(format!("{key}={value}"))
            } else if let Some(added) = way.strip_prefix("after adding ") {
                let words = added
                    .strip_suffix(" to memory.on_oom")
                    .expect("adding to memory.on_oom");
                let first = words.split(" or ").next().unwrap().to_owned();
                let mut on_oom: Vec<String> = spec_on_oom.iter().map(|a| format!("\"{a}\"")).collect();
                on_oom.insert(on_oom.len() - 1, first);
                Some(format!("memory.on_oom=[{}]", on_oom.join(",")))
            } else {
                None
            }
        })
        .collect()
}

#[test]
fn the_advice_after_an_oom_of_the_static_bill_trains_when_followed() {
    let failed = static_bill().name("failed").exit(3).run();
    let ways = advice_as_settings(&failed.stderr, &["backoff", "fail"]);
    assert!(!ways.is_empty(), "the advice offers a setting: {}", failed.stderr);
    for (i, way) in ways.iter().enumerate() {
        // Each way from the same failure: a run of its own, resumed as the advice says.
        let r = static_bill().name(&format!("way{i}")).exit(3).run();
        r.resume().args(&["--set", way]).run();
        let s = r.summary();
        assert_eq!(s.status, Status::Completed, "after --set {way}");
        assert_eq!(s.samples_trained, 51, "after --set {way}");
    }
    assert_eq!(ways[0], "memory.optimizer_state=\"host\"", "{ways:?}");
    // The policy's own way: "offload" added to memory.on_oom moves the state to the host before
    // the checkpoint's copy of it is read, where it would not fit beside the state on the device.
    let r = static_bill().name("offload").exit(3).run();
    r.resume()
        .args(&["--set", "memory.on_oom=[\"backoff\",\"offload\",\"fail\"]"])
        .stderr_has("the optimizer state moves to host memory and the checkpoint is read again")
        .run();
    assert_eq!(r.summary().status, Status::Completed);
    assert!(r.starts().last().unwrap().resumed);
}

#[test]
fn an_oom_of_the_static_bill_goes_to_the_lever_that_moves_it_not_to_backoff() {
    let cannot_fit = "is more than the 135 MiB cap (memory.limit) before any activation: this spec cannot fit. \
                      To fit, set memory.optimizer_state = \"host\".";
    let r = static_bill()
        .name("offload")
        .set("memory.on_oom", policy(&["backoff", "offload", "fail"]))
        .stderr_has(cannot_fit)
        .stderr_has("skipped backoff: it does not shrink what the optimizer step holds")
        .stderr_has("offloading: the optimizer state moves to host memory")
        .run();
    assert!(!r.stderr.contains("backing off"), "{}", r.stderr);
    let ooms = r.ooms();
    assert_eq!(ooms.len(), 1);
    assert_eq!(ooms[0].phase, "optimizer step (preflight)");
    assert_eq!(ooms[0].decision.action, "host_optimizer_state");
    let s = r.summary();
    assert_eq!(s.status, Status::Completed);
    assert_eq!(s.batch.final_micro_batch, 16, "the micro-batch was never halved");
    // Without such a lever in the policy the run stops at the first OOM, at micro-batch 16.
    let r = static_bill().name("fails").exit(3).stderr_has(cannot_fit).run();
    assert!(!r.stderr.contains("backing off"), "{}", r.stderr);
    let ooms = r.ooms();
    assert_eq!(ooms.len(), 1);
    assert_eq!(
        (ooms[0].micro_batch_before, ooms[0].decision.action.as_str()),
        (16, "fail")
    );
}
