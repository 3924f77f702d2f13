//! What the examples share: their `--json` output, kept valid JSON when a value is NaN or
//! infinite.
//!
//! JSON has no NaN and no infinity. The convention: a float field `x` whose value is not finite
//! is written `"x": null` beside `"x_non_finite": "NaN"` (or `"inf"`, `"-inf"`); a finite value
//! is a plain number with no companion field. A reader tells a missing measurement from a failed
//! one by the companion field. Floats reach the output only through [`Object::set`] (the
//! [`Field`] impl of `f64` is the one place the conversion happens), so no example can write a
//! float any other way.
//!
//! `tests/examples_json.rs` includes this file and runs its tests.

use serde_json::{Map, Value};

/// Ends the name of the field that says why a float field is null.
pub const NON_FINITE_SUFFIX: &str = "_non_finite";

/// A JSON object built field by field.
#[derive(Debug, Default)]
pub struct Object(Map<String, Value>);

impl Object {
    /// An empty object.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `key: value`; a non-finite float becomes `null` and a `key_non_finite` field.
    pub fn set(mut self, key: &str, value: impl Field) -> Self {
        debug_assert!(!self.0.contains_key(key), "field {key} set twice");
        value.insert_into(key, &mut self.0);
        self
    }
}

impl From<Object> for Value {
    fn from(o: Object) -> Value {
        Value::Object(o.0)
    }
}

/// A value an [`Object`] field can hold.
pub trait Field {
    /// Inserts `self` under `key` (and, for a non-finite float, its companion field).
    fn insert_into(self, key: &str, map: &mut Map<String, Value>);
}

impl Field for f64 {
    fn insert_into(self, key: &str, map: &mut Map<String, Value>) {
        match serde_json::Number::from_f64(self) {
            Some(n) => {
                map.insert(key.to_string(), Value::Number(n));
            }
            None => {
                let name = if self.is_nan() {
                    "NaN"
                } else if self > 0.0 {
                    "inf"
                } else {
                    "-inf"
                };
                map.insert(key.to_string(), Value::Null);
                map.insert(format!("{key}{NON_FINITE_SUFFIX}"), name.into());
            }
        }
    }
}

/// Types serde_json converts without loss (no floats: they go through the `f64` impl).
macro_rules! exact_fields {
    ($($t:ty),*) => {$(
        impl Field for $t {
            fn insert_into(self, key: &str, map: &mut Map<String, Value>) {
                map.insert(key.to_string(), self.into());
            }
        }
    )*};
}

exact_fields!(bool, u32, u64, usize, &str, String, Object, Vec<Object>);

/// Writes `value` as one line of JSON on stdout.
pub fn print(value: impl Into<Value>) {
    println!("{}", value.into());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text printed, parsed back: it must be valid JSON.
    fn round_trip(o: Object) -> Value {
        let text = Value::from(o).to_string();
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("invalid JSON {text}: {e}"))
    }

    #[test]
    fn finite_floats_are_numbers_without_a_companion() {
        let v = round_trip(Object::new().set("err", 1.5e-7).set("zero", -0.0));
        assert_eq!(v["err"].as_f64(), Some(1.5e-7));
        assert_eq!(v["zero"].as_f64(), Some(0.0));
        assert_eq!(v.as_object().map(|m| m.len()), Some(2), "{v}");
    }

    #[test]
    fn non_finite_floats_are_null_with_a_field_naming_them() {
        let v = round_trip(
            Object::new()
                .set("nan", f64::NAN)
                .set("up", f64::INFINITY)
                .set("down", f64::NEG_INFINITY)
                .set("ok", 2.0),
        );
        for (key, name) in [("nan", "NaN"), ("up", "inf"), ("down", "-inf")] {
            assert!(v[key].is_null(), "{key} in {v}");
            assert_eq!(v[format!("{key}{NON_FINITE_SUFFIX}")], name, "{v}");
        }
        assert_eq!(v["ok"].as_f64(), Some(2.0));
        assert!(v.get("ok_non_finite").is_none(), "{v}");
    }

    #[test]
    fn nested_objects_and_arrays_keep_the_convention() {
        let rows = vec![
            Object::new().set("name", "a").set("x", f64::NAN),
            Object::new().set("name", "b").set("x", 1.0),
        ];
        let v = round_trip(
            Object::new()
                .set("rows", rows)
                .set("inner", Object::new().set("y", f64::INFINITY))
                .set("count", 2usize)
                .set("ok", true),
        );
        assert!(v["rows"][0]["x"].is_null());
        assert_eq!(v["rows"][0]["x_non_finite"], "NaN");
        assert_eq!(v["rows"][1]["x"].as_f64(), Some(1.0));
        assert_eq!(v["inner"]["y_non_finite"], "inf");
        assert_eq!(v["count"], 2);
        assert_eq!(v["ok"], true);
    }
}
