//! The SVG of `kvattn serve-bench`: throughput (left axis) and p95 time to first token (right
//! axis) against concurrency on a log2 axis, drawn with `plotters`' SVG backend.

use plotters::prelude::*;

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
    let mut out = String::new();
    draw(&mut out, points, title, kv_fit).map_err(|e| e.to_string())?;
    Ok(out)
}

/// The top of an axis holding `values`: 10% above the largest, 1 when there is none.
pub fn top(values: impl Iterator<Item = f64>) -> f64 {
    let m = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    if m > 0.0 {
        m * 1.1
    } else {
        1.0
    }
}

/// `2^x` as a concurrency label: an integer at integer `x`.
pub fn pow2_label(x: &f64) -> String {
    let v = x.exp2();
    if (v - v.round()).abs() < 1e-6 {
        format!("{}", v.round())
    } else {
        format!("{v:.1}")
    }
}

fn draw(
    out: &mut String,
    points: &[Point],
    title: &str,
    kv_fit: usize,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::with_string(out, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let xs: Vec<f64> = points
        .iter()
        .map(|p| (p.concurrency as f64).log2())
        .collect();
    let lo = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let (lo, hi) = if lo.is_finite() { (lo, hi) } else { (0.0, 1.0) };
    let x_range = (lo - 0.25)..(hi + 0.25);
    let y_tp = top(points.iter().map(|p| p.throughput));
    let y_ttft = top(points.iter().map(|p| p.ttft_p95));
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .right_y_label_area_size(64)
        .build_cartesian_2d(x_range.clone(), 0.0..y_tp)?
        .set_secondary_coord(x_range, 0.0..y_ttft);
    chart
        .configure_mesh()
        .x_labels(((hi - lo).round() as usize + 1).max(2))
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
    if fit > lo - 0.25 && fit < hi + 0.25 {
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
    let blue = RGBColor(31, 119, 180);
    let red = RGBColor(214, 39, 40);
    chart
        .draw_series(
            LineSeries::new(
                xs.iter().zip(points).map(|(&x, p)| (x, p.throughput)),
                blue.stroke_width(2),
            )
            .point_size(3),
        )?
        .label("throughput (left)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], blue.stroke_width(2)));
    chart
        .draw_secondary_series(
            LineSeries::new(
                xs.iter()
                    .zip(points)
                    .filter(|(_, p)| p.ttft_p95.is_finite())
                    .map(|(&x, p)| (x, p.ttft_p95)),
                red.stroke_width(2),
            )
            .point_size(3),
        )?
        .label("p95 TTFT (right)")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], red.stroke_width(2)));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
