//! Weight optimizers (SGD, Adam, AdamW) whose state can be exported and restored, gradient
//! clipping, and learning-rate schedules.
//!
//! tch's built-in optimizers wrap libtorch's C++ ones, whose state cannot be read or written from
//! Rust, so a checkpoint could not resume a run exactly. These reimplement PyTorch's Python
//! optimizers (`torch.optim.SGD`, `Adam`, `AdamW` with their defaults: single-tensor
//! implementation, `maximize=False`, `amsgrad=False`, `dampening=0`) with every state tensor
//! exposed by name.
//!
//! # Numerics
//!
//! Each update performs the same ATen operations, in the same order and with the same rounding,
//! as `_single_tensor_sgd` / `_single_tensor_adam` in PyTorch 2.11; the tests compare against
//! numbers produced by PyTorch itself (`scripts/optim_reference.py`) and agree bit for bit on CPU.
//! One complication: tch's generated bindings drop the optional `alpha` / `value` scalars of
//! `add`, `addcmul` and `addcdiv`, so those three calls are rebuilt from ops tch does have, in a
//! form that rounds exactly like the kernel PyTorch runs:
//!
//! * `a.add(b, alpha=s)` is a fused multiply-add (`fma(b, s, a)`, one rounding) in both the CPU
//!   and CUDA kernels. It is computed as `a.addcmul(b, s_t)` with `s_t` a 0-dim tensor holding
//!   `s`: with `value = 1` the addcmul kernels reduce to the same single fused multiply-add.
//! * `a.addcmul_(b, c, value=v)`: on CPU the kernel evaluates `a + (v*b)*c`, reproduced as
//!   `a.addcmul_(b*v, c)`; on CUDA it evaluates `fma(v, b*c, a)`, reproduced as
//!   `a.addcmul_(b*c, v_t)`.
//! * `a.addcdiv_(b, c, value=v)`: on CPU `a + (v*b)/c`, reproduced as `a.addcdiv_(b*v, c)`;
//!   on CUDA `fma(v, b/c, a)`, reproduced as `a.addcmul_(b/c, v_t)`.
//!
//! The scalar tensors live on the parameter's device (created once, refilled with `fill_`, which
//! launches a kernel but never synchronises), so `step` never waits for the device. The CPU
//! forms were checked bitwise against PyTorch (a million elements per op, and multi-step runs of
//! every optimizer variant on 1003 elements, with both the AVX2 and the default kernels); the
//! CUDA forms follow the 2.11 kernel sources (`DeviceAddCmulCdiv.cuh`) but were not run here.
//!
//! Reduced-precision parameters (bf16/f16, e.g. `precision = "bf16"`) are not bit-exact, only
//! within a few bf16 ulps of PyTorch, for lack of the `value` argument: PyTorch evaluates
//! `a + v*b*c` and `a + v*b/c` in f32 and rounds once, where the forms above round `v*b` to
//! bf16 first. On the CPU, `add(alpha)` is reproduced exactly as above (PyTorch's CPU kernel
//! rounds `alpha` to the tensor's dtype, like the 0-dim tensor does). On CUDA PyTorch keeps
//! `alpha` in f32, so a bf16 0-dim tensor would bias every step (momentum 0.9 would become
//! 0.8984); there `a + round(b*s)` is used instead (the multiply kernel keeps `s` in f32), and
//! the CPU forms of addcmul/addcdiv.
//!
//! # Step count
//!
//! One step count is shared by all parameters (PyTorch keeps one per parameter, counting only
//! the steps in which that parameter had a gradient). The two agree whenever every parameter
//! gets a gradient from the first step on, which is the case for the models here; the shared
//! count is what makes a restored optimizer continue exactly.
use std::collections::{BTreeSet, HashMap, HashSet};

use anyhow::{bail, Result};
use tch::{Device, Kind, Tensor};

use crate::spec::{OptimizerKind, Schedule, Train};

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
        }
    }

    /// Parameter-sized temporaries one update needs at once (the workspace's slots).
    fn temporaries(&self) -> usize {
        match self.kind {
            OptimizerKind::Sgd => 1,
            OptimizerKind::Adam | OptimizerKind::Adamw => 2,
        }
    }

    /// Names of the per-parameter state tensors, in the order `state_tensors` lists them.
    pub fn state_slots(&self) -> &'static [&'static str] {
        match self.kind {
            OptimizerKind::Sgd if self.momentum != 0.0 => &["momentum_buffer"],
            OptimizerKind::Sgd => &[],
            OptimizerKind::Adam | OptimizerKind::Adamw => &["exp_avg", "exp_avg_sq"],
        }
    }
}

/// Scalars as 0-dim tensors on one (device, kind), used as the multiplier of a fused
/// multiply-add (see the module docs). `neg_lr` and `neg_step_size` change every step and are
/// refilled at most once per step.
struct Scalars {
    device: Device,
    kind: Kind,
    /// The step whose values `neg_lr` / `neg_step_size` hold.
    filled_for: i64,
    neg_lr: Tensor,
    neg_step_size: Tensor,
    weight_decay: Tensor,
    momentum: Tensor,
    one_minus_beta2: Tensor,
}

impl Scalars {
    fn new(h: &Hyper, device: Device, kind: Kind) -> Self {
        let t = |v: f64| Tensor::scalar_tensor(v, (kind, device));
        Scalars {
            device,
            kind,
            filled_for: -1,
            neg_lr: t(0.0),
            neg_step_size: t(0.0),
            weight_decay: t(h.weight_decay),
            momentum: t(h.momentum),
            one_minus_beta2: t(1.0 - h.betas[1]),
        }
    }
}

/// Per-step constants shared by all parameters.
#[derive(Clone, Copy)]
struct StepConsts {
    lr: f64,
    /// Adam: `lr / bias_correction1`.
    step_size: f64,
    /// Adam: `bias_correction2 ** 0.5`.
    bias_correction2_sqrt: f64,
}

/// SGD / Adam / AdamW over a fixed list of named parameters, with exportable state.
///
/// State is allocated when the optimizer is built (zeros, on each parameter's device and kind),
/// so `state_tensors` always lists the same names. This matches PyTorch's lazily created state:
/// Adam's moments start at zero there too, and SGD's momentum buffer is still initialised to a
/// copy of the first gradient (tracked per parameter), not updated from zero.
pub struct Optimizer {
    hyper: Hyper,
    /// Shallow clones of the VarStore variables: in-place updates reach the model.
    params: Vec<(String, Tensor)>,
    /// `state[i][s]` is slot `hyper.state_slots()[s]` of parameter `i`.
    state: Vec<Vec<Tensor>>,
    /// SGD with momentum: whether parameter `i`'s buffer has been initialised from a gradient.
    buffer_ready: Vec<bool>,
    steps: i64,
    scalars: Vec<Scalars>,
    /// Sharded state (ZeRO stage 1): which rank owns each parameter; None: this process owns all.
    shard: Option<Shard>,
}

/// Which rank steps each parameter when optimizer state is sharded across data-parallel ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    pub rank: usize,
    /// `owners[i]`: the rank that holds parameter `i`'s state and computes its update.
    pub owners: Vec<usize>,
}

impl Shard {
    /// Balances state bytes: parameters largest first, each to the rank holding least so far
    /// (the lowest such rank on ties), as PyTorch's ZeroRedundancyOptimizer partitions. Every
    /// rank computes the same assignment from the same sizes.
    pub fn balanced(numels: &[i64], ranks: usize, rank: usize) -> Shard {
        let mut order: Vec<usize> = (0..numels.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(numels[i]));
        let mut load = vec![0i64; ranks.max(1)];
        let mut owners = vec![0; numels.len()];
        for i in order {
            let r = (0..load.len())
                .min_by_key(|&r| (load[r], r))
                .expect("at least one rank");
            owners[i] = r;
            load[r] += numels[i];
        }
        Shard { rank, owners }
    }

    fn owns(&self, i: usize) -> bool {
        self.owners[i] == self.rank
    }
}

/// Whether this process steps parameter `i`: always, unless the state is sharded.
fn steps_param(shard: Option<&Shard>, i: usize) -> bool {
    shard.is_none_or(|s| s.owns(i))
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

impl Optimizer {
    /// An optimizer over `params` (name, variable), typically shallow clones of a VarStore's
    /// trainable variables. Allocates the state (zeros like each parameter).
    pub fn new(hyper: Hyper, params: Vec<(String, Tensor)>) -> Self {
        Self::sharded(hyper, params, None)
    }

    /// With `shard`, state is allocated for this rank's parameters only and `step` updates only
    /// them; the caller brings the others from their owners afterwards.
    pub fn sharded(hyper: Hyper, params: Vec<(String, Tensor)>, shard: Option<Shard>) -> Self {
        let slots = hyper.state_slots().len();
        let state = tch::no_grad(|| {
            params
                .iter()
                .enumerate()
                .map(|(i, (_, p))| match steps_param(shard.as_ref(), i) {
                    true => (0..slots).map(|_| p.zeros_like()).collect(),
                    false => Vec::new(),
                })
                .collect()
        });
        Optimizer {
            hyper,
            buffer_ready: vec![false; params.len()],
            params,
            state,
            steps: 0,
            scalars: Vec::new(),
            shard,
        }
    }

    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// Parameter `i`'s state tensors, one per slot (empty for a parameter another rank owns).
    pub fn state_of(&self, i: usize) -> &[Tensor] {
        &self.state[i]
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
    /// Transactional with respect to memory: everything the update allocates (the per-device
    /// scalars and a workspace for the largest parameter's temporaries) is allocated before the
    /// first parameter is touched, and the step is counted last. An out-of-memory error (a tch
    /// panic) therefore leaves parameters, state and step count exactly as they were, and the
    /// step can be retried.
    pub fn step(&mut self, lr: f64) {
        let prepared = self.prepare();
        self.apply(prepared, lr);
    }

    /// The step's first phase: every allocation it makes (per-device scalars, the workspace).
    /// Data-parallel ranks agree on whether any of them ran out of memory between this and
    /// [`Optimizer::apply`], which allocates nothing.
    pub fn prepare(&mut self) -> Prepared {
        let h = self.hyper;
        let Optimizer {
            params, scalars, shard, ..
        } = self;
        tch::no_grad(|| {
            let live: Vec<(usize, Tensor)> = params
                .iter()
                .enumerate()
                .filter(|(i, _)| steps_param(shard.as_ref(), *i))
                .map(|(i, (_, p))| (i, p.grad()))
                .filter(|(_, g)| g.defined())
                .collect();
            let mut workspace = Workspace::default();
            for (i, _) in &live {
                let p = &params[*i].1;
                prepare_scalars(scalars, &h, p.device(), p.kind());
                workspace.reserve(p, h.temporaries());
            }
            workspace.allocate();
            Prepared { live, workspace }
        })
    }

    /// The step's second phase, in place only: nothing here allocates tensor memory.
    pub fn apply(&mut self, prepared: Prepared, lr: f64) {
        let h = self.hyper;
        let next = self.steps + 1;
        let consts = match h.kind {
            OptimizerKind::Sgd => StepConsts {
                lr,
                step_size: 0.0,
                bias_correction2_sqrt: 1.0,
            },
            OptimizerKind::Adam | OptimizerKind::Adamw => {
                // As in _single_tensor_adam (non-capturable): Python floats, i.e. f64 and libm pow.
                let step = next as f64;
                let bias_correction1 = 1.0 - h.betas[0].powf(step);
                let bias_correction2 = 1.0 - h.betas[1].powf(step);
                StepConsts {
                    lr,
                    step_size: lr / bias_correction1,
                    bias_correction2_sqrt: bias_correction2.powf(0.5),
                }
            }
        };
        let Prepared { live, workspace } = prepared;
        let Optimizer {
            params,
            state,
            buffer_ready,
            scalars,
            ..
        } = self;
        tch::no_grad(|| {
            for (i, grad) in &live {
                let i = *i;
                let param = &mut params[i].1;
                let sc = scalars_for(scalars, &h, param.device(), param.kind(), next, &consts);
                let mut tmp = workspace.views(param);
                match h.kind {
                    OptimizerKind::Sgd => {
                        let buf = state[i].first_mut().map(|b| (b, &mut buffer_ready[i]));
                        sgd_update(&h, &consts, param, grad, buf, sc, &mut tmp)
                    }
                    OptimizerKind::Adam | OptimizerKind::Adamw => {
                        let (exp_avg, rest) = state[i].split_first_mut().expect("adam has two state slots");
                        adam_update(&h, &consts, param, grad, exp_avg, &mut rest[0], sc, &mut tmp)
                    }
                }
            }
        });
        self.steps = next;
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
        if let Err(e) = crate::shim::drop_grads(self.params.iter().map(|(_, p)| p)) {
            // Inside the OOM guard like any libtorch error; it cannot fail for a plain tensor.
            panic!("{e}");
        }
    }

    /// Every state tensor, named `<slot>/<param name>` with slot `exp_avg` and `exp_avg_sq`
    /// (Adam, AdamW) or `momentum_buffer` (SGD with momentum; plain SGD has none), in parameter
    /// order. The tensors are the live state (shallow clones): copy them before the next `step`
    /// if a snapshot is needed. Sharded: this rank's parameters only.
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let slots = self.hyper.state_slots();
        let mut out = Vec::with_capacity(self.params.len() * slots.len());
        for ((name, _), st) in self.params.iter().zip(&self.state) {
            for (slot, t) in slots.iter().zip(st) {
                out.push((state_name(slot, name), t.shallow_clone()));
            }
        }
        out
    }

    /// The name of every state tensor of parameter `i`, owned here or not, in slot order.
    pub fn state_names_of(&self, i: usize) -> Vec<String> {
        let name = &self.params[i].0;
        self.hyper
            .state_slots()
            .iter()
            .map(|slot| state_name(slot, name))
            .collect()
    }

    /// Restores state saved by `state_tensors` and the step count. The names must be exactly
    /// this optimizer's (the error lists the missing and unexpected ones) and every shape must
    /// match its parameter; tensors are copied into the existing state, onto each parameter's
    /// device and kind. Nothing changes when an error is returned.
    ///
    /// SGD momentum buffers count as initialised when `steps_taken > 0`. Sharded: the saved
    /// state is the whole optimizer's (gathered when it was written, whatever the rank count
    /// then); this rank copies its own parameters' part and checks the names of all.
    pub fn load_state(&mut self, tensors: &[(String, Tensor)], steps_taken: i64) -> Result<()> {
        if steps_taken < 0 {
            bail!("optimizer state: negative step count {steps_taken}");
        }
        let slots = self.hyper.state_slots();
        let mut given: HashMap<&str, &Tensor> = HashMap::with_capacity(tensors.len());
        let mut duplicated = BTreeSet::new();
        for (name, t) in tensors {
            if given.insert(name.as_str(), t).is_some() {
                duplicated.insert(name.as_str());
            }
        }
        // Pair every slot with its source, in state order, checking names and shapes before
        // anything is written.
        let mut missing = Vec::new();
        let mut sources: Vec<Vec<&Tensor>> = Vec::with_capacity(self.params.len());
        let mut shape_errors = Vec::new();
        let mut known = HashSet::with_capacity(self.params.len() * slots.len());
        for (i, (name, p)) in self.params.iter().enumerate() {
            let want = p.size();
            let mut row = Vec::with_capacity(slots.len());
            for slot in slots {
                let full = state_name(slot, name);
                match given.get(full.as_str()) {
                    Some(src) => {
                        if src.size() != want {
                            shape_errors.push(format!("{full} has shape {:?}, the parameter {want:?}", src.size()));
                        }
                        row.push(*src);
                    }
                    None => missing.push(full.clone()),
                }
                known.insert(full);
            }
            if !steps_param(self.shard.as_ref(), i) {
                row.clear();
            }
            sources.push(row);
        }
        let unexpected: BTreeSet<&str> = given.keys().copied().filter(|n| !known.contains(*n)).collect();
        let mut problems = Vec::new();
        if !missing.is_empty() {
            problems.push(format!("missing {}", missing.join(", ")));
        }
        if !unexpected.is_empty() {
            problems.push(format!("unexpected {}", Vec::from_iter(unexpected).join(", ")));
        }
        if !duplicated.is_empty() {
            problems.push(format!("duplicated {}", Vec::from_iter(duplicated).join(", ")));
        }
        problems.extend(shape_errors);
        if !problems.is_empty() {
            bail!(
                "optimizer state does not fit this {:?} optimizer: {}",
                self.hyper.kind,
                problems.join("; ")
            );
        }
        tch::no_grad(|| {
            for (st, row) in self.state.iter_mut().zip(sources) {
                for (dst, src) in st.iter_mut().zip(row) {
                    dst.copy_(src);
                }
            }
        });
        self.steps = steps_taken;
        self.buffer_ready.iter_mut().for_each(|r| *r = steps_taken > 0);
        Ok(())
    }

    /// Moves all state tensors to `device`. The parameters are not touched: they are shallow
    /// clones of VarStore variables and follow the VarStore's own move (`set_data`).
    pub fn to_device(&mut self, device: Device) {
        tch::no_grad(|| {
            for t in self.state.iter_mut().flatten() {
                if t.device() != device {
                    *t = t.to_device(device);
                }
            }
        });
        self.scalars.retain(|s| s.device == device);
    }
}

fn state_name(slot: &str, param: &str) -> String {
    format!("{slot}/{param}")
}

/// Whether (device, kind) uses scalar tensors: not reduced-precision kinds off the CPU, which
/// take the unfused forms (module docs).
fn uses_scalars(device: Device, kind: Kind) -> bool {
    matches!(kind, Kind::Float | Kind::Double) || device == Device::Cpu
}

/// Creates the scalar tensors for (device, kind) if they do not exist yet (they allocate).
fn prepare_scalars(cache: &mut Vec<Scalars>, h: &Hyper, device: Device, kind: Kind) {
    if uses_scalars(device, kind) && !cache.iter().any(|s| s.device == device && s.kind == kind) {
        cache.push(Scalars::new(h, device, kind));
    }
}

/// The scalar tensors for (device, kind), created by `prepare_scalars` and refilled once per
/// step (in place); `None` where `uses_scalars` says the unfused forms apply.
fn scalars_for<'a>(
    cache: &'a mut Vec<Scalars>,
    h: &Hyper,
    device: Device,
    kind: Kind,
    step: i64,
    c: &StepConsts,
) -> Option<&'a Scalars> {
    if !uses_scalars(device, kind) {
        return None;
    }
    prepare_scalars(cache, h, device, kind);
    let i = cache
        .iter()
        .position(|s| s.device == device && s.kind == kind)
        .expect("prepared above");
    let s = &mut cache[i];
    if s.filled_for != step {
        let _ = s.neg_lr.fill_(-c.lr);
        let _ = s.neg_step_size.fill_(-c.step_size);
        s.filled_for = step;
    }
    Some(&cache[i])
}

/// Flat buffers, per (device, kind), for the temporaries of one parameter's update, sized for
/// the largest parameter so that one allocation before the update loop serves every parameter.
#[derive(Default)]
/// What [`Optimizer::prepare`] allocated for one step: the gradients it found and the workspace.
pub struct Prepared {
    live: Vec<(usize, Tensor)>,
    workspace: Workspace,
}

#[derive(Default)]
struct Workspace {
    /// (device, kind, slots, numel) wanted, then the allocated buffers.
    wanted: Vec<(Device, Kind, usize, i64)>,
    buffers: Vec<(Device, Kind, Vec<Tensor>)>,
}

impl Workspace {
    fn reserve(&mut self, p: &Tensor, slots: usize) {
        let (d, k, n) = (p.device(), p.kind(), p.numel() as i64);
        match self.wanted.iter_mut().find(|w| w.0 == d && w.1 == k) {
            Some(w) => w.3 = w.3.max(n),
            None => self.wanted.push((d, k, slots, n)),
        }
    }

    fn allocate(&mut self) {
        self.buffers = self
            .wanted
            .iter()
            .map(|&(d, k, slots, n)| (d, k, (0..slots).map(|_| Tensor::empty([n], (k, d))).collect()))
            .collect();
    }

    /// Views of the buffers shaped like `p` (views allocate no tensor memory).
    fn views(&self, p: &Tensor) -> Vec<Tensor> {
        let (d, k) = (p.device(), p.kind());
        let (_, _, bufs) = self
            .buffers
            .iter()
            .find(|b| b.0 == d && b.1 == k)
            .expect("reserved for every parameter");
        let n = p.numel() as i64;
        let shape = p.size();
        bufs.iter().map(|b| b.narrow(0, 0, n).view(shape.as_slice())).collect()
    }
}

/// A multiplier `s` of `a + s * b`: its value and, where `scalars_for` provides one, the same
/// value as a 0-dim tensor of the parameter's kind and device.
#[derive(Clone, Copy)]
struct Coef<'a> {
    value: f64,
    tensor: Option<&'a Tensor>,
}

impl<'a> Coef<'a> {
    fn new(value: f64, sc: Option<&'a Scalars>, pick: fn(&Scalars) -> &Tensor) -> Self {
        Coef {
            value,
            tensor: sc.map(pick),
        }
    }
}

/// `a.add(b, alpha=s)` into `out`. With the scalar tensor this is PyTorch's single fused
/// multiply-add; without (bf16/f16 off the CPU) `s` stays in f32, as in PyTorch's CUDA kernel,
/// but the product is rounded once more.
fn add_scaled_into(out: &Tensor, a: &Tensor, b: &Tensor, s: Coef) {
    match s.tensor {
        Some(t) => {
            let _ = a.addcmul_out(out, b, t);
        }
        None => {
            let _ = b.mul_scalar_out(out, s.value);
            let _ = out.shallow_clone().g_add_(a);
        }
    }
}

/// `a.add_(b, alpha=s)`, in place; see `add_scaled_into`.
fn add_scaled_(a: &mut Tensor, b: &Tensor, s: Coef) {
    let _ = match s.tensor {
        Some(t) => a.addcmul_(b, t),
        None => a.g_add_(&b.g_mul_scalar(s.value)),
    };
}

/// `x.mul_(s)` as Python runs it (`mul_.Tensor` with `s` as a wrapped number). tch's
/// `g_mul_scalar_` is `mul_.Scalar`, which on bf16/f16 rounds `s` to the tensor's dtype first;
/// `mul.Scalar_out` into `x` itself keeps `s` in f32 like Python. Same result for f32/f64.
fn mul_(x: &Tensor, s: f64) {
    match x.kind() {
        // The in-place kernel saves a temporary and a copy per parameter and step (measured by
        // scripts/bench-vs-pytorch), and rounds identically in f32/f64.
        Kind::Float | Kind::Double => {
            let _ = x.shallow_clone().g_mul_scalar_(s);
        }
        _ => {
            let _ = x.mul_scalar_out(x, s);
        }
    }
}

/// `_single_tensor_sgd` for one parameter (dampening 0, maximize off).
fn sgd_update(
    h: &Hyper,
    c: &StepConsts,
    param: &mut Tensor,
    grad: &Tensor,
    buf: Option<(&mut Tensor, &mut bool)>,
    sc: Option<&Scalars>,
    tmp: &mut [Tensor],
) {
    let neg_lr = Coef::new(-c.lr, sc, |s| &s.neg_lr);
    let momentum = Coef::new(h.momentum, sc, |s| &s.momentum);
    // grad = grad.add(param, alpha=weight_decay), in the workspace
    let mut d_p = (h.weight_decay != 0.0).then(|| {
        add_scaled_into(&tmp[0], grad, param, Coef::new(h.weight_decay, sc, |s| &s.weight_decay));
        tmp[0].shallow_clone()
    });
    match buf {
        Some((buf, ready)) if h.momentum != 0.0 => {
            let g = d_p.as_ref().unwrap_or(grad);
            if *ready {
                // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                mul_(buf, h.momentum);
                let _ = buf.g_add_(g);
            } else {
                // buf = torch.clone(grad).detach()
                buf.copy_(g);
                *ready = true;
            }
            if h.nesterov {
                // grad = grad.add(buf, alpha=momentum); our own temporary can be updated in place.
                match d_p.as_mut() {
                    Some(d) => add_scaled_(d, buf, momentum),
                    None => {
                        add_scaled_into(&tmp[0], grad, buf, momentum);
                        d_p = Some(tmp[0].shallow_clone());
                    }
                }
                // param.add_(grad, alpha=-lr)
                add_scaled_(param, d_p.as_ref().expect("set above"), neg_lr);
            } else {
                add_scaled_(param, buf, neg_lr);
            }
        }
        _ => add_scaled_(param, d_p.as_ref().unwrap_or(grad), neg_lr),
    }
}

/// `_single_tensor_adam` for one parameter (amsgrad and maximize off; AdamW is the decoupled
/// weight decay variant).
#[allow(clippy::too_many_arguments)]
fn adam_update(
    h: &Hyper,
    c: &StepConsts,
    param: &mut Tensor,
    grad: &Tensor,
    exp_avg: &mut Tensor,
    exp_avg_sq: &mut Tensor,
    sc: Option<&Scalars>,
    ws: &mut [Tensor],
) {
    let [beta1, beta2] = h.betas;
    // Which kernel's rounding of addcmul/addcdiv with a `value` to reproduce (module docs);
    // reduced-precision parameters always take the CPU forms, which need no scalar tensor.
    let cuda_forms = match sc {
        Some(sc) if param.device() != Device::Cpu => Some(sc),
        _ => None,
    };
    let mut own_grad: Option<Tensor> = None;
    if h.weight_decay != 0.0 {
        match h.kind {
            // param.mul_(1 - lr * weight_decay)
            OptimizerKind::Adamw => {
                mul_(param, 1.0 - c.lr * h.weight_decay);
            }
            // grad = grad.add(param, alpha=weight_decay)
            _ => {
                add_scaled_into(&ws[0], grad, param, Coef::new(h.weight_decay, sc, |s| &s.weight_decay));
                own_grad = Some(ws[0].shallow_clone());
            }
        }
    }
    let g = own_grad.as_ref().unwrap_or(grad);
    // exp_avg.lerp_(grad, 1 - beta1)
    let _ = exp_avg.lerp_(g, 1.0 - beta1);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    mul_(exp_avg_sq, beta2);
    let mut tmp = ws[1].shallow_clone();
    match cuda_forms {
        None => {
            let _ = g.mul_scalar_out(&tmp, 1.0 - beta2);
            let _ = exp_avg_sq.addcmul_(&tmp, g);
        }
        Some(sc) => {
            let _ = g.mul_out(&tmp, g);
            let _ = exp_avg_sq.addcmul_(&tmp, &sc.one_minus_beta2);
        }
    }
    // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps), built in `tmp`
    let _ = exp_avg_sq.sqrt_out(&tmp);
    let _ = tmp.g_div_scalar_(c.bias_correction2_sqrt);
    let _ = tmp.g_add_scalar_(h.eps);
    // param.addcdiv_(exp_avg, denom, value=-step_size)
    match cuda_forms {
        None => {
            // Slot 0 holds the decayed grad, which is dead by now.
            let upd = ws[0].shallow_clone();
            let _ = exp_avg.mul_scalar_out(&upd, -c.step_size);
            let _ = param.addcdiv_(&upd, &tmp);
        }
        Some(sc) => {
            let _ = exp_avg.div_out(&tmp, &tmp);
            let _ = param.addcmul_(&tmp, &sc.neg_step_size);
        }
    }
}

/// Clips gradients in place so that their global L2 norm is at most `max_norm`, exactly like
/// `torch.nn.utils.clip_grad_norm_(params, max_norm)` (norm type 2): the total norm is the norm
/// of the stacked per-parameter norms, every grad is multiplied by
/// `min(max_norm / (total_norm + 1e-6), 1)` (computed on the device, so the multiply happens
/// even when it is 1). Parameters without a grad are skipped. Returns the total norm before
/// clipping (0 when no parameter has a grad); reading it is the one device synchronisation.
///
/// On CUDA PyTorch computes the per-parameter norms with a fused multi-tensor kernel whose
/// summation order differs, so there the norm can differ from PyTorch's in the last bits.
pub fn clip_grad_norm(params: &[(String, Tensor)], max_norm: f64) -> f64 {
    tch::no_grad(|| {
        let mut grads: Vec<Tensor> = params.iter().map(|(_, p)| p.grad()).filter(|g| g.defined()).collect();
        let Some(first) = grads.first() else {
            return 0.0;
        };
        let device = first.device();
        let norms: Vec<Tensor> = grads
            .iter()
            .map(|g| {
                let n = g.norm();
                if n.device() == device {
                    n
                } else {
                    n.to_device(device)
                }
            })
            .collect();
        let total = Tensor::stack(&norms, 0).norm();
        // clip_coef = max_norm / (total_norm + 1e-6), which Python evaluates as
        // (total_norm + 1e-6).reciprocal() * max_norm; then clamp(max=1.0).
        let coef = total
            .g_add_scalar(1e-6)
            .reciprocal()
            .g_mul_scalar(max_norm)
            .clamp_max(1.0);
        for g in grads.iter_mut() {
            if g.device() == device {
                let _ = g.g_mul_(&coef);
            } else {
                let _ = g.g_mul_(&coef.to_device(g.device()));
            }
        }
        total.double_value(&[])
    })
}

/// The learning rate as a function of the optimizer step.
///
/// `lr_at(step)` takes `step`, the number of optimizer steps already taken (0 for the first
/// update):
///
/// * Warmup: for `step < warmup_steps`, `base_lr * (step + 1) / warmup_steps`, rising linearly
///   to `base_lr` at the last warmup step (no warmup when `warmup_steps <= 0`).
/// * After warmup:
///   * `Constant`: `base_lr`.
///   * `Step`: `base_lr * gamma^floor(epoch / step_epochs)`, with `epoch = floor(step /
///     steps_per_epoch)` counted from step 0 (warmup steps included).
///   * `Cosine`: `min_lr + (base_lr - min_lr) * (1 + cos(pi * t / T)) / 2` with
///     `t = step - warmup_steps` clamped to `T = max(1, total_steps - warmup_steps)`, so the
///     rate reaches `min_lr` at `total_steps` and stays there.
///
/// `steps_per_epoch` and `step_epochs` below 1 are treated as 1; a negative `step` as 0.
#[derive(Debug, Clone)]
pub struct LrSchedule {
    pub base_lr: f64,
    pub schedule: Schedule,
    pub warmup_steps: i64,
    pub step_epochs: i64,
    pub gamma: f64,
    pub min_lr: f64,
    pub total_steps: i64,
    pub steps_per_epoch: i64,
}

impl LrSchedule {
    /// The schedule of a job's `[train]` table, for a run of `total_steps` optimizer steps with
    /// `steps_per_epoch` of them per epoch.
    pub fn from_train(t: &Train, total_steps: i64, steps_per_epoch: i64) -> Self {
        LrSchedule {
            base_lr: t.lr,
            schedule: t.schedule,
            warmup_steps: t.warmup_steps,
            step_epochs: t.lr_step_epochs,
            gamma: t.lr_gamma,
            min_lr: t.min_lr,
            total_steps,
            steps_per_epoch,
        }
    }

    /// Learning rate for the update after `step` steps have been taken (see the type's docs).
    pub fn lr_at(&self, step: i64) -> f64 {
        let step = step.max(0);
        if step < self.warmup_steps {
            return self.base_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.schedule {
            Schedule::Constant => self.base_lr,
            Schedule::Step => {
                let epoch = step / self.steps_per_epoch.max(1);
                let decays = epoch / self.step_epochs.max(1);
                self.base_lr * self.gamma.powf(decays as f64)
            }
            Schedule::Cosine => {
                let warmup = self.warmup_steps.max(0);
                let total = (self.total_steps - warmup).max(1);
                let t = (step - warmup).min(total);
                let cos = (std::f64::consts::PI * t as f64 / total as f64).cos();
                self.min_lr + (self.base_lr - self.min_lr) * (1.0 + cos) / 2.0
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Reference numbers from PyTorch, printed by scripts/optim_reference.py (torch 2.11.0):
    // 3 steps, lr 0.1, of torch.optim.{SGD, Adam, AdamW} (foreach=False) on PARAM with GRADS.
    const SGD_MOMENTUM: [f32; 6] = [0.4906404, -1.2373544, 0.27460745, 2.030573, -0.7709314, 0.15764679];
    const SGD_NESTEROV: [f32; 6] = [0.50516343, -1.2499778, 0.28138798, 2.0263546, -0.79152334, 0.20146933];
    const ADAM: [f32; 6] = [0.339019, -1.1630648, 0.20731245, 2.0902748, -0.81890184, 0.18155235];
    const ADAMW: [f32; 6] = [0.340299, -1.1720663, 0.2084967, 2.0962877, -0.8199715, 0.18159024];
    // The same for SGD_MOMENTUM and ADAM with bfloat16 parameters and grads (values widened to f32).
    const SGD_MOMENTUM_BF16: [f32; 6] = [0.49023438, -1.234375, 0.27539062, 2.03125, -0.7734375, 0.15820312];
    const ADAM_BF16: [f32; 6] = [0.33984375, -1.1640625, 0.20703125, 2.09375, -0.8203125, 0.18066406];
    // torch.nn.utils.clip_grad_norm_(max_norm=1.0) on CLIP_GRADS (and a param without grad).
    const CLIP_TOTAL_NORM: [f32; 1] = [2.7789388];
    const CLIP_GRAD0: [f32; 6] = [0.03598495, -0.0719699, 0.10795485, -0.1439398, 0.17992474, -0.2159097];
    const CLIP_GRAD1: [f32; 3] = [0.53977424, -0.71969897, 0.26988712];

    // The inputs, identical to scripts/optim_reference.py.
    const PARAM: [f32; 6] = [0.5, -1.25, 0.3, 2.0, -0.7, 0.05];
    const GRADS: [[f32; 6]; 3] = [
        [0.1, -0.2, 0.3, -0.4, 0.5, -0.6],
        [0.05, 0.15, -0.25, 0.35, -0.45, 0.55],
        [-0.3, 0.2, -0.1, 0.0, 0.25, -0.5],
    ];
    const CLIP_GRADS: ([f32; 6], [f32; 3]) = ([0.1, -0.2, 0.3, -0.4, 0.5, -0.6], [1.5, -2.0, 0.75]);
    const LR: f64 = 0.1;

    fn hyper(kind: OptimizerKind, momentum: f64, nesterov: bool) -> Hyper {
        Hyper {
            kind,
            momentum,
            nesterov,
            weight_decay: 0.01,
            betas: [0.9, 0.999],
            eps: 1e-8,
        }
    }

    fn sgd() -> Hyper {
        hyper(OptimizerKind::Sgd, 0.9, false)
    }
    fn nesterov() -> Hyper {
        hyper(OptimizerKind::Sgd, 0.9, true)
    }
    fn adam() -> Hyper {
        hyper(OptimizerKind::Adam, 0.0, false)
    }
    fn adamw() -> Hyper {
        hyper(OptimizerKind::Adamw, 0.0, false)
    }

    fn leaf(values: &[f32], shape: &[i64]) -> Tensor {
        Tensor::from_slice(values).reshape(shape).set_requires_grad(true)
    }

    /// Makes `p.grad()` exactly `g`, through autograd like a real backward pass:
    /// d/dp sum(p * g) = g, accumulated into a zeroed (or not yet defined) grad.
    fn set_grad(p: &Tensor, g: &[f32]) {
        let g = Tensor::from_slice(g).reshape(p.size());
        (p * g).sum(Kind::Float).backward();
    }

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(&t.detach().flatten(0, -1)).unwrap()
    }

    /// Largest |got - want|, asserting each is within 2e-7 relative (about one float32 ulp).
    fn assert_close(what: &str, got: &[f32], want: &[f32]) -> f32 {
        assert_eq!(got.len(), want.len(), "{what}: length");
        let mut max = 0f32;
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let d = (g - w).abs();
            max = max.max(d);
            assert!(
                d <= 2e-7 * w.abs().max(1e-3),
                "{what}[{i}]: got {g:e}, PyTorch {w:e} (diff {d:e})"
            );
        }
        eprintln!("{what}: max abs diff vs PyTorch {max:e}");
        max
    }

    fn run_three_steps(h: Hyper) -> (Tensor, Optimizer) {
        let p = leaf(&PARAM, &[2, 3]);
        let mut opt = Optimizer::new(h, vec![("w".into(), p.shallow_clone())]);
        for g in &GRADS {
            opt.zero_grad();
            set_grad(&p, g);
            opt.step(LR);
        }
        (p, opt)
    }

    #[test]
    fn sgd_momentum_matches_pytorch() {
        let (p, opt) = run_three_steps(sgd());
        assert_eq!(opt.steps_taken(), 3);
        assert_close("sgd momentum", &values(&p), &SGD_MOMENTUM);
    }

    #[test]
    fn sgd_nesterov_matches_pytorch() {
        let (p, _) = run_three_steps(nesterov());
        assert_close("sgd nesterov", &values(&p), &SGD_NESTEROV);
    }

    #[test]
    fn adam_matches_pytorch() {
        let (p, _) = run_three_steps(adam());
        assert_close("adam", &values(&p), &ADAM);
    }

    #[test]
    fn adamw_matches_pytorch() {
        let (p, _) = run_three_steps(adamw());
        assert_close("adamw", &values(&p), &ADAMW);
    }

    /// bf16 parameters take the unfused forms (module docs): within one bf16 ulp of PyTorch.
    #[test]
    fn bf16_params_stay_within_one_ulp_of_pytorch() {
        for (h, want) in [(sgd(), SGD_MOMENTUM_BF16), (adam(), ADAM_BF16)] {
            let p = Tensor::from_slice(&PARAM)
                .reshape([2, 3])
                .to_kind(Kind::BFloat16)
                .set_requires_grad(true);
            let mut opt = Optimizer::new(h, vec![("w".into(), p.shallow_clone())]);
            for g in &GRADS {
                opt.zero_grad();
                let g = Tensor::from_slice(g).reshape([2, 3]).to_kind(Kind::BFloat16);
                (&p * g).sum(Kind::BFloat16).backward();
                opt.step(LR);
            }
            assert_eq!(p.kind(), Kind::BFloat16);
            assert!(opt.state_tensors().iter().all(|(_, t)| t.kind() == Kind::BFloat16));
            let got = values(&p.to_kind(Kind::Float));
            let mut max = 0f32;
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                let d = (g - w).abs();
                max = max.max(d);
                // One bf16 ulp is 2^-7 relative at worst.
                assert!(d <= w.abs() / 128.0, "{:?}[{i}]: got {g}, PyTorch {w}", h.kind);
            }
            eprintln!("{:?} bf16: max abs diff vs PyTorch {max:e}", h.kind);
        }
    }

    #[test]
    fn params_without_grad_are_skipped() {
        for h in [sgd(), adam(), adamw(), hyper(OptimizerKind::Sgd, 0.0, false)] {
            let a = leaf(&PARAM, &[2, 3]);
            let b = leaf(&[1.0, 2.0, 3.0], &[3]);
            let mut opt = Optimizer::new(
                h,
                vec![("a".into(), a.shallow_clone()), ("b".into(), b.shallow_clone())],
            );
            set_grad(&a, &GRADS[0]);
            opt.step(LR);
            assert_eq!(values(&b), vec![1.0, 2.0, 3.0], "{:?}", h.kind);
            assert_ne!(values(&a), PARAM.to_vec(), "{:?}", h.kind);
        }
    }

    #[test]
    fn drop_grads_releases_them_and_the_next_backward_makes_them_again() {
        let p = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
        let mut opt = Optimizer::new(sgd(), vec![("w".into(), p.shallow_clone())]);
        (&p * 3.0).sum(tch::Kind::Float).backward();
        assert!(p.grad().defined());
        opt.drop_grads();
        assert!(!p.grad().defined());
        opt.step(0.1);
        assert_eq!(values(&p), vec![1.0, 2.0], "no gradient, no update");
        (&p * 3.0).sum(tch::Kind::Float).backward();
        assert_eq!(values(&p.grad()), vec![3.0, 3.0]);
    }

    #[test]
    fn shards_balance_state_largest_first_and_cover_every_parameter() {
        let s = Shard::balanced(&[100, 10, 60, 50, 1], 2, 1);
        // 100 -> 0; 60 -> 1; 50 -> 1 (60 < 100); 10 -> 0 (100 < 110); 1 -> 1 (110 = 110: lower rank 0)
        assert_eq!(s.owners, vec![0, 0, 1, 1, 0]);
        assert_eq!(Shard::balanced(&[5, 5, 5], 3, 0).owners, vec![0, 1, 2]);
        assert_eq!(Shard::balanced(&[5, 5], 1, 0).owners, vec![0, 0]);
    }

    #[test]
    fn a_sharded_optimizer_steps_and_keeps_only_its_parameters() {
        let (a, b) = (leaf(&PARAM, &[2, 3]), leaf(&[1.0, 2.0], &[2]));
        let params = vec![("a".into(), a.shallow_clone()), ("b".into(), b.shallow_clone())];
        let shard = Shard {
            rank: 1,
            owners: vec![0, 1],
        };
        let mut opt = Optimizer::sharded(adam(), params, Some(shard));
        let names: Vec<String> = opt.state_tensors().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["exp_avg/b", "exp_avg_sq/b"]);
        assert_eq!(opt.state_names_of(0), ["exp_avg/a", "exp_avg_sq/a"]);
        set_grad(&a, &GRADS[0]);
        set_grad(&b, &[0.5, 0.5]);
        opt.step(LR);
        assert_eq!(values(&a), PARAM.to_vec(), "rank 0's parameter is not stepped here");
        assert_ne!(values(&b), vec![1.0, 2.0]);
        // The whole optimizer's saved state loads: own part copied, the rest checked and skipped.
        let full: Vec<(String, Tensor)> = ["exp_avg/a", "exp_avg_sq/a"]
            .iter()
            .map(|n| (n.to_string(), Tensor::ones([2, 3], (Kind::Float, Device::Cpu))))
            .chain(
                ["exp_avg/b", "exp_avg_sq/b"]
                    .iter()
                    .map(|n| (n.to_string(), Tensor::full([2], 7.0, (Kind::Float, Device::Cpu)))),
            )
            .collect();
        opt.load_state(&full, 3).unwrap();
        assert_eq!(values(&opt.state_of(1)[0]), vec![7.0, 7.0]);
        assert!(opt.state_of(0).is_empty());
        // A name missing for a parameter another rank owns is still an error.
        let e = opt.load_state(&full[1..], 3).unwrap_err();
        assert!(e.to_string().contains("missing exp_avg/a"), "{e}");
    }

    #[test]
    fn zero_grad_zeroes_in_place() {
        let p = leaf(&PARAM, &[2, 3]);
        let mut opt = Optimizer::new(sgd(), vec![("w".into(), p.shallow_clone())]);
        set_grad(&p, &GRADS[0]);
        let before = p.grad();
        opt.zero_grad();
        assert_eq!(values(&p.grad()), vec![0.0; 6]);
        // Same storage: zeroed in place, not replaced.
        assert_eq!(before.data_ptr(), p.grad().data_ptr());
    }

    #[test]
    fn state_names() {
        let named = |h: Hyper| {
            let opt = Optimizer::new(
                h,
                vec![("a".into(), leaf(&PARAM, &[2, 3])), ("b".into(), leaf(&[1.0], &[1]))],
            );
            opt.state_tensors().into_iter().map(|(n, _)| n).collect::<Vec<_>>()
        };
        assert_eq!(
            named(adam()),
            ["exp_avg/a", "exp_avg_sq/a", "exp_avg/b", "exp_avg_sq/b"]
        );
        assert_eq!(
            named(adamw()),
            ["exp_avg/a", "exp_avg_sq/a", "exp_avg/b", "exp_avg_sq/b"]
        );
        assert_eq!(named(sgd()), ["momentum_buffer/a", "momentum_buffer/b"]);
        assert!(named(hyper(OptimizerKind::Sgd, 0.0, false)).is_empty());
    }

    #[test]
    fn state_round_trip_is_exact() {
        for h in [sgd(), nesterov(), adam(), adamw()] {
            let a = leaf(&PARAM, &[2, 3]);
            let mut opt_a = Optimizer::new(h, vec![("w".into(), a.shallow_clone())]);
            for g in &GRADS[..2] {
                opt_a.zero_grad();
                set_grad(&a, g);
                opt_a.step(LR);
            }
            // What a checkpoint holds: deep copies on the CPU.
            let saved: Vec<(String, Tensor)> = opt_a
                .state_tensors()
                .into_iter()
                .map(|(n, t)| (n, t.to_device(Device::Cpu).copy()))
                .collect();
            let b = a.detach().copy().set_requires_grad(true);
            let mut opt_b = Optimizer::new(h, vec![("w".into(), b.shallow_clone())]);
            opt_b.load_state(&saved, opt_a.steps_taken()).unwrap();
            assert_eq!(opt_b.steps_taken(), 2);
            for (p, opt) in [(&a, &mut opt_a), (&b, &mut opt_b)] {
                opt.zero_grad();
                set_grad(p, &GRADS[2]);
                opt.step(LR);
            }
            assert!(a.equal(&b), "{:?}: resumed param differs", h.kind);
            for ((na, ta), (nb, tb)) in opt_a.state_tensors().iter().zip(opt_b.state_tensors().iter()) {
                assert_eq!(na, nb);
                assert!(ta.equal(tb), "{:?}: {na} differs", h.kind);
            }
        }
    }

    #[test]
    fn load_state_rejects_missing_and_unexpected_names() {
        let p = leaf(&PARAM, &[2, 3]);
        let mut opt = Optimizer::new(adam(), vec![("w".into(), p.shallow_clone())]);
        set_grad(&p, &GRADS[0]);
        opt.step(LR);
        let before = values(&opt.state_tensors()[0].1);
        let saved: Vec<(String, Tensor)> = opt
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.copy().zero_()))
            .collect();

        let missing: Vec<_> = saved
            .iter()
            .filter(|(n, _)| n != "exp_avg_sq/w")
            .map(|(n, t)| (n.clone(), t.copy()))
            .collect();
        let err = opt.load_state(&missing, 1).unwrap_err().to_string();
        assert!(err.contains("missing exp_avg_sq/w"), "{err}");

        let mut extra: Vec<_> = saved.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
        extra.push((
            "momentum_buffer/w".into(),
            Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)),
        ));
        let err = opt.load_state(&extra, 1).unwrap_err().to_string();
        assert!(err.contains("unexpected momentum_buffer/w"), "{err}");

        let mut wrong_shape: Vec<_> = saved.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
        wrong_shape[0].1 = Tensor::zeros([3, 2], (Kind::Float, Device::Cpu));
        let err = opt.load_state(&wrong_shape, 1).unwrap_err().to_string();
        assert!(err.contains("exp_avg/w has shape [3, 2]"), "{err}");

        // A rejected load leaves the state and step count alone.
        assert_eq!(values(&opt.state_tensors()[0].1), before);
        assert_eq!(opt.steps_taken(), 1);
    }

    #[test]
    fn load_state_converts_kind() {
        let p = leaf(&PARAM, &[2, 3]);
        let mut opt = Optimizer::new(sgd(), vec![("w".into(), p.shallow_clone())]);
        let saved = vec![(
            "momentum_buffer/w".to_string(),
            Tensor::ones([2, 3], (Kind::Double, Device::Cpu)),
        )];
        opt.load_state(&saved, 5).unwrap();
        let (_, buf) = &opt.state_tensors()[0];
        assert_eq!(buf.kind(), Kind::Float);
        assert_eq!(values(buf), vec![1.0; 6]);
        assert_eq!(opt.steps_taken(), 5);
    }

    #[test]
    fn to_device_keeps_state() {
        let p = leaf(&PARAM, &[2, 3]);
        let mut opt = Optimizer::new(adam(), vec![("w".into(), p.shallow_clone())]);
        set_grad(&p, &GRADS[0]);
        opt.step(LR);
        let before: Vec<Vec<f32>> = opt.state_tensors().iter().map(|(_, t)| values(t)).collect();
        opt.to_device(Device::Cpu);
        let after: Vec<Vec<f32>> = opt.state_tensors().iter().map(|(_, t)| values(t)).collect();
        assert_eq!(before, after);
    }

    #[test]
    fn clip_grad_norm_matches_pytorch() {
        let a = leaf(&[0.0; 6], &[2, 3]);
        let b = leaf(&[0.0; 3], &[3]);
        let c = leaf(&[0.0; 4], &[4]); // no grad: skipped
        set_grad(&a, &CLIP_GRADS.0);
        set_grad(&b, &CLIP_GRADS.1);
        let params = vec![
            ("a".to_string(), a.shallow_clone()),
            ("b".into(), b.shallow_clone()),
            ("c".into(), c),
        ];
        let total = clip_grad_norm(&params, 1.0);
        assert_close("clip total norm", &[total as f32], &CLIP_TOTAL_NORM);
        assert_close("clip grad a", &values(&a.grad()), &CLIP_GRAD0);
        assert_close("clip grad b", &values(&b.grad()), &CLIP_GRAD1);
        assert!(!params[2].1.grad().defined());
    }

    #[test]
    fn clip_grad_norm_below_max_leaves_grads() {
        let a = leaf(&[0.0; 6], &[2, 3]);
        set_grad(&a, &CLIP_GRADS.0);
        let total = clip_grad_norm(&[("a".into(), a.shallow_clone())], 100.0);
        let want = CLIP_GRADS.0.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
        assert!((total - want).abs() < 1e-6, "{total} vs {want}");
        assert_eq!(values(&a.grad()), CLIP_GRADS.0.to_vec());
        assert_eq!(clip_grad_norm(&[("none".into(), leaf(&[1.0], &[1]))], 1.0), 0.0);
    }

    fn schedule(kind: Schedule, warmup: i64) -> LrSchedule {
        LrSchedule {
            base_lr: 0.1,
            schedule: kind,
            warmup_steps: warmup,
            step_epochs: 2,
            gamma: 0.5,
            min_lr: 0.01,
            total_steps: 14,
            steps_per_epoch: 3,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12
    }

    #[test]
    fn lr_constant() {
        let s = schedule(Schedule::Constant, 0);
        for step in [0, 1, 5, 100] {
            assert_eq!(s.lr_at(step), 0.1);
        }
        // Warmup: 0.1 * (step + 1) / 4 for steps 0..4.
        let s = schedule(Schedule::Constant, 4);
        let want = [0.025, 0.05, 0.075, 0.1, 0.1, 0.1];
        for (step, w) in want.iter().enumerate() {
            assert!(close(s.lr_at(step as i64), *w), "step {step}: {}", s.lr_at(step as i64));
        }
    }

    #[test]
    fn lr_step() {
        // 3 steps per epoch, halved every 2 epochs: steps 0-5 -> 0.1, 6-11 -> 0.05, 12-17 -> 0.025.
        let s = schedule(Schedule::Step, 0);
        for (step, w) in [(0, 0.1), (5, 0.1), (6, 0.05), (11, 0.05), (12, 0.025), (18, 0.0125)] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
        // Warmup first (steps 0, 1), then the epoch count runs from step 0.
        let s = schedule(Schedule::Step, 2);
        for (step, w) in [(0, 0.05), (1, 0.1), (2, 0.1), (6, 0.05)] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
    }

    #[test]
    fn lr_cosine() {
        // No warmup: T = 14; t = 0 -> 0.1, t = 7 (half) -> 0.055, t >= 14 -> 0.01.
        let s = schedule(Schedule::Cosine, 0);
        for (step, w) in [(0, 0.1), (7, 0.055), (14, 0.01), (20, 0.01)] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
        // Warmup 2: steps 0, 1 warm up; then T = 12, so step 5 (t = 3) is a quarter of the way:
        // 0.01 + 0.09 * (1 + cos(pi/4)) / 2 = 0.01 + 0.045 * (1 + 0.70710678...) = 0.0868198051533946.
        let s = schedule(Schedule::Cosine, 2);
        for (step, w) in [
            (0, 0.05),
            (1, 0.1),
            (2, 0.1),
            (5, 0.0868198051533946),
            (8, 0.055),
            (14, 0.01),
        ] {
            assert!(close(s.lr_at(step), w), "step {step}: {}", s.lr_at(step));
        }
    }
}
