//! report.html: one file, inline SVG and CSS, nothing fetched, no scripts.
use std::fmt::Write;

use anyhow::Result;
use plotters::style::RGBColor;

use super::charts::{self, Axis, LineChart, Series};
use super::{MarkKind, Run, StepPoint};
use crate::human::{human_bytes, human_duration};
use crate::policy::levers::{Described, LEVERS};

const BLUE: RGBColor = RGBColor(31, 119, 180);
const LIGHT_BLUE: RGBColor = RGBColor(158, 202, 225);
const ORANGE: RGBColor = RGBColor(230, 110, 0);
const LIGHT_ORANGE: RGBColor = RGBColor(253, 190, 133);
const GREEN: RGBColor = RGBColor(44, 160, 44);
const PURPLE: RGBColor = RGBColor(117, 107, 177);
const LIGHT_PURPLE: RGBColor = RGBColor(188, 189, 220);

fn series(name: &'static str, color: RGBColor, width: u32, run: &Run, f: impl Fn(&StepPoint) -> Option<f64>) -> Series {
    let points: Vec<(f64, f64)> = run.steps.iter().filter_map(|p| Some((p.step, f(p)?))).collect();
    Series {
        name,
        color,
        width,
        points: charts::thin(&points, charts::MAX_POINTS),
    }
}

pub fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The memory charts: device (or counted CPU tensor) memory with its marks, and RSS.
fn memory_figures(run: &Run, epoch_ends: &[f64]) -> Result<Vec<(&'static str, String)>> {
    let mut figures: Vec<(&'static str, String)> = vec![];
    let tensors_title = if run.device.starts_with("cuda") {
        "GPU memory per step (peaks are since the previous step line)"
    } else {
        "CPU tensor memory per step (the counting allocator; peaks since the previous step line)"
    };
    let memory = LineChart {
        title: tensors_title,
        x_desc: "optimizer step",
        axis: Axis::Bytes,
        series: vec![
            series("peak allocated", LIGHT_BLUE, 2, run, |p| p.peak_allocated),
            series("allocated", BLUE, 2, run, |p| p.allocated),
            series("peak reserved", LIGHT_ORANGE, 2, run, |p| p.peak_reserved),
            series("reserved", ORANGE, 2, run, |p| p.reserved),
            series("peak on host", LIGHT_PURPLE, 2, run, |p| p.peak_host),
            series("on host", PURPLE, 2, run, |p| p.host),
        ],
        marks: &run.marks,
        epoch_ends,
        limit: run.cap_bytes.map(|c| ("cap", c)),
        height: 360,
    };
    if let Some(svg) = charts::line_chart(&memory)? {
        figures.push(("memory", svg));
    }
    let rss = LineChart {
        title: "Host memory (RSS) per step",
        series: vec![series("RSS", GREEN, 2, run, |p| Some(p.rss))],
        limit: None,
        height: 260,
        ..memory
    };
    if let Some(svg) = charts::line_chart(&rss)? {
        figures.push(("rss", svg));
    }
    Ok(figures)
}

/// The training curves: loss, accuracy, learning rate and throughput.
fn training_figures(run: &Run, epoch_ends: &[f64]) -> Result<Vec<(&'static str, String)>> {
    let mut figures: Vec<(&'static str, String)> = vec![];
    let loss_series = vec![
        series("step loss", LIGHT_BLUE, 1, run, |p| Some(p.loss)),
        Series {
            name: "epoch train loss",
            color: BLUE,
            width: 2,
            points: run.epochs.iter().map(|e| (e.step, e.train_loss)).collect(),
        },
        Series {
            name: "validation loss",
            color: ORANGE,
            width: 2,
            points: run.epochs.iter().filter_map(|e| Some((e.step, e.val_loss?))).collect(),
        },
    ];
    let curves = [
        ("loss", "Loss", Axis::Plain, loss_series),
        (
            "accuracy",
            "Accuracy per epoch",
            Axis::Percent,
            vec![
                Series {
                    name: "train accuracy",
                    color: BLUE,
                    width: 2,
                    points: run.epochs.iter().map(|e| (e.step, e.train_acc)).collect(),
                },
                Series {
                    name: "validation accuracy",
                    color: ORANGE,
                    width: 2,
                    points: run.epochs.iter().filter_map(|e| Some((e.step, e.val_acc?))).collect(),
                },
            ],
        ),
        (
            "lr",
            "Learning rate",
            Axis::Plain,
            vec![series("learning rate", PURPLE, 2, run, |p| Some(p.lr))],
        ),
        (
            "throughput",
            "Throughput (samples/s, running mean over the epoch)",
            Axis::Plain,
            vec![series("samples/s", GREEN, 2, run, |p| Some(p.samples_per_s))],
        ),
    ];
    for (id, title, axis, series) in curves {
        let c = LineChart {
            title,
            x_desc: "optimizer step",
            axis,
            series,
            marks: &[],
            epoch_ends,
            limit: None,
            height: 280,
        };
        if let Some(svg) = charts::line_chart(&c)? {
            figures.push((id, svg));
        }
    }

    Ok(figures)
}

pub fn render(run: &Run) -> Result<String> {
    let epoch_ends: Vec<f64> = run.epochs.iter().map(|e| e.step).collect();
    let mut figures = memory_figures(run, &epoch_ends)?;
    figures.extend(training_figures(run, &epoch_ends)?);
    let mut h = String::new();
    let title = format!("memtrain report: {}", if run.job.is_empty() { "run" } else { &run.job });
    write!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\n<style>{CSS}</style></head><body>\n<h1>{}</h1>\n",
        escape(&title),
        escape(&title)
    )?;
    writeln!(h, "<p class=\"where\">{}</p>", escape(&run.dir.display().to_string()))?;
    h += &facts_table(run);
    h += "<h2>Memory</h2>\n";
    h += &ranks_table(run);
    if run.steps.is_empty() {
        h += "<p>No step lines were recorded (the run ended before its first step, or <code>log.every_steps</code> is 0).</p>\n";
    }
    for (id, svg) in &figures {
        if *id == "loss" {
            h += &events_table(run);
            h += "<h2>Training</h2>\n";
        }
        writeln!(h, "<figure id=\"{id}\">{svg}</figure>")?;
    }
    if !figures.iter().any(|(id, _)| *id == "loss") {
        h += &events_table(run);
    }
    if let Some(e) = &run.snapshot_error {
        writeln!(h, "<p>The allocator snapshot could not be drawn: {}</p>", escape(e))?;
    }
    if let Some(map) = &run.segments {
        h += "<h2>Allocator at the OOM</h2>\n";
        writeln!(
            h,
            "<p>{} segments, {} reserved, {} allocated; largest free block {}{}.</p>",
            map.segments.len(),
            human_bytes(map.reserved()),
            human_bytes(map.allocated()),
            human_bytes(map.largest_free()),
            map.request
                .map(|r| format!(", failed request {}", human_bytes(r)))
                .unwrap_or_default()
        )?;
        writeln!(h, "<figure id=\"request\">{}</figure>", charts::request_bars(map)?)?;
        writeln!(h, "<figure id=\"segments\">{}</figure>", charts::segment_map(map)?)?;
    }
    write!(
        h,
        "<footer>memtrain {} · from metrics.jsonl, summary.json and oom/ in this directory</footer>\n</body></html>\n",
        env!("CARGO_PKG_VERSION")
    )?;
    Ok(h)
}

const CSS: &str = "body{font-family:sans-serif;max-width:1000px;margin:1.5em auto;color:#222}\
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em;border-bottom:1px solid #ddd}\
table{border-collapse:collapse;margin:.5em 0}td,th{padding:.2em .8em;border-bottom:1px solid #eee;text-align:left;vertical-align:top}\
figure{margin:.8em 0}svg{max-width:100%;height:auto}.where{color:#666;font-size:.9em}footer{color:#888;font-size:.8em;margin-top:2em}";

fn facts_table(run: &Run) -> String {
    let mut rows: Vec<(&str, String)> = vec![];
    let summary = run.summary.as_ref();
    rows.push(("status", run.status().to_owned()));
    rows.push(("device", run.device.clone()));
    if let Some(s) = summary {
        rows.push(("epochs completed", s.epochs_completed.to_string()));
    }
    rows.push(("optimizer steps", run.global_steps().to_string()));
    let bytes = |v: Option<f64>| v.map(|b| human_bytes(b as u64));
    if let Some(b) = bytes(run.peak_allocated()) {
        rows.push(("peak allocated", b));
    }
    if let Some(b) = bytes(run.peak_reserved()) {
        rows.push(("peak reserved", b));
    }
    if let Some(s) = summary {
        rows.push(("peak RSS", human_bytes(s.memory.peak_rss_bytes)));
    }
    if let Some(b) = bytes(run.cap_bytes) {
        rows.push(("memory cap", b));
    }
    if let Some(s) = summary {
        rows.push(("samples/s", format!("{:.1}", s.samples_per_s)));
        rows.push(("wall time", human_duration(s.wall_seconds)));
    }
    if let Some(w) = run.data_wait() {
        rows.push(("data wait", w));
    }
    if let Some(c) = summary.and_then(|s| s.cache) {
        rows.push((
            "cache clears",
            format!("{} ({})", c.clears, human_duration(c.clear_seconds)),
        ));
    }
    if let Some(s) = summary {
        let m = &s.memory;
        rows.push((
            "per-step memory readings",
            format!("{} ({})", m.step_readings, human_duration(m.step_reading_seconds)),
        ));
        let o = &s.oom;
        rows.push((
            "OOM events",
            format!(
                "{} ({}grow-back {})",
                o.events,
                LEVERS
                    .iter()
                    .map(|l| format!("{} {}, ", l.label(), o.of(l.counted_as())))
                    .collect::<String>(),
                o.grow_backs
            ),
        ));
        rows.push(("precision", s.precision.mode.name().to_owned()));
        let b = &s.batch;
        rows.push((
            "batch",
            format!(
                "effective {}; micro-batch {} x {} at the start, {} x {} at the end",
                b.effective_batch,
                b.configured_micro_batch,
                b.configured_accumulation_steps,
                b.final_micro_batch,
                b.final_accumulation_steps
            ),
        ));
    }
    let mut h = String::from("<table id=\"facts\">\n");
    for (k, v) in rows {
        h += &format!("<tr><th>{}</th><td>{}</td></tr>\n", escape(k), escape(&v));
    }
    h + "</table>\n"
}

/// Data-parallel runs: every rank's peaks over the run, from summary.json.
fn ranks_table(run: &Run) -> String {
    let ranks = run.rank_peaks();
    if ranks.is_empty() {
        return String::new();
    }
    let cell = |v: Option<u64>| v.map(human_bytes).unwrap_or_else(|| "-".into());
    let mut h = String::from(
        "<table id=\"ranks\"><tr><th>rank</th><th>peak allocated</th><th>peak reserved</th><th>peak RSS</th></tr>\n",
    );
    for r in ranks {
        h += &format!(
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>\n",
            r.rank,
            cell(r.peak_allocated_bytes),
            cell(r.peak_reserved_bytes),
            human_bytes(r.peak_rss_bytes)
        );
    }
    h + "</table>\n"
}

fn events_table(run: &Run) -> String {
    if run.marks.is_empty() {
        return "<p id=\"events\">No OOM, backoff, recompute, grow-back, cache-clear or checkpoint events.</p>\n"
            .into();
    }
    let mut h =
        String::from("<h2>Events</h2>\n<table id=\"events\"><tr><th>step</th><th>event</th><th>detail</th></tr>\n");
    for m in run.marks.iter().take(MAX_EVENT_ROWS) {
        let c = charts::mark_color(m.kind);
        let oom = m.kind == MarkKind::Fail;
        h += &format!(
            "<tr{}><td>{}</td><td><span style=\"color:rgb({},{},{})\">&#9646;</span> {}</td><td>{}</td></tr>\n",
            if oom { " class=\"oom\"" } else { "" },
            m.step,
            c.0,
            c.1,
            c.2,
            escape(m.kind.label()),
            escape(&m.detail)
        );
    }
    if run.marks.len() > MAX_EVENT_ROWS {
        h += &format!(
            "<tr><td colspan=\"3\">{} more in metrics.jsonl</td></tr>\n",
            run.marks.len() - MAX_EVENT_ROWS
        );
    }
    h + "</table>\n"
}

/// A page stays a page: a cache cleared every step of a long run is summed up, not listed.
const MAX_EVENT_ROWS: usize = 500;
