use super::*;

#[test]
fn each_gpu_rank_takes_its_local_device_and_blocking_nccl_waits() {
    assert_eq!(rank_device(Place::Cuda(0), 3), Place::Cuda(3));
    assert_eq!(rank_device(Place::Cpu, 3), Place::Cpu);
    assert_eq!(nccl_env(Place::Cuda(1), false), Some(("TORCH_NCCL_BLOCKING_WAIT", "1")));
    assert_eq!(nccl_env(Place::Cuda(1), true), None, "the user's own setting stands");
    assert_eq!(nccl_env(Place::Cpu, false), None, "Gloo has no such switch");
}

fn spec(extra: &str) -> Spec {
    toml::from_str(&format!("[model]\npreset = \"mlp\"\n{extra}")).unwrap()
}

fn facts() -> Facts {
    Facts {
        host_ram_bytes: 16 << 30,
        ..Default::default()
    }
}

fn fresh() -> Request {
    Request::default()
}

fn resuming() -> Request {
    Request {
        resume: Some(None),
        ..Default::default()
    }
}

/// Facts of a resume from `state`, whose checkpoint's run had the spec `text`.
fn resumed_from(text: &str, state: TrainState) -> Facts {
    Facts {
        checkpoint_spec: Some(spec::to_toml(&spec(text)).parse().unwrap()),
        ..resumable(state)
    }
}

#[test]
fn a_cpu_plan_caps_tensor_bytes_from_limit_or_fraction() {
    let p = Plan::resolve(&spec("[memory]\nlimit = \"100MiB\"\n"), &fresh(), &facts()).unwrap();
    assert_eq!(p.device, Place::Cpu);
    assert_eq!(
        p.cap,
        Some(Cap {
            kind: "cpu_tensor_bytes".into(),
            bytes: 100 << 20,
            fraction: None
        })
    );
    let p = Plan::resolve(&spec("[memory]\nfraction = 0.25\n"), &fresh(), &facts()).unwrap();
    assert_eq!(p.cap.unwrap().bytes, 4 << 30);
    let p = Plan::resolve(&spec(""), &fresh(), &facts()).unwrap();
    assert_eq!(p.cap, None);
    assert_eq!(p.run_dir, PathBuf::from("runs/"));
    assert!(p.env.is_empty() && p.resume.is_none() && p.nothing_to_do.is_none());
}

#[test]
fn a_cuda_limit_is_a_fraction_of_what_the_runtime_reports() {
    let f = Facts {
        cuda_devices: 1,
        cuda_total_bytes: Some(8 << 30),
        ..facts()
    };
    let p = Plan::resolve(&spec("[memory]\nlimit = \"2GiB\"\n"), &fresh(), &f).unwrap();
    assert_eq!(p.device, Place::Cuda(0));
    let cap = p.cap.unwrap();
    assert_eq!(
        (cap.kind.as_str(), cap.bytes, cap.fraction),
        ("cuda_fraction", 2 << 30, Some(0.25))
    );
    assert_eq!(p.alloc.conf.as_deref(), Some("per_process_memory_fraction:0.25"));
    assert!(p.env.iter().any(|(k, _)| k == "PYTORCH_CUDA_ALLOC_CONF"));
    // cudaMallocAsync takes the fraction through the allocator call alone: its string keeps
    // the user's backend and gains no key libtorch would warn it ignores.
    let async_env = Facts {
        alloc_env: EnvSettings {
            cuda_alloc_conf: Some("backend:cudaMallocAsync".into()),
            alloc_conf: None,
        },
        ..f.clone()
    };
    let p = Plan::resolve(&spec("[memory]\nlimit = \"2GiB\"\n"), &fresh(), &async_env).unwrap();
    assert_eq!(p.cap.unwrap().fraction, Some(0.25));
    assert_eq!(p.alloc.conf.as_deref(), Some("backend:cudaMallocAsync"));
    // Without the runtime's total, a limit cannot become a fraction: say so.
    let f = Facts {
        cuda_devices: 1,
        ..facts()
    };
    let e = Plan::resolve(&spec("[memory]\nlimit = \"2GiB\"\n"), &fresh(), &f).unwrap_err();
    assert!(e.0.contains("total memory"), "{}", e.0);
}

#[test]
fn devices_resolve_or_explain() {
    let f = Facts {
        cuda_devices: 1,
        cuda_total_bytes: Some(1 << 30),
        ..facts()
    };
    assert_eq!(
        Plan::resolve(&spec("[job]\ndevice = \"auto\"\n"), &fresh(), &facts())
            .unwrap()
            .device,
        Place::Cpu
    );
    assert_eq!(
        Plan::resolve(&spec("[job]\ndevice = \"auto\"\n"), &fresh(), &f)
            .unwrap()
            .device,
        Place::Cuda(0)
    );
    let e = Plan::resolve(&spec("[job]\ndevice = \"cuda:1\"\n"), &fresh(), &f).unwrap_err();
    assert!(e.0.contains("cuda:1 but libtorch sees 1"), "{}", e.0);
}

#[test]
fn synthetic_keys_set_for_a_file_source_are_said_to_be_unread() {
    let notices = |extra: &str| Plan::resolve(&spec(extra), &fresh(), &facts()).unwrap().notices;
    let npz = "[data]\nsource = \"npz\"\npath = \"d.npz\"\n";
    assert!(notices(npz).is_empty(), "{:?}", notices(npz));
    let n = notices(&format!("{npz}samples = 100\n"));
    assert_eq!(
        n,
        ["data.samples is read only for synthetic data: this run reads every sample of data.path; remove it"]
    );
    let n = notices(&format!("{npz}samples = 100\nnoise = 0.5\nval_path = \"v.npz\"\n"));
    assert!(
        n[0].starts_with("data.samples and data.noise are read only for synthetic data: this run reads every sample of data.path and data.val_path; remove them"),
        "{n:?}"
    );
    assert!(notices("[data]\nsamples = 100\nnoise = 0.5\n").is_empty());
    // The defaults, as resolved specs of file sources once recorded them, pass.
    assert!(notices(&format!("{npz}samples = 512\nnoise = 1.0\n")).is_empty());
}

#[test]
fn record_history_sets_the_symbolizer_unless_the_user_did() {
    let s = spec("[job]\ndevice = \"cuda\"\n[memory]\nrecord_history = true\n");
    let f = Facts {
        cuda_devices: 1,
        cuda_total_bytes: Some(1 << 30),
        ..facts()
    };
    let p = Plan::resolve(&s, &fresh(), &f).unwrap();
    assert!(p.env.contains(&("TORCH_SYMBOLIZE_MODE".into(), "dladdr".into())));
    let f = Facts {
        symbolize_mode: Some("fast".into()),
        ..f
    };
    assert!(Plan::resolve(&s, &fresh(), &f).unwrap().env.is_empty());
    // On the CPU there is no history to record.
    let p = Plan::resolve(&spec("[memory]\nrecord_history = true\n"), &fresh(), &facts()).unwrap();
    assert!(!p.record_history && p.env.is_empty());
    assert!(
        p.notices[0].starts_with("memory.record_history is ignored"),
        "{:?}",
        p.notices
    );
}

#[test]
fn run_directories_are_never_overwritten_and_resume_needs_a_checkpoint() {
    let busy = Facts {
        run_dir_exists: true,
        run_dir_has_run: true,
        ..facts()
    };
    let e = Plan::resolve(&spec(""), &fresh(), &busy).unwrap_err();
    assert!(e.0.contains("already holds a run"), "{}", e.0);
    let resume = resuming();
    let e = Plan::resolve(&spec(""), &resume, &facts()).unwrap_err();
    assert!(e.0.contains("does not exist"), "{}", e.0);
    let e = Plan::resolve(&spec(""), &resume, &busy).unwrap_err();
    assert!(e.0.contains("no checkpoint"), "{}", e.0);
    let others = Facts {
        run_dir_exists: true,
        run_dir_outputs: vec!["summary.json", "report.html"],
        ..facts()
    };
    let e = Plan::resolve(&spec(""), &fresh(), &others).unwrap_err();
    assert!(
        e.0.contains("holds summary.json, report.html, which a run writes"),
        "{}",
        e.0
    );
    let file = Facts {
        run_dir_exists: true,
        run_dir_is_file: true,
        ..facts()
    };
    let e = Plan::resolve(&spec(""), &fresh(), &file).unwrap_err();
    assert!(e.0.contains("is a file, not a directory"), "{}", e.0);
    let saved = Facts {
        run_dir_has_checkpoint: true,
        ..busy.clone()
    };
    let e = Plan::resolve(&spec(""), &fresh(), &saved).unwrap_err();
    assert!(e.0.contains("pass --resume to continue it"), "{}", e.0);
    let e = Plan::resolve(&spec(""), &fresh(), &busy).unwrap_err();
    assert!(
        e.0.contains("stopped before its first checkpoint, so there is nothing to resume"),
        "{}",
        e.0
    );
    assert_eq!(
        resume_hint(Path::new("runs/x/checkpoints/step-000000004")),
        "; --resume takes the run directory, runs/x, and resumes its newest checkpoint"
    );
    assert_eq!(
        resume_hint(Path::new("runs/x/checkpoints")),
        "; --resume takes the run directory, runs/x, and resumes its newest checkpoint"
    );
    assert_eq!(resume_hint(Path::new("runs/x")), "");
}

fn resumable(state: TrainState) -> Facts {
    Facts {
        run_dir_exists: true,
        run_dir_has_run: true,
        checkpoint: Some(("runs/x/checkpoints/step-000000004".into(), state)),
        ..facts()
    }
}

#[test]
fn a_resume_with_other_data_or_seed_is_said_and_speed_keys_are_not() {
    let resume = resuming();
    let s = spec("[train]\nepochs = 2\n[data]\nsource = \"synthetic\"\nsamples = 64\n");
    let shape = BatchShape {
        micro_batch: 32,
        accumulation_steps: 1,
    };
    let was = |text: &str| resumed_from(text, fresh_state(shape));
    let same = Plan::resolve(
        &s,
        &resume,
        &was("[train]\nepochs = 2\n[data]\nsource = \"synthetic\"\nsamples = 64\nworkers = 3\n"),
    )
    .unwrap();
    assert!(same.notices.is_empty(), "{:?}", same.notices);
    let other = Plan::resolve(
        &s,
        &resume,
        &was("[job]\nseed = 5\n[train]\nepochs = 2\n[data]\nsource = \"synthetic\"\nsamples = 80\n"),
    )
    .unwrap();
    assert_eq!(other.notices.len(), 1, "{:?}", other.notices);
    // The same file named absolutely, and another augmentation: the same split and order.
    let file =
        |path: &str, extra: &str| format!("[train]\nepochs = 2\n[data]\nsource = \"npz\"\npath = \"{path}\"\n{extra}");
    let absolute = std::path::absolute("data/d.npz").unwrap().display().to_string();
    let p = Plan::resolve(
        &spec(&file(&absolute, "[data.augment]\nhorizontal_flip = true\n")),
        &resume,
        &was(&file("data/d.npz", "")),
    )
    .unwrap();
    assert!(p.notices.is_empty(), "{:?}", p.notices);
    let p = Plan::resolve(&spec(&file("data/e.npz", "")), &resume, &was(&file("data/d.npz", ""))).unwrap();
    assert!(
        p.notices[0].starts_with("resuming with data.path (the run had \"data/d.npz\") changed"),
        "{:?}",
        p.notices
    );
    assert!(
        other.notices[0].starts_with("resuming with job.seed (the run had 5), data.samples (the run had 80) changed"),
        "{}",
        other.notices[0]
    );
}

#[test]
fn a_resume_with_another_seq_len_says_the_windows_moved() {
    let shape = BatchShape {
        micro_batch: 32,
        accumulation_steps: 1,
    };
    let tokens =
        |n: i64| format!("[data]\nsource = \"tokens\"\npath = \"t.bin\"\ntoken_dtype = \"uint16\"\nseq_len = {n}\n");
    let was = resumed_from(&tokens(16), fresh_state(shape));
    let p = Plan::resolve(&spec(&tokens(8)), &resuming(), &was).unwrap();
    assert!(
        p.notices
            .first()
            .is_some_and(|n| n.starts_with("resuming with data.seq_len (the run had 16) changed")),
        "{:?}",
        p.notices
    );
    let same = Plan::resolve(&spec(&tokens(16)), &resuming(), &was).unwrap();
    assert!(same.notices.is_empty(), "{:?}", same.notices);
}

#[test]
fn a_resume_that_monitors_another_metric_drops_the_saved_value() {
    let resume = resuming();
    let mut state = fresh_state(BatchShape {
        micro_batch: 32,
        accumulation_steps: 1,
    });
    state.monitored = Some(2.5);
    let was = |text: &str| resumed_from(text, state.clone());
    let by_loss = "[train]\nepochs = 2\n";
    let by_acc = "[train]\nepochs = 2\n[checkpoint]\nmonitor = \"val_acc\"\n";
    let p = Plan::resolve(&spec(by_acc), &resume, &was(by_loss)).unwrap();
    assert_eq!(p.start.monitored, None);
    let p = Plan::resolve(&spec(by_loss), &resume, &was(by_loss)).unwrap();
    assert_eq!(p.start.monitored, Some(2.5));
}

#[test]
fn resume_reconciles_the_checkpoint_with_the_spec() {
    let shape = BatchShape {
        micro_batch: 8,
        accumulation_steps: 4,
    };
    let resume = resuming();
    let mut mid = fresh_state(shape);
    mid.groups_done = 3;
    mid.micro_batch = 4;
    mid.accumulation_steps = 8;
    // Same effective batch: the backed-off micro-batch is kept.
    let s = spec("[train]\nbatch_size = 8\naccumulation_steps = 4\nepochs = 2\n");
    let p = Plan::resolve(&s, &resume, &resumable(mid.clone())).unwrap();
    assert_eq!((p.start.micro_batch, p.start.accumulation_steps), (4, 8));
    // A smaller micro-batch asked for now is honoured.
    let s2 = spec("[train]\nbatch_size = 2\naccumulation_steps = 16\nepochs = 2\n");
    let p = Plan::resolve(&s2, &resume, &resumable(mid.clone())).unwrap();
    assert_eq!((p.start.micro_batch, p.start.accumulation_steps), (2, 16));
    // A different effective batch mid-epoch would change the groups: refused.
    let s3 = spec("[train]\nbatch_size = 8\naccumulation_steps = 1\nepochs = 2\n");
    let e = Plan::resolve(&s3, &resume, &resumable(mid.clone())).unwrap_err();
    assert!(e.0.contains("mid-epoch with an effective batch of 32"), "{}", e.0);
    // ... but taken at an epoch boundary.
    let mut boundary = mid;
    boundary.groups_done = 0;
    boundary.epoch = 1;
    let p = Plan::resolve(&s3, &resume, &resumable(boundary)).unwrap();
    assert_eq!((p.start.micro_batch, p.start.effective_batch), (8, 8));
}

#[test]
fn a_fallen_back_run_resumes_on_the_cpu_and_a_finished_one_does_nothing() {
    let shape = BatchShape {
        micro_batch: 8,
        accumulation_steps: 1,
    };
    let mut st = fresh_state(shape);
    st.levers = vec!["cpu".into()];
    st.epoch = 1;
    let f = Facts {
        cuda_devices: 1,
        cuda_total_bytes: Some(1 << 30),
        ..resumable(st)
    };
    let resume = resuming();
    let s = spec("[job]\ndevice = \"cuda\"\n[train]\nbatch_size = 8\nepochs = 1\n");
    let p = Plan::resolve(&s, &resume, &f).unwrap();
    assert_eq!(p.device, Place::Cpu);
    assert!(p.nothing_to_do.unwrap().contains("--set train.epochs=2"));
}
