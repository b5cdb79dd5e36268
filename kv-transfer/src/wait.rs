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

/// How long kv-transfer's threads poll before they sleep: a UCX progress thread after its last activity,
/// the shipping thread between layers, a thread waiting for a reply, a completion or a buffer ([`spin_until`]).
/// Waking a sleeping thread costs tens of microseconds, on a virtual machine sometimes hundreds (the idle vCPU
/// halts). On the H200 pair (32 cores) 200 us of polling left most handshakes to cold threads: a scattered
/// 8K-token request took 1.39-1.60 ms with it and 1.27-1.37 with 1-3 ms, a 32K one 4.81-5.04 against
/// 4.60-4.70 (bench/RESULTS.md, "Fixed costs of a request").
const SPIN: Duration = Duration::from_micros(2000);
/// The same on machines of at most [`FEW_CORES`] cores, where a polling thread takes the core another
/// thread (often the peer process's) needs: on the 2-core VM handshake + completion took a median
/// 520 us with 200 us of polling and 320 us with 50 us.
const SPIN_FEW_CORES: Duration = Duration::from_micros(50);
const FEW_CORES: usize = 4;
/// The longest window `TANDEM_KV_SPIN_US` may ask for.
const SPIN_MAX_US: u64 = 1_000_000;

/// The polling window ([`SPIN`]); `TANDEM_KV_SPIN_US` overrides it (microseconds, at most one second;
/// read once, a value that is not a number is reported and ignored).
pub fn spin_time() -> Duration {
    static V: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *V.get_or_init(|| {
        if let Ok(v) = std::env::var("TANDEM_KV_SPIN_US") {
            match v.trim().parse::<u64>() {
                Ok(us) => return Duration::from_micros(us.min(SPIN_MAX_US)),
                Err(_) => tracing::warn!(value = %v, "TANDEM_KV_SPIN_US is not a number of microseconds; ignored"),
            }
        }
        if cores() <= FEW_CORES { SPIN_FEW_CORES } else { SPIN }
    })
}

fn cores() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// Threads polling in [`spin_until`] or [`Cell::wait_until`] now. Those waits run on the callers' threads
/// (a prefill worker settles each request on a thread of its own), so many requests finishing together
/// must not turn into as many polling cores: past [`spinners_max`] a wait sleeps at once.
static SPINNERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A quarter of the cores, at least one.
fn spinners_max() -> usize {
    (cores() / 4).max(1)
}

/// Counts one polling thread while alive; `None` when [`spinners_max`] threads poll already.
struct SpinTicket;

impl SpinTicket {
    fn take() -> Option<SpinTicket> {
        let n = SPINNERS.fetch_add(1, Ordering::AcqRel);
        if n >= spinners_max() {
            SPINNERS.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        Some(SpinTicket)
    }
}

impl Drop for SpinTicket {
    fn drop(&mut self) {
        SPINNERS.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Polls `ready` for up to [`spin_time`] (or until `deadline`); whether it became true. Blocking waits call
/// it before they sleep on their condition variable. Where [`spinners_max`] threads poll already, it looks
/// once.
pub fn spin_until(deadline: Instant, mut ready: impl FnMut() -> bool) -> bool {
    let Some(_ticket) = SpinTicket::take() else { return ready() };
    let until = (Instant::now() + spin_time()).min(deadline);
    loop {
        if ready() {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        for _ in 0..32 {
            std::hint::spin_loop();
        }
    }
}

/// Receives from `rx`, polling for [`spin_time`] before it blocks.
pub fn recv_spinning<T>(rx: &std::sync::mpsc::Receiver<T>) -> Result<T, std::sync::mpsc::RecvError> {
    let until = Instant::now() + spin_time();
    loop {
        match rx.try_recv() {
            Ok(v) => return Ok(v),
            Err(std::sync::mpsc::TryRecvError::Disconnected) => return Err(std::sync::mpsc::RecvError),
            Err(std::sync::mpsc::TryRecvError::Empty) if Instant::now() < until => std::hint::spin_loop(),
            Err(std::sync::mpsc::TryRecvError::Empty) => return rx.recv(),
        }
    }
}

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
        spin_until(deadline, || self.ready.load(Ordering::Acquire));
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

    #[test]
    fn polling_sees_a_condition_and_gives_up_at_its_window() {
        let far = Instant::now() + Duration::from_secs(60);
        assert!(spin_until(far, || true));
        let t0 = Instant::now();
        assert!(!spin_until(far, || false));
        // It polls for the window (2 ms, or 50 us on few cores), never towards the far deadline.
        assert!(t0.elapsed() < spin_time() + Duration::from_millis(500), "{:?}", t0.elapsed());
        assert!(!spin_until(Instant::now(), || false));
    }

    #[test]
    fn polling_threads_are_bounded() {
        // As if far more threads than the bound polled (other tests' waits may hold tickets too): no
        // ticket, and a wait looks once instead of polling.
        SPINNERS.fetch_add(1 << 20, Ordering::AcqRel);
        let refused = SpinTicket::take().is_none();
        let mut looks = 0;
        let seen = spin_until(Instant::now() + Duration::from_secs(60), || {
            looks += 1;
            false
        });
        SPINNERS.fetch_sub(1 << 20, Ordering::AcqRel);
        assert!(refused);
        assert!(!seen);
        assert_eq!(looks, 1);
    }

    #[test]
    fn receiving_polls_then_blocks() {
        let (tx, rx) = std::sync::mpsc::channel();
        tx.send(1).unwrap();
        assert_eq!(recv_spinning(&rx), Ok(1));
        // Sent after the polling window: received by the blocking receive.
        let tx2 = tx.clone();
        std::thread::spawn(move || {
            std::thread::sleep(spin_time() + Duration::from_millis(20));
            tx2.send(2).unwrap();
        });
        assert_eq!(recv_spinning(&rx), Ok(2));
        drop(tx);
        assert!(recv_spinning(&rx).is_err(), "every sender gone");
    }
}
