//! `memtrain run`: turns a spec into a plan (run directory, device, memory cap, allocator
//! settings), builds the trainer, and writes the records the run leaves behind.
use std::fs;
use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use tch::{nn, Device, Tensor};

use crate::alloc_conf;
use crate::app::load_spec;
use crate::checkpoint::{Store, TrainState};
use crate::cli::RunArgs;
use crate::exit::{OomExit, UsageError};
use crate::memory::{self, CachePolicy, Place};
use crate::metrics::{write_json_atomic, Metrics};
use crate::model;
use crate::oom::{self, BatchShape, Policy, StepError};
use crate::optim::{Hyper, LrSchedule, Optimizer};
use crate::progress::Progress;
use crate::report::human_bytes;
use crate::signals::StopFlag;
use crate::spec::{self, OptimizerKind, Precision, Spec};
use crate::train::{split_params, Status, Trainer};
use crate::{shim, sysmem};

/// The memory limit in force for the run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Cap {
    /// "cuda_fraction" (allocator per-process fraction) or "rlimit_data" (CPU data segment).
    pub kind: &'static str,
    pub bytes: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fraction: Option<f64>,
    /// CPU: the process's RSS when the cap was set; the cap limits growth above it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub baseline_rss_bytes: Option<u64>,
}

pub fn run(args: &RunArgs, quiet: bool) -> Result<()> {
    let t_start = Instant::now();
    oom::install_hook();
    let loaded = load_spec(&args.spec)?;
    let spec = loaded.spec;
    let run_dir = match (&args.resume, &args.out) {
        (Some(Some(d)), _) => d.clone(),
        (_, Some(out)) => out.clone(),
        _ => spec.job.output_dir.join(&spec.job.name),
    };
    let resuming = args.resume.is_some();
    prepare_run_dir(&run_dir, resuming)?;
    if spec.job.threads > 0 {
        tch::set_num_threads(spec.job.threads as i32);
    }

    // Allocator settings are read at the first CUDA allocation: settle them before any CUDA work.
    let cuda_fraction = cuda_fraction(&spec)?;
    let applied = alloc_conf::apply(&alloc_conf::from_spec(&spec.memory.allocator, cuda_fraction));
    for c in &applied.conflicts {
        tracing::warn!(
            "allocator setting {}: the environment says {}, the spec says {}; using the spec's",
            c.key,
            c.environment,
            c.spec
        );
    }
    let device = resolve_device(&spec)?;
    let cap = apply_cap(&spec, device, cuda_fraction)?;
    if spec.memory.record_history {
        if let Device::Cuda(_) = device {
            shim::record_memory_history(true, 100_000).context("starting allocator history recording")?;
        } else {
            tracing::info!("memory.record_history applies to CUDA only; ignored on the CPU");
        }
    }

    let spec_toml = spec::to_toml(&spec);

    tch::manual_seed(spec.job.seed);
    let mut vs = nn::VarStore::new(device);
    let built = setup_step("building the model", || model::build(&vs.root(), &spec.model))??;
    if spec.train.precision == Precision::Bf16 {
        vs.bfloat16();
    }
    if let Some(path) = &spec.model.init_from {
        init_from(&vs, path)?;
    }
    // A data file that does not fit the model is bad input, like a bad spec: exit 2.
    let data = crate::data::load(&spec.data, &built.input_shape, built.num_classes, spec.job.seed)
        .map_err(|e| UsageError(format!("{e:#}")))?;

    let t = &spec.train;
    let (weights, arch) = split_params(&vs);
    let hyper = Hyper::from_train(t);
    let mut opt = setup_step("creating the optimizer state", || Optimizer::new(hyper, weights))?;
    let mut arch_opt = built.has_arch.then(|| {
        let o = spec.model.darts.clone().unwrap_or_default();
        // DARTS trains α with Adam(β = (0.5, 0.999)), weight decay on α.
        let h = Hyper {
            kind: OptimizerKind::Adam,
            momentum: 0.0,
            nesterov: false,
            weight_decay: o.arch_weight_decay,
            betas: [0.5, 0.999],
            eps: 1e-8,
        };
        Optimizer::new(h, arch)
    });
    let configured = BatchShape {
        micro_batch: t.batch_size,
        accumulation_steps: t.accumulation_steps,
    };
    let effective = configured.effective();
    let steps_per_epoch = (data.train.len() + effective - 1) / effective;
    let sched = LrSchedule::from_train(t, steps_per_epoch * t.epochs, steps_per_epoch);

    let store = Store::new(
        &run_dir,
        spec.checkpoint.keep_last as usize,
        spec.checkpoint.keep_best,
        spec.checkpoint.monitor.maximize(),
    );
    let mut state = fresh_state(configured);
    let mut device = device;
    if resuming {
        let latest = store.latest().ok_or_else(|| {
            UsageError(format!(
                "--resume: {} has no checkpoint to resume from (looked in {}/checkpoints)",
                run_dir.display(),
                run_dir.display()
            ))
        })?;
        let ck = Store::load(&latest)?;
        if ck.state.on_cpu_fallback && device != Device::Cpu {
            vs.set_device(Device::Cpu);
            device = Device::Cpu;
            tracing::warn!("the checkpoint was taken after a fallback to the CPU; resuming on the CPU");
        }
        copy_into(&vs, &ck.model, "checkpoint model")?;
        let pick = |prefix: &str| -> Vec<(String, Tensor)> {
            ck.optimizer
                .iter()
                .filter_map(|(n, t)| n.strip_prefix(prefix).map(|s| (s.to_owned(), t.shallow_clone())))
                .collect()
        };
        opt.load_state(&pick("weight/"), ck.state.weight_steps)?;
        if let Some(a) = &mut arch_opt {
            a.load_state(&pick("arch/"), ck.state.arch_steps)?;
        }
        if device != vs.device() {
            opt.to_device(vs.device());
        }
        state = ck.state;
        if state.effective_batch > 0 && state.effective_batch != configured.effective() {
            if state.groups_done > 0 {
                return Err(UsageError(format!(
                    "the checkpoint stopped mid-epoch with an effective batch of {}, but the spec now asks for {} ({} x {}); keep {} to resume, or resume from an end-of-epoch checkpoint",
                    state.effective_batch,
                    configured.effective(),
                    t.batch_size,
                    t.accumulation_steps,
                    state.effective_batch
                ))
                .into());
            }
            state.effective_batch = configured.effective();
            state.micro_batch = configured.micro_batch;
            state.accumulation_steps = configured.accumulation_steps;
        } else if t.batch_size < state.micro_batch {
            // A smaller micro-batch asked for at resume (e.g. after an OOM exit) is honoured.
            state.micro_batch = t.batch_size;
            state.accumulation_steps = (configured.effective() + t.batch_size - 1) / t.batch_size;
        }
        if state.epoch >= t.epochs {
            // Nothing to train; leave the finished run's records exactly as they are.
            eprintln!(
                "{} already finished {} epoch(s), which train.epochs ({}) does not exceed; raise it (e.g. --set train.epochs={}) to train further",
                run_dir.display(),
                state.epoch,
                t.epochs,
                state.epoch + 1
            );
            return Ok(());
        }
        tracing::info!(
            "resuming from {} (epoch {}, step {}, micro-batch {})",
            latest.display(),
            state.epoch + 1,
            state.global_step,
            state.micro_batch
        );
    }
    let shape = BatchShape {
        micro_batch: state.micro_batch,
        accumulation_steps: state.accumulation_steps,
    };

    // Only now, with model and data known to be good, does the run directory appear.
    fs::create_dir_all(&run_dir).with_context(|| format!("creating run directory {}", run_dir.display()))?;
    write_atomic(&run_dir.join("config.resolved.toml"), spec_toml.as_bytes())?;
    let m = &spec.memory;
    let mut trainer = Trainer {
        spec: spec.clone(),
        spec_toml,
        run_dir: run_dir.clone(),
        vs,
        net: built.net,
        device,
        data,
        opt,
        arch_opt,
        sched,
        shape,
        configured,
        policy: Policy::new(m.on_oom.clone(), m.min_batch_size),
        cache: CachePolicy::new(m.cache_clear_every, m.auto_clear_threshold.0, m.sync_every as u64),
        metrics: Metrics::open(&run_dir.join("metrics.jsonl"))?,
        progress: Progress::new(spec.log.progress, quiet),
        store,
        state,
        stop: StopFlag::install()?,
        ooms: Default::default(),
        oom_reported: run_dir.join("oom").exists(),
        last: None,
        samples_trained: 0,
        train_seconds: 0.0,
        checkpoint_spikes: vec![],
        cap: cap.clone(),
        alloc_conf: applied.conf.clone(),
        t_start,
        peaks: Default::default(),
        preflight_pending: spec.memory.preflight,
        val_order: None,
    };
    trainer.metrics.record(
        "start",
        json!({"job": spec.job.name, "device": trainer.device_name(), "resumed": resuming,
               "micro_batch": shape.micro_batch, "accumulation_steps": shape.accumulation_steps,
               "effective_batch": effective, "cap": cap, "allocator_conf": applied.conf,
               "allocator_conflicts": applied.conflicts, "train_samples": trainer.data.train.len(),
               "val_samples": trainer.data.val.len(), "libtorch": shim::versions().libtorch}),
    )?;
    let p = &trainer.progress;
    p.println(&format!(
        "memtrain: job {} on {}; run directory {}",
        spec.job.name,
        trainer.device_name(),
        run_dir.display()
    ));
    p.println(&format!(
        "Effective batch size: {effective} (micro-batch {} x {} accumulation steps); {} training / {} validation samples",
        shape.micro_batch,
        shape.accumulation_steps,
        trainer.data.train.len(),
        trainer.data.val.len()
    ));
    p.println(&match &cap {
        Some(c) if c.kind == "cuda_fraction" => format!(
            "Memory cap: {} of GPU memory (per-process fraction {:.4})",
            human_bytes(c.bytes),
            c.fraction.unwrap_or(1.0)
        ),
        Some(c) => format!(
            "Memory cap: {} of process data memory (RLIMIT_DATA above the baseline)",
            human_bytes(c.bytes)
        ),
        None => "Memory cap: none".into(),
    });
    if let Some(conf) = &applied.conf {
        p.println(&format!("Allocator: {conf}"));
    }
    let status = trainer.train()?;
    if status == Status::Completed {
        if let Some(r) = &trainer.last {
            let val = r
                .val_acc
                .map(|a| format!(", val acc {:.1}%", a * 100.0))
                .unwrap_or_default();
            trainer.progress.println(&format!(
                "done: {} epochs, final train loss {:.4}{val}; summary in {}",
                r.epoch,
                r.train_loss,
                run_dir.join("summary.json").display()
            ));
        }
    }
    Ok(())
}

fn fresh_state(shape: BatchShape) -> TrainState {
    TrainState {
        epoch: 0,
        groups_done: 0,
        global_step: 0,
        weight_steps: 0,
        arch_steps: 0,
        val_cursor: 0,
        micro_batch: shape.micro_batch,
        accumulation_steps: shape.accumulation_steps,
        effective_batch: shape.effective(),
        clean_steps: 0,
        epoch_loss_sum: 0.0,
        epoch_correct: 0,
        epoch_seen: 0,
        on_cpu_fallback: false,
        monitored: None,
        finished: false,
    }
}

/// A run directory that already holds a run is never overwritten silently.
fn prepare_run_dir(dir: &Path, resuming: bool) -> Result<()> {
    let has_run = dir.join("metrics.jsonl").exists() || dir.join("checkpoints").exists();
    if has_run && !resuming {
        return Err(UsageError(format!(
            "{} already holds a run; pass --resume to continue it, --out DIR to start a new run elsewhere, or remove the directory",
            dir.display()
        ))
        .into());
    }
    if resuming && !dir.exists() {
        return Err(UsageError(format!("--resume: run directory {} does not exist", dir.display())).into());
    }
    Ok(())
}

/// Per-process fraction for the CUDA allocator from memory.fraction, or memory.limit ÷ the
/// GPU's total (read through NVML, which does not start CUDA).
fn cuda_fraction(spec: &Spec) -> Result<Option<f64>> {
    if spec.job.device == spec::Device::Cpu {
        return Ok(None);
    }
    if let Some(f) = spec.memory.fraction {
        return Ok(Some(f));
    }
    let Some(limit) = spec.memory.limit else {
        return Ok(None);
    };
    let index = match spec.job.device {
        spec::Device::Cuda(i) => i,
        _ => 0,
    };
    let total = nvml_total(index);
    Ok(total.map(|t| (limit.0 as f64 / t as f64).min(1.0)))
}

fn nvml_total(cuda_index: usize) -> Option<u64> {
    // CUDA_VISIBLE_DEVICES renumbers devices; NVML does not.
    let physical = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|v| v.split(',').nth(cuda_index).and_then(|s| s.trim().parse::<u32>().ok()))
        .unwrap_or(cuda_index as u32);
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let d = nvml.device_by_index(physical).ok()?;
    d.memory_info().ok().map(|m| m.total)
}

fn resolve_device(spec: &Spec) -> Result<Device> {
    match spec.job.device {
        spec::Device::Cpu => Ok(Device::Cpu),
        spec::Device::Auto => Ok(if shim::accelerator_available() {
            Device::Cuda(0)
        } else {
            Device::Cpu
        }),
        spec::Device::Cuda(i) => {
            let n = if shim::accelerator_available() {
                shim::device_count()?
            } else {
                0
            };
            if i < n {
                Ok(Device::Cuda(i))
            } else {
                Err(UsageError(format!(
                    "job.device is cuda:{i} but libtorch sees {n} CUDA device(s) (see `memtrain info`); use device = \"auto\" or \"cpu\""
                ))
                .into())
            }
        }
    }
}

fn apply_cap(spec: &Spec, device: Device, fraction: Option<f64>) -> Result<Option<Cap>> {
    let m = &spec.memory;
    match device {
        Device::Cuda(i) => {
            let (_, total) = shim::memory_info(i)?.unwrap_or((0, 0));
            if m.limit.is_some() && fraction.is_none() {
                return Err(UsageError(
                    "memory.limit on CUDA needs the GPU's total memory from NVML before CUDA starts, and NVML is not available; set memory.fraction instead".into(),
                )
                .into());
            }
            Ok(fraction.map(|f| Cap {
                kind: "cuda_fraction",
                bytes: (f * total as f64) as u64,
                fraction: Some(f),
                baseline_rss_bytes: None,
            }))
        }
        _ => {
            let bytes = match (m.limit, m.fraction) {
                (Some(l), _) => l.0,
                (None, Some(f)) => (f * sysmem::host_memory()?.ram_total_bytes as f64) as u64,
                (None, None) => return Ok(None),
            };
            sysmem::tighten_malloc();
            let baseline = sysmem::data_in_use();
            sysmem::set_data_limit(baseline + bytes).context("setting the CPU memory cap")?;
            Ok(Some(Cap {
                kind: "rlimit_data",
                bytes,
                fraction: m.fraction,
                baseline_rss_bytes: Some(sysmem::rss().0),
            }))
        }
    }
}

/// Runs set-up work that allocates (building the model), so an OOM there ends with exit 3
/// and a clear message instead of a panic.
fn setup_step<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    oom::guarded(f).map_err(|e| match e {
        StepError::Oom { message, .. } => OomExit(format!(
            "out of memory while {what}: {message}; the model does not fit under the cap"
        ))
        .into(),
        StepError::Other(m) => anyhow::anyhow!("{what} failed: {m}"),
    })
}

/// Copies named tensors into the VarStore, insisting that names and shapes match exactly.
fn copy_into(vs: &nn::VarStore, tensors: &[(String, Tensor)], what: &str) -> Result<()> {
    let vars = vs.variables();
    let mut missing: Vec<&str> = vars
        .keys()
        .map(String::as_str)
        .filter(|k| !tensors.iter().any(|(n, _)| n == k))
        .collect();
    missing.sort();
    let mut unexpected = vec![];
    let mut misshaped = vec![];
    for (name, t) in tensors {
        match vars.get(name) {
            None => unexpected.push(name.as_str()),
            Some(v) if v.size() != t.size() => {
                misshaped.push(format!("{name}: file {:?}, model {:?}", t.size(), v.size()))
            }
            Some(_) => {}
        }
    }
    unexpected.sort();
    misshaped.sort();
    if !missing.is_empty() || !unexpected.is_empty() || !misshaped.is_empty() {
        let mut msg = format!("{what} does not match the model:");
        if !missing.is_empty() {
            msg += &format!("\n  missing (in the model, not in the file): {}", missing.join(", "));
        }
        if !unexpected.is_empty() {
            msg += &format!(
                "\n  unexpected (in the file, not in the model): {}",
                unexpected.join(", ")
            );
        }
        if !misshaped.is_empty() {
            msg += &format!("\n  mis-shaped: {}", misshaped.join("; "));
        }
        return Err(UsageError(msg).into());
    }
    tch::no_grad(|| {
        for (name, t) in tensors {
            let v = &vars[name];
            v.shallow_clone().copy_(&t.to_device(v.device()).to_kind(v.kind()));
        }
    });
    Ok(())
}

fn init_from(vs: &nn::VarStore, path: &Path) -> Result<()> {
    let tensors = Tensor::read_safetensors(path).map_err(|e| {
        UsageError(format!(
            "model.init_from: cannot read {} as safetensors: {e}",
            path.display()
        ))
    })?;
    copy_into(vs, &tensors, &format!("model.init_from {}", path.display()))
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming {}", tmp.display()))
}

/// `oom/` at the first OOM of a run: what failed, where, with which allocator state.
pub fn write_oom_report(t: &Trainer, phase: &str, shape: &[i64], message: &str) -> Result<()> {
    let dir = t.run_dir.join("oom");
    fs::create_dir_all(&dir)?;
    let stats = match Place::of(t.device) {
        Place::Cuda(i) => shim::device_stats(i)
            .ok()
            .flatten()
            .map(|s| serde_json::to_value(s).unwrap_or_default()),
        Place::Cpu => None,
    };
    let mut snapshot = None;
    if let Device::Cuda(_) = t.device {
        match shim::memory_snapshot() {
            Ok(bytes) => {
                fs::write(dir.join("snapshot.pickle"), bytes)?;
                snapshot = Some("snapshot.pickle");
            }
            Err(e) => tracing::warn!("no allocator snapshot: {e:#}"),
        }
    }
    write_json_atomic(
        &dir.join("report.json"),
        &json!({
            "phase": phase, "epoch": t.state.epoch + 1, "step": t.state.global_step, "device": t.device_name(),
            "failing_batch_shape": shape, "micro_batch": t.shape.micro_batch,
            "accumulation_steps": t.shape.accumulation_steps, "error": message,
            "allocator_stats": stats, "memory": memory::sample(Place::of(t.device)),
            "cap": t.cap, "allocator_conf": t.alloc_conf, "cpu_data_limit_bytes": sysmem::data_limit(),
            "snapshot": snapshot, "record_history": t.spec.memory.record_history,
        }),
    )?;
    fs::write(dir.join("spec.toml"), &t.spec_toml)?;
    Ok(())
}

pub fn write_summary(t: &mut Trainer, status: Status) -> Result<()> {
    t.note_peaks();
    let code = match status {
        Status::Completed => crate::exit::OK,
        Status::Interrupted => crate::exit::INTERRUPTED,
        Status::Oom => crate::exit::OOM,
    };
    let wall = t.t_start.elapsed().as_secs_f64();
    let summary = json!({
        "status": status, "exit_code": code, "job": t.spec.job.name, "device": t.device_name(),
        "epochs_completed": t.state.epoch, "global_steps": t.state.global_step,
        "samples_trained": t.samples_trained, "wall_seconds": wall, "train_seconds": t.train_seconds,
        "samples_per_s": t.samples_trained as f64 / t.train_seconds.max(1e-9),
        "final": t.last,
        "batch": {
            "configured_micro_batch": t.configured.micro_batch,
            "configured_accumulation_steps": t.configured.accumulation_steps,
            "effective_batch": t.configured.effective(),
            "final_micro_batch": t.shape.micro_batch,
            "final_accumulation_steps": t.shape.accumulation_steps,
        },
        "memory": {
            "cap": t.cap, "allocator_conf": t.alloc_conf,
            "peak_allocated_bytes": t.peaks.allocated, "peak_reserved_bytes": t.peaks.reserved,
            "peak_rss_bytes": t.peaks.rss,
        },
        "cache": t.cache,
        "oom": t.ooms,
        "checkpoints": {
            "saved": t.checkpoint_spikes.len(),
            "max_spike_bytes": t.checkpoint_spikes.iter().max(),
        },
    });
    write_json_atomic(&t.run_dir.join("summary.json"), &summary)
}

/// Largest peaks seen over the run.
#[derive(Debug, Default, Clone, Copy)]
pub struct Peaks {
    pub allocated: Option<u64>,
    pub reserved: Option<u64>,
    pub rss: u64,
}

impl Trainer {
    pub fn note_peaks(&mut self) {
        let m = memory::sample(Place::of(self.device));
        let max = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(x), Some(y)) => Some(x.max(y)),
            (x, y) => x.or(y),
        };
        self.peaks.allocated = max(self.peaks.allocated, m.peak_allocated_bytes);
        self.peaks.reserved = max(self.peaks.reserved, m.peak_reserved_bytes);
        self.peaks.rss = self.peaks.rss.max(m.peak_rss_bytes);
    }
}
