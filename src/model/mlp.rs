//! `mlp`: Linear → ReLU layers (`fc0`, `fc1`, …); small, for tests and tabular data. LoRA adapts
//! any of them.
use tch::{nn, nn::Module, Tensor};

use anyhow::Result;

use super::lora::{adapted, adapter_for, Adapter, LoraOptions};
use super::preset::{Built, Net, Preset};
use serde::{Deserialize, Serialize};

pub struct MlpPreset;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
/// `[model.mlp]`.
pub struct MlpOptions {
    pub inputs: i64,
    pub hidden: Vec<i64>,
    pub num_classes: i64,
}

impl Default for MlpOptions {
    fn default() -> Self {
        MlpOptions {
            inputs: 64,
            hidden: vec![128],
            num_classes: 10,
        }
    }
}

impl Preset for MlpPreset {
    type Options = MlpOptions;
    const NAME: &'static str = "mlp";

    fn check(o: &MlpOptions) -> Vec<(&'static str, String)> {
        let mut p = vec![];
        for (key, v, min) in [("inputs", o.inputs, 1), ("num_classes", o.num_classes, 2)] {
            if v < min {
                p.push((key, format!("must be at least {min}, got {v}")));
            }
        }
        for (i, h) in o.hidden.iter().enumerate() {
            if *h < 1 {
                p.push(("hidden", format!("entries must be at least 1, got {h} at position {i}")));
            }
        }
        p
    }

    fn build(root: &nn::Path, o: &MlpOptions) -> Result<Built> {
        Ok(Built {
            input_shape: vec![o.inputs],
            num_classes: o.num_classes,
            head: vec![format!("fc{}", o.hidden.len())],
            net: Box::new(Mlp::new(root, o)),
        })
    }
}

#[derive(Debug)]
pub struct Mlp {
    layers: Vec<nn::Linear>,
    lora: Vec<Option<Adapter>>,
}

impl Mlp {
    pub fn new(root: &nn::Path, o: &MlpOptions) -> Self {
        let mut dims = vec![o.inputs];
        dims.extend(&o.hidden);
        dims.push(o.num_classes);
        let layers = dims
            .windows(2)
            .enumerate()
            .map(|(i, w)| nn::linear(root / format!("fc{i}"), w[0], w[1], Default::default()))
            .collect::<Vec<_>>();
        let lora = layers.iter().map(|_| None).collect();
        Mlp { layers, lora }
    }
}

impl Net for Mlp {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let mut h = xs.flatten(1, -1);
        let last = self.layers.len() - 1;
        for (i, (l, a)) in self.layers.iter().zip(&self.lora).enumerate() {
            h = adapted(a, l.forward(&h), &h, train);
            if i < last {
                h = h.relu();
            }
        }
        h
    }

    fn adapt(&mut self, root: &nn::Path, o: &LoraOptions) -> Vec<String> {
        let mut made = vec![];
        for (i, l) in self.layers.iter().enumerate() {
            let [out, inputs] = l.ws.size()[..] else {
                unreachable!("a linear layer's weight is [out, in]")
            };
            self.lora[i] = adapter_for(root / format!("fc{i}"), inputs, out, o, &mut made);
        }
        made
    }

    fn adaptable(&self) -> Vec<String> {
        (0..self.layers.len()).map(|i| format!("fc{i}")).collect()
    }
}
