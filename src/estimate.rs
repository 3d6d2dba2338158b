//! `memtrain check`'s static estimate: what parameters, gradients and optimizer state need,
//! before any activation. Activations depend on the data and are measured by `run`'s preflight.
use std::fmt;

use anyhow::Result;

use crate::host::Home;
use crate::human::{human_bytes, human_count};
use crate::model;
use crate::optim::{state_bytes_8bit, Hyper};
use crate::spec::schema::{Device, Memory, Model, Precision, Train};

#[derive(Debug, Clone)]
pub struct Estimate {
    pub preset: String,
    /// Trained weights (frozen ones apart).
    pub weights: u64,
    /// Weights `train.freeze` keeps from training for the whole run: parameters without a
    /// gradient or optimizer state.
    pub frozen: u64,
    /// Of the frozen values, those `train.frozen_dtype = "bf16"` stores in bf16 (0 otherwise).
    pub frozen_bf16: u64,
    /// Of those, the values never held in fp32 while the model is built (`BaseDraw::built_in_bf16`).
    pub drawn_bf16: u64,
    /// The setting that freezes them: the LoRA base's adapters, or `train.freeze`.
    pub frozen_by: &'static str,
    /// Bytes of the variables that stay on the device when parameters stream (a decoder's
    /// output projection: `Chain::resident`).
    pub resident_bytes: u64,
    /// Of `weights`, the values of the resident variables that train (a full fine-tune's
    /// output projection): with the parameters streamed they stay on the device, and so does
    /// their gradient while backward makes it; their state and update are the host's.
    pub resident_trained: u64,
    pub arch_weights: u64,
    /// Non-trained state such as BatchNorm running statistics.
    pub buffers: u64,
    pub bytes_per_value: u64,
    pub precision: Precision,
    /// Optimizer state tensors per weight (SGD with momentum 1, Adam/AdamW 2).
    pub state_per_weight: u64,
    /// `train.optimizer_state_bits`: with 8, Adam/AdamW's moments take `state_bytes_8bit`.
    pub state_bits: u32,
    /// Values of each trained tensor (8-bit state depends on each one's size).
    pub weight_sizes: Vec<u64>,
    pub optimizer: String,
    /// How `train.optimizer_impl` resolves for the spec's device and placement, in words.
    pub optimizer_impl: String,
    pub micro_batch: i64,
    pub accumulation_steps: i64,
    /// The model is a sequence of blocks.
    pub has_blocks: bool,
    /// Each variable belongs to one block (parameters can stream block by block).
    pub blockwise: bool,
    /// Where the spec puts each term.
    pub homes: Homes,
    /// `memory.limit`: the device's budget, when the spec gives one in bytes.
    pub cap: Option<u64>,
    /// The spec trains on a GPU (or may: `job.device = "auto"`).
    pub gpu: bool,
    /// The shape of one input sample.
    pub input_shape: Vec<i64>,
    /// A language model's vocabulary: its next-token loss holds one chunk of logits at a time.
    pub vocab: Option<i64>,
    /// `train.cuda_graph` when the spec asks for graphs: what a run would decide, in words.
    pub cuda_graph: Option<String>,
    /// A run of the spec captures its step on CUDA (`train.cuda_graph`, nothing declining it,
    /// a device other than the CPU).
    pub captured: bool,
}

/// The device's working memory above the static bill at its peak, for a step that needs `step`
/// bytes of transients (activations, temporaries) and a validation pass that needs `eval`.
///
/// Eager, a step's transients go back to the caching allocator when it ends and validation's
/// forward reuses those blocks: the peak is the larger of the two. Captured, they belong to
/// the graph's private pool, which stays reserved between replays so that a replay allocates
/// nothing; validation cannot allocate from it and takes its own blocks beside it: the two add.
/// (Checkpoints copy to the host one tensor at a time; what they allocate on the device is
/// small next to either.)
pub fn working_peak(step: u64, eval: u64, captured: bool) -> u64 {
    match captured {
        true => step + eval,
        false => step.max(eval),
    }
}

/// Where each term of the bill lives under a spec (`memory.*`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Homes {
    pub parameters: Home,
    pub gradients: Home,
    pub optimizer_state: Home,
    pub activations: Home,
}

impl Homes {
    /// The spec's placements; streamed parameters bring their gradients and optimizer state to
    /// the host with them.
    pub fn of(m: &crate::spec::Memory) -> Homes {
        let streamed = |h: Home| if m.parameters.is_host() { Home::Host } else { h };
        Homes {
            parameters: m.parameters,
            gradients: streamed(m.gradients),
            optimizer_state: streamed(m.optimizer_state),
            activations: m.activations,
        }
    }
}

/// A spec key and what setting it to "host" does to the homes.
type Placement = (&'static str, fn(&mut Homes));

impl Estimate {
    /// Trained values plus buffers, all of which live on the device.
    pub fn parameter_bytes(&self) -> u64 {
        let values = self.weights + self.frozen + self.arch_weights + self.buffers;
        values * self.bytes_per_value - self.frozen_bf16 * (self.bytes_per_value - 2)
    }
    pub fn gradient_bytes(&self) -> u64 {
        (self.weights + self.arch_weights) * self.bytes_per_value
    }
    /// Weight optimizer state plus, for DARTS, the architecture Adam's two moments.
    pub fn optimizer_bytes(&self) -> u64 {
        let arch = self.arch_weights * 2 * self.bytes_per_value;
        match self.state_bits {
            8 => self.weight_sizes.iter().map(|n| state_bytes_8bit(*n)).sum::<u64>() + arch,
            _ => self.weights * self.state_per_weight * self.bytes_per_value + arch,
        }
    }
    /// What `memtrain run` builds before anything moves or is cast, in host memory: every value
    /// in fp32 but a frozen base kept in bf16, read or drawn straight into it (a TorchScript
    /// module aside, which is loaded where it runs).
    pub fn build_bytes(&self) -> u64 {
        let values = self.weights + self.frozen + self.arch_weights + self.buffers;
        values.saturating_mul(4).saturating_sub(self.drawn_bf16 * 2)
    }
    pub fn total_bytes(&self) -> u64 {
        self.parameter_bytes() + self.gradient_bytes() + self.optimizer_bytes()
    }

    /// The static terms (parameters, gradients, optimizer state) with where each lives.
    pub fn terms(&self) -> [(&'static str, &'static str, u64, Home); 3] {
        self.terms_at(self.homes)
    }

    /// The static terms with where each would live under `h`.
    fn terms_at(&self, h: Homes) -> [(&'static str, &'static str, u64, Home); 3] {
        [
            ("parameters", "memory.parameters", self.parameter_bytes(), h.parameters),
            ("gradients", "memory.gradients", self.gradient_bytes(), h.gradients),
            (
                "optimizer state",
                "memory.optimizer_state",
                self.optimizer_bytes(),
                h.optimizer_state,
            ),
        ]
    }

    /// The static bytes that stay on the device under `homes`. Gradients on the host still
    /// pass through the device one block at a time; that transient is part of the activations'
    /// share, which the preflight step measures.
    pub fn device_bytes(&self, homes: Homes) -> u64 {
        let placed: u64 = self
            .terms_at(homes)
            .iter()
            .filter(|t| t.3 == Home::Device)
            .map(|t| t.2)
            .sum();
        // Streamed parameters leave the output projection on the device.
        match homes.parameters {
            Home::Host => placed + self.resident_device_bytes(),
            Home::Device => placed,
        }
    }

    /// What streamed parameters leave on the device: the resident variables, and for those
    /// that train, their gradient as well.
    pub fn resident_device_bytes(&self) -> u64 {
        self.resident_bytes + self.resident_trained * self.bytes_per_value * 2
    }

    /// The static bytes in host memory under `homes`. A frozen resident variable leaves the
    /// host for the device; a trained one keeps its host copy, gradient and state there.
    pub fn host_bytes(&self, homes: Homes) -> u64 {
        let placed: u64 = self
            .terms_at(homes)
            .iter()
            .filter(|t| t.3 == Home::Host)
            .map(|t| t.2)
            .sum();
        match homes.parameters {
            Home::Host => placed.saturating_sub(self.resident_bytes),
            Home::Device => placed,
        }
    }

    /// The placements that would bring the static device bill under `cap`, cheapest first
    /// (optimizer state, then gradients, then the parameters streamed by block, for models
    /// whose variables each belong to one block): the keys to set and the device bytes left;
    /// None when even all of them on the host leave too much.
    pub fn placements_to_fit(&self, cap: u64) -> Option<(Vec<&'static str>, u64)> {
        let mut homes = self.homes;
        let mut keys = vec![];
        let steps: [Placement; 3] = [
            ("memory.optimizer_state", |h| h.optimizer_state = Home::Host),
            ("memory.gradients", |h| h.gradients = Home::Host),
            ("memory.parameters", |h| h.parameters = Home::Host),
        ];
        let usable = if self.blockwise { steps.len() } else { 2 };
        for (key, move_it) in steps.into_iter().take(usable) {
            if self.device_bytes(homes) <= cap {
                break;
            }
            let before = homes;
            move_it(&mut homes);
            if homes != before {
                keys.push(key);
            }
        }
        let left = self.device_bytes(homes);
        (left <= cap).then_some((keys, left))
    }

    /// The same model and optimizer under another precision.
    pub fn with_precision(&self, p: Precision) -> Estimate {
        Estimate {
            precision: p,
            bytes_per_value: p.bytes(),
            // train.frozen_dtype applies under bf16-mixed alone.
            frozen_bf16: if p == Precision::Bf16Mixed { self.frozen_bf16 } else { 0 },
            ..self.clone()
        }
    }

    /// What capturing the step adds to the device's peak that is known before any step: the
    /// `working_peak` of the working memory the estimate can count, captured less eager. The
    /// gradients are in the static bill either way (eager holds them until the next step
    /// starts, a graph in its pool). Of the transients, only mixed precision's weight copies
    /// are known here: the step's forward holds them (in the pool, when captured) and
    /// validation's forward makes its own. The activations, the rest of both, are measured by
    /// a run: the graph's `pool_bytes` is the step's; the preflight step, an eager warm-up,
    /// does not see the pool.
    pub fn graph_pool_bytes(&self) -> u64 {
        let cast = self.autocast_cache_bytes();
        working_peak(cast, cast, self.captured) - working_peak(cast, cast, false)
    }

    /// Mixed precision: autocast keeps a low-precision copy of each weight it casts for as long
    /// as the forward runs (its cast cache), at most the trained weights at 2 bytes.
    pub fn autocast_cache_bytes(&self) -> u64 {
        match self.precision.autocast() {
            // Weights kept in bf16 are read as they are: no copy.
            Some(_) => (self.weights + self.frozen - self.frozen_bf16 + self.arch_weights) * 2,
            None => 0,
        }
    }
}

/// The implementation a run of `spec` would use; "auto" on `job.device = "auto"` depends on
/// the machine, so both outcomes are named.
fn impl_words(job: &Sections) -> String {
    use crate::spec::{Device, OptimizerImpl};
    let asked = job.train.optimizer_impl;
    if asked == OptimizerImpl::Auto && captures(job) {
        return "fused (auto: a captured step reads its learning rate on the device)".into();
    }
    let placement = crate::spec::optimizer_placement(job.train, job.memory);
    let device = match job.device {
        Device::Cpu => tch::Device::Cpu,
        Device::Cuda(i) => tch::Device::Cuda(i),
        Device::Auto
            if asked == OptimizerImpl::Auto && crate::optim::refusal(OptimizerImpl::Foreach, placement).is_none() =>
        {
            return "auto: foreach on CUDA, single on the CPU".into()
        }
        Device::Auto => tch::Device::Cpu,
    };
    let which = crate::optim::resolve(asked, device, placement).name();
    match asked {
        OptimizerImpl::Auto => format!("{which} (auto)"),
        _ => which.into(),
    }
}

/// Whether a run of the spec captures its step: `job.device = "auto"` counts as CUDA, as the
/// estimate's words say.
fn captures(job: &Sections) -> bool {
    job.train.cuda_graph != crate::spec::CudaGraph::Off
        && crate::spec::graph_declines_of(job.train, job.memory).is_none()
        && job.device != Device::Cpu
}

/// The sections of a spec the estimate reads.
pub struct Sections<'a> {
    pub model: &'a Model,
    pub train: &'a Train,
    pub memory: &'a Memory,
    pub device: Device,
}

pub fn estimate(job: &Sections) -> Result<Estimate> {
    // Counting builds the model as shapes, but a TorchScript module is loaded with its values:
    // one too large for the host is said, not a panic.
    let c = match crate::oom::guarded(|| model::counts(job.model, job.train)) {
        Ok(counted) => counted?,
        Err(crate::oom::StepError::Oom { message, .. }) => {
            return Err(crate::exit::OomExit(format!(
                "the model does not fit in host memory, where it is built to count its parameters ({message}); \
                 memtrain run would stop there too: make the model smaller (its [model] table)"
            ))
            .into())
        }
        Err(
            crate::oom::StepError::Other(m)
            | crate::oom::StepError::PeerLost(m)
            | crate::oom::StepError::OomInCollective(m),
        ) => {
            anyhow::bail!("building the model to count its parameters failed: {m}")
        }
    };
    let (weights, arch, buffers) = (c.weights, c.arch_weights, c.buffers);
    let state_per_weight = match job.train.optimizer_state_bits {
        8 => 2,
        _ => Hyper::from_train(job.train).state_slots().len() as u64,
    };
    let t = job.train;
    Ok(Estimate {
        preset: job.model.preset.clone(),
        weights,
        frozen: c.frozen,
        resident_bytes: c.resident_bytes,
        resident_trained: c.resident_trained,
        drawn_bf16: match model::BaseDraw::of(job.model, t).built_in_bf16(&job.model.preset) {
            true => c.frozen_low,
            false => 0,
        },
        frozen_by: match job.model.options.contains_key(model::lora::TABLE) {
            true => "the base under model.lora",
            false => "train.freeze",
        },
        frozen_bf16: match t.frozen_dtype {
            crate::spec::FrozenDtype::Bf16 => c.frozen_low,
            crate::spec::FrozenDtype::Fp32 => 0,
        },
        arch_weights: arch,
        buffers,
        bytes_per_value: t.precision.bytes(),
        precision: t.precision,
        state_per_weight,
        state_bits: t.optimizer_state_bits,
        weight_sizes: c.weight_sizes,
        optimizer: format!("{:?}", t.optimizer).to_lowercase(),
        optimizer_impl: impl_words(job),
        micro_batch: t.batch_size,
        accumulation_steps: t.accumulation_steps,
        has_blocks: c.has_blocks,
        blockwise: c.blockwise,
        homes: Homes::of(job.memory),
        cap: job.memory.limit.map(|l| l.0),
        input_shape: c.input_shape.clone(),
        vocab: c.vocab,
        gpu: job.device != crate::spec::Device::Cpu,
        cuda_graph: graph_words(job),
        captured: captures(job),
    })
}

/// What a run of the spec decides about CUDA graphs, and what a captured step holds.
fn graph_words(job: &Sections) -> Option<String> {
    if job.train.cuda_graph == crate::spec::CudaGraph::Off {
        return None;
    }
    let spec_reason = crate::spec::graph_declines_of(job.train, job.memory);
    Some(match (spec_reason, job.device) {
        (Some(why), _) => format!("eager: {why}"),
        (None, Device::Cpu) => "eager: the run is on the CPU, and CUDA graphs are CUDA's".into(),
        (None, _) => "captured on CUDA after 3 eager steps per batch shape; the graph's pool keeps the step's working memory (activations, gradients, temporaries) between steps, so validation and checkpoints allocate beside it rather than in it".into(),
    })
}

/// What a GPU holds beyond the cap, said wherever a cap is set against a card.
pub const BEYOND_THE_CAP: &str = "beyond the cap the card also holds the CUDA context and the cuBLAS/cuDNN workspaces (about 0.3-0.5 GiB; `memtrain run` measures it in its preflight line): a 4 GB card takes a cap of about 3.5 GB";

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
        if self.frozen > 0 {
            write!(f, " + {} frozen ({})", human_count(self.frozen), self.frozen_by)?;
            if self.frozen_bf16 > 0 {
                write!(f, ", {} of them kept in bf16", human_count(self.frozen_bf16))?;
            }
        }
        if self.arch_weights > 0 {
            write!(f, " + {} architecture weights", human_count(self.arch_weights))?;
        }
        if self.buffers > 0 {
            write!(f, " + {} buffer values", human_count(self.buffers))?;
        }
        writeln!(f)?;
        writeln!(f, "parameters       {}", human_bytes(self.parameter_bytes()))?;
        writeln!(f, "gradients        {}", human_bytes(self.gradient_bytes()))?;
        match self.state_bits {
            8 => writeln!(
                f,
                "optimizer state  {} ({}, 8-bit: {} values of 1 byte per parameter and an fp32 scale per 256; fp32 for tensors under 4096 values; implementation {})",
                human_bytes(self.optimizer_bytes()),
                self.optimizer,
                self.state_per_weight,
                self.optimizer_impl
            )?,
            _ => writeln!(
                f,
                "optimizer state  {} ({}: {} value(s) per parameter; implementation {})",
                human_bytes(self.optimizer_bytes()),
                self.optimizer,
                self.state_per_weight,
                self.optimizer_impl
            )?,
        }
        writeln!(f, "total static     {}", human_bytes(self.total_bytes()))?;
        if let Some(g) = &self.cuda_graph {
            writeln!(f, "CUDA graph       {g}")?;
        }
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
        )?;
        self.write_loss_chunk(f)?;
        self.write_bill(f)
    }
}

/// `check`'s warning for a static bill over the cap; `run` repeats it when its first optimizer
/// step finds the same.
pub fn cannot_fit(device: u64, cap: u64) -> String {
    format!(
        "the device part of the bill, {}, is more than the {} cap (memory.limit) before any activation: this spec cannot fit.",
        human_bytes(device),
        human_bytes(cap)
    )
}

impl Estimate {
    /// The captured step's line in the bill: what its pool adds that can be counted before any
    /// step (see `graph_pool_bytes`), and that the activations count twice.
    fn write_graph_pool(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !self.captured {
            return Ok(());
        }
        let (bytes, counted) = match self.graph_pool_bytes() {
            0 => ("measured".to_owned(), ""),
            b => (
                human_bytes(b),
                " (here: a second set of the weights' low-precision copies)",
            ),
        };
        writeln!(
            f,
            "  {:<15} {bytes:>10}  device: the captured step's working memory stays in the graph's pool between steps, so validation's forward allocates beside it{counted}; the activations count twice, the step's and validation's",
            "graph pool",
        )
    }

    /// A language model's next-token loss: one chunk of fp32 logits, not the micro-batch's.
    fn write_loss_chunk(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Some(vocab) = self.vocab else {
            return Ok(());
        };
        let tokens = self.micro_batch.max(1) * self.input_shape.iter().product::<i64>().max(1);
        let chunk = crate::model::lm_loss::chunk_tokens(vocab).min(tokens);
        let bytes = |t: i64| human_bytes((t * vocab * 4) as u64);
        if chunk == tokens {
            // A micro-batch small enough for one chunk: saying "not the whole" would mislead.
            return writeln!(
                f,
                "next-token loss  the micro-batch's {tokens} tokens in one chunk: {} of fp32 logits (and as much for their softmax and gradient)",
                bytes(tokens)
            );
        }
        writeln!(
            f,
            "next-token loss  {chunk} of the micro-batch's {tokens} tokens at a time: {} of fp32 logits (and as much for their softmax and gradient), not the whole {}",
            bytes(chunk),
            bytes(tokens)
        )
    }

    /// Each term with where the spec puts it, the device's share against the cap, and what
    /// would make it fit when it cannot.
    fn write_bill(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "# The bill under this spec: each term and where it lives")?;
        for (name, key, bytes, home) in self.terms() {
            let at = match home {
                Home::Device => "device".to_owned(),
                Home::Host if key != "memory.parameters" && self.homes.parameters.is_host() => {
                    "host (with memory.parameters)".to_owned()
                }
                Home::Host if key == "memory.parameters" => {
                    "host, streamed to the device block by block (memory.parameters)".to_owned()
                }
                Home::Host => format!("host ({key})"),
            };
            writeln!(f, "  {name:<15} {:>10}  {at}", human_bytes(bytes))?;
        }
        let acts = match self.homes.activations {
            Home::Device => "device",
            Home::Host => "host, block boundaries only (memory.activations)",
        };
        writeln!(f, "  {:<15} {:>10}  {acts}", "activations", "measured")?;
        if self.homes.parameters.is_host() && self.resident_device_bytes() > 0 {
            writeln!(
                f,
                "  {:<15} {:>10}  device: read after the last block (the output projection), it stays there{}",
                "resident",
                human_bytes(self.resident_device_bytes()),
                match self.resident_trained {
                    0 => "",
                    _ => " with its gradient; its update runs on the host",
                }
            )?;
        }
        self.write_graph_pool(f)?;
        let device = self.device_bytes(self.homes) + self.graph_pool_bytes();
        let host = self.host_bytes(self.homes);
        write!(
            f,
            "device static    {} (+ activations, measured by the preflight step{})",
            human_bytes(device),
            if self.captured {
                "; captured, the step's and validation's both"
            } else {
                ""
            }
        )?;
        if host > 0 {
            write!(f, "; host {}", human_bytes(host))?;
        }
        writeln!(f)?;
        let Some(cap) = self.cap else { return Ok(()) };
        if device <= cap {
            writeln!(
                f,
                "cap              {} (memory.limit): {} left for activations",
                human_bytes(cap),
                human_bytes(cap - device)
            )?;
            if self.gpu {
                // The cap binds on the caching allocator; the context and the libraries'
                // workspaces are allocated outside it.
                writeln!(f, "{BEYOND_THE_CAP}")?;
            }
            return Ok(());
        }
        writeln!(f, "WARNING: {}", cannot_fit(device, cap))?;
        if self.device_bytes(self.homes) <= cap {
            // Only the graph's pool is over: eager, validation reuses the step's memory.
            return writeln!(
                f,
                "  to fit, set train.cuda_graph = \"off\": validation then reuses the step's memory instead of allocating beside the graph's pool"
            );
        }
        // Any placement on the host runs the step eager, so the pool is not in what is left.
        match self.placements_to_fit(cap) {
            Some((keys, left)) => writeln!(
                f,
                "  to fit, set {}: the device keeps {} of static state ({} left for activations)",
                keys.iter().map(|k| format!("{k} = \"host\"")).collect::<Vec<_>>().join(" and "),
                human_bytes(left),
                human_bytes(cap - left)
            ),
            None => writeln!(
                f,
                "  even with the optimizer state and gradients on the host the parameters alone ({}) do not fit, and this model's parameters cannot stream by block (memory.parameters = \"host\": the vit, resnet and llama presets): lower the precision (train.precision = \"bf16\") or raise memory.limit",
                human_bytes(self.parameter_bytes())
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlp_counts_match_the_layers() {
        let spec: crate::spec::Spec = toml::from_str(
            "[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 10\nhidden = [20]\nnum_classes = 3\n[train]\noptimizer = \"adam\"\n",
        )
        .unwrap();
        let e = estimate(&Sections {
            model: &spec.model,
            train: &spec.train,
            memory: &spec.memory,
            device: spec.job.device,
        })
        .unwrap();
        assert_eq!(e.weights, 10 * 20 + 20 + 20 * 3 + 3);
        assert_eq!(e.parameter_bytes(), e.weights * 4);
        assert_eq!(e.optimizer_bytes(), e.weights * 8);
        assert_eq!(e.total_bytes(), e.weights * 16);
    }

    fn graph_estimate(extra: &str, device: Device) -> Estimate {
        let spec: crate::spec::Spec = toml::from_str(&format!(
            "[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = 10\nhidden = [20]\nnum_classes = 3\n[train]\noptimizer = \"adam\"\n{extra}\n[memory]\nlimit = 1000000\n"
        ))
        .unwrap();
        estimate(&Sections {
            model: &spec.model,
            train: &spec.train,
            memory: &spec.memory,
            device,
        })
        .unwrap()
    }

    #[test]
    fn a_captured_step_keeps_its_working_memory_and_validation_adds_its_own() {
        assert_eq!(
            working_peak(300, 100, false),
            300,
            "eager: validation reuses the step's blocks"
        );
        assert_eq!(working_peak(300, 100, true), 400, "captured: beside the pool");

        let bf16 = "precision = \"bf16-mixed\"\ncuda_graph = \"auto\"";
        let captured = graph_estimate(bf16, Device::Cuda(0));
        assert!(captured.captured);
        let cast = captured.autocast_cache_bytes();
        assert_eq!(cast, captured.weights * 2);
        assert_eq!(captured.graph_pool_bytes(), cast, "the forward's weight copies, twice");
        let bill = captured.to_string();
        let static_device = captured.device_bytes(captured.homes);
        assert!(
            bill.contains(&format!(
                "device static    {} (+ activations, measured by the preflight step; captured, the step's and validation's both)",
                human_bytes(static_device + cast)
            )),
            "{bill}"
        );
        assert!(
            bill.contains("graph pool") && bill.contains("validation's forward allocates beside it"),
            "{bill}"
        );

        let fp32 = graph_estimate("cuda_graph = \"on\"", Device::Cuda(0));
        assert!(fp32.captured);
        assert_eq!(fp32.graph_pool_bytes(), 0, "fp32 makes no weight copies");
        assert!(fp32
            .to_string()
            .contains("measured  device: the captured step's working memory"));

        for (extra, device) in [
            (bf16, Device::Cpu),
            ("precision = \"bf16-mixed\"", Device::Cuda(0)),
            (
                "precision = \"bf16-mixed\"\ncuda_graph = \"auto\"\noptimizer_impl = \"foreach\"",
                Device::Cuda(0),
            ),
        ] {
            let e = graph_estimate(extra, device);
            assert!(!e.captured, "{extra} on {device:?}");
            assert_eq!(e.graph_pool_bytes(), 0);
            assert!(!e.to_string().contains("graph pool"));
        }
    }

    #[test]
    fn only_the_pool_over_the_cap_says_to_turn_graphs_off() {
        let bf16 = "precision = \"bf16-mixed\"\ncuda_graph = \"auto\"";
        let mut e = graph_estimate(bf16, Device::Cuda(0));
        let device = e.device_bytes(e.homes);
        e.cap = Some(device + e.graph_pool_bytes() - 1);
        let bill = e.to_string();
        assert!(bill.contains("WARNING: "), "{bill}");
        assert!(bill.contains("to fit, set train.cuda_graph = \"off\""), "{bill}");
        e.cap = Some(device + e.graph_pool_bytes());
        assert!(!e.to_string().contains("WARNING"));
    }
}
