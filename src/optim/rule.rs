//! What an optimization algorithm is to the container: a rule for updating one parameter.
use tch::Tensor;

use super::forms::{Coefs, Forms, Values};

/// One algorithm (SGD, Adam, AdamW): the state it keeps per parameter, the temporaries an update
/// needs and the update itself. Where state and temporaries live, which parameters are stepped
/// and when memory is allocated are the container's business (`Optimizer`).
pub trait Rule: std::fmt::Debug + Send + Sync {
    /// Checkpoint names of the state tensors kept per parameter (each shaped like it), in slot
    /// order.
    fn slots(&self) -> &'static [&'static str];

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
