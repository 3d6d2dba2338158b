//! Which parameters train and with what: `train.freeze`, `[[train.param_groups]]`,
//! `train.no_decay` and `train.layer_decay`, resolved over the model's variable names into one
//! group per distinct (learning-rate scale, weight decay) setting.
//!
//! The rules are timm's where timm has one: `no_decay` is `param_groups_weight_decay`'s
//! (`ndim <= 1`, a name ending in `.bias`, or the model's `no_weight_decay()` set: class token
//! and position embedding), and `layer_decay` is `param_groups_layer_decay`'s, with the layer id
//! of a parameter from the model's chain (for the `vit` preset exactly timm's: 0 for the
//! embeddings, `i + 1` for encoder block `i`, the last block's for the final norm, one more for
//! the head), scaled by `decay^(layers - 1 - id)`.
use serde::Serialize;

use crate::spec::schema::Train;

/// The names timm's ViT lists in `no_weight_decay()`, as memtrain's (torchvision's) names.
const NO_DECAY_NAMES: &[&str] = &["class_token", "encoder.pos_embedding"];

/// One parameter group as the summary lists it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupReport {
    pub name: String,
    pub parameters: u64,
    pub tensors: usize,
    pub lr_scale: f64,
    pub weight_decay: f64,
    /// The optimizer step its parameters started training at (0, or when they were unfrozen).
    pub start_step: i64,
}

/// What the resolution needs to know of one parameter.
#[derive(Debug, Clone)]
pub struct ParamInfo {
    pub name: String,
    pub ndim: usize,
    pub numel: u64,
    /// Its layer id for `layer_decay` (the model chain's `layer_of`; None: no chain, or outside
    /// every block).
    pub layer: Option<usize>,
}

/// One parameter group: what its parameters train with.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GroupSetting {
    /// Where the setting comes from, in words ("default", "param_groups[0]", "layer 3, no_decay").
    pub name: String,
    /// Multiplies the scheduled learning rate.
    pub lr_scale: f64,
    pub weight_decay: f64,
}

/// Every parameter's group (None: frozen), and the groups.
#[derive(Debug, Clone, PartialEq)]
pub struct Groups {
    pub settings: Vec<GroupSetting>,
    pub of: Vec<Option<usize>>,
}

impl Groups {
    /// Every one of `n` parameters in one group at the optimizer's own rate and decay.
    pub fn single(n: usize, weight_decay: f64) -> Groups {
        Groups {
            settings: vec![GroupSetting {
                name: "default".into(),
                lr_scale: 1.0,
                weight_decay,
            }],
            of: vec![Some(0); n],
        }
    }

    /// The groups `t` asks for over `params`; Err: a pattern that matches no parameter, a
    /// freeze that leaves nothing to train, or a layer decay for a model without blocks.
    pub fn resolve(t: &Train, params: &[ParamInfo]) -> Result<Groups, String> {
        unmatched(t, params)?;
        let layers = match t.layer_decay {
            Some(_) => Some(layers_of(params)?),
            None => None,
        };
        let mut out = Groups {
            settings: Vec::new(),
            of: Vec::with_capacity(params.len()),
        };
        for p in params {
            if t.freeze.iter().any(|pat| glob(pat, &p.name)) {
                out.of.push(None);
                continue;
            }
            let s = setting(t, p, layers);
            let at = match out.settings.iter().position(|g| *g == s) {
                Some(i) => i,
                None => {
                    out.settings.push(s);
                    out.settings.len() - 1
                }
            };
            out.of.push(Some(at));
        }
        if out.of.iter().all(Option::is_none) {
            return Err(format!(
                "train.freeze: its patterns freeze every parameter ({} of them), so there is nothing to train",
                params.len()
            ));
        }
        Ok(out)
    }

    pub fn is_frozen(&self, i: usize) -> bool {
        self.of[i].is_none()
    }

    /// Every parameter trains from here on, each in the group it would have had unfrozen.
    pub fn unfrozen(t: &Train, params: &[ParamInfo]) -> Result<Groups, String> {
        let t = Train {
            freeze: Vec::new(),
            ..t.clone()
        };
        Groups::resolve(&t, params)
    }
}

/// Each pattern of `t` that matches no parameter is an error naming it and a few real names.
fn unmatched(t: &Train, params: &[ParamInfo]) -> Result<(), String> {
    let mut lists: Vec<(String, &[String])> = vec![("train.freeze".into(), &t.freeze)];
    for (i, g) in t.param_groups.iter().enumerate() {
        lists.push((format!("train.param_groups[{i}].match"), &g.patterns));
    }
    for (key, patterns) in lists {
        if let Some(p) = patterns.iter().find(|p| !params.iter().any(|x| glob(p, &x.name))) {
            let few: Vec<&str> = params.iter().take(6).map(|x| x.name.as_str()).collect();
            return Err(format!(
                "{key}: \"{p}\" matches no parameter of the model (its names are like {}; `*` matches any run of characters, dots included, `?` one character)",
                few.join(", ")
            ));
        }
    }
    Ok(())
}

/// (layer id of each parameter, layer count), from the chain's blocks.
fn layers_of(params: &[ParamInfo]) -> Result<(usize, usize), String> {
    if let Some(p) = params.iter().find(|p| p.layer.is_none()) {
        return Err(format!(
            "train.layer_decay needs a model built as a sequence of blocks (the vit preset), and {} belongs to no block",
            p.name
        ));
    }
    let count = params.iter().filter_map(|p| p.layer).max().unwrap_or(0) + 1;
    Ok((0, count))
}

/// The setting of one trained parameter.
fn setting(t: &Train, p: &ParamInfo, layers: Option<(usize, usize)>) -> GroupSetting {
    let group = t
        .param_groups
        .iter()
        .position(|g| g.patterns.iter().any(|pat| glob(pat, &p.name)));
    let mut words = Vec::new();
    let mut lr_scale = 1.0;
    let mut weight_decay = t.weight_decay;
    if let Some(i) = group {
        let g = &t.param_groups[i];
        words.push(format!("param_groups[{i}]"));
        lr_scale = g.lr_scale;
        if let Some(wd) = g.weight_decay {
            weight_decay = wd;
        }
    }
    if let (Some(decay), Some((_, count))) = (t.layer_decay, layers) {
        let id = p.layer.expect("checked by layers_of");
        words.push(format!("layer {id}"));
        // As Python's `decay ** n`: libm's pow, not repeated multiplication.
        lr_scale *= decay.powf((count - 1 - id) as f64);
    }
    let explicit = group.is_some_and(|i| t.param_groups[i].weight_decay.is_some());
    if t.no_decay && !explicit && excluded_from_decay(p) {
        words.push("no_decay".into());
        weight_decay = 0.0;
    }
    GroupSetting {
        name: match words.is_empty() {
            true => "default".into(),
            false => words.join(", "),
        },
        lr_scale,
        weight_decay,
    }
}

/// timm's rule: 1-D (or 0-D) tensors, biases, and the model's tokens and position embeddings.
pub fn excluded_from_decay(p: &ParamInfo) -> bool {
    p.ndim <= 1 || p.name.ends_with(".bias") || NO_DECAY_NAMES.contains(&p.name.as_str())
}

/// Whether `name` matches `pattern`: `*` is any run of characters (dots included), `?` any one
/// character, everything else itself.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Iterative matching with backtracking to the last star: linear in practice.
    let (mut i, mut j) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || p[i] == n[j]) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::schema::ParamGroup;

    fn info(name: &str, ndim: usize, block: usize) -> ParamInfo {
        ParamInfo {
            name: name.into(),
            ndim,
            numel: 4,
            layer: Some(block),
        }
    }

    fn vit() -> Vec<ParamInfo> {
        vec![
            info("class_token", 3, 0),
            info("conv_proj.weight", 4, 0),
            info("conv_proj.bias", 1, 0),
            info("encoder.pos_embedding", 3, 0),
            info("encoder.layers.encoder_layer_0.mlp.0.weight", 2, 1),
            info("encoder.layers.encoder_layer_0.ln_1.weight", 1, 1),
            info("encoder.layers.encoder_layer_1.mlp.0.weight", 2, 2),
            info("encoder.ln.weight", 1, 2),
            info("heads.head.weight", 2, 3),
            info("heads.head.bias", 1, 3),
        ]
    }

    #[test]
    fn glob_matches_runs_and_single_characters() {
        assert!(glob("conv1.*", "conv1.weight"));
        assert!(glob("layer1.*", "layer1.0.conv1.weight"));
        assert!(!glob("layer1.*", "layer10.weight") || glob("layer1*", "layer10.weight"));
        assert!(!glob("layer1.*", "xlayer1.0"));
        assert!(glob("*.bias", "heads.head.bias"));
        assert!(glob(
            "encoder.layers.encoder_layer_?.*",
            "encoder.layers.encoder_layer_3.ln_1.weight"
        ));
        assert!(!glob(
            "encoder.layers.encoder_layer_?.*",
            "encoder.layers.encoder_layer_13.ln_1.weight"
        ));
        assert!(glob("*", "anything"));
        assert!(glob("fc.weight", "fc.weight"));
        assert!(!glob("fc.weight", "fc.weights"));
    }

    #[test]
    fn frozen_parameters_have_no_group_and_freezing_all_is_refused() {
        let t = Train {
            freeze: vec!["encoder.*".into(), "conv_proj.*".into(), "class_token".into()],
            ..Train::default()
        };
        let g = Groups::resolve(&t, &vit()).unwrap();
        let frozen: Vec<bool> = (0..vit().len()).map(|i| g.is_frozen(i)).collect();
        assert_eq!(frozen, [true, true, true, true, true, true, true, true, false, false]);
        let all = Train {
            freeze: vec!["*".into()],
            ..Train::default()
        };
        assert!(Groups::resolve(&all, &vit()).unwrap_err().contains("nothing to train"));
        let none = Train {
            freeze: vec!["layer9.*".into()],
            ..Train::default()
        };
        let e = Groups::resolve(&none, &vit()).unwrap_err();
        assert!(e.contains("\"layer9.*\"") && e.contains("class_token"), "{e}");
    }

    #[test]
    fn first_matching_group_wins_and_no_decay_follows_timm() {
        let t = Train {
            weight_decay: 0.05,
            no_decay: true,
            param_groups: vec![
                ParamGroup {
                    patterns: vec!["heads.*".into()],
                    lr_scale: 10.0,
                    weight_decay: None,
                },
                ParamGroup {
                    patterns: vec!["heads.head.weight".into(), "encoder.ln.*".into()],
                    lr_scale: 2.0,
                    weight_decay: Some(0.1),
                },
            ],
            ..Train::default()
        };
        let g = Groups::resolve(&t, &vit()).unwrap();
        let of = |name: &str| {
            let i = vit().iter().position(|p| p.name == name).unwrap();
            g.settings[g.of[i].unwrap()].clone()
        };
        assert_eq!(
            (of("heads.head.weight").lr_scale, of("heads.head.weight").weight_decay),
            (10.0, 0.05)
        );
        assert_eq!(
            (of("heads.head.bias").lr_scale, of("heads.head.bias").weight_decay),
            (10.0, 0.0)
        );
        // An explicit weight decay wins over the no_decay rule.
        assert_eq!(
            (of("encoder.ln.weight").lr_scale, of("encoder.ln.weight").weight_decay),
            (2.0, 0.1)
        );
        assert_eq!(of("class_token").weight_decay, 0.0);
        assert_eq!(of("encoder.pos_embedding").weight_decay, 0.0);
        assert_eq!(of("conv_proj.weight").weight_decay, 0.05);
        assert_eq!(of("conv_proj.bias").weight_decay, 0.0);
    }

    #[test]
    fn layer_decay_scales_by_depth_from_the_top() {
        let t = Train {
            layer_decay: Some(0.5),
            ..Train::default()
        };
        let g = Groups::resolve(&t, &vit()).unwrap();
        let scales: Vec<f64> = g.of.iter().map(|s| g.settings[s.unwrap()].lr_scale).collect();
        assert_eq!(scales, [0.125, 0.125, 0.125, 0.125, 0.25, 0.25, 0.5, 0.5, 1.0, 1.0]);
        let no_blocks = vec![ParamInfo {
            layer: None,
            ..info("fc.weight", 2, 0)
        }];
        assert!(Groups::resolve(&t, &no_blocks)
            .unwrap_err()
            .contains("sequence of blocks"));
    }
}
