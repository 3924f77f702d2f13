//! Benchmarks: the adapter's ceilings (copy bandwidth and arithmetic rate), the cases
//! `kvattn bench` and the criterion benches time, and the roofline they are judged by
//! (ARCHITECTURE.md section 13).
pub mod bandwidth;
pub mod cases;
pub mod ceilings;
pub mod fma_rate;

pub use ceilings::{measure_ceilings, CeilingOptions, Ceilings, Trial};
