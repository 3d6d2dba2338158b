//! Layers shared by the torchvision-compatible presets, with PyTorch's variable names and
//! default initialisations (tch's defaults differ: its Linear draws from a wider range and its
//! BatchNorm has no `num_batches_tracked`, which every torchvision `state_dict` carries).
use tch::nn::{self, Init};
use tch::{Kind, Tensor};

/// `torch.nn.BatchNorm2d` (momentum 0.1, eps 1e-5): `weight`, `bias`, `running_mean`,
/// `running_var` and `num_batches_tracked`, counted up on every training forward as PyTorch does.
#[derive(Debug)]
pub struct BatchNorm2d {
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor,
}

impl BatchNorm2d {
    /// `zero_weight`: γ starts at 0 (torchvision's `zero_init_residual` for a block's last BN).
    pub fn new(p: &nn::Path, c: i64, zero_weight: bool) -> Self {
        BatchNorm2d {
            weight: p.var("weight", &[c], Init::Const(if zero_weight { 0.0 } else { 1.0 })),
            bias: p.var("bias", &[c], Init::Const(0.0)),
            running_mean: p.zeros_no_train("running_mean", &[c]),
            running_var: p.ones_no_train("running_var", &[c]),
            num_batches_tracked: p.add(
                "num_batches_tracked",
                Tensor::zeros([], (Kind::Int64, p.device())),
                false,
            ),
        }
    }

    pub fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        if train {
            // Not used with a fixed momentum, but part of the state a torchvision user expects.
            let _ = self.num_batches_tracked.shallow_clone().g_add_scalar_(1);
        }
        x.batch_norm(
            Some(&self.weight),
            Some(&self.bias),
            Some(&self.running_mean),
            Some(&self.running_var),
            train,
            0.1,
            1e-5,
            true,
        )
    }
}

/// `torch.nn.Linear` with PyTorch's default initialisation: weight and bias uniform in
/// ±1/√fan_in (kaiming_uniform with a = √5).
pub fn linear(p: nn::Path, inputs: i64, outputs: i64) -> nn::Linear {
    let b = 1.0 / (inputs as f64).sqrt();
    let u = Init::Uniform { lo: -b, up: b };
    linear_init(p, inputs, outputs, u, u)
}

/// A linear layer with the given initialisations.
pub fn linear_init(p: nn::Path, inputs: i64, outputs: i64, ws: Init, bs: Init) -> nn::Linear {
    nn::linear(
        p,
        inputs,
        outputs,
        nn::LinearConfig {
            ws_init: ws,
            bs_init: Some(bs),
            bias: true,
        },
    )
}

/// Glorot/Xavier uniform bound for a weight `[fan_out, fan_in]`.
pub fn xavier_uniform(fan_in: i64, fan_out: i64) -> Init {
    let b = (6.0 / (fan_in + fan_out) as f64).sqrt();
    Init::Uniform { lo: -b, up: b }
}

/// `torch.nn.LayerNorm(d, eps)`: `weight` 1, `bias` 0.
#[derive(Debug)]
pub struct LayerNorm {
    weight: Tensor,
    bias: Tensor,
    d: i64,
    eps: f64,
}

impl LayerNorm {
    pub fn new(p: &nn::Path, d: i64, eps: f64) -> Self {
        LayerNorm {
            weight: p.var("weight", &[d], Init::Const(1.0)),
            bias: p.var("bias", &[d], Init::Const(0.0)),
            d,
            eps,
        }
    }

    pub fn forward(&self, x: &Tensor) -> Tensor {
        x.layer_norm([self.d], Some(&self.weight), Some(&self.bias), self.eps, true)
    }
}
