//! One optimizer step as one pipeline, shared by the weight step and DARTS's architecture step:
//!
//! 1. **zero**: every trainable gradient is zeroed (kept allocated, so memory stays flat);
//! 2. per micro-batch: **forward** and **loss** (sum-reduced cross-entropy in fp32 divided by the
//!    group's size, so the accumulated gradient is the group mean however the group is split),
//!    then **backward**, by the forward part (`forward`): it wraps forward and loss in an
//!    autocast region for the mixed modes, multiplies the loss by the scaler's scale for
//!    fp16-mixed, and with recomputation on runs the checkpointed pair;
//! 3. **unscale** (fp16-mixed): gradients divided by the scale in one fused kernel that also
//!    finds inf and NaN; such a step is **skipped** (no optimizer step, no step counted);
//! 4. **clip** the global gradient norm when asked (on unscaled gradients);
//! 5. **optimizer step**, transactional (see `Optimizer::step`).
//!
//! Nothing in it waits on the device but fp16-mixed's found-inf check: each micro-batch's inputs
//! go to the device from pinned memory without blocking, the next one's copy issued before this
//! one's backward; the clip norm is never read; the loss and correct count stay on the device as
//! [`Totals`] for the trainer to read at a logged step, after the optimizer step is launched.
//!
//! The whole pipeline runs inside the OOM guard: an error anywhere unwinds, drops every tensor of
//! the failed attempt, restores grad mode and the autocast state, and leaves parameters,
//! optimizer state and the scaler as they were (the caller updates the scaler only after a
//! step succeeded), so the group can be retried whole. A data-parallel all-reduce goes between
//! backward and unscale.
use tch::{Kind, Tensor};

use super::forward::{Around, Batch, Forward, Micro};
use super::stream::Streamer;
use super::tally::{Count, Tally, Totals};
use crate::data::Dataset;
use crate::fault::{self, Phase};
use crate::memory::{self, Place};
use crate::model::Net;
use crate::oom::{self, StepError};
use crate::optim::{clip_grads, Optimizer, Prepared, Step};
use crate::parallel::{Dist, Local, Outcome};
use crate::readback;
use crate::shim;
use crate::shim::dist::Reducer;

fn other(e: anyhow::Error) -> StepError {
    StepError::Other(format!("{e:#}"))
}

/// A collective failed before the optimizer wrote anything: another rank is gone, or this one
/// ran out of memory inside it.
fn peer_lost(e: anyhow::Error) -> StepError {
    let message = format!("{e:#}");
    match oom::classify(&message) {
        Some(_) => StepError::OomInCollective(message),
        None => StepError::PeerLost(message),
    }
}

/// The fixed parts of every step: the forward part and clipping.
#[derive(Debug, Clone, Copy)]
pub struct StepPipeline {
    pub forward: Forward,
    /// 0: no clipping.
    pub clip_norm: f64,
}

/// What one step trains on: a group of sample indices, split into micro-batches.
pub struct Work<'a> {
    pub data: &'a Dataset,
    pub group: &'a [i64],
    pub micro_batch: usize,
    pub lr: f64,
    /// The global step this work belongs to (1-based), for fault injection in tests; none for
    /// DARTS's architecture step, which the count leaves out.
    pub step: Option<i64>,
    /// The epoch (0-based) the samples are drawn in, which keys their augmentation.
    pub epoch: i64,
    /// fp16-mixed: the loss scale of this step.
    pub loss_scale: Option<f64>,
    /// The model's buffers (BatchNorm running statistics): recomputation puts them back after
    /// running a block a second time, so they are updated once per forward.
    pub buffers: &'a [Tensor],
    /// Parameters streamed by block (`memory.parameters = "host"`).
    pub stream: Option<&'a Streamer>,
    /// What the loss is divided by: the whole group's size, across all ranks (a language
    /// model's: the group's counted target tokens).
    pub divisor: f64,
    /// False for a rank with no samples in this group: it runs one sample with a zero loss, so
    /// its Reducer takes part, and reports nothing.
    pub contributes: bool,
    /// Data-parallel: this rank was asked to stop (agreed on in the exchange).
    pub stop: bool,
    /// Data-parallel: the gradients are synchronised by the Reducer (the weight step; the
    /// architecture step is computed alike on every rank and needs none).
    pub synced: bool,
}

/// A step's borrowed parts, as the pipeline and the graphs pass them on.
pub struct Stepping<'s, 'o> {
    pub net: &'s dyn Net,
    pub opt: &'s mut Optimizer,
    pub others: &'s mut [&'o mut Optimizer],
    pub work: &'s Work<'s>,
    pub tally: Option<&'s mut Tally>,
}

/// What one guarded attempt yields: loss sum and correct count, inf found, the prepared step.
type Attempt = (Totals, bool, Option<Prepared>);

/// What a step yields to the trainer (its loss went into the tally).
#[derive(Debug, Clone, Copy)]
pub struct StepOutput {
    /// fp16-mixed: the gradients held inf or NaN, so the optimizer step was skipped.
    pub found_inf: bool,
    /// Data-parallel: some rank was asked to stop; every rank stops after this step.
    pub stop: bool,
}

impl StepPipeline {
    pub fn place(&self) -> Place {
        Place::of(self.forward.device)
    }

    /// `f` inside the OOM guard, counting the device's OOMs as the step's.
    pub(super) fn guarded<T>(&self, f: impl FnOnce() -> T) -> Result<T, StepError> {
        let place = self.place();
        oom::guarded_counting(|| memory::oom_count(place), f)
    }

    /// The step as one rank of a data-parallel group: every rank takes part in the collectives
    /// and all agree on the outcome before any optimizer writes.
    pub(super) fn data_parallel(&self, d: &mut Dist, s: Stepping) -> Result<StepOutput, StepError> {
        let Stepping {
            net,
            opt,
            others,
            work,
            tally,
        } = s;
        let reducer = work.synced.then(|| d.reducer()).flatten();
        let synced = reducer.is_some();
        if let Some(r) = reducer {
            r.enter().map_err(peer_lost)?;
        }
        let attempt = self.guarded(|| self.attempt(net, opt, others, work, reducer, None));
        let out = self.agree(d, opt, work, synced, attempt)?;
        if let Some(t) = tally {
            t.add_values(out.0, out.1, work.divisor);
        }
        Ok(out.2)
    }

    /// The step in a single process, eager.
    pub(super) fn eager(&self, s: Stepping) -> Result<StepOutput, StepError> {
        let Stepping {
            net,
            opt,
            others,
            work,
            tally,
        } = s;
        let (totals, found_inf, prepared) = self.guarded(|| self.attempt(net, opt, others, work, None, None))?;
        // Into the tally in place, before the optimizer writes: nothing of the attempt is
        // alive while it does, so an applied step peaks no higher than a skipped one.
        match tally {
            Some(t) => t.add(totals),
            None => drop(totals),
        }
        if let Some(p) = prepared {
            opt.apply(p, work.lr).map_err(other)?;
        }
        Ok(StepOutput { found_inf, stop: false })
    }

    /// Every micro-batch of `work`, on its way to the device.
    pub(super) fn uploads(&self, work: &Work) -> Vec<Batch> {
        work.group
            .chunks(work.micro_batch.max(1))
            .map(|c| self.forward.inputs(work.data, c, work.epoch))
            .collect()
    }

    /// The step as a capture records it: reading `inputs` in place of uploads, the update
    /// applied with the scalars `step` staged. Inside the OOM guard: an error panics.
    pub(super) fn recorded(&self, s: &mut Stepping, inputs: &[Batch], step: Step) -> Totals {
        let (totals, _, prepared) = self.attempt(s.net, s.opt, s.others, s.work, None, Some(inputs));
        let prepared = prepared.expect("a captured step has no loss scale, so it is never skipped");
        if let Err(e) = s.opt.apply_staged(prepared, step) {
            panic!("{e:#}");
        }
        totals
    }

    /// One attempt inside the OOM guard: zero, forward and backward per micro-batch, unscale,
    /// clip, and the optimizer's allocations; the loss sum, correct count, whether the
    /// gradients held inf or NaN, and the prepared optimizer step.
    fn attempt(
        &self,
        net: &dyn Net,
        opt: &mut Optimizer,
        others: &mut [&mut Optimizer],
        work: &Work,
        reducer: Option<&Reducer>,
        fixed: Option<&[Batch]>,
    ) -> Attempt {
        // zero: gradients are released, as PyTorch's default zero_grad does; placing the inputs
        // counts as forward's memory
        oom::entering(Phase::Forward);
        opt.drop_grads();
        for o in others.iter_mut() {
            // Their parameters are read by this forward, not by block.
            Around::settle(&mut **o);
            o.drop_grads();
        }
        // forward → loss → backward, per micro-batch
        // A group without a counted target (prompts filling their windows): 0/1, not 0/0 in every weight.
        let n = if work.contributes {
            work.divisor.max(1.0)
        } else {
            f64::INFINITY
        };
        let device = self.forward.device;
        let mut loss_sum = Tensor::zeros([], (Kind::Float, device));
        let mut correct = Tensor::zeros([], (Kind::Int64, device));
        let chunks: Vec<&[i64]> = work.group.chunks(work.micro_batch.max(1)).collect();
        // A capture reads the inputs where every replay will have them.
        let inputs = |i: usize| match fixed {
            Some(f) => f.get(i).map(Batch::alias),
            None => chunks.get(i).map(|c| self.forward.inputs(work.data, c, work.epoch)),
        };
        let mut ahead = inputs(0);
        for i in 0..chunks.len() {
            // The next micro-batch's copy is on its way while this one runs.
            let batch = ahead.take().expect("one placed batch per micro-batch");
            ahead = inputs(i + 1);
            if i + 1 == chunks.len() {
                // The last micro-batch's backward synchronises (DDP outside no_sync).
                if let Some(r) = reducer {
                    r.arm().unwrap_or_else(|e| panic!("{e:#}"));
                }
            }
            let micro = Micro {
                batch,
                buffers: work.buffers,
                loss_scale: work.loss_scale,
                stream: work.stream,
                step: work.step,
            };
            let (loss, c) = self.forward.forward_backward(net, &micro, n, opt);
            loss_sum += loss.detach();
            correct += c;
        }
        if let Some(r) = reducer {
            r.settle(false).unwrap_or_else(|e| panic!("{e:#}"));
        }
        opt.finish_backward();
        // From here on an OOM is the optimizer step's: it reads and rewrites the gradients.
        oom::entering(Phase::Optimizer);
        // unscale (the gradients are the optimizer's: on the device, or on the host; listed
        // only when a stage reads them)
        let grads = || -> Vec<Tensor> { opt.grads().into_iter().map(|(_, g)| g).collect() };
        if let Some(step) = work.step {
            fault::plant_inf_at(step, grads);
        }
        // A fused optimizer divides the scale out in its kernel, as GradScaler.step has it do
        // when unscale_ was not called, so only the inf check runs here (a multiply by 1, as
        // GradScaler's `_check_inf_per_device`). Clipping needs unscaled gradients: with it the
        // gradients are unscaled here and the kernel gets no scale.
        let folded = work.loss_scale.filter(|_| self.clip_norm == 0.0 && opt.folds_unscale());
        let found_inf = match work.loss_scale {
            Some(scale) => unscale(&grads(), if folded.is_some() { 1.0 } else { scale }),
            None => false,
        };
        // clip (the norm stays on the device: nothing here needs it)
        if self.clip_norm > 0.0 {
            let _norm = clip_grads(grads(), self.clip_norm);
        }
        // optimizer step, its allocations first; a step whose gradients are not finite makes
        // them too and lets them go, so its peak is an applied step's (fit's fp16 probes whose
        // every step is skipped would measure less than training needs)
        let prepared = {
            let _squeeze = fault::squeeze_before_optimizer(work.step);
            let p = opt.prepare();
            let p = match folded {
                Some(scale) => p.with_grad_scale(opt, scale),
                None => p,
            };
            (!found_inf).then_some(p)
        };
        // A rank without samples ran one with a zero loss: it counts nothing.
        let totals = match work.contributes {
            true => Totals::new(loss_sum, correct, Count::Known(work.divisor)),
            false => Totals::zero(device),
        };
        (totals, found_inf, prepared)
    }

    /// Data-parallel: whatever happened here, this rank takes part in every collective the
    /// others run, then all agree before any optimizer writes.
    fn agree(
        &self,
        d: &mut Dist,
        opt: &mut Optimizer,
        work: &Work,
        synced: bool,
        attempt: Result<Attempt, StepError>,
    ) -> Result<(f64, i64, StepOutput), StepError> {
        let failed = attempt.is_err();
        if failed && synced {
            let r = d.reducer().expect("synced");
            r.settle(true).map_err(|e| peer_lost(d.explain(e)))?;
        }
        // The ranks agree on the outcome every step, and the loss travels with it: one read.
        let read = attempt.as_ref().ok().map(|(totals, ..)| totals.read());
        if let Some(Err(e)) = &read {
            tracing::error!("reading the step's loss: {e:#}");
        }
        let local = match read {
            Some(Ok((loss_sum, correct))) => Local {
                outcome: Outcome::Done,
                stop: work.stop,
                loss_sum,
                correct,
            },
            _ => Local {
                outcome: match attempt.as_ref().err() {
                    Some(StepError::Oom { .. }) => Outcome::OutOfMemory,
                    _ => Outcome::Broken,
                },
                stop: work.stop,
                loss_sum: 0.0,
                correct: 0,
            },
        };
        let agreed = {
            let _squeeze = fault::squeeze_in_collective(work.step);
            d.exchange(&local).map_err(peer_lost)?
        };
        if let Some(&first) = agreed.broken.first() {
            // Not an OOM: no recovery decision applies; every rank stops, the broken one with
            // its own error.
            return Err(match attempt {
                Err(StepError::Other(m)) => StepError::Other(m),
                _ => StepError::Other(format!("rank {first} failed (its own message says why); stopping")),
            });
        }
        if let Some(&first) = agreed.failed.first() {
            if synced {
                // A failed backward leaves the Reducer mid-pass; every rank starts a fresh one.
                let params: Vec<&Tensor> = opt.params().iter().map(|(_, t)| t).collect();
                d.attach(&params).map_err(other)?;
            }
            return Err(match attempt {
                Err(StepError::Other(m)) => StepError::Other(m),
                Err(e) => e,
                Ok(_) => StepError::Oom {
                    kind: crate::oom::OomKind::Peer,
                    message: format!("rank {first} ran out of memory"),
                    phase: None,
                },
            });
        }
        let (_, found_inf, prepared) = attempt.expect("no rank failed");
        if let Some(p) = prepared {
            opt.apply(p, work.lr).map_err(other)?;
            // Sharded state: each rank updated its own parameters; every rank takes them. (A
            // skipped fp16 step is skipped alike everywhere, as long as the inf check reads the
            // summed gradients, which are the same on every rank.)
            d.sync_shards(opt).map_err(other)?;
        }
        Ok((
            agreed.loss_sum,
            agreed.correct,
            StepOutput {
                found_inf,
                stop: agreed.stop,
            },
        ))
    }
}

/// The optimizer stepped by this pipeline finishes a pending update as the forward reaches each
/// block. Errors here would be libtorch refusing the optimizer's own tensors: they surface
/// through the OOM guard like any libtorch error.
impl Around for Optimizer {
    fn block_coming(&mut self, i: usize) {
        if let Err(e) = self.finish_block(i) {
            panic!("{e:#}");
        }
    }

    fn block_ready(&mut self, i: usize) {
        self.await_block(i);
    }

    fn settle(&mut self) {
        if let Err(e) = Optimizer::settle(self) {
            panic!("{e:#}");
        }
    }

    fn after_block(&mut self, i: usize) {
        self.collect_grads(i);
    }
}

/// Divides the gradients by `scale` in place; true if any is inf or NaN. The check runs where
/// the gradients are (the host's, when they live there).
fn unscale(grads: &[Tensor], scale: f64) -> bool {
    let Some(first) = grads.first() else {
        return false;
    };
    let device = first.device();
    let found_inf = Tensor::zeros([1], (Kind::Float, device));
    let inv_scale = Tensor::full([1], 1.0 / scale, (Kind::Float, device));
    if let Err(e) = shim::amp_unscale(grads, &found_inf, &inv_scale) {
        // Surfaces through the OOM guard like any libtorch error.
        panic!("{e}");
    }
    // The one read fp16-mixed adds to a step: the scaler and the skip decide on it.
    readback::flag(&found_inf)
}
