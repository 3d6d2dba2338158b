//! Gradients on the host (`memory.gradients = "host"`, or an "offload" OOM decision): each
//! block's gradients leave the device as soon as its backward is done and accumulate in host
//! memory, so the device holds at most the gradients of the block in flight (the whole model's
//! at the end of each micro-batch's backward for a model without blocks or without
//! recomputation). Exact: the first piece is copied, the rest added as autograd adds them.
use super::lever::{About, Lever, Position, Search, Situation, Target};
use crate::estimate::Estimate;
use crate::human::human_bytes;
use crate::oom::BatchShape;

pub struct HostGrads;

impl HostGrads {
    pub const ABOUT: About = About {
        name: "host_gradients",
        title: "gradients on the host",
        label: "grads to host",
        counted_as: "gradient_offloads",
        action: "host_gradients",
        answers: "offload",
        search: Search::Ladder,
        colour: [117, 107, 177],
        setting: Some("memory.gradients"),
        moves_static_bill: true,
        said,
        estimate,
    };
}

impl Lever for HostGrads {
    fn about(&self) -> &'static About {
        &Self::ABOUT
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        super::placement::applies(self, s, "the gradients")?;
        if s.data_parallel {
            return Err("data-parallel runs reduce the gradients on the device as backward makes them".into());
        }
        Ok(())
    }

    fn engage(&self, run: &mut dyn Target) {
        run.grads_to_host();
    }
}

fn said(before: &Position, _after: &Position, _configured: BatchShape) -> String {
    format!(
        "offloading: gradients accumulate in host memory for the rest of the run, micro-batch stays {}",
        before.shape.micro_batch
    )
}

fn estimate(e: &Estimate) -> String {
    format!(
        "gradients: {} accumulate in host memory instead; the device holds one block's at a time (with recomputation) or one micro-batch's",
        human_bytes(e.gradient_bytes())
    )
}
