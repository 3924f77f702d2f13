//! A result table's rows as JSON and CSV, from one list of named columns (`kvattn bench` and
//! `kvattn serve-bench`).

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
    /// The cell as a JSON value.
    pub fn json(&self) -> String {
        match self {
            Value::Int(v) => v.to_string(),
            Value::Float(v) => {
                serde_json::to_string(&serde_json::json!(v)).expect("JSON of a number")
            }
            Value::Text(s) => serde_json::json!(s).to_string(),
            Value::Owned(s) => serde_json::json!(s).to_string(),
            Value::Bool(b) => b.to_string(),
        }
    }

    /// The cell as CSV text.
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

/// A column: its name (JSON key, CSV header) and how a row gives its cell.
pub type Column<R> = (&'static str, fn(&R) -> Value);

/// One JSON array, one object per row, keys in column order.
pub fn json<R>(rows: &[R], columns: &[Column<R>]) -> String {
    let objects: Vec<String> = rows
        .iter()
        .map(|r| {
            let fields: Vec<String> = columns
                .iter()
                .map(|(name, get)| format!("\"{name}\": {}", get(r).json()))
                .collect();
            format!("  {{{}}}", fields.join(", "))
        })
        .collect();
    if objects.is_empty() {
        return "[]\n".into();
    }
    format!("[\n{}\n]\n", objects.join(",\n"))
}

/// A header line and one line per row.
pub fn csv<R>(rows: &[R], columns: &[Column<R>]) -> String {
    let names: Vec<&str> = columns.iter().map(|c| c.0).collect();
    let mut out = names.join(",");
    out.push('\n');
    for r in rows {
        let cells: Vec<String> = columns.iter().map(|(_, get)| get(r).csv()).collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}
