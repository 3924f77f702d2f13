//! Serving under load: a continuous-batching scheduler over the decoder and the paged cache,
//! with admission control, preemption (swap or recompute) and prefix caching
//! ([`scheduler`]), and the statistics of a run ([`stats`]).

pub mod scheduler;
pub mod stats;

pub use scheduler::{Counters, Finished, Preemption, Request, Scheduler, SchedulerConfig};
pub use stats::RunStats;
