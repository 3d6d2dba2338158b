//! Optimizer state on the host (`memory.optimizer_state = "host"`, or an "offload" OOM
//! decision): the moments leave the device, the host keeps a master copy of each parameter, and
//! each step brings the gradients down, updates the master copies there (any implementation;
//! "auto" runs the fused kernel) and sends them up. On the CPU it is byte-identical to the
//! update on the device with the same implementation; on CUDA it is PyTorch's CPU update.
use super::lever::{Lever, Parts, Position, Search, Situation};
use crate::estimate::Estimate;
use crate::host::Home;
use crate::human::human_bytes;
use crate::oom::BatchShape;

pub struct HostState;

impl Lever for HostState {
    fn name(&self) -> &'static str {
        "host_optimizer_state"
    }

    fn title(&self) -> &'static str {
        "optimizer state on the host"
    }

    fn label(&self) -> &'static str {
        "state to host"
    }

    fn counted_as(&self) -> &'static str {
        "state_offloads"
    }

    fn answers(&self) -> &'static str {
        "offload"
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        super::placement::applies(self, s, "the optimizer state")?;
        if s.state_slots == 0 {
            return Err("the optimizer keeps no state (plain SGD)".into());
        }
        Ok(())
    }

    fn engage(&self, parts: &mut Parts<'_>) {
        parts.model.opt.place_state(Home::Host);
    }

    fn said(&self, before: &Position, _after: &Position, _configured: BatchShape) -> String {
        format!(
            "offloading: the optimizer state moves to host memory for the rest of the run, micro-batch stays {}",
            before.shape.micro_batch
        )
    }

    fn estimate(&self, e: &Estimate) -> String {
        format!(
            "optimizer state: {} leaves the device for host memory; each step brings every gradient down and sends every updated parameter up",
            human_bytes(e.optimizer_bytes())
        )
    }

    fn search(&self) -> Search {
        Search::Ladder
    }
}
