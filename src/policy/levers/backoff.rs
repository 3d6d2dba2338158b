//! Backoff as a lever: half the micro-batch, twice the accumulation, the same effective batch.
//! Engaged again and again down to `memory.min_batch_size`; released by doubling back after
//! `memory.grow_back_after` clean steps. It changes only the position: the trainer reads the
//! shape in force from `Recovery` at every step.
use super::lever::{About, Lever, Position, Search, Situation};
use crate::estimate::Estimate;
use crate::oom::BatchShape;

pub struct Backoff;

impl Backoff {
    pub const ABOUT: About = About {
        name: "backoff",
        title: "halving the micro-batch",
        label: "backoff",
        counted_as: "backoffs",
        action: "backoff",
        answers: "backoff",
        search: Search::Size,
        colour: [255, 127, 14],
        setting: None,
        moves_static_bill: false,
        said,
        estimate,
    };
}

impl Lever for Backoff {
    fn about(&self) -> &'static About {
        &Self::ABOUT
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        match s.at.shape.halved(s.min_batch) {
            Some(_) => Ok(()),
            None => Err(format!(
                "micro-batch {} cannot be halved without going below memory.min_batch_size {}",
                s.at.shape.micro_batch, s.min_batch
            )),
        }
    }

    fn engaged(&self, s: &Situation) -> Position {
        Position {
            shape: s.at.shape.halved(s.min_batch).expect("applies"),
            clean_steps: 0,
            ..s.at
        }
    }

    fn released(&self, at: &Position, configured: BatchShape, after_clean_steps: i64) -> Option<Position> {
        if after_clean_steps <= 0
            || at.shape.micro_batch >= configured.micro_batch
            || at.clean_steps < after_clean_steps
        {
            return None;
        }
        let micro = (at.shape.micro_batch * 2).min(configured.micro_batch);
        Some(Position {
            shape: BatchShape {
                micro_batch: micro,
                accumulation_steps: (configured.effective() + micro - 1) / micro,
            },
            clean_steps: 0,
            ..*at
        })
    }
}

fn said(before: &Position, after: &Position, configured: BatchShape) -> String {
    format!(
        "backing off: micro-batch {} -> {}, accumulation {} -> {} (effective batch stays {})",
        before.shape.micro_batch,
        after.shape.micro_batch,
        before.shape.accumulation_steps,
        after.shape.accumulation_steps,
        configured.effective()
    )
}

fn estimate(e: &Estimate) -> String {
    format!(
        "activations: shrink with the micro-batch, halved down to memory.min_batch_size (from {}); the effective batch stays {}",
        e.micro_batch,
        e.micro_batch * e.accumulation_steps
    )
}
