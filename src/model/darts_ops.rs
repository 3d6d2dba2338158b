//! The operations of a DARTS edge (see `darts` for what each computes and what it keeps for
//! backward), and the preprocessing blocks cells share.
use anyhow::{bail, Result};
use tch::nn::{self, Module, ModuleT, RNN};
use tch::Tensor;

use super::layers::Conv;

/// Every operation the supernet knows, by its `ops` name.
pub const KNOWN_OPS: &[&str] = &[
    "none",
    "skip_connect",
    "max_pool_3",
    "avg_pool_3",
    "conv_3",
    "conv_5",
    "sep_conv_3",
    "sep_conv_5",
    "dil_conv_3",
    "dil_conv_5",
    "disjoint_cnn_3x1",
    "disjoint_cnn_5x1",
    "lstm",
    "attention",
    "attention_light",
];

fn bn_cfg() -> nn::BatchNormConfig {
    nn::BatchNormConfig {
        affine: false,
        ..Default::default()
    }
}

/// 1-D convolution without bias, padded so that the length becomes `ceil(L / stride)` (odd `k`).
pub(super) fn conv1d(p: nn::Path, cin: i64, cout: i64, k: i64, stride: i64, dilation: i64, groups: i64) -> Conv {
    let padding = dilation * (k - 1) / 2;
    // tch's 1-D default (the one `nn::conv1d` uses) with this geometry.
    let d = nn::ConvConfig::default();
    let cfg = nn::ConvConfigND::<[i64; 1]> {
        stride: [stride],
        padding: [padding],
        dilation: [dilation],
        groups,
        bias: false,
        ws_init: d.ws_init,
        bs_init: d.bs_init,
        padding_mode: d.padding_mode,
    };
    Conv::new(p, cin, cout, [k], cfg)
}

/// Average pool, kernel 3, padding 1, padding not counted: length `ceil(L / stride)`.
fn avg_pool_3(x: &Tensor, stride: i64) -> Tensor {
    x.avg_pool1d([3], [stride], [1], false, false)
}

/// ReLU-Conv-BN (no affine).
#[derive(Debug)]
pub(super) struct ReluConvBn {
    conv: Conv,
    bn: nn::BatchNorm,
}

impl ReluConvBn {
    pub(super) fn new(p: &nn::Path, cin: i64, cout: i64, k: i64, stride: i64) -> Self {
        ReluConvBn {
            conv: conv1d(p / "conv", cin, cout, k, stride, 1, 1),
            bn: nn::batch_norm1d(p / "bn", cout, bn_cfg()),
        }
    }

    pub(super) fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        self.bn.forward_t(&self.conv.forward(&x.relu()), train)
    }
}

/// Halves the length (to `ceil(L/2)`) with two 1×1 convs of stride 2, the second offset by one
/// sample, concatenated along channels (DARTS' FactorizedReduce).
#[derive(Debug)]
pub(super) struct FactorizedReduce {
    conv1: Conv,
    conv2: Conv,
    bn: nn::BatchNorm,
}

impl FactorizedReduce {
    pub(super) fn new(p: &nn::Path, cin: i64, cout: i64) -> Self {
        let half = cout / 2;
        FactorizedReduce {
            conv1: conv1d(p / "conv1", cin, half, 1, 2, 1, 1),
            conv2: conv1d(p / "conv2", cin, cout - half, 1, 2, 1, 1),
            bn: nn::batch_norm1d(p / "bn", cout, bn_cfg()),
        }
    }

    pub(super) fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let x = x.relu();
        let len = x.size()[2];
        let a = self.conv1.forward(&x);
        let out_len = (len + 1) / 2;
        let b = if len > 1 {
            let b = self.conv2.forward(&x.narrow(2, 1, len - 1));
            // For odd L the offset branch is one sample short; its missing sample is a zero input.
            let short = out_len - b.size()[2];
            if short > 0 {
                b.constant_pad_nd([0, short])
            } else {
                b
            }
        } else {
            let s = a.size();
            Tensor::zeros([s[0], self.conv2.ws.size()[0], out_len], (x.kind(), x.device()))
        };
        self.bn.forward_t(&Tensor::cat(&[a, b], 1), train)
    }
}

/// Multi-head self-attention over the length.
#[derive(Debug)]
pub(super) struct Attention {
    heads: i64,
    qkv: nn::Linear,
    proj: nn::Linear,
    bn: nn::BatchNorm,
}

impl Attention {
    fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        let (n, c, l) = x.size3().expect("attention input [N, C, L]");
        let d = c / self.heads;
        // [N, L, 3C] -> [3, N, H, L, d]
        let qkv = self
            .qkv
            .forward(&x.transpose(1, 2))
            .view([n, l, 3, self.heads, d])
            .permute([2, 0, 3, 1, 4]);
        let (q, k, v) = (qkv.get(0), qkv.get(1), qkv.get(2));
        // One batched call over all heads; fused kernels avoid the L×L score matrix where available.
        let y = Tensor::scaled_dot_product_attention(&q, &k, &v, None::<Tensor>, 0.0, false, None, false);
        let y = self.proj.forward(&y.transpose(1, 2).reshape([n, l, c]));
        self.bn.forward_t(&y.transpose(1, 2), train)
    }
}

/// One candidate operation on an edge. (Variants differ in size; there are only a few hundred ops
/// in a net, so boxing them would buy nothing.)
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Op {
    Identity,
    Reduce(FactorizedReduce),
    MaxPool {
        stride: i64,
        bn: nn::BatchNorm,
    },
    AvgPool {
        stride: i64,
        bn: nn::BatchNorm,
    },
    Conv(ReluConvBn),
    SepConv {
        dw1: Conv,
        pw1: Conv,
        bn1: nn::BatchNorm,
        dw2: Conv,
        pw2: Conv,
        bn2: nn::BatchNorm,
    },
    DilConv {
        dw: Conv,
        pw: Conv,
        bn: nn::BatchNorm,
    },
    Disjoint {
        temporal: Conv,
        bn1: nn::BatchNorm,
        spatial: Conv,
        bn2: nn::BatchNorm,
    },
    Lstm {
        stride: i64,
        channels: i64,
        lstm: nn::LSTM,
        bn: nn::BatchNorm,
    },
    Attention {
        stride: i64,
        att: Attention,
    },
}

impl Op {
    /// Builds op `name` (not "none") for `c` channels under `p`.
    pub(super) fn new(p: &nn::Path, name: &str, c: i64, stride: i64) -> Result<Op> {
        let kernel = |name: &str| -> i64 {
            if name.ends_with("_5") || name.ends_with("5x1") {
                5
            } else {
                3
            }
        };
        Ok(match name {
            "skip_connect" if stride == 1 => Op::Identity,
            "skip_connect" => Op::Reduce(FactorizedReduce::new(p, c, c)),
            "max_pool_3" => Op::MaxPool {
                stride,
                bn: nn::batch_norm1d(p / "bn", c, bn_cfg()),
            },
            "avg_pool_3" => Op::AvgPool {
                stride,
                bn: nn::batch_norm1d(p / "bn", c, bn_cfg()),
            },
            "conv_3" | "conv_5" => Op::Conv(ReluConvBn::new(p, c, c, kernel(name), stride)),
            "sep_conv_3" | "sep_conv_5" => {
                let k = kernel(name);
                Op::SepConv {
                    dw1: conv1d(p / "dw1", c, c, k, stride, 1, c),
                    pw1: conv1d(p / "pw1", c, c, 1, 1, 1, 1),
                    bn1: nn::batch_norm1d(p / "bn1", c, bn_cfg()),
                    dw2: conv1d(p / "dw2", c, c, k, 1, 1, c),
                    pw2: conv1d(p / "pw2", c, c, 1, 1, 1, 1),
                    bn2: nn::batch_norm1d(p / "bn2", c, bn_cfg()),
                }
            }
            "dil_conv_3" | "dil_conv_5" => {
                let k = kernel(name);
                Op::DilConv {
                    dw: conv1d(p / "dw", c, c, k, stride, 2, c),
                    pw: conv1d(p / "pw", c, c, 1, 1, 1, 1),
                    bn: nn::batch_norm1d(p / "bn", c, bn_cfg()),
                }
            }
            "disjoint_cnn_3x1" | "disjoint_cnn_5x1" => {
                let k = kernel(name);
                let temporal = nn::ConvConfigND::<[i64; 2]> {
                    stride: [1, stride],
                    padding: [0, (k - 1) / 2],
                    bias: false,
                    ..Default::default()
                };
                let spatial = nn::ConvConfigND::<[i64; 2]> {
                    bias: false,
                    ..Default::default()
                };
                Op::Disjoint {
                    temporal: Conv::new(p / "temporal", 1, c, [1, k], temporal),
                    bn1: nn::batch_norm2d(p / "bn1", c, bn_cfg()),
                    spatial: Conv::new(p / "spatial", c, c, [c, 1], spatial),
                    bn2: nn::batch_norm2d(p / "bn2", c, bn_cfg()),
                }
            }
            "lstm" => {
                let hidden = (c + 1) / 2;
                let cfg = nn::RNNConfig {
                    bidirectional: true,
                    batch_first: true,
                    ..Default::default()
                };
                Op::Lstm {
                    stride,
                    channels: c,
                    lstm: nn::lstm(p / "lstm", c, hidden, cfg),
                    bn: nn::batch_norm1d(p / "bn", c, bn_cfg()),
                }
            }
            "attention" | "attention_light" => {
                let heads = if name == "attention" { 4 } else { 2 };
                if c % heads != 0 {
                    bail!("op \"{name}\" splits {c} channels into {heads} heads; use an init_channels that is a multiple of 4")
                }
                Op::Attention {
                    stride,
                    att: Attention {
                        heads,
                        qkv: nn::linear(p / "qkv", c, 3 * c, Default::default()),
                        proj: nn::linear(p / "proj", c, c, Default::default()),
                        bn: nn::batch_norm1d(p / "bn", c, bn_cfg()),
                    },
                }
            }
            other => bail!("unknown DARTS operation \"{other}\"; known: {}", KNOWN_OPS.join(", ")),
        })
    }

    pub(super) fn forward_t(&self, x: &Tensor, train: bool) -> Tensor {
        match self {
            Op::Identity => x.shallow_clone(),
            Op::Reduce(r) => r.forward_t(x, train),
            Op::MaxPool { stride, bn } => bn.forward_t(&x.max_pool1d([3], [*stride], [1], [1], false), train),
            Op::AvgPool { stride, bn } => bn.forward_t(&avg_pool_3(x, *stride), train),
            Op::Conv(c) => c.forward_t(x, train),
            Op::SepConv {
                dw1,
                pw1,
                bn1,
                dw2,
                pw2,
                bn2,
            } => {
                let y = bn1.forward_t(&pw1.forward(&dw1.forward(&x.relu())), train);
                bn2.forward_t(&pw2.forward(&dw2.forward(&y.relu())), train)
            }
            Op::DilConv { dw, pw, bn } => bn.forward_t(&pw.forward(&dw.forward(&x.relu())), train),
            Op::Disjoint {
                temporal,
                bn1,
                spatial,
                bn2,
            } => {
                // [N, C, L] -> [N, 1, C, L] -> [N, C, C, L'] -> [N, C, 1, L'] -> [N, C, L']
                let y = bn1.forward_t(&temporal.forward(&x.relu().unsqueeze(1)), train);
                bn2.forward_t(&spatial.forward(&y.relu()), train).squeeze_dim(2)
            }
            Op::Lstm {
                stride,
                channels,
                lstm,
                bn,
            } => {
                let x = if *stride > 1 {
                    avg_pool_3(x, *stride)
                } else {
                    x.shallow_clone()
                };
                let (y, _) = lstm.seq(&x.transpose(1, 2).contiguous());
                let y = y.transpose(1, 2);
                let y = if y.size()[1] > *channels {
                    y.narrow(1, 0, *channels)
                } else {
                    y
                };
                bn.forward_t(&y, train)
            }
            Op::Attention { stride, att } => {
                if *stride > 1 {
                    att.forward_t(&avg_pool_3(x, *stride), train)
                } else {
                    att.forward_t(x, train)
                }
            }
        }
    }
}
