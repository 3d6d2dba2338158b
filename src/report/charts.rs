//! The report's pictures, drawn with plotters into SVG strings.
use anyhow::{anyhow, Result};
use plotters::prelude::*;

use super::{BlockState, Mark, MarkKind, Segment, SegmentMap};
use crate::human::human_bytes;
use crate::policy::levers::lever;

pub const WIDTH: u32 = 960;

/// Points per series: a chart is under 1,000 pixels wide, so more only makes the page heavy.
pub const MAX_POINTS: usize = 2000;

/// At most `max` points: the first and last, and each bucket's lowest and highest in step
/// order, so peaks survive the thinning.
pub fn thin(points: &[(f64, f64)], max: usize) -> Vec<(f64, f64)> {
    if points.len() <= max || max < 4 {
        return points.to_vec();
    }
    let buckets = (max - 2) / 2;
    let inner = &points[1..points.len() - 1];
    let size = inner.len().div_ceil(buckets);
    let mut out = vec![points[0]];
    for chunk in inner.chunks(size) {
        let lo = chunk
            .iter()
            .enumerate()
            .min_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
            .unwrap();
        let hi = chunk
            .iter()
            .enumerate()
            .max_by(|a, b| a.1 .1.total_cmp(&b.1 .1))
            .unwrap();
        let (first, second) = if lo.0 <= hi.0 { (lo, hi) } else { (hi, lo) };
        out.push(*first.1);
        if first.0 != second.0 {
            out.push(*second.1);
        }
    }
    out.push(points[points.len() - 1]);
    out
}

/// How a chart's y values read.
#[derive(Debug, Clone, Copy)]
pub enum Axis {
    Bytes,
    Plain,
    Percent,
}

impl Axis {
    /// A tick label with as many digits as the axis's `span` needs to tell ticks apart.
    fn fmt(self, v: f64, span: f64) -> String {
        let digits = (-(span / 10.0).log10()).ceil().clamp(0.0, 12.0) as usize;
        match self {
            Axis::Bytes => human_bytes(v.max(0.0) as u64),
            Axis::Percent => format!("{:.0}%", v * 100.0),
            Axis::Plain if v != 0.0 && (v.abs() < 1e-3 || v.abs() >= 1e7) => {
                let mantissa = (v.abs().log10().floor() - (span / 10.0).log10().floor()).clamp(0.0, 12.0) as usize;
                format!("{v:.mantissa$e}")
            }
            Axis::Plain => format!("{v:.digits$}"),
        }
    }
}

pub struct Series {
    pub name: &'static str,
    pub color: RGBColor,
    pub width: u32,
    pub points: Vec<(f64, f64)>,
}

pub struct LineChart<'a> {
    pub title: &'a str,
    pub x_desc: &'a str,
    pub axis: Axis,
    pub series: Vec<Series>,
    /// Vertical lines: events, and epoch boundaries (drawn faint).
    pub marks: &'a [Mark],
    pub epoch_ends: &'a [f64],
    /// A horizontal line, e.g. the memory cap.
    pub limit: Option<(&'static str, f64)>,
    pub height: u32,
}

pub fn mark_color(k: MarkKind) -> RGBColor {
    match k {
        MarkKind::Fail => RGBColor(214, 39, 40),
        MarkKind::Lever(name) => {
            // A name this memtrain does not know (a newer one wrote the records) gets pink.
            let [r, g, b] = lever(name).map_or([227, 119, 194], |l| l.about().colour);
            RGBColor(r, g, b)
        }
        MarkKind::Validation => RGBColor(23, 100, 160),
        MarkKind::GrowBack => RGBColor(44, 160, 44),
        MarkKind::CacheClear => RGBColor(148, 103, 189),
        MarkKind::Checkpoint => RGBColor(127, 127, 127),
        MarkKind::Resume => RGBColor(23, 190, 207),
    }
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("drawing a chart: {e}")
}

/// A line chart's ranges, the limit line when it is on the data's scale, and the caption.
struct Frame {
    x0: f64,
    x1: f64,
    y0: f64,
    y1: f64,
    limit: Option<(&'static str, f64)>,
    caption: String,
}

/// `None` when no series has a finite point.
fn frame(c: &LineChart) -> Option<Frame> {
    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let all: Vec<(f64, f64)> = c
        .series
        .iter()
        .flat_map(|s| s.points.iter().filter(finite))
        .copied()
        .collect();
    if all.is_empty() {
        return None;
    }
    let (mut x0, mut x1) = all
        .iter()
        .fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    for m in c.marks {
        x0 = x0.min(m.step);
        x1 = x1.max(m.step);
    }
    if x1 <= x0 {
        x1 = x0 + 1.0;
    }
    let y_max = all.iter().map(|p| p.1).fold(f64::MIN, f64::max);
    let mut y0 = all.iter().map(|p| p.1).fold(f64::MAX, f64::min);
    // A limit far above the data would flatten it: drawn only when it is on the same scale.
    let limit = c.limit.filter(|(_, l)| *l <= 3.0 * y_max.max(0.0));
    let y1 = limit.map_or(y_max, |(_, l)| y_max.max(l));
    if matches!(c.axis, Axis::Bytes | Axis::Percent) || y0 > 0.0 && y0 < 0.5 * y1 {
        y0 = y0.min(0.0);
    }
    let span = y1 - y0;
    let pad = if span > 1e-9 * y1.abs() {
        span * 0.08
    } else {
        (y1.abs() * 0.1).max(1e-12)
    };
    let (y0, y1) = (if y0 == 0.0 { 0.0 } else { y0 - pad }, y1 + pad);
    let caption = match (c.limit, limit) {
        (Some((name, l)), None) => format!("{} ({name} {} is far above)", c.title, c.axis.fmt(l, l)),
        _ => c.title.to_owned(),
    };

    Some(Frame {
        x0,
        x1,
        y0,
        y1,
        limit,
        caption,
    })
}

/// One mark per pixel column (`column` steps wide) and kind is all the eye can see.
fn visible_marks(marks: &[Mark], column: f64) -> Vec<&Mark> {
    let mut seen = std::collections::HashSet::new();
    marks
        .iter()
        .filter(|m| seen.insert((m.kind, (m.step / column) as i64)))
        .collect()
}

/// A line chart with event marks; `None` when no series has a point.
pub fn line_chart(c: &LineChart) -> Result<Option<String>> {
    let finite = |p: &&(f64, f64)| p.0.is_finite() && p.1.is_finite();
    let Some(Frame {
        x0,
        x1,
        y0,
        y1,
        limit,
        caption,
    }) = frame(c)
    else {
        return Ok(None);
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, c.height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(84)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(err)?;
        let axis = c.axis;
        chart
            .configure_mesh()
            .light_line_style(RGBColor(238, 238, 238))
            .x_desc(c.x_desc)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| axis.fmt(*v, y1 - y0))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(
                c.epoch_ends
                    .iter()
                    .map(|&x| PathElement::new(vec![(x, y0), (x, y1)], RGBColor(200, 200, 200).stroke_width(1))),
            )
            .map_err(err)?;
        let marks = visible_marks(c.marks, (x1 - x0) / WIDTH as f64);
        let mut kinds: Vec<MarkKind> = marks.iter().map(|m| m.kind).collect();
        kinds.sort();
        kinds.dedup();
        for k in kinds {
            let color = mark_color(k);
            chart
                .draw_series(
                    marks
                        .iter()
                        .filter(|m| m.kind == k)
                        .map(|m| PathElement::new(vec![(m.step, y0), (m.step, y1)], color.stroke_width(2))),
                )
                .map_err(err)?
                .label(k.label())
                .legend(move |(x, y)| PathElement::new(vec![(x + 9, y - 7), (x + 9, y + 7)], color.stroke_width(2)));
        }
        if let Some((name, l)) = limit {
            let red = RGBColor(214, 39, 40);
            chart
                .draw_series(std::iter::once(PathElement::new(
                    vec![(x0, l), (x1, l)],
                    red.stroke_width(1),
                )))
                .map_err(err)?
                .label(name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], red.stroke_width(1)));
        }
        for s in &c.series {
            let pts: Vec<(f64, f64)> = s.points.iter().filter(finite).copied().collect();
            if pts.is_empty() {
                continue;
            }
            let style = s.color.stroke_width(s.width);
            let color = s.color;
            let width = s.width;
            let drawn = if pts.len() == 1 {
                chart
                    .draw_series(pts.iter().map(|&p| Circle::new(p, 3, style.filled())))
                    .map_err(err)?
            } else {
                chart.draw_series(LineSeries::new(pts, style)).map_err(err)?
            };
            drawn
                .label(s.name)
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(width)));
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(RGBColor(180, 180, 180))
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(Some(svg))
}

const SEGMENT_ROWS: usize = 40;

/// Where the blocks in `state` lie, as (start, end) fractions of their segment's size and the
/// segment's row.
fn block_spans(segs: &[&Segment], state: BlockState, rows: usize) -> Vec<(f64, f64, f64)> {
    let mut spans = vec![];
    for (i, s) in segs.iter().enumerate() {
        let y = (rows - 1 - i) as f64;
        let mut at = 0u64;
        for b in &s.blocks {
            if b.state == state && s.total_size > 0 {
                spans.push((
                    at as f64 / s.total_size as f64,
                    (at + b.size) as f64 / s.total_size as f64,
                    y,
                ));
            }
            at += b.size;
        }
    }
    spans
}

/// One row per segment (largest first), each drawn to the full width with its blocks in
/// address order: allocated, awaiting free, free. Next to it, its size and largest free block.
pub fn segment_map(map: &SegmentMap) -> Result<String> {
    let mut segs: Vec<_> = map.segments.iter().collect();
    segs.sort_by(|a, b| b.total_size.cmp(&a.total_size).then(a.address.cmp(&b.address)));
    segs.truncate(SEGMENT_ROWS);
    let rows = segs.len().max(1);
    let height = 90 + 22 * rows as u32;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, height)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(
                "Allocator segments at the OOM (each row one segment, to scale within the row)",
                ("sans-serif", 18),
            )
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(10)
            .build_cartesian_2d(0f64..1.9, 0f64..rows as f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .disable_y_axis()
            .x_labels(6)
            .x_label_formatter(&|v| {
                if *v <= 1.0 {
                    format!("{:.0}%", v * 100.0)
                } else {
                    String::new()
                }
            })
            .x_desc("offset within the segment")
            .draw()
            .map_err(err)?;
        let colors = [
            (BlockState::Allocated, RGBColor(31, 119, 180), "allocated"),
            (BlockState::AwaitingFree, RGBColor(255, 187, 120), "awaiting free"),
            (BlockState::Free, RGBColor(210, 210, 210), "free (cached)"),
        ];
        for (state, color, name) in colors {
            let rects: Vec<_> = block_spans(&segs, state, rows)
                .into_iter()
                .map(|(x0, x1, y)| Rectangle::new([(x0, y + 0.15), (x1, y + 0.85)], color.filled()))
                .collect();
            chart
                .draw_series(rects)
                .map_err(err)?
                .label(name)
                .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
        }
        let outline = RGBColor(90, 90, 90);
        chart
            .draw_series(segs.iter().enumerate().map(|(i, _)| {
                let y = (rows - 1 - i) as f64;
                Rectangle::new([(0.0, y + 0.15), (1.0, y + 0.85)], outline.stroke_width(1))
            }))
            .map_err(err)?;
        let request = map.request.unwrap_or(0);
        chart
            .draw_series(segs.iter().enumerate().map(|(i, s)| {
                let y = (rows - 1 - i) as f64 + 0.5;
                let free = s.largest_free();
                let flag = if request > 0 && free > 0 && free < request {
                    " < request"
                } else {
                    ""
                };
                Text::new(
                    format!(
                        "{} ({}), largest free {}{flag}",
                        human_bytes(s.total_size),
                        if s.large { "large" } else { "small" },
                        human_bytes(free)
                    ),
                    (1.02, y),
                    ("sans-serif", 12).into_font().color(&BLACK),
                )
            }))
            .map_err(err)?;
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(RGBColor(180, 180, 180))
            .label_font(("sans-serif", 13))
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

/// The failed request beside the largest free block and all free cached memory: when the
/// request is larger than the largest block but not than all free memory, fragmentation is
/// what failed it.
pub fn request_bars(map: &SegmentMap) -> Result<String> {
    let free_total = map.reserved().saturating_sub(map.allocated());
    let mut bars = vec![
        ("largest free block", map.largest_free(), RGBColor(44, 160, 44)),
        ("all free cached memory", free_total, RGBColor(160, 160, 160)),
    ];
    if let Some(r) = map.request {
        bars.insert(0, ("failed request", r, RGBColor(214, 39, 40)));
    }
    let max = bars.iter().map(|b| b.1).max().unwrap_or(1).max(1) as f64;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, 60 + 34 * bars.len() as u32)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("The failed request against free memory", ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(24)
            .build_cartesian_2d(0f64..max * 1.6, 0f64..bars.len() as f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_mesh()
            .disable_y_axis()
            .x_label_formatter(&|v| human_bytes(*v as u64))
            .draw()
            .map_err(err)?;
        let n = bars.len();
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (_, v, c))| {
                let y = (n - 1 - i) as f64;
                Rectangle::new([(0.0, y + 0.2), (*v as f64, y + 0.8)], c.filled())
            }))
            .map_err(err)?;
        chart
            .draw_series(bars.iter().enumerate().map(|(i, (name, v, _))| {
                let y = (n - 1 - i) as f64 + 0.5;
                Text::new(
                    format!("{name}: {}", human_bytes(*v)),
                    (*v as f64 + max * 0.02, y),
                    ("sans-serif", 13).into_font().color(&BLACK),
                )
            }))
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(svg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thinning_keeps_the_ends_and_every_buckets_extremes() {
        let pts: Vec<(f64, f64)> = (0..10_000).map(|i| (i as f64, ((i * 7919) % 1000) as f64)).collect();
        let thin_pts = thin(&pts, 200);
        assert!(thin_pts.len() <= 200, "{}", thin_pts.len());
        assert_eq!(thin_pts[0], pts[0]);
        assert_eq!(*thin_pts.last().unwrap(), *pts.last().unwrap());
        assert!(thin_pts.windows(2).all(|w| w[0].0 < w[1].0), "still in step order");
        let max = thin_pts.iter().map(|p| p.1).fold(0.0, f64::max);
        assert_eq!(max, 999.0, "the peak survives");
        assert_eq!(thin(&pts[..50], 200), pts[..50].to_vec());
    }

    #[test]
    fn tick_labels_have_the_digits_their_span_needs() {
        let ticks = |lo: f64, step: f64, span: f64| -> Vec<String> {
            (0..4).map(|i| Axis::Plain.fmt(lo + step * i as f64, span)).collect()
        };
        assert_eq!(ticks(0.0098, 0.0002, 0.002), ["0.0098", "0.0100", "0.0102", "0.0104"]);
        assert_eq!(ticks(60000.0, 10000.0, 80000.0), ["60000", "70000", "80000", "90000"]);
        assert_eq!(Axis::Plain.fmt(1.2e-4, 2e-5), "1.20e-4");
        assert_eq!(Axis::Bytes.fmt(3.0 * 1048576.0, 1.0), "3.00 MiB");
        assert_eq!(Axis::Percent.fmt(0.5, 1.0), "50%");
    }
}
