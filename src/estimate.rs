//! `memtrain check`'s static estimate: what parameters, gradients and optimizer state need,
//! before any activation. Activations depend on the data and are measured by `run`'s preflight.
use std::fmt;

use anyhow::Result;

use crate::human::{human_bytes, human_count};
use crate::model;
use crate::optim::Hyper;
use crate::spec::{Precision, Spec};

#[derive(Debug, Clone)]
pub struct Estimate {
    pub preset: String,
    pub weights: u64,
    pub arch_weights: u64,
    /// Non-trained state such as BatchNorm running statistics.
    pub buffers: u64,
    pub bytes_per_value: u64,
    pub precision: Precision,
    /// Optimizer state tensors per weight (SGD with momentum 1, Adam/AdamW 2).
    pub state_per_weight: u64,
    pub optimizer: String,
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    /// The model is a sequence of blocks.
    pub has_blocks: bool,
    /// Each variable belongs to one block (parameters can stream block by block).
    pub blockwise: bool,
}

impl Estimate {
    /// Trained values plus buffers, all of which live on the device.
    pub fn parameter_bytes(&self) -> u64 {
        (self.weights + self.arch_weights + self.buffers) * self.bytes_per_value
    }
    pub fn gradient_bytes(&self) -> u64 {
        (self.weights + self.arch_weights) * self.bytes_per_value
    }
    /// Weight optimizer state plus, for DARTS, the architecture Adam's two moments.
    pub fn optimizer_bytes(&self) -> u64 {
        (self.weights * self.state_per_weight + self.arch_weights * 2) * self.bytes_per_value
    }
    pub fn total_bytes(&self) -> u64 {
        self.parameter_bytes() + self.gradient_bytes() + self.optimizer_bytes()
    }

    /// The same model and optimizer under another precision.
    pub fn with_precision(&self, p: Precision) -> Estimate {
        Estimate {
            precision: p,
            bytes_per_value: p.bytes(),
            ..self.clone()
        }
    }

    /// Mixed precision: autocast keeps a low-precision copy of each weight it casts for as long
    /// as the forward runs (its cast cache), at most the trained weights at 2 bytes.
    pub fn autocast_cache_bytes(&self) -> u64 {
        match self.precision.autocast() {
            Some(_) => (self.weights + self.arch_weights) * 2,
            None => 0,
        }
    }
}

pub fn estimate(spec: &Spec) -> Result<Estimate> {
    let c = model::counts(&spec.model)?;
    let (weights, arch, buffers) = (c.weights, c.arch_weights, c.buffers);
    let t = &spec.train;
    let state_per_weight = Hyper::from_train(t).state_slots().len() as u64;
    Ok(Estimate {
        preset: spec.model.preset.clone(),
        weights,
        arch_weights: arch,
        buffers,
        bytes_per_value: t.precision.bytes(),
        precision: t.precision,
        state_per_weight,
        optimizer: format!("{:?}", t.optimizer).to_lowercase(),
        micro_batch: t.batch_size,
        accumulation_steps: t.accumulation_steps,
        has_blocks: c.has_blocks,
        blockwise: c.blockwise,
    })
}

impl fmt::Display for Estimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "# Static memory estimate (activations not included: `memtrain run` measures them in its preflight step)"
        )?;
        write!(
            f,
            "model            {}: {} parameters",
            self.preset,
            human_count(self.weights)
        )?;
        if self.arch_weights > 0 {
            write!(f, " + {} architecture weights", human_count(self.arch_weights))?;
        }
        if self.buffers > 0 {
            write!(f, " + {} buffer values", human_count(self.buffers))?;
        }
        writeln!(f)?;
        writeln!(f, "parameters       {}", human_bytes(self.parameter_bytes()))?;
        writeln!(f, "gradients        {}", human_bytes(self.gradient_bytes()))?;
        writeln!(
            f,
            "optimizer state  {} ({}: {} value(s) per parameter)",
            human_bytes(self.optimizer_bytes()),
            self.optimizer,
            self.state_per_weight
        )?;
        writeln!(f, "total static     {}", human_bytes(self.total_bytes()))?;
        writeln!(
            f,
            "by precision     parameters, gradients and optimizer state by dtype (* = train.precision)"
        )?;
        for p in Precision::ALL {
            let e = self.with_precision(p);
            let dtype = if p == Precision::Bf16 { "bf16" } else { "fp32" };
            let mark = if p == self.precision { "*" } else { " " };
            write!(
                f,
                "  {mark}{:<11} {} {dtype} + {} {dtype} + {} {dtype} = {}",
                p.name(),
                human_bytes(e.parameter_bytes()),
                human_bytes(e.gradient_bytes()),
                human_bytes(e.optimizer_bytes()),
                human_bytes(e.total_bytes())
            )?;
            if e.autocast_cache_bytes() > 0 {
                write!(
                    f,
                    "; up to {} of {} weight copies while the forward runs",
                    human_bytes(e.autocast_cache_bytes()),
                    if p == Precision::Fp16Mixed { "fp16" } else { "bf16" }
                )?;
            }
            writeln!(f)?;
        }
        writeln!(
            f,
            "effective batch  {} = micro-batch {} x {} accumulation steps",
            self.micro_batch * self.accumulation_steps,
            self.micro_batch,
            self.accumulation_steps
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlp_counts_match_the_layers() {
        let spec: Spec = toml::from_str(
            "[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 10\nhidden = [20]\nnum_classes = 3\n[train]\noptimizer = \"adam\"\n",
        )
        .unwrap();
        let e = estimate(&spec).unwrap();
        assert_eq!(e.weights, 10 * 20 + 20 + 20 * 3 + 3);
        assert_eq!(e.parameter_bytes(), e.weights * 4);
        assert_eq!(e.optimizer_bytes(), e.weights * 8);
        assert_eq!(e.total_bytes(), e.weights * 16);
    }
}
