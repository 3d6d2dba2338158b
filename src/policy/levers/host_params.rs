//! Parameters streamed by block (`memory.parameters = "host"`, or an "offload" OOM decision, the
//! last placement it tries): the model's variables rest in host memory and the device holds
//! only the blocks in flight: forward in order, backward in reverse, the next block brought in
//! while one runs. A model whose weights alone exceed the device can train.
//!
//! It comes with what it needs: recomputation (the block-by-block pass), gradients on the host
//! (a block's gradients leave before its parameters do) and the optimizer's update on the host
//! (it reads and writes the parameters' host copies). Exact: the same values meet the same
//! kernels, only where they wait changes.
use super::host_grads::HostGrads;
use super::host_state::HostState;
use super::lever::{About, Described, Lever, Position, Search, Situation, Target};
use super::recompute::Recompute;
use crate::estimate::Estimate;
use crate::human::human_bytes;
use crate::oom::BatchShape;

pub struct HostParams;

impl HostParams {
    pub const ABOUT: About = About {
        name: "host_parameters",
        title: "parameters streamed by block from the host",
        label: "params to host",
        counted_as: "parameter_offloads",
        action: "host_parameters",
        answers: "offload",
        search: Search::Ladder,
        colour: [227, 119, 194],
        setting: Some("memory.parameters"),
        moves_static_bill: true,
        said,
        estimate,
    };
}

impl Lever for HostParams {
    fn about(&self) -> &'static About {
        &Self::ABOUT
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        if !s.has_blocks {
            return Err("the model is not a sequence of blocks".into());
        }
        if !s.blockwise {
            // Whatever the model: a reason that names one preset misleads for every other.
            return Err(
                "some of the model's variables are used by more than one block of its chain, so no one block can bring them in".into(),
            );
        }
        super::placement::applies(self, s, "the parameters")?;
        if s.data_parallel {
            return Err("data-parallel runs reduce the gradients on the device as backward makes them".into());
        }
        Ok(())
    }

    /// Recomputation, host gradients and the host optimizer update come with it.
    fn engaged(&self, s: &Situation) -> Position {
        let engaged = [Recompute.name(), HostState.name(), HostGrads.name(), self.name()]
            .into_iter()
            .fold(s.at.engaged, |e, n| e.with(n));
        Position {
            engaged,
            clean_steps: 0,
            ..s.at
        }
    }

    fn engage(&self, run: &mut dyn Target) {
        run.recompute();
        run.state_to_host();
        run.grads_to_host();
        run.stream_parameters();
    }
}

fn said(before: &Position, _after: &Position, _configured: BatchShape) -> String {
    format!(
        "offloading: parameters rest in host memory and stream to the device block by block (with activation checkpointing, gradients and the optimizer update on the host) for the rest of the run, micro-batch stays {}",
        before.shape.micro_batch
    )
}

fn estimate(e: &Estimate) -> String {
    format!(
        "parameters: {} rest in host memory and stream to the device block by block (forward in order, backward in reverse, one block ahead); the device holds about two blocks' parameters; comes with activation checkpointing, gradients and the optimizer update on the host",
        human_bytes(e.parameter_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::super::lever::Engaged;
    use super::*;

    fn at(has_blocks: bool, blockwise: bool, data_parallel: bool) -> Situation {
        Situation {
            at: Position {
                shape: BatchShape {
                    micro_batch: 8,
                    accumulation_steps: 1,
                },
                clean_steps: 3,
                engaged: Engaged::default(),
            },
            min_batch: 1,
            planned_on_cpu: false,
            has_blocks,
            blockwise,
            data_parallel,
            state_slots: 0,
            torchscript: false,
        }
    }

    #[test]
    fn applies_to_blockwise_chains_once_and_brings_what_it_needs() {
        let s = at(true, true, false);
        assert_eq!(HostParams.applies(&s), Ok(()));
        let after = HostParams.engaged(&s);
        assert_eq!(
            after.engaged.names(),
            ["recompute", "host_optimizer_state", "host_gradients", "host_parameters"]
        );
        assert_eq!(after.clean_steps, 0);
        assert_eq!(after.shape, s.at.shape);
        let again = Situation { at: after, ..s };
        assert!(HostParams.applies(&again).unwrap_err().contains("already"));
        assert!(HostParams
            .applies(&at(false, false, false))
            .unwrap_err()
            .contains("not a sequence of blocks"));
        let shared = HostParams.applies(&at(true, false, false)).unwrap_err();
        assert!(
            shared.contains("more than one block") && !shared.contains("DARTS"),
            "{shared}"
        );
        assert!(HostParams
            .applies(&at(true, true, true))
            .unwrap_err()
            .contains("data-parallel"));
        let fell_back = Situation {
            at: Position {
                engaged: Engaged::default().with("cpu"),
                ..s.at
            },
            ..s
        };
        assert!(HostParams.applies(&fell_back).unwrap_err().contains("CPU"));
    }
}
