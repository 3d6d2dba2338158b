//! What every lever is: the trait of its decisions, the constant that describes it, what it asks
//! of the run, the position it acts on, and what it may look at. The registry (`levers`) lists
//! them; nothing here depends on which levers exist.
use std::fmt;

use crate::estimate::Estimate;
use crate::oom::BatchShape;
use crate::spec::schema::Precision;

/// Where a run stands: the batch shape in force, the clean steps since the last OOM and the
/// levers engaged. `Recovery` owns it; checkpoints save it and resumes restore it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub shape: BatchShape,
    pub clean_steps: i64,
    pub engaged: Engaged,
}

/// What a lever's `applies` may look at: the position and the run's fixed facts.
#[derive(Debug, Clone, Copy)]
pub struct Situation {
    pub at: Position,
    /// `memory.min_batch_size`.
    pub min_batch: i64,
    /// The run was planned on the CPU (a fallback is `at.engaged`, not this).
    pub planned_on_cpu: bool,
    /// The model is a sequence of blocks (recomputation and block-wise placement need one).
    pub has_blocks: bool,
    /// Each of the model's variables belongs to one block (parameters can stream).
    pub blockwise: bool,
    /// Gradients are reduced across ranks as backward makes them.
    pub data_parallel: bool,
    /// State tensors the weights' optimizer keeps per parameter (0: plain SGD).
    pub state_slots: usize,
    /// The model is a TorchScript module: tensors its graph holds as constants were loaded onto
    /// the device and are no variables that could be moved.
    pub torchscript: bool,
}

/// How `fit` treats a lever.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Search {
    /// Tried off and on, as one axis of the settings.
    Toggle,
    /// Searched by size: the largest setting that fits (the micro-batch).
    Size,
    /// A rung of the placement ladder (state, then gradients, then activations to the host),
    /// climbed only while micro-batch 1 does not fit: each rung costs copies.
    Ladder,
    /// Never recommended, for this reason.
    Never(&'static str),
}

/// What a lever is called and how it is spoken of where nothing is being decided: one
/// constant per lever (`ABOUT` in its file), so its wording lives in one place.
pub struct About {
    /// The name `memory.on_oom`, checkpoints and records use.
    pub name: &'static str,
    /// What it is, in words ("activation checkpointing").
    pub title: &'static str,
    /// The report's name for its marks ("backoff").
    pub label: &'static str,
    /// The summary's count of engagements (`oom.recomputes`).
    pub counted_as: &'static str,
    /// What an OOM record's decision calls an engagement (`decision.action`).
    pub action: &'static str,
    /// The `memory.on_oom` word that engages it ("offload" answers for every placement).
    pub answers: &'static str,
    /// How `fit` searches it.
    pub search: Search,
    /// The colour of its marks in the report's charts.
    pub colour: [u8; 3],
    /// The spec key that turns it on from the start (the placements: set to "host"), if any.
    pub setting: Option<&'static str>,
    /// It shrinks what the optimizer step holds whatever the micro-batch (parameters, gradients,
    /// optimizer state), so it can answer an OOM of the static bill.
    pub moves_static_bill: bool,
    /// The line the run prints when an OOM engages it (before, after, and `configured`: the
    /// spec's batch shape).
    pub said: fn(&Position, &Position, BatchShape) -> String,
    /// What engaging it does to the bill, for `check`.
    pub estimate: fn(&Estimate) -> String,
}

/// What engaging a lever asks of the run. The levers decide; the run's parts, which implement
/// this, move the tensors.
pub trait Target {
    /// Recompute each block in backward, keeping only block boundaries.
    fn recompute(&mut self);
    /// Keep the recomputed forward's block boundaries in host memory.
    fn activations_to_host(&mut self);
    /// The optimizer's state and the update to host memory.
    fn state_to_host(&mut self);
    /// Gradients accumulate in host memory.
    fn grads_to_host(&mut self);
    /// Parameters rest in host memory and stream to the device block by block.
    fn stream_parameters(&mut self);
    /// Everything to the CPU; `precision` says what the run's precision becomes there.
    fn move_to_cpu(&mut self, precision: fn(Precision) -> Precision);
}

/// A lever's decisions. Everything else about it is its `About`.
pub trait Lever: Sync {
    fn about(&self) -> &'static About;
    /// Whether engaging it now could help; the reason when it could not.
    fn applies(&self, s: &Situation) -> Result<(), String>;
    /// The position once engaged (only asked when it applies).
    fn engaged(&self, s: &Situation) -> Position {
        Position {
            engaged: s.at.engaged.with(self.about().name),
            clean_steps: 0,
            ..s.at
        }
    }
    /// The position once released after enough clean steps, if this lever ever lets go.
    fn released(&self, _at: &Position, _configured: BatchShape, _after_clean_steps: i64) -> Option<Position> {
        None
    }
    /// What engaging it asks of the run (nothing for levers that only move the position).
    fn engage(&self, _run: &mut dyn Target) {}
}

/// A lever's `About`, read as methods (`l.name()`), for concrete levers and `dyn Lever` alike.
pub trait Described {
    fn name(&self) -> &'static str;
    fn title(&self) -> &'static str;
    fn label(&self) -> &'static str;
    fn counted_as(&self) -> &'static str;
    fn action(&self) -> &'static str;
    fn answers(&self) -> &'static str;
    fn search(&self) -> &'static Search;
    fn said(&self, before: &Position, after: &Position, configured: BatchShape) -> String;
    fn estimate(&self, e: &Estimate) -> String;
}

impl<L: Lever + ?Sized> Described for L {
    fn name(&self) -> &'static str {
        self.about().name
    }
    fn title(&self) -> &'static str {
        self.about().title
    }
    fn label(&self) -> &'static str {
        self.about().label
    }
    fn counted_as(&self) -> &'static str {
        self.about().counted_as
    }
    fn action(&self) -> &'static str {
        self.about().action
    }
    fn answers(&self) -> &'static str {
        self.about().answers
    }
    fn search(&self) -> &'static Search {
        &self.about().search
    }
    fn said(&self, before: &Position, after: &Position, configured: BatchShape) -> String {
        (self.about().said)(before, after, configured)
    }
    fn estimate(&self, e: &Estimate) -> String {
        (self.about().estimate)(e)
    }
}

/// The levers engaged, by name, in the order they were engaged (a small inline set, so
/// `Position` stays `Copy`).
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Engaged {
    names: [&'static str; Engaged::MAX],
    len: usize,
}

impl Engaged {
    const MAX: usize = 8;

    pub fn contains(&self, name: &str) -> bool {
        self.names().contains(&name)
    }

    #[must_use]
    pub fn with(mut self, name: &'static str) -> Engaged {
        if !self.contains(name) {
            assert!(self.len < Self::MAX, "more than {} levers engaged at once", Self::MAX);
            self.names[self.len] = name;
            self.len += 1;
        }
        self
    }

    pub fn names(&self) -> &[&'static str] {
        &self.names[..self.len]
    }
}

impl fmt::Debug for Engaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.names()).finish()
    }
}
