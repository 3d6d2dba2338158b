//! Weight optimizers (SGD, Adam, AdamW) whose state can be exported and restored, gradient
//! clipping, and learning-rate schedules.
//!
//! tch's built-in optimizers wrap libtorch's C++ ones, whose state cannot be read or written from
//! Rust, so a checkpoint could not resume a run exactly. These reimplement PyTorch's Python
//! optimizers (`torch.optim.SGD`, `Adam`, `AdamW` with their defaults: `maximize=False`,
//! `amsgrad=False`, `dampening=0`; in their single-tensor, foreach or fused implementation) with
//! every state tensor exposed by name.
//!
//! Each algorithm is a `rule::Rule` (`sgd`, `adam`; `adam8` for Adam/AdamW with 8-bit moments,
//! `train.optimizer_state_bits = 8`): the state slots it keeps per parameter,
//! the temporaries an update needs and the update of one parameter, and for SGD and Adam the same
//! over a group of parameters as foreach ops or a fused kernel (`rule::MultiTensor`). How a step
//! launches the updates is an `implementation` (`train.optimizer_impl`: single, foreach, fused).
//! [`Optimizer`] is the container around a rule: it owns the parameters, where their state lives
//! (`state`), which of them this process steps (`shard`), the per-device multipliers and
//! temporaries (`forms`, `workspace`), which implementation runs, and the step's prepare/apply
//! transaction.
//!
//! # Numerics
//!
//! Each update performs the same ATen operations, in the same order and with the same rounding,
//! as `_single_tensor_sgd` / `_single_tensor_adam` in PyTorch 2.11; the tests compare against
//! numbers produced by PyTorch itself (`scripts/optim_reference.py`) and agree bit for bit on CPU.
//! `forms` says how the calls tch lacks are rebuilt, and where reduced precision differs. The
//! foreach and fused forms call PyTorch's own `_foreach_*_` ops and `_fused_*_` kernels through
//! the shim, with the Python numbers PyTorch passes them, and agree with `foreach=True` and
//! `fused=True` bit for bit on the CPU, in bf16 too.
//!
//! # Step count
//!
//! One step count is shared by all parameters (PyTorch keeps one per parameter, counting only
//! the steps in which that parameter had a gradient). The two agree whenever every parameter
//! gets a gradient from the first step on, which is the case for the models here; the shared
//! count is what makes a restored optimizer continue exactly.
mod adam;
mod adam8;
mod classes;
mod clip;
mod deferred;
mod forms;
mod grads;
mod groups;
mod implementation;
mod masters;
mod quant;
mod rule;
mod schedule;
mod sgd;
mod shard;
mod state;
#[cfg(test)]
mod tests;
mod workspace;

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use crate::host::{Fence, Home, Host};
use crate::shim::HostScope;
use crate::spec::schema::{OptimizerImpl, OptimizerKind, Train};
pub use adam8::state_bytes_8bit;
pub use clip::{clip_grad_norm, clip_grads};
use forms::{Forms, Multipliers};
use grads::GradBuffers;
pub use groups::{excluded_from_decay, glob, GroupReport, GroupSetting, Groups, ParamInfo};
pub use implementation::{refusal, resolve, Placement};
use implementation::{Batch, Implementation, Reserve};
use masters::{update_runs, Masters};
pub use quant::dynamic_map;
use rule::Rule;
pub use rule::Slot;
pub use rule::Step;
pub use schedule::LrSchedule;
use shard::steps_param;
pub use shard::Shard;
use state::StateStore;
use workspace::Workspace;

/// Optimizer hyper-parameters other than the learning rate (which `step` takes, so that a
/// schedule can change it every step). Assumed valid (see `spec::validate`): `nesterov` needs
/// SGD with `momentum > 0`; `momentum` and `nesterov` are ignored by Adam/AdamW and `betas`/`eps`
/// by SGD.
#[derive(Debug, Clone, Copy)]
pub struct Hyper {
    pub kind: OptimizerKind,
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
    pub betas: [f64; 2],
    pub eps: f64,
    /// Bits per Adam/AdamW moment value: 32, or 8 for block-wise quantized moments (`adam8`).
    pub state_bits: u32,
    /// `train.optimizer_impl`, as asked (the container resolves "auto").
    pub implementation: OptimizerImpl,
}

impl Hyper {
    /// The optimizer settings of a job's `[train]` table.
    pub fn from_train(t: &Train) -> Self {
        Hyper {
            kind: t.optimizer,
            momentum: t.momentum,
            nesterov: t.nesterov,
            weight_decay: t.weight_decay,
            betas: t.betas,
            eps: t.eps,
            state_bits: t.optimizer_state_bits,
            implementation: t.optimizer_impl,
        }
    }

    /// Names of the per-parameter state tensors, in the order `state_tensors` lists them.
    pub fn state_slots(&self) -> &'static [&'static str] {
        self.rule().slots()
    }

    fn rule(&self) -> Box<dyn Rule> {
        self.rule_with(self.weight_decay)
    }

    /// The rule with a parameter group's own weight decay.
    fn rule_with(&self, weight_decay: f64) -> Box<dyn Rule> {
        let adam = |decay| adam::Adam {
            betas: self.betas,
            eps: self.eps,
            weight_decay,
            decay,
        };
        match self.kind {
            OptimizerKind::Sgd => Box::new(sgd::Sgd {
                momentum: self.momentum,
                nesterov: self.nesterov,
                weight_decay,
            }),
            OptimizerKind::Adam | OptimizerKind::Adamw if self.state_bits == 8 => {
                let decay = match self.kind {
                    OptimizerKind::Adam => adam::Decay::Coupled,
                    _ => adam::Decay::Decoupled,
                };
                Box::new(adam8::Adam8::new(adam(decay)))
            }
            OptimizerKind::Adam => Box::new(adam(adam::Decay::Coupled)),
            OptimizerKind::Adamw => Box::new(adam(adam::Decay::Decoupled)),
        }
    }
}

/// A rule over a fixed list of named parameters, with exportable state.
///
/// State is allocated when the optimizer is built (zeros, on each parameter's device and kind),
/// so `state_tensors` always lists the same names. This matches PyTorch's lazily created state:
/// Adam's moments start at zero there too, and SGD's momentum buffer is still initialised to a
/// copy of the first gradient (tracked per parameter), not updated from zero.
pub struct Optimizer {
    hyper: Hyper,
    /// Per class (a parameter group and the step its parameters started at): the rule with the
    /// group's weight decay, and its multipliers.
    rules: Vec<Box<dyn Rule>>,
    multipliers: Vec<Multipliers>,
    classes: Vec<classes::Class>,
    /// Each parameter's class; None: frozen (no gradient, no state).
    class_of: Vec<Option<usize>>,
    /// Shallow clones of the VarStore variables: in-place updates reach the model.
    params: Vec<(String, Tensor)>,
    state: StateStore,
    /// Which forms reproduce PyTorch's kernels on a (device, kind); a test replaces it to run
    /// the forms of another device on the CPU.
    forms_of: fn(Device, Kind) -> Forms,
    /// Sharded state (ZeRO stage 1): which rank owns each parameter; None: this process owns all.
    shard: Option<Shard>,
    steps: i64,
    /// How the updates are launched: `hyper.implementation` resolved for the device and the
    /// placement (again whenever they change).
    implementation: Box<dyn Implementation>,
    /// Where host-placed state and gradients are made.
    host: Host,
    /// `memory.gradients = "host"`: the step's gradients, collected off the device.
    host_grads: Option<GradBuffers>,
    /// State on the host of a CUDA run with gradients on the device: where the update's
    /// gradients are staged once backward is done.
    staged: Option<GradBuffers>,
    /// State on the host of a CUDA run: the parameters' host copies the update writes and
    /// uploads (see [`Masters`]).
    masters: Masters,
    /// Seconds the host updates took since they were last taken (None: no host update ran).
    host_update_seconds: Option<f64>,
    /// The block of the model's chain that uses each parameter: a host update then finishes
    /// block by block during the next forward (see [`deferred`]). None: it finishes at once.
    blocks: Option<Vec<usize>>,
    /// A host update applied and not yet finished.
    pending: Option<deferred::Pending>,
}

impl std::fmt::Debug for Optimizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Optimizer")
            .field("hyper", &self.hyper)
            .field("params", &self.params.len())
            .field("steps", &self.steps)
            .finish()
    }
}

/// What [`Optimizer::prepare`] allocated for one step: the gradients it found and the
/// workspaces (on the device, and on the host for state placed there).
pub struct Prepared {
    live: Vec<(usize, Tensor)>,
    workspace: Workspace,
    host_workspace: Workspace,
    /// State on the host: what the update writes (see [`Masters::targets`]).
    targets: Vec<(String, Tensor)>,
    /// State on the host: the runs of `live` the update takes one by one ([`update_runs`]),
    /// and, for gradients staged off the device, when each run has landed (empty: they are on
    /// the host already).
    runs: Vec<std::ops::Range<usize>>,
    arrivals: Vec<Fence>,
    /// fp16-mixed with a fused optimizer: the loss scale the gradients still carry, per device,
    /// which the kernel divides out (see [`Prepared::with_grad_scale`]).
    grad_scale: Vec<(Device, Tensor)>,
}

impl Prepared {
    /// The gradients are still multiplied by `scale`: the fused kernels divide it out as they
    /// read them, as GradScaler.step has them do when `unscale_` was not called (the caller
    /// asks [`Optimizer::folds_unscale`] first). Allocates (a 1-element tensor per device), so
    /// it belongs to the step's first phase.
    pub fn with_grad_scale(mut self, opt: &Optimizer, scale: f64) -> Prepared {
        for (i, _) in &self.live {
            let d = opt.update_device(*i);
            if !self.grad_scale.iter().any(|(sd, _)| *sd == d) {
                self.grad_scale.push((d, Tensor::full([1], scale, (Kind::Float, d))));
            }
        }
        self
    }
}

impl Optimizer {
    /// An optimizer over `params` (name, variable), typically shallow clones of a VarStore's
    /// trainable variables. Allocates the state (zeros like each parameter).
    pub fn new(hyper: Hyper, params: Vec<(String, Tensor)>) -> Self {
        Self::sharded(hyper, params, None)
    }

    /// With `shard`, state is allocated for this rank's parameters only and `step` updates only
    /// them; the caller brings the others from their owners afterwards.
    pub fn sharded(hyper: Hyper, params: Vec<(String, Tensor)>, shard: Option<Shard>) -> Self {
        Self::placed(hyper, params, shard, Home::Device)
    }

    /// With its state allocated on `home` from the start (host memory never passes through
    /// the device, where it might not fit).
    pub fn placed(hyper: Hyper, params: Vec<(String, Tensor)>, shard: Option<Shard>, home: Home) -> Self {
        let groups = Groups::single(params.len(), hyper.weight_decay);
        Self::grouped(hyper, params, groups, shard, home)
    }

    /// With the parameters in `groups` (a frozen one gets no state, and no gradient: it is
    /// made not to require one).
    pub fn grouped(
        hyper: Hyper,
        params: Vec<(String, Tensor)>,
        groups: Groups,
        shard: Option<Shard>,
        home: Home,
    ) -> Self {
        let rule = hyper.rule();
        let device = params.first().map_or(Device::Cpu, |(_, p)| p.device());
        let host = Host::new(device);
        let (classes, class_of) = classes::Class::of_groups(&groups);
        for ((_, p), c) in params.iter().zip(&class_of) {
            if c.is_none() {
                // A frozen parameter never gets a gradient.
                let _ = p.shallow_clone().set_requires_grad(false);
            }
        }
        let state = StateStore::allocate(
            |i, p| match class_of[i] {
                Some(_) => rule.layout(p),
                None => Vec::new(),
            },
            &params,
            |i| steps_param(shard.as_ref(), i),
            home,
            &host,
        );
        let mut opt = Optimizer {
            host,
            host_grads: None,
            staged: None,
            masters: Masters::default(),
            host_update_seconds: None,
            blocks: None,
            pending: None,
            rules: classes
                .iter()
                .map(|c| hyper.rule_with(c.setting.weight_decay))
                .collect(),
            multipliers: classes.iter().map(|_| Multipliers::default()).collect(),
            classes,
            class_of,
            hyper,
            params,
            state,
            forms_of: Forms::of,
            shard,
            steps: 0,
            implementation: implementation::of(OptimizerImpl::Single),
        };
        opt.choose_implementation();
        opt
    }

    /// Whether the update divides the loss scale out of the gradients itself (the fused
    /// kernels' `grad_scale`), so that fp16-mixed only checks them for inf/NaN beforehand.
    pub fn folds_unscale(&self) -> bool {
        self.implementation() == OptimizerImpl::Fused
    }

    /// The implementation that runs the updates now ("single", "foreach" or "fused").
    pub fn implementation(&self) -> OptimizerImpl {
        self.implementation.which()
    }

    /// Resolves `hyper.implementation` for where the parameters, state and gradients are now.
    fn choose_implementation(&mut self) {
        let device = self.params.first().map_or(Device::Cpu, |(_, p)| p.device());
        let placement = Placement {
            state_bits: self.hyper.state_bits,
            state_on_host: self.state.home() == Home::Host,
            grads_on_host: self.host_grads.is_some(),
        };
        let asked = self.hyper.implementation;
        let which = resolve(asked, device, placement);
        if which != asked && asked != OptimizerImpl::Auto {
            let why = refusal(asked, placement).unwrap_or_default();
            tracing::warn!("train.optimizer_impl: running \"single\" instead: {why}");
        }
        if which != self.implementation.which() {
            self.implementation = implementation::of(which);
        }
    }

    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// Parameter `i`'s state tensors, one per slot (empty for a parameter another rank owns).
    pub fn state_of(&self, i: usize) -> &[Tensor] {
        self.assert_settled();
        self.state.of(i)
    }

    pub fn hyper(&self) -> &Hyper {
        &self.hyper
    }

    pub fn params(&self) -> &[(String, Tensor)] {
        &self.params
    }

    /// Number of `step` calls so far (or the count restored by `load_state`).
    pub fn steps_taken(&self) -> i64 {
        self.steps
    }

    /// One update with learning rate `lr` from the parameters' current `.grad()`. Parameters
    /// whose grad is undefined are skipped, as PyTorch does; the step count advances regardless.
    /// Runs under `no_grad`, in place on the parameters, and never synchronises with the device.
    ///
    /// Transactional with respect to memory: everything the update allocates (the multipliers
    /// and a workspace for the largest parameter's temporaries) is allocated before the first
    /// parameter is touched, and the step is counted last. An out-of-memory error (a tch panic)
    /// therefore leaves parameters, state and step count exactly as they were, and the step can
    /// be retried.
    pub fn step(&mut self, lr: f64) -> Result<()> {
        let prepared = self.prepare();
        self.apply(prepared, lr)
    }

    /// The step's first phase: every allocation it makes (multipliers, the workspace).
    /// Data-parallel ranks agree on whether any of them ran out of memory between this and
    /// [`Optimizer::apply`], which allocates nothing parameter-sized.
    pub fn prepare(&mut self) -> Prepared {
        if let Err(e) = self.settle() {
            // Inside the OOM guard like any libtorch error.
            panic!("{e:#}");
        }
        tch::no_grad(|| {
            let mut workspace = Workspace::default();
            let mut host_workspace = Workspace::default();
            let (mut runs, mut arrivals) = (Vec::new(), Vec::new());
            let (live, targets) = match self.state.home() {
                Home::Device => {
                    let live = self.live_grads();
                    let grads_on_host = self.host_grads.is_some();
                    for (c, members) in self.by_class(&live) {
                        self.implementation.reserve(Reserve {
                            class: c,
                            rule: &*self.rules[c],
                            params: &self.params,
                            live: &members,
                            multipliers: &mut self.multipliers[c],
                            forms_of: self.forms_of,
                            workspace: &mut workspace,
                            grads_on_host,
                        });
                    }
                    (live, Vec::new())
                }
                Home::Host => {
                    let _host = HostScope::enter();
                    let mut live = self.live_grads();
                    if let Some(blocks) = &self.blocks {
                        deferred::block_order(blocks, &mut live);
                    }
                    runs = update_runs(&live, |i| (self.block_of(i), self.class_of[i]));
                    let (live, fences) = self.host_live(live, &runs);
                    arrivals = fences;
                    let targets = self.masters.targets(&self.host, &self.params, &live);
                    // The update runs where its gradients, state and targets all are: on the host.
                    for (c, members) in self.by_class(&live) {
                        self.implementation.reserve(Reserve {
                            class: c,
                            rule: &*self.rules[c],
                            params: &targets,
                            live: &members,
                            multipliers: &mut self.multipliers[c],
                            forms_of: self.forms_of,
                            workspace: &mut host_workspace,
                            grads_on_host: false,
                        });
                    }
                    (live, targets)
                }
            };
            workspace.allocate();
            {
                let _host = HostScope::enter();
                host_workspace.allocate();
            }
            Prepared {
                live,
                workspace,
                host_workspace,
                targets,
                runs,
                arrivals,
                grad_scale: Vec::new(),
            }
        })
    }

    /// This step's gradients of the parameters this process steps.
    fn live_grads(&self) -> Vec<(usize, Tensor)> {
        self.grads()
            .into_iter()
            .filter(|(i, _)| steps_param(self.shard.as_ref(), *i))
            .collect()
    }

    /// The live gradients on the host, for an update there: staged off a CUDA device when
    /// they are not placed on the host already, run by run (the downloads are queued; the
    /// fences say when each run has landed).
    fn host_live(
        &mut self,
        live: Vec<(usize, Tensor)>,
        runs: &[std::ops::Range<usize>],
    ) -> (Vec<(usize, Tensor)>, Vec<Fence>) {
        if !(self.host.device.is_cuda() && self.host_grads.is_none()) {
            return (live, Vec::new());
        }
        let staged = self
            .staged
            .get_or_insert_with(|| GradBuffers::allocate(&self.host, &self.params, &self.class_of));
        let fences = staged.stage(&self.host, &self.params, &live, runs);
        let on_host = live
            .iter()
            .map(|(i, _)| (*i, staged.of(*i).expect("staged").shallow_clone()))
            .collect();
        (on_host, fences)
    }

    /// Where parameter `i`'s update runs.
    fn update_device(&self, i: usize) -> Device {
        match self.state.home() {
            Home::Host => Device::Cpu,
            Home::Device => self.params[i].1.device(),
        }
    }

    /// The step's second phase, in place only: the rule updates every parameter that has a
    /// gradient, in temporaries `prepare` allocated. An error (a libtorch call refusing its
    /// arguments: a bug, never memory) leaves the step uncounted.
    pub fn apply(&mut self, prepared: Prepared, lr: f64) -> Result<()> {
        let step = self.stage(lr)?;
        self.apply_staged(prepared, step)?;
        self.count(step);
        Ok(())
    }

    /// The next step's scalars, written where its update reads them: the rules' multipliers,
    /// and the step count and learning rate on the device where the implementation reads them
    /// there (a captured update: written before each replay, outside the graph).
    pub fn stage(&mut self, lr: f64) -> Result<Step> {
        let step = Step {
            number: self.steps + 1,
            lr,
        };
        for c in 0..self.classes.len() {
            let class_step = self.class_step(c, step);
            let values = self.rules[c].multipliers(class_step);
            tch::no_grad(|| self.multipliers[c].refill(&values));
            tch::no_grad(|| self.implementation.stage(c, class_step))?;
        }
        Ok(step)
    }

    /// The update of a staged step, uncounted (see [`Optimizer::count`]): what a captured step
    /// records once and replays.
    pub fn apply_staged(&mut self, prepared: Prepared, step: Step) -> Result<()> {
        if self.state.home() == Home::Host {
            return self.apply_on_host(prepared, step);
        }
        let Prepared {
            live,
            workspace,
            grad_scale,
            ..
        } = prepared;
        for (c, members) in self.by_class(&live) {
            let class_step = self.class_step(c, step);
            tch::no_grad(|| {
                self.implementation.apply(Batch {
                    class: c,
                    rule: &*self.rules[c],
                    step: class_step,
                    params: &mut self.params,
                    live: &members,
                    state: &mut self.state,
                    workspace: &workspace,
                    multipliers: &self.multipliers[c],
                    forms_of: self.forms_of,
                    grads_on_host: self.host_grads.is_some(),
                    grad_scale: &grad_scale,
                })
            })?;
        }
        Ok(())
    }

    /// `step` has been applied (by `apply_staged`, or by a replay of it).
    pub fn count(&mut self, step: Step) {
        self.steps = step.number;
    }

    /// Readies the update for a captured step: "auto" becomes the fused kernels, which then
    /// read their step count and learning rate from the device (see [`Optimizer::stage`]).
    /// False when the update cannot be captured (another implementation was asked for).
    pub fn ready_for_capture(&mut self) -> bool {
        if self.hyper.implementation == OptimizerImpl::Auto {
            self.hyper.implementation = OptimizerImpl::Fused;
            self.choose_implementation();
        }
        self.implementation.read_scalars_on_device()
    }

    /// Whether the update reads its scalars from the device, as a captured step needs.
    pub fn reads_scalars_on_device(&self) -> bool {
        self.implementation.reads_scalars_on_device()
    }

    /// The update with the state on the host, run by run: each run goes up while the next is
    /// updated. By block, it is left for the next forward to finish ([`deferred`]).
    fn apply_on_host(&mut self, prepared: Prepared, step: Step) -> Result<()> {
        let Prepared {
            live,
            host_workspace,
            targets,
            runs,
            arrivals,
            grad_scale,
            ..
        } = prepared;
        // The CPU writes a target only once no queued copy reads or writes it: with the
        // gradients staged by runs, once the run's downloads have landed (the copy stream runs
        // in order, so the last step's uploads are done too); otherwise once every copy queued
        // by now has (whatever is queued later touches neither targets, state nor gradients
        // until the update is done).
        if arrivals.is_empty() {
            self.host.before_cpu_writes();
        }
        let mut arrivals = arrivals.into_iter();
        let runs = runs
            .into_iter()
            .map(|range| deferred::Run {
                block: self.block_of(live[range.start].0),
                class: self.class_of[live[range.start].0].expect("a live parameter trains"),
                range,
                arrival: arrivals.next(),
            })
            .collect();
        self.pending = Some(deferred::Pending {
            step,
            live,
            targets,
            workspace: host_workspace,
            grad_scale,
            runs,
            uploaded: Vec::new(),
        });
        if self.defers() {
            return Ok(());
        }
        self.settle()
    }

    /// The CPU seconds of the host updates since the last call (None: none ran).
    pub fn take_host_update_seconds(&mut self) -> Option<f64> {
        self.host_update_seconds.take()
    }

    /// Zeroes every defined grad in place (detached first, like PyTorch's
    /// `zero_grad(set_to_none=False)`); undefined grads stay undefined. Training releases them
    /// (`drop_grads`); the optimizer tests' reference loops zero them.
    #[cfg(test)]
    pub fn zero_grad(&mut self) {
        for (_, p) in self.params.iter_mut() {
            p.zero_grad();
        }
    }

    /// Releases every gradient, as PyTorch's default `zero_grad(set_to_none=True)`: the forward
    /// pass of the next step runs without a copy of the parameters' size alive, and backward
    /// makes them afresh (its first micro-batch writes the gradient instead of adding it to
    /// zeros, which gives the same values).
    pub fn drop_grads(&mut self) {
        if let Some(h) = &mut self.host_grads {
            h.reset();
        }
        if let Err(e) = crate::shim::drop_grads(self.params.iter().map(|(_, p)| p)) {
            // Inside the OOM guard like any libtorch error; it cannot fail for a plain tensor.
            panic!("{e}");
        }
    }

    /// This step's gradients by parameter index: the device's `.grad()`, or the host's
    /// buffers when gradients live there. Shallow clones: in-place changes (unscaling,
    /// clipping) reach what the optimizer reads.
    pub fn grads(&self) -> Vec<(usize, Tensor)> {
        match &self.host_grads {
            None => self
                .params
                .iter()
                .enumerate()
                .map(|(i, (_, p))| (i, p.grad()))
                .filter(|(_, g)| g.defined())
                .collect(),
            Some(h) => (0..self.params.len())
                .filter_map(|i| h.of(i).map(|g| (i, g.shallow_clone())))
                .collect(),
        }
    }

    /// With gradients on the host: moves what backward has produced so far off the device (a
    /// no-op otherwise). Called after each block's backward, `from` the block just done: a
    /// parameter that an earlier block reads too (a tied embedding, which the loss reads after
    /// the last block) keeps its gradient on the device until that block's backward, so the
    /// micro-batch's pieces add up there first, as one backward adds them, and the host buffer
    /// takes their sum.
    pub fn collect_grads(&mut self, from: usize) {
        self.settle_now();
        let blocks = self.blocks.as_deref();
        if let Some(h) = &mut self.host_grads {
            h.collect(&self.host, &self.params, |i| blocks.is_none_or(|b| b[i] >= from));
        }
    }

    /// Backward is over: gradients on the host are complete once this returns.
    pub fn finish_backward(&mut self) {
        if let Some(h) = &mut self.host_grads {
            h.finish(&self.host);
        }
    }

    /// Where the state lives now.
    pub fn state_home(&self) -> Home {
        self.state.home()
    }

    pub fn grads_home(&self) -> Home {
        match self.host_grads {
            Some(_) => Home::Host,
            None => Home::Device,
        }
    }

    /// Host tensors made from now on are for a run on `device` (pinned memory for CUDA): for
    /// parameters built on the CPU to stream to that device.
    pub fn host_for(&mut self, device: Device) {
        self.settle_now();
        self.host = Host::new(device);
        self.masters.drop_all();
    }

    /// Moves the state to `home` (`memory.optimizer_state`); the values are kept exactly.
    pub fn place_state(&mut self, home: Home) {
        self.settle_now();
        self.state.place(home, &self.host, &self.params);
        self.masters.drop_all();
        self.staged = None;
        self.choose_implementation();
    }

    /// Keeps the gradients on `home` from the next backward on (`memory.gradients`).
    pub fn place_grads(&mut self, home: Home) {
        self.settle_now();
        self.host_grads = match home {
            Home::Host => Some(
                self.host_grads
                    .take()
                    .unwrap_or_else(|| GradBuffers::allocate(&self.host, &self.params, &self.class_of)),
            ),
            Home::Device => None,
        };
        self.choose_implementation();
    }

    /// Every state tensor, named `<slot>/<param name>` with slot `exp_avg` and `exp_avg_sq`
    /// (Adam, AdamW) or `momentum_buffer` (SGD with momentum; plain SGD has none), in parameter
    /// order; with 8-bit state, `exp_avg_q8`, `exp_avg_absmax`, `exp_avg_sq_q8` and
    /// `exp_avg_sq_absmax` for the parameters `adam8` quantizes. The tensors are the live state
    /// (shallow clones): copy them before the next `step` if a snapshot is needed. Sharded: this rank's parameters only.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        self.assert_settled();
        self.state.named(&self.params)
    }

    /// The name of every state tensor of parameter `i`, owned here or not, in slot order.
    pub fn state_names_of(&self, i: usize) -> Vec<String> {
        self.state.names_of(i, &self.params[i].0)
    }

    /// Parameter `i`'s state slots (names, sizes, kinds), owned here or not.
    pub fn state_layout_of(&self, i: usize) -> &[Slot] {
        self.state.layout_of(i)
    }

    /// Restores state saved by `state_tensors` and the step count. The names must be exactly
    /// this optimizer's (the error lists the missing and unexpected ones) and every shape must
    /// match its slot (by default the parameter's); tensors are copied into the existing state,
    /// onto each parameter's device and the slot's kind. Nothing changes when an error is
    /// returned.
    ///
    /// SGD momentum buffers count as initialised when `steps_taken > 0`. Sharded: the saved
    /// state is the whole optimizer's (gathered when it was written, whatever the rank count
    /// then); this rank copies its own parameters' part and checks the names of all.
    pub fn load_state(&mut self, tensors: &[(String, Tensor)], steps_taken: i64) -> Result<()> {
        self.settle()?;
        if steps_taken < 0 {
            bail!("optimizer state: negative step count {steps_taken}");
        }
        let shard = self.shard.as_ref();
        if let Err(problems) = self
            .state
            .load(&self.params, tensors, steps_taken > 0, |i| steps_param(shard, i))
        {
            // Another optimizer, state width or parameter set than the checkpoint's run had: the
            // spec changed, which the user decides.
            return Err(crate::exit::UsageError(format!(
                "the checkpoint's optimizer state does not fit this run's {} optimizer ({}): resume with the \
                 train.optimizer and train.optimizer_state_bits the checkpoint was written with (its spec.toml), and its train.freeze",
                format!("{:?}", self.hyper.kind).to_lowercase(),
                problems.join("; ")
            ))
            .into());
        }
        self.steps = steps_taken;
        // A checkpoint's parameters came with it.
        self.masters.drop_all();
        Ok(())
    }

    /// Moves all state tensors to `device`. The parameters are not touched: they are shallow
    /// clones of VarStore variables and follow the VarStore's own move (`set_data`).
    pub fn to_device(&mut self, device: Device) {
        self.settle_now();
        self.host = Host::new(device);
        self.masters.drop_all();
        self.staged = None;
        self.state.move_to(device);
        self.multipliers.iter_mut().for_each(|m| m.retain_on(device));
        self.choose_implementation();
    }
}
