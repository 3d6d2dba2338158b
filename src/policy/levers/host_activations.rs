//! Activations on the host (`memory.activations = "host"`, or an "offload" OOM decision): the
//! recomputed forward keeps its block boundaries in host memory and brings each back one block
//! ahead of its backward, so activation memory stops growing with depth. Implies recomputation.
use super::lever::{About, Described, Lever, Position, Search, Situation, Target};
use super::recompute::Recompute;
use crate::estimate::Estimate;
use crate::oom::BatchShape;

pub struct HostActivations;

impl HostActivations {
    pub const ABOUT: About = About {
        name: "host_activations",
        title: "activations on the host",
        label: "activations to host",
        counted_as: "activation_offloads",
        action: "host_activations",
        answers: "offload",
        search: Search::Ladder,
        colour: [117, 107, 177],
        setting: Some("memory.activations"),
        moves_static_bill: false,
        said,
        estimate,
    };
}

impl Lever for HostActivations {
    fn about(&self) -> &'static About {
        &Self::ABOUT
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
            engaged: s.at.engaged.with(Recompute::ABOUT.name).with(self.name()),
            clean_steps: 0,
            ..s.at
        }
    }

    fn engage(&self, run: &mut dyn Target) {
        run.recompute();
        run.activations_to_host();
    }
}

fn said(before: &Position, _after: &Position, _configured: BatchShape) -> String {
    format!(
        "offloading: block boundaries wait in host memory (with activation checkpointing) for the rest of the run, micro-batch stays {}",
        before.shape.micro_batch
    )
}

fn estimate(_e: &Estimate) -> String {
    "activations: with checkpointing, the block boundaries wait in host memory and come back one block ahead; the device keeps about two boundaries and one block's activations".into()
}
