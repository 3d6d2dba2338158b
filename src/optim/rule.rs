//! What an optimization algorithm is to the container: a rule for updating one parameter.
use tch::{Device, Kind, Tensor};

use super::forms::{Coefs, Forms, Values};

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
