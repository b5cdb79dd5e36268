//! Fuzzing the UCX receive path (issue 24 item 3, the counterpart of tests/fuzz.rs's TCP frames): a raw
//! libucp client (`raw_ucx`, real UCX with default settings) sends the decode worker's receiver arbitrary
//! control messages (random bytes, and well-formed messages with random sessions and tokens) and data writes
//! with every header field real or random (session, token, offset, length; eager or rendezvous, a payload
//! as long as the header says or not), before and after a valid handshake. The receiver must never panic
//! or stop serving, nothing may land outside the request's own blocks, and an honest transfer afterwards
//! completes with its checksum verified. Bounded by `fuzzing::config` (`TANDEM_FUZZ_CASES`,
//! scripts/fuzz.sh); under CI=true a missing libucp fails (as every UCX test).

mod raw_ucx;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_cache::{BlockId, BlockPool, KvCache, LayerIdx};
use kv_transfer::transport::WriteHeader;
use kv_transfer::{
    KvReceiver, KvSender, PendingTransfer, ReceiverConfig, SenderConfig, TransferOutcome, TransportConfig, testkit,
};
use proptest::prelude::*;
use proto::v1::transfer_control::Body;
use proto::v1::{
    GeneratedToken, TransferAbort, TransferAck, TransferComplete, TransferControl, TransferDescriptor, TransferRelease,
};
use raw_ucx::{Raw, control, receiver_worker, ucx, valid_begin};

const LAYERS: usize = 2;
const CASES: u32 = 24;

struct Receiver {
    recv: KvReceiver,
    pool: Arc<BlockPool>,
    cache: Arc<KvCache>,
}

impl Receiver {
    fn start() -> Receiver {
        let g = testkit::geometry(LAYERS, 64);
        let (cache, pool) = testkit::filled_cache(g, 7);
        let cfg = ReceiverConfig {
            abort_ack_timeout: Duration::from_millis(200),
            quarantine: Duration::from_millis(200),
            ..ReceiverConfig::new(TransportConfig::Ucx { tls: None, tcp_fallback: None })
        };
        let recv = KvReceiver::start(cfg, cache.clone(), pool.clone(), testkit::fingerprint(&g)).unwrap();
        Receiver { recv, pool, cache }
    }

    fn expect(&self, id: &str) -> (TransferDescriptor, PendingTransfer) {
        raw_ucx::expect64(&self.recv, &self.pool, id)
    }

    fn bytes(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.cache.arena().len()];
        // SAFETY: read between steps; no honest transfer runs at the time.
        unsafe { self.cache.arena().copy_out(0, &mut v) }.unwrap();
        v
    }

    /// The byte ranges of the pool `desc`'s request may be written in: its blocks' latent and indexer entries
    /// in every layer.
    fn granted(&self, desc: &TransferDescriptor) -> Vec<std::ops::Range<usize>> {
        let g = self.cache.geometry();
        let mut r = Vec::new();
        for l in 0..LAYERS {
            for &b in &desc.block_ids {
                let (layer, block) = (LayerIdx(l as u32), BlockId(b));
                let lat = g.latent_block_offset(layer, block);
                r.push(lat..lat + g.latent_bytes_per_token() * 64);
                let idx = g.indexer_block_offset(layer, block);
                r.push(idx..idx + g.indexer_bytes_per_block());
            }
        }
        r
    }

    /// A real sender moves a fresh request end to end.
    fn honest_transfer(&self, id: &str) -> Result<(), TestCaseError> {
        let g = testkit::geometry(LAYERS, 64);
        let (cache, spool) = testkit::filled_cache(g, 99);
        let sender = KvSender::new(SenderConfig::default(), cache, testkit::fingerprint(&g)).unwrap();
        let (desc, pending) = self.expect(id);
        let src = spool.reserve(id, 64).unwrap();
        let s = sender.begin(&desc, &src).map_err(|e| TestCaseError::fail(format!("honest handshake: {e}")))?;
        for l in 0..LAYERS {
            s.put_layer(LayerIdx(l as u32)).unwrap();
        }
        s.complete(GeneratedToken { token_id: 5, logprobs: None }, None).unwrap();
        let out = pending.wait_timeout(Duration::from_secs(20));
        self.pool.release(id).unwrap();
        match out {
            Some(Ok(TransferOutcome::Completed(c))) if c.checksum_verified => Ok(()),
            other => Err(TestCaseError::fail(format!("honest transfer after the fuzzed messages: {other:?}"))),
        }
    }
}

/// A field taken from the real handshake or made up.
#[derive(Debug, Clone)]
enum Pick<T> {
    Real,
    Made(T),
}

impl<T: Clone> Pick<T> {
    fn or(&self, real: T) -> T {
        match self {
            Pick::Real => real,
            Pick::Made(v) => v.clone(),
        }
    }
}

fn pick<T: std::fmt::Debug + Clone>(other: impl Strategy<Value = T>) -> impl Strategy<Value = Pick<T>> {
    prop_oneof![2 => Just(Pick::Real), 1 => other.prop_map(Pick::Made)]
}

#[derive(Debug, Clone)]
enum Msg {
    /// Arbitrary bytes on the control path.
    Raw(Vec<u8>),
    /// A well-formed control message about a real or made-up session.
    Control { kind: u8, session: Pick<u64>, token: Pick<Vec<u8>> },
    /// A data write: each header field real or made up, the offset somewhere in or near the request's first
    /// block or anywhere, the payload as long as the header says or not.
    Write {
        session: Pick<u64>,
        token: Pick<[u8; 16]>,
        offset: Pick<u64>,
        delta: i64,
        len: u64,
        short: bool,
        rendezvous: bool,
    },
}

fn msg() -> impl Strategy<Value = Msg> {
    prop_oneof![
        fuzzing::bytes(256).prop_map(Msg::Raw),
        (0u8..4, pick(any::<u64>()), pick(proptest::collection::vec(any::<u8>(), 0..24)))
            .prop_map(|(kind, session, token)| Msg::Control { kind, session, token }),
        (
            pick(any::<u64>()),
            pick(any::<[u8; 16]>()),
            pick(any::<u64>()),
            -70_000i64..70_000,
            prop_oneof![0u64..2048, Just(0), any::<u64>()],
            any::<bool>(),
            any::<bool>(),
        )
            .prop_map(|(session, token, offset, delta, len, short, rendezvous)| Msg::Write {
                session,
                token,
                offset,
                delta,
                len,
                short,
                rendezvous
            }),
    ]
}

#[test]
fn ucx_messages_never_crash_or_wedge_the_receiver_nor_write_outside_the_blocks() {
    let Some(lib) = ucx() else { return };
    let r = Receiver::start();
    let n = std::sync::atomic::AtomicU64::new(0);
    let sessions = std::sync::atomic::AtomicU64::new(0);
    let case = (any::<bool>(), proptest::collection::vec(msg(), 1..12));
    fuzzing::run(CASES, "ucx messages", case, |(handshake, msgs)| {
        let i = n.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let id = format!("f{i}");
        let used = r.pool.stats().used_blocks;
        let (desc, _pending) = r.expect(&id);
        let before = r.bytes();
        let mut raw = Raw::new(lib);
        raw.connect(&receiver_worker(&desc));
        let (mut session, mut token) = (i, [0u8; 16]);
        if handshake {
            // A new endpoint is a stranger until accepted, and strangers' handshakes are answered at a bounded
            // rate: over many cases some get no answer, and the case goes on without a session.
            raw.send(7, &control(1, valid_begin(&desc, raw.sender_address(7), true)));
            let end = Instant::now() + Duration::from_secs(2);
            while Instant::now() < end {
                if let Some(TransferControl { body: Some(Body::Accept(a)), .. }) =
                    raw.replies().into_iter().find(|m| m.correlation_id == 1)
                {
                    session = a.session_id;
                    token = a.session_token.as_slice().try_into().unwrap();
                    sessions.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    break;
                }
                raw.progress_for(Duration::from_millis(5));
            }
        }
        let first = r.cache.geometry().latent_block_offset(LayerIdx(0), BlockId(desc.block_ids[0])) as u64;
        for (k, m) in msgs.iter().enumerate() {
            match m {
                Msg::Raw(bytes) => raw.send(7, bytes),
                Msg::Control { kind, session: s, token: t } => {
                    let (session_id, session_token) = (s.or(session), t.or(token.to_vec()));
                    let body = match kind {
                        0 => Body::Complete(TransferComplete { session_id, session_token, ..Default::default() }),
                        1 => Body::Release(TransferRelease { session_id, session_token, ..Default::default() }),
                        2 => Body::Abort(TransferAbort { session_id, session_token, ..Default::default() }),
                        _ => Body::Ack(TransferAck::default()),
                    };
                    raw.send(7, &control(100 + k as u64, body));
                }
                Msg::Write { session: s, token: t, offset, delta, len, short, rendezvous } => {
                    let offset = offset.or(first).wrapping_add_signed(*delta);
                    let h = WriteHeader { session: s.or(session), token: t.or(token), offset, len: *len };
                    // Payloads stay small: a header may claim any length, the bytes sent are at most 4 KiB.
                    let size = if *short { (*len).min(4096) / 2 } else { (*len).min(4096) };
                    raw.send_write(&h, &vec![0xa5u8; size as usize], *rendezvous);
                }
            }
        }
        raw.progress_for(Duration::from_millis(50));
        drop(raw);
        // Nothing outside the request's own blocks changed.
        let now = r.bytes();
        let granted = r.granted(&desc);
        let outside = (0..now.len()).find(|&b| now[b] != before[b] && !granted.iter().any(|g| g.contains(&b)));
        prop_assert!(outside.is_none(), "a fuzzed message changed byte {:?} outside the request's blocks", outside);
        // The fuzzed request is released (or already failed and gave its blocks back), and the receiver still
        // moves an honest request end to end.
        let _ = r.pool.release(&id);
        r.honest_transfer(&format!("h{i}"))?;
        let end = Instant::now() + Duration::from_secs(10);
        while r.pool.stats().used_blocks != used {
            prop_assert!(Instant::now() < end, "blocks leaked: {} used, {used} before", r.pool.stats().used_blocks);
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    });
    // The trusted path was fuzzed too: some cases wrote with a real session and token.
    assert!(sessions.into_inner() > 0, "no fuzzed case got a session");
}
