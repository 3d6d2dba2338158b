//! Gradients on the host (`memory.gradients = "host"`, or an "offload" OOM decision): each
//! block's gradients leave the device as soon as its backward is done and accumulate in host
//! memory, so the device holds at most the gradients of the block in flight (the whole model's
//! at the end of each micro-batch's backward for a model without blocks or without
//! recomputation). Exact: the first piece is copied, the rest added as autograd adds them.
use super::lever::{Lever, Parts, Position, Search, Situation};
use crate::estimate::Estimate;
use crate::host::Home;
use crate::human::human_bytes;
use crate::oom::BatchShape;

pub struct HostGrads;

impl Lever for HostGrads {
    fn name(&self) -> &'static str {
        "host_gradients"
    }

    fn title(&self) -> &'static str {
        "gradients on the host"
    }

    fn label(&self) -> &'static str {
        "grads to host"
    }

    fn counted_as(&self) -> &'static str {
        "gradient_offloads"
    }

    fn answers(&self) -> &'static str {
        "offload"
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        super::placement::applies(self, s, "the gradients")?;
        if s.data_parallel {
            return Err("data-parallel runs reduce the gradients on the device as backward makes them".into());
        }
        Ok(())
    }

    fn engage(&self, parts: &mut Parts<'_>) {
        parts.model.opt.place_grads(Home::Host);
    }

    fn said(&self, before: &Position, _after: &Position, _configured: BatchShape) -> String {
        format!(
            "offloading: gradients accumulate in host memory for the rest of the run, micro-batch stays {}",
            before.shape.micro_batch
        )
    }

    fn estimate(&self, e: &Estimate) -> String {
        format!(
            "gradients: {} accumulate in host memory instead; the device holds one block's at a time (with recomputation) or one micro-batch's",
            human_bytes(e.gradient_bytes())
        )
    }

    fn search(&self) -> Search {
        Search::Ladder
    }
}
