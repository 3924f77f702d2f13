//! What the SVG charts share (`kvattn serve-bench --svg`, `kvattn bench --plot`): a document on
//! a white background drawn with `plotters`' SVG backend, an x axis on a log2 scale labelled
//! with powers of two, y axes with head room, lines with points and their legend.

use std::ops::Range;

use plotters::coord::Shift;
use plotters::prelude::*;

/// What a drawing step may fail with.
pub type DrawResult = Result<(), Box<dyn std::error::Error>>;

/// Line colours, one per series in turn.
pub const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(255, 127, 14),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(23, 190, 207),
];

/// One SVG document of `size` pixels: a white background, then what `draw` draws.
pub fn document<F>(size: (u32, u32), draw: F) -> Result<String, String>
where
    F: FnOnce(&DrawingArea<SVGBackend<'_>, Shift>) -> DrawResult,
{
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, size).into_drawing_area();
        let drawn: DrawResult = (|| {
            root.fill(&WHITE)?;
            draw(&root)?;
            root.present()?;
            Ok(())
        })();
        drawn.map_err(|e| e.to_string())?;
    }
    Ok(out)
}

/// The top of an axis holding `values`: 10% above the largest finite one, 1 when there is
/// none.
pub fn top(values: impl Iterator<Item = f64>) -> f64 {
    let m = values.filter(|v| v.is_finite()).fold(0.0, f64::max);
    if m > 0.0 {
        m * 1.1
    } else {
        1.0
    }
}

/// An x axis on a log2 scale: the log2 of the smallest and largest values.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Log2Axis {
    /// log2 of the smallest value (0 without values).
    pub lo: f64,
    /// log2 of the largest value (1 without values).
    pub hi: f64,
}

impl Log2Axis {
    /// The axis holding `values` (positive counts).
    pub fn new(values: impl Iterator<Item = f64>) -> Self {
        let (lo, hi) = values
            .map(f64::log2)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), x| {
                (lo.min(x), hi.max(x))
            });
        if lo.is_finite() && hi.is_finite() {
            Self { lo, hi }
        } else {
            Self { lo: 0.0, hi: 1.0 }
        }
    }

    /// The drawn range: a quarter step of margin on each side.
    pub fn range(&self) -> Range<f64> {
        (self.lo - 0.25)..(self.hi + 0.25)
    }

    /// How many labels: one per power of two, at least two.
    pub fn labels(&self) -> usize {
        ((self.hi - self.lo).round() as usize + 1).max(2)
    }
}

/// `2^x` as an axis label: an integer at integer `x`.
pub fn pow2_label(x: &f64) -> String {
    let v = x.exp2();
    if (v - v.round()).abs() < 1e-6 {
        format!("{}", v.round())
    } else {
        format!("{v:.1}")
    }
}

/// A line of `color` through `points`, 2 px wide with a 3 px dot at each point.
pub fn line<'a>(
    points: impl IntoIterator<Item = (f64, f64)>,
    color: RGBColor,
) -> LineSeries<SVGBackend<'a>, (f64, f64)> {
    LineSeries::new(points, color.stroke_width(2)).point_size(3)
}

/// The legend mark of a [`line()`] of `color`.
pub fn mark(color: RGBColor) -> impl Fn((i32, i32)) -> PathElement<(i32, i32)> {
    move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
}

/// Draws the legend of `chart`'s labelled series in its upper left corner.
pub fn legend<'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
) -> DrawResult {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log2_axis_and_labels() {
        let a = Log2Axis::new([1.0, 4.0, 64.0].into_iter());
        assert_eq!((a.lo, a.hi), (0.0, 6.0));
        assert_eq!(a.labels(), 7);
        assert_eq!(
            Log2Axis::new(std::iter::empty()),
            Log2Axis { lo: 0.0, hi: 1.0 }
        );
        assert_eq!(pow2_label(&3.0), "8");
        assert_eq!(pow2_label(&0.5), "1.4");
        assert_eq!(top([2.0, f64::NAN].into_iter()), 2.2);
        assert_eq!(top(std::iter::empty()), 1.0);
    }
}
