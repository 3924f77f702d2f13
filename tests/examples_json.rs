//! The examples' JSON convention (`examples/common/mod.rs`): NaN and infinities are written as
//! `null` beside a `<field>_non_finite` field naming them, so `--json` output stays valid JSON.
//! The tests live beside the code in that module; this file makes `cargo test` run them.

#[path = "../examples/common/mod.rs"]
#[allow(dead_code)] // `print` is for the examples
mod common;
