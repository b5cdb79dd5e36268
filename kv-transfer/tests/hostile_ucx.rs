//! What a stranger (or a broken sender) sends to the decode worker's UCX control path: nothing before an
//! accepted handshake is answered, strangers' handshakes are answered at a bounded rate, a trusted peer
//! that stops reading its replies is cut off, and a legitimate transfer still works afterwards. The
//! stranger is a raw libucp client (real UCX, default settings: `UCX_TLS` unset).

mod raw_ucx;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_cache::{BlockPool, KvCache, LayerIdx};
use kv_transfer::transport::ucx::{CONTROL_INFLIGHT, STRANGER_EPS, STRANGER_TTL};
use kv_transfer::{
    KvReceiver, KvSender, ReceiverConfig, SenderConfig, TransferError, TransferOutcome, TransportConfig, testkit,
};
use proto::v1::transfer_control::Body;
use proto::v1::{GeneratedToken, TransferAbort, TransferAck, TransferComplete, TransferDescriptor};
use raw_ucx::{Raw, begin, control, receiver_worker, ucx, valid_begin};

struct Receiver {
    recv: KvReceiver,
    pool: Arc<BlockPool>,
    layers: usize,
}

fn receiver() -> Receiver {
    let layers = 2;
    let g = testkit::geometry(layers, 64);
    let (cache, pool) = testkit::filled_cache(g, 7);
    let cfg = ReceiverConfig::new(TransportConfig::Ucx { tls: None, tcp_fallback: None });
    let recv = KvReceiver::start(cfg, cache, pool.clone(), testkit::fingerprint(&g)).unwrap();
    assert_eq!(recv.transport(), kv_transfer::TransportKind::Ucx);
    Receiver { recv, pool, layers }
}

impl Receiver {
    fn expect(&self, id: &str) -> (TransferDescriptor, kv_transfer::PendingTransfer) {
        raw_ucx::expect64(&self.recv, &self.pool, id)
    }

    /// A real sender moves a request end to end.
    fn legitimate_transfer_works(&self, id: &str) {
        let g = testkit::geometry(self.layers, 64);
        let (cache, spool): (Arc<KvCache>, _) = testkit::filled_cache(g, 99);
        let sender = KvSender::new(SenderConfig::default(), cache, testkit::fingerprint(&g)).unwrap();
        let (desc, pending) = self.expect(id);
        let src = spool.reserve(id, 64).unwrap();
        let s = sender.begin(&desc, &src).expect("a legitimate handshake is accepted");
        for l in 0..self.layers {
            s.put_layer(LayerIdx(l as u32)).unwrap();
        }
        s.complete(GeneratedToken { token_id: 5, logprobs: None }, None).unwrap();
        match pending.wait_timeout(Duration::from_secs(20)) {
            Some(Ok(TransferOutcome::Completed(c))) => assert!(c.checksum_verified),
            other => panic!("legitimate transfer: {other:?}"),
        }
        self.pool.release(id).unwrap();
    }
}

/// Resident memory of this process in bytes.
fn rss() -> u64 {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    s.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 4096
}

#[test]
fn messages_before_a_handshake_get_no_answer() {
    let Some(lib) = ucx() else { return };
    let r = receiver();
    let (desc, _pending) = r.expect("r1");
    let mut raw = Raw::new(lib);
    raw.connect(&receiver_worker(&desc));
    let before = rss();
    let n = 20_000u64;
    for i in 0..n {
        let msg = match i % 4 {
            // Garbage that does not decode.
            0 => vec![0xff; 9 + (i % 50) as usize],
            // Messages that need a session: from a sender nobody accepted.
            1 => {
                let session_token = i.to_le_bytes().repeat(2);
                control(i, Body::Complete(TransferComplete { session_id: i, session_token, ..Default::default() }))
            }
            2 => {
                let session_token = i.to_le_bytes().repeat(2);
                control(i, Body::Abort(TransferAbort { session_id: i, session_token, ..Default::default() }))
            }
            _ => control(i, Body::Ack(TransferAck::default())),
        };
        raw.send(i % 7, &msg);
    }
    raw.progress_for(Duration::from_millis(500));
    assert_eq!(raw.answers(), 0, "the receiver answered messages sent before any handshake");
    let st = r.recv.stats();
    assert_eq!(st.dropped_untrusted, n, "every message from a stranger is dropped and counted");
    assert_eq!(st.rejected_handshakes, 0);
    let grown = rss().saturating_sub(before);
    assert!(grown < 64 << 20, "{n} dropped messages grew the process by {} MB", grown >> 20);
    drop(raw);
    r.legitimate_transfer_works("ok1");
    assert_eq!(r.pool.stats().used_blocks, 1, "only r1's reservation is held");
}

#[test]
fn strangers_handshakes_are_answered_at_a_bounded_rate() {
    let Some(lib) = ucx() else { return };
    let r = receiver();
    let (desc, pending) = r.expect("r2");
    let mut raw = Raw::new(lib);
    raw.connect(&receiver_worker(&desc));
    let start = Instant::now();
    let n = 2_000u64;
    let mut wrong = desc.transfer_token.clone();
    wrong[0] ^= 1;
    for i in 0..n {
        // Every handshake from a new origin, with a wrong token: each would need its own endpoint.
        let origin = 1_000_000 + i;
        raw.send(origin, &control(i, begin("r2", wrong.clone(), raw.sender_address(origin))));
    }
    let sent_in = start.elapsed();
    raw.progress_for(Duration::from_millis(500));
    let windows = (sent_in.as_secs_f64() / STRANGER_TTL.as_secs_f64()).ceil() as usize + 1;
    let answered = raw.answers();
    assert!(answered >= 1, "a refused handshake from a stranger gets its reason");
    assert!(
        answered <= STRANGER_EPS * windows,
        "{answered} of {n} strangers' handshakes were answered (at most {} per {:?})",
        STRANGER_EPS,
        STRANGER_TTL
    );
    let st = r.recv.stats();
    assert_eq!(st.rejected_handshakes as usize, answered);
    assert_eq!(st.dropped_untrusted as usize + answered, n as usize);
    // The expected transfer is untouched by wrong tokens, and a real sender still gets through once
    // the strangers' window passed.
    drop(raw);
    std::thread::sleep(STRANGER_TTL);
    assert!(pending.wait_timeout(Duration::from_millis(1)).is_none(), "wrong tokens must not fail r2");
    r.legitimate_transfer_works("ok2");
}

#[test]
fn a_trusted_peer_that_does_not_read_its_replies_is_cut_off() {
    let Some(lib) = ucx() else { return };
    let r = receiver();
    let (desc, pending) = r.expect("r3");
    let mut writer = Raw::new(lib);
    writer.connect(&receiver_worker(&desc));
    // Replies go to the address the handshake names: a worker that never progresses (never reads).
    let deaf = Raw::new(lib);
    let origin = 77;
    let valid = valid_begin(&desc, deaf.sender_address(origin), true);
    writer.send(origin, &control(1, valid));
    // Trusted now (its handshake was accepted); every further handshake gets an answer it never reads.
    let before = rss();
    let n = 4 * CONTROL_INFLIGHT as u64;
    for i in 0..n {
        writer.send(origin, &control(2 + i, begin("unknown", vec![1; 16], deaf.sender_address(origin))));
    }
    let outcome = pending.wait_timeout(Duration::from_secs(10));
    assert!(matches!(outcome, Some(Err(TransferError::PeerLost { .. }))), "the peer was not cut off: {outcome:?}");
    assert_eq!(r.recv.stats().cut_off_peers, 1);
    // Cut off, the peer is a stranger again: its handshakes get at most the strangers' budget.
    let refused = r.recv.stats().rejected_handshakes;
    let start = Instant::now();
    for i in 0..1000 {
        writer.send(origin, &control(10_000 + i, begin("unknown", vec![1; 16], deaf.sender_address(origin))));
    }
    writer.progress_for(Duration::from_millis(200));
    let windows = (start.elapsed().as_secs_f64() / STRANGER_TTL.as_secs_f64()).ceil() as u64 + 1;
    let answered = r.recv.stats().rejected_handshakes - refused;
    assert!(answered <= STRANGER_EPS as u64 * windows, "{answered} handshakes answered after the cut-off");
    let grown = rss().saturating_sub(before);
    assert!(grown < 64 << 20, "the unread replies grew the process by {} MB", grown >> 20);
    // The cut-off freed r3's blocks (the sender wrote through the receiver), and others still transfer.
    common_wait_used(&r.pool, 0);
    drop(writer);
    std::thread::sleep(STRANGER_TTL);
    r.legitimate_transfer_works("ok3");
    drop(deaf);
}

fn common_wait_used(pool: &BlockPool, used: usize) {
    let end = Instant::now() + Duration::from_secs(10);
    while pool.stats().used_blocks != used {
        assert!(Instant::now() < end, "pool still holds {} blocks", pool.stats().used_blocks);
        std::thread::sleep(Duration::from_millis(20));
    }
}
