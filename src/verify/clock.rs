//! The crate's one time source: verification times its cases with it and the pipeline cache
//! times compilation with it.
//!
//! `std::time::Instant` panics on `wasm32-unknown-unknown`, so the clock is `web-time`'s
//! `Instant`: std's on native targets, `performance.now()` in the browser.

/// A started clock.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stopwatch(web_time::Instant);

impl Stopwatch {
    /// Starts a clock now.
    pub(crate) fn start() -> Self {
        Self(web_time::Instant::now())
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
