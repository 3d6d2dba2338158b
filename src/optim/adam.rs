//! `torch.optim.Adam` and `AdamW` (single-tensor implementation, amsgrad and maximize off).
use tch::Tensor;

use super::forms::{add_scaled_into, scale_, scale_into, Forms, Values};
use super::rule::{ParamUpdate, Rule, Step};

/// Adam, or AdamW with decoupled weight decay: the two differ only in how the decay is applied.
#[derive(Debug, Clone, Copy)]
pub struct Adam {
    pub betas: [f64; 2],
    pub eps: f64,
    pub weight_decay: f64,
    pub decay: Decay,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decay {
    /// Adam: the L2 penalty is added to the gradient.
    Coupled,
    /// AdamW: the parameter shrinks by `lr * weight_decay` before the update.
    Decoupled,
}

const WEIGHT_DECAY: usize = 0;
const ONE_MINUS_BETA2: usize = 1;
const NEG_STEP_SIZE: usize = 2;
const BETA2: usize = 3;
/// AdamW: `1 - lr * weight_decay`.
const SHRINK: usize = 4;

impl Rule for Adam {
    fn slots(&self) -> &'static [&'static str] {
        &["exp_avg", "exp_avg_sq"]
    }

    /// The decayed gradient (later the update's numerator) and the denominator.
    fn temporaries(&self, _: Forms) -> usize {
        2
    }

    fn multipliers(&self, step: Step) -> Values {
        // As in _single_tensor_adam (non-capturable): Python floats, i.e. f64 and libm pow.
        let bias_correction1 = 1.0 - self.betas[0].powf(step.number as f64);
        let mut v = Values::default();
        v[WEIGHT_DECAY] = self.weight_decay;
        v[ONE_MINUS_BETA2] = 1.0 - self.betas[1];
        v[NEG_STEP_SIZE] = -(step.lr / bias_correction1);
        v[BETA2] = self.betas[1];
        v[SHRINK] = 1.0 - step.lr * self.weight_decay;
        v
    }

    /// `_single_tensor_adam` for one parameter.
    fn update(&self, step: Step, u: ParamUpdate<'_>) {
        let ParamUpdate {
            param,
            grad,
            state,
            temps,
            forms,
            coefs,
            ..
        } = u;
        let [exp_avg, exp_avg_sq] = state else {
            unreachable!("Adam keeps two state slots")
        };
        let bias_correction2_sqrt = (1.0 - self.betas[1].powf(step.number as f64)).powf(0.5);
        let mut own_grad: Option<Tensor> = None;
        if self.weight_decay != 0.0 {
            match self.decay {
                // param.mul_(1 - lr * weight_decay)
                Decay::Decoupled => scale_(param, coefs.get(SHRINK)),
                // grad = grad.add(param, alpha=weight_decay)
                Decay::Coupled => {
                    add_scaled_into(&temps[0], grad, param, coefs.get(WEIGHT_DECAY));
                    own_grad = Some(temps[0].shallow_clone());
                }
            }
        }
        let g = own_grad.as_ref().unwrap_or(grad);
        // exp_avg.lerp_(grad, 1 - beta1)
        let _ = exp_avg.lerp_(g, 1.0 - self.betas[0]);
        // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        scale_(exp_avg_sq, coefs.get(BETA2));
        let denom = &temps[1];
        let one_minus_beta2 = coefs.get(ONE_MINUS_BETA2);
        match forms {
            Forms::Device => {
                let _ = g.mul_out(denom, g);
                let _ = exp_avg_sq.addcmul_(denom, one_minus_beta2.alpha());
            }
            Forms::Cpu | Forms::Unfused => {
                scale_into(denom, g, one_minus_beta2);
                let _ = exp_avg_sq.addcmul_(denom, g);
            }
        }
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let _ = exp_avg_sq.sqrt_out(denom);
        let _ = denom.shallow_clone().g_div_scalar_(bias_correction2_sqrt);
        let _ = denom.shallow_clone().g_add_scalar_(self.eps);
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        let neg_step_size = coefs.get(NEG_STEP_SIZE);
        match forms {
            Forms::Device => {
                let _ = exp_avg.div_out(denom, denom);
                let _ = param.addcmul_(denom, neg_step_size.alpha());
            }
            Forms::Cpu | Forms::Unfused => {
                // Slot 0 holds the decayed grad, which is dead by now.
                let upd = &temps[0];
                scale_into(upd, exp_avg, neg_step_size);
                let _ = param.addcdiv_(upd, denom);
            }
        }
    }
}
