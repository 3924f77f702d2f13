//! The SVG of `kvattn bench --plot`: for the GQA decode cases (paged, batch 1), the fraction of
//! the roofline reached (upper panel) and the KV bandwidth (lower panel) against the context on
//! a log2 axis, one line per KV storage format.

use kvattn::bench::cases::{Case, CaseKernel, Row};
use plotters::prelude::*;

use crate::output::svg::{self, legend, line, mark, pow2_label, top, DrawResult, Log2Axis};

const WIDTH: u32 = 820;
const HEIGHT: u32 = 720;

/// Whether the chart draws `case`: paged GQA decode (more than one KV head, groups of more than
/// one query head) of one sequence.
pub fn plots(case: &Case) -> bool {
    case.kernel == CaseKernel::Decode
        && case.paged
        && case.batch == 1
        && case.kv_heads > 1
        && case.group() > 1
}

/// One case on the chart.
struct Point {
    context: usize,
    roofline_fraction: f64,
    gbps: f64,
}

/// One line of the chart: its label and its points by context.
struct Series {
    label: String,
    points: Vec<Point>,
}

/// A panel: its y axis and the value of a point on it.
type Panel = (&'static str, fn(&Point) -> f64);

const PANELS: [Panel; 2] = [
    ("roofline reached (%)", |p| 100.0 * p.roofline_fraction),
    ("KV bandwidth (GB/s)", |p| p.gbps),
];

/// Groups the plotted rows into series by storage format, and by head dim and group when the
/// rows hold several.
fn series(rows: &[(Case, Row)]) -> Vec<Series> {
    let plotted: Vec<&(Case, Row)> = rows.iter().filter(|(c, _)| plots(c)).collect();
    let shapes = |c: &Case| (c.head_dim, c.group(), c.q_heads);
    let mixed = plotted
        .iter()
        .any(|(c, _)| shapes(c) != shapes(&plotted[0].0));
    let mut out: Vec<Series> = Vec::new();
    for (c, r) in plotted {
        let label = if mixed {
            format!("{} hd{} g{}", c.kv_dtype, c.head_dim, c.group())
        } else {
            c.kv_dtype.to_string()
        };
        let point = Point {
            context: c.context,
            roofline_fraction: r.roofline_fraction,
            gbps: r.gbps,
        };
        match out.iter_mut().find(|s| s.label == label) {
            Some(s) => s.points.push(point),
            None => out.push(Series {
                label,
                points: vec![point],
            }),
        }
    }
    for s in &mut out {
        s.points.sort_by_key(|p| p.context);
    }
    out
}

/// The chart as one SVG document.
pub fn svg(rows: &[(Case, Row)], title: &str) -> Result<String, String> {
    let series = series(rows);
    svg::document((WIDTH, HEIGHT), |root| draw(root, &series, title))
}

fn draw(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    series: &[Series],
    title: &str,
) -> DrawResult {
    let root = root.titled(title, ("sans-serif", 16))?;
    let panels = root.split_evenly((2, 1));
    let x = Log2Axis::new(
        series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.context as f64)),
    );
    for (i, (area, (y_desc, value))) in panels.iter().zip(PANELS).enumerate() {
        // Head room above the lines for the legend.
        let y_top = 1.5 * top(series.iter().flat_map(|s| s.points.iter().map(value)));
        let decimals = if y_top >= 10.0 { 0 } else { 2 };
        let mut chart = ChartBuilder::on(area)
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(64)
            .build_cartesian_2d(x.range(), 0.0..y_top)?;
        chart
            .configure_mesh()
            .x_labels(x.labels())
            .x_label_formatter(&pow2_label)
            .y_label_formatter(&|y| format!("{y:.decimals$}"))
            .x_desc("context, keys per sequence (log2 scale)")
            .y_desc(y_desc)
            .draw()?;
        for (i, s) in series.iter().enumerate() {
            let color = svg::COLORS[i % svg::COLORS.len()];
            let points = s
                .points
                .iter()
                .map(|p| ((p.context as f64).log2(), value(p)));
            chart
                .draw_series(line(points, color))?
                .label(s.label.clone())
                .legend(mark(color));
        }
        // One legend serves both panels.
        if i == 0 {
            legend(&mut chart)?;
        }
    }
    Ok(())
}
