//! Model presets. Every preset is built into a `tch::nn::Path`, so all weights live in one
//! VarStore and are saved and loaded by name.
mod darts;
mod mlp;

use anyhow::Result;
use tch::{nn, Tensor};

use crate::spec::{Model, Preset};

pub use darts::{derive_genotype, Darts, Genotype};
pub use mlp::Mlp;

/// Variables whose name starts with this are architecture weights (DARTS α): trained by
/// their own optimizer on held-out data, never by the weight optimizer.
pub const ARCH_PREFIX: &str = "arch.";

pub trait Net: std::fmt::Debug {
    /// Logits `[batch, num_classes]` for inputs `[batch, ..input_shape]`.
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor;
    /// The architecture the current α selects, for presets that search one.
    fn genotype(&self) -> Option<Genotype> {
        None
    }
}

/// A built preset and the shapes it expects.
#[derive(Debug)]
pub struct Built {
    pub net: Box<dyn Net>,
    /// Shape of one sample, without the batch dimension.
    pub input_shape: Vec<i64>,
    pub num_classes: i64,
    /// Whether the preset has architecture weights (and so an architecture step).
    pub has_arch: bool,
}

pub fn build(root: &nn::Path, model: &Model) -> Result<Built> {
    Ok(match model.preset {
        Preset::Mlp => {
            let o = model.mlp.clone().unwrap_or_default();
            Built {
                input_shape: vec![o.inputs],
                num_classes: o.num_classes,
                net: Box::new(Mlp::new(root, &o)),
                has_arch: false,
            }
        }
        Preset::Darts => {
            let o = model.darts.clone().unwrap_or_default();
            Built {
                input_shape: vec![o.in_channels, o.input_length],
                num_classes: o.num_classes,
                net: Box::new(Darts::new(root, &o)?),
                has_arch: true,
            }
        }
    })
}
