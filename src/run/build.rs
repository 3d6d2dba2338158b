//! The plan's factories: from a resolved plan and its spec to the parts a run is made of. This
//! is the one place below `run::run` that reads the spec; every part gets its own options.
use std::fs;
use std::path::Path;

use anyhow::{Context, Result};
use tch::{nn, Device, Tensor};

use super::components::{Components, LoopSettings, Outputs};
use super::execution::Execution;
use super::forward::{Forward, PrecisionStage};
use super::parts::{ArchStep, Kept, Trained};
use super::step::StepPipeline;
use crate::checkpoint::{NamedTensors, Store, TrainState};
use crate::data::Splits;
use crate::exit::{OomExit, UsageError};
use crate::fault::{self, Phase};
use crate::host::Home;
use crate::human::{device_name, human_bytes};
use crate::memory::CachePolicy;
use crate::model::{self, Built, Net, ARCH_PREFIX};
use crate::oom::{self, BatchShape, OomKind, StepError};
use crate::optim::{Groups, Hyper, LrSchedule, Optimizer, Shard};
use crate::plan::{Place, Plan};
use crate::policy::levers::{self, Described, Position, Situation};
use crate::policy::recovery::{EvalPosition, Policy, Recovery};
use crate::progress::Progress;
use crate::records::{Event, InitLoad, Recorder, StartEvent};
use crate::spec::{self, OptimizerImpl, Precision};
use crate::weights::Loaded;
use crate::{atomic, shim};

/// What the command line adds to the plan.
pub struct Session {
    pub max_steps: Option<i64>,
    pub quiet: bool,
}

/// What the run's opening record and lines say beside the plan.
struct Opening<'a> {
    state: &'a TrainState,
    data: &'a Splits,
    optimizer_impl: OptimizerImpl,
    init: Option<InitLoad>,
}

/// Builds every part of the run from its plan alone. The run directory appears only once the
/// model, the data and any checkpoint are known to be good.
pub fn components(plan: &Plan, execution: Execution, session: Session) -> Result<Components> {
    Factory { plan }.build(execution, session)
}

/// The factories, each reading the sections of the plan's spec its part needs.
struct Factory<'p> {
    plan: &'p Plan,
}

impl Factory<'_> {
    /// Builds every part of the run. The run directory appears only once the model, the data and
    /// any checkpoint are known to be good.
    fn build(&self, mut execution: Execution, session: Session) -> Result<Components> {
        let spec = &self.plan.spec;
        let device = self.plan.device.tch();
        streams_alone(spec.memory.parameters.is_host(), &execution)?;
        let (vs, built, init) = self.build_model()?;
        trainable(&vs, &spec.model.preset)?;
        let parallel = execution.group().is_some();
        let train = model::with_frozen(&spec.train, model::lora_frozen(&vs, &spec.model)?);
        let (groups, unfreeze) = super::finetune::groups(&train, &vs, built.net.as_ref(), parallel)?;
        self.store_frozen(&train, &vs, built.net.as_ref(), &groups)?;
        let data = self.load_data(&built, device)?;
        let (mut opt, arch) = {
            let _host = spec.memory.parameters.is_host().then(shim::HostScope::enter);
            self.build_optimizers(&vs, &execution, groups)?
        };
        // Parameters built on the host still stream to the run's device.
        opt.host_for(device);
        if let Some(blocks) = param_blocks(built.net.as_ref(), &vs, &opt) {
            opt.update_by_block(blocks);
        }
        let mut model = Trained {
            sched: self.schedule(&data),
            kept: self.kept(&vs)?,
            vs,
            net: built.net,
            opt,
            stream: None,
            unfreeze,
        };
        let mut state = self.plan.start.clone();
        let mut arch = arch.map(|(step, opt)| ArchStep::new(step, opt, state.arch.clone(), spec.job.seed));
        let moved = self.restore(&mut model, arch.as_mut(), device)?;
        state.levers.extend(moved.map(String::from));
        scalers(spec.train.precision, &mut state, arch.as_mut());
        let recovery = self.recovery(&state, &model, &execution)?;
        if spec.memory.parameters.is_host() && !recovery.engaged().contains(levers::HostParams.name()) {
            // Built on the host for streaming, which does not apply (the warning said why).
            setup_step(Phase::Model.label(), &|| None, &CHANGE_MODEL, || {
                model.vs.set_device(device);
                model.opt.to_device(device);
            })?;
        }
        self.ready_for_capture(&mut model, arch.as_mut());
        let spec_toml = spec::to_toml(spec);
        self.write_run_files(&spec_toml, model.net.output_head().is_none(), built.num_classes)?;
        let opening = Opening {
            state: &state,
            data: &data,
            optimizer_impl: model.opt.implementation(),
            init,
        };
        let out = self.outputs(&spec_toml, opening, session.quiet)?;
        share_model(&mut execution, &model)?;
        let m = &spec.memory;
        Ok(Components {
            settings: LoopSettings {
                epochs: spec.train.epochs,
                seed: spec.job.seed,
                log_every: spec.log.every_steps,
                checkpoint_every: spec.checkpoint.every_epochs,
                checkpoint_steps: spec.checkpoint.every_steps,
                checkpoint_minutes: spec.checkpoint.every_minutes,
                monitor: spec.checkpoint.monitor,
                clear_on_epoch_end: m.clear_on_epoch_end,
                clear_after_checkpoint: m.clear_after_checkpoint,
                preflight: m.preflight,
                record_history: self.plan.record_history,
                max_steps: session.max_steps,
                spec_toml,
                cap: self.plan.cap.clone(),
                alloc_conf: self.plan.alloc.conf.clone(),
            },
            model,
            arch,
            data,
            pipeline: StepPipeline {
                forward: Forward {
                    device,
                    precision: PrecisionStage {
                        precision: spec.train.precision,
                    },
                    // Engaged levers set these, at the start and on an OOM.
                    recompute: false,
                    activations: crate::host::Home::Device,
                },
                clip_norm: spec.train.grad_clip_norm,
            },
            recovery,
            execution,
            out,
            state,
        })
    }

    /// The data sets, resident on the device where they fit its budget. A data file that does
    /// not fit the model is bad input, like a bad spec: exit 2; one that does not fit in memory
    /// is an OOM: exit 3.
    fn load_data(&self, built: &Built, device: Device) -> Result<crate::data::Splits> {
        let spec = &self.plan.spec;
        let mut data = {
            let _squeeze = fault::squeeze_in(Phase::Data, self.plan.start.global_step);
            let needs = data_size(&spec.data, &built.input_shape);
            setup_step(Phase::Data.label(), &|| needs.clone(), &CHANGE_DATA, || {
                crate::data::load(&spec.data, &built.input_shape, built.num_classes, spec.job.seed)
            })?
            .map_err(|e| -> anyhow::Error {
                let text = format!("{e:#}");
                match oom::classify(&text) {
                    Some(_) => setup_oom(
                        Phase::Data.label(),
                        &|| needs.clone(),
                        &CHANGE_DATA,
                        &oom::short_message(&text),
                    )
                    .into(),
                    None => UsageError(text).into(),
                }
            })?
        };
        if data.stay_resident(device, self.plan.device_budget) {
            // Steps then copy indices, not samples.
            data.train.keep_on(device);
            data.val.keep_on(device);
        } else {
            data.train.start_loader(&spec.data);
        }
        Ok(data)
    }

    /// The model is built on the CPU and then moved to the run's device, so its initial weights
    /// depend on the seed alone, whatever the device or the placement (the CPU generator draws
    /// them, as it does for a PyTorch model built and then moved with `.to(device)`). With
    /// `memory.parameters = "host"` it stays in host memory to stream (counted as host on the
    /// CPU), so weights larger than the device can be. A TorchScript module is loaded on the
    /// device: its weights come from its file, and its code may hold tensors of its own.
    fn build_model(&self) -> Result<(nn::VarStore, Built, Option<InitLoad>)> {
        let spec = &self.plan.spec;
        let on_host = spec.memory.parameters.is_host();
        let _host = on_host.then(shim::HostScope::enter);
        let device = self.plan.device.tch();
        let built_on = match spec.model.preset == "torchscript" {
            true => device,
            false => Device::Cpu,
        };
        let mut vs = nn::VarStore::new(built_on);
        // A random base kept in bf16 is rounded while it is drawn: its copies are made here.
        let needs = || match model::BaseDraw::of(&spec.model, &spec.train) {
            model::BaseDraw::RoundedAsDrawn => self.model_needs_in_bf16(),
            _ => self.model_needs(),
        };
        let built = {
            let _squeeze = fault::squeeze_in(Phase::Model, self.plan.start.global_step);
            // Seeded there: eval, generate and export draw a LoRA run's base again the same way.
            setup_try(Phase::Model.label(), &needs, &CHANGE_MODEL, || {
                super::rebuild::drawn_model(&mut vs, spec)
            })?
        };
        let init = match &spec.model.init_from {
            Some(path) => Some(init_from(&vs, &built.head, &spec.model, path)?),
            None => None,
        };
        model::freeze_base(&vs, &spec.model)?;
        if !on_host && built_on != device {
            let _squeeze = fault::squeeze_in(Phase::Model, self.plan.start.global_step);
            setup_step(Phase::Model.label(), &needs, &CHANGE_MODEL, || vs.set_device(device))?;
        }
        Ok((vs, built, init))
    }

    /// `train.frozen_dtype`'s bf16 copies of the frozen weights, made where the weights rest:
    /// streamed ones in host memory (apart from the device's count and never against its cap),
    /// others on the device as part of the model's bill, whose OOM ends the run as building the
    /// model's does.
    fn store_frozen(&self, train: &spec::Train, vs: &nn::VarStore, net: &dyn Net, groups: &Groups) -> Result<()> {
        let _host = self.plan.spec.memory.parameters.is_host().then(shim::HostScope::enter);
        let needs = || self.model_needs_in_bf16();
        setup_step(Phase::Model.label(), &needs, &CHANGE_MODEL, || {
            super::finetune::store_frozen(train, vs, net, groups)
        })?;
        Ok(())
    }

    /// What the model holds while its frozen weights go to bf16, for an OOM then: each frozen
    /// weight is drawn in fp32, and its bf16 copy made beside it.
    fn model_needs_in_bf16(&self) -> Option<String> {
        self.model_needs()
            .map(|n| format!("{n} with the frozen weights in bf16, each copied from its fp32 draw"))
    }

    /// What the model holds, for an OOM while building it.
    fn model_needs(&self) -> Option<String> {
        self.after_setup_oom()
            .map(|e| format!("its parameters are {}", human_bytes(e.parameter_bytes())))
    }

    /// The weights' optimizer (this rank's share of its state under ZeRO stage 1) and the
    /// preset's extra step with its own optimizer.
    fn build_optimizers(
        &self,
        vs: &nn::VarStore,
        execution: &Execution,
        groups: crate::optim::Groups,
    ) -> Result<(Optimizer, Option<(model::ExtraStep, Optimizer)>)> {
        let spec = &self.plan.spec;
        let t = &spec.train;
        let (weights, arch) = split_params(vs);
        let shard = match execution.group() {
            Some(d) if t.shard_optimizer_state => {
                // A frozen parameter has no state to balance.
                let numel = |((_, p), g): (&(String, Tensor), &Option<usize>)| g.map_or(0, |_| p.numel() as i64);
                let numels: Vec<i64> = weights.iter().zip(&groups.of).map(numel).collect();
                Some(Shard::balanced(&numels, d.size(), d.rank()))
            }
            _ => None,
        };
        // State bound for the host (by the spec or the checkpoint's levers; streamed parameters
        // bring it along) is made there: it may not fit on the device even for a moment.
        let from_start = levers::configured(&spec.train, &spec.memory)
            .into_iter()
            .map(|(_, l)| l.name())
            .chain(self.plan.start.levers.iter().map(String::as_str))
            .collect::<Vec<_>>();
        let home = match [levers::HostState.name(), levers::HostParams.name()]
            .iter()
            .any(|n| from_start.contains(n))
        {
            true => Home::Host,
            false => Home::Device,
        };
        let needs = || {
            self.after_setup_oom()
                .map(|e| format!("the optimizer state is {}", human_bytes(e.optimizer_bytes())))
        };
        let opt = setup_step(OPTIMIZER_STATE, &needs, &CHANGE_OPTIMIZER, || {
            Optimizer::grouped(Hyper::from_train(t), weights, groups.clone(), shard, home)
        })?;
        let extra = match model::extra_step(&spec.model) {
            Some(x) => Some((
                x,
                setup_step(OPTIMIZER_STATE, &|| None, &CHANGE_OPTIMIZER, || {
                    Optimizer::new(x.hyper, arch)
                })?,
            )),
            None => None,
        };
        Ok((opt, extra))
    }

    fn schedule(&self, data: &Splits) -> LrSchedule {
        let spec = &self.plan.spec;
        let t = &spec.train;
        let effective = self.plan.configured.effective();
        let steps_per_epoch = (data.train.len() + effective - 1) / effective;
        LrSchedule::from_train(t, steps_per_epoch * t.epochs, steps_per_epoch)
    }

    /// Recovery at the run's position, with the levers the spec turns on engaged.
    fn recovery(&self, state: &TrainState, model: &Trained, execution: &Execution) -> Result<Recovery> {
        let spec = &self.plan.spec;
        let m = &spec.memory;
        let has_blocks = model.net.chain().is_some();
        // Checkpoints from before levers had names kept the spec's checkpointing flag even for a
        // model without blocks, where recomputation never ran.
        let names: Vec<&String> = state
            .levers
            .iter()
            .filter(|n| has_blocks || *n != levers::Recompute::ABOUT.name)
            .collect();
        let engaged = levers::from_names(&names).map_err(|e| {
            UsageError(format!(
                "{}: {e}; a newer memtrain wrote it, so resume it with that one",
                self.plan.resume.as_ref().map_or_else(
                    || "the checkpoint".into(),
                    |r| r.checkpoint.join("state.json").display().to_string()
                )
            ))
        })?;
        let mut recovery = Recovery::new(
            Policy {
                on_oom: m.on_oom.clone(),
                grow_back_after: m.grow_back_after,
                configured: self.plan.configured,
                eval_configured: spec.train.eval_batch_size.unwrap_or(spec.train.batch_size),
                reported: self.plan.oom_reported,
                situation: Situation {
                    at: Position {
                        shape: BatchShape {
                            micro_batch: state.micro_batch,
                            accumulation_steps: state.accumulation_steps,
                        },
                        clean_steps: state.clean_steps,
                        engaged,
                    },
                    min_batch: m.min_batch_size,
                    planned_on_cpu: self.plan.device == Place::Cpu,
                    has_blocks,
                    blockwise: crate::model::blockwise(model.net.as_ref(), &model.vs),
                    data_parallel: execution.group().is_some(),
                    state_slots: model.opt.hyper().state_slots().len(),
                    torchscript: spec.model.preset == "torchscript",
                },
            },
            state.eval_micro_batch.map(|micro_batch| EvalPosition {
                micro_batch,
                clean: state.eval_clean,
            }),
        );
        for (key, lever) in levers::configured(&spec.train, &spec.memory) {
            if let Err(why) = recovery.engage_configured(lever) {
                tracing::warn!(
                    "{key}: {why} ({} preset), so {} does not apply; the run goes on without it",
                    spec.model.preset,
                    lever.title()
                );
            }
        }
        Ok(recovery)
    }

    /// The static estimate, for the message of an OOM while building the model or its optimizer
    /// state. Counting builds the model once more (as shapes, but a TorchScript module with its
    /// values), so it is done only then, with the CPU cap lifted: the run ends on this error, and
    /// the cap has been read for the message.
    fn after_setup_oom(&self) -> Option<crate::estimate::Estimate> {
        shim::cpu_alloc_set_cap(None);
        let spec = &self.plan.spec;
        oom::guarded(|| {
            crate::estimate::estimate(&crate::estimate::Sections {
                model: &spec.model,
                train: &spec.train,
                memory: &spec.memory,
                device: spec.job.device,
            })
            .ok()
        })
        .ok()
        .flatten()
    }

    /// A plan that captures steps has each optimizer read its scalars on the device.
    fn ready_for_capture(&self, model: &mut Trained, arch: Option<&mut ArchStep>) {
        if self.plan.graph.captures() {
            model.opt.ready_for_capture();
            if let Some(a) = arch {
                a.opt.ready_for_capture();
            }
        }
    }

    /// The run directory with the resolved spec and, for a classifier, its class names (a
    /// language model's outputs are its vocabulary: no class names to keep).
    fn write_run_files(&self, spec_toml: &str, classifier: bool, num_classes: i64) -> Result<()> {
        let dir = &self.plan.writes_to;
        fs::create_dir_all(dir).with_context(|| format!("creating run directory {}", dir.display()))?;
        atomic::write_atomic(
            &dir.join("config.resolved.toml"),
            self.resolved_toml(spec_toml).as_bytes(),
        )?;
        if classifier {
            crate::data::classes::ClassNames::of_run(&self.plan.spec.data, num_classes)?.write(dir)?;
        }
        Ok(())
    }

    /// The resolved spec as the run directory keeps it: paths absolute, CUDA graphs' verdict first.
    fn resolved_toml(&self, spec_toml: &str) -> String {
        let spec_toml = spec::with_absolute_paths(spec_toml);
        match self.plan.spec.train.cuda_graph {
            spec::CudaGraph::Off => spec_toml,
            _ => format!("# train.cuda_graph: {}\n{spec_toml}", self.plan.graph.describe()),
        }
    }

    /// The records (with the start event), the terminal and its opening lines, checkpoints and
    /// the cache policy.
    fn outputs(&self, spec_toml: &str, opening: Opening, quiet: bool) -> Result<Outputs> {
        let Opening {
            state,
            data,
            optimizer_impl,
            init,
        } = opening;
        let spec = &self.plan.spec;
        let run_dir = &self.plan.writes_to;
        let device = self.plan.device.tch();
        let effective = self.plan.configured.effective();
        let mut recorder = Recorder::open(run_dir, spec_toml, spec.log.tensorboard)?;
        let (train_samples, val_samples) = (data.train.len(), data.val.len());
        let setup = crate::memory::sample(crate::memory::Place::of(device));
        recorder.emit(&Event::Start(StartEvent {
            job: spec.job.name.clone(),
            step: state.global_step,
            device: device_name(device),
            resumed: self.plan.resume.is_some(),
            micro_batch: state.micro_batch,
            accumulation_steps: state.accumulation_steps,
            effective_batch: effective,
            cap: self.plan.cap.clone(),
            allocator_conf: self.plan.alloc.conf.clone(),
            allocator_conflicts: self.plan.alloc.conflicts.clone(),
            train_samples,
            val_samples,
            libtorch: shim::versions().libtorch,
            optimizer_impl: Some(optimizer_impl.name().into()),
            setup_peak_allocated_bytes: setup.peak_allocated_bytes,
            setup_peak_reserved_bytes: setup.peak_reserved_bytes,
            init,
            cuda_graph: Some(self.plan.graph.describe()),
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
            state.micro_batch, state.accumulation_steps,
        ));
        if effective > train_samples {
            tracing::warn!(
                "the effective batch ({effective}) is more than the {train_samples} training samples: every step trains on all of them; lower train.batch_size or train.accumulation_steps, or give more data"
            );
        }
        progress.println(&match &self.plan.cap {
            Some(c) if c.kind == "cuda_fraction" => format!(
                "Memory cap: {} of GPU memory (per-process fraction {:.4})",
                human_bytes(c.bytes),
                c.fraction.unwrap_or(1.0)
            ),
            Some(c) => format!("Memory cap: {} of CPU tensor memory", human_bytes(c.bytes)),
            None => "Memory cap: none".into(),
        });
        if let Some(conf) = &self.plan.alloc.conf {
            progress.println(&format!("Allocator: {conf}"));
        }
        progress.println(&format!(
            "Optimizer: {} ({} implementation; train.optimizer_impl = \"{}\")",
            format!("{:?}", spec.train.optimizer).to_lowercase(),
            optimizer_impl.name(),
            spec.train.optimizer_impl.name()
        ));
        if spec.train.cuda_graph != spec::CudaGraph::Off {
            progress.println(&format!("CUDA graph: {}", self.plan.graph.describe()));
        }
        let m = &spec.memory;
        Ok(Outputs {
            recorder,
            progress,
            store: Store::new(
                run_dir,
                spec.checkpoint.keep_last as usize,
                spec.checkpoint.keep_best,
                spec.checkpoint.monitor,
            ),
            cache: CachePolicy::new(m.cache_clear_every, m.auto_clear_threshold.0, m.sync_every as u64),
        })
    }
}

/// fp16-mixed starts (or, switched on at a resume, takes up) a loss scaler for each step that
/// has one; other precisions drop them.
fn scalers(precision: Precision, state: &mut TrainState, arch: Option<&mut ArchStep>) {
    let on = precision.scales_loss();
    for s in std::iter::once(&mut state.scaler).chain(arch.map(|a| &mut a.state.arch_scaler)) {
        match on {
            true => {
                s.get_or_insert_with(Default::default);
            }
            false => *s = None,
        }
    }
}

const OPTIMIZER_STATE: &str = "creating the optimizer state";

/// What to change when a set-up phase runs out of memory (docs/guide.md, "Out of memory in every
/// phase"): raise the cap that bound the allocation, or, with none set, make room on the device;
/// else `otherwise`; `before` and `then` frame it, and `cap_note` says why the cap applies.
struct Remedy {
    before: &'static str,
    cap_note: &'static str,
    otherwise: &'static str,
    then: &'static str,
}

impl Remedy {
    /// Raise the cap or make room, else `otherwise` (none when empty).
    const fn or(otherwise: &'static str) -> Remedy {
        Remedy {
            before: "",
            cap_note: "",
            otherwise,
            then: "",
        }
    }

    fn text(&self, bound: Bound) -> String {
        let first = match bound {
            Bound::Cap => format!("raise memory.limit (memory.fraction on a GPU){}", self.cap_note),
            Bound::Device("GPU") => "no memory.limit bound it, so the GPU's own memory ran out: end what other processes hold there (memtrain info lists them)".to_string(),
            Bound::Device(place) => format!(
                "no memory.limit bound it, so the {place}'s own memory ran out: free memory there (memtrain info shows how much is available)"
            ),
        };
        let otherwise = match self.otherwise {
            "" => String::new(),
            o => format!(", or {o}"),
        };
        format!("{}{first}{otherwise}{}", self.before, self.then)
    }
}

/// What limited the allocation that failed: a cap memtrain set, or the device itself.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Bound {
    Cap,
    Device(&'static str),
}

impl Bound {
    /// The counting CPU allocator names its cap when the cap refuses; libtorch's CUDA text
    /// names the bytes "allowed" (the native allocator) or "allowed memory" (cudaMallocAsync)
    /// only under a per-process fraction, memtrain's cap, though it cannot tell whether other
    /// processes filled the card first.
    fn of(kind: Option<OomKind>, message: &str) -> Bound {
        match kind {
            Some(OomKind::Cpu) | None if message.contains(shim::CPU_CAP_REFUSED) => Bound::Cap,
            Some(OomKind::Cpu) | None => Bound::Device("machine"),
            _ if message.contains(" allowed;") || message.contains("would exceed allowed memory") => Bound::Cap,
            _ => Bound::Device("GPU"),
        }
    }
}

const CHANGE_DATA: Remedy = Remedy {
    cap_note: " (the data is loaded on the host, where the CPU cap covers it)",
    ..Remedy::or("train on less data")
};
const CHANGE_MODEL: Remedy =
    Remedy::or("use a smaller model; on a GPU, memory.parameters = \"host\" keeps the weights in host memory");
const CHANGE_OPTIMIZER: Remedy = Remedy::or("set memory.optimizer_state = \"host\" or train.optimizer_state_bits = 8");
const CHANGE_RESUME: Remedy = Remedy {
    before: "the checkpoint is untouched: ",
    then: "; then run --resume again",
    ..Remedy::or("")
};
const CHANGE_INIT_FROM: Remedy = Remedy::or("use a smaller model");

/// Runs set-up work that allocates (building the model, loading data or a checkpoint), so an
/// OOM there ends with exit 3 and a message that names the phase, the sizes (`needs`: what the
/// phase holds; what was allocated under which cap) and what to change, instead of a panic.
fn setup_step<T>(what: &str, needs: Needs, change: &Remedy, f: impl FnOnce() -> T) -> Result<T> {
    oom::guarded(f).map_err(|e| match e {
        StepError::Oom { message, .. } => setup_oom(what, needs, change, &message).into(),
        StepError::Other(m) | StepError::PeerLost(m) | StepError::OomInCollective(m) => {
            anyhow::anyhow!("{what} failed: {m}")
        }
    })
}

/// `setup_step` for work that reports libtorch's errors as values (`f_` calls, file readers):
/// an error that is an OOM ends the run as one too.
fn setup_try<T>(what: &str, needs: Needs, change: &Remedy, f: impl FnOnce() -> Result<T>) -> Result<T> {
    setup_step(what, needs, change, f)?.map_err(|e| {
        let text = format!("{e:#}");
        match oom::classify(&text) {
            Some(_) => setup_oom(what, needs, change, &oom::short_message(&text)).into(),
            None => e,
        }
    })
}

/// What a set-up phase holds, said only once it ran out of memory (it may take work).
type Needs<'a> = &'a dyn Fn() -> Option<String>;

fn setup_oom(what: &str, needs: Needs, change: &Remedy, message: &str) -> OomExit {
    let kind = oom::classify(message);
    // Read before `needs`, which may lift the CPU cap to count the model.
    let bound = Bound::of(kind, message);
    // A CUDA message carries the device's figures; the host's count only a host allocation.
    let held = match kind {
        Some(OomKind::Cpu) | None => {
            let s = shim::cpu_alloc_stats();
            let cap = s
                .cap
                .map(|c| format!(" under the {} cap", human_bytes(c)))
                .unwrap_or_default();
            format!("; {} of tensors were allocated{cap}", human_bytes(s.allocated))
        }
        _ => String::new(),
    };
    let needs = needs().map(|n| format!(" ({n})")).unwrap_or_default();
    OomExit(format!(
        "out of memory while {what}{needs}: {}{held}. To fix: {}",
        crate::shim::first_line(message),
        change.text(bound)
    ))
}

/// What the data set holds, for an OOM while loading it: its files' size on disk, or what the
/// synthetic samples take.
fn data_size(d: &spec::Data, input_shape: &[i64]) -> Option<String> {
    match d.source {
        spec::DataSource::Synthetic => {
            let per: i64 = input_shape.iter().product();
            Some(format!(
                "{} samples of {input_shape:?} are {}",
                d.synthetic_samples(),
                human_bytes((d.synthetic_samples() * per * 4).max(0) as u64)
            ))
        }
        _ => {
            let bytes: u64 = d.path.iter().chain(&d.val_path).map(|p| dir_bytes(p)).sum();
            Some(format!("the data files are {} on disk", human_bytes(bytes)))
        }
    }
}

/// The bytes of a file, or of every file under a directory.
fn dir_bytes(p: &Path) -> u64 {
    match fs::metadata(p) {
        Ok(m) if m.is_dir() => fs::read_dir(p)
            .map(|entries| entries.filter_map(|e| e.ok()).map(|e| dir_bytes(&e.path())).sum())
            .unwrap_or(0),
        Ok(m) => m.len(),
        Err(_) => 0,
    }
}

/// Every rank starts from rank 0's variables, and reduces the gradients of the parameters that
/// train. Optimizer state needs no sharing: fresh, or read from the same checkpoint by every rank.
fn share_model(execution: &mut Execution, model: &Trained) -> Result<()> {
    let mut vars: Vec<(String, Tensor)> = model.vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    // A frozen parameter gets no gradient to reduce.
    let params: Vec<&Tensor> = model
        .opt
        .params()
        .iter()
        .map(|(_, t)| t)
        .filter(|t| t.requires_grad())
        .collect();
    execution.share_model(&vars, &params)
}

/// Streamed parameters go through one process's device: not data-parallel.
fn streams_alone(streamed: bool, execution: &Execution) -> Result<(), UsageError> {
    if streamed && execution.group().is_some() {
        return Err(UsageError(
            "memory.parameters = \"host\" streams the parameters through one process's device and cannot be data-parallel (the ranks reduce gradients on the device as backward makes them); keep \"device\" and shard the optimizer state (train.shard_optimizer_state = true), or train in one process".into(),
        ));
    }
    Ok(())
}

/// Weight-optimizer parameters: every parameter (frozen ones too) that is not an architecture
/// weight, in name order so optimizer state lines up across runs.
fn split_params(vs: &nn::VarStore) -> (NamedTensors, NamedTensors) {
    model::parameters(vs)
        .into_iter()
        .partition(|(n, _)| !n.starts_with(ARCH_PREFIX))
}
/// Copies named tensors into the VarStore's variables that `kept` keeps, insisting that names
/// and shapes match exactly.
pub fn copy_into(vs: &nn::VarStore, tensors: &[(String, Tensor)], what: &str, kept: &Kept) -> Result<()> {
    let vars: std::collections::HashMap<String, Tensor> =
        vs.variables().into_iter().filter(|(n, _)| kept.keeps(n)).collect();
    crate::weights::copy_exact(&vars, tensors, what)
}

/// A model none of whose variables requires a gradient has nothing to train: said before the
/// run directory appears, rather than as the first backward's libtorch error.
fn trainable(vs: &nn::VarStore, preset: &str) -> Result<(), UsageError> {
    if vs.variables().values().any(Tensor::requires_grad) {
        return Ok(());
    }
    Err(UsageError(format!(
        "the model has no trainable parameters (none requires a gradient), so there is nothing to train; {}",
        match preset {
            "torchscript" => "script a module whose parameters have requires_grad = True",
            _ => "check model.init_from and the [model] table",
        }
    )))
}

/// `model.init_from` into the model's variables: mapped, tensor by tensor (`weights::load`), the
/// head left as built where the checkpoint's does not fit. The counts line goes to the terminal
/// and, returned, into the start record and the summary. Public for `export` (a LoRA run's base)
/// and the tests that load other libraries' checkpoints through it.
pub fn init_from(vs: &nn::VarStore, head: &[String], model: &spec::Model, path: &Path) -> Result<InitLoad> {
    let loaded = read_init_from(vs, head, model, path)?;
    let plan = &loaded.plan;
    tracing::info!("model.init_from {}: {}", path.display(), plan.describe());
    Ok(InitLoad {
        peak_host_bytes: loaded.peak_host_bytes,
        largest_tensor_bytes: loaded.largest_bytes,
        format: plan.format.into(),
        kept: plan.kept.len() as u64,
        created: plan.created.len() as u64,
        dropped: plan.dropped.len() as u64,
        missing: 0,
        resampled: plan.resampled.len() as u64,
    })
}

/// `model.init_from` into the variables, saying nothing: the load and its plan.
pub(crate) fn read_init_from(vs: &nn::VarStore, head: &[String], model: &spec::Model, path: &Path) -> Result<Loaded> {
    let what = format!("reading model.init_from {}", path.display());
    let _squeeze = fault::squeeze_in(Phase::InitFrom, 0);
    let needs = Some(format!("{} on disk", human_bytes(dir_bytes(path))));
    setup_try(&what, &|| needs.clone(), &CHANGE_INIT_FROM, || {
        crate::weights::load(&vs.variables(), head, model, path)
    })
}

/// The block of the model's chain that uses each weight, when every weight belongs to one: a
/// host update then finishes block by block during the next forward, beside the device's work.
fn param_blocks(net: &dyn Net, vs: &nn::VarStore, opt: &Optimizer) -> Option<Vec<usize>> {
    let chain = net.chain()?;
    let by_block = model::block_vars(chain, vs).ok()?;
    let of: std::collections::HashMap<&str, usize> = by_block
        .iter()
        .enumerate()
        .flat_map(|(b, vars)| vars.iter().map(move |(n, _)| (n.as_str(), b)))
        .collect();
    opt.params()
        .iter()
        .map(|(n, _)| {
            of.get(n.as_str())
                .copied()
                .or_else(|| chain.resident(n).then(|| chain.resident_from(n)))
        })
        .collect()
}

mod restore;
#[cfg(test)]
mod tests;
