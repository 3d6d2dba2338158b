//! One frame of `watch` as ratatui widgets: the host and GPUs on top, the jobs below, and the
//! selected job's memory timeline and latest events. The same drawing serves the live terminal
//! and `--once`, which renders it into a buffer and prints that as plain text.
use ratatui::buffer::Buffer;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::symbols::Marker;
use ratatui::text::{Line, Span};
use ratatui::widgets::{Axis, Block, Chart, Dataset, GraphType, LegendPosition, List, ListItem, Paragraph, Row, Table};
use ratatui::Frame;

use super::model::{GpuView, JobView, Snapshot};
use crate::human::{human_bytes, human_duration};

/// Lines the selected job's timeline and events take.
const DETAIL_HEIGHT: u16 = 16;

fn bytes(b: Option<u64>) -> String {
    b.map(human_bytes).unwrap_or_else(|| "-".into())
}

/// The height a frame needs to show everything in `s`, for `--once`.
pub fn height(s: &Snapshot) -> u16 {
    2 + gpus_height(s) + jobs_height(s) + if s.jobs.is_empty() { 0 } else { DETAIL_HEIGHT }
}

fn gpus_height(s: &Snapshot) -> u16 {
    if s.gpus.is_empty() {
        return 1;
    }
    let rows: usize = s.gpus.iter().map(|g| 1 + g.processes.len().max(1)).sum();
    rows as u16 + 3
}

fn jobs_height(s: &Snapshot) -> u16 {
    s.jobs.len().max(1) as u16 + 3
}

pub fn draw(f: &mut Frame, s: &Snapshot, selected: usize) {
    let [header, gpus, jobs, detail] = Layout::vertical([
        Constraint::Length(2),
        Constraint::Length(gpus_height(s)),
        Constraint::Length(jobs_height(s)),
        Constraint::Min(0),
    ])
    .areas(f.area());
    f.render_widget(header_lines(s), header);
    draw_gpus(f, s, gpus);
    draw_jobs(f, s, selected, jobs);
    if let Some(j) = s.jobs.get(selected) {
        draw_detail(f, j, detail);
    }
}

fn header_lines(s: &Snapshot) -> Paragraph<'static> {
    let secs = s.time as u64 % 86_400;
    let clock = format!("{:02}:{:02}:{:02} UTC", secs / 3600, secs / 60 % 60, secs % 60);
    let used = s.host.ram_total_bytes.saturating_sub(s.host.ram_available_bytes);
    Paragraph::new(vec![
        Line::from(vec![
            Span::styled("memtrain watch", Style::new().add_modifier(Modifier::BOLD)),
            Span::raw(format!("  {clock}   q quit   ↑/↓ ←/→ select job")),
        ]),
        Line::from(format!(
            "Host RAM: {} used of {} ({} available)",
            human_bytes(used),
            human_bytes(s.host.ram_total_bytes),
            human_bytes(s.host.ram_available_bytes)
        )),
    ])
}

fn draw_gpus(f: &mut Frame, s: &Snapshot, area: Rect) {
    if s.gpus.is_empty() {
        let why = if s.nvml {
            "NVML sees none"
        } else {
            "no NVIDIA driver (NVML)"
        };
        f.render_widget(
            Paragraph::new(format!(
                "GPUs: none ({why}); the jobs below show their counted CPU tensor memory"
            )),
            area,
        );
        return;
    }
    // Lines rather than a table: a GPU's own line spans the columns of its processes.
    let bold = Style::new().add_modifier(Modifier::BOLD);
    let mut lines = vec![Line::styled(
        format!(
            "  {:<8} {:<10} {:<16} {:>10}  memtrain job",
            "pid", "user", "name", "memory"
        ),
        bold,
    )];
    for g in &s.gpus {
        lines.push(Line::styled(gpu_line(g), bold));
        if g.processes.is_empty() {
            lines.push(Line::from("  no processes"));
        }
        for p in &g.processes {
            let stale = p
                .stale
                .map(|s| format!(" [{}]", s.name().to_uppercase()))
                .unwrap_or_default();
            let run = match (&p.job, &p.run_dir) {
                (Some(job), Some(dir)) => format!(
                    "{job}{}  step {}  {}  {}",
                    p.rank.map(|r| format!(" rank {r}")).unwrap_or_default(),
                    p.step.map_or("-".into(), |s| s.to_string()),
                    p.status.as_deref().unwrap_or("-"),
                    dir.display()
                ),
                _ => String::new(),
            };
            let text = format!(
                "  {:<8} {:<10} {:<16} {:>10}  {run}{stale}",
                p.pid,
                p.user.as_deref().unwrap_or("?"),
                p.name,
                bytes(p.used_bytes)
            );
            lines.push(match p.stale {
                Some(_) => Line::styled(text, Style::new().fg(Color::Red)),
                None => Line::from(text),
            });
        }
    }
    f.render_widget(Paragraph::new(lines).block(Block::bordered().title(" GPUs ")), area);
}

fn gpu_line(g: &GpuView) -> String {
    let util = g
        .utilization_percent
        .map(|u| format!(", {u}% busy"))
        .unwrap_or_default();
    format!(
        "GPU {} {}: {} used of {}{util}",
        g.index,
        g.name,
        human_bytes(g.used_bytes),
        human_bytes(g.total_bytes)
    )
}

fn draw_jobs(f: &mut Frame, s: &Snapshot, selected: usize, area: Rect) {
    let block = Block::bordered().title(" memtrain jobs ");
    if s.jobs.is_empty() {
        f.render_widget(
            Paragraph::new("no memtrain run is running; pass run directories to show finished ones").block(block),
            area,
        );
        return;
    }
    let rows: Vec<Row> = s
        .jobs
        .iter()
        .enumerate()
        .map(|(i, j)| {
            let m = j.memory.as_ref();
            let status = match j.stale {
                Some(st) => format!("{} [{}]", j.status, st.name().to_uppercase()),
                None => j.status.clone(),
            };
            let row = Row::new(vec![
                format!("{} {}", if i == selected { ">" } else { " " }, j.job),
                status,
                j.device.clone().unwrap_or_else(|| "-".into()),
                step_text(j),
                j.samples_per_s.map_or("-".into(), |v| format!("{v:.0}")),
                j.eta_seconds.map_or("-".into(), human_duration),
                bytes(m.and_then(|m| m.allocated_bytes)),
                bytes(m.and_then(|m| m.peak_allocated_bytes)),
                bytes(m.and_then(|m| m.reserved_bytes)),
                bytes(m.and_then(|m| m.host_bytes)),
                bytes(m.and_then(|m| m.cap_bytes)),
                j.pids.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
            ]);
            if i == selected {
                row.style(Style::new().add_modifier(Modifier::REVERSED))
            } else {
                row
            }
        })
        .collect();
    let table = Table::new(
        rows,
        [
            Constraint::Fill(1),
            Constraint::Length(16),
            Constraint::Length(7),
            Constraint::Length(14),
            Constraint::Length(9),
            Constraint::Length(8),
            Constraint::Length(9),
            Constraint::Length(9),
            Constraint::Length(9),
            Constraint::Length(9),
            Constraint::Length(9),
            Constraint::Length(12),
        ],
    )
    .header(
        Row::new([
            "  job",
            "status",
            "device",
            "step (epoch)",
            "samples/s",
            "ETA",
            "allocated",
            "peak",
            "reserved",
            "host",
            "cap",
            "pids",
        ])
        .style(Style::new().add_modifier(Modifier::BOLD)),
    )
    .block(block);
    f.render_widget(table, area);
}

/// "12/135 (1/3)": the step of all steps, the epoch of all epochs, as far as known.
fn step_text(j: &JobView) -> String {
    let Some(step) = j.step else { return "-".into() };
    let total = match (j.steps_per_epoch, j.epochs) {
        (Some(spe), Some(e)) => format!("/{}", spe * e),
        _ => String::new(),
    };
    let epoch = match (j.epoch, j.epochs) {
        (Some(e), Some(n)) => format!(" ({e}/{n})"),
        (Some(e), None) => format!(" ({e})"),
        _ => String::new(),
    };
    format!("{step}{total}{epoch}")
}

/// "  data wait 3%": the share of the latest step the job waited for its batches.
fn wait_text(j: &JobView) -> String {
    j.data_wait_share
        .map(|w| format!("  data wait {:.0}%", w * 100.0))
        .unwrap_or_default()
}

fn draw_detail(f: &mut Frame, j: &JobView, area: Rect) {
    let [chart, events] = Layout::horizontal([Constraint::Percentage(60), Constraint::Percentage(40)]).areas(area);
    draw_timeline(f, j, chart);
    let items: Vec<ListItem> = j
        .events
        .iter()
        .map(|e| {
            let at = e.step.map(|s| format!("step {s}: ")).unwrap_or_default();
            let style = match e.kind.as_str() {
                "oom" => Style::new().fg(Color::Red),
                "grow_back" | "checkpoint" => Style::new().fg(Color::Green),
                _ => Style::new(),
            };
            ListItem::new(format!("{at}{}", e.text)).style(style)
        })
        .collect();
    f.render_widget(
        List::new(items).block(Block::bordered().title(format!(" {} events{} ", j.job, wait_text(j)))),
        events,
    );
}

fn draw_timeline(f: &mut Frame, j: &JobView, area: Rect) {
    if j.timeline.is_empty() {
        let title = format!(" {} memory by step  {} ", j.job, j.run_dir.display());
        f.render_widget(
            Paragraph::new("no step records yet").block(Block::bordered().title(title)),
            area,
        );
        return;
    }
    let series = |get: &dyn Fn(&super::model::TimelinePoint) -> Option<u64>| -> Vec<(f64, f64)> {
        j.timeline
            .iter()
            .filter_map(|p| get(p).map(|b| (p.step as f64, b as f64 / MIB)))
            .collect()
    };
    let allocated = series(&|p| p.allocated_bytes);
    let reserved = series(&|p| p.reserved_bytes);
    let peak = series(&|p| p.peak_allocated_bytes);
    let host = series(&|p| p.host_bytes.filter(|&b| b > 0));
    let (x0, x1) = (
        j.timeline.first().map_or(0.0, |p| p.step as f64),
        j.timeline.last().map_or(1.0, |p| p.step as f64),
    );
    let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
    let highest = [&allocated, &reserved, &peak, &host]
        .iter()
        .flat_map(|s| s.iter().map(|p| p.1))
        .fold(1e-3f64, f64::max);
    // A cap far above what the run uses would flatten every line against the floor: then it
    // is named in the title instead of drawn.
    let cap = j.memory.as_ref().and_then(|m| m.cap_bytes);
    let cap_drawn = cap.map(|c| c as f64 / MIB).filter(|&c| c <= highest * 4.0);
    let cap_line = cap_drawn.map(|c| vec![(x0, c), (x1, c)]).unwrap_or_default();
    let top = highest.max(cap_drawn.unwrap_or(0.0)) * 1.1;
    let off_scale = match (cap, cap_drawn) {
        (Some(c), None) => format!(", cap {} above", human_bytes(c)),
        _ => String::new(),
    };
    let title = format!(" {} memory by step{off_scale}  {} ", j.job, j.run_dir.display());
    let block = Block::bordered().title(title);
    // The datasets borrow their points, which live to the end of this function.
    let keep: [Vec<(f64, f64)>; 5] = [allocated, reserved, peak, host, cap_line];
    let names = ["allocated", "reserved", "peak", "host", "cap"];
    let colors = [Color::Cyan, Color::Blue, Color::Yellow, Color::Magenta, Color::Red];
    let datasets: Vec<Dataset> = keep
        .iter()
        .zip(names)
        .zip(colors)
        .filter(|((d, _), _)| !d.is_empty())
        .map(|((d, name), color)| {
            Dataset::default()
                .name(name)
                .marker(Marker::Braille)
                .graph_type(GraphType::Line)
                .style(Style::new().fg(color))
                .data(d)
        })
        .collect();
    let chart = Chart::new(datasets)
        .block(block)
        // Top left, where the lines start low; shown whenever it fits.
        .legend_position(Some(LegendPosition::TopLeft))
        .hidden_legend_constraints((Constraint::Percentage(50), Constraint::Percentage(80)))
        .x_axis(
            Axis::default()
                .title("step")
                .bounds([x0, x1])
                .labels([format!("{x0:.0}"), format!("{x1:.0}")]),
        )
        .y_axis(
            Axis::default()
                .bounds([0.0, top])
                .labels(["0".to_owned(), human_bytes((top * MIB) as u64)]),
        );
    f.render_widget(chart, area);
}

const MIB: f64 = (1u64 << 20) as f64;

/// A buffer as plain text: one line per row, trailing blanks trimmed.
pub fn plain(buf: &Buffer) -> String {
    let area = buf.area;
    let mut out = String::new();
    for y in area.top()..area.bottom() {
        let mut line = String::new();
        for x in area.left()..area.right() {
            line.push_str(buf[(x, y)].symbol());
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::super::frame_text;
    use super::super::model::*;
    use crate::procs::Stale;

    fn process(pid: u32, user: &str, name: &str, job: Option<&str>, stale: Option<Stale>) -> ProcessView {
        ProcessView {
            pid,
            user: Some(user.into()),
            name: name.into(),
            used_bytes: Some(3 << 30),
            stale,
            job: job.map(Into::into),
            run_dir: job.map(|j| format!("/runs/{j}").into()),
            rank: job.map(|_| 1),
            step: job.map(|_| 120),
            status: job.map(|_| "running".into()),
        }
    }

    /// The GPU side, which a machine without a GPU cannot show for real.
    #[test]
    fn a_gpu_shows_its_memory_and_processes_and_flags_the_stale_one() {
        let snap = Snapshot {
            time: 3600.0 * 25.0 + 61.0,
            host: HostView {
                ram_total_bytes: 64 << 30,
                ram_available_bytes: 48 << 30,
            },
            nvml: true,
            gpus: vec![GpuView {
                index: 0,
                name: "NVIDIA H100".into(),
                total_bytes: 80 << 30,
                used_bytes: 6 << 30,
                utilization_percent: Some(37),
                processes: vec![
                    process(4242, "ana", "memtrain", Some("vit"), Some(Stale::Orphaned)),
                    process(77, "bob", "python3", None, None),
                ],
            }],
            jobs: vec![],
        };
        let text = frame_text(&snap, 140);
        assert!(text.contains("01:01:01 UTC"), "{text}");
        assert!(
            text.contains("Host RAM: 16.00 GiB used of 64.00 GiB (48.00 GiB available)"),
            "{text}"
        );
        assert!(
            text.contains("GPU 0 NVIDIA H100: 6.00 GiB used of 80.00 GiB, 37% busy"),
            "{text}"
        );
        let ours = text.lines().find(|l| l.contains("4242")).unwrap();
        for want in [
            "ana",
            "memtrain",
            "3.00 GiB",
            "vit rank 1",
            "step 120",
            "running",
            "/runs/vit",
            "[ORPHANED]",
        ] {
            assert!(ours.contains(want), "{want:?} missing: {ours}");
        }
        let theirs = text.lines().find(|l| l.contains(" 77 ")).unwrap();
        assert!(
            theirs.contains("bob") && theirs.contains("python3") && !theirs.contains("step"),
            "{theirs}"
        );
        assert!(text.contains("no memtrain run is running"), "{text}");
    }
}
