//! The plan: everything `memtrain run` decides from the spec, the command line and the
//! environment, resolved before anything happens. `Facts::probe` reads the world (GPUs, host
//! memory, environment variables, the run directory and its latest checkpoint); `Plan::resolve`
//! is a pure function of spec, request and facts. Setting limits and environment variables,
//! loading and training all come after, from the plan.
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::alloc_conf::{self, Conflict, EnvSettings};
use crate::checkpoint::{Store, TrainState};
use crate::data::classes::DataClasses;
use crate::exit::UsageError;
pub use crate::memory::{Cap, Place};
use crate::oom::BatchShape;
use crate::parallel::World;
use crate::policy::levers::CpuFallback;
use crate::spec::{self, Spec};
use crate::{shim, sysmem};

pub mod graph;
pub use graph::GraphPlan;

/// What the command line asks of `run`.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub out: Option<PathBuf>,
    /// `--resume` (None: not resuming; Some(None): the run directory; Some(Some(d)): d).
    pub resume: Option<Option<PathBuf>>,
}

impl Request {
    pub fn resuming(&self) -> bool {
        self.resume.is_some()
    }

    /// The run directory: `--resume DIR`, else `--out`, else `<job.output_dir>/<job.name>`.
    pub fn run_dir(&self, spec: &Spec) -> PathBuf {
        match (&self.resume, &self.out) {
            (Some(Some(d)), _) => d.clone(),
            (_, Some(out)) => out.clone(),
            _ => spec.job.output_dir.join(&spec.job.name),
        }
    }
}

/// The environment as probed before planning.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    pub cuda_devices: usize,
    /// Total memory of the CUDA device the spec names (from the driver, without a context), when
    /// there is one.
    pub cuda_total_bytes: Option<u64>,
    pub host_ram_bytes: u64,
    pub alloc_env: EnvSettings,
    /// TORCH_SYMBOLIZE_MODE as the user set it.
    pub symbolize_mode: Option<String>,
    pub run_dir_exists: bool,
    /// The run directory's path names a file that is not a directory.
    pub run_dir_is_file: bool,
    pub run_dir_has_run: bool,
    /// Some checkpoint of the run directory exists (read or not).
    pub run_dir_has_checkpoint: bool,
    /// Files of `RUN_OUTPUTS` already in the run directory, which a new run would overwrite.
    pub run_dir_outputs: Vec<&'static str>,
    pub run_dir_has_oom_report: bool,
    /// The newest checkpoint of the run directory and its state (read only when resuming).
    pub checkpoint: Option<(PathBuf, TrainState)>,
    /// That checkpoint's resolved spec, where it reads.
    pub checkpoint_spec: Option<toml::Table>,
    /// This process's place in a data-parallel group, when it was launched as a rank.
    pub rank: Option<RankFacts>,
    /// The data's own classes, where it has them and they read (else loading says why).
    pub data_classes: Option<DataClasses>,
}

/// What a data-parallel rank knows of itself and its machine before it joins its group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankFacts {
    pub rank: usize,
    pub local_rank: usize,
    /// Ranks on this machine, which share its cores.
    pub local_size: usize,
    pub cores: usize,
    /// Where a rank other than 0 writes what nobody reads (its own directory, removed at the end).
    pub private_dir: PathBuf,
    /// The user set NCCL's blocking wait themselves.
    pub nccl_blocking_wait_set: bool,
}

impl RankFacts {
    pub fn of(w: &World) -> RankFacts {
        RankFacts {
            rank: w.rank,
            local_rank: w.local_rank,
            local_size: w.local_size,
            cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
            private_dir: std::env::temp_dir().join(format!("memtrain-rank{}-{}", w.rank, std::process::id())),
            nccl_blocking_wait_set: std::env::var_os(NCCL_BLOCKING_WAIT).is_some(),
        }
    }
}

/// NCCL's blocking wait: without it `WorkNCCL::wait` does not block and a lost peer ends the
/// process through the watchdog.
pub const NCCL_BLOCKING_WAIT: &str = "TORCH_NCCL_BLOCKING_WAIT";

impl Facts {
    pub fn probe(spec: &Spec, request: &Request, world: Option<&World>) -> anyhow::Result<Facts> {
        let run_dir = request.run_dir(spec);
        let cuda_devices = if spec.job.device != spec::Device::Cpu && shim::accelerator_available() {
            shim::device_count()?
        } else {
            0
        };
        let index = match spec.job.device {
            spec::Device::Cuda(i) => i,
            _ => 0,
        };
        let cuda_total_bytes = if index < cuda_devices {
            shim::cuda_device_facts(index)?.map(|f| f.total_bytes)
        } else {
            None
        };
        let checkpoint = match request.resuming() {
            true => match Store::latest_in(&run_dir) {
                Some(dir) => Some((dir.clone(), Store::load_state(&dir)?)),
                None => None,
            },
            false => None,
        };
        let checkpoint_spec = checkpoint.as_ref().and_then(|(dir, _)| Store::spec_of(dir));
        Ok(Facts {
            checkpoint_spec,
            cuda_devices,
            cuda_total_bytes,
            host_ram_bytes: sysmem::host_memory()?.ram_total_bytes,
            alloc_env: EnvSettings::from_env(),
            symbolize_mode: std::env::var("TORCH_SYMBOLIZE_MODE").ok().filter(|v| !v.is_empty()),
            run_dir_exists: run_dir.exists(),
            run_dir_is_file: run_dir.exists() && !run_dir.is_dir(),
            run_dir_has_run: run_dir.join("metrics.jsonl").exists() || run_dir.join("checkpoints").exists(),
            run_dir_has_checkpoint: Store::latest_in(&run_dir).is_some(),
            run_dir_outputs: RUN_OUTPUTS
                .iter()
                .copied()
                .filter(|f| run_dir.join(f).exists())
                .collect(),
            run_dir_has_oom_report: run_dir.join("oom").exists(),
            checkpoint,
            rank: world.map(RankFacts::of),
            data_classes: crate::data::classes::probe(&spec.data).ok().flatten(),
        })
    }
}

/// Allocator settings: the string in force and the environment variables to set for it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocPlan {
    pub conf: Option<String>,
    pub conflicts: Vec<Conflict>,
}

/// Where a command other than `run` works, and under what cap (`eval`).
#[derive(Debug, Clone)]
pub struct Placement {
    pub device: Place,
    pub cap: Option<Cap>,
    /// Variables to set before CUDA starts (the allocator's settings, the cap's fraction).
    pub env: Vec<(String, String)>,
}

impl Placement {
    /// The spec's device and cap, resolved as a run resolves them.
    pub fn resolve(spec: &Spec, facts: &Facts) -> Result<Placement, UsageError> {
        let device = resolve_device(spec.job.device, facts.cuda_devices)?;
        let cap = resolve_cap(spec, device, facts)?;
        let (_, env) = resolve_alloc(spec, cap.as_ref(), facts);
        Ok(Placement { device, cap, env })
    }
}

/// Where a resumed run picks up.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    pub checkpoint: PathBuf,
    /// The checkpoint's state reconciled with the spec (batch shape, effective batch).
    pub state: TrainState,
}

#[derive(Debug, Clone)]
pub struct Plan {
    /// The spec as resolved: defaults filled in, overrides applied.
    pub spec: Spec,
    /// The run's directory, where its records and checkpoints are.
    pub run_dir: PathBuf,
    /// Where this process writes: the run directory, or a data-parallel follower's private one.
    pub writes_to: PathBuf,
    /// This process's device (a data-parallel rank's own GPU).
    pub device: Place,
    pub cap: Option<Cap>,
    /// What the run may use of the device: the cap, else the CUDA device's total (None on the
    /// CPU).
    pub device_budget: Option<u64>,
    pub alloc: AllocPlan,
    /// Variables to set before CUDA starts (allocator settings, symbolizer).
    pub env: Vec<(String, String)>,
    /// libtorch CPU threads; None keeps libtorch's default. Data-parallel ranks split the
    /// machine's cores unless the spec sets them.
    pub threads: Option<i32>,
    pub record_history: bool,
    /// The spec's batch shape (its product is the effective batch, which never changes).
    pub configured: BatchShape,
    /// The state training starts from: fresh, or the reconciled checkpoint's.
    pub start: TrainState,
    pub resume: Option<Resume>,
    /// `memory.on_oom` lists "offload": a resume whose checkpoint does not fit beside the
    /// optimizer state on the device moves the state to the host before reading it again.
    pub offload_on_oom: bool,
    /// An earlier session already wrote `oom/`.
    pub oom_reported: bool,
    /// Set when a resumed run has nothing left to train; `run` says so and stops.
    pub nothing_to_do: Option<String>,
    /// Whether steps are captured as CUDA graphs, or why not.
    pub graph: GraphPlan,
    /// What `run` says before it starts and goes on: settings of the spec this run cannot honour
    /// where it runs, a resume whose data differs from its run's, each with why.
    pub notices: Vec<String>,
}

impl Plan {
    pub fn resolve(spec: &Spec, request: &Request, facts: &Facts) -> Result<Plan, UsageError> {
        let run_dir = request.run_dir(spec);
        check_run_dir(&run_dir, request.resuming(), facts)?;
        let configured = BatchShape {
            micro_batch: spec.train.batch_size,
            accumulation_steps: spec.train.accumulation_steps,
        };
        let mut device = resolve_device(spec.job.device, facts.cuda_devices)?;
        let Resumed {
            start,
            resume,
            nothing_to_do,
            mut notices,
        } = resolve_resume(spec, request, facts, &run_dir, configured)?;
        if start.levers.iter().any(|l| l == CpuFallback::ABOUT.name) {
            // The run fell back to the CPU before this checkpoint; it continues there.
            device = Place::Cpu;
        }
        let cap = resolve_cap(spec, device, facts)?;
        let (alloc, mut env) = resolve_alloc(spec, cap.as_ref(), facts);
        let record_history = spec.memory.record_history && matches!(device, Place::Cuda(_));
        notices.extend(cuda_only_on_cpu(spec, record_history));
        notices.extend(unread_data_keys(&spec.data));
        notices.extend(
            facts
                .data_classes
                .as_ref()
                .and_then(|c| crate::model::class_notice(&spec.model, c, &spec.data)),
        );
        if record_history && facts.symbolize_mode.is_none() {
            // 2.11 symbolizes recorded stacks by forking addr2line; without binutils the forked
            // child carries on as a second memtrain holding a CUDA context. dladdr stays in-process.
            env.push(("TORCH_SYMBOLIZE_MODE".to_owned(), "dladdr".to_owned()));
        }
        if let Some(r) = &facts.rank {
            // Each rank on its own GPU: NCCL refuses two ranks on one.
            device = rank_device(device, r.local_rank);
            if let Some((k, v)) = nccl_env(device, r.nccl_blocking_wait_set) {
                env.push((k.to_owned(), v.to_owned()));
            }
        }
        let writes_to = match &facts.rank {
            Some(r) if r.rank != 0 => r.private_dir.clone(),
            _ => run_dir.clone(),
        };
        let threads = match (&facts.rank, spec.job.threads) {
            (_, t) if t > 0 => Some(t as i32),
            (Some(r), _) => Some((r.cores / r.local_size.max(1)).max(1) as i32),
            (None, _) => None,
        };
        let graph = graph::resolve(spec, device, facts.rank.is_some())?;
        notices.extend(graph::cpu_notice(spec, device));
        let device_budget = match device {
            Place::Cpu => None,
            Place::Cuda(_) => cap.as_ref().map(|c| c.bytes).or(facts.cuda_total_bytes),
        };
        Ok(Plan {
            spec: spec.clone(),
            run_dir,
            writes_to,
            device,
            device_budget,
            cap,
            alloc,
            env,
            threads,
            record_history,
            configured,
            start,
            resume,
            offload_on_oom: spec.memory.on_oom.contains(&spec::OomAction::Offload),
            oom_reported: facts.run_dir_has_oom_report,
            nothing_to_do,
            graph,
            notices,
        })
    }
}

/// Where a run starts: fresh, or from its run directory's latest checkpoint.
struct Resumed {
    start: TrainState,
    resume: Option<Resume>,
    nothing_to_do: Option<String>,
    notices: Vec<String>,
}

fn resolve_resume(
    spec: &Spec,
    request: &Request,
    facts: &Facts,
    run_dir: &Path,
    configured: BatchShape,
) -> Result<Resumed, UsageError> {
    let mut r = Resumed {
        start: fresh_state(configured),
        resume: None,
        nothing_to_do: None,
        notices: vec![],
    };
    if !request.resuming() {
        return Ok(r);
    }
    let checkpoint;
    (checkpoint, r.start) = resumed_state(spec, facts, run_dir, configured)?;
    let start = &r.start;
    if start.epoch >= spec.train.epochs {
        r.nothing_to_do = Some(format!(
            "{} already finished {} epoch(s), which train.epochs ({}) does not exceed; raise it (e.g. --set train.epochs={}) to train further",
            run_dir.display(),
            start.epoch,
            spec.train.epochs,
            start.epoch + 1
        ));
    }
    r.resume = Some(Resume {
        checkpoint,
        state: start.clone(),
    });
    if let Some(was) = &facts.checkpoint_spec {
        r.notices.extend(data_changes(was, spec));
    }
    Ok(r)
}

/// The allocator settings in force and the environment variables that set them.
fn resolve_alloc(spec: &Spec, cap: Option<&Cap>, facts: &Facts) -> (AllocPlan, Vec<(String, String)>) {
    // backend:cudaMallocAsync takes the fraction only through the allocator call (`run`
    // makes it); in its configuration string the native allocator's key is ignored, and
    // libtorch warns that it is.
    let async_backend = facts
        .alloc_env
        .effective()
        .is_some_and(|c| c.replace(' ', "").contains("backend:cudaMallocAsync"));
    let fraction = cap
        .filter(|c| c.kind == "cuda_fraction" && !async_backend)
        .and_then(|c| c.fraction);
    let ours = alloc_conf::from_spec(&spec.memory.allocator, fraction);
    if ours.is_empty() {
        let alloc = AllocPlan {
            conf: facts.alloc_env.effective().map(str::to_owned),
            conflicts: vec![],
        };
        return (alloc, vec![]);
    }
    let (conf, conflicts) = alloc_conf::merge(facts.alloc_env.effective(), &ours);
    let env = vec![
        (alloc_conf::CUDA_VAR.to_owned(), conf.clone()),
        (alloc_conf::GENERIC_VAR.to_owned(), conf.clone()),
    ];
    let alloc = AllocPlan {
        conf: Some(conf),
        conflicts,
    };
    (alloc, env)
}

/// A data-parallel rank's device: `cuda:LOCAL_RANK` on GPUs, the CPU as planned.
fn rank_device(planned: Place, local_rank: usize) -> Place {
    match planned {
        Place::Cuda(_) => Place::Cuda(local_rank),
        Place::Cpu => Place::Cpu,
    }
}

/// NCCL's blocking wait on GPUs, unless the user chose; Gloo has no such switch.
fn nccl_env(device: Place, user_set: bool) -> Option<(&'static str, &'static str)> {
    match (device, user_set) {
        (Place::Cuda(_), false) => Some((NCCL_BLOCKING_WAIT, "1")),
        _ => None,
    }
}

/// The notice for a CUDA-only setting on a run that is not on CUDA.
fn cuda_only_on_cpu(spec: &Spec, record_history: bool) -> Option<String> {
    (spec.memory.record_history && !record_history).then(|| {
        "memory.record_history is ignored: it records the CUDA caching allocator's history, and this run is on the CPU"
            .to_owned()
    })
}

/// Synthetic-only data keys set for a file source: said by `run` (a plan notice) and `check`.
pub fn unread_data_keys(data: &spec::Data) -> Option<String> {
    let keys = data.unread_synthetic_keys();
    (!keys.is_empty()).then(|| {
        format!(
            "{} {} read only for synthetic data: this run reads every sample of data.path{}; remove {}",
            keys.join(" and "),
            if keys.len() == 1 { "is" } else { "are" },
            if data.val_path.is_some() {
                " and data.val_path"
            } else {
                ""
            },
            if keys.len() == 1 { "it" } else { "them" },
        )
    })
}

/// The notice for a resume whose seed or data keys differ from its checkpoint's run in a way
/// that moves samples between training and validation or reorders them. Keys that change how a
/// sample looks (augmentation, normalisation) or how fast batches come are not among them.
fn data_changes(was: &toml::Table, spec: &Spec) -> Option<String> {
    let now: toml::Table = spec::to_toml(spec).parse().ok()?;
    let get = |t: &toml::Table, table: &str, key: &str| t.get(table).and_then(|v| v.get(key)).cloned();
    let mut keys = vec![("job", "seed"), ("data", "source"), ("data", "val_fraction")];
    if spec.data.source == spec::DataSource::Synthetic {
        keys.push(("data", "samples"));
    }
    if spec.data.source.is_tokens() {
        // Other windows, or other ids in them.
        keys.extend([
            ("data", "seq_len"),
            ("data", "token_dtype"),
            ("data", "text_field"),
            ("data", "prompt_field"),
        ]);
    }
    let mut changed: Vec<String> = keys
        .into_iter()
        .filter(|(t, k)| get(was, t, k) != get(&now, t, k))
        .map(|(t, k)| format!("{t}.{k} (the run had {})", shown(get(was, t, k))))
        .collect();
    // The same file named another way (relative, absolute) is the same data.
    let place = |v: Option<toml::Value>| std::path::absolute(v?.as_str()?).ok();
    for k in ["path", "val_path"] {
        if place(get(was, "data", k)) != place(get(&now, "data", k)) {
            changed.push(format!("data.{k} (the run had {})", shown(get(was, "data", k))));
        }
    }
    (!changed.is_empty()).then(|| {
        format!(
            "resuming with {} changed: the data's split into training and validation, or its order, is not the run's \
             (the validation set may hold samples the run trained on); resume with the checkpoint's values (its spec.toml) to continue the same run",
            changed.join(", ")
        )
    })
}

fn shown(v: Option<toml::Value>) -> String {
    v.map_or("it unset".into(), |v| v.to_string())
}

/// The newest checkpoint and the state a resume starts from: the checkpoint's, reconciled with
/// the spec.
fn resumed_state(
    spec: &Spec,
    facts: &Facts,
    run_dir: &Path,
    configured: BatchShape,
) -> Result<(PathBuf, TrainState), UsageError> {
    let Some((checkpoint, state)) = &facts.checkpoint else {
        return Err(UsageError(format!(
            "--resume: {} has no checkpoint to resume from (looked in {}/checkpoints){}",
            run_dir.display(),
            run_dir.display(),
            resume_hint(run_dir)
        )));
    };
    let mut start = reconcile(state.clone(), configured, spec.train.batch_size)?;
    let monitored = facts.checkpoint_spec.as_ref().and_then(crate::checkpoint::monitor_in);
    if monitored.is_some_and(|m| m != spec.checkpoint.monitor) {
        // The saved value is of the other metric: a save before this run's first epoch ends
        // must not enter it as this metric's best.
        start.monitored = None;
    }
    Ok((checkpoint.clone(), start))
}

/// Where `--resume` named a checkpoint or the checkpoints folder rather than the run directory.
fn resume_hint(dir: &Path) -> String {
    let named = |p: &Path, n: &str| p.file_name().is_some_and(|f| f == n);
    let run = match dir.parent() {
        Some(p) if named(dir, "checkpoints") => Some(p),
        Some(p) if named(p, "checkpoints") => p.parent(),
        _ => None,
    };
    match run {
        Some(run) => format!(
            "; --resume takes the run directory, {}, and resumes its newest checkpoint",
            run.display()
        ),
        None => String::new(),
    }
}

/// What a run writes at the top of its directory besides `metrics.jsonl` and `checkpoints/`
/// (and `config.resolved.toml` and `classes.json`, which a run that stopped in its set-up may
/// leave alone).
const RUN_OUTPUTS: [&str; 5] = ["summary.json", "report.html", "oom", "snapshot.pickle", "tensorboard"];

/// A run directory that already holds a run, or files a run would write, is never overwritten
/// silently.
fn check_run_dir(dir: &Path, resuming: bool, facts: &Facts) -> Result<(), UsageError> {
    if facts.run_dir_is_file {
        return Err(UsageError(format!(
            "{} is a file, not a directory; give --out a directory (new or empty) for the run",
            dir.display()
        )));
    }
    if !facts.run_dir_has_run && !resuming && !facts.run_dir_outputs.is_empty() {
        return Err(UsageError(format!(
            "{} holds {}, which a run writes and would overwrite; move those files, or give --out another directory",
            dir.display(),
            facts.run_dir_outputs.join(", ")
        )));
    }
    if facts.run_dir_has_run && !resuming {
        return Err(UsageError(match facts.run_dir_has_checkpoint {
            true => format!(
                "{} already holds a run; pass --resume to continue it, --out DIR to start a new run elsewhere, or remove the directory",
                dir.display()
            ),
            false => format!(
                "{} already holds a run that stopped before its first checkpoint, so there is nothing to resume; remove the directory to start again, or give --out DIR",
                dir.display()
            ),
        }));
    }
    if resuming && !facts.run_dir_exists {
        return Err(UsageError(format!(
            "--resume: run directory {} does not exist{}",
            dir.display(),
            resume_hint(dir)
        )));
    }
    Ok(())
}

fn resolve_device(wanted: spec::Device, cuda_devices: usize) -> Result<Place, UsageError> {
    match wanted {
        spec::Device::Cpu => Ok(Place::Cpu),
        spec::Device::Auto if cuda_devices > 0 => Ok(Place::Cuda(0)),
        spec::Device::Auto => Ok(Place::Cpu),
        spec::Device::Cuda(i) if i < cuda_devices => Ok(Place::Cuda(i)),
        spec::Device::Cuda(i) => Err(UsageError(format!(
            "job.device is cuda:{i} but libtorch sees {cuda_devices} CUDA device(s) (see `memtrain info`); use device = \"auto\" or \"cpu\""
        ))),
    }
}

/// memory.limit / memory.fraction as a cap: on CUDA a per-process fraction of the total the CUDA
/// runtime reports for the device; on the CPU a cap on live tensor bytes (a fraction of RAM).
fn resolve_cap(spec: &Spec, device: Place, facts: &Facts) -> Result<Option<Cap>, UsageError> {
    let m = &spec.memory;
    match device {
        Place::Cuda(i) => {
            let Some(total) = facts.cuda_total_bytes else {
                return match (m.limit, m.fraction) {
                    (None, None) => Ok(None),
                    _ => Err(UsageError(format!(
                        "memory.limit/fraction on cuda:{i} needs the device's total memory, and the CUDA runtime did not report it"
                    ))),
                };
            };
            let fraction = match (m.fraction, m.limit) {
                (Some(f), _) => f,
                (None, Some(l)) => (l.0 as f64 / total as f64).min(1.0),
                (None, None) => return Ok(None),
            };
            Ok(Some(Cap {
                kind: "cuda_fraction".into(),
                bytes: (fraction * total as f64) as u64,
                fraction: Some(fraction),
            }))
        }
        Place::Cpu => {
            let bytes = match (m.limit, m.fraction) {
                (Some(l), _) => l.0,
                (None, Some(f)) => (f * facts.host_ram_bytes as f64) as u64,
                (None, None) => return Ok(None),
            };
            Ok(Some(Cap {
                kind: "cpu_tensor_bytes".into(),
                bytes,
                fraction: m.fraction,
            }))
        }
    }
}

pub fn fresh_state(shape: BatchShape) -> TrainState {
    TrainState {
        epoch: 0,
        groups_done: 0,
        global_step: 0,
        weight_steps: 0,
        arch: Default::default(),
        micro_batch: shape.micro_batch,
        accumulation_steps: shape.accumulation_steps,
        effective_batch: shape.effective(),
        clean_steps: 0,
        eval_micro_batch: None,
        eval_clean: 0,
        epoch_loss_sum: 0.0,
        epoch_correct: 0,
        epoch_seen: 0,
        epoch_tokens: 0,
        tokens_seen: 0,
        tokens_uncounted: false,
        levers: vec![],
        scaler: None,
        monitored: None,
        finished: false,
        unfrozen_at: None,
    }
}

/// A checkpoint's state against the spec now: a changed effective batch is taken at an epoch
/// boundary (refused mid-epoch, where it would change the groups), and a smaller micro-batch
/// asked for at resume (e.g. after an OOM exit) is honoured.
pub fn reconcile(mut state: TrainState, configured: BatchShape, batch_size: i64) -> Result<TrainState, UsageError> {
    if state.effective_batch > 0 && state.effective_batch != configured.effective() {
        if state.groups_done > 0 {
            return Err(UsageError(format!(
                "the checkpoint stopped mid-epoch with an effective batch of {}, but the spec now asks for {} ({} x {}); keep {} to resume, or resume from an end-of-epoch checkpoint",
                state.effective_batch,
                configured.effective(),
                configured.micro_batch,
                configured.accumulation_steps,
                state.effective_batch
            )));
        }
        state.effective_batch = configured.effective();
        state.micro_batch = configured.micro_batch;
        state.accumulation_steps = configured.accumulation_steps;
    } else if batch_size < state.micro_batch {
        state.micro_batch = batch_size;
        state.accumulation_steps = (configured.effective() + batch_size - 1) / batch_size;
    }
    Ok(state)
}

#[cfg(test)]
mod tests;
