//! A one-shot value that both threads (with a deadline) and async tasks can wait for. Transports complete
//! replies and flushes from their own threads; the sender waits on the compute thread, the decode worker
//! awaits in its runtime.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

pub struct Cell<T> {
    state: Mutex<State<T>>,
    cv: Condvar,
    /// Mirrors `State::set` for waiters that spin before sleeping.
    ready: AtomicBool,
}

/// How long a thread waiting on a cell polls before it sleeps on the condition variable: replies on
/// loopback arrive within tens of microseconds, and a futex wake-up costs about as much again.
const SPIN: Duration = Duration::from_micros(50);

struct State<T> {
    value: Option<T>,
    set: bool,
    waker: Option<Waker>,
}

impl<T> Cell<T> {
    pub fn new() -> Arc<Self> {
        Arc::new(Cell {
            state: Mutex::new(State { value: None, set: false, waker: None }),
            cv: Condvar::new(),
            ready: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State<T>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Stores the value; only the first call counts. Returns whether this call stored it.
    pub fn set(&self, v: T) -> bool {
        let waker = {
            let mut s = self.lock();
            if s.set {
                return false;
            }
            s.set = true;
            s.value = Some(v);
            self.ready.store(true, Ordering::Release);
            s.waker.take()
        };
        self.cv.notify_all();
        if let Some(w) = waker {
            w.wake();
        }
        true
    }

    pub fn is_set(&self) -> bool {
        self.lock().set
    }

    /// Takes the value, waiting until `deadline`. `None` on timeout (or when already taken).
    pub fn wait_until(&self, deadline: Instant) -> Option<T> {
        let spin_until = Instant::now() + SPIN;
        while !self.ready.load(Ordering::Acquire) && Instant::now() < spin_until.min(deadline) {
            std::hint::spin_loop();
        }
        let mut s = self.lock();
        loop {
            if s.set {
                return s.value.take();
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            s = self.cv.wait_timeout(s, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    pub fn poll_take(&self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let mut s = self.lock();
        if s.set {
            return Poll::Ready(s.value.take());
        }
        s.waker = Some(cx.waker().clone());
        Poll::Pending
    }
}

/// Awaits a [`Cell`].
pub struct CellFuture<T>(pub Arc<Cell<T>>);

impl<T> Future for CellFuture<T> {
    type Output = Option<T>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<T>> {
        self.0.poll_take(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn first_set_wins_and_waiters_time_out() {
        let c = Cell::new();
        assert_eq!(c.wait_until(Instant::now() + Duration::from_millis(20)), None);
        assert!(c.set(1));
        assert!(!c.set(2));
        assert_eq!(c.wait_until(Instant::now()), Some(1));
    }

    #[test]
    fn a_thread_wakes_the_waiter() {
        let c = Cell::new();
        let c2 = c.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            c2.set("x");
        });
        assert_eq!(c.wait_until(Instant::now() + Duration::from_secs(5)), Some("x"));
    }
}
