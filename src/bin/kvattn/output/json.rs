//! JSON of result rows: one array with an object per line (`kvattn bench`, `kvattn
//! serve-bench`), or one indented object (`kvattn capacity`, `kvattn info`). Everything goes
//! through serde_json, which writes NaN and infinities as `null`: the output is always valid
//! JSON.

use std::io;

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;
use serde_json::ser::Formatter;

use super::Column;

/// serde_json's compact layout with a space after each `:` and `,`: `{"a": 1, "b": [2, 3]}`.
struct Spaced;

impl Formatter for Spaced {
    fn begin_array_value<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_key<W: ?Sized + io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

/// `value` as JSON on one line.
pub fn line<T: Serialize + ?Sized>(value: &T) -> String {
    let mut out = Vec::new();
    value
        .serialize(&mut serde_json::Serializer::with_formatter(
            &mut out, Spaced,
        ))
        // Writing to memory fails only for a map with non-string keys, which no row has.
        .expect("a row serializes to JSON");
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

/// One JSON array, one object per line: `[\n  {..},\n  {..}\n]\n`, or `[]\n` without rows.
pub fn array<T: Serialize>(rows: &[T]) -> String {
    if rows.is_empty() {
        return "[]\n".into();
    }
    let objects: Vec<String> = rows.iter().map(|r| format!("  {}", line(r))).collect();
    format!("[\n{}\n]\n", objects.join(",\n"))
}

/// [`array()`] of the rows as objects keyed by the columns' names, in column order.
pub fn columns<R>(rows: &[R], columns: &[Column<R>]) -> String {
    let objects: Vec<Keyed<'_, R>> = rows.iter().map(|row| Keyed { row, columns }).collect();
    array(&objects)
}

/// `value` indented over several lines (serde_json's pretty layout), with a final newline.
pub fn pretty(value: &serde_json::Value) -> String {
    format!("{value:#}\n")
}

/// A row seen through its columns: a map from column name to cell.
struct Keyed<'a, R> {
    row: &'a R,
    columns: &'a [Column<R>],
}

impl<R> Serialize for Keyed<'_, R> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.columns.len()))?;
        for (name, get) in self.columns {
            map.serialize_entry(name, &get(self.row))?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::super::Value;
    use super::*;

    #[test]
    fn one_object_per_line_and_nan_as_null() {
        let columns: [Column<(u64, f64, bool)>; 3] = [
            ("n", |r| Value::Int(r.0)),
            ("x", |r| Value::Float(r.1)),
            ("ok", |r| Value::Bool(r.2)),
        ];
        let text = super::columns(&[(1, 0.5, true), (2, f64::NAN, false)], &columns);
        assert_eq!(
            text,
            "[\n  {\"n\": 1, \"x\": 0.5, \"ok\": true},\n  {\"n\": 2, \"x\": null, \"ok\": false}\n]\n"
        );
        let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(parsed[1]["x"].is_null());
        assert_eq!(super::columns(&[], &columns), "[]\n");
        assert_eq!(line(&[1.0, f64::INFINITY]), "[1.0, null]");
    }
}
