//! `torch.optim.Adam` and `AdamW` (single-tensor implementation, amsgrad and maximize off).
use anyhow::Result;
use tch::Tensor;

use super::forms::{add_scaled_into, scale_, scale_into, Forms, Values};
use super::rule::{Group, MultiTensor, ParamUpdate, Rule, Step};
use crate::shim::{self, FusedAdam, Scaling};
use shim::Foreach::*;

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

    fn multi_tensor(&self) -> Option<&dyn MultiTensor> {
        Some(self)
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

impl MultiTensor for Adam {
    /// The decayed gradients (Adam with weight decay only) and the denominators.
    fn foreach_temporaries(&self) -> usize {
        match (self.weight_decay != 0.0, self.decay) {
            (true, Decay::Coupled) => 2,
            _ => 1,
        }
    }

    /// `_multi_tensor_adam` (not capturable): the same foreach ops with the same Python numbers;
    /// its two out-of-place ops (the decayed gradients, the square roots) are a copy into the
    /// workspace and the op in place there, which computes the same values.
    fn foreach(&self, step: Step, g: Group<'_>) -> Result<()> {
        let Group {
            params,
            grads,
            state,
            temps,
            ..
        } = g;
        let [exp_avgs, exp_avg_sqs] = state else {
            unreachable!("Adam keeps two state slots")
        };
        let none: &[Tensor] = &[];
        let [beta1, beta2] = self.betas;
        let mut g = grads;
        if self.weight_decay != 0.0 {
            match self.decay {
                Decay::Decoupled => shim::foreach(Mul(1.0 - step.lr * self.weight_decay), params, none, none)?,
                Decay::Coupled => {
                    shim::foreach(Copy, &temps[0], grads, none)?;
                    shim::foreach(Add(self.weight_decay), &temps[0], params, none)?;
                    g = &temps[0];
                }
            }
        }
        shim::foreach(Lerp(1.0 - beta1), exp_avgs, g, none)?;
        shim::foreach(Mul(beta2), exp_avg_sqs, none, none)?;
        shim::foreach(Addcmul(1.0 - beta2), exp_avg_sqs, g, g)?;
        // Python floats, as `_get_value(step)` makes them (the step count is exact in f32).
        let t = step.number as f64;
        let bias_correction1 = 1.0 - beta1.powf(t);
        let bias_correction2 = 1.0 - beta2.powf(t);
        // `(lr / bc) * -1` in Python: a multiply by -1 is the negation, exactly.
        let step_size = vec![-(step.lr / bias_correction1); params.len()];
        let bias_correction2_sqrt = vec![bias_correction2.powf(0.5); params.len()];
        let denom = temps.last().expect("a denominator temporary");
        shim::foreach(Copy, denom, exp_avg_sqs, none)?;
        shim::foreach(Sqrt, denom, none, none)?;
        shim::foreach(DivList(&bias_correction2_sqrt), denom, none, none)?;
        shim::foreach(AddScalar(self.eps), denom, none, none)?;
        shim::foreach(AddcdivList(&step_size), params, exp_avgs, denom)
    }

    fn fused(&self, step: Step, g: Group<'_>, scaling: Scaling) -> Result<()> {
        let h = FusedAdam {
            lr: step.lr,
            betas: self.betas,
            weight_decay: self.weight_decay,
            eps: self.eps,
            decoupled: self.decay == Decay::Decoupled,
        };
        let [exp_avgs, exp_avg_sqs] = g.state else {
            unreachable!("Adam keeps two state slots")
        };
        shim::fused_adam(h, g.params, g.grads, [exp_avgs, exp_avg_sqs], g.steps, scaling)
    }
}
