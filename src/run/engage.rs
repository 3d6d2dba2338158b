//! What engaging a lever does to the run's parts: the policy decides (`policy::levers`), this
//! moves the tensors and switches the forward.
use tch::Device;

use super::parts::Parts;
use super::stream::Streamer;
use crate::host::{Home, Host};
use crate::policy::levers::Target;
use crate::spec::schema::Precision;

impl Target for Parts<'_> {
    fn recompute(&mut self) {
        self.forward.recompute = true;
    }

    fn activations_to_host(&mut self) {
        self.forward.activations = Home::Host;
    }

    fn state_to_host(&mut self) {
        self.model.opt.place_state(Home::Host);
    }

    fn grads_to_host(&mut self) {
        self.model.opt.place_grads(Home::Host);
    }

    fn stream_parameters(&mut self) {
        let model = &mut *self.model;
        if model.stream.is_some() {
            return;
        }
        // Nothing on the device may hold a gradient when its parameter moves.
        model.opt.drop_grads();
        let Some(chain) = model.net.chain() else {
            tracing::warn!("parameters cannot stream: the model is not a sequence of blocks");
            return;
        };
        match Streamer::new(&model.vs, chain, Host::new(self.forward.device)) {
            Ok(s) => model.stream = Some(s),
            Err(why) => tracing::warn!("parameters cannot stream: {why}"),
        }
        let _ = crate::shim::empty_cache();
    }

    /// `VarStore::set_device` alone would leave `.grad` behind on the GPU.
    fn move_to_cpu(&mut self, precision_on_cpu: fn(Precision) -> Precision) {
        let cpu = Device::Cpu;
        let model = &mut *self.model;
        tch::no_grad(|| {
            for (_, p) in model.vs.variables() {
                let g = p.grad();
                if g.defined() && g.device() != cpu {
                    g.shallow_clone().set_data(&g.to_device(cpu));
                }
            }
        });
        // Streamed parameters rest on the host, which is the CPU: they stay where they are
        // and the run stops streaming them.
        model.vs.set_device(cpu);
        model.stream = None;
        model.opt.to_device(cpu);
        if let Some(a) = &mut self.arch {
            a.opt.to_device(cpu);
        }
        self.forward.device = cpu;
        let precision = &mut self.forward.precision.precision;
        if precision_on_cpu(*precision) != *precision {
            tracing::warn!(
                "on the CPU fp16 is many times slower than bf16: {} continues as {} (summary.json's precision.mode says so)",
                precision.name(),
                precision_on_cpu(*precision).name()
            );
            *precision = precision_on_cpu(*precision);
        }
        let _ = crate::shim::empty_cache();
    }
}
