//! The rule for metadata that lives across steps: one update per submission.
//!
//! A plan's `update` writes the next step's metadata with [`Context::write_buffer`], and such
//! writes land when the queue's next submission starts. Two steps recorded into one submission
//! would therefore both read the second step's metadata. kvattn refuses that instead of
//! computing it: after a plan has been recorded, its next `update` needs a submission through
//! [`Context::submit`] (or a wrapper that submits) in between.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use super::Context;
use crate::{Error, Result};

/// Tracks one plan's updates against the context's submissions (see the module docs).
#[derive(Debug, Default)]
pub struct UpdateGate {
    /// The context's submission count when the plan was last updated.
    updated_at: AtomicU64,
    /// Whether the plan was recorded since that update.
    recorded: AtomicBool,
    /// Whether the plan has been updated at all.
    ready: AtomicBool,
}

impl UpdateGate {
    /// Checks that `what` may be updated now: [`Error::InvalidArgument`] when it was recorded
    /// since its last update and no submission followed (nothing is written then).
    pub fn check_update(&self, ctx: &Context, what: &str) -> Result<()> {
        if !self.may_update(ctx) {
            return Err(Error::InvalidArgument(format!(
                "{what} was updated twice without a submission in between: the writes of an \
                 update land at the next submission, so the work recorded after the first update \
                 would read the second; submit (Context::submit) before updating again"
            )));
        }
        Ok(())
    }

    /// Whether an update is allowed now: not recorded since the last update, or a submission
    /// has followed.
    pub fn may_update(&self, ctx: &Context) -> bool {
        !self.recorded.load(Ordering::Acquire)
            || ctx.counters().submissions != self.updated_at.load(Ordering::Acquire)
    }

    /// Notes a successful update.
    pub fn updated(&self, ctx: &Context) {
        self.updated_at
            .store(ctx.counters().submissions, Ordering::Release);
        self.recorded.store(false, Ordering::Release);
        self.ready.store(true, Ordering::Release);
    }

    /// Checks that `what` has been updated once (so it has metadata to record) and notes that
    /// it is being recorded.
    pub fn record(&self, what: &str) -> Result<()> {
        if !self.ready.load(Ordering::Acquire) {
            return Err(Error::InvalidArgument(format!(
                "{what} has not been updated with a batch yet"
            )));
        }
        self.recorded.store(true, Ordering::Release);
        Ok(())
    }
}
