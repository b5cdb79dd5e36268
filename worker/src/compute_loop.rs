//! The compute thread both roles run (compute never runs on the async runtime): commands in (new work,
//! aborts, events from helper threads), one turn of work at a time, a blocking wait when nothing can
//! progress, load published while idle. The roles plug in a [`Batcher`]: the prefill batcher (chunked
//! prefill, prefix cache, kv-transfer) and the decode batcher (continuous batching, MTP, preemption).
//!
//! Under expert parallelism ([`engine::Backend::expert_parallel`]) the ranks of a group step in lockstep:
//! the loop ends every turn of a batcher that names its backend ([`Batcher::lockstep`]) with
//! [`engine::Backend::end_step`] (an idle rank joins the others' passes with an empty batch), a turn is
//! busy while any rank had rows, and an idle loop polls every [`LOCKSTEP_POLL`] so that a rank that gets
//! work finds the others at its first step within that time.

use std::sync::mpsc;
use std::time::Duration;

use engine::cache::BlockPool;

/// How long an idle loop sleeps before publishing its load again.
pub const IDLE_WAIT: Duration = Duration::from_millis(200);

/// How long an idle rank of an expert-parallel group waits before it joins the group's next step (every
/// rank idle: one small all-reduce per pass of the step).
pub const LOCKSTEP_POLL: Duration = Duration::from_millis(2);

/// What a turn left behind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Turn {
    /// There is more to do right away.
    Busy,
    /// Nothing can progress until a command arrives (idle, or waiting on helper threads).
    Wait,
}

/// A role's side of the loop.
pub trait Batcher: Send + 'static {
    /// New work the service admitted (a prefill to run, a decode request whose caches arrived).
    type Work: Send + 'static;
    /// What helper threads report back (a finished handshake, blocks returned).
    type Event: Send + 'static;

    fn submit(&mut self, work: Self::Work);
    /// Ends request `id` wherever it is; unknown ids are ignored.
    fn abort(&mut self, id: &str);
    fn event(&mut self, event: Self::Event);
    /// Drops requests whose caller went away, starts queued work, runs at most one batch.
    fn turn(&mut self) -> Turn;
    /// Publishes load and metrics (also while idle).
    fn publish(&mut self);
    /// The backend of a rank of a working expert-parallel group (none otherwise, or once the worker failed):
    /// the loop ends each turn with its [`engine::Backend::end_step`].
    fn lockstep(&self) -> Option<std::sync::Arc<dyn engine::Backend>> {
        None
    }
    /// The group failed at the end of a step: end every request and fail the worker.
    fn lockstep_failed(&mut self, _e: &engine::EngineError) {}
}

/// One turn; for a rank of an expert-parallel group, the end of its step too: busy when another rank had
/// rows (this rank must join the next step at once).
fn turn<B: Batcher>(b: &mut B) -> Turn {
    let t = b.turn();
    let Some(backend) = b.lockstep() else { return t };
    match backend.end_step() {
        Ok(true) => Turn::Busy,
        Ok(false) => t,
        Err(e) => {
            b.lockstep_failed(&e);
            Turn::Wait
        }
    }
}

enum Command<W, E> {
    Submit(W),
    Abort(String),
    Event(E),
    /// The last handle is gone.
    Stop,
}

/// Stops the loop when the last handle goes away (event senders held by the batcher and its helper
/// threads do not keep it running).
struct Owner<W, E> {
    tx: mpsc::Sender<Command<W, E>>,
}

impl<W, E> Drop for Owner<W, E> {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Stop);
    }
}

/// Sends commands to a running loop. Dropping every handle stops it.
pub struct LoopHandle<W, E> {
    owner: std::sync::Arc<Owner<W, E>>,
}

impl<W, E> Clone for LoopHandle<W, E> {
    fn clone(&self) -> Self {
        LoopHandle { owner: self.owner.clone() }
    }
}

impl<W, E> LoopHandle<W, E> {
    /// Queues new work; gives it back if the loop is gone.
    pub fn submit(&self, work: W) -> Result<(), W> {
        self.owner.tx.send(Command::Submit(work)).map_err(|e| match e.0 {
            Command::Submit(w) => w,
            _ => unreachable!("sent a Submit"),
        })
    }

    pub fn abort(&self, id: &str) {
        let _ = self.owner.tx.send(Command::Abort(id.to_string()));
    }
}

/// Reports helper threads' results to the loop (the batcher keeps one and clones it into its tasks).
pub struct Events<W, E> {
    tx: mpsc::Sender<Command<W, E>>,
}

impl<W, E> Clone for Events<W, E> {
    fn clone(&self) -> Self {
        Events { tx: self.tx.clone() }
    }
}

impl<W, E> Events<W, E> {
    /// False if the loop is gone.
    pub fn send(&self, event: E) -> bool {
        self.tx.send(Command::Event(event)).is_ok()
    }
}

/// Builds the batcher with its event sender and starts it on its own thread named `name`.
pub fn spawn<B: Batcher>(
    name: &str,
    make: impl FnOnce(Events<B::Work, B::Event>) -> B,
) -> std::io::Result<LoopHandle<B::Work, B::Event>> {
    let (tx, rx) = mpsc::channel();
    let batcher = make(Events { tx: tx.clone() });
    std::thread::Builder::new().name(name.to_string()).spawn(move || run(batcher, rx))?;
    Ok(LoopHandle { owner: std::sync::Arc::new(Owner { tx }) })
}

fn run<B: Batcher>(mut b: B, rx: mpsc::Receiver<Command<B::Work, B::Event>>) {
    // False once the loop must stop.
    let handle = |b: &mut B, cmd: Command<B::Work, B::Event>| {
        match cmd {
            Command::Submit(w) => b.submit(w),
            Command::Abort(id) => b.abort(&id),
            Command::Event(e) => b.event(e),
            Command::Stop => return false,
        }
        true
    };
    let mut turn = Turn::Wait;
    loop {
        if turn == Turn::Wait {
            let wait = if b.lockstep().is_some() { LOCKSTEP_POLL } else { IDLE_WAIT };
            match rx.recv_timeout(wait) {
                Ok(cmd) => {
                    if !handle(&mut b, cmd) {
                        return;
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    b.publish();
                    // Callers that went away are noticed while waiting too.
                    turn = self::turn(&mut b);
                    continue;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        }
        while let Ok(cmd) = rx.try_recv() {
            if !handle(&mut b, cmd) {
                return;
            }
        }
        turn = self::turn(&mut b);
        b.publish();
    }
}

/// Returns every block of request `id` to the pool (logged when it held none: a bookkeeping bug).
pub fn release(pool: &BlockPool, id: &str) {
    if let Err(e) = pool.release(id) {
        tracing::error!(request_id = %id, error = %e, "releasing cache blocks");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    use super::*;

    /// Records what the loop did; each piece of work needs `steps` busy turns.
    #[derive(Default)]
    struct Log {
        calls: Vec<String>,
        publishes: usize,
    }

    struct Fake {
        log: Arc<Mutex<Log>>,
        running: Vec<(String, usize)>,
        events: Events<(String, usize), String>,
    }

    fn fake(log: &Arc<Mutex<Log>>) -> LoopHandle<(String, usize), String> {
        spawn("test-loop", |events| Fake { log: log.clone(), running: Vec::new(), events }).unwrap()
    }

    impl Batcher for Fake {
        type Work = (String, usize);
        type Event = String;
        fn submit(&mut self, work: (String, usize)) {
            self.log.lock().unwrap().calls.push(format!("submit {}", work.0));
            if work.1 == 0 {
                // As a helper thread would: report back through the event sender.
                let events = self.events.clone();
                std::thread::spawn(move || events.send(format!("helper {}", work.0)));
                return;
            }
            self.running.push(work);
        }
        fn abort(&mut self, id: &str) {
            self.log.lock().unwrap().calls.push(format!("abort {id}"));
            self.running.retain(|(j, _)| j != id);
        }
        fn event(&mut self, e: String) {
            self.log.lock().unwrap().calls.push(format!("event {e}"));
        }
        fn turn(&mut self) -> Turn {
            let mut log = self.log.lock().unwrap();
            for (id, left) in &mut self.running {
                *left -= 1;
                if *left == 0 {
                    log.calls.push(format!("done {id}"));
                }
            }
            self.running.retain(|(_, left)| *left > 0);
            if self.running.is_empty() { Turn::Wait } else { Turn::Busy }
        }
        fn publish(&mut self) {
            self.log.lock().unwrap().publishes += 1;
        }
    }

    fn wait_for(log: &Mutex<Log>, what: &str) {
        let until = Instant::now() + Duration::from_secs(5);
        while !log.lock().unwrap().calls.iter().any(|c| c == what) {
            assert!(Instant::now() < until, "never saw {what}: {:?}", log.lock().unwrap().calls);
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn commands_run_in_order_and_work_runs_until_done() {
        let log = Arc::new(Mutex::new(Log::default()));
        let h = fake(&log);
        h.submit(("a".into(), 3)).unwrap();
        wait_for(&log, "done a");
        h.submit(("b".into(), 1_000_000)).unwrap();
        h.abort("b");
        h.submit(("c".into(), 0)).unwrap();
        wait_for(&log, "event helper c");
        let calls = log.lock().unwrap().calls.clone();
        let pos = |c: &str| calls.iter().position(|x| x == c).unwrap();
        assert!(pos("submit a") < pos("done a") && pos("submit b") < pos("abort b"));
        assert!(pos("abort b") < pos("submit c") && pos("submit c") < pos("event helper c"));
        assert!(!calls.iter().any(|c| c == "done b"), "aborted work does not finish");
    }

    #[test]
    fn an_idle_loop_blocks_and_still_publishes() {
        let log = Arc::new(Mutex::new(Log::default()));
        let h = fake(&log);
        std::thread::sleep(IDLE_WAIT * 3 + IDLE_WAIT / 2);
        let published = log.lock().unwrap().publishes;
        // A spinning loop would publish thousands of times; a waiting one about once per IDLE_WAIT.
        assert!((2..=5).contains(&published), "published {published} times in 3.5 idle periods");
        drop(h);
    }

    #[test]
    fn dropping_every_handle_stops_the_loop() {
        let log = Arc::new(Mutex::new(Log::default()));
        let h = fake(&log);
        let h2 = h.clone();
        drop(h);
        h2.submit(("x".into(), 1)).unwrap();
        wait_for(&log, "done x");
        drop(h2);
        // The batcher holds an event sender, yet the loop stops and drops it (and its log clone).
        let until = Instant::now() + Duration::from_secs(2);
        while Arc::strong_count(&log) > 1 {
            assert!(Instant::now() < until, "the loop did not stop");
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}
