//! The forward part of a step: how a micro-batch enters the model (device, dtype, autocast), the
//! loss, and forward with backward, either plain or with activation checkpointing.
//!
//! Activation checkpointing: forward and backward of one micro-batch through a model's chain of
//! blocks, keeping only the activations at block boundaries.
//!
//! The forward pass runs every block but the last without building a graph, saving each block's
//! inputs and the generator state it started from. The last block (the head) runs with the graph,
//! the loss is back-propagated to its inputs. Then, from the last block down, each block is run
//! again from its saved inputs with the graph on, under the generator state it first saw (so
//! dropout draws the same masks), and the gradient arriving at its outputs is back-propagated
//! through it (`torch.autograd.backward(outputs, grads)`), which accumulates into the parameters
//! and gives the gradient at its inputs. The recomputation must not update BatchNorm's running
//! statistics a second time: the buffers are saved after the first forward and put back after
//! each block's backward (BatchNorm's backward checks their version, so not before). With the same graph inside each block as the plain forward, gradients
//! equal the plain run's bit for bit on the CPU.
//!
//! With parameters streamed (`memory.parameters = "host"`, `run::stream`) the same pass also
//! brings each block's variables to the device one block ahead of its forward, and again of its
//! backward, and sends them back once the block is done.
//!
//! Memory: the plain forward keeps every block's activations until backward; this keeps the block
//! boundaries plus one block's activations at a time. Time: one more forward of every block but
//! the last (about a third more per step for a model whose backward costs twice its forward).
use tch::{Device, Kind, Reduction, Tensor};

use super::stream::{streamed_forward, Pass, Streamer};
use super::tally::Count;
use crate::data::Dataset;
use crate::fault::{self, Phase};
use crate::host::{Fence, Home, Host};
use crate::model::{lm_loss, Chain, Net};
use crate::oom::{self, inside_guard as ok};
use crate::shim::{self, Autocast};
use crate::spec::Precision;

/// How inputs enter the model, in which dtype it computes, and how the loss is scaled.
#[derive(Debug, Clone, Copy)]
pub struct PrecisionStage {
    pub precision: Precision,
}

impl PrecisionStage {
    /// Places a batch on the device in the dtype the model's weights have (the mixed modes keep
    /// fp32 weights and let autocast cast). Token ids stay integers.
    pub fn input(&self, x: &Tensor, device: Device) -> Tensor {
        let x = Host::new(device).input(x);
        match self.precision {
            Precision::Bf16 if x.is_floating_point() => x.to_kind(Kind::BFloat16),
            _ => x,
        }
    }

    /// An autocast region for the mixed modes (None otherwise); it ends when dropped.
    pub fn autocast(&self, device: Device) -> Option<Autocast> {
        let dtype = self.precision.autocast()?;
        // Entering only sets thread-local flags; it cannot fail short of a broken libtorch.
        Some(Autocast::enter(device, dtype).expect("autocast state can be set"))
    }
}

/// A micro-batch placed on the device (its copies may still be in flight): inputs in the
/// model's dtype, and labels.
pub struct Batch {
    pub x: Tensor,
    pub y: Tensor,
}

impl Batch {
    /// The same tensors again: what a replayed graph reads is what its capture read.
    pub fn alias(&self) -> Batch {
        Batch {
            x: self.x.shallow_clone(),
            y: self.y.shallow_clone(),
        }
    }
}

/// The forward part: device, precision and whether the forward is recomputed in backward
/// (models with a chain; the `recompute` lever turns it on).
#[derive(Debug, Clone, Copy)]
pub struct Forward {
    pub device: Device,
    pub precision: PrecisionStage,
    pub recompute: bool,
    /// Host: the recomputed path keeps the block boundaries on the host and brings each back
    /// one block ahead of its backward (`memory.activations`).
    pub activations: Home,
}

/// One micro-batch of a step, and what its backward needs.
pub struct Micro<'a> {
    pub batch: Batch,
    /// The model's buffers (BatchNorm running statistics): recomputation puts them back after
    /// running a block a second time, so they are updated once per forward.
    pub buffers: &'a [Tensor],
    /// fp16-mixed: the loss scale of this step.
    pub loss_scale: Option<f64>,
    /// Parameters streamed by block: the recomputed pass brings each block in and sends it back.
    pub stream: Option<&'a Streamer>,
    /// The global step this micro-batch belongs to, for fault injection in tests; none for
    /// DARTS's architecture step, which the count leaves out.
    pub step: Option<i64>,
}

/// What the step's optimizer does around one micro-batch's forward and backward: an update
/// still pending from the last step finishes block by block as the forward reaches each block,
/// and gradients placed on the host leave the device after each block's backward.
pub trait Around {
    /// Block `i`'s parameters are about to be read (brought in, or used by its kernels).
    fn block_coming(&mut self, i: usize);
    /// Block `i`'s kernels are about to be queued.
    fn block_ready(&mut self, i: usize);
    /// Nothing may stay pending from here on: before backward, and before a forward that does
    /// not go by block.
    fn settle(&mut self);
    /// After block `i`'s backward (once, with `i` 0, after the whole backward without
    /// recomputation).
    fn after_block(&mut self, i: usize);
}

/// Entering a stage of the step: marked for the OOM guard, so an OOM names it, and squeezed
/// where a test's fault asks for this stage (the guard lifts the squeeze).
pub fn stage(phase: Phase, step: impl Into<Option<i64>>) -> fault::Squeeze {
    oom::entering(phase);
    fault::squeeze_in(phase, step)
}

impl Forward {
    /// The samples at `idx` (drawn in `epoch`, which keys their augmentation), on their way to
    /// the device.
    pub fn inputs(&self, data: &Dataset, idx: &[i64], epoch: i64) -> Batch {
        let (x, y) = data.batch_at(idx, epoch);
        Batch {
            x: self.precision.input(&x, self.device),
            y: Host::new(self.device).input(&y),
        }
    }

    /// Sum-reduced cross-entropy and correct count of one micro-batch.
    /// With parameters streamed (`stream`, validation under no_grad), block by block.
    pub fn forward_loss(
        &self,
        net: &dyn Net,
        stream: Option<&Streamer>,
        batch: &Batch,
        train: bool,
    ) -> (Tensor, Tensor, Count) {
        let x = &batch.x;
        let logits = streamed_forward(net, stream, x, train, &|| self.precision.autocast(self.device));
        self.loss(net, &logits, &batch.y)
    }

    /// Sum-reduced cross-entropy in fp32, the correct count and what the loss counts, from the
    /// model's output: logits (a sample each), or a language model's hidden states, whose
    /// next-token loss goes through the output projection a chunk of tokens at a time (a token
    /// each, ignored targets left out).
    pub fn loss(&self, net: &dyn Net, out: &Tensor, y: &Tensor) -> (Tensor, Tensor, Count) {
        if let Some(w) = net.output_head() {
            let chunk = lm_loss::chunk_tokens(w.size()[0]);
            let t = lm_loss::next_token_loss(out, &w, y, self.precision.precision.autocast(), chunk);
            return (t.loss, t.correct, Count::Counted(t.tokens));
        }
        let logits = out.to_kind(Kind::Float);
        let loss = logits.cross_entropy_loss::<Tensor>(y, None, Reduction::Sum, -100, 0.0);
        let correct = logits.argmax(-1, false).eq_tensor(y).sum(Kind::Int64);
        (loss, correct, Count::Known(y.size()[0] as f64))
    }

    /// The loss backward starts from: the group mean's share, times the loss scale.
    pub fn scaled(&self, loss: &Tensor, n: f64, scale: Option<f64>) -> Tensor {
        let l = loss / n;
        match scale {
            Some(s) => l * s,
            None => l,
        }
    }

    /// Forward, loss and backward of one micro-batch, the loss divided by `n` (the group's size:
    /// its samples, or a language model's counted target tokens)
    /// before backward; returns the sum-reduced loss and the correct count. `around` is told of
    /// each block as the forward reaches it and after each block's backward.
    pub fn forward_backward(&self, net: &dyn Net, m: &Micro, n: f64, around: &mut dyn Around) -> (Tensor, Tensor) {
        match net.chain().filter(|_| self.recompute || m.stream.is_some()) {
            Some(_) => recomputed(self, net, m, n, around),
            None => {
                around.settle();
                let forward = stage(Phase::Forward, m.step);
                let (loss, c, _) = self.forward_loss(net, None, &m.batch, true);
                drop(forward);
                let _backward = stage(Phase::Backward, m.step);
                self.scaled(&loss, n, m.loss_scale).backward();
                around.after_block(0);
                (loss, c)
            }
        }
    }
}

/// Puts the generator state back when dropped, so an error inside a recomputation cannot leave
/// the run's random stream rewound.
struct RngRestore {
    device: tch::Device,
    state: Vec<u8>,
}

impl Drop for RngRestore {
    fn drop(&mut self) {
        if let Err(e) = shim::set_rng_state(self.device, &self.state) {
            tracing::warn!("restoring the generator state: {e}");
        }
    }
}

/// Generator whose stream dropout reads on this device. The CPU generator also drives CPU-side
/// randomness, so both are saved when the run is on CUDA.
fn rng_devices(device: tch::Device) -> Vec<tch::Device> {
    match device {
        tch::Device::Cpu => vec![tch::Device::Cpu],
        d => vec![tch::Device::Cpu, d],
    }
}

fn save_rng(device: tch::Device) -> Vec<(tch::Device, Vec<u8>)> {
    rng_devices(device)
        .into_iter()
        .map(|d| (d, ok(shim::rng_state(d))))
        .collect()
}

/// A block's inputs and the generator states it started from.
type Saved = (Vec<Tensor>, Vec<(tch::Device, Vec<u8>)>);

/// Where the saved block inputs wait for backward.
struct Boundaries {
    host: Option<Host>,
}

impl Boundaries {
    /// Sends a block's inputs to the host once the kernels queued so far (the block that reads
    /// them) have run; the device copies go when the block is done with them.
    fn keep(&self, ts: Vec<Tensor>) -> Vec<Tensor> {
        match &self.host {
            Some(h) => {
                let copies = h.copies();
                ts.iter()
                    .map(|t| {
                        let kept = h.empty(&t.size(), t.kind());
                        copies.down(&kept, t);
                        kept
                    })
                    .collect()
            }
            None => ts,
        }
    }

    /// The inputs back on the device, issued ahead of the block that needs them: it waits for
    /// the fence first.
    fn fetch(&self, ts: Vec<Tensor>) -> (Vec<Tensor>, Option<Fence>) {
        match &self.host {
            Some(h) => {
                let copies = h.copies();
                let back = ts.iter().map(|t| copies.up_new(t)).collect();
                (back, Some(copies.fence()))
            }
            None => (ts, None),
        }
    }
}

/// Detached copies of a block boundary that collect the gradient arriving at them.
fn leaves(ts: &[Tensor]) -> Vec<Tensor> {
    ts.iter()
        .map(|t| {
            let d = t.detach();
            if d.is_floating_point() {
                d.set_requires_grad(true)
            } else {
                d
            }
        })
        .collect()
}

/// Block `i` run again with the graph on, under the generator states it first saw (so dropout
/// draws the same masks); the run's own states are put back afterwards, even on an error.
fn rerun(p: &Forward, chain: &dyn Chain, i: usize, ins: &[Tensor], rng: &[(tch::Device, Vec<u8>)]) -> Vec<Tensor> {
    let _restore: Vec<RngRestore> = rng
        .iter()
        .map(|(d, _)| RngRestore {
            device: *d,
            state: ok(shim::rng_state(*d)),
        })
        .collect();
    for (d, s) in rng {
        ok(shim::set_rng_state(*d, s));
    }
    let _autocast = p.precision.autocast(p.device);
    chain.block(i, ins, true)
}

/// How blocks come and go in a recomputed pass: streamed parameters are brought in one block
/// ahead and sent back after use, and a pending optimizer update finishes block `i` before the
/// block comes in (its host copy is what streaming brings) and one block ahead of its kernels,
/// which wait for its uploads only.
struct Flow<'a> {
    pass: Option<Pass<'a>>,
}

impl Flow<'_> {
    fn bring(&self, a: &mut dyn Around, i: usize) {
        a.block_coming(i);
        self.pass.iter().for_each(|s| s.bring(i));
    }

    fn ready(&self, a: &mut dyn Around, i: usize) {
        a.block_ready(i);
        self.pass.iter().for_each(|s| s.ready(i));
    }

    fn release(&self, i: usize) {
        self.pass.iter().for_each(|s| s.release(i));
    }
}

/// The chain's last block with the graph on, and the loss of its output.
fn head_loss(p: &Forward, net: &dyn Net, head_in: &[Tensor], y: &Tensor) -> (Tensor, Tensor) {
    let chain = net.chain().expect("a recomputed model has a chain");
    let out = {
        let _autocast = p.precision.autocast(p.device);
        chain.block(chain.blocks() - 1, head_in, true).pop().expect("logits")
    };
    let (loss, correct, _) = p.loss(net, &out, y);
    (loss, correct)
}

/// Checkpointed forward, loss and backward of one micro-batch; returns the sum-reduced loss and
/// the correct count, as `Forward::forward_loss` does.
fn recomputed(p: &Forward, net: &dyn Net, m: &Micro, n: f64, around: &mut dyn Around) -> (Tensor, Tensor) {
    let chain = net.chain().expect("a recomputed model has a chain");
    let forward = stage(Phase::Forward, m.step);
    let (x, y) = (m.batch.x.shallow_clone(), &m.batch.y);
    let k = chain.blocks();
    let bounds = Boundaries {
        host: p.activations.is_host().then(|| Host::new(p.device)),
    };
    let mut saved: Vec<Saved> = Vec::with_capacity(k);
    let mut state = vec![x];
    // Streamed parameters: each block comes in one block ahead of its use and goes back once
    // its forward (and later its backward) is done; all go back if anything fails.
    let flow = Flow {
        pass: m.stream.map(Streamer::pass),
    };
    flow.bring(around, 0);
    tch::no_grad(|| {
        // Streamed: one autocast region per block, so the cast cache (low-precision copies of
        // the weights) leaves with its block.
        let mut _autocast = p.precision.autocast(p.device);
        for i in 0..k - 1 {
            flow.bring(around, i + 1);
            let rng = save_rng(p.device);
            if flow.pass.is_some() {
                // The old region ends before the new one starts: its cache is dropped and the
                // new one restores a state with autocast on.
                _autocast = None;
                _autocast = p.precision.autocast(p.device);
            }
            flow.ready(around, i);
            let next = chain.block(i, &state, true);
            flow.release(i);
            saved.push((bounds.keep(std::mem::replace(&mut state, next)), rng));
        }
    });
    // The buffers as the one real forward left them.
    let buffers: Vec<Tensor> = m.buffers.iter().map(|b| b.copy()).collect();

    let head_in = leaves(&state);
    flow.ready(around, k - 1);
    let (loss, correct) = head_loss(p, net, &head_in, y);
    // The last saved boundary and its block come back while the head's backward runs.
    let mut ahead = saved.pop().map(|(ins, rng)| (bounds.fetch(ins), rng));
    drop(forward);
    // Recomputing each block's forward is backward's memory: it happens only for backward.
    let _backward = stage(Phase::Backward, m.step);
    around.settle();
    if let Some(j) = k.checked_sub(2) {
        flow.bring(around, j);
    }
    p.scaled(&loss, n, m.loss_scale).backward();
    around.after_block(k - 1);
    // The head's gradients have left (with the parameters streamed, gradients live on the
    // host), so its parameters can.
    flow.release(k - 1);
    let mut grads: Vec<Tensor> = head_in.iter().map(Tensor::grad).collect();
    drop(head_in);

    while let Some(((inputs, arrived), rng)) = ahead.take() {
        let i = saved.len();
        // One block ahead: the next boundary and block are on their way while this block runs
        // again.
        ahead = saved.pop().map(|(ins, rng)| (bounds.fetch(ins), rng));
        if i > 0 {
            flow.bring(around, i - 1);
        }
        if let Some(f) = arrived {
            f.compute_waits();
        }
        flow.ready(around, i);
        let ins = if i == 0 { inputs } else { leaves(&inputs) };
        let outs = rerun(p, chain, i, &ins, &rng);
        // Outputs that received no gradient (a weight no later block used) start nothing.
        let (roots, gs): (Vec<Tensor>, Vec<Tensor>) = outs
            .into_iter()
            .zip(grads)
            .filter(|(o, g)| g.defined() && o.requires_grad())
            .unzip();
        if !roots.is_empty() {
            ok(shim::backward(&roots, &gs));
        }
        around.after_block(i);
        // After the backward: BatchNorm's backward holds the running statistics (and checks
        // their version), so they go back only once it has run.
        tch::no_grad(|| {
            for (b, s) in m.buffers.iter().zip(&buffers) {
                b.shallow_clone().copy_(s);
            }
        });
        flow.release(i);
        grads = ins.iter().map(Tensor::grad).collect();
    }
    (loss, correct)
}
