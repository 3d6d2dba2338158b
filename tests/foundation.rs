//! `info`, `check`, spec errors and exit codes, driven through the built binary.
mod common;

use common::*;

#[test]
fn info_json_agrees_with_proc_meminfo() {
    let r = run(&["info", "--json"]).ok();
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
    let avail = v["host"]["ram_available_bytes"].as_f64().unwrap();
    // Available memory moves while tests run in parallel; it must be in the same ballpark.
    assert!(
        (avail - kb("MemAvailable")).abs() < 0.1 * total,
        "{avail} vs {}",
        kb("MemAvailable")
    );
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
    let j: serde_json::Value = serde_json::from_str(&run(&["info", "--json"]).ok().stdout).unwrap();
    let human = run(&["info"]).ok().stdout;
    if j["cuda"]["available"] == false {
        assert!(human.contains("GPUs: none available"), "{human}");
    } else {
        assert!(human.contains("GPU 0:"), "{human}");
    }
}

#[test]
fn info_reports_allocator_settings_from_the_environment() {
    let out = memtrain()
        .args(["info", "--json"])
        .env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["allocator"]["PYTORCH_CUDA_ALLOC_CONF"], "expandable_segments:True");
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
            "unknown variant `resnet`",
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
    let dir = tempfile::tempdir().unwrap();
    let cases = bad_specs();
    assert!(cases.len() >= 15);
    for (i, (name, text, at, fragment)) in cases.into_iter().enumerate() {
        let p = write(dir.path(), &format!("{name}.toml"), &text);
        // `run` validates the same way; a few cases show it, all would only cost time.
        let cmds: &[&str] = if i % 5 == 0 { &["check", "run"] } else { &["check"] };
        for &cmd in cmds {
            let r = run(&[cmd, p.to_str().unwrap()]);
            assert_eq!(r.code, 2, "{name} ({cmd}): expected exit 2\nstderr: {}", r.stderr);
            assert!(
                !r.stderr.contains("panicked") && !r.stderr.contains("backtrace"),
                "{name}: {}",
                r.stderr
            );
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
            assert!(
                r.stderr.contains(fragment),
                "{name} ({cmd}): expected {fragment:?}\nstderr: {}",
                r.stderr
            );
        }
    }
    // Nothing was written for any of them.
    assert!(!common::repo().join("runs/unknown_key").exists());
}

#[test]
fn set_overrides_are_typed_and_errors_name_the_override() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "s.toml", &digits_spec(""));
    let r = run(&[
        "check",
        p.to_str().unwrap(),
        "--set",
        "train.batch_size=8",
        "--set",
        "job.device=cuda:1",
    ])
    .ok();
    assert!(r.stdout.contains("batch_size = 8"), "{}", r.stdout);
    assert!(r.stdout.contains("device = \"cuda:1\""), "{}", r.stdout);
    let r = run(&["check", p.to_str().unwrap(), "--set", "train.batch_size=0"]);
    assert_eq!(r.code, 2);
    assert_eq!(
        r.stderr.trim(),
        "--set train.batch_size=0: train.batch_size must be at least 1, got 0"
    );
    let r = run(&["check", p.to_str().unwrap(), "--set", "train.batch_size"]);
    assert_eq!(r.code, 2);
    assert!(r.stderr.contains("expected KEY=VALUE"), "{}", r.stderr);
    let r = run(&["check", p.to_str().unwrap(), "--set", "train.nope=1"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.starts_with("--set train.nope=1: unknown field `nope`"),
        "{}",
        r.stderr
    );
}

#[test]
fn missing_spec_file_and_bad_flags_exit_2() {
    let r = run(&["check", "no/such/spec.toml"]);
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("no/such/spec.toml: cannot read spec file"),
        "{}",
        r.stderr
    );
    assert_eq!(run(&["run"]).code, 2);
    assert_eq!(run(&["frobnicate"]).code, 2);
}

#[test]
fn check_prints_the_resolved_spec_and_a_static_estimate() {
    let dir = tempfile::tempdir().unwrap();
    let p = write(dir.path(), "s.toml", &digits_spec("[memory]\nlimit = \"512MiB\"\n"));
    let r = run(&["check", p.to_str().unwrap(), "--set", "train.accumulation_steps=4"]).ok();
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
            .contains("optimizer state  18.83 KiB (adam: 2 value(s) per parameter)"),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("effective batch  128 = micro-batch 32 x 4"),
        "{}",
        r.stdout
    );
    // The printed spec is itself a valid spec.
    let again = write(dir.path(), "again.toml", r.stdout.split("\n# Static").next().unwrap());
    run(&["check", again.to_str().unwrap()]).ok();
}

#[test]
fn every_shipped_config_checks() {
    for e in std::fs::read_dir(repo().join("configs")).unwrap() {
        let p = e.unwrap().path();
        let r = run(&["check", p.to_str().unwrap()]);
        assert_eq!(r.code, 0, "{}: {}", p.display(), r.stderr);
    }
}
