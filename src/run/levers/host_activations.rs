//! Activations on the host (`memory.activations = "host"`, or an "offload" OOM decision): the
//! recomputed forward keeps its block boundaries in host memory and brings each back one block
//! ahead of its backward, so activation memory stops growing with depth. Implies recomputation.
use super::lever::{Lever, Parts, Position, Search, Situation};
use crate::estimate::Estimate;
use crate::host::Home;
use crate::oom::BatchShape;

pub struct HostActivations;

impl Lever for HostActivations {
    fn name(&self) -> &'static str {
        "host_activations"
    }

    fn title(&self) -> &'static str {
        "activations on the host"
    }

    fn label(&self) -> &'static str {
        "activations to host"
    }

    fn counted_as(&self) -> &'static str {
        "activation_offloads"
    }

    fn answers(&self) -> &'static str {
        "offload"
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        if !s.has_blocks {
            return Err("the model is not a sequence of blocks".into());
        }
        super::placement::applies(self, s, "the activations")
    }

    /// Recomputation comes with it: only recomputed block boundaries can wait on the host.
    fn engaged(&self, s: &Situation) -> Position {
        Position {
            engaged: s.at.engaged.with("recompute").with(self.name()),
            clean_steps: 0,
            ..s.at
        }
    }

    fn engage(&self, parts: &mut Parts<'_>) {
        parts.forward.recompute = true;
        parts.forward.activations = Home::Host;
    }

    fn said(&self, before: &Position, _after: &Position, _configured: BatchShape) -> String {
        format!(
            "offloading: block boundaries wait in host memory (with activation checkpointing) for the rest of the run, micro-batch stays {}",
            before.shape.micro_batch
        )
    }

    fn estimate(&self, _e: &Estimate) -> String {
        "activations: with checkpointing, the block boundaries wait in host memory and come back one block ahead; the device keeps about two boundaries and one block's activations".into()
    }

    fn search(&self) -> Search {
        Search::Ladder
    }
}
