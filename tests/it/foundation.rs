//! `info`, `check`, spec errors and exit codes, driven through the built binary.
use crate::common::*;

fn info(args: &[&str]) -> Test {
    Test::new().no_spec().command("info").args(args)
}

#[test]
fn info_json_agrees_with_proc_meminfo() {
    let r = info(&["--json"]).run();
    // `info --json` is the command's own output, not a record: its JSON is the interface.
    let v: serde_json::Value = serde_json::from_str(&r.stdout).expect("info --json prints one JSON object");
    assert_eq!(v["libtorch"], "2.11.0");
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap();
    let kb = |name: &str| -> f64 {
        meminfo
            .lines()
            .find(|l| l.starts_with(&format!("{name}:")))
            .and_then(|l| l.split_whitespace().nth(1))
            .unwrap()
            .parse::<f64>()
            .unwrap()
            * 1024.0
    };
    let total = v["host"]["ram_total_bytes"].as_f64().unwrap();
    assert_eq!(total, kb("MemTotal"));
    // Available memory moves with every other process (the tests beside this one among them), so
    // no reading taken here can be held against memtrain's. What holds whatever else runs: a
    // whole number of /proc/meminfo's kB, more than none and less than all (the kernel's own
    // memory is never available).
    let avail = v["host"]["ram_available_bytes"].as_u64().unwrap();
    assert_eq!(avail % 1024, 0, "{avail} is not in kB");
    assert!(avail > 0 && (avail as f64) < total, "{avail} of {total}");
    assert!(v["host"]["process_rss_bytes"].as_u64().unwrap() > 1 << 20);
    assert!(v["cpu"]["logical_cpus"].as_u64().unwrap() >= 1);
    for key in ["available", "device_count", "runtime", "cudnn", "driver"] {
        assert!(v["cuda"].get(key).is_some(), "cuda.{key} missing");
    }
    assert!(v["allocator"].get("PYTORCH_CUDA_ALLOC_CONF").is_some());
    // NVML lists every GPU; libtorch counts those CUDA_VISIBLE_DEVICES leaves it.
    assert!(v["gpus"].as_array().unwrap().len() as u64 >= v["cuda"]["device_count"].as_u64().unwrap());
}

#[test]
fn info_says_plainly_whether_there_is_a_gpu() {
    let j: serde_json::Value = serde_json::from_str(&info(&["--json"]).run().stdout).unwrap();
    let human = info(&[]).run().stdout;
    if j["cuda"]["available"] == false {
        assert!(human.contains("GPUs: none available"), "{human}");
    } else {
        assert!(human.contains("GPU 0:"), "{human}");
    }
}

/// scripts/bootstrap installs Gloo's headers and the CUDA runtime's crt/ and <nv/target> that
/// nccl.h needs, so every binary built from it, CI's included, can train data-parallel on both.
#[test]
fn the_binary_is_built_with_gloo_and_nccl() {
    let j: serde_json::Value = serde_json::from_str(&info(&["--json"]).run().stdout).unwrap();
    assert_eq!(j["data_parallel"]["gloo"], true, "{j}");
    assert_eq!(j["data_parallel"]["nccl"], true, "{j}");
    let human = info(&[]).run().stdout;
    assert!(
        human.contains("Data-parallel: Gloo (CPU) built, NCCL (CUDA) built"),
        "{human}"
    );
}

#[test]
fn info_reports_allocator_settings_from_the_environment() {
    let out = info(&["--json"])
        .env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        .run();
    let v: serde_json::Value = serde_json::from_str(&out.stdout).unwrap();
    assert_eq!(v["allocator"]["PYTORCH_CUDA_ALLOC_CONF"], "expandable_segments:True");
}

#[test]
fn a_cuda_only_setting_on_the_cpu_is_named_and_the_run_goes_on() {
    let o = Test::new()
        .set("memory.record_history", true)
        .arg("--max-steps")
        .arg("1")
        .stderr_has("memory.record_history is ignored: it records the CUDA caching allocator's history, and this run is on the CPU")
        .run();
    assert!(o.out.join("summary.json").exists() && !o.out.join("snapshot.pickle").exists());
}

#[test]
fn a_model_too_large_for_the_machine_without_a_cap_is_not_told_to_raise_one() {
    // As below: an allocation past any address space, with no memory.limit set.
    let o = Test::new()
        .set(
            "model.mlp.hidden",
            toml::Value::Array(vec![toml::Value::Integer(1 << 54)]),
        )
        .exit(3)
        .stderr_has("out of memory while building the model")
        .stderr_has("To fix: no memory.limit bound it, so the machine's own memory ran out")
        .stderr_has("or use a smaller model")
        .run();
    assert!(!o.stderr.contains("raise memory.limit"), "{}", o.stderr);
}

#[test]
fn check_of_a_model_too_large_for_host_memory_says_so() {
    // 2^54 hidden units: a bias of 2^56 bytes and weights of 2^62, past any machine's address
    // space. `check` counts them from their shapes and says that `run` could not build them.
    Test::new()
        .command("check")
        .set(
            "model.mlp.hidden",
            toml::Value::Array(vec![toml::Value::Integer(1 << 54)]),
        )
        .stderr_has("`memtrain run` builds the model in host memory (in fp32, but a frozen base kept in bf16) before it moves anything")
        .stderr_has("run it where more is free")
        .run();
}

#[test]
fn resuming_with_another_optimizer_or_a_damaged_state_says_what_to_keep() {
    let o = Test::new().set("train.epochs", 1).run();
    let checkpoint = std::fs::read_dir(o.out.join("checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_dir())
        .expect("a checkpoint");
    let saved = file_bytes(&checkpoint.join("optimizer.safetensors"));
    o.resume()
        .set("train.epochs", 2)
        .set("train.optimizer", "sgd")
        .exit(2)
        .stderr_has("the checkpoint's optimizer state does not fit this run's sgd optimizer")
        .stderr_has("resume with the train.optimizer and train.optimizer_state_bits the checkpoint was written with")
        .run();
    assert_eq!(
        file_bytes(&checkpoint.join("optimizer.safetensors")),
        saved,
        "resuming only reads"
    );
    let state = checkpoint.join("state.json");
    let whole = std::fs::read(&state).unwrap();
    let mut json: serde_json::Value = serde_json::from_slice(&whole).unwrap();
    json["micro_batch"] = 0.into();
    std::fs::write(&state, serde_json::to_vec(&json).unwrap()).unwrap();
    o.resume()
        .set("train.epochs", 2)
        .exit(2)
        .stderr_has("state.json: micro_batch is 0 (at least 1), which no run writes")
        .stderr_has("remove this checkpoint directory to resume from the one before it")
        .run();
    // A weights file cut short after the save.
    std::fs::write(&state, whole).unwrap();
    let model = checkpoint.join("model.safetensors");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 2]).unwrap();
    o.resume()
        .set("train.epochs", 2)
        .exit(2)
        .stderr_has("(the file is cut short or damaged: its tensors do not fit the bytes it holds)")
        .stderr_has("this checkpoint is damaged: remove")
        .run();
    // Initial weights that are not safetensors at all.
    let text = o.out.join("notes.safetensors");
    std::fs::write(&text, "just some notes\n").unwrap();
    Test::new()
        .name("init")
        .set("model.init_from", text.to_str().unwrap())
        .exit(2)
        .stderr_has("(not a safetensors file: its header does not read)")
        .run();
}

#[test]
fn an_image_model_on_samples_without_a_channel_axis_says_how_to_save_them() {
    Test::new()
        .remove("model.mlp")
        .set("model.preset", "resnet18")
        .set("model.resnet18.num_classes", 10)
        .arg("--max-steps")
        .arg("1")
        .exit(2)
        .stderr_has("x has samples of shape [8, 8] (64 values) but the model expects [3, 224, 224]")
        .stderr_has("save x with a channel axis, as [N, 1, 8, 8]")
        .run();
    Test::new()
        .command("check")
        .remove("model.mlp")
        .set("model.preset", "vit")
        .set("model.vit.image_size", 32)
        .set("model.vit.patch_size", 5)
        .exit(2)
        .stderr_has("model.vit.image_size must be a multiple of model.vit.patch_size (5), got 32; a patch_size that divides it: 1, 2, 4, 8, 16, 32")
        .run();
}

#[test]
fn a_cap_below_a_mib_is_said_in_its_own_units() {
    Test::new()
        .set("memory.limit", 1)
        .exit(3)
        .stderr_has("out of memory while building the model")
        .stderr_has("of tensors already allocated under the run's 1 B cap")
        .run();
}

/// `memtrain run ... 2>&1 | head -2`: the reader goes away, and the run trains on to its end.
#[test]
fn a_run_whose_output_nobody_reads_still_completes() {
    let t = Test::new().set("train.epochs", 2).set("log.progress", "lines");
    let spec = t.dir().join("spec.toml");
    std::fs::write(&spec, toml::to_string(t.table()).unwrap()).unwrap();
    let out = t.dir().join("run");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_memtrain"))
        .args(["run", spec.to_str().unwrap(), "--out", out.to_str().unwrap()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    drop(child.stderr.take());
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{status}");
    let summary: serde_json::Value = json(&out.join("summary.json"));
    assert_eq!(summary["status"], "completed", "{summary}");
}

/// `memtrain check spec.toml | head -1`, and the like: a reader that closed stdout before the
/// command wrote asked for no more, so the command ends as it would have, without a panic.
#[test]
fn output_nobody_reads_ends_the_command_cleanly() {
    let t = Test::new();
    let spec = t.dir().join("spec.toml");
    std::fs::write(&spec, toml::to_string(t.table()).unwrap()).unwrap();
    let spec = spec.to_str().unwrap();
    for args in [vec!["check", spec], vec!["info"], vec!["info", "--json"]] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_memtrain"))
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let out = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

#[test]
fn an_effective_batch_above_the_data_is_said() {
    Test::new()
        .set("train.epochs", 1)
        .set("data.val_fraction", 0.995)
        .stderr_has("the effective batch (32) is more than the 9 training samples: every step trains on all of them")
        .run();
}

#[test]
fn a_loss_gone_to_nan_is_said_with_what_to_change() {
    Test::new()
        .set("train.epochs", 1)
        .set("train.lr", 1e30)
        .stderr_has("epoch 1: the training loss is NaN, so the weights no longer learn; lower train.lr")
        .run();
}

/// (name, spec text, expected line:col, expected message fragment)
fn bad_specs() -> Vec<(&'static str, String, &'static str, &'static str)> {
    let d = digits();
    let base = |extra: &str| format!("[model]\npreset = \"mlp\"\n{extra}");
    vec![
        (
            "unknown_key",
            base("[train]\nbatchsize = 4\n"),
            "4:1",
            "unknown field `batchsize`",
        ),
        (
            "unknown_section",
            base("[trian]\nepochs = 1\n"),
            "3:2",
            "unknown field `trian`",
        ),
        (
            "effective_batch_overflows",
            base("[train]\naccumulation_steps = 576460752303423488\n"),
            "4:1",
            "train.batch_size × train.accumulation_steps (the effective batch) must be at most 2147483647",
        ),
        (
            "threads_past_any_machine",
            base("[job]\nthreads = 100000\n"),
            "4:1",
            "job.threads must be at most 1024, got 100000",
        ),
        (
            "wrong_type",
            base("[train]\nepochs = \"ten\"\n"),
            "4:1",
            "train.epochs: invalid type",
        ),
        (
            "zero_batch",
            base("[train]\nbatch_size = 0\n"),
            "4:1",
            "train.batch_size must be at least 1, got 0",
        ),
        (
            "negative_epochs",
            base("[train]\nepochs = -3\n"),
            "4:1",
            "train.epochs must be at least 1, got -3",
        ),
        (
            "zero_accumulation",
            base("[train]\naccumulation_steps = 0\n"),
            "4:1",
            "train.accumulation_steps must be at least 1",
        ),
        (
            "bad_unit",
            base("[memory]\nlimit = \"4 gigs\"\n"),
            "4:1",
            "is not a size",
        ),
        (
            "zero_limit",
            base("[memory]\nlimit = \"0MiB\"\n"),
            "4:1",
            "memory.limit must be more than 0 bytes",
        ),
        (
            "negative_limit",
            base("[memory]\nlimit = -5\n"),
            "4:1",
            "a size cannot be negative",
        ),
        (
            "negative_limit_with_a_unit",
            base("[memory]\nlimit = \"-1GiB\"\n"),
            "4:1",
            "a size cannot be negative, got \"-1GiB\"",
        ),
        (
            "fraction_zero",
            base("[memory]\nfraction = 0.0\n"),
            "4:1",
            "memory.fraction must be in (0, 1], got 0",
        ),
        (
            "fraction_above_one",
            base("[memory]\nfraction = 1.5\n"),
            "4:1",
            "memory.fraction must be in (0, 1], got 1.5",
        ),
        (
            "limit_and_fraction",
            base("[memory]\nlimit = \"1GiB\"\nfraction = 0.5\n"),
            "5:1",
            "cannot be set together",
        ),
        (
            "unknown_preset",
            "[model]\npreset = \"resnet\"\n".into(),
            "2:1",
            "model.preset is \"resnet\", which is not a preset; choose one of: mlp, darts",
        ),
        (
            "unknown_mlp_option",
            base(
                "[model.mlp]
inputs = 4
hiden = [8]
",
            ),
            "5:1",
            "model.mlp.hiden is not an option of the mlp preset (expected one of `inputs`, `hidden`, `num_classes`)",
        ),
        (
            "mistyped_darts_option",
            "[model]\npreset = \"darts\"\n[model.darts]\nnum_cells = \"three\"\n".into(),
            "4:1",
            "model.darts.num_cells is invalid: invalid type: string \"three\", expected an integer (write numbers without quotes)",
        ),
        (
            "stray_model_key",
            base("initfrom = \"w.safetensors\"\n"),
            "3:1",
            "model.initfrom is not a key of [model]",
        ),
        (
            "missing_data_file",
            base("[data]\nsource = \"npz\"\npath = \"nope/missing.npz\"\n"),
            "5:1",
            "data.path names nope/missing.npz, which does not exist",
        ),
        (
            "npz_without_path",
            base("[data]\nsource = \"npz\"\n"),
            "3:2",
            "data.path is required",
        ),
        (
            "unknown_device",
            "[job]\ndevice = \"tpu\"\n[model]\npreset = \"mlp\"\n".into(),
            "2:1",
            "expected \"auto\", \"cpu\"",
        ),
        (
            "bad_on_oom",
            base("[memory]\non_oom = [\"retry\"]\n"),
            "4:1",
            "unknown variant `retry`",
        ),
        (
            "unknown_optimizer_impl",
            base("[train]\noptimizer_impl = \"fast\"\n"),
            "4:1",
            "expected one of `single`, `foreach`, `fused`, `auto`",
        ),
        (
            "fused_with_8bit_state",
            base("[train]\noptimizer = \"adamw\"\noptimizer_state_bits = 8\noptimizer_impl = \"fused\"\n"),
            "6:1",
            "\"fused\" has no 8-bit form",
        ),
        (
            "foreach_with_host_gradients",
            base("[train]\noptimizer_impl = \"foreach\"\n[memory]\ngradients = \"host\"\n"),
            "4:1",
            "set train.optimizer_impl = \"auto\" or \"single\", or keep the gradients on the device",
        ),
        (
            "fail_not_last",
            base("[memory]\non_oom = [\"fail\", \"cpu\"]\n"),
            "4:1",
            "put \"fail\" last",
        ),
        (
            "unknown_darts_op",
            "[model]\npreset = \"darts\"\n[model.darts]\nops = [\"none\", \"conv_9\"]\n".into(),
            "4:1",
            "unknown operation \"conv_9\"",
        ),
        (
            "darts_op_listed_twice",
            "[model]\npreset = \"darts\"\n[model.darts]\nops = [\"none\", \"sep_conv_3\", \"sep_conv_3\"]\n".into(),
            "4:1",
            "model.darts.ops lists \"sep_conv_3\" twice",
        ),
        (
            "darts_options_on_mlp",
            base("[model.darts]\nnum_cells = 2\n"),
            "3:8",
            "model.darts is set but model.preset is \"mlp\"",
        ),
        (
            "min_batch_above_batch",
            base("[train]\nbatch_size = 4\n[memory]\nmin_batch_size = 8\n"),
            "6:1",
            "must not exceed train.batch_size",
        ),
        (
            "cache_clear_word",
            base("[memory]\ncache_clear_every = \"sometimes\"\n"),
            "4:1",
            "expected a step count",
        ),
        (
            "bad_max_split",
            base("[memory.allocator]\nmax_split_size_mb = 10\n"),
            "4:1",
            "must be more than 20",
        ),
        (
            "val_fraction_one",
            format!("[model]\npreset = \"mlp\"\n[data]\nsource = \"npz\"\npath = \"{d}\"\nval_fraction = 1.0\n"),
            "6:1",
            "data.val_fraction must be in (0, 1)",
        ),
        (
            "data_path_a_directory",
            format!(
                "[model]\npreset = \"mlp\"\n[data]\nsource = \"npz\"\npath = \"{}\"\n",
                repo().join("data").display()
            ),
            "5:1",
            "which is a directory; it must be a file with arrays x and y",
        ),
        (
            "missing_model",
            "[train]\nepochs = 1\n".into(),
            "",
            "missing field `model`",
        ),
        (
            "invalid_toml",
            "[model\npreset = \"mlp\"\n".into(),
            "1:7",
            "invalid TOML",
        ),
    ]
}

#[test]
fn bad_specs_exit_2_with_file_line_col_and_no_panic() {
    let cases = bad_specs();
    assert!(cases.len() >= 15);
    for (i, (name, text, at, fragment)) in cases.into_iter().enumerate() {
        // `run` validates the same way; a few cases show it, all would only cost time.
        let cmds: &[&str] = if i % 5 == 0 { &["check", "run"] } else { &["check"] };
        for &cmd in cmds {
            let r = Test::new()
                .name(name)
                .spec_text(&text)
                .command(cmd)
                .exit(2)
                .stderr_has(fragment)
                .run();
            assert!(!r.stderr.contains("backtrace"), "{name}: {}", r.stderr);
            let p = r.test.spec_path();
            let prefix = if at.is_empty() {
                format!("{}: ", p.display())
            } else {
                format!("{}:{at}: ", p.display())
            };
            assert!(
                r.stderr.starts_with(&prefix),
                "{name} ({cmd}): expected prefix {prefix:?}\nstderr: {}",
                r.stderr
            );
            // Nothing was written.
            assert!(!r.out.exists(), "{name} ({cmd}) created {}", r.out.display());
        }
    }
}

fn check() -> Test {
    Test::new().command("check")
}

#[test]
fn set_overrides_are_typed_and_errors_name_the_override() {
    let r = check()
        .args(&["--set", "train.batch_size=8", "--set", "job.device=cuda:1"])
        .run();
    assert!(r.stdout.contains("batch_size = 8"), "{}", r.stdout);
    assert!(r.stdout.contains("device = \"cuda:1\""), "{}", r.stdout);
    let r = check().args(&["--set", "train.batch_size=0"]).exit(2).run();
    assert_eq!(
        r.stderr.trim(),
        "--set train.batch_size=0: train.batch_size must be at least 1, got 0"
    );
    check()
        .args(&["--set", "train.batch_size"])
        .exit(2)
        .stderr_has("expected KEY=VALUE")
        .run();
    let r = check().args(&["--set", "train.nope=1"]).exit(2).run();
    assert!(
        r.stderr.starts_with("--set train.nope=1: unknown field `nope`"),
        "{}",
        r.stderr
    );
}

#[test]
fn missing_spec_file_and_bad_flags_exit_2() {
    let bare = |args: &[&str]| Test::new().no_spec().command(args[0]).args(&args[1..]).exit(2);
    bare(&["check", "no/such/spec.toml"])
        .stderr_has("no/such/spec.toml: cannot read spec file")
        .run();
    bare(&["run"]).run();
    bare(&["frobnicate"]).run();
}

#[test]
fn check_prints_the_resolved_spec_and_a_static_estimate() {
    let r = check()
        .set("memory.limit", "512MiB")
        .args(&["--set", "train.accumulation_steps=4"])
        .run();
    // Defaults are filled in and sizes are shown with units.
    for want in [
        "[checkpoint]",
        "keep_last = 2",
        "limit = \"512MiB\"",
        "accumulation_steps = 4",
    ] {
        assert!(r.stdout.contains(want), "missing {want:?} in\n{}", r.stdout);
    }
    // 64*32+32 + 32*10+10 = 2410 parameters; adam keeps two values per parameter, fp32.
    assert!(r.stdout.contains("mlp: 2410 parameters"), "{}", r.stdout);
    assert!(r.stdout.contains("parameters       9.41 KiB"), "{}", r.stdout);
    assert!(
        r.stdout
            .contains("optimizer state  18.83 KiB (adam: 2 value(s) per parameter; implementation "),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("effective batch  128 = micro-batch 32 x 4"),
        "{}",
        r.stdout
    );
    // Per precision, by dtype; mixed keeps fp32 master weights, pure bf16 halves everything.
    assert!(
        r.stdout
            .contains("*fp32        9.41 KiB fp32 + 9.41 KiB fp32 + 18.83 KiB fp32 = 37.66 KiB"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(
            "fp16-mixed  9.41 KiB fp32 + 9.41 KiB fp32 + 18.83 KiB fp32 = 37.66 KiB; up to 4.71 KiB of fp16 weight copies"
        ),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("bf16        4.71 KiB bf16 + 4.71 KiB bf16 + 9.41 KiB bf16 = 18.83 KiB"),
        "{}",
        r.stdout
    );
    // The printed spec is itself a valid spec.
    check()
        .name("again")
        .spec_text(r.stdout.split("\n# Static").next().unwrap())
        .run();
    // A CPU job's cap covers everything it holds; on a GPU the context and the libraries'
    // workspaces lie outside it, and check says so.
    let beyond = "beyond the cap the card also holds the CUDA context";
    assert!(!r.stdout.contains(beyond), "{}", r.stdout);
    let gpu = check()
        .name("gpu")
        .set("memory.limit", "512MiB")
        .set("job.device", "auto")
        .run();
    assert!(gpu.stdout.contains(beyond), "{}", gpu.stdout);
}

#[test]
fn every_shipped_config_checks() {
    for e in std::fs::read_dir(repo().join("configs")).unwrap() {
        let p = e.unwrap().path();
        Test::new().no_spec().command("check").arg(p.to_str().unwrap()).run();
    }
}

#[test]
fn check_lists_every_lever_with_when_it_comes_in_or_why_it_does_not_apply() {
    // The digits MLP is no sequence of blocks: recomputation cannot help it, and says why.
    let r = check()
        .set("memory.on_oom", vec!["recompute", "backoff", "fail"])
        .set("train.batch_size", 1)
        .run();
    let levers = r
        .stdout
        .split("levers ")
        .nth(1)
        .unwrap_or_else(|| panic!("{}", r.stdout));
    for line in [
        "recompute            on an OOM (memory.on_oom entry 1); does not apply: the model is not a sequence of blocks",
        "host_activations     not in memory.on_oom; does not apply: the model is not a sequence of blocks",
        "backoff              on an OOM (memory.on_oom entry 2); does not apply: micro-batch 1 cannot be halved",
        "cpu                  not in memory.on_oom; does not apply: the run is already on the CPU",
    ] {
        assert!(levers.contains(line), "missing {line:?} in\n{levers}");
    }
    // A chain of blocks with checkpointing asked for: engaged by the spec from the start.
    let r = check()
        .spec(table(
            "[job]\ndevice = \"cuda\"\n[model]\npreset = \"vit\"\n[model.vit]\nimage_size = 8\npatch_size = 4\n\
             hidden_dim = 16\nlayers = 2\nheads = 2\nmlp_dim = 32\nnum_classes = 10\n[train]\nbatch_size = 8\n\
             activation_checkpointing = true\n",
        ))
        .run();
    assert!(
        r.stdout
            .contains("recompute            on from the start (spec); activations: only block boundaries"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(
            "backoff              on an OOM (memory.on_oom entry 1); activations: shrink with the micro-batch"
        ),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .contains("cpu                  not in memory.on_oom; the whole bill ("),
        "{}",
        r.stdout
    );
}
