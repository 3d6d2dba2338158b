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
    // Bytes, not a string: a cut line may end inside a character, and only that line is lost.
    let bytes = fs::read(&metrics).map_err(|e| {
        UsageError(format!(
            "{} has no readable metrics.jsonl ({e}); pass a run directory that `memtrain run` wrote (runs/<job> by default)",
            run_dir.display()
        ))
    })?;
    let mut records = RunRecords::parse(&String::from_utf8_lossy(&bytes));
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
        records.push_lines(text);
        records
    }

    /// More of metrics.jsonl's text, whole lines only, for a reader that follows a live run.
    pub fn push_lines(&mut self, text: &str) {
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            match serde_json::from_str::<Event>(line) {
                Ok(event) => self.push(event),
                Err(_) => self.unreadable_lines += 1,
            }
        }
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
            Event::Prefetch(e) => Some(e.step),
            Event::Graph(e) => Some(e.step),
            Event::Preflight(_) | Event::End(_) => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::records::samples::{self, lines};
    use crate::records::{Recorder, Status};

    #[test]
    fn every_event_kind_reads_back_as_the_recorder_wrote_it() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Recorder::open(dir.path(), "[job]\n", false).unwrap();
        let events = samples::every_kind();
        for e in &events {
            r.emit(e).unwrap();
        }
        let read = read(dir.path()).unwrap();
        assert_eq!(read.events, events);
        assert_eq!(read.unreadable_lines, 0);
        let Some(Event::End(end)) = events.last() else {
            panic!("the samples end with the summary")
        };
        assert_eq!(read.summary.as_ref(), Some(end));
    }

    #[test]
    fn a_loss_json_could_not_carry_reads_back_as_nan() {
        let diverged = Event::Step(samples::step(1, f64::NAN, 1, 1));
        let text = lines(&[diverged]);
        assert!(text.contains(r#""loss":null"#), "{text}");
        let read = RunRecords::parse(&text);
        assert!(read.steps().next().unwrap().loss.is_nan());
    }

    #[test]
    fn a_cut_last_line_is_counted_and_the_rest_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let events = [
            Event::Start(samples::start(0, false, None)),
            Event::Step(samples::step(1, 2.0, 1, 1)),
        ];
        let text = lines(&events) + r#"{"type":"step","epoch":2,"st"#;
        fs::write(dir.path().join("metrics.jsonl"), text).unwrap();
        let read = read(dir.path()).unwrap();
        assert_eq!(read.events, events);
        assert_eq!(read.unreadable_lines, 1);
        assert_eq!(read.summary, None);
    }

    #[test]
    fn a_session_resumed_from_an_earlier_checkpoint_replaces_the_records_after_it() {
        let step = |s: i64, loss: f64| Event::Step(samples::step(s, loss, 1, 1));
        let mut events = vec![
            Event::Start(samples::start(0, false, None)),
            Event::Preflight(samples::preflight()),
        ];
        events.extend((1..=5).map(|s| step(s, 1.0)));
        events.push(Event::Checkpoint(samples::checkpoint(3)));
        events.push(Event::Epoch(samples::epoch(5, 0.5)));
        events.push(Event::Oom(samples::oom(5, samples::backoff())));
        // A crash, then a session from the checkpoint at step 3: it redoes steps 4 and 5.
        let resumed = Event::Start(samples::start(3, true, None));
        events.push(resumed.clone());
        events.extend((4..=6).map(|s| step(s, 2.0)));
        let read = RunRecords::parse(&lines(&events));
        let steps: Vec<(i64, f64)> = read.steps().map(|s| (s.step, s.loss)).collect();
        assert_eq!(steps, [(1, 1.0), (2, 1.0), (3, 1.0), (4, 2.0), (5, 2.0), (6, 2.0)]);
        // What happened up to the checkpoint stays, and so does the first session's start.
        let kinds: Vec<&Event> = read.events.iter().filter(|e| !matches!(e, Event::Step(_))).collect();
        assert_eq!(
            kinds,
            [
                &events[0],
                &events[1],
                &Event::Checkpoint(samples::checkpoint(3)),
                &resumed
            ]
        );
        assert_eq!(read.ooms().count(), 0);
    }

    #[test]
    fn summary_json_is_the_last_word_over_the_end_events() {
        let dir = tempfile::tempdir().unwrap();
        let events = [Event::End(samples::summary(Status::Interrupted, 2))];
        fs::write(dir.path().join("metrics.jsonl"), lines(&events)).unwrap();
        assert_eq!(read(dir.path()).unwrap().summary.unwrap().status, Status::Interrupted);
        let later = samples::summary(Status::Completed, 4);
        crate::atomic::write_json(&dir.path().join("summary.json"), &later).unwrap();
        assert_eq!(read(dir.path()).unwrap().summary, Some(later));
    }

    #[test]
    fn the_first_oom_s_report_reads_back() {
        let dir = tempfile::tempdir().unwrap();
        let mut r = Recorder::open(dir.path(), "[job]\n", false).unwrap();
        let mut oom = samples::oom(4, samples::backoff());
        let memory = samples::epoch(4, 0.5).memory;
        oom.report = Some(crate::records::OomReport {
            allocator_stats: Some(serde_json::json!({"num_ooms": 1})),
            memory: memory.clone(),
            cap: samples::start(0, false, Some(1000)).cap,
            allocator_conf: None,
            snapshot: Some(b"pickle".to_vec()),
            record_history: true,
        });
        r.emit(&Event::Oom(oom.clone())).unwrap();
        let file = read_oom_report(dir.path()).unwrap();
        assert_eq!(
            (file.step, file.micro_batch, file.error.as_str()),
            (4, 8, oom.error.as_str())
        );
        assert_eq!(file.failing_batch_shape, oom.batch_shape);
        assert_eq!(file.memory, memory);
        assert_eq!(file.snapshot.as_deref(), Some("snapshot.pickle"));
        assert_eq!(fs::read(dir.path().join("oom/snapshot.pickle")).unwrap(), b"pickle");
        assert_eq!(fs::read_to_string(dir.path().join("oom/spec.toml")).unwrap(), "[job]\n");
        // The event itself reads back without the report, which lives in oom/ only.
        oom.report = None;
        assert_eq!(read(dir.path()).unwrap().events, [Event::Oom(oom)]);
    }

    #[test]
    fn status_names_are_summary_json_s() {
        for s in [Status::Completed, Status::Interrupted, Status::Oom, Status::StepLimit] {
            assert_eq!(serde_json::to_value(s).unwrap(), s.name());
        }
    }

    #[test]
    fn a_directory_without_metrics_is_a_usage_error() {
        let dir = tempfile::tempdir().unwrap();
        let e = read(dir.path()).unwrap_err();
        assert_eq!(crate::exit::code_for(&e), crate::exit::USAGE);
        assert!(e.to_string().contains("metrics.jsonl"));
    }
}
