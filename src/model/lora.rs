//! `[model.lora]`: low-rank adapters on a preset's linear layers, as peft's `LoraConfig`. Each
//! adapted layer `W` gains `lora_A.weight` `[rank, in]` and `lora_B.weight` `[out, rank]`, and its
//! output becomes `W x + B (A dropout(x)) · alpha / rank`. The base is frozen; the adapters and
//! the named extras (the head) train.
//!
//! Adapters are made after the preset has built its base, so the base draws the same initial
//! weights with and without them (a run that loads the base changes nothing, and one that does
//! not can compare). A is drawn as peft draws it (`kaiming_uniform_(a=√5)`: uniform in
//! ±1/√in), B starts at zero, so the adapted model starts as the base.
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init};

use tch::Tensor;

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
    a: Tensor,
    b: Tensor,
    scale: f64,
    dropout: f64,
}

impl Adapter {
    /// The adapter of the layer at `layer` (its variables are `layer/lora_A/weight`, …).
    pub fn new(layer: &nn::Path, inputs: i64, outputs: i64, o: &LoraOptions) -> Self {
        let bound = 1.0 / (inputs as f64).sqrt();
        Adapter {
            a: (layer / "lora_A").var("weight", &[o.rank, inputs], Init::Uniform { lo: -bound, up: bound }),
            b: (layer / "lora_B").var("weight", &[outputs, o.rank], Init::Const(0.0)),
            scale: o.scale(),
            dropout: o.dropout,
        }
    }

    /// `base` (the layer's own output for `x`) plus the adapter's, in peft's order.
    pub fn add(&self, base: Tensor, x: &Tensor, train: bool) -> Tensor {
        let x = x.dropout(self.dropout, train);
        base + x.linear::<Tensor>(&self.a, None).linear::<Tensor>(&self.b, None) * self.scale
    }
}

/// A layer's output with its adapter, when it has one.
pub fn adapted(adapter: &Option<Adapter>, base: Tensor, x: &Tensor, train: bool) -> Tensor {
    match adapter {
        Some(a) => a.add(base, x, train),
        None => base,
    }
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

/// Targets that match no layer: the error names the layers there are, by their short names
/// (the part after the block) and one full name.
pub(crate) fn no_target(o: &LoraOptions, preset: &str, offered: &[String]) -> crate::exit::UsageError {
    // A block's layers once, without the block's own prefix (`self_attention.in_proj_q` of
    // `encoder.layers.encoder_layer_0.`, `self_attn.q_proj` of `model.layers.0.`).
    let mut short: Vec<&str> = vec![];
    for name in offered {
        let s = name
            .split_once("_layer_")
            .or_else(|| name.split_once("layers."))
            .and_then(|(_, r)| r.split_once('.'))
            .map_or(name.as_str(), |(_, r)| r);
        if !short.contains(&s) {
            short.push(s);
        }
    }
    crate::exit::UsageError(format!(
        "model.lora.targets ({}) matches none of the {preset} preset's linear layers{}",
        o.targets.join(", "),
        match offered.first() {
            None => "; it has none that LoRA adapts".to_owned(),
            Some(full) => format!(
                "; its layers are {} (a plain name matches a layer whose name ends with it, as {full} ends with {})",
                short.join(", "),
                short[0]
            ),
        }
    ))
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
    }
}
