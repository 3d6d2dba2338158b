//! The parts a memory lever acts on: the model with its weights' optimizer, the architecture
//! step's driver, and (in `forward`) how the forward runs.
use tch::{nn, Tensor};

use super::execution::Execution;
use super::forward::Forward;
use super::step::{StepPipeline, Work};
use super::stream::Streamer;
use crate::checkpoint::ArchState;
use crate::data::{self, Dataset};
use crate::model::{ExtraStep, Net};
use crate::oom::StepError;
use crate::optim::{LrSchedule, Optimizer};

/// The model being trained and what trains its weights.
pub struct Trained {
    pub vs: nn::VarStore,
    pub net: Box<dyn Net>,
    pub opt: Optimizer,
    pub sched: LrSchedule,
    /// `memory.parameters = "host"`: the variables rest on the host, streamed block by block.
    pub stream: Option<Streamer>,
    /// `train.unfreeze_at_epoch`: when the frozen parameters start training.
    pub unfreeze: Option<Unfreeze>,
    pub kept: Kept,
}

/// What a checkpoint keeps of the model.
#[derive(Debug, Clone)]
pub enum Kept {
    /// Every variable.
    Whole,
    /// Only these variables (what trains over a frozen base: LoRA's adapters and extras, and the
    /// BatchNorm running statistics); the base is read again from its file, which `base` names,
    /// on resume and export.
    Trained {
        names: std::collections::BTreeSet<String>,
        base: Option<crate::checkpoint::BaseRef>,
    },
}

impl Kept {
    /// The base the checkpoint's tensors go with.
    pub fn base(&self) -> Option<&crate::checkpoint::BaseRef> {
        match self {
            Kept::Whole => None,
            Kept::Trained { base, .. } => base.as_ref(),
        }
    }

    /// Whether a checkpoint keeps the variable of this name.
    pub fn keeps(&self, name: &str) -> bool {
        match self {
            Kept::Whole => true,
            Kept::Trained { names, .. } => names.contains(name),
        }
    }
}

/// `train.unfreeze_at_epoch`: at the start of `epoch` (0-based) the frozen parameters start
/// training in the groups of `all`.
#[derive(Debug, Clone)]
pub struct Unfreeze {
    pub epoch: i64,
    pub all: crate::optim::Groups,
}

impl Trained {
    /// The model's buffers (BatchNorm running statistics) in name order.
    pub fn buffers(&self) -> Vec<Tensor> {
        // Not by requires_grad: a frozen parameter is no buffer.
        crate::model::buffers(&self.vs).into_iter().map(|(_, t)| t).collect()
    }
}

/// DARTS's architecture step as a driver of its own: before each weight step, one first-order
/// step of the architecture weights on the next micro-batch of an endless, per-round shuffled
/// stream of held-out samples, with its own optimizer, loss scaler and position.
pub struct ArchStep {
    pub step: ExtraStep,
    pub opt: Optimizer,
    pub state: ArchState,
    /// The stream's current round and its order, computed once per round.
    order: Option<(i64, Vec<i64>)>,
    seed: i64,
}

impl ArchStep {
    pub fn new(step: ExtraStep, opt: Optimizer, state: ArchState, seed: i64) -> Self {
        ArchStep {
            step,
            opt,
            state,
            order: None,
            seed,
        }
    }

    /// The k-th sample of the held-out stream.
    fn index(&mut self, n: i64, k: i64) -> i64 {
        let round = k / n;
        if self.order.as_ref().is_none_or(|(r, _)| *r != round) {
            self.order = Some((round, data::epoch_order(n, self.seed.wrapping_add(7919), round)));
        }
        let (_, order) = self.order.as_ref().expect("just filled");
        order[(k % n) as usize]
    }

    /// One architecture step at the weight step's micro-batch. The weights' gradients are
    /// released with the architecture's, and it neither clips nor shares the weights' clipping.
    pub fn run(&mut self, at: ArchAt<'_>, exec: &mut Execution) -> Result<(), StepError> {
        let n = at.val.len();
        let b = at.micro_batch.min(n);
        let start = self.state.val_cursor;
        let idx: Vec<i64> = (0..b).map(|k| self.index(n, start + k)).collect();
        let work = Work {
            data: at.val,
            group: &idx,
            micro_batch: idx.len(),
            lr: self.step.lr,
            step: None,
            epoch: at.epoch,
            loss_scale: self.state.arch_scaler.map(|s| s.scale),
            buffers: at.buffers,
            // Streaming needs every variable in one block; DARTS's α are used by every cell.
            stream: None,
            divisor: idx.len() as f64,
            contributes: true,
            stop: false,
            // Every rank computes the same architecture step on the same samples.
            synced: false,
        };
        let pipeline = StepPipeline {
            clip_norm: 0.0,
            ..*at.pipeline
        };
        let out = pipeline.run(at.net, &mut self.opt, &mut [at.weights], &work, exec, None)?;
        if let Some(s) = &mut self.state.arch_scaler {
            s.update(out.found_inf);
        }
        self.state.arch_steps += 1;
        self.state.val_cursor += b;
        Ok(())
    }
}

/// What an architecture step runs against.
pub struct ArchAt<'a> {
    pub net: &'a dyn Net,
    pub weights: &'a mut Optimizer,
    pub val: &'a Dataset,
    pub micro_batch: i64,
    pub epoch: i64,
    pub buffers: &'a [Tensor],
    pub pipeline: &'a StepPipeline,
}

/// The parts a memory lever changes when engaged or released.
pub struct Parts<'a> {
    pub model: &'a mut Trained,
    pub arch: Option<&'a mut ArchStep>,
    pub forward: &'a mut Forward,
}
