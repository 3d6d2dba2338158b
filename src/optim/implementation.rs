//! How a step's updates are launched (`train.optimizer_impl`): one parameter at a time
//! ([`Single`]), PyTorch's foreach ops over groups of parameters ([`Foreach`]), or its fused
//! kernels ([`Fused`]). The rule says what is computed; the implementation decides how the
//! parameters are grouped, what workspace that needs and which of the rule's forms runs.
//!
//! All three keep the container's transaction: `reserve` (in `Optimizer::prepare`) allocates
//! everything, `apply` only writes in place into the state, the parameters and that workspace.
//! Foreach ops exist in place (`_foreach_mul_`, ...) and the out-of-place ones PyTorch's
//! `_multi_tensor_*` use become a copy into the workspace and the op in place there; the fused
//! kernels are in place by nature. So an out-of-memory error can only come from `reserve`,
//! before any parameter or state tensor is written.
//!
//! Foreach groups are capped: PyTorch's `_multi_tensor_adam` holds a square root of every
//! `exp_avg_sq` at once, an extra copy of all the parameters; here each group's elements sum to
//! at most the largest parameter's, so the workspace is the single-tensor implementation's (one
//! largest parameter per temporary) and a model launches a few groups instead of one. Every op
//! is elementwise, so the grouping changes no value.
use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::forms::{Forms, Multipliers};
use super::rule::{Group, ParamUpdate, Rule, Step};
use super::state::StateStore;
use super::workspace::Workspace;
use crate::shim::Scaling;
use crate::spec::schema::OptimizerImpl;

/// What decides whether a multi-tensor implementation can run: the state's form and where the
/// state and the gradients live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub state_bits: u32,
    pub state_on_host: bool,
    pub grads_on_host: bool,
}

/// Why `asked` cannot run with `p`, saying what to set instead; None when it can.
pub fn refusal(asked: OptimizerImpl, p: Placement) -> Option<String> {
    let x = asked.name();
    if matches!(asked, OptimizerImpl::Single | OptimizerImpl::Auto) {
        return None;
    }
    let instead = "set train.optimizer_impl = \"auto\" or \"single\"";
    if p.state_bits == 8 {
        return Some(format!(
            "\"{x}\" has no 8-bit form: train.optimizer_state_bits = 8 dequantizes, updates and quantizes the moments one parameter at a time; {instead}, or train.optimizer_state_bits = 32"
        ));
    }
    if p.state_on_host {
        // The update runs on the host, over host gradients, state and parameters.
        return None;
    }
    if p.grads_on_host {
        return Some(format!(
            "\"{x}\" needs every gradient of a group on the device at once, and memory.gradients = \"host\" (or memory.parameters = \"host\") brings them down one at a time; {instead}, or keep the gradients on the device"
        ));
    }
    None
}

/// What runs for `asked` on `device` with `p`: "auto" is the fused kernel for state on the host
/// (one multi-threaded pass over memory, where host memory bandwidth is the wall), and
/// otherwise PyTorch's default (foreach on CUDA, single on the CPU) where foreach can run,
/// single otherwise; an explicit choice that cannot run (a spec refuses it; a later placement
/// can still force it) falls back to single.
pub fn resolve(asked: OptimizerImpl, device: Device, p: Placement) -> OptimizerImpl {
    match asked {
        OptimizerImpl::Auto if p.state_on_host && refusal(OptimizerImpl::Fused, p).is_none() => OptimizerImpl::Fused,
        OptimizerImpl::Auto => match device.is_cuda() && refusal(OptimizerImpl::Foreach, p).is_none() {
            true => OptimizerImpl::Foreach,
            false => OptimizerImpl::Single,
        },
        x if refusal(x, p).is_some() => OptimizerImpl::Single,
        x => x,
    }
}

/// The implementation of a resolved choice.
pub fn of(which: OptimizerImpl) -> Box<dyn Implementation> {
    match which {
        OptimizerImpl::Foreach => Box::new(Foreach),
        OptimizerImpl::Fused => Box::new(Fused::default()),
        OptimizerImpl::Single | OptimizerImpl::Auto => Box::new(Single),
    }
}

/// What `reserve` sees of the container.
pub struct Reserve<'a> {
    /// The parameters' class (group): its step and learning rate are its own.
    pub class: usize,
    pub rule: &'a dyn Rule,
    pub params: &'a [(String, Tensor)],
    pub live: &'a [(usize, Tensor)],
    pub multipliers: &'a mut Multipliers,
    pub forms_of: fn(Device, Kind) -> Forms,
    pub workspace: &'a mut Workspace,
    pub grads_on_host: bool,
}

/// What one step's updates read and write (state on the device).
pub struct Batch<'a> {
    /// The parameters' class (group), as in [`Reserve`].
    pub class: usize,
    pub rule: &'a dyn Rule,
    pub step: Step,
    pub params: &'a mut [(String, Tensor)],
    pub live: &'a [(usize, Tensor)],
    pub state: &'a mut StateStore,
    pub workspace: &'a Workspace,
    pub multipliers: &'a Multipliers,
    pub forms_of: fn(Device, Kind) -> Forms,
    pub grads_on_host: bool,
    /// The loss scale the gradients still carry, per device (empty: none); only implementations
    /// that `folds_unscale` get one.
    pub grad_scale: &'a [(Device, Tensor)],
}

/// One way of launching a step's updates, with the state on the parameters' device.
pub trait Implementation: Send {
    fn which(&self) -> OptimizerImpl;

    /// Allocates what `apply` needs for the live parameters (the step's only allocations).
    fn reserve(&mut self, r: Reserve<'_>);

    /// Updates every live parameter in place; allocates nothing parameter-sized. A libtorch
    /// error here would be a bug (shapes and kinds are the optimizer's own); it comes back as
    /// an error, not a panic.
    fn apply(&self, b: Batch<'_>) -> Result<()>;

    /// From now on `apply` reads each class's step count and learning rate from tensors on the
    /// device that [`Implementation::stage`] writes, so that a captured update reads the step it
    /// replays; false where the kernels only take them as arguments.
    fn read_scalars_on_device(&mut self) -> bool {
        false
    }

    /// Whether `read_scalars_on_device` is on.
    fn reads_scalars_on_device(&self) -> bool {
        false
    }

    /// Writes class `class`'s `step` where `apply` reads it on the device (nothing unless
    /// [`Implementation::read_scalars_on_device`] was turned on).
    fn stage(&mut self, _class: usize, _step: Step) -> Result<()> {
        Ok(())
    }
}

/// `foreach=False, fused=False`: the rule's `update`, parameter by parameter, in temporaries
/// sized for the largest parameter.
pub struct Single;

impl Implementation for Single {
    fn which(&self) -> OptimizerImpl {
        OptimizerImpl::Single
    }

    fn reserve(&mut self, r: Reserve<'_>) {
        for (i, _) in r.live {
            let p = &r.params[*i].1;
            let forms = (r.forms_of)(p.device(), p.kind());
            r.multipliers.prepare(p.device(), p.kind(), forms);
            r.rule.prepare(p.device());
            // A host gradient comes to the device in a temporary of its own.
            let carried = usize::from(r.grads_on_host);
            r.workspace.reserve(p, r.rule.temporaries(forms) + carried);
        }
    }

    fn apply(&self, b: Batch<'_>) -> Result<()> {
        for (i, grad) in b.live {
            let param = &mut b.params[*i].1;
            let (device, kind) = (param.device(), param.kind());
            let st = b.state.param_mut(*i);
            let forms = (b.forms_of)(device, kind);
            let n = b.rule.temporaries(forms);
            let temps = b.workspace.views(param);
            let grad = match b.grads_on_host {
                true => super::workspace::carry(&temps[n], grad),
                false => grad.shallow_clone(),
            };
            b.rule.update(
                b.step,
                ParamUpdate {
                    param,
                    grad: &grad,
                    state: &mut st.tensors,
                    state_written: st.written,
                    temps: &temps[..n],
                    forms,
                    coefs: b.multipliers.coefs(device, kind),
                },
            );
            st.written = true;
        }
        Ok(())
    }
}

/// `foreach=True`: the rule's foreach form over groups of one device and dtype, each no larger
/// in all than the largest parameter (see the module's notes).
pub struct Foreach;

impl Implementation for Foreach {
    fn which(&self) -> OptimizerImpl {
        OptimizerImpl::Foreach
    }

    fn reserve(&mut self, r: Reserve<'_>) {
        let k = multi(r.rule).foreach_temporaries();
        for (i, _) in r.live {
            r.workspace.reserve(&r.params[*i].1, k);
        }
    }

    fn apply(&self, b: Batch<'_>) -> Result<()> {
        let rule = multi(b.rule);
        for members in groups(&b, true) {
            let (params, grads, state) = lists(&b, &members.idx);
            let temps = match rule.foreach_temporaries() {
                0 => Vec::new(),
                _ => b.workspace.packed(members.device, members.kind, &params),
            };
            let g = Group {
                params: &params,
                grads: &grads,
                state: &state,
                state_written: members.written,
                temps: &temps,
                steps: &[],
            };
            rule.foreach(b.step, g)?;
        }
        mark_written(b);
        Ok(())
    }
}

/// `fused=True`: one fused kernel per device and dtype. Its step counts are a 0-dim float
/// tensor per device (the count is shared), made in `reserve`. Read on the device (a captured
/// step), each class has its own count and learning rate per device, written by `stage`.
#[derive(Default)]
pub struct Fused {
    steps: Vec<(Device, Tensor)>,
    /// Per class: the scalars the kernels read on the device; None: from the host at each apply.
    on_device: Option<Vec<Vec<DeviceScalars>>>,
}

/// One class's step count and learning rate (0-dim float32) on one device.
struct DeviceScalars {
    device: Device,
    count: Tensor,
    lr: Tensor,
}

impl Fused {
    fn scalars(&self, class: usize, device: Device) -> Option<&DeviceScalars> {
        let on_device = self.on_device.as_ref()?;
        on_device.get(class)?.iter().find(|s| s.device == device)
    }
}

impl Implementation for Fused {
    fn which(&self) -> OptimizerImpl {
        OptimizerImpl::Fused
    }

    fn reserve(&mut self, r: Reserve<'_>) {
        for (i, _) in r.live {
            let d = r.params[*i].1.device();
            if !self.steps.iter().any(|(sd, _)| *sd == d) {
                self.steps.push((d, Tensor::zeros([], (Kind::Float, d))));
            }
            // Only CUDA's kernels take their scalars from the device; an update on the host (state
            // moved there by recovery) takes them as arguments.
            if let Some(classes) = self.on_device.as_mut().filter(|_| d.is_cuda()) {
                if classes.len() <= r.class {
                    classes.resize_with(r.class + 1, Vec::new);
                }
                if !classes[r.class].iter().any(|s| s.device == d) {
                    classes[r.class].push(DeviceScalars {
                        device: d,
                        count: Tensor::zeros([], (Kind::Float, d)),
                        lr: Tensor::zeros([], (Kind::Float, d)),
                    });
                }
            }
        }
    }

    fn apply(&self, b: Batch<'_>) -> Result<()> {
        let rule = multi(b.rule);
        for members in groups(&b, false) {
            let (params, grads, state) = lists(&b, &members.idx);
            let staged = self.scalars(b.class, members.device);
            let count = match staged {
                Some(s) => s.count.shallow_clone(),
                None => {
                    let mut count = self
                        .steps
                        .iter()
                        .find(|(d, _)| *d == members.device)
                        .expect("reserved for every device")
                        .1
                        .shallow_clone();
                    let _ = count.f_fill_(b.step.number as f64)?;
                    count
                }
            };
            let steps: Vec<Tensor> = params.iter().map(|_| count.shallow_clone()).collect();
            let g = Group {
                params: &params,
                grads: &grads,
                state: &state,
                state_written: members.written,
                temps: &[],
                steps: &steps,
            };
            let scaling = Scaling {
                grad_scale: b.grad_scale.iter().find(|(d, _)| *d == members.device).map(|(_, t)| t),
                // GradScaler's found_inf makes the kernel skip the step; the step pipeline reads
                // it on the host first and then does not apply the step at all (nor count it),
                // which leaves parameters, state and step count as the kernel would.
                found_inf: None,
                lr: staged.map(|s| &s.lr),
            };
            rule.fused(b.step, g, scaling)?;
        }
        mark_written(b);
        Ok(())
    }

    fn read_scalars_on_device(&mut self) -> bool {
        self.on_device.get_or_insert_with(Vec::new);
        true
    }

    fn reads_scalars_on_device(&self) -> bool {
        self.on_device.is_some()
    }

    fn stage(&mut self, class: usize, step: Step) -> Result<()> {
        let Some(classes) = &mut self.on_device else {
            return Ok(());
        };
        for s in classes.get_mut(class).into_iter().flatten() {
            let _ = s.count.f_fill_(step.number as f64)?;
            let _ = s.lr.f_fill_(step.lr)?;
        }
        Ok(())
    }
}

fn multi(rule: &dyn Rule) -> &dyn super::rule::MultiTensor {
    rule.multi_tensor()
        .expect("resolve() picks a multi-tensor implementation only for rules that have one")
}

/// Live parameters of one device, dtype and state-written flag: positions in `live`.
struct Members {
    device: Device,
    kind: Kind,
    written: bool,
    idx: Vec<usize>,
}

/// The live parameters grouped by device, dtype and whether their state was written (PyTorch
/// groups by device and dtype; the flag only splits a group whose parameters started at
/// different steps); `capped`: each group's elements sum to at most the largest parameter's
/// of its device and dtype.
fn groups(b: &Batch<'_>, capped: bool) -> Vec<Members> {
    let info: Vec<(Device, Kind, bool, usize)> = b
        .live
        .iter()
        .map(|(i, _)| {
            let p = &b.params[*i].1;
            (p.device(), p.kind(), b.state.of_written(*i), p.numel())
        })
        .collect();
    let cap = |d: Device, k: Kind| match capped {
        true => info
            .iter()
            .filter(|x| x.0 == d && x.1 == k)
            .map(|x| x.3)
            .max()
            .unwrap_or(0),
        false => usize::MAX,
    };
    let mut open: Vec<(Members, usize)> = Vec::new();
    let mut done = Vec::new();
    for (j, &(device, kind, written, n)) in info.iter().enumerate() {
        let fresh = || {
            let m = Members {
                device,
                kind,
                written,
                idx: vec![j],
            };
            (m, n)
        };
        let same = |m: &Members| m.device == device && m.kind == kind && m.written == written;
        match open.iter().position(|(m, _)| same(m)) {
            Some(s) if open[s].1 + n <= cap(device, kind) => {
                open[s].0.idx.push(j);
                open[s].1 += n;
            }
            Some(s) => done.push(std::mem::replace(&mut open[s], fresh()).0),
            None => open.push(fresh()),
        }
    }
    done.extend(open.into_iter().map(|(m, _)| m));
    done
}

/// A group's parameters, gradients and state by slot, as shallow clones.
fn lists(b: &Batch<'_>, idx: &[usize]) -> (Vec<Tensor>, Vec<Tensor>, Vec<Vec<Tensor>>) {
    let params = idx.iter().map(|&j| b.params[b.live[j].0].1.shallow_clone()).collect();
    let grads = idx.iter().map(|&j| b.live[j].1.shallow_clone()).collect();
    let slots = b.rule.slots().len();
    let state = (0..slots)
        .map(|s| {
            idx.iter()
                .map(|&j| b.state.of(b.live[j].0)[s].shallow_clone())
                .collect()
        })
        .collect();
    (params, grads, state)
}

fn mark_written(b: Batch<'_>) {
    for (i, _) in b.live {
        b.state.param_mut(*i).written = true;
    }
}
