//! The SVG of `kvattn serve-bench`: throughput (left axis) and p95 time to first token (right
//! axis) against concurrency on a log2 axis, drawn with `plotters`' SVG backend.

use plotters::prelude::*;

use crate::output::svg::{self, legend, line, mark, pow2_label, top, DrawResult, Log2Axis};

/// One concurrency's values.
pub struct Point {
    /// Requests in flight at most.
    pub concurrency: usize,
    /// Output tokens per second.
    pub throughput: f64,
    /// p95 time to first token, seconds (NaN: none).
    pub ttft_p95: f64,
}

const WIDTH: u32 = 760;
const HEIGHT: u32 = 440;

/// The chart as one SVG document; `kv_fit` (requests whose prompt and output the cache holds)
/// is marked with a vertical line.
pub fn svg(points: &[Point], title: &str, kv_fit: usize) -> Result<String, String> {
    svg::document((WIDTH, HEIGHT), |root| draw(root, points, title, kv_fit))
}

fn draw(
    root: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    points: &[Point],
    title: &str,
    kv_fit: usize,
) -> DrawResult {
    let x = Log2Axis::new(points.iter().map(|p| p.concurrency as f64));
    let xs: Vec<f64> = points
        .iter()
        .map(|p| (p.concurrency as f64).log2())
        .collect();
    let y_tp = top(points.iter().map(|p| p.throughput));
    let y_ttft = top(points.iter().map(|p| p.ttft_p95));
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .right_y_label_area_size(64)
        .build_cartesian_2d(x.range(), 0.0..y_tp)?
        .set_secondary_coord(x.range(), 0.0..y_ttft);
    chart
        .configure_mesh()
        .x_labels(x.labels())
        .x_label_formatter(&pow2_label)
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_desc("concurrency (log2 scale)")
        .y_desc("throughput (output tokens/s)")
        .draw()?;
    chart
        .configure_secondary_axes()
        .y_label_formatter(&|y| format!("{y:.1}"))
        .y_desc("p95 time to first token (s)")
        .draw()?;
    let fit = (kv_fit.max(1) as f64).log2();
    let r = x.range();
    if fit > r.start && fit < r.end {
        let grey = RGBColor(120, 120, 120);
        chart.draw_series(std::iter::once(PathElement::new(
            vec![(fit, 0.0), (fit, y_tp)],
            grey.stroke_width(1),
        )))?;
        chart.draw_series(std::iter::once(Text::new(
            format!(" the cache holds {kv_fit} requests"),
            (fit, y_tp * 0.04),
            ("sans-serif", 12).into_font().color(&grey),
        )))?;
    }
    let (blue, red) = (svg::COLORS[0], svg::COLORS[1]);
    let throughput = xs.iter().zip(points).map(|(&x, p)| (x, p.throughput));
    chart
        .draw_series(line(throughput, blue))?
        .label("throughput (left)")
        .legend(mark(blue));
    let ttft = xs
        .iter()
        .zip(points)
        .filter(|(_, p)| p.ttft_p95.is_finite())
        .map(|(&x, p)| (x, p.ttft_p95));
    chart
        .draw_secondary_series(line(ttft, red))?
        .label("p95 TTFT (right)")
        .legend(mark(red));
    legend(&mut chart)?;
    Ok(())
}
