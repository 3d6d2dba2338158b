//! Gradients on the host (`memory.gradients = "host"`): each parameter's gradient leaves the
//! device as soon as a block's backward has produced it and accumulates in a host buffer.
//!
//! Exact by construction: the first piece of a step is copied (autograd would have taken it as
//! the gradient), every later one is added in place (`grad += new`, autograd's own
//! accumulation), so the host buffer holds the same values the device gradient would have.
use tch::Tensor;

use crate::host::Host;

pub struct HostGrads {
    /// One host buffer per parameter, shaped like it.
    buffers: Vec<Tensor>,
    /// Whether this step has written buffer `i` (the step's first piece is copied, not added).
    written: Vec<bool>,
}

impl HostGrads {
    pub fn allocate(host: &Host, params: &[(String, Tensor)]) -> Self {
        HostGrads {
            buffers: params.iter().map(|(_, p)| host.zeros_like(p)).collect(),
            written: vec![false; params.len()],
        }
    }

    /// Moves every gradient the device holds into its host buffer and releases it there.
    pub fn collect(&mut self, params: &[(String, Tensor)]) {
        let mut moved = Vec::new();
        tch::no_grad(|| {
            for (i, (_, p)) in params.iter().enumerate() {
                let g = p.grad();
                if !g.defined() {
                    continue;
                }
                let buf = &mut self.buffers[i];
                match self.written[i] {
                    false => buf.copy_(&g),
                    true => {
                        let _ = buf.g_add_(&g.to_device(buf.device()));
                    }
                }
                self.written[i] = true;
                moved.push(p);
            }
        });
        if let Err(e) = crate::shim::drop_grads(moved) {
            // Inside the OOM guard like any libtorch error.
            panic!("{e}");
        }
    }

    /// A new step: nothing written yet.
    pub fn reset(&mut self) {
        self.written.iter_mut().for_each(|w| *w = false);
    }

    /// Parameter `i`'s gradient of this step, if any piece of it arrived.
    pub fn of(&self, i: usize) -> Option<&Tensor> {
        self.written[i].then(|| &self.buffers[i])
    }
}
