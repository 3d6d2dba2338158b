//! Activation checkpointing as a lever: the forward keeps only block boundaries and each block
//! runs again in backward (`run::recompute`). Engaged by `train.activation_checkpointing` or by
//! a "recompute" OOM decision; the micro-batch stays.
use super::lever::{About, Described, Lever, Position, Search, Situation, Target};
use crate::estimate::Estimate;
use crate::oom::BatchShape;

pub struct Recompute;

impl Recompute {
    pub const ABOUT: About = About {
        name: "recompute",
        title: "activation checkpointing",
        label: "recompute",
        counted_as: "recomputes",
        action: "recompute",
        answers: "recompute",
        search: Search::Toggle,
        colour: [188, 189, 34],
        setting: Some("train.activation_checkpointing"),
        moves_static_bill: false,
        said,
        estimate,
    };
}

impl Lever for Recompute {
    fn about(&self) -> &'static About {
        &Self::ABOUT
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        if !s.has_blocks {
            Err("the model is not a sequence of blocks".into())
        } else if s.at.engaged.contains(self.name()) {
            Err("activation checkpointing is already on".into())
        } else {
            Ok(())
        }
    }

    fn engage(&self, run: &mut dyn Target) {
        run.recompute();
    }
}

fn said(before: &Position, _after: &Position, _configured: BatchShape) -> String {
    format!(
        "recomputing: activation checkpointing is on for the rest of the run, micro-batch stays {}",
        before.shape.micro_batch
    )
}

fn estimate(_e: &Estimate) -> String {
    "activations: only block boundaries are kept, plus one block's at a time in backward; costs about one more forward per step".into()
}

#[cfg(test)]
mod tests {
    use super::super::lever::{Engaged, Situation};
    use super::*;
    use crate::oom::BatchShape;

    fn at(engaged: Engaged, has_blocks: bool) -> Situation {
        Situation {
            at: Position {
                shape: BatchShape {
                    micro_batch: 8,
                    accumulation_steps: 1,
                },
                clean_steps: 3,
                engaged,
            },
            min_batch: 1,
            planned_on_cpu: false,
            has_blocks,
            blockwise: has_blocks,
            data_parallel: false,
            state_slots: 2,
            torchscript: false,
        }
    }

    #[test]
    fn applies_once_to_a_chain_and_keeps_the_shape() {
        let s = at(Engaged::default(), true);
        assert_eq!(Recompute.applies(&s), Ok(()));
        let after = Recompute.engaged(&s);
        assert!(after.engaged.contains("recompute"));
        assert_eq!((after.shape, after.clean_steps), (s.at.shape, 0));
        assert_eq!(
            Recompute.applies(&at(after.engaged, true)),
            Err("activation checkpointing is already on".into())
        );
        assert_eq!(
            Recompute.applies(&at(Engaged::default(), false)),
            Err("the model is not a sequence of blocks".into())
        );
    }
}
