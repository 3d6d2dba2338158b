//! Memory levers: each term of the memory bill that a run can trade for time, one file per
//! lever behind one trait, and one registry line each.
//!
//! A lever says whether it applies (purely, from where the run stands, with a reason when it
//! does not), what engaging it does to the run's position (pure, so `Recovery` decides without
//! libtorch) and to the parts (the model, its optimizers and the step pipeline), what `check`'s
//! estimate says of it and how `fit` searches it. `Recovery` alone decides which levers are
//! engaged; checkpoints persist its `Position` (engaged levers by name, and the batch shape),
//! and summary counts and OOM decisions are keyed by the lever's name.
mod backoff;
mod cpu;
mod recompute;

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::step::StepPipeline;
use super::trainer::Model;
use crate::estimate::Estimate;
use crate::oom::BatchShape;

pub use backoff::Backoff;
pub use cpu::CpuFallback;
pub use recompute::Recompute;

/// Every lever, in the order `check` lists them. Adding one: its file and one line here.
pub static LEVERS: &[&dyn Lever] = &[&Recompute, &Backoff, &CpuFallback];

/// The lever of this name (a name from the spec, a checkpoint or a record).
pub fn lever(name: &str) -> Option<&'static dyn Lever> {
    LEVERS.iter().copied().find(|l| l.name() == name)
}

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
}

/// How `fit` treats a lever.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Search {
    /// Tried off and on, as one axis of the settings.
    Toggle,
    /// Searched by size: the largest setting that fits (the micro-batch).
    Size,
    /// Never recommended, for this reason.
    Never(&'static str),
}

/// The parts a lever changes when engaged or released.
pub struct Parts<'a> {
    pub model: &'a mut Model,
    pub pipeline: &'a mut StepPipeline,
}

pub trait Lever: Sync {
    /// The name `memory.on_oom`, checkpoints and records use.
    fn name(&self) -> &'static str;
    /// The summary's count of engagements (`oom.recomputes`).
    fn counted_as(&self) -> &'static str;
    /// What an OOM record's decision calls an engagement (`decision.action`).
    fn action(&self) -> &'static str {
        self.name()
    }
    /// Whether engaging it now could help; the reason when it could not.
    fn applies(&self, s: &Situation) -> Result<(), String>;
    /// The position once engaged (only asked when it applies).
    fn engaged(&self, s: &Situation) -> Position {
        Position {
            engaged: s.at.engaged.with(self.name()),
            clean_steps: 0,
            ..s.at
        }
    }
    /// The position once released after enough clean steps, if this lever ever lets go.
    fn released(&self, _at: &Position, _configured: BatchShape, _after_clean_steps: i64) -> Option<Position> {
        None
    }
    /// What engaging it does to the parts (nothing for levers that only move the position).
    fn engage(&self, _parts: &mut Parts<'_>) {}
    /// The line the run prints when an OOM engages it.
    fn said(&self, before: &Position, after: &Position) -> String;
    /// What engaging it does to the bill, for `check`.
    fn estimate(&self, e: &Estimate) -> String;
    /// How `fit` searches it.
    fn search(&self) -> Search;
}

/// A set of engaged levers (a bit per registry entry, so `Position` stays `Copy`). On the wire
/// it is the list of their names.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
pub struct Engaged(u32);

impl Engaged {
    fn bit(name: &str) -> u32 {
        let i = LEVERS
            .iter()
            .position(|l| l.name() == name)
            .unwrap_or_else(|| panic!("no lever is called {name:?}"));
        1 << i
    }

    pub fn contains(self, name: &str) -> bool {
        self.0 & Self::bit(name) != 0
    }

    #[must_use]
    pub fn with(self, name: &str) -> Engaged {
        Engaged(self.0 | Self::bit(name))
    }

    pub fn levers(self) -> impl Iterator<Item = &'static dyn Lever> {
        LEVERS
            .iter()
            .enumerate()
            .filter(move |(i, _)| self.0 & (1 << i) != 0)
            .map(|(_, l)| *l)
    }

    pub fn names(self) -> Vec<&'static str> {
        self.levers().map(|l| l.name()).collect()
    }

    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Engaged, String> {
        names.iter().try_fold(Engaged::default(), |e, n| match lever(n.as_ref()) {
            Some(l) => Ok(e.with(l.name())),
            None => Err(format!(
                "unknown lever {:?} (this memtrain knows {})",
                n.as_ref(),
                LEVERS.iter().map(|l| l.name()).collect::<Vec<_>>().join(", ")
            )),
        })
    }
}

impl fmt::Debug for Engaged {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.names()).finish()
    }
}

impl Serialize for Engaged {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.names().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Engaged {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let names = Vec::<String>::deserialize(d)?;
        Engaged::from_names(&names).map_err(serde::de::Error::custom)
    }
}

/// The levers the spec turns on from the start, with the key that does.
pub fn configured(spec: &crate::spec::Spec) -> Vec<(&'static str, &'static dyn Lever)> {
    let mut on: Vec<(&'static str, &'static dyn Lever)> = vec![];
    if spec.train.activation_checkpointing {
        on.push(("train.activation_checkpointing", &Recompute));
    }
    on
}

/// `check`'s levers section for a spec and its estimate: each lever as the run would start.
pub fn check_lines(spec: &crate::spec::Spec, e: &Estimate) -> String {
    let s = Situation {
        at: Position {
            shape: BatchShape {
                micro_batch: spec.train.batch_size,
                accumulation_steps: spec.train.accumulation_steps,
            },
            clean_steps: 0,
            engaged: Engaged::default(),
        },
        min_batch: spec.memory.min_batch_size,
        planned_on_cpu: spec.job.device == crate::spec::Device::Cpu,
        has_blocks: e.has_blocks,
    };
    let on_oom: Vec<&str> = spec.memory.on_oom.iter().map(|a| a.name()).collect();
    let by_spec = configured(spec)
        .iter()
        .fold(Engaged::default(), |e, (_, l)| e.with(l.name()));
    bill_lines(e, &s, &on_oom, by_spec)
}

/// `check`'s lines on the levers: what each would do to the bill, and when it comes into play
/// under the spec (`engaged_by_spec`: levers the spec turns on from the start).
pub fn bill_lines(e: &Estimate, s: &Situation, on_oom: &[&str], engaged_by_spec: Engaged) -> String {
    let mut out = String::from("levers           what each would do to the bill, and when it comes in\n");
    for l in LEVERS {
        let when = if engaged_by_spec.contains(l.name()) {
            "on from the start (spec)".to_owned()
        } else {
            match on_oom.iter().position(|a| *a == l.name()) {
                Some(k) => format!("on an OOM (memory.on_oom entry {})", k + 1),
                None => "not in memory.on_oom".to_owned(),
            }
        };
        let effect = match l.applies(s) {
            Ok(()) => l.estimate(e),
            Err(why) => format!("does not apply: {why}"),
        };
        out += &format!("  {:<10} {when}; {effect}\n", l.name());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::OomAction;

    #[test]
    fn every_on_oom_action_but_fail_is_a_lever_and_names_are_unique() {
        for a in OomAction::ALL {
            match a {
                OomAction::Fail => assert!(lever(a.name()).is_none()),
                _ => assert_eq!(lever(a.name()).map(|l| l.name()), Some(a.name())),
            }
        }
        let mut names: Vec<_> = LEVERS.iter().map(|l| l.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), LEVERS.len());
        assert!(LEVERS.len() <= 32, "Engaged is a 32-bit set");
    }

    #[test]
    fn engaged_levers_travel_as_their_names() {
        let e = Engaged::default().with("cpu").with("recompute");
        assert!(e.contains("cpu") && e.contains("recompute") && !e.contains("backoff"));
        let json = serde_json::to_string(&e).unwrap();
        assert_eq!(json, r#"["recompute","cpu"]"#, "registry order");
        assert_eq!(serde_json::from_str::<Engaged>(&json).unwrap(), e);
        let err = serde_json::from_str::<Engaged>(r#"["swap"]"#).unwrap_err().to_string();
        assert!(err.contains("unknown lever \"swap\""), "{err}");
    }
}
