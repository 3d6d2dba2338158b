//! Model presets. A preset is one file behind the `Preset` trait (its options' validation, how
//! it is built, its static counts, and any extra step it needs) plus one line in `preset_of`.
//! Every preset is built into a `tch::nn::Path`, so all weights live in one VarStore and are
//! saved and loaded by name.
mod darts;
mod mlp;

use anyhow::Result;
use tch::{nn, Device, Tensor};

use crate::optim::Hyper;
use crate::spec::{self, Model};

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
}

/// A second optimizer step some presets take before each weight step, on held-out data, for
/// the variables under `ARCH_PREFIX` (DARTS's architecture step).
#[derive(Debug, Clone, Copy)]
pub struct ExtraStep {
    pub lr: f64,
    pub hyper: Hyper,
}

/// Values by role, as the static estimate counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    pub weights: u64,
    pub arch_weights: u64,
    pub buffers: u64,
}

pub trait Preset: Sync {
    /// Problems with the preset's options, as (dotted key, message); the spec loader places
    /// each at its `file:line:col`.
    fn validate(&self, model: &Model) -> Vec<(String, String)>;
    fn build(&self, root: &nn::Path, model: &Model) -> Result<Built>;
    /// The extra step this preset needs, if any.
    fn extra_step(&self, _model: &Model) -> Option<ExtraStep> {
        None
    }
    /// Static counts for `memtrain check`: by default, a CPU build's variables by role.
    fn counts(&self, model: &Model) -> Result<Counts> {
        let vs = nn::VarStore::new(Device::Cpu);
        drop(tch::no_grad(|| self.build(&vs.root(), model))?);
        let mut c = Counts::default();
        for (name, t) in vs.variables() {
            let n = t.numel() as u64;
            if name.starts_with(ARCH_PREFIX) {
                c.arch_weights += n;
            } else if t.requires_grad() {
                c.weights += n;
            } else {
                c.buffers += n;
            }
        }
        Ok(c)
    }
}

/// The registry: one line per preset.
fn preset_of(p: spec::Preset) -> &'static dyn Preset {
    match p {
        spec::Preset::Mlp => &mlp::MlpPreset,
        spec::Preset::Darts => &darts::DartsPreset,
    }
}

pub fn validate(spec: &spec::Spec) -> Vec<(String, String)> {
    preset_of(spec.model.preset).validate(&spec.model)
}

pub fn build(root: &nn::Path, model: &Model) -> Result<Built> {
    preset_of(model.preset).build(root, model)
}

pub fn extra_step(model: &Model) -> Option<ExtraStep> {
    preset_of(model.preset).extra_step(model)
}

pub fn counts(model: &Model) -> Result<Counts> {
    preset_of(model.preset).counts(model)
}
