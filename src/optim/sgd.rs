//! `torch.optim.SGD` (single-tensor implementation, dampening 0, maximize off).
use anyhow::Result;
use tch::Tensor;

use super::forms::{add_scaled_, add_scaled_into, scale_, Forms, Values};
use super::rule::{Group, MultiTensor, ParamUpdate, Rule, Step};
use crate::shim::{self, FusedSgd, Scaling};
use shim::Foreach::*;

/// SGD with optional momentum (heavy-ball or Nesterov) and L2 weight decay.
#[derive(Debug, Clone, Copy)]
pub struct Sgd {
    pub momentum: f64,
    pub nesterov: bool,
    pub weight_decay: f64,
}

const NEG_LR: usize = 0;
const WEIGHT_DECAY: usize = 1;
const MOMENTUM: usize = 2;

impl Rule for Sgd {
    fn slots(&self) -> &'static [&'static str] {
        match self.momentum != 0.0 {
            true => &["momentum_buffer"],
            false => &[],
        }
    }

    /// The decayed or Nesterov gradient, and for the unfused forms the scratch their
    /// `add(alpha)` builds its product in.
    fn temporaries(&self, forms: Forms) -> usize {
        match forms {
            Forms::Unfused => 2,
            Forms::Cpu | Forms::Device => 1,
        }
    }

    fn multipliers(&self, step: Step) -> Values {
        let mut v = Values::default();
        v[NEG_LR] = -step.lr;
        v[WEIGHT_DECAY] = self.weight_decay;
        v[MOMENTUM] = self.momentum;
        v
    }

    fn multi_tensor(&self) -> Option<&dyn MultiTensor> {
        Some(self)
    }

    /// `_single_tensor_sgd` for one parameter.
    fn update(&self, _: Step, u: ParamUpdate<'_>) {
        let ParamUpdate {
            param,
            grad,
            state,
            state_written,
            temps,
            coefs,
            ..
        } = u;
        let scratch = temps.get(1);
        let neg_lr = coefs.get(NEG_LR);
        // grad = grad.add(param, alpha=weight_decay), in the workspace
        let mut d_p = (self.weight_decay != 0.0).then(|| {
            add_scaled_into(&temps[0], grad, param, coefs.get(WEIGHT_DECAY));
            temps[0].shallow_clone()
        });
        // Only momentum keeps a buffer.
        let Some(buf) = state.first_mut() else {
            return add_scaled_(param, d_p.as_ref().unwrap_or(grad), neg_lr, scratch);
        };
        let momentum = coefs.get(MOMENTUM);
        let g = d_p.as_ref().unwrap_or(grad);
        if state_written {
            // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
            scale_(buf, momentum);
            let _ = buf.g_add_(g);
        } else {
            // buf = torch.clone(grad).detach()
            buf.copy_(g);
        }
        if !self.nesterov {
            return add_scaled_(param, buf, neg_lr, scratch);
        }
        // grad = grad.add(buf, alpha=momentum); our own temporary can be updated in place.
        match d_p.as_mut() {
            Some(d) => add_scaled_(d, buf, momentum, scratch),
            None => {
                add_scaled_into(&temps[0], grad, buf, momentum);
                d_p = Some(temps[0].shallow_clone());
            }
        }
        // param.add_(grad, alpha=-lr)
        add_scaled_(param, d_p.as_ref().expect("set above"), neg_lr, scratch);
    }
}

impl MultiTensor for Sgd {
    /// The decayed (and for Nesterov, the look-ahead) gradients.
    fn foreach_temporaries(&self) -> usize {
        usize::from(self.weight_decay != 0.0 || self.nesterov)
    }

    /// `_multi_tensor_sgd` (dampening 0). Where PyTorch adds the Nesterov term to the gradients
    /// in place, this adds it to their copy in the workspace: the same values, and the
    /// gradients stay as backward left them.
    fn foreach(&self, step: Step, g: Group<'_>) -> Result<()> {
        let Group {
            params,
            grads,
            state,
            state_written,
            temps,
            ..
        } = g;
        let none: &[Tensor] = &[];
        let mut d_p = grads;
        if self.weight_decay != 0.0 || self.nesterov {
            shim::foreach(Copy, &temps[0], grads, none)?;
            d_p = &temps[0];
        }
        if self.weight_decay != 0.0 {
            shim::foreach(Add(self.weight_decay), &temps[0], params, none)?;
        }
        if let Some(bufs) = state.first() {
            if state_written {
                shim::foreach(Mul(self.momentum), bufs, none, none)?;
                shim::foreach(Add(1.0), bufs, d_p, none)?;
            } else {
                shim::foreach(Copy, bufs, d_p, none)?;
            }
            match self.nesterov {
                true => shim::foreach(Add(self.momentum), &temps[0], bufs, none)?,
                false => d_p = bufs,
            }
        }
        shim::foreach(Add(-step.lr), params, d_p, none)
    }

    fn fused(&self, step: Step, g: Group<'_>, scaling: Scaling) -> Result<()> {
        let h = FusedSgd {
            lr: step.lr,
            momentum: self.momentum,
            nesterov: self.nesterov,
            weight_decay: self.weight_decay,
            first_step: !g.state_written,
        };
        let bufs = g.state.first().map_or(&[][..], |b| b.as_slice());
        shim::fused_sgd(h, g.params, g.grads, bufs, scaling)
    }
}
