//! One thread at a time inside the device on GL.
//!
//! wgpu's GL backend guards its one GL context with a lock that it waits on for at most a few
//! seconds (six on EGL, one on WGL) and then panics ("Could not lock adapter context"). That
//! lock is held for the whole of a shader compilation, a submission (which a CPU driver such as
//! llvmpipe executes before returning) or a wait for the GPU, so a few threads sharing one
//! context on a slow adapter can make one of them panic although nothing is wrong. On GL a
//! [`Context`](super::Context) therefore lets one thread at a time into the device calls it
//! makes (creating buffers, bind groups, shader modules and pipelines; writes, submissions and
//! polls): the others queue here, without a timeout. The gate is re-entrant, so a call made
//! while the same thread holds it does not wait for itself. Other backends have no such lock
//! and pass straight through.

use std::sync::{Condvar, Mutex, PoisonError};
use std::thread::ThreadId;

/// The gate (see the module docs); `enabled` on GL only.
#[derive(Debug, Default)]
pub(crate) struct DeviceSerial {
    enabled: bool,
    /// The thread inside and how many times it entered.
    owner: Mutex<(Option<ThreadId>, u32)>,
    free: Condvar,
}

impl DeviceSerial {
    /// A gate that serializes when `enabled`, else lets every call through at once.
    pub(crate) fn new(enabled: bool) -> Self {
        Self {
            enabled,
            ..Self::default()
        }
    }

    /// Runs `f` with this thread alone inside the gate (at once when the gate is disabled or
    /// this thread is already inside).
    pub(crate) fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        let _turn = self.enabled.then(|| self.enter());
        f()
    }

    fn enter(&self) -> Turn<'_> {
        let me = std::thread::current().id();
        let mut state = self.owner.lock().unwrap_or_else(PoisonError::into_inner);
        while state.0.is_some_and(|owner| owner != me) {
            state = self
                .free
                .wait(state)
                .unwrap_or_else(PoisonError::into_inner);
        }
        state.0 = Some(me);
        state.1 += 1;
        Turn { serial: self }
    }
}

/// One entry into the gate; leaving (also by unwinding) lets the next thread in.
struct Turn<'a> {
    serial: &'a DeviceSerial,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let mut state = self
            .serial
            .owner
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        state.1 -= 1;
        if state.1 == 0 {
            state.0 = None;
            self.serial.free.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DeviceSerial;
    use std::sync::atomic::{AtomicU32, Ordering};

    /// Four threads entering an enabled gate (once directly and once nested) are never inside
    /// together; a disabled gate lets them overlap.
    fn most_inside_at_once(enabled: bool) -> u32 {
        let serial = DeviceSerial::new(enabled);
        let (inside, most) = (AtomicU32::new(0), AtomicU32::new(0));
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| {
                    for _ in 0..20 {
                        serial.run(|| {
                            serial.run(|| {
                                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                                most.fetch_max(now, Ordering::SeqCst);
                                std::thread::sleep(std::time::Duration::from_millis(2));
                                inside.fetch_sub(1, Ordering::SeqCst);
                            })
                        });
                    }
                });
            }
        });
        most.into_inner()
    }

    #[test]
    fn an_enabled_gate_lets_one_thread_in_and_is_reentrant() {
        assert_eq!(most_inside_at_once(true), 1);
    }

    #[test]
    fn a_disabled_gate_lets_threads_overlap() {
        assert!(most_inside_at_once(false) > 1);
    }

    #[test]
    fn a_panic_inside_releases_the_gate() {
        let serial = DeviceSerial::new(true);
        std::thread::scope(|s| {
            let panicked = s.spawn(|| serial.run(|| panic!("inside"))).join();
            assert!(panicked.is_err());
            assert_eq!(s.spawn(|| serial.run(|| 7)).join().ok(), Some(7));
        });
    }
}
