//! Timing GPU work: device timestamps around every compute pass where the adapter has
//! `TIMESTAMP_QUERY`, the wall clock around a queue sync otherwise.

use std::sync::Mutex;
use web_time::Instant;

use super::Context;
use crate::{Error, Result};

/// Compute passes one [`Context::timed`] call can time with timestamps (two queries each); a
/// call that records more falls back to the wall clock.
const MAX_TIMED_PASSES: u32 = 1024;

/// Timestamp queries of the passes recorded while [`Context::timed`] runs.
#[derive(Default)]
pub(crate) struct PassClock {
    recorder: Mutex<Option<Recorder>>,
}

struct Recorder {
    set: wgpu::QuerySet,
    next: u32,
    /// Each timed pass's label, in recording order.
    labels: Vec<String>,
}

/// One compute pass timed by [`Context::timed_passes`]: its label and how long it ran.
#[derive(Debug, Clone, PartialEq)]
pub struct PassTime {
    /// The label the pass was begun with (empty for none).
    pub label: String,
    /// Seconds from the pass's start to its end (device timestamps).
    pub seconds: f64,
}

/// How long some GPU work took, and how that was measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Seconds from the start of the first compute pass to the end of the last (timestamps),
    /// or from the call to the queue being idle again (wall clock).
    pub seconds: f64,
    /// Whether `seconds` comes from device timestamps.
    pub timestamps: bool,
    /// Compute passes recorded (0 on the wall clock).
    pub passes: u32,
    /// Seconds the passes themselves ran (the sum of each pass's start-to-end time, gaps
    /// between submissions left out) with timestamps; `seconds` on the wall clock.
    pub busy_seconds: f64,
}

impl Context {
    /// Begins a compute pass on `encoder`; while [`Context::timed`] runs, the pass writes
    /// timestamps at its start and end. Every kernel records its passes through this.
    pub(crate) fn begin_compute_pass<'e>(
        &self,
        encoder: &'e mut wgpu::CommandEncoder,
        label: Option<&str>,
    ) -> wgpu::ComputePass<'e> {
        let mut guard = self
            .clock
            .recorder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let writes = guard.as_mut().and_then(|r| {
            let at = r.next;
            r.next += 2;
            let fits = at + 2 <= 2 * MAX_TIMED_PASSES;
            if fits {
                r.labels.push(label.unwrap_or_default().to_owned());
            }
            fits.then(|| (r.set.clone(), at))
        });
        drop(guard);
        match writes {
            Some((set, at)) => encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label,
                timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                    query_set: &set,
                    beginning_of_pass_write_index: Some(at),
                    end_of_pass_write_index: Some(at + 1),
                }),
            }),
            None => encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label,
                timestamp_writes: None,
            }),
        }
    }

    /// Runs `f` (which submits GPU work through this context) after the queue is idle, waits
    /// for its work and says how long the work took: with device timestamps from the first
    /// compute pass to the end of the last where the adapter has them and `f` recorded at most
    /// 1,024 passes, else on the wall clock around `f` and the queue sync.
    ///
    /// The recorder is the context's: passes other threads record on the same context while
    /// `f` runs are timed with it.
    ///
    /// # Errors
    /// What `f` returns, and [`Error::Wgpu`] (or [`Error::OutOfMemory`], [`Error::DeviceLost`])
    /// when creating the queries, waiting or reading the timestamps fails.
    pub fn timed<T>(&self, f: impl FnOnce() -> Result<T>) -> Result<(T, Timing)> {
        self.timed_passes(f)
            .map(|(value, timing, _)| (value, timing))
    }

    /// [`timed`](Self::timed), with each compute pass's own time and label in recording order
    /// when the timing comes from device timestamps (empty on the wall clock). A profile of
    /// where the time goes: record the parts to tell apart in passes of their own, labelled.
    ///
    /// # Errors
    /// As [`timed`](Self::timed).
    pub fn timed_passes<T>(
        &self,
        f: impl FnOnce() -> Result<T>,
    ) -> Result<(T, Timing, Vec<PassTime>)> {
        self.wait()?;
        if self.caps().timestamps {
            let set = self.scoped("timestamp queries", || {
                self.device.create_query_set(&wgpu::QuerySetDescriptor {
                    label: Some("kvattn timing"),
                    ty: wgpu::QueryType::Timestamp,
                    count: 2 * MAX_TIMED_PASSES,
                })
            })?;
            *self.lock_clock() = Some(Recorder {
                set,
                next: 0,
                labels: Vec::new(),
            });
        }
        let start = Instant::now();
        let value = f();
        let waited = self.wait();
        let wall = start.elapsed().as_secs_f64();
        let recorder = self.lock_clock().take();
        let value = value?;
        waited?;
        let wall_clock = Timing {
            seconds: wall,
            timestamps: false,
            passes: 0,
            busy_seconds: wall,
        };
        let Some(recorder) = recorder else {
            return Ok((value, wall_clock, Vec::new()));
        };
        let queries = recorder.next;
        if queries == 0 || queries > 2 * MAX_TIMED_PASSES {
            return Ok((value, wall_clock, Vec::new()));
        }
        let (span, spans) = self.timestamp_span(&recorder.set, queries)?;
        let passes: Vec<PassTime> = recorder
            .labels
            .into_iter()
            .zip(spans)
            .map(|(label, seconds)| PassTime { label, seconds })
            .collect();
        Ok((
            value,
            Timing {
                seconds: span,
                timestamps: true,
                passes: queries / 2,
                busy_seconds: passes.iter().map(|p| p.seconds).sum(),
            },
            passes,
        ))
    }

    fn lock_clock(&self) -> std::sync::MutexGuard<'_, Option<Recorder>> {
        self.clock
            .recorder
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Seconds from the earliest to the latest of the first `queries` timestamps of `set`, and
    /// each pass's own span.
    fn timestamp_span(&self, set: &wgpu::QuerySet, queries: u32) -> Result<(f64, Vec<f64>)> {
        let bytes = u64::from(queries) * wgpu::QUERY_SIZE as u64;
        let resolve = self.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kvattn timestamps"),
            size: bytes,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        })?;
        let mut encoder = self.encoder("resolving timestamps");
        encoder.resolve_query_set(set, 0..queries, &resolve, 0);
        self.submit("resolving timestamps", encoder)?;
        let words: Vec<u32> = self.read_back(&resolve, 2 * queries as usize)?;
        let ticks: Vec<u64> = words
            .chunks_exact(2)
            .map(|w| u64::from(w[0]) | (u64::from(w[1]) << 32))
            .collect();
        let first = ticks.iter().step_by(2).copied().min().unwrap_or(0);
        let last = ticks.iter().skip(1).step_by(2).copied().max().unwrap_or(0);
        if last < first {
            return Err(Error::Gpu(format!(
                "timestamps run backwards ({first} to {last})"
            )));
        }
        let period_ns = f64::from(self.queue.get_timestamp_period());
        let spans = ticks
            .chunks_exact(2)
            .map(|p| p[1].saturating_sub(p[0]) as f64 * period_ns * 1e-9)
            .collect();
        Ok(((last - first) as f64 * period_ns * 1e-9, spans))
    }
}
