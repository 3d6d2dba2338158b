//! Optimizer state on the host (`memory.optimizer_state = "host"`, or an "offload" OOM
//! decision): the moments leave the device, the host keeps a master copy of each parameter, and
//! each step brings the gradients down, updates the master copies there (any implementation;
//! "auto" runs the fused kernel) and sends them up. On the CPU it is byte-identical to the
//! update on the device with the same implementation; on CUDA it is PyTorch's CPU update.
use super::lever::{About, Lever, Position, Search, Situation, Target};
use crate::estimate::Estimate;
use crate::human::human_bytes;
use crate::oom::BatchShape;

pub struct HostState;

impl HostState {
    pub const ABOUT: About = About {
        name: "host_optimizer_state",
        title: "optimizer state on the host",
        label: "state to host",
        counted_as: "state_offloads",
        action: "host_optimizer_state",
        answers: "offload",
        search: Search::Ladder,
        colour: [117, 107, 177],
        setting: Some("memory.optimizer_state"),
        moves_static_bill: true,
        said,
        estimate,
    };
}

impl Lever for HostState {
    fn about(&self) -> &'static About {
        &Self::ABOUT
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        super::placement::applies(self, s, "the optimizer state")?;
        if s.state_slots == 0 {
            return Err("the optimizer keeps no state (plain SGD)".into());
        }
        Ok(())
    }

    fn engage(&self, run: &mut dyn Target) {
        run.state_to_host();
    }
}

fn said(before: &Position, _after: &Position, _configured: BatchShape) -> String {
    format!(
        "offloading: the optimizer state moves to host memory for the rest of the run, micro-batch stays {}",
        before.shape.micro_batch
    )
}

fn estimate(e: &Estimate) -> String {
    format!(
        "optimizer state: {} leaves the device for host memory; each step brings every gradient down and sends every updated parameter up",
        human_bytes(e.optimizer_bytes())
    )
}
