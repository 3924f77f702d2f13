//! The command line's printing in one place: aligned text and Markdown tables ([`table`]), CSV
//! ([`csv`]) and JSON ([`json`]) of result rows, and the parts the SVG charts share ([`svg`]).
//!
//! A result table is described once, as a list of named [`Column`]s: the CSV header and the
//! JSON keys are the column names, in order. Rows whose library type is `Serialize` (the bench
//! rows) go to JSON through serde instead.

pub mod csv;
pub mod json;
pub mod svg;
pub mod table;

/// One cell of a machine-readable row.
#[derive(Clone)]
pub enum Value {
    /// A count.
    Int(u64),
    /// A measurement (non-finite: empty in CSV, `null` in JSON).
    Float(f64),
    /// A name.
    Text(&'static str),
    /// A name built at run time.
    Owned(String),
    /// A flag.
    Bool(bool),
}

impl Value {
    /// The cell as CSV text (unquoted; [`csv::rows`] quotes where needed).
    pub fn csv(&self) -> String {
        match self {
            Value::Int(v) => v.to_string(),
            Value::Float(v) if !v.is_finite() => String::new(),
            Value::Float(v) => format!("{v}"),
            Value::Text(s) => s.to_string(),
            Value::Owned(s) => s.clone(),
            Value::Bool(b) => b.to_string(),
        }
    }
}

impl serde::Serialize for Value {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Value::Int(v) => s.serialize_u64(*v),
            // serde_json writes NaN and infinities as `null`.
            Value::Float(v) => s.serialize_f64(*v),
            Value::Text(v) => s.serialize_str(v),
            Value::Owned(v) => s.serialize_str(v),
            Value::Bool(v) => s.serialize_bool(*v),
        }
    }
}

/// A column: its name (JSON key, CSV header) and how a row gives its cell.
pub type Column<R> = (&'static str, fn(&R) -> Value);
