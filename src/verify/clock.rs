//! The crate's one time source: verification times its cases with it and the pipeline cache
//! times compilation with it.
//!
//! `std::time::Instant` panics on `wasm32-unknown-unknown`; a web build swaps the body of
//! [`Stopwatch`] here (for example for `performance.now()`), and nothing else changes.

/// A started clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stopwatch(std::time::Instant);

impl Stopwatch {
    /// Starts a clock now.
    pub(crate) fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// Seconds since [`Stopwatch::start`].
    pub(crate) fn seconds(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }

    /// Nanoseconds since [`Stopwatch::start`] (saturating).
    pub(crate) fn nanos(&self) -> u64 {
        u64::try_from(self.0.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }
}
