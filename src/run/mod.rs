//! `memtrain run`: spec → plan → (limits, environment, loading) → trainer → records.
mod recompute;
mod recovery;
mod step;
mod trainer;

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use tch::{nn, Device, Tensor};

use crate::checkpoint::{NamedTensors, Store};
use crate::cli::RunArgs;
use crate::exit::{OomExit, UsageError};
use crate::human::human_bytes;
use crate::memory::CachePolicy;
use crate::model::{self, ARCH_PREFIX};
use crate::oom::{self, BatchShape, StepError};
use crate::optim::{Hyper, LrSchedule, Optimizer, Shard};
use crate::plan::{DevicePlan, Facts, Plan, Request};
use crate::progress::Progress;
use crate::records::{Event, Recorder, StartEvent, Status};
use crate::spec::{self, Precision};
use crate::{atomic, shim};

pub use recovery::{GrowBack, Outcome, Position, Recovery};
pub use step::{PrecisionStage, StepOutput, StepPipeline, Work};
pub use trainer::{LoopSettings, Model, Trainer};

pub fn run(args: &RunArgs, quiet: bool) -> Result<()> {
    let t_start = Instant::now();
    oom::install_hook();
    // Not called: with glibc's thresholds raised, `tests/models.rs`'s every-precision run of
    // the new presets produced a NaN loss (freed memory is reused instead of coming back as zero
    // pages; PyTorch's own bf16 CPU ResNet18 shows the same nondeterminism). Until the kernel
    // that reads uninitialised memory is found, `sysmem::warm_malloc_thresholds` stays unused.
    // Before anything is loaded, so every CPU tensor byte of the run is counted.
    shim::cpu_alloc_install().context("installing the counting CPU allocator")?;
    let world = crate::dist::World::from_env().map_err(|e| UsageError(format!("{e:#}")))?;
    // Ranks other than 0 print nothing unless something goes wrong.
    let quiet = quiet || world.as_ref().is_some_and(|w| w.rank != 0);
    let mut sets = args.spec.set.clone();
    match &world {
        Some(w) => sets.extend(rank_sets(&args.rank_set, w.rank)?),
        None if !args.rank_set.is_empty() => {
            return Err(UsageError(
                "--rank-set applies to data-parallel runs: add --nproc N (or launch with torchrun)".into(),
            )
            .into())
        }
        None => {}
    }
    let loaded = spec::load_args(&args.spec.file, &sets, &model::validate)?;
    let spec = loaded.spec;
    let request = Request {
        out: args.out.clone(),
        resume: args.resume.clone(),
    };
    let facts = Facts::probe(&spec, &request)?;
    let mut plan = Plan::resolve(&spec, &request, &facts)?;
    // Data-parallel: every rank has resolved its plan (and checked the run directory) before
    // rank 0 creates anything; ranks other than 0 write to a private directory that goes away.
    let mut private_dir = None;
    let dist = match world {
        Some(w) => {
            if plan.device != DevicePlan::Cpu && !shim::dist::backends().nccl {
                return Err(UsageError(format!(
                    "data-parallel training on {} needs NCCL, and this memtrain was built without NCCL's headers; set job.device = \"cpu\" to train on Gloo, or build with a CUDA toolkit (see README)",
                    device_name(plan.device.tch())
                ))
                .into());
            }
            let d = crate::dist::Dist::join(w, plan.device.tch())?;
            d.barrier()?;
            if d.rank() != 0 {
                let dir = std::env::temp_dir().join(format!("memtrain-rank{}-{}", d.rank(), std::process::id()));
                plan.run_dir = dir.clone();
                private_dir = Some(RemoveOnDrop(dir));
            }
            if plan.threads.is_none() {
                // The machine's cores split between this machine's ranks.
                let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
                plan.threads = Some((cores / d.world.local_size).max(1) as _);
            }
            Some(d)
        }
        None => None,
    };
    if let Some(msg) = &plan.nothing_to_do {
        // Nothing to train; leave the finished run's records exactly as they are.
        eprintln!("{msg}");
        return Ok(());
    }
    apply(&plan)?;

    let spec_toml = spec::to_toml(&spec);
    let device = plan.device.tch();
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
    let data = setup_step("loading the data", || {
        crate::data::load(&spec.data, &built.input_shape, built.num_classes, spec.job.seed)
    })?
    .map_err(|e| UsageError(format!("{e:#}")))?;

    let t = &spec.train;
    let (weights, arch) = split_params(&vs);
    // ZeRO stage 1: this rank keeps (and steps) only its share of the optimizer state.
    let shard = match &dist {
        Some(d) if t.shard_optimizer_state => {
            let numels: Vec<i64> = weights.iter().map(|(_, p)| p.numel() as i64).collect();
            Some(Shard::balanced(&numels, d.size(), d.rank()))
        }
        _ => None,
    };
    let mut opt = setup_step("creating the optimizer state", || {
        Optimizer::sharded(Hyper::from_train(t), weights, shard)
    })?;
    let mut extra = match model::extra_step(&spec.model) {
        Some(x) => Some((
            x,
            setup_step("creating the optimizer state", || Optimizer::new(x.hyper, arch))?,
        )),
        None => None,
    };
    let effective = plan.configured.effective();
    let steps_per_epoch = (data.train.len() + effective - 1) / effective;
    let sched = LrSchedule::from_train(t, steps_per_epoch * t.epochs, steps_per_epoch);

    let store = Store::new(
        &plan.run_dir,
        spec.checkpoint.keep_last as usize,
        spec.checkpoint.keep_best,
        spec.checkpoint.monitor.maximize(),
    );
    if let Some(r) = &plan.resume {
        let ck = setup_step("reading the checkpoint", || Store::load(&r.checkpoint))??;
        setup_step("restoring the checkpoint", || {
            copy_into(&vs, &ck.model, "checkpoint model")
        })??;
        let pick = |prefix: &str| -> NamedTensors {
            ck.optimizer
                .iter()
                .filter_map(|(n, t)| n.strip_prefix(prefix).map(|s| (s.to_owned(), t.shallow_clone())))
                .collect()
        };
        opt.load_state(&pick("weight/"), ck.state.weight_steps)?;
        for (name, t) in pick("rng/") {
            // A checkpoint from a CUDA run resumed on the CPU keeps only the CPU stream.
            let d = match name.as_str() {
                "cpu" => Device::Cpu,
                _ if device != Device::Cpu => device,
                _ => continue,
            };
            let bytes = Vec::<u8>::try_from(&t).context("reading a generator state from the checkpoint")?;
            shim::set_rng_state(d, &bytes).context("restoring the generator state")?;
        }
        if let Some((_, a)) = &mut extra {
            a.load_state(&pick("arch/"), ck.state.arch_steps)?;
        }
        tracing::info!(
            "resuming from {} (epoch {}, step {}, micro-batch {})",
            r.checkpoint.display(),
            r.state.epoch + 1,
            r.state.global_step,
            r.state.micro_batch
        );
    }
    if t.activation_checkpointing && built.net.chain().is_none() {
        tracing::warn!(
            "train.activation_checkpointing: the {} preset is not a sequence of blocks, so activation checkpointing does not apply; the run goes on without it",
            spec.model.preset
        );
    }
    let mut state = plan.start.clone();
    // A spec that asks for checkpointing turns it on; a resumed run keeps it on once a
    // "recompute" decision turned it on. fp16-mixed starts (or, switched on at a resume, takes
    // up) a loss scaler; other precisions drop it.
    state.activation_checkpointing |= t.activation_checkpointing;
    if t.precision.scales_loss() {
        state.scaler.get_or_insert_with(Default::default);
        if extra.is_some() {
            state.arch_scaler.get_or_insert_with(Default::default);
        }
    } else {
        state.scaler = None;
        state.arch_scaler = None;
    }
    let shape = BatchShape {
        micro_batch: state.micro_batch,
        accumulation_steps: state.accumulation_steps,
    };

    // Only now, with model and data known to be good, does the run directory appear.
    let run_dir = &plan.run_dir;
    fs::create_dir_all(run_dir).with_context(|| format!("creating run directory {}", run_dir.display()))?;
    atomic::write_atomic(&run_dir.join("config.resolved.toml"), spec_toml.as_bytes())?;
    let m = &spec.memory;
    let recovery = Recovery::new(
        m.on_oom.clone(),
        m.min_batch_size,
        m.grow_back_after,
        plan.configured,
        Position {
            shape,
            clean_steps: state.clean_steps,
            on_cpu_fallback: state.on_cpu_fallback,
            recompute: state.activation_checkpointing,
        },
        plan.device == DevicePlan::Cpu,
        built.net.chain().is_some(),
        plan.oom_reported,
    );
    let settings = LoopSettings {
        job: spec.job.name.clone(),
        epochs: t.epochs,
        seed: spec.job.seed,
        log_every: spec.log.every_steps,
        checkpoint_every: spec.checkpoint.every_epochs,
        monitor: spec.checkpoint.monitor,
        clear_on_epoch_end: m.clear_on_epoch_end,
        clear_after_checkpoint: m.clear_after_checkpoint,
        preflight: m.preflight,
        record_history: plan.record_history,
        max_steps: args.max_steps,
    };
    let pipeline = StepPipeline {
        device,
        precision: PrecisionStage { precision: t.precision },
        clip_norm: t.grad_clip_norm,
        recompute: state.activation_checkpointing && built.net.chain().is_some(),
    };
    let mut recorder = Recorder::open(run_dir, &spec_toml, spec.log.tensorboard)?;
    let train_samples = data.train.len();
    let val_samples = data.val.len();
    let setup = crate::memory::sample(crate::memory::Place::of(device));
    recorder.emit(&Event::Start(StartEvent {
        job: spec.job.name.clone(),
        step: state.global_step,
        device: device_name(device),
        resumed: plan.resume.is_some(),
        micro_batch: shape.micro_batch,
        accumulation_steps: shape.accumulation_steps,
        effective_batch: effective,
        cap: plan.cap.clone(),
        allocator_conf: plan.alloc.conf.clone(),
        allocator_conflicts: plan.alloc.conflicts.clone(),
        train_samples,
        val_samples,
        libtorch: shim::versions().libtorch,
        setup_peak_allocated_bytes: setup.peak_allocated_bytes,
        setup_peak_reserved_bytes: setup.peak_reserved_bytes,
    }))?;
    let progress = Progress::new(spec.log.progress, quiet);
    progress.println(&format!(
        "memtrain: job {} on {}; run directory {}",
        spec.job.name,
        device_name(device),
        run_dir.display()
    ));
    progress.println(&format!(
        "Effective batch size: {effective} (micro-batch {} x {} accumulation steps); {train_samples} training / {val_samples} validation samples",
        shape.micro_batch, shape.accumulation_steps,
    ));
    progress.println(&match &plan.cap {
        Some(c) if c.kind == "cuda_fraction" => format!(
            "Memory cap: {} of GPU memory (per-process fraction {:.4})",
            human_bytes(c.bytes),
            c.fraction.unwrap_or(1.0)
        ),
        Some(c) => format!("Memory cap: {} of CPU tensor memory", human_bytes(c.bytes)),
        None => "Memory cap: none".into(),
    });
    if let Some(conf) = &plan.alloc.conf {
        progress.println(&format!("Allocator: {conf}"));
    }
    if let Some(d) = &dist {
        // Rank 0's weights and buffers everywhere, as DDP does at start. (Optimizer state needs
        // none: fresh, or read from the same checkpoint by every rank.)
        let vars = vs.variables();
        let mut names: Vec<&String> = vars.keys().collect();
        names.sort();
        let all: Vec<&Tensor> = names.iter().map(|n| &vars[*n]).collect();
        d.broadcast(&all).context("sharing rank 0's model")?;
    }
    let mut dist = dist;
    if let Some(d) = &mut dist {
        let params: Vec<&Tensor> = opt.params().iter().map(|(_, t)| t).collect();
        d.attach(&params).context("creating the gradient Reducer")?;
    }
    let mut trainer = Trainer::new(
        settings,
        spec_toml,
        Model {
            vs,
            net: built.net,
            opt,
            extra,
            sched,
        },
        data,
        pipeline,
        recovery,
        CachePolicy::new(m.cache_clear_every, m.auto_clear_threshold.0, m.sync_every as u64),
        recorder,
        progress,
        store,
        state,
        plan.cap.clone(),
        plan.alloc.conf.clone(),
        t_start,
    )?;
    let follower = dist.as_ref().is_some_and(|d| d.rank() != 0);
    trainer.dist = dist;
    let result = trainer.train();
    drop(private_dir);
    if follower {
        return result.map(|_| ());
    }
    // Every run gets its report, interrupted and failed ones included.
    let report = crate::report::write(run_dir);
    match &report {
        Ok(r) => trainer.progress.println(&format!("report: {}", r.html.display())),
        Err(e) => tracing::warn!("could not write the report: {e:#}"),
    }
    let status = result?;
    if status == Status::StepLimit {
        trainer.progress.println(&format!(
            "stopped after {} optimizer steps (--max-steps); no checkpoint written",
            args.max_steps.unwrap_or_default()
        ));
    }
    if status == Status::Completed {
        if let Some(r) = trainer.last() {
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

/// Carries out the plan's side effects, in the order CUDA needs: environment variables (read
/// at the allocator's first use), threads, the CPU cap, allocator history.
fn apply(plan: &Plan) -> Result<()> {
    for (k, v) in &plan.env {
        // Edition 2021: safe. Called before libtorch starts threads that read the environment.
        std::env::set_var(k, v);
    }
    for c in &plan.alloc.conflicts {
        tracing::warn!(
            "allocator setting {}: the environment says {}, the spec says {}; using the spec's",
            c.key,
            c.environment,
            c.spec
        );
    }
    if let Some(n) = plan.threads {
        tch::set_num_threads(n);
    }
    if let (DevicePlan::Cpu, Some(cap)) = (plan.device, &plan.cap) {
        shim::cpu_alloc_set_cap(Some(cap.bytes));
    }
    if plan.record_history {
        shim::record_memory_history(true, 100_000).context("starting allocator history recording")?;
    }
    Ok(())
}

pub(crate) fn device_name(d: Device) -> String {
    match d {
        Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

/// Runs set-up work that allocates (building the model, loading data or a checkpoint), so an
/// OOM there ends with exit 3 and a message that names the sizes instead of a panic.
fn setup_step<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    oom::guarded(f).map_err(|e| match e {
        StepError::Oom { message, .. } => {
            let s = shim::cpu_alloc_stats();
            let cap = s
                .cap
                .map(|c| format!(" under the {} cap", human_bytes(c)))
                .unwrap_or_default();
            OomExit(format!(
                "out of memory while {what}: {message}; {} of tensors were allocated{cap}. Raise memory.limit/memory.fraction, or use a smaller model or data set",
                human_bytes(s.allocated)
            ))
            .into()
        }
        StepError::Other(m) | StepError::PeerLost(m) => anyhow::anyhow!("{what} failed: {m}"),
    })
}

/// Weight-optimizer parameters: every trainable variable that is not an architecture weight,
/// in name order so optimizer state lines up across runs.
pub fn split_params(vs: &nn::VarStore) -> (NamedTensors, NamedTensors) {
    let mut all: Vec<(String, Tensor)> = vs.variables().into_iter().filter(|(_, t)| t.requires_grad()).collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    all.into_iter().partition(|(n, _)| !n.starts_with(ARCH_PREFIX))
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
            msg += &format!("\n  missing (in the model, not in the file): {}", few(&missing, ", "));
        }
        if !unexpected.is_empty() {
            msg += &format!(
                "\n  unexpected (in the file, not in the model): {}",
                few(&unexpected, ", ")
            );
        }
        if !misshaped.is_empty() {
            msg += &format!("\n  mis-shaped: {}", few(&misshaped, "; "));
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

/// `--rank-set R:KEY=VALUE` entries that apply to `rank`, as `--set` values.
pub(crate) fn rank_sets(entries: &[String], rank: usize) -> Result<Vec<String>> {
    let mut out = vec![];
    for e in entries {
        let (r, set) = e
            .split_once(':')
            .and_then(|(r, set)| Some((r.trim().parse::<usize>().ok()?, set)))
            .ok_or_else(|| {
                UsageError(format!(
                    "--rank-set {e:?}: expected RANK:KEY=VALUE, e.g. 1:memory.limit=64MiB"
                ))
            })?;
        // Ranks must agree on everything that decides which collectives they run (optimizer,
        // sharding, batch, checkpoints); memory is what differs between devices.
        if !set.trim_start().starts_with("memory.") {
            return Err(UsageError(format!(
                "--rank-set {e:?}: only memory.* keys can differ between ranks (e.g. 1:memory.limit=64MiB); use --set for the others"
            ))
            .into());
        }
        if r == rank {
            out.push(set.to_owned());
        }
    }
    Ok(out)
}

/// A directory removed when the run ends (a follower rank's private run directory).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// The first few names of a list and how many more: a model has thousands of tensors, and a
/// renamed module would otherwise print all of them.
fn few<S: AsRef<str>>(names: &[S], sep: &str) -> String {
    const SHOWN: usize = 8;
    let mut s = names
        .iter()
        .take(SHOWN)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(sep);
    if names.len() > SHOWN {
        s += &format!("{sep}… and {} more ({} in all)", names.len() - SHOWN, names.len());
    }
    s
}

fn init_from(vs: &nn::VarStore, path: &Path) -> Result<()> {
    let what = format!("reading model.init_from {}", path.display());
    let tensors = setup_step(&what, || Tensor::read_safetensors(path))?.map_err(|e| -> anyhow::Error {
        let text = e.to_string();
        if oom::classify(&text).is_some() {
            let size = fs::metadata(path).map(|m| m.len()).unwrap_or(0);
            let cap = shim::cpu_alloc_stats().cap;
            OomExit(format!(
                "out of memory while {what} ({} on disk{}): {}; raise memory.limit/memory.fraction",
                human_bytes(size),
                cap.map(|c| format!(", cap {}", human_bytes(c))).unwrap_or_default(),
                crate::shim::first_line(&oom::short_message(&text))
            ))
            .into()
        } else {
            UsageError(format!(
                "model.init_from: cannot read {} as safetensors: {}",
                path.display(),
                crate::shim::first_line(&text)
            ))
            .into()
        }
    })?;
    let label = format!("model.init_from {}", path.display());
    setup_step(&what, || copy_into(vs, &tensors, &label))?
}

#[cfg(test)]
mod tests {
    use super::few;

    #[test]
    fn few_names_and_a_count_of_the_rest() {
        assert_eq!(few(&["a", "b"], ", "), "a, b");
        let many: Vec<String> = (0..11).map(|i| format!("n{i}")).collect();
        assert_eq!(
            few(&many, "; "),
            "n0; n1; n2; n3; n4; n5; n6; n7; … and 3 more (11 in all)"
        );
    }
}
