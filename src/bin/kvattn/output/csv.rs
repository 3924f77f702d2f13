//! CSV of result rows: a header line of column names, then one line per row.

use super::Column;

/// A header line and one line per row; non-finite floats are empty cells, and a cell holding a
/// comma, a quote or a line break is quoted (RFC 4180).
pub fn rows<R>(rows: &[R], columns: &[Column<R>]) -> String {
    let names: Vec<String> = columns.iter().map(|c| quote(c.0)).collect();
    let mut out = names.join(",");
    out.push('\n');
    for r in rows {
        let cells: Vec<String> = columns
            .iter()
            .map(|(_, get)| quote(&get(r).csv()))
            .collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

/// `cell`, in double quotes (its quotes doubled) when it holds a comma, a quote or a line
/// break.
fn quote(cell: &str) -> String {
    if cell.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", cell.replace('"', "\"\""))
    } else {
        cell.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Value;
    use super::*;

    #[test]
    fn header_cells_and_quoting() {
        let columns: [Column<(u64, f64, &'static str)>; 3] = [
            ("n", |r| Value::Int(r.0)),
            ("x", |r| Value::Float(r.1)),
            ("name", |r| Value::Text(r.2)),
        ];
        let text = rows(&[(1, 0.5, "a"), (2, f64::NAN, "b,\"c\"")], &columns);
        assert_eq!(text, "n,x,name\n1,0.5,a\n2,,\"b,\"\"c\"\"\"\n");
    }
}
