//! Tables of text cells for the terminal: columns as wide as their widest cell, each left- or
//! right-aligned, as plain text (`kvattn serve-bench`, `kvattn verify`) or Markdown (`kvattn
//! bench`).

/// How a column's cells line up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    /// Text: padded on the right.
    Left,
    /// Numbers: padded on the left.
    Right,
}

/// A header and rows of text cells.
pub struct Table {
    head: Vec<String>,
    align: Vec<Align>,
    min_width: Vec<usize>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// A table with these columns (header text and alignment) and no rows.
    pub fn new<S: Into<String>>(columns: impl IntoIterator<Item = (S, Align)>) -> Self {
        let (head, align): (Vec<String>, Vec<Align>) =
            columns.into_iter().map(|(h, a)| (h.into(), a)).unzip();
        let min_width = vec![0; head.len()];
        Self {
            head,
            align,
            min_width,
            rows: Vec::new(),
        }
    }

    /// Column `column` at least `width` characters wide, whatever its cells.
    // For the tables of `verify` and `verify --quality`, which pad some columns to a width.
    #[allow(dead_code)]
    pub fn min_width(mut self, column: usize, width: usize) -> Self {
        if let Some(w) = self.min_width.get_mut(column) {
            *w = width;
        }
        self
    }

    /// Adds a row: one cell per column (missing cells are empty, extra cells dropped).
    pub fn push(&mut self, mut cells: Vec<String>) {
        cells.resize(self.head.len(), String::new());
        self.rows.push(cells);
    }

    /// Each column's width in characters: its widest cell, header included.
    fn widths(&self) -> Vec<usize> {
        (0..self.head.len())
            .map(|i| {
                self.rows
                    .iter()
                    .chain(std::iter::once(&self.head))
                    .map(|r| r[i].chars().count())
                    .fold(self.min_width[i], usize::max)
            })
            .collect()
    }

    /// The cells of `row` padded to `widths` by their columns' alignment.
    fn padded(&self, row: &[String], widths: &[usize]) -> Vec<String> {
        row.iter()
            .zip(widths)
            .zip(&self.align)
            .map(|((c, &w), a)| match a {
                Align::Left => format!("{c:<w$}"),
                Align::Right => format!("{c:>w$}"),
            })
            .collect()
    }

    /// Plain text: the header and one line per row, cells joined by `sep`, no trailing spaces.
    pub fn text(&self, sep: &str) -> String {
        let widths = self.widths();
        let mut out = String::new();
        for row in std::iter::once(&self.head).chain(&self.rows) {
            out.push_str(self.padded(row, &widths).join(sep).trim_end());
            out.push('\n');
        }
        out
    }

    /// A Markdown table: `| a | b |` lines, the rule under the header ending in `:` for
    /// right-aligned columns.
    pub fn markdown(&self) -> String {
        let widths = self.widths();
        let line = |cells: Vec<String>| format!("| {} |\n", cells.join(" | "));
        let mut out = line(self.padded(&self.head, &widths));
        let rule: Vec<String> = widths
            .iter()
            .zip(&self.align)
            .map(|(&w, a)| match a {
                Align::Left => "-".repeat(w.max(1)),
                Align::Right => format!("{}:", "-".repeat(w.saturating_sub(1))),
            })
            .collect();
        out.push_str(&line(rule));
        for row in &self.rows {
            out.push_str(&line(self.padded(row, &widths)));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Table {
        let mut t = Table::new([("name", Align::Left), ("ms", Align::Right)]);
        t.push(vec!["decode".into(), "1.5".into()]);
        t.push(vec!["copy".into(), "12.25".into()]);
        t
    }

    #[test]
    fn plain_text_aligns_and_trims() {
        assert_eq!(
            sample().text("  "),
            "name       ms\ndecode    1.5\ncopy    12.25\n"
        );
        let mut t = Table::new([("n", Align::Right), ("result", Align::Left)]).min_width(0, 3);
        t.push(vec!["1".into(), "pass".into()]);
        assert_eq!(t.text("  "), "  n  result\n  1  pass\n");
    }

    #[test]
    fn markdown_rule_marks_right_alignment() {
        assert_eq!(
            sample().markdown(),
            "| name   |    ms |\n| ------ | ----: |\n| decode |   1.5 |\n| copy   | 12.25 |\n"
        );
    }
}
