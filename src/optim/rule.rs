//! What an optimization algorithm is to the container: a rule for updating one parameter.
use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::forms::{Coefs, Forms, Values};
use crate::shim::Scaling;

/// One state tensor a rule keeps for a parameter: its checkpoint slot name, size and kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub name: &'static str,
    pub size: Vec<i64>,
    pub kind: Kind,
}

/// One algorithm (SGD, Adam, AdamW): the state it keeps per parameter, the temporaries an update
/// needs and the update itself. Where state and temporaries live, which parameters are stepped
/// and when memory is allocated are the container's business (`Optimizer`).
pub trait Rule: std::fmt::Debug + Send + Sync {
    /// Checkpoint names of the state tensors kept per parameter, in slot order (by default each
    /// shaped like the parameter; see `layout`).
    fn slots(&self) -> &'static [&'static str];

    /// Parameter `p`'s state tensors, in slot order. By default one per `slots()`, each shaped
    /// and typed like `p`; a rule whose state is stored otherwise (8-bit Adam: codes and
    /// per-block scales, and fp32 moments for small parameters) says so here.
    fn layout(&self, p: &Tensor) -> Vec<Slot> {
        let slot = |name| Slot {
            name,
            size: p.size(),
            kind: p.kind(),
        };
        self.slots().iter().map(|n| slot(*n)).collect()
    }

    /// Allocates whatever the rule keeps per device (8-bit Adam's quantization maps) before a
    /// step's updates on `device`; the default keeps nothing.
    fn prepare(&self, _device: Device) {}

    /// Parameter-sized temporaries one update needs at once with `forms`.
    fn temporaries(&self, forms: Forms) -> usize;

    /// This step's multipliers (see `forms`), each at the index the rule gives it.
    fn multipliers(&self, step: Step) -> Values;

    /// Updates one parameter in place from its gradient. Allocates nothing parameter-sized: the
    /// temporaries are views of the container's workspace.
    fn update(&self, step: Step, u: ParamUpdate<'_>);

    /// The rule's multi-tensor forms (foreach ops, fused kernels); None: it has only the
    /// single-tensor update (8-bit Adam).
    fn multi_tensor(&self) -> Option<&dyn MultiTensor> {
        None
    }
}

/// A rule as PyTorch's `_multi_tensor_*` and `_fused_*` functions run it: over a group of
/// parameters of one device and dtype at once.
pub trait MultiTensor {
    /// Parameter-shaped temporaries per parameter of a group the foreach update needs at once.
    fn foreach_temporaries(&self) -> usize;

    /// `_multi_tensor_<rule>` for one group, with in-place foreach ops only (the temporaries
    /// are the container's workspace).
    fn foreach(&self, step: Step, g: Group<'_>) -> Result<()>;

    /// `_fused_<rule>` for one group: one in-place kernel, no temporaries.
    fn fused(&self, step: Step, g: Group<'_>, scaling: Scaling) -> Result<()>;
}

/// One group of parameters, all of one device and dtype, with their state written alike.
/// Lists are shallow clones: the ops write through them.
pub struct Group<'a> {
    pub params: &'a [Tensor],
    pub grads: &'a [Tensor],
    /// `state[slot][i]`: parameter i's tensor of each slot.
    pub state: &'a [Vec<Tensor>],
    /// See `ParamUpdate::state_written`.
    pub state_written: bool,
    /// `temps[k][i]`: `foreach_temporaries()` lists of parameter-shaped workspace views.
    pub temps: &'a [Vec<Tensor>],
    /// Fused kernels: each parameter's step count (0-dim float tensors holding this step's).
    pub steps: &'a [Tensor],
}

/// The step being taken: its number (1 for the first update) and learning rate.
#[derive(Debug, Clone, Copy)]
pub struct Step {
    pub number: i64,
    pub lr: f64,
}

/// Everything one parameter's update reads and writes.
pub struct ParamUpdate<'a> {
    pub param: &'a mut Tensor,
    pub grad: &'a Tensor,
    /// The parameter's state, one tensor per slot.
    pub state: &'a mut [Tensor],
    /// False until an update or a restored checkpoint has written `state`: PyTorch creates
    /// state lazily, and SGD's momentum buffer starts as a copy of the first gradient.
    pub state_written: bool,
    /// `temporaries(forms)` parameter-shaped tensors, contents undefined.
    pub temps: &'a [Tensor],
    pub forms: Forms,
    pub coefs: Coefs<'a>,
}
