//! `torch.optim.SGD` (single-tensor implementation, dampening 0, maximize off).
use super::forms::{add_scaled_, add_scaled_into, scale_, Forms, Values};
use super::rule::{ParamUpdate, Rule, Step};

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
