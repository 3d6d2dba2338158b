//! `mlp`: Linear → ReLU layers; small, for tests and tabular data.
use tch::{nn, nn::Module, Tensor};

use super::Net;
use crate::spec::MlpOptions;

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
