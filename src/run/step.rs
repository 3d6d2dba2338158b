//! One optimizer step as one pipeline, shared by the weight step and DARTS's architecture step:
//!
//! 1. **zero**: every trainable gradient is zeroed (kept allocated, so memory stays flat);
//! 2. per micro-batch: **forward** (the precision stage places and casts the input), **loss**
//!    (sum-reduced cross-entropy in fp32 divided by the group's size, so the accumulated gradient
//!    is the group mean however the group is split), **backward**;
//! 3. **clip** the global gradient norm when asked;
//! 4. **optimizer step**, transactional (see `Optimizer::step`).
//!
//! The whole pipeline runs inside the OOM guard: an error anywhere unwinds, drops every tensor of
//! the failed attempt and leaves parameters and optimizer state as they were, so the group can be
//! retried whole. Precision (loss scaling, autocast) wraps forward/loss/backward and sits between
//! backward and clip (unscale); recomputation replaces forward/backward per micro-batch; a
//! data-parallel all-reduce goes between backward and clip.
use tch::{Device, Kind, Reduction, Tensor};

use crate::data::Dataset;
use crate::fault;
use crate::memory::{self, Place};
use crate::model::Net;
use crate::oom::{self, StepError};
use crate::optim::{clip_grad_norm, Optimizer};
use crate::spec::Precision;

/// How inputs enter the model and logits leave it.
#[derive(Debug, Clone, Copy)]
pub struct PrecisionStage {
    pub precision: Precision,
}

impl PrecisionStage {
    /// Places a batch on the device in the dtype the model's weights have.
    pub fn input(&self, x: &Tensor, device: Device) -> Tensor {
        let x = x.to_device(device);
        match self.precision {
            Precision::Fp32 => x,
            Precision::Bf16 => x.to_kind(Kind::BFloat16),
        }
    }
}

/// The fixed parts of every step: device, precision and clipping.
#[derive(Debug, Clone, Copy)]
pub struct StepPipeline {
    pub device: Device,
    pub precision: PrecisionStage,
    /// 0: no clipping.
    pub clip_norm: f64,
}

/// What one step trains on: a group of sample indices, split into micro-batches.
pub struct Work<'a> {
    pub data: &'a Dataset,
    pub group: &'a [i64],
    pub micro_batch: usize,
    pub lr: f64,
    /// The global step this work belongs to (1-based), for fault injection in tests.
    pub step: i64,
}

/// Loss summed over the group's samples and the number classified correctly.
#[derive(Debug, Clone, Copy)]
pub struct StepOutput {
    pub loss_sum: f64,
    pub correct: i64,
}

impl StepPipeline {
    pub fn place(&self) -> Place {
        Place::of(self.device)
    }

    /// Sum-reduced cross-entropy and correct count of one micro-batch.
    pub fn forward_loss(&self, net: &dyn Net, data: &Dataset, idx: &[i64], train: bool) -> (Tensor, Tensor) {
        let (x, y) = data.batch(&Tensor::from_slice(idx));
        let y = y.to_device(self.device);
        let logits = net
            .forward_t(&self.precision.input(&x, self.device), train)
            .to_kind(Kind::Float);
        let loss = logits.cross_entropy_loss::<Tensor>(&y, None, Reduction::Sum, -100, 0.0);
        let correct = logits.argmax(-1, false).eq_tensor(&y).sum(Kind::Int64);
        (loss, correct)
    }

    /// Runs the pipeline once for `work`, stepping `opt`; `others` are optimizers whose
    /// gradients are zeroed too (their parameters get gradients from this backward pass but
    /// are not stepped here).
    pub fn run(
        &self,
        net: &dyn Net,
        opt: &mut Optimizer,
        others: &mut [&mut Optimizer],
        work: &Work,
    ) -> Result<StepOutput, StepError> {
        let place = self.place();
        oom::guarded_counting(
            || memory::oom_count(place),
            || {
                // zero
                opt.zero_grad();
                for o in others.iter_mut() {
                    o.zero_grad();
                }
                // forward → loss → backward, per micro-batch
                let n = work.group.len() as f64;
                let mut loss_sum = Tensor::zeros([], (Kind::Float, self.device));
                let mut correct = Tensor::zeros([], (Kind::Int64, self.device));
                for chunk in work.group.chunks(work.micro_batch.max(1)) {
                    let (loss, c) = self.forward_loss(net, work.data, chunk, true);
                    (&loss / n).backward();
                    loss_sum += loss.detach();
                    correct += c;
                }
                // clip
                if self.clip_norm > 0.0 {
                    clip_grad_norm(opt.params(), self.clip_norm);
                }
                // optimizer step
                {
                    let _squeeze = fault::squeeze_before_optimizer(work.step);
                    opt.step(work.lr);
                }
                // One read per optimizer step; progress and records need the loss.
                StepOutput {
                    loss_sum: loss_sum.double_value(&[]),
                    correct: correct.int64_value(&[]),
                }
            },
        )
    }
}
