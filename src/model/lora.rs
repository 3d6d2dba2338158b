//! `[model.lora]`: low-rank adapters on a preset's linear layers and convolutions, as peft's
//! `LoraConfig`. Each adapted linear layer `W` gains `lora_A.weight` `[rank, in]` and
//! `lora_B.weight` `[out, rank]`, and its output becomes `W x + B (A dropout(x)) · alpha / rank`.
//! An adapted convolution's A is a convolution with the base's kernel, stride and padding and
//! `rank` output channels (`[rank, in, kh, kw]`), its B a 1×1 convolution (`[out, rank, 1, 1]`),
//! as peft's `Conv2d` adapter. The base is frozen; the adapters and the named extras (the head)
//! train.
//!
//! Adapters are made after the preset has built its base, so the base draws the same initial
//! weights with and without them (a run that loads the base changes nothing, and one that does
//! not can compare). A is drawn as peft draws it (`kaiming_uniform_(a=√5)`: uniform in ±1/√fan_in,
//! fan_in being `in` or `in·kh·kw`), B starts at zero, so the adapted model starts as the base.
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init, Module};

use tch::Tensor;

use super::layers::Conv;

/// The key of `[model]` that holds the adapters' options.
pub const TABLE: &str = "lora";

/// Variable names of an adapter's two matrices end with one of these.
pub const ADAPTER_VARS: [&str; 2] = ["lora_A.weight", "lora_B.weight"];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LoraOptions {
    pub rank: i64,
    pub alpha: f64,
    pub dropout: f64,
    /// Layers to adapt, by name: a plain name matches a layer whose name is it or ends with
    /// `.name` (peft's rule); a name with `*` is a pattern over the whole name.
    pub targets: Vec<String>,
    /// Variables that train beside the adapters (peft's `modules_to_save`), by the same rule
    /// over variable names without their last part (`heads.head` for `heads.head.weight`).
    pub extras: Vec<String>,
}

impl Default for LoraOptions {
    fn default() -> Self {
        LoraOptions {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            targets: vec!["in_proj_q".into(), "in_proj_v".into()],
            extras: vec![],
        }
    }
}

impl LoraOptions {
    /// Problems with the options, as (option name, message).
    pub fn check(&self) -> Vec<(&'static str, String)> {
        let mut p = vec![];
        if self.rank < 1 {
            p.push(("rank", format!("must be at least 1, got {}", self.rank)));
        }
        if !(self.alpha > 0.0 && self.alpha.is_finite()) {
            p.push(("alpha", format!("must be a positive number, got {}", self.alpha)));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            p.push(("dropout", format!("must be in [0, 1), got {}", self.dropout)));
        }
        if self.targets.is_empty() {
            p.push(("targets", "must name at least one layer to adapt".into()));
        }
        p
    }

    pub fn scale(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Whether the layer of this full name is adapted.
    pub fn targets(&self, layer: &str) -> bool {
        self.targets.iter().any(|t| matches(t, layer))
    }

    /// Whether the variable of this full name trains: an adapter's, or an extra's.
    pub fn trains(&self, var: &str) -> bool {
        if ADAPTER_VARS.iter().any(|a| var.ends_with(&format!(".{a}"))) {
            return true;
        }
        let owner = var.rsplit_once('.').map_or(var, |(o, _)| o);
        self.extras.iter().any(|e| matches(e, owner) || matches(e, var))
    }
}

/// peft's rule for a plain name (the whole name or its last dotted parts), a glob otherwise.
pub fn matches(pattern: &str, name: &str) -> bool {
    if pattern.contains('*') {
        return glob(pattern.as_bytes(), name.as_bytes());
    }
    name == pattern || name.ends_with(&format!(".{pattern}"))
}

/// `*` matches any run of characters, dots included.
fn glob(p: &[u8], s: &[u8]) -> bool {
    match (p.first(), s.first()) {
        (None, None) => true,
        (Some(b'*'), _) => glob(&p[1..], s) || (!s.is_empty() && glob(p, &s[1..])),
        (Some(a), Some(b)) if a == b => glob(&p[1..], &s[1..]),
        _ => false,
    }
}

/// One adapter: `delta(x) = B (A dropout(x)) · scale`.
#[derive(Debug)]
pub struct Adapter {
    a: Down,
    b: Tensor,
    scale: f64,
    dropout: f64,
}

/// An adapter's A: a matrix over a linear layer's inputs, or a convolution with the adapted
/// convolution's geometry (whose B is then a 1×1 convolution).
#[derive(Debug)]
enum Down {
    Linear(Tensor),
    Conv(Conv),
}

impl Adapter {
    /// The adapter of the linear layer at `layer` (its variables are `layer/lora_A/weight`, …).
    pub fn new(layer: &nn::Path, inputs: i64, outputs: i64, o: &LoraOptions) -> Self {
        Adapter {
            a: Down::Linear((layer / "lora_A").var("weight", &[o.rank, inputs], kaiming_a(inputs))),
            b: (layer / "lora_B").var("weight", &[outputs, o.rank], Init::Const(0.0)),
            scale: o.scale(),
            dropout: o.dropout,
        }
    }

    /// The adapter of the convolution `base` at `layer`: peft's `lora_A = Conv2d(in, rank,
    /// kernel, stride, padding, bias=False)` and `lora_B = Conv2d(rank, out, 1, bias=False)`.
    pub fn conv(layer: &nn::Path, base: &Conv, o: &LoraOptions) -> Self {
        let g = base.geometry();
        let fan_in = g.inputs * g.kernel.iter().product::<i64>();
        let a = Conv::new(
            layer / "lora_A",
            g.inputs,
            o.rank,
            [g.kernel[0], g.kernel[1]],
            nn::ConvConfigND::<[i64; 2]> {
                stride: [g.stride[0], g.stride[1]],
                padding: [g.padding[0], g.padding[1]],
                bias: false,
                ws_init: kaiming_a(fan_in),
                ..Default::default()
            },
        );
        Adapter {
            a: Down::Conv(a),
            b: (layer / "lora_B").var("weight", &[g.outputs, o.rank, 1, 1], Init::Const(0.0)),
            scale: o.scale(),
            dropout: o.dropout,
        }
    }

    /// `base` (the layer's own output for `x`) plus the adapter's, in peft's order.
    pub fn add(&self, base: Tensor, x: &Tensor, train: bool) -> Tensor {
        let x = x.dropout(self.dropout, train);
        let delta = match &self.a {
            Down::Linear(a) => x.linear::<Tensor>(a, None).linear::<Tensor>(&self.b, None),
            Down::Conv(a) => a.forward(&x).conv2d::<Tensor>(&self.b, None, [1, 1], [0, 0], [1, 1], 1),
        };
        base + delta * self.scale
    }
}

/// peft's draw for A, `kaiming_uniform_(a=√5)`: uniform in ±1/√fan_in.
fn kaiming_a(fan_in: i64) -> Init {
    let bound = 1.0 / (fan_in as f64).sqrt();
    Init::Uniform { lo: -bound, up: bound }
}

/// A layer's output with its adapter, when it has one.
pub fn adapted(adapter: &Option<Adapter>, base: Tensor, x: &Tensor, train: bool) -> Tensor {
    match adapter {
        Some(a) => a.add(base, x, train),
        None => base,
    }
}

/// An adapted convolution's output: the base's, plus the adapter's where it has one.
pub fn conv_adapted(base: &Conv, adapter: &Option<Adapter>, x: &Tensor, train: bool) -> Tensor {
    adapted(adapter, base.forward(x), x, train)
}

/// The weight change an adapter merges into its layer, `B A · scale`, in the layer's shape: for
/// a convolution `B[o, r] · A[r, (in, kh, kw)]`, as peft's `get_delta_weight` computes it.
pub fn delta_weight(a: &Tensor, b: &Tensor, scale: f64) -> Tensor {
    let mut shape = vec![b.size()[0]];
    shape.extend_from_slice(&a.size()[1..]);
    (b.flatten(1, -1).matmul(&a.flatten(1, -1)) * scale).reshape(shape.as_slice())
}

/// Makes the adapter of the layer at `path` when the options target it, and notes its name.
pub fn adapter_for(
    path: nn::Path,
    inputs: i64,
    outputs: i64,
    o: &LoraOptions,
    made: &mut Vec<String>,
) -> Option<Adapter> {
    let name = path.components().collect::<Vec<_>>().join(".");
    if !o.targets(&name) {
        return None;
    }
    made.push(name);
    Some(Adapter::new(&path, inputs, outputs, o))
}

/// Makes the adapter of the convolution `base` at `path` when the options target it, and notes
/// its name.
pub fn conv_adapter_for(path: nn::Path, base: &Conv, o: &LoraOptions, made: &mut Vec<String>) -> Option<Adapter> {
    let name = path.components().collect::<Vec<_>>().join(".");
    if !o.targets(&name) {
        return None;
    }
    made.push(name);
    Some(Adapter::conv(&path, base, o))
}

/// Targets that match no layer: the error names the linear layers there are, by their short
/// names (the part after the block) and one full name.
#[cfg(test)]
pub(crate) fn no_target(o: &LoraOptions, preset: &str, offered: &[String]) -> crate::exit::UsageError {
    no_target_among(o, preset, offered, "linear layers")
}

/// Targets that match none of `offered`, layers of this `kind` ("linear layers"): the error
/// names them by their short names, with a full name that a short one ends.
pub(crate) fn no_target_among(
    o: &LoraOptions,
    preset: &str,
    offered: &[String],
    kind: &str,
) -> crate::exit::UsageError {
    let mut short: Vec<&str> = vec![];
    for name in offered {
        let s = short_name(name);
        if !short.contains(&s) {
            short.push(s);
        }
    }
    // A name its short form stands for, to show the rule with.
    let example = offered
        .iter()
        .map(|n| (n, short_name(n)))
        .find(|(n, s)| n.as_str() != *s);
    crate::exit::UsageError(format!(
        "model.lora.targets ({}) matches none of the {preset} preset's {kind}{}",
        o.targets.join(", "),
        match (offered.is_empty(), example) {
            (true, _) => "; it has none that LoRA adapts".to_owned(),
            (false, Some((full, s))) => format!(
                "; its layers are {} (a plain name matches a layer whose name ends with it, as {full} ends with {s})",
                short.join(", "),
            ),
            (false, None) => format!("; its layers are {}", short.join(", ")),
        }
    ))
}

/// A block's layer without the block's own prefix: `self_attention.in_proj_q` of
/// `encoder.layers.encoder_layer_0.`, `self_attn.q_proj` of `model.layers.0.`, `conv1` of
/// `layer1.0.`.
fn short_name(name: &str) -> &str {
    // What follows the block: `encoder_layer_N.…`, `layers.N.…`, or a ResNet's `layerL.B.…`.
    let block = match name.split_once("_layer_").or_else(|| name.split_once("layers.")) {
        Some((_, r)) => Some(r),
        None => name
            .strip_prefix("layer")
            .filter(|r| r.starts_with(|c: char| c.is_ascii_digit()))
            .and_then(|r| r.split_once('.'))
            .map(|(_, r)| r),
    };
    block.and_then(|r| r.split_once('.')).map_or(name, |(_, r)| r)
}

/// `train` with `names` frozen too: LoRA's base is frozen as `train.freeze` freezes, so the
/// optimizer, the gradient buffers, the host levers and `check` leave it out alike.
pub fn with_frozen(train: &crate::spec::schema::Train, names: Vec<String>) -> crate::spec::schema::Train {
    let mut t = train.clone();
    t.freeze.extend(names);
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_match_as_peft_matches_them() {
        assert!(matches(
            "in_proj_q",
            "encoder.layers.encoder_layer_0.self_attention.in_proj_q"
        ));
        assert!(!matches(
            "proj_q",
            "encoder.layers.encoder_layer_0.self_attention.in_proj_q"
        ));
        assert!(matches("mlp.0", "encoder.layers.encoder_layer_3.mlp.0"));
        assert!(matches(
            "encoder.layers.*.mlp.*",
            "encoder.layers.encoder_layer_3.mlp.3"
        ));
        assert!(!matches("encoder.layers.*.mlp.*", "heads.head"));
        let o = LoraOptions {
            extras: vec!["heads.head".into()],
            ..Default::default()
        };
        assert!(o.trains("heads.head.weight"));
        assert!(o.trains("encoder.layers.encoder_layer_0.self_attention.in_proj_q.lora_B.weight"));
        assert!(!o.trains("encoder.layers.encoder_layer_0.self_attention.in_proj_weight"));
        assert!(!o.trains("encoder.ln.weight"));
        assert!(matches("layer*.conv*", "layer2.1.conv2"));
        assert!(matches("conv1", "layer2.1.conv1") && matches("conv1", "conv1"));
        assert!(!matches("layer*.conv*", "conv1"));
    }

    #[test]
    fn short_names_drop_the_block() {
        assert_eq!(short_name("encoder.layers.encoder_layer_3.mlp.0"), "mlp.0");
        assert_eq!(short_name("model.layers.12.self_attn.q_proj"), "self_attn.q_proj");
        assert_eq!(short_name("layer3.1.downsample.0"), "downsample.0");
        assert_eq!(short_name("conv1"), "conv1");
        assert_eq!(short_name("fc2"), "fc2");
        assert_eq!(short_name("heads.head"), "heads.head");
    }

    /// peft's `lora_B(lora_A(dropout(x))) * scaling` for a convolution: A has the base's stride
    /// and padding, and the dropout acts on the adapter's input alone (the base sees `x` whole).
    #[test]
    fn a_conv_adapter_runs_a_then_b_and_drops_only_its_own_input() {
        let vs = nn::VarStore::new(tch::Device::Cpu);
        let cfg = nn::ConvConfigND::<[i64; 2]> {
            stride: [2, 2],
            padding: [1, 1],
            bias: false,
            ..Default::default()
        };
        let base = Conv::new(vs.root() / "c", 3, 5, [3, 3], cfg);
        let o = LoraOptions {
            rank: 2,
            alpha: 3.0,
            dropout: 0.5,
            ..Default::default()
        };
        let ad = Some(Adapter::conv(&(vs.root() / "c"), &base, &o));
        let x = Tensor::randn([2, 3, 8, 8], tch::kind::FLOAT_CPU);
        let b = vs.variables()["c.lora_B.weight"].shallow_clone();
        // B at zero: whatever the dropout draws, the output is the base's on the whole input.
        assert!(conv_adapted(&base, &ad, &x, true).equal(&base.forward(&x)));
        tch::no_grad(|| {
            b.shallow_clone()
                .copy_(&Tensor::randn([5, 2, 1, 1], tch::kind::FLOAT_CPU))
        });
        let a = x.conv2d::<Tensor>(&vs.variables()["c.lora_A.weight"], None, [2, 2], [1, 1], [1, 1], 1);
        let want = base.forward(&x) + a.conv2d::<Tensor>(&b, None, [1, 1], [0, 0], [1, 1], 1) * 1.5;
        assert!(conv_adapted(&base, &ad, &x, false).allclose(&want, 1e-6, 1e-6, false));
        assert_eq!(vs.variables()["c.lora_A.weight"].size(), [2, 3, 3, 3]);
    }

    /// A convolution's merged change is peft's `get_delta_weight`:
    /// `conv2d(A.transpose(0, 1), B).transpose(0, 1) · scale`, and the 1×1 case `B A · scale`.
    #[test]
    fn a_conv_adapters_delta_is_peft_s() {
        for k in [3, 1] {
            let a = Tensor::randn([4, 6, k, k], tch::kind::FLOAT_CPU);
            let b = Tensor::randn([5, 4, 1, 1], tch::kind::FLOAT_CPU);
            let peft = a
                .transpose(0, 1)
                .conv2d::<Tensor>(&b, None, [1, 1], [0, 0], [1, 1], 1)
                .transpose(0, 1)
                * 2.0;
            let ours = delta_weight(&a, &b, 2.0);
            assert_eq!(ours.size(), [5, 6, k, k]);
            assert!(ours.allclose(&peft, 1e-6, 1e-6, false), "k = {k}");
        }
    }
}
