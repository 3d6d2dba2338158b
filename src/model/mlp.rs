//! `mlp`: Linear → ReLU layers; small, for tests and tabular data.
use tch::{nn, nn::Module, Tensor};

use anyhow::Result;

use super::{Built, Net, Preset};
use crate::spec::{MlpOptions, Model};

pub struct MlpPreset;

impl Preset for MlpPreset {
    fn validate(&self, m: &Model) -> Vec<(String, String)> {
        let mut p = vec![];
        let o = m.mlp.clone().unwrap_or_default();
        for (key, v, min) in [("inputs", o.inputs, 1), ("num_classes", o.num_classes, 2)] {
            if v < min {
                p.push((format!("model.mlp.{key}"), format!("must be at least {min}, got {v}")));
            }
        }
        for (i, h) in o.hidden.iter().enumerate() {
            if *h < 1 {
                p.push((
                    "model.mlp.hidden".into(),
                    format!("entries must be at least 1, got {h} at position {i}"),
                ));
            }
        }
        p
    }

    fn build(&self, root: &tch::nn::Path, m: &Model) -> Result<Built> {
        let o = m.mlp.clone().unwrap_or_default();
        Ok(Built {
            input_shape: vec![o.inputs],
            num_classes: o.num_classes,
            net: Box::new(Mlp::new(root, &o)),
        })
    }
}

#[derive(Debug)]
pub struct Mlp {
    layers: Vec<nn::Linear>,
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
            .collect();
        Mlp { layers }
    }
}

impl Net for Mlp {
    fn forward_t(&self, xs: &Tensor, _train: bool) -> Tensor {
        let mut h = xs.flatten(1, -1);
        let last = self.layers.len() - 1;
        for (i, l) in self.layers.iter().enumerate() {
            h = l.forward(&h);
            if i < last {
                h = h.relu();
            }
        }
        h
    }
}
