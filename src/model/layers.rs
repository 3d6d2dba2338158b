//! Layers shared by the torchvision-compatible presets, with PyTorch's variable names and
//! default initialisations (tch's defaults differ: its Linear draws from a wider range and its
//! BatchNorm has no `num_batches_tracked`, which every torchvision `state_dict` carries).
use tch::nn::{self, Init};
use tch::{Device, Kind, Tensor};

/// `torch.nn.BatchNorm2d` (momentum 0.1, eps 1e-5): `weight`, `bias`, `running_mean`,
/// `running_var` and `num_batches_tracked`, counted up on every training forward as PyTorch does.
#[derive(Debug)]
pub struct BatchNorm2d {
    weight: Tensor,
    bias: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    num_batches_tracked: Tensor,
    /// `train.freeze_batchnorm_stats`: with weight and bias frozen, the layer runs as in eval
    /// mode (its running statistics normalize and stay unchanged).
    frozen_stats: std::sync::atomic::AtomicBool,
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
            frozen_stats: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether a layer whose weight and bias are both frozen keeps its running statistics.
    pub fn keep_stats_when_frozen(&self, on: bool) {
        self.frozen_stats.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Training mode for this forward: off where the layer is frozen and keeps its statistics
    /// (decided at each forward, so unfreezing the layer brings it back).
    fn trains(&self, train: bool) -> bool {
        let frozen = !self.weight.requires_grad() && !self.bias.requires_grad();
        train && !(frozen && self.frozen_stats.load(std::sync::atomic::Ordering::Relaxed))
    }

    pub fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let train = self.trains(train);
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

/// A zero-padded `torch.nn.Conv1d`/`Conv2d` (tch's `nn::conv`, the same variables) whose forward
/// gives libtorch's bf16 CPU kernel no weight taps that meet only padding.
///
/// oneDNN's bf16 backward-weights convolution (`jit_bf16:avx512_core_bf16`, which libtorch 2.11
/// picks on CPUs with AVX512-BF16) leaves the weight gradient of such taps unwritten when they
/// lie along the width and the stride is wider than the input: a 3×3 stride-2 convolution on a
/// 1×1 map, as in ResNet18's layer4 on 16-pixel images. Those gradient values are whatever the buffer held:
/// zeros from a fresh mmap, old floats (NaN among them) from recycled heap memory. Their true
/// value is exactly 0, so on the CPU in bf16 the forward takes the weight through
/// `where(live, w, 0)`: the output is unchanged (those taps multiply padding only, and oneDNN
/// skips them) and their gradient is an exact 0. `scripts/onednn_dead_taps.py` reproduces the
/// kernel's fault in plain PyTorch.
#[derive(Debug)]
pub struct Conv {
    pub ws: Tensor,
    pub bs: Option<Tensor>,
    stride: Vec<i64>,
    padding: Vec<i64>,
    dilation: Vec<i64>,
    groups: i64,
}

impl Conv {
    pub fn new<ND: AsRef<[i64]> + Copy>(
        p: nn::Path,
        cin: i64,
        cout: i64,
        kernel: ND,
        cfg: nn::ConvConfigND<ND>,
    ) -> Self {
        assert!(matches!(cfg.padding_mode, nn::PaddingMode::Zeros), "zero padding only");
        let c = nn::conv(p, cin, cout, kernel, cfg);
        Conv {
            ws: c.ws,
            bs: c.bs,
            stride: cfg.stride.as_ref().to_vec(),
            padding: cfg.padding.as_ref().to_vec(),
            dilation: cfg.dilation.as_ref().to_vec(),
            groups: cfg.groups,
        }
    }

    /// The weight with the taps that see only padding (for this input's size) set to 0, where
    /// the bf16 kernel would leave their gradient unwritten; None where nothing needs changing.
    fn live_weight(&self, x: &Tensor) -> Option<Tensor> {
        let bf16 = self.ws.kind() == Kind::BFloat16 || crate::shim::autocast_enabled(Device::Cpu);
        if self.ws.device() != Device::Cpu || !bf16 {
            return None;
        }
        let ks = self.ws.size();
        let xs = x.size();
        let nd = ks.len() - 2;
        let live: Vec<Vec<bool>> = (0..nd)
            .map(|d| {
                let (input, k) = (xs[xs.len() - nd + d], ks[2 + d]);
                let (s, p, dil) = (self.stride[d], self.padding[d], self.dilation[d]);
                let out = (input + 2 * p - dil * (k - 1) - 1).div_euclid(s) + 1;
                (0..k).map(|t| tap_is_live(input, out, s, p, t * dil)).collect()
            })
            .collect();
        // Only the width's taps go unwritten, and only when the stride is wider than the input
        // (856 geometries swept: every fault had both, no geometry without them faulted). That
        // keeps the extra `where` out of ordinary shapes: at 32 pixels ResNet18's layer4 has dead
        // taps too, but a stride no wider than its 2×2 input.
        let last = nd - 1;
        let width = xs[xs.len() - 1];
        if self.stride[last] <= width || live[last].iter().all(|&l| l) {
            return None;
        }
        // Row-major over the kernel's dimensions: a tap is live when it is live in every one.
        let mut mask = vec![true];
        for dim in &live {
            mask = mask.iter().flat_map(|&m| dim.iter().map(move |&l| m && l)).collect();
        }
        let mut shape = vec![1, 1];
        shape.extend_from_slice(&ks[2..]);
        let mask = Tensor::from_slice(&mask).reshape(shape.as_slice());
        Some(self.ws.where_scalarother(&mask, 0.0))
    }
}

/// A convolution's shape and geometry, for an adapter that mirrors it.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvGeometry {
    pub inputs: i64,
    pub outputs: i64,
    pub kernel: Vec<i64>,
    pub stride: Vec<i64>,
    pub padding: Vec<i64>,
}

impl Conv {
    /// Its channels, kernel, stride and padding; an adapter has no place for dilation or groups,
    /// which the presets that adapt convolutions never set.
    pub fn geometry(&self) -> ConvGeometry {
        assert!(
            self.groups == 1 && self.dilation.iter().all(|&d| d == 1),
            "an adapted convolution has neither groups nor dilation"
        );
        let s = self.ws.size();
        ConvGeometry {
            inputs: s[1],
            outputs: s[0],
            kernel: s[2..].to_vec(),
            stride: self.stride.clone(),
            padding: self.padding.clone(),
        }
    }
}

/// Whether kernel offset `off` (tap × dilation) meets the input for some output position `o` in
/// `0..out`: `0 <= o·s − p + off < input`.
fn tap_is_live(input: i64, out: i64, s: i64, p: i64, off: i64) -> bool {
    let first = (p - off + s - 1).div_euclid(s).max(0);
    let last = (input - 1 + p - off).div_euclid(s).min(out - 1);
    first <= last
}

impl nn::Module for Conv {
    fn forward(&self, x: &Tensor) -> Tensor {
        let live = self.live_weight(x);
        let w = live.as_ref().unwrap_or(&self.ws);
        let (s, p, d, g) = (&self.stride[..], &self.padding[..], &self.dilation[..], self.groups);
        match self.ws.dim() {
            3 => x.conv1d(w, self.bs.as_ref(), s, p, d, g),
            4 => x.conv2d(w, self.bs.as_ref(), s, p, d, g),
            n => panic!("a {n}-dimensional convolution weight"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn taps_meeting_only_padding_are_found() {
        // 3 taps, stride 2, padding 1 on a 1-wide input: one output, only the centre tap meets it.
        let live: Vec<bool> = (0..3).map(|t| tap_is_live(1, 1, 2, 1, t)).collect();
        assert_eq!(live, [false, true, false]);
        // On a 2-wide input the output at 0 sees input 0 with tap 1 and input 1 with tap 2.
        let live: Vec<bool> = (0..3).map(|t| tap_is_live(2, 1, 2, 1, t)).collect();
        assert_eq!(live, [false, true, true]);
        // Dilation 2, kernel 3 (offsets 0, 2, 4), padding 2, stride 1 on 1 sample: the centre only.
        let live: Vec<bool> = (0..3).map(|t| tap_is_live(1, 1, 1, 2, 2 * t)).collect();
        assert_eq!(live, [false, true, false]);
        // An ordinary shape: every tap meets the input.
        assert!((0..3).all(|t| tap_is_live(8, 4, 2, 1, t)));
    }
}
