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
use super::lever::{Lever, Parts, Position, Search, Situation};
use super::recompute::Recompute;
use crate::estimate::Estimate;
use crate::host::{Home, Host};
use crate::human::human_bytes;
use crate::oom::BatchShape;
use crate::run::stream::Streamer;

pub struct HostParams;

impl Lever for HostParams {
    fn name(&self) -> &'static str {
        "host_parameters"
    }

    fn title(&self) -> &'static str {
        "parameters streamed by block from the host"
    }

    fn label(&self) -> &'static str {
        "params to host"
    }

    fn counted_as(&self) -> &'static str {
        "parameter_offloads"
    }

    fn answers(&self) -> &'static str {
        "offload"
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        if !s.has_blocks {
            return Err("the model is not a sequence of blocks".into());
        }
        if !s.blockwise {
            return Err("some of the model's variables are used by more than one block (DARTS's architecture weights by every cell)".into());
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

    fn engage(&self, parts: &mut Parts<'_>) {
        parts.forward.recompute = true;
        let model = &mut *parts.model;
        model.opt.place_state(Home::Host);
        model.opt.place_grads(Home::Host);
        if model.stream.is_some() {
            return;
        }
        // Nothing on the device may hold a gradient when its parameter moves.
        model.opt.drop_grads();
        let Some(chain) = model.net.chain() else {
            tracing::warn!("parameters cannot stream: the model is not a sequence of blocks");
            return;
        };
        match Streamer::new(&model.vs, chain, Host::new(parts.forward.device)) {
            Ok(s) => model.stream = Some(s),
            Err(name) => tracing::warn!("parameters cannot stream: {name} belongs to no one block"),
        }
        let _ = crate::shim::empty_cache();
    }

    fn said(&self, before: &Position, _after: &Position, _configured: BatchShape) -> String {
        format!(
            "offloading: parameters rest in host memory and stream to the device block by block (with activation checkpointing, gradients and the optimizer update on the host) for the rest of the run, micro-batch stays {}",
            before.shape.micro_batch
        )
    }

    fn estimate(&self, e: &Estimate) -> String {
        format!(
            "parameters: {} rest in host memory and stream to the device block by block (forward in order, backward in reverse, one block ahead); the device holds about two blocks' parameters; comes with activation checkpointing, gradients and the optimizer update on the host",
            human_bytes(e.parameter_bytes())
        )
    }

    fn search(&self) -> Search {
        Search::Ladder
    }
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
        assert!(HostParams
            .applies(&at(true, false, false))
            .unwrap_err()
            .contains("more than one block"));
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
