//! Parameters streamed by block (`memory.parameters = "host"`): every variable of the model (its
//! parameters and buffers) rests in host memory, and the device holds only the blocks in flight.
//!
//! The variable itself never changes: `set_data` swaps the storage under it, so the VarStore,
//! the modules' and the optimizer's shallow clones and autograd's accumulators all see the
//! block's device copy while it is in flight and its host copy at rest. Bringing a block in
//! makes a device copy of its host copy; sending it back points the variables at the host copy
//! again. Parameters do not change between the two (the optimizer writes the host copy itself,
//! with its state on the host), so nothing is copied back; buffers (BatchNorm's running
//! statistics) do change in a training forward, so theirs are copied back first. The values the
//! math sees are the same either way, so a run that streams equals one that does not, byte for
//! byte on the CPU.
use std::cell::{Cell, RefCell};

use tch::{nn, Tensor};

use crate::host::{Fence, Host};
use crate::model::{block_vars, Chain, KvCache, Net};
use crate::shim::Autocast;

/// One variable: the live variable and its host copy.
struct Streamed {
    var: Tensor,
    home: Tensor,
    /// A buffer (no gradient): changed by the forward, so copied back when it leaves.
    buffer: bool,
}

pub struct Streamer {
    host: Host,
    blocks: Vec<Vec<Streamed>>,
    /// Which blocks are on the device now.
    brought: RefCell<Vec<bool>>,
    /// Each block's uploads, until the compute stream is told to wait for them.
    arriving: RefCell<Vec<Option<Fence>>>,
    /// Buffers are on their way back to the host: the CPU must not read them yet.
    returning: Cell<bool>,
}

impl std::fmt::Debug for Streamer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streamer").field("blocks", &self.blocks.len()).finish()
    }
}

impl Streamer {
    /// Moves every variable of `vs` to the host, grouped by the block of `chain` that uses it;
    /// Err: the name of a variable that belongs to no one block.
    pub fn new(vs: &nn::VarStore, chain: &dyn Chain, host: Host) -> Result<Self, String> {
        let by_block = block_vars(chain, vs).map_err(|name| format!("{name} belongs to no one block"))?;
        // What stays on the device. One that trains gets its gradient collected to the host
        // and its update there, like the blocks' parameters; the update writes the host's
        // master copy and uploads it (`optim::Masters`), before the first block that reads it.
        let resident: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(n, _)| chain.block_of(n).is_none() && chain.resident(n))
            .collect();
        for (_, t) in &resident {
            // On the CPU a copy made here, outside the host's scope, is counted (and capped) as
            // the device's, where a GPU run holds it.
            let on_device = match t.device() == host.device {
                true => tch::no_grad(|| t.copy()),
                false => t.to_device(host.device),
            };
            tch::no_grad(|| t.shallow_clone().set_data(&on_device));
        }
        // Not by requires_grad: a frozen parameter is no buffer (the optimizer may write its
        // host copy once it is unfrozen, which a buffer's copy-back would overwrite).
        let buffers: std::collections::HashSet<String> =
            crate::model::buffers(vs).into_iter().map(|(n, _)| n).collect();
        let blocks: Vec<Vec<Streamed>> = by_block
            .into_iter()
            .map(|vars| {
                vars.into_iter()
                    .map(|(name, var)| {
                        let home = host.copy_of(&var);
                        let buffer = buffers.contains(&name);
                        var.shallow_clone().set_data(&home);
                        Streamed { var, home, buffer }
                    })
                    .collect()
            })
            .collect();
        Ok(Streamer {
            host,
            brought: RefCell::new(vec![false; blocks.len()]),
            arriving: RefCell::new((0..blocks.len()).map(|_| None).collect()),
            returning: Cell::new(false),
            blocks,
        })
    }

    /// Block `i`'s variables onto the device (nothing if they are there or `i` is past the end).
    /// The copies are issued now, on the copy stream; [`Streamer::ready`] orders the block's
    /// kernels after them.
    pub fn bring(&self, i: usize) {
        let mut brought = self.brought.borrow_mut();
        if i >= self.blocks.len() || brought[i] {
            return;
        }
        // Marked first: a copy that runs out of memory halfway leaves some variables on the
        // device, and the release that follows the error must send them back.
        brought[i] = true;
        drop(brought);
        let copies = self.host.copies();
        for s in &self.blocks[i] {
            let on_device = copies.up_new(&s.home);
            s.var.shallow_clone().set_data(&on_device);
        }
        self.arriving.borrow_mut()[i] = Some(copies.fence());
    }

    /// Kernels queued from now on see block `i`'s variables (brought earlier) on the device.
    pub fn ready(&self, i: usize) {
        if let Some(f) = self.arriving.borrow_mut().get_mut(i).and_then(Option::take) {
            f.compute_waits();
        }
    }

    /// Block `i`'s variables back to their host copies, buffers copied back first.
    pub fn release(&self, i: usize) {
        let mut brought = self.brought.borrow_mut();
        if i >= self.blocks.len() || !brought[i] {
            return;
        }
        // Only buffers (BatchNorm's running statistics) change on the device and go back.
        let copies = self.blocks[i].iter().any(|s| s.buffer).then(|| self.host.copies());
        for s in &self.blocks[i] {
            if let (true, Some(c)) = (s.buffer, &copies) {
                c.down(&s.home, &s.var);
                self.returning.set(true);
            }
            s.var.shallow_clone().set_data(&s.home);
        }
        self.arriving.borrow_mut()[i] = None;
        brought[i] = false;
    }

    /// Every block back on the host: the end of a pass, or an error unwinding out of one.
    pub fn release_all(&self) {
        for i in 0..self.blocks.len() {
            self.release(i);
        }
        // At rest the variables are their host copies, which the CPU may read (a checkpoint).
        if self.returning.replace(false) {
            self.host.before_cpu_writes();
        }
    }

    /// A pass over the blocks: whatever is still on the device when it ends goes back.
    pub fn pass(&self) -> Pass<'_> {
        Pass(self)
    }
}

/// Releases every block when dropped, also while an error (an OOM) unwinds, so the run's
/// variables are always at rest on the host between passes.
pub struct Pass<'a>(&'a Streamer);

impl Pass<'_> {
    pub fn bring(&self, i: usize) {
        self.0.bring(i);
    }

    pub fn release(&self, i: usize) {
        self.0.release(i);
    }

    pub fn ready(&self, i: usize) {
        self.0.ready(i);
    }
}

impl Drop for Pass<'_> {
    fn drop(&mut self) {
        self.0.release_all();
    }
}

/// The model's output for `x`: block by block where its parameters stream (`stream`, and the
/// model is a chain), else in one forward. `autocast` opens the mixed-precision region: one per
/// block when streamed, so the cast cache leaves with the block.
pub fn streamed_forward(
    net: &dyn Net,
    stream: Option<&Streamer>,
    x: &Tensor,
    train: bool,
    autocast: &dyn Fn() -> Option<Autocast>,
) -> Tensor {
    match (stream, net.chain()) {
        (Some(s), Some(chain)) => streamed_logits(chain, s, x, train, autocast),
        _ => {
            let _autocast = autocast();
            net.forward_t(x, train)
        }
    }
}

/// The chain's logits for `x`, block by block: block `i + 1` comes in before block `i` runs, and
/// block `i` goes back once it has. Without a graph only (validation): a block's backward reads
/// its parameters where they are then, so training runs the recomputed pass instead.
/// `autocast` opens the mixed-precision region each block runs in (None: full precision), so
/// the cast cache leaves with the block.
pub fn streamed_logits(
    chain: &dyn Chain,
    stream: &Streamer,
    x: &Tensor,
    train: bool,
    autocast: &dyn Fn() -> Option<Autocast>,
) -> Tensor {
    let pass = stream.pass();
    let mut state = vec![x.shallow_clone()];
    pass.bring(0);
    for i in 0..chain.blocks() {
        pass.bring(i + 1);
        pass.ready(i);
        let _autocast = autocast();
        state = chain.block(i, &state, train);
        pass.release(i);
    }
    state.pop().expect("the last block returns the logits")
}

/// A decoder's cached forward over `ids` (`Net::decode`), block by block as
/// [`streamed_logits`] runs them: only the blocks in flight are on the device, the cache stays
/// there. None: the model keeps no cache.
pub fn streamed_decode(
    net: &dyn Net,
    stream: &Streamer,
    ids: &Tensor,
    cache: &mut KvCache,
    autocast: &dyn Fn() -> Option<Autocast>,
) -> Option<Tensor> {
    let blocks = net.chain()?.blocks();
    let start = cache.len();
    let pass = stream.pass();
    let mut x = ids.shallow_clone();
    pass.bring(0);
    for i in 0..blocks {
        pass.bring(i + 1);
        pass.ready(i);
        let _autocast = autocast();
        x = net.decode_block(i, &x, start, cache)?;
        pass.release(i);
    }
    Some(x)
}
