//! What `fit` tries: a setting (precision, recomputation, how much of the bill lives on the
//! host), the budget it must fit in, and one probe's outcome.
use serde::Serialize;

use super::search::Measured;
use crate::host::Home;
use crate::spec::Precision;

/// One candidate: a precision, whether activation checkpointing is on, and how much of the
/// model's state lives in host memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Setting {
    #[serde(serialize_with = "precision_name")]
    pub precision: Precision,
    pub activation_checkpointing: bool,
    #[serde(serialize_with = "placement_name")]
    pub placement: Placement,
    /// Whether the probe captures its step as a CUDA graph (`train.cuda_graph`).
    pub cuda_graph: Graph,
}

/// A setting's `train.cuda_graph`: fit tries `On` only on CUDA, beside a setting whose spec
/// could capture (`graph::variant`), and at that setting's chosen micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Graph {
    Off,
    On,
}

impl Graph {
    pub fn name(self) -> &'static str {
        match self {
            Graph::Off => "off",
            Graph::On => "on",
        }
    }
}

/// How much of the bill a setting moves to host memory: a ladder, searched least first. A
/// setting climbs it only while micro-batch 1 does not fit, since every rung costs copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    Device,
    State,
    StateGrads,
    /// Block boundaries too; needs activation checkpointing.
    StateGradsActs,
    /// The parameters stream by block too: the device holds only the blocks in flight.
    Everything,
}

impl Placement {
    pub fn name(self) -> &'static str {
        match self {
            Placement::Device => "none",
            Placement::State => "state",
            Placement::StateGrads => "state+grads",
            Placement::StateGradsActs => "state+grads+acts",
            Placement::Everything => "everything",
        }
    }

    /// `memory.optimizer_state`, `memory.gradients`, `memory.activations` and
    /// `memory.parameters` at this rung.
    pub fn keys(self) -> [(&'static str, Home); 4] {
        use Placement::*;
        let at = |on: bool| if on { Home::Host } else { Home::Device };
        [
            ("memory.optimizer_state", at(self != Device)),
            (
                "memory.gradients",
                at(matches!(self, StateGrads | StateGradsActs | Everything)),
            ),
            ("memory.activations", at(matches!(self, StateGradsActs | Everything))),
            ("memory.parameters", at(self == Everything)),
        ]
    }

    /// The next rung up (activations only move with checkpointing on; parameters only for
    /// presets that stream).
    pub(super) fn next(self, checkpointing: bool, streams: bool) -> Option<Placement> {
        match self {
            Placement::Device => Some(Placement::State),
            Placement::State => Some(Placement::StateGrads),
            Placement::StateGrads if checkpointing => Some(Placement::StateGradsActs),
            Placement::StateGradsActs if streams => Some(Placement::Everything),
            _ => None,
        }
    }
}

fn placement_name<S: serde::Serializer>(p: &Placement, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.name())
}

fn precision_name<S: serde::Serializer>(p: &Precision, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(p.name())
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ck = if self.activation_checkpointing { "on" } else { "off" };
        write!(
            f,
            "{:<10}  checkpointing {ck:<3}  on host {:<16}",
            self.precision.name(),
            self.placement.name()
        )?;
        // Only the captured variant says so: eager is what every setting was before graphs,
        // and on the CPU the lines stay as they were.
        match self.cuda_graph {
            Graph::On => write!(f, "  cuda graph on"),
            Graph::Off => Ok(()),
        }
    }
}

/// The memory the settings must fit in, and where that number came from.
#[derive(Debug, Clone, Serialize)]
pub struct Budget {
    pub bytes: u64,
    pub source: String,
    pub margin_bytes: u64,
    /// What probes are capped at: the budget less the margin.
    pub usable_bytes: u64,
    #[serde(skip)]
    pub(super) written_as: Option<(&'static str, toml_edit::Value)>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Probe {
    #[serde(flatten)]
    pub setting: Setting,
    #[serde(flatten)]
    pub measured: Measured,
    pub seconds: f64,
    /// Where an OOM probe ran out, as the probe said it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub oom: Option<String>,
}
