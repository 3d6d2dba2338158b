//! `darts`: a DARTS supernet (Liu et al., 2019, first-order search space) for 1-D signals.
//!
//! Input `[N, in_channels, L]`, output logits `[N, num_classes]`.
//!
//! * **Stem**: `Conv1d(in_channels → 3·init_channels, k=3, pad=1, no bias)` + `BatchNorm1d` (affine).
//!   The stem multiplier is 3, as in DARTS.
//! * **Cells**: `num_cells` cells; cells `num_cells/3` and `2·num_cells/3` (integer division, one
//!   reduction if they coincide) are reduction cells, which halve the length (`ceil(L/2)`) and
//!   double the channel count `C` (starting at `init_channels`). A cell takes the outputs of the two
//!   previous cells, `s0` and `s1`, preprocessed to `C` channels (ReLU-Conv1x1-BN; a FactorizedReduce
//!   for `s0` when the previous cell was a reduction), and has `num_nodes` intermediate nodes. Node `i`
//!   sums a MixedOp edge from each of `s0`, `s1` and nodes `0..i`; a MixedOp is
//!   `Σ_k softmax(α[edge])_k · op_k(x)`. In a reduction cell the edges leaving `s0`/`s1` have stride 2.
//!   The cell output is the concatenation of its nodes (`num_nodes · C` channels).
//! * **Head**: global average pool over the length, then `Linear(→ num_classes)`.
//! * **Architecture weights**: `arch.alpha_normal` and `arch.alpha_reduce`, each
//!   `[num_edges, num_ops]` with `num_edges = Σ_{i<num_nodes} (2 + i)`, initialised to `1e-3 · randn`.
//!   Everything else lives under `stem.*`, `cells.<i>.*` and `classifier.*`; inside a cell, the op of
//!   edge `e` named `op` is under `cells.<i>.edges.<e>.<op>.*`.
//!
//! All batch norms inside cells (preprocessing and ops) have no affine parameters, as in the DARTS
//! search phase. All ops keep the channel count `C` and map length `L` to `ceil(L / stride)`.
//!
//! | op | computes | memory (activations kept for backward, per edge) |
//! |----|----------|--------------------------------------------------|
//! | `none` | zeros (of the reduced length with stride 2) | none: it contributes nothing to the sum, so it is never computed; it only takes a share of the softmax |
//! | `skip_connect` | identity; with stride 2 a FactorizedReduce (ReLU, two 1×1 convs of stride 2 offset by one sample, concat, BN) | none at stride 1; about 2·C·L′ at stride 2 |
//! | `max_pool_3` | max pool, kernel 3, pad 1, then BN | about 2·C·L′ |
//! | `avg_pool_3` | average pool, kernel 3, pad 1, padding not counted, then BN | about 2·C·L′ |
//! | `conv_3`, `conv_5` | ReLU-Conv(k)-BN | about 3·C·L′ |
//! | `sep_conv_3`, `sep_conv_5` | twice ReLU-depthwise Conv(k)-pointwise Conv1x1-BN (the first with the stride) | about 8·C·L′ |
//! | `dil_conv_3`, `dil_conv_5` | ReLU-depthwise Conv(k, dilation 2)-pointwise Conv1x1-BN | about 4·C·L′ |
//! | `disjoint_cnn_3x1`, `disjoint_cnn_5x1` | disjoint CNN (Foumani et al., 2021): the signal as a 2-D map `[N, 1, C, L]`, ReLU, temporal Conv2d `1×k` (C filters, stride along L), BN, ReLU, spatial Conv2d `C×1` (C filters), BN, back to `[N, C, L′]` | **high**: the temporal stage is `[N, C, C, L′]`, C times a conv op (about 3·C²·L′); the spatial kernel has C³ weights |
//! | `lstm` | (avg pool, stride 2, when reducing) bidirectional LSTM over the length, `ceil(C/2)` hidden units per direction (output cut to C channels), then BN | **high**: gates and states of every time step (about 12·C·L′), and L′ sequential steps (slow on CPU) |
//! | `attention` | (avg pool, stride 2, when reducing) multi-head self-attention over the length, 4 heads, embed dim C, QKV and output projections, then BN | **high**: O(L′²) work per head; the score matrix `[N, heads, L′, L′]` is materialised unless a fused (flash / memory-efficient) kernel is used; `scaled_dot_product_attention` picks one where it can |
//! | `attention_light` | the same with 2 heads | as `attention` (half the score matrices when materialised) |
//!
//! `L′ = ceil(L / stride)`. `disjoint_cnn_*`, `lstm` and `attention*` are the memory-hungry ops:
//! leave them out of `ops` on small GPUs. Attention is also the slow one: its work grows with L′²
//! (at L = 3000 it is about 80% of a darts_4gb step on a 2-core CPU).
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use tch::nn::{self, Module, ModuleT};
use tch::{Kind, Tensor};

use super::layers::Conv;
use super::preset::{run_chain, Built, Chain, ExtraStep, Genotype, Net, Preset};
use crate::optim::Hyper;
use crate::spec::schema::{OptimizerImpl, OptimizerKind};

/// Channels of the stem, as a multiple of `init_channels` (3 in DARTS).
const STEM_MULTIPLIER: i64 = 3;

/// Number of MixedOp edges in a cell with `num_nodes` intermediate nodes.
fn num_edges(num_nodes: usize) -> usize {
    (0..num_nodes).map(|i| 2 + i).sum()
}

/// The discrete architecture α selects, as in DARTS: per node, the two incoming edges whose
/// strongest op other than `"none"` has the largest softmax weight, strongest first, each with that
/// op. Ties go to the earlier edge and the earlier op.
///
/// `alpha` is `[num_edges, ops.len()]`, edges ordered node by node (`offset_i + j`).
///
/// # Panics
/// If `alpha` does not have that shape or `ops` has no op besides `"none"`.
pub fn derive_genotype(alpha: &Tensor, ops: &[String], num_nodes: usize) -> Vec<Vec<(String, usize)>> {
    let edges = num_edges(num_nodes);
    let size = alpha.size();
    assert_eq!(
        size,
        [edges as i64, ops.len() as i64],
        "derive_genotype: alpha has shape {size:?}, expected [{edges}, {}] for {num_nodes} nodes and ops {ops:?}",
        ops.len()
    );
    assert!(
        ops.iter().any(|o| o != "none"),
        "derive_genotype: ops {ops:?} has no op besides \"none\""
    );
    let w: Vec<f32> = tch::no_grad(|| {
        let w = alpha
            .detach()
            .to_kind(Kind::Float)
            .softmax(-1, Kind::Float)
            .to_device(tch::Device::Cpu);
        Vec::<f32>::try_from(w.flatten(0, -1)).expect("alpha to Vec<f32>")
    });
    let k = ops.len();
    let mut out = Vec::with_capacity(num_nodes);
    let mut offset = 0;
    for i in 0..num_nodes {
        // Per incoming edge j: (best weight, best op index), "none" excluded.
        let mut best: Vec<(usize, f32, usize)> = (0..2 + i)
            .map(|j| {
                let row = &w[(offset + j) * k..(offset + j + 1) * k];
                let (op, wt) = row.iter().enumerate().filter(|(o, _)| ops[*o] != "none").fold(
                    (usize::MAX, f32::NEG_INFINITY),
                    |acc, (o, &v)| if v > acc.1 { (o, v) } else { acc },
                );
                (j, wt, op)
            })
            .collect();
        // Stable: ties keep the earlier edge first.
        best.sort_by(|a, b| b.1.total_cmp(&a.1));
        out.push(best.iter().take(2).map(|&(j, _, op)| (ops[op].clone(), j)).collect());
        offset += 2 + i;
    }
    out
}

mod ops;
pub use ops::KNOWN_OPS;
use ops::{conv1d, Edge, FactorizedReduce, Op, ReluConvBn};

#[derive(Debug)]
enum Pre0 {
    Plain(ReluConvBn),
    Reduce(FactorizedReduce),
}

#[derive(Debug)]
struct Cell {
    reduction: bool,
    pre0: Pre0,
    pre1: ReluConvBn,
    edges: Vec<Edge>,
    num_nodes: usize,
}

impl Cell {
    #[allow(clippy::too_many_arguments)]
    fn new(
        p: &nn::Path,
        ops: &[String],
        num_nodes: usize,
        c_pp: i64,
        c_p: i64,
        c: i64,
        reduction: bool,
        reduction_prev: bool,
    ) -> Result<Cell> {
        let pre0 = if reduction_prev {
            Pre0::Reduce(FactorizedReduce::new(&(p / "pre0"), c_pp, c))
        } else {
            Pre0::Plain(ReluConvBn::new(&(p / "pre0"), c_pp, c, 1, 1))
        };
        let pre1 = ReluConvBn::new(&(p / "pre1"), c_p, c, 1, 1);
        let mut edges = Vec::with_capacity(num_edges(num_nodes));
        for i in 0..num_nodes {
            for j in 0..2 + i {
                let e = edges.len();
                let stride = if reduction && j < 2 { 2 } else { 1 };
                let ep = p / "edges" / e;
                let mut edge_ops = Vec::new();
                for (k, name) in ops.iter().enumerate() {
                    if name != "none" {
                        edge_ops.push((k, Op::new(&(&ep / name.as_str()), name, c, stride)?));
                    }
                }
                edges.push(Edge { ops: edge_ops });
            }
        }
        Ok(Cell {
            reduction,
            pre0,
            pre1,
            edges,
            num_nodes,
        })
    }

    /// `w`: softmax(α) split per edge and per op.
    fn forward_t(&self, s0: &Tensor, s1: &Tensor, w: &[Vec<Tensor>], train: bool) -> Tensor {
        let s0 = match &self.pre0 {
            Pre0::Plain(p) => p.forward_t(s0, train),
            Pre0::Reduce(r) => r.forward_t(s0, train),
        };
        let mut states = vec![s0, self.pre1.forward_t(s1, train)];
        let mut e = 0;
        for i in 0..self.num_nodes {
            let n_in = 2 + i;
            let node = states
                .iter()
                .zip(&self.edges[e..e + n_in])
                .zip(&w[e..e + n_in])
                .map(|((x, edge), w)| edge.forward_t(x, w, train))
                .reduce(|a, b| a + b)
                .expect("a node has at least two inputs");
            states.push(node);
            e += n_in;
        }
        Tensor::cat(&states[2..], 1)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
/// `[model.darts]`.
pub struct DartsOptions {
    pub in_channels: i64,
    pub input_length: i64,
    pub num_classes: i64,
    pub init_channels: i64,
    pub num_cells: i64,
    pub num_nodes: i64,
    pub ops: Vec<String>,
    /// Learning rate of the Adam that trains the architecture weights α.
    pub arch_lr: f64,
    pub arch_weight_decay: f64,
}

impl Default for DartsOptions {
    fn default() -> Self {
        DartsOptions {
            in_channels: 1,
            input_length: 3000,
            num_classes: 5,
            init_channels: 24,
            num_cells: 3,
            num_nodes: 2,
            ops: [
                "none",
                "skip_connect",
                "max_pool_3",
                "avg_pool_3",
                "sep_conv_3",
                "dil_conv_3",
                "attention_light",
            ]
            .map(String::from)
            .to_vec(),
            arch_lr: 3e-4,
            arch_weight_decay: 1e-3,
        }
    }
}

/// The `darts` preset.
pub struct DartsPreset;

impl Preset for DartsPreset {
    type Options = DartsOptions;
    const NAME: &'static str = "darts";

    fn check(o: &DartsOptions) -> Vec<(&'static str, String)> {
        let mut p: Vec<(&'static str, String)> = vec![];
        for (key, v, min) in [
            ("in_channels", o.in_channels, 1),
            ("input_length", o.input_length, 8),
            ("num_classes", o.num_classes, 2),
            ("init_channels", o.init_channels, 2),
            ("num_cells", o.num_cells, 1),
            ("num_nodes", o.num_nodes, 1),
        ] {
            if v < min {
                p.push((key, format!("must be at least {min}, got {v}")));
            }
        }
        if o.arch_lr <= 0.0 || !o.arch_lr.is_finite() {
            p.push(("arch_lr", format!("must be positive, got {}", o.arch_lr)));
        }
        if o.arch_weight_decay < 0.0 || !o.arch_weight_decay.is_finite() {
            p.push((
                "arch_weight_decay",
                format!("must be in [0, ∞), got {}", o.arch_weight_decay),
            ));
        }
        if o.ops.is_empty() || o.ops.iter().all(|op| op == "none") {
            p.push(("ops", "must list at least one operation besides \"none\"".into()));
        }
        for (i, op) in o.ops.iter().enumerate() {
            if !KNOWN_OPS.contains(&op.as_str()) {
                p.push((
                    "ops",
                    format!("has unknown operation \"{op}\"; known: {}", KNOWN_OPS.join(", ")),
                ));
            } else if o.ops[..i].contains(op) {
                p.push(("ops", format!("lists \"{op}\" twice; each operation may appear once")));
            }
        }
        if o.ops.iter().any(|op| op.starts_with("attention")) && o.init_channels % 4 != 0 {
            p.push((
                "init_channels",
                format!(
                    "must be a multiple of 4 when attention ops are used (heads split the channels), got {}",
                    o.init_channels
                ),
            ));
        }
        p
    }

    fn build(root: &nn::Path, o: &DartsOptions) -> Result<Built> {
        Ok(Built {
            input_shape: vec![o.in_channels, o.input_length],
            num_classes: o.num_classes,
            head: vec!["classifier".into()],
            net: Box::new(Darts::new(root, o)?),
        })
    }

    /// First-order DARTS: α trains with Adam(β = (0.5, 0.999)) and weight decay on held-out data.
    fn extra_step(o: &DartsOptions) -> Option<ExtraStep> {
        Some(ExtraStep {
            lr: o.arch_lr,
            hyper: Hyper {
                kind: OptimizerKind::Adam,
                momentum: 0.0,
                nesterov: false,
                weight_decay: o.arch_weight_decay,
                betas: [0.5, 0.999],
                eps: 1e-8,
                state_bits: 32,
                implementation: OptimizerImpl::Auto,
            },
        })
    }
}

/// The DARTS supernet.
#[derive(Debug)]
pub struct Darts {
    stem_conv: Conv,
    stem_bn: nn::BatchNorm,
    cells: Vec<Cell>,
    classifier: nn::Linear,
    alpha_normal: Tensor,
    alpha_reduce: Tensor,
    ops: Vec<String>,
    num_nodes: usize,
}

impl Darts {
    pub fn new(root: &nn::Path, o: &DartsOptions) -> Result<Self> {
        for (name, v, min) in [
            ("in_channels", o.in_channels, 1),
            ("num_classes", o.num_classes, 1),
            ("init_channels", o.init_channels, 1),
            ("num_cells", o.num_cells, 1),
            ("num_nodes", o.num_nodes, 1),
        ] {
            if v < min {
                bail!("darts: {name} must be at least {min}, got {v}");
            }
        }
        for (i, op) in o.ops.iter().enumerate() {
            if !KNOWN_OPS.contains(&op.as_str()) {
                bail!("darts: unknown operation \"{op}\"; known: {}", KNOWN_OPS.join(", "));
            }
            if o.ops[..i].contains(op) {
                bail!("darts: operation \"{op}\" is listed twice in ops");
            }
        }
        if !o.ops.iter().any(|op| op != "none") {
            bail!(
                "darts: ops must list at least one operation besides \"none\", got {:?}",
                o.ops
            );
        }
        let reductions: Vec<i64> = {
            let mut r = vec![o.num_cells / 3, 2 * o.num_cells / 3];
            r.dedup();
            r
        };
        let mut len = o.input_length;
        for _ in &reductions {
            len = (len + 1) / 2;
        }
        if len < 2 {
            bail!(
                "darts: input_length {} is too short: after {} reduction cell(s) the length is {len}, and batch \
                 norm needs at least 2 values per channel with batch size 1",
                o.input_length,
                reductions.len()
            );
        }
        let num_nodes = o.num_nodes as usize;
        let mult = o.num_nodes;

        let c_stem = STEM_MULTIPLIER * o.init_channels;
        let stem_conv = conv1d(root / "stem" / "conv", o.in_channels, c_stem, 3, 1, 1, 1);
        let stem_bn = nn::batch_norm1d(root / "stem" / "bn", c_stem, Default::default());

        let (mut c_pp, mut c_p, mut c) = (c_stem, c_stem, o.init_channels);
        let mut reduction_prev = false;
        let mut cells = Vec::with_capacity(o.num_cells as usize);
        for i in 0..o.num_cells {
            let reduction = reductions.contains(&i);
            if reduction {
                c *= 2;
            }
            let p = root / "cells" / i;
            cells.push(
                Cell::new(&p, &o.ops, num_nodes, c_pp, c_p, c, reduction, reduction_prev)
                    .map_err(|e| anyhow::anyhow!("darts: cell {i}: {e}"))?,
            );
            reduction_prev = reduction;
            (c_pp, c_p) = (c_p, mult * c);
        }
        let classifier = nn::linear(root / "classifier", c_p, o.num_classes, Default::default());

        let arch = root / "arch";
        let shape = [num_edges(num_nodes) as i64, o.ops.len() as i64];
        let init = nn::Init::Randn { mean: 0.0, stdev: 1e-3 };
        let alpha_normal = arch.var("alpha_normal", &shape, init);
        let alpha_reduce = arch.var("alpha_reduce", &shape, init);

        Ok(Darts {
            stem_conv,
            stem_bn,
            cells,
            classifier,
            alpha_normal,
            alpha_reduce,
            ops: o.ops.clone(),
            num_nodes,
        })
    }
}

/// Blocks: the stem (which also computes the edge weights softmax(α), so that they are computed
/// once, as in the plain forward), one block per cell, and the head. The state between blocks is
/// `[s0, s1, normal edge weights…, reduce edge weights…]`; the weights pass through every cell
/// unchanged.
impl Chain for Darts {
    fn blocks(&self) -> usize {
        self.cells.len() + 2
    }

    fn block(&self, i: usize, state: &[Tensor], train: bool) -> Vec<Tensor> {
        if i == 0 {
            let s = self.stem_bn.forward_t(&self.stem_conv.forward(&state[0]), train);
            let mut out = vec![s.shallow_clone(), s];
            for alpha in [&self.alpha_normal, &self.alpha_reduce] {
                out.extend(edge_weights(alpha).into_iter().flatten());
            }
            return out;
        }
        if i == self.cells.len() + 1 {
            let s1 = &state[1];
            return vec![self.classifier.forward(&s1.mean_dim(-1, false, s1.kind()))];
        }
        let cell = &self.cells[i - 1];
        let ops = self.ops.len();
        let per = state[2..].len() / 2;
        let ws = if cell.reduction {
            &state[2 + per..]
        } else {
            &state[2..2 + per]
        };
        let w: Vec<Vec<Tensor>> = ws
            .chunks(ops)
            .map(|row| row.iter().map(|t| t.shallow_clone()).collect())
            .collect();
        let out = cell.forward_t(&state[0], &state[1], &w, train);
        let mut next = vec![state[1].shallow_clone(), out];
        next.extend(state[2..].iter().map(|t| t.shallow_clone()));
        next
    }
}

/// softmax(α) per row, split into one 0-d tensor per (edge, op).
fn edge_weights(alpha: &Tensor) -> Vec<Vec<Tensor>> {
    alpha
        .softmax(-1, alpha.kind())
        .unbind(0)
        .iter()
        .map(|row| row.unbind(0))
        .collect()
}

impl Net for Darts {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        run_chain(self, xs, train)
    }

    fn chain(&self) -> Option<&dyn Chain> {
        Some(self)
    }

    fn genotype(&self) -> Option<Genotype> {
        Some(Genotype {
            normal: derive_genotype(&self.alpha_normal, &self.ops, self.num_nodes),
            reduce: derive_genotype(&self.alpha_reduce, &self.ops, self.num_nodes),
        })
    }
}

#[cfg(test)]
mod tests;
