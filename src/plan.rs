//! The plan: everything `memtrain run` decides from the spec, the command line and the
//! environment, resolved before anything happens. `Facts::probe` reads the world (GPUs, host
//! memory, environment variables, the run directory and its latest checkpoint); `Plan::resolve`
//! is a pure function of spec, request and facts. Setting limits and environment variables,
//! loading and training all come after, from the plan.
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::alloc_conf::{self, Conflict, EnvSettings};
use crate::checkpoint::{Store, TrainState};
use crate::exit::UsageError;
pub use crate::memory::Cap;
use crate::oom::BatchShape;
use crate::spec::{self, Spec};
use crate::{shim, sysmem};

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
}

impl Facts {
    pub fn probe(spec: &Spec, request: &Request) -> anyhow::Result<Facts> {
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
        })
    }
}

/// Where the run trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DevicePlan {
    Cpu,
    Cuda(usize),
}

impl DevicePlan {
    pub fn tch(self) -> tch::Device {
        match self {
            DevicePlan::Cpu => tch::Device::Cpu,
            DevicePlan::Cuda(i) => tch::Device::Cuda(i),
        }
    }
}

/// Allocator settings: the string in force and the environment variables to set for it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AllocPlan {
    pub conf: Option<String>,
    pub conflicts: Vec<Conflict>,
}

/// Where a resumed run picks up.
#[derive(Debug, Clone, PartialEq)]
pub struct Resume {
    pub checkpoint: PathBuf,
    /// The checkpoint's state reconciled with the spec (batch shape, effective batch).
    pub state: TrainState,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub run_dir: PathBuf,
    pub device: DevicePlan,
    pub cap: Option<Cap>,
    /// What the run may use of the device: the cap, else the CUDA device's total (None on the
    /// CPU).
    pub device_budget: Option<u64>,
    pub alloc: AllocPlan,
    /// Variables to set before CUDA starts (allocator settings, symbolizer).
    pub env: Vec<(String, String)>,
    /// libtorch CPU threads; None keeps libtorch's default.
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
        let mut start = fresh_state(configured);
        let mut notices = vec![];
        let mut resume = None;
        let mut nothing_to_do = None;
        if request.resuming() {
            let checkpoint;
            (checkpoint, start) = resumed_state(spec, facts, &run_dir, configured)?;
            if start.levers.iter().any(|l| l == "cpu") {
                // The run fell back to the CPU before this checkpoint; it continues there.
                device = DevicePlan::Cpu;
            }
            if start.epoch >= spec.train.epochs {
                nothing_to_do = Some(format!(
                    "{} already finished {} epoch(s), which train.epochs ({}) does not exceed; raise it (e.g. --set train.epochs={}) to train further",
                    run_dir.display(),
                    start.epoch,
                    spec.train.epochs,
                    start.epoch + 1
                ));
            }
            resume = Some(Resume {
                checkpoint,
                state: start.clone(),
            });
            if let Some(was) = &facts.checkpoint_spec {
                notices.extend(data_changes(was, spec));
            }
        }
        let cap = resolve_cap(spec, device, facts)?;
        // backend:cudaMallocAsync takes the fraction only through the allocator call (`run`
        // makes it); in its configuration string the native allocator's key is ignored, and
        // libtorch warns that it is.
        let async_backend = facts
            .alloc_env
            .effective()
            .is_some_and(|c| c.replace(' ', "").contains("backend:cudaMallocAsync"));
        let fraction = cap
            .as_ref()
            .filter(|c| c.kind == "cuda_fraction" && !async_backend)
            .and_then(|c| c.fraction);
        let ours = alloc_conf::from_spec(&spec.memory.allocator, fraction);
        let mut env = vec![];
        let alloc = if ours.is_empty() {
            AllocPlan {
                conf: facts.alloc_env.effective().map(str::to_owned),
                conflicts: vec![],
            }
        } else {
            let (conf, conflicts) = alloc_conf::merge(facts.alloc_env.effective(), &ours);
            env.push((alloc_conf::CUDA_VAR.to_owned(), conf.clone()));
            env.push((alloc_conf::GENERIC_VAR.to_owned(), conf.clone()));
            AllocPlan {
                conf: Some(conf),
                conflicts,
            }
        };
        let record_history = spec.memory.record_history && matches!(device, DevicePlan::Cuda(_));
        notices.extend(cuda_only_on_cpu(spec, record_history));
        notices.extend(unread_data_keys(&spec.data));
        if record_history && facts.symbolize_mode.is_none() {
            // 2.11 symbolizes recorded stacks by forking addr2line; without binutils the forked
            // child carries on as a second memtrain holding a CUDA context. dladdr stays in-process.
            env.push(("TORCH_SYMBOLIZE_MODE".to_owned(), "dladdr".to_owned()));
        }
        let device_budget = match device {
            DevicePlan::Cpu => None,
            DevicePlan::Cuda(_) => cap.as_ref().map(|c| c.bytes).or(facts.cuda_total_bytes),
        };
        Ok(Plan {
            run_dir,
            device,
            device_budget,
            cap,
            alloc,
            env,
            threads: (spec.job.threads > 0).then_some(spec.job.threads as i32),
            record_history,
            configured,
            start,
            resume,
            offload_on_oom: spec.memory.on_oom.contains(&spec::OomAction::Offload),
            oom_reported: facts.run_dir_has_oom_report,
            nothing_to_do,
            notices,
        })
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
/// (and `config.resolved.toml`, which a run that stopped in its set-up may leave alone).
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

fn resolve_device(wanted: spec::Device, cuda_devices: usize) -> Result<DevicePlan, UsageError> {
    match wanted {
        spec::Device::Cpu => Ok(DevicePlan::Cpu),
        spec::Device::Auto if cuda_devices > 0 => Ok(DevicePlan::Cuda(0)),
        spec::Device::Auto => Ok(DevicePlan::Cpu),
        spec::Device::Cuda(i) if i < cuda_devices => Ok(DevicePlan::Cuda(i)),
        spec::Device::Cuda(i) => Err(UsageError(format!(
            "job.device is cuda:{i} but libtorch sees {cuda_devices} CUDA device(s) (see `memtrain info`); use device = \"auto\" or \"cpu\""
        ))),
    }
}

/// memory.limit / memory.fraction as a cap: on CUDA a per-process fraction of the total the CUDA
/// runtime reports for the device; on the CPU a cap on live tensor bytes (a fraction of RAM).
fn resolve_cap(spec: &Spec, device: DevicePlan, facts: &Facts) -> Result<Option<Cap>, UsageError> {
    let m = &spec.memory;
    match device {
        DevicePlan::Cuda(i) => {
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
        DevicePlan::Cpu => {
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
        levers: vec![],
        scaler: None,
        monitored: None,
        finished: false,
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
mod tests {
    use super::*;

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
        assert_eq!(p.device, DevicePlan::Cpu);
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
        assert_eq!(p.device, DevicePlan::Cuda(0));
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
            DevicePlan::Cpu
        );
        assert_eq!(
            Plan::resolve(&spec("[job]\ndevice = \"auto\"\n"), &fresh(), &f)
                .unwrap()
                .device,
            DevicePlan::Cuda(0)
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
        let file = |path: &str, extra: &str| {
            format!("[train]\nepochs = 2\n[data]\nsource = \"npz\"\npath = \"{path}\"\n{extra}")
        };
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
            other.notices[0]
                .starts_with("resuming with job.seed (the run had 5), data.samples (the run had 80) changed"),
            "{}",
            other.notices[0]
        );
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
        assert_eq!(p.device, DevicePlan::Cpu);
        assert!(p.nothing_to_do.unwrap().contains("--set train.epochs=2"));
    }
}
