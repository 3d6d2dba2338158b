//! Gradients on the host (`memory.gradients = "host"`): each parameter's gradient leaves the
//! device as soon as a block's backward has produced it and accumulates in a host buffer (one
//! read by an earlier block too, a tied embedding, once that block's backward is done). The
//! same buffers stage the gradients of an update that runs on the host
//! (`memory.optimizer_state = "host"`), downloaded once backward is done.
//!
//! Exact by construction: the first piece of a step is copied (autograd would have taken it as
//! the gradient), every later one is added in place (`grad += new`, autograd's own
//! accumulation), so the host buffer holds the same values the device gradient would have.
//!
//! On CUDA the pieces go down on the copy stream while backward goes on. A later piece lands in
//! a staging buffer of its own and is added once it has arrived: at the next collection (the
//! block before's downloads are done by then, or nearly) or at [`GradBuffers::finish`].
use tch::Tensor;

use crate::host::{Fence, Host};

/// The host buffers that gradients accumulate in (the `host_gradients` lever engages them).
pub struct GradBuffers {
    /// One host buffer per parameter, shaped like it.
    buffers: Vec<Tensor>,
    /// Whether this step has written buffer `i` (the step's first piece is copied, not added).
    written: Vec<bool>,
    /// Later pieces on their way down: (parameter, staging buffer), added once `arrived` passes.
    pending: Vec<(usize, Tensor)>,
    /// The downloads issued so far.
    arrived: Option<Fence>,
}

impl GradBuffers {
    /// Buffers for the parameters that train (`class_of[i]` is Some); a frozen one has none.
    pub fn allocate(host: &Host, params: &[(String, Tensor)], class_of: &[Option<usize>]) -> Self {
        GradBuffers {
            buffers: params
                .iter()
                .zip(class_of)
                .map(|((_, p), c)| match c {
                    Some(_) => host.zeros_like(p),
                    None => Tensor::new(),
                })
                .collect(),
            written: vec![false; params.len()],
            pending: Vec::new(),
            arrived: None,
        }
    }

    /// Moves every gradient the device holds whose parameter is `complete` (no later backward
    /// of this micro-batch adds to it) into its host buffer and releases it there.
    pub fn collect(&mut self, host: &Host, params: &[(String, Tensor)], complete: impl Fn(usize) -> bool) {
        self.add_arrived(host);
        let copies = host.copies();
        let mut moved = Vec::new();
        tch::no_grad(|| {
            for (i, (_, p)) in params.iter().enumerate() {
                let g = p.grad();
                if !g.defined() || !complete(i) {
                    continue;
                }
                let buf = &mut self.buffers[i];
                match (self.written[i], host.device) {
                    (false, _) => copies.down(buf, &g),
                    // On the CPU the piece is where the buffer is.
                    (true, tch::Device::Cpu) => {
                        let _ = buf.g_add_(&g);
                    }
                    (true, _) => {
                        let staged = host.empty(&g.size(), g.kind());
                        copies.down(&staged, &g);
                        self.pending.push((i, staged));
                    }
                }
                self.written[i] = true;
                moved.push(p);
            }
        });
        self.arrived = Some(copies.fence());
        if let Err(e) = crate::shim::drop_grads(moved) {
            // Inside the OOM guard like any libtorch error.
            panic!("{e}");
        }
    }

    /// A new step's gradients `live` (parameter, device gradient), downloaded in the runs of
    /// `runs` (ranges of `live`), each run with the fence that marks its arrival, so an update
    /// can start on the first run while the others are on their way. The device gradients are
    /// released.
    pub fn stage(
        &mut self,
        host: &Host,
        params: &[(String, Tensor)],
        live: &[(usize, Tensor)],
        runs: &[std::ops::Range<usize>],
    ) -> Vec<Fence> {
        self.reset();
        let copies = host.copies();
        let fences = runs
            .iter()
            .map(|run| {
                for (i, g) in &live[run.clone()] {
                    copies.down(&self.buffers[*i], g);
                    self.written[*i] = true;
                }
                copies.fence()
            })
            .collect();
        if let Err(e) = crate::shim::drop_grads(live.iter().map(|(i, _)| &params[*i].1)) {
            // Inside the OOM guard like any libtorch error.
            panic!("{e}");
        }
        fences
    }

    /// Waits for the downloads issued so far and adds the pieces that were waiting for them.
    fn add_arrived(&mut self, host: &Host) {
        if self.pending.is_empty() {
            return;
        }
        match self.arrived.take() {
            Some(f) => f.host_waits(),
            None => host.before_cpu_writes(),
        }
        tch::no_grad(|| {
            for (i, piece) in self.pending.drain(..) {
                let _ = self.buffers[i].g_add_(&piece);
            }
        });
    }

    /// Backward is over: every piece of this step is in its buffer once this returns.
    pub fn finish(&mut self, host: &Host) {
        self.add_arrived(host);
        if let Some(f) = self.arrived.take() {
            f.host_waits();
        }
    }

    /// A new step: nothing written yet.
    pub fn reset(&mut self) {
        self.written.iter_mut().for_each(|w| *w = false);
        self.pending.clear();
        self.arrived = None;
    }

    /// Parameter `i`'s gradient of this step, if any piece of it arrived.
    pub fn of(&self, i: usize) -> Option<&Tensor> {
        self.written[i].then(|| &self.buffers[i])
    }
}
