//! A host update that finishes during the next forward, block by block.
//!
//! With the optimizer state on the host, the update is CPU work: on a GPU, the device would sit
//! idle through all of it. So when the model runs as a chain of blocks, the update of a step is
//! applied (counted, its multipliers and gradients fixed) but left [`Pending`], and the next
//! forward finishes it one block ahead of use: block `i + 1`'s parameters are updated on the CPU
//! and sent up while block `i` computes ([`Optimizer::finish_block`]), and block `i`'s kernels
//! wait for its own uploads only ([`Optimizer::await_block`]).
//!
//! The math is the step's own: every parameter gets the same update from the same gradient and
//! state, only later, before the first kernel that reads it. Nothing but that forward may read
//! the parameters or the state while an update is pending, so everything else settles it first
//! ([`Optimizer::settle`]): the optimizer's own methods that read, move or replace state or
//! gradients, the forward before backward (and a forward that is not by block, before it starts),
//! and the trainer before validation, a save, a lever and an architecture step. Methods that
//! hand out state without `&mut` refuse while an update is pending, so a missed settle fails
//! loudly instead of saving stale values.
use std::collections::VecDeque;
use std::ops::Range;

use anyhow::Result;
use tch::{Device, Tensor};

use super::implementation::Batch;
use super::rule::Step;
use super::workspace::Workspace;
use super::Optimizer;
use crate::host::Fence;
use crate::shim::HostScope;

/// One run of a host update: a range of the live parameters, all of one block.
pub(super) struct Run {
    pub block: usize,
    /// The class (parameter group) of every parameter of the run.
    pub class: usize,
    pub range: Range<usize>,
    /// Gradients staged off the device: when this run's have landed.
    pub arrival: Option<Fence>,
}

/// A host update applied but not yet done: what its remaining runs need.
pub(super) struct Pending {
    pub step: Step,
    pub live: Vec<(usize, Tensor)>,
    pub targets: Vec<(String, Tensor)>,
    pub workspace: Workspace,
    pub grad_scale: Vec<(Device, Tensor)>,
    /// The runs not yet updated, in block order.
    pub runs: VecDeque<Run>,
    /// Per block: its uploads, until the compute stream is told to wait for them.
    pub uploaded: Vec<Option<Fence>>,
}

/// `live` in the order the forward reaches the blocks (`blocks[i]`: parameter i's block), so a
/// host update's runs can finish block by block.
pub(super) fn block_order(blocks: &[usize], live: &mut [(usize, Tensor)]) {
    // Stable: parameter order within a block, as without blocks.
    live.sort_by_key(|(i, _)| blocks[*i]);
}

impl Optimizer {
    /// Updates block by block during the next forward from now on: `blocks[i]` is the block of
    /// the model's chain that uses parameter `i` (each parameter used by exactly one). Only an
    /// unsharded optimizer defers; a sharded one sends its parameters to the other ranks right
    /// after the update.
    pub fn update_by_block(&mut self, blocks: Vec<usize>) {
        assert_eq!(blocks.len(), self.params.len(), "one block per parameter");
        self.blocks = Some(blocks);
    }

    /// Whether an applied host update is left for the next forward.
    pub(super) fn defers(&self) -> bool {
        self.blocks.is_some() && self.shard.is_none()
    }

    /// The block of live parameter `i` (0 when the update is not by block).
    pub(super) fn block_of(&self, i: usize) -> usize {
        self.blocks.as_ref().map_or(0, |b| b[i])
    }

    /// Whether an update is pending.
    #[cfg(test)]
    pub(super) fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    /// Block `i`'s parameters are about to be read: a pending update finishes every run up to
    /// and including block `i`'s, and queues their uploads.
    pub fn finish_block(&mut self, i: usize) -> Result<()> {
        let Some(mut p) = self.pending.take() else {
            return Ok(());
        };
        let out = (|| {
            while p.runs.front().is_some_and(|r| r.block <= i) {
                let run = p.runs.pop_front().expect("just seen");
                self.update_run(&mut p, run)?;
            }
            Ok(())
        })();
        self.pending = Some(p);
        out
    }

    /// Block `i`'s kernels are about to be queued: they run after its parameters' uploads.
    pub fn await_block(&mut self, i: usize) {
        if let Some(f) = self
            .pending
            .as_mut()
            .and_then(|p| p.uploaded.get_mut(i))
            .and_then(Option::take)
        {
            f.compute_waits();
        }
    }

    /// Finishes a pending update: every remaining run, and the next kernels wait for all its
    /// uploads.
    pub fn settle(&mut self) -> Result<()> {
        if self.pending.is_none() {
            return Ok(());
        }
        self.finish_block(usize::MAX)?;
        let p = self.pending.take().expect("pending");
        for f in p.uploaded.into_iter().flatten() {
            f.compute_waits();
        }
        Ok(())
    }

    /// One run: the rule over its parameters on the host, then their uploads on the copy
    /// stream, which the block's kernels will wait for.
    fn update_run(&mut self, p: &mut Pending, run: Run) -> Result<()> {
        if let Some(landed) = &run.arrival {
            landed.host_waits();
        }
        let t0 = std::time::Instant::now();
        let step = self.class_step(run.class, p.step);
        // Whatever the update allocates is the host's: on the CPU, never against the device's
        // cap (it may run inside the next step's forward).
        let _host = HostScope::enter();
        let Optimizer {
            rules,
            params,
            state,
            multipliers,
            forms_of,
            host,
            implementation,
            host_update_seconds,
            ..
        } = self;
        let chunk = &p.live[run.range];
        tch::no_grad(|| {
            implementation.apply(Batch {
                class: run.class,
                rule: &*rules[run.class],
                step,
                params: &mut p.targets,
                live: chunk,
                state,
                workspace: &p.workspace,
                multipliers: &multipliers[run.class],
                forms_of: *forms_of,
                grads_on_host: false,
                grad_scale: &p.grad_scale,
            })
        })?;
        let on_device: Vec<usize> = chunk
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| params[*i].1.device() != Device::Cpu)
            .collect();
        if !on_device.is_empty() {
            let uploads = host.copies();
            // Into the leaf variables themselves: no autograd record.
            tch::no_grad(|| {
                for i in on_device {
                    uploads.up(&params[i].1, &p.targets[i].1);
                }
            });
            if p.uploaded.len() <= run.block {
                p.uploaded.resize_with(run.block + 1, || None);
            }
            p.uploaded[run.block] = Some(uploads.fence());
        }
        *host_update_seconds.get_or_insert(0.0) += t0.elapsed().as_secs_f64();
        Ok(())
    }
}

impl Optimizer {
    /// [`Optimizer::settle`] where the caller cannot take an error: one would be a libtorch call
    /// refusing the optimizer's own tensors, a bug.
    pub(super) fn settle_now(&mut self) {
        if let Err(e) = self.settle() {
            panic!("finishing the pending optimizer update: {e:#}");
        }
    }

    /// State handed out while an update is pending would be stale.
    pub(super) fn assert_settled(&self) {
        assert!(
            self.pending.is_none(),
            "optimizer state read while an update is pending: settle first"
        );
    }
}
