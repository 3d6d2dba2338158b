//! The records of a run directory read back as the types that wrote them: what `report` draws,
//! what `fit` measures. A renamed field is a compile error here, not a silently empty chart.
use std::fs;
use std::path::Path;

use anyhow::Result;

use super::events::{Event, OomEvent, OomReportFile, StartEvent, StepEvent, Summary};
use crate::exit::UsageError;

/// A run directory's records: every session's, in the order they happened.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct RunRecords {
    /// metrics.jsonl's events. A session resumed from an earlier checkpoint (after a crash)
    /// redoes the steps after it, so its records replace the earlier ones from its start on.
    pub events: Vec<Event>,
    /// summary.json when it can be read, else the last `end` event: one per session, the latest
    /// session's last.
    pub summary: Option<Summary>,
    /// Lines that are not a whole event, such as a killed run's cut last line; skipped.
    pub unreadable_lines: usize,
}

/// Reads `run_dir`'s metrics.jsonl and summary.json. Only a missing or unreadable metrics.jsonl
/// is an error (the directory is not a run's); a line that does not parse is counted.
pub fn read(run_dir: &Path) -> Result<RunRecords> {
    let metrics = run_dir.join("metrics.jsonl");
    let text = fs::read_to_string(&metrics).map_err(|e| {
        UsageError(format!(
            "{} has no readable metrics.jsonl ({e}); pass a run directory that `memtrain run` wrote (runs/<job> by default)",
            run_dir.display()
        ))
    })?;
    let mut records = RunRecords::parse(&text);
    // summary.json is rewritten at every session's end, so it is the last word when present.
    let summary = fs::read(run_dir.join("summary.json"))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    if summary.is_some() {
        records.summary = summary;
    }
    Ok(records)
}

/// oom/report.json, where the run wrote one and it can be read.
pub fn read_oom_report(run_dir: &Path) -> Option<OomReportFile> {
    let bytes = fs::read(run_dir.join("oom/report.json")).ok()?;
    serde_json::from_slice(&bytes).ok()
}

impl RunRecords {
    /// metrics.jsonl's text, one event a line.
    pub fn parse(text: &str) -> Self {
        let mut records = RunRecords::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<Event>(line) {
                Ok(event) => records.push(event),
                Err(_) => records.unreadable_lines += 1,
            }
        }
        records
    }

    fn push(&mut self, event: Event) {
        match &event {
            Event::Start(s) if s.resumed => {
                let from = s.step;
                self.events.retain(|e| e.at_step().is_none_or(|at| at <= from));
            }
            Event::End(s) => self.summary = Some(s.clone()),
            _ => {}
        }
        self.events.push(event);
    }

    pub fn starts(&self) -> impl Iterator<Item = &StartEvent> {
        self.events.iter().filter_map(|e| match e {
            Event::Start(s) => Some(s),
            _ => None,
        })
    }

    pub fn steps(&self) -> impl Iterator<Item = &StepEvent> {
        self.events.iter().filter_map(|e| match e {
            Event::Step(s) => Some(s),
            _ => None,
        })
    }

    pub fn ooms(&self) -> impl Iterator<Item = &OomEvent> {
        self.events.iter().filter_map(|e| match e {
            Event::Oom(o) => Some(o),
            _ => None,
        })
    }
}

impl Event {
    /// The global step an event sits at on the run's timeline; `None` for the preflight and the
    /// end, which are about a session rather than a step.
    pub fn at_step(&self) -> Option<i64> {
        match self {
            Event::Start(e) => Some(e.step),
            Event::Step(e) => Some(e.step),
            Event::Epoch(e) => Some(e.step),
            Event::Checkpoint(e) => Some(e.step),
            Event::Oom(e) => Some(e.step),
            Event::GrowBack(e) => Some(e.step),
            Event::CacheClear(e) => Some(e.step),
            Event::Preflight(_) | Event::End(_) => None,
        }
    }
}
