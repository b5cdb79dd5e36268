//! Fuzzing kv-transfer's inputs from the network: wire frames written to a live TCP receiver (control
//! frames with arbitrary or damaged `TransferControl` messages and lying length prefixes, data frames
//! with arbitrary sessions, tokens, offsets and lengths, barriers, raw bytes), and transfer descriptors
//! (a real one, mutated field by field) handed to `KvSender::begin`. The receiver must never panic,
//! hang or stop serving, and a descriptor either starts the transfer it describes or is refused.
//! Bounded by `fuzzing::config` (`TANDEM_FUZZ_CASES`, scripts/fuzz.sh).

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::Duration;

use kv_cache::BlockPool;
use kv_transfer::transport::WriteHeader;
use kv_transfer::{
    ExpectRequest, KvReceiver, KvSender, ReceiverConfig, SenderConfig, TcpConfig, TransportConfig, TransportKind,
    testkit,
};
use proptest::prelude::*;
use prost::Message;
use proto::v1::transfer_control::Body;
use proto::v1::*;

const CASES: u32 = 256;
const TAG_CONTROL: u8 = 1;
const TAG_DATA: u8 = 2;
const TAG_BARRIER: u8 = 3;
/// The correlation id of the probe handshake that ends every case.
const PROBE: u64 = 0x5eed;

static PANICS: AtomicUsize = AtomicUsize::new(0);
/// The tests' own threads: proptest reports their panics itself.
static TEST_THREADS: Mutex<Vec<ThreadId>> = Mutex::new(Vec::new());

/// Counts panics on the library's threads (the receiver's tasks run on its own runtime, where a panic
/// would only end the task).
fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    TEST_THREADS.lock().unwrap().push(std::thread::current().id());
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !TEST_THREADS.lock().is_ok_and(|t| t.contains(&std::thread::current().id())) {
                PANICS.fetch_add(1, Ordering::SeqCst);
            }
            prev(info)
        }));
    });
}

struct Receiver {
    recv: KvReceiver,
    pool: Arc<BlockPool>,
    next: AtomicU64,
}

impl Receiver {
    fn start() -> Receiver {
        let g = testkit::geometry(2, 64);
        let (cache, pool) = testkit::filled_cache(g, 7);
        let cfg = ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()));
        let recv = KvReceiver::start(cfg, cache, pool.clone(), testkit::fingerprint(&g)).unwrap();
        Receiver { recv, pool, next: AtomicU64::new(0) }
    }

    /// A fresh expected transfer of 64 tokens (one block).
    fn expect(&self) -> (TransferDescriptor, kv_transfer::PendingTransfer) {
        let id = format!("r{}", self.next.fetch_add(1, Ordering::Relaxed));
        let blocks = self.pool.reserve(&id, 64).expect("a free block");
        let req = ExpectRequest {
            request_id: id,
            blocks,
            num_tokens: 64,
            timeout: Duration::from_secs(30),
            verify_checksum: true,
        };
        self.recv.expect(req).unwrap()
    }

    /// Ends a case's transfer whatever state the frames left it in, and returns its blocks.
    fn finish(&self, desc: &TransferDescriptor, pending: kv_transfer::PendingTransfer) {
        self.recv.abort(&desc.request_id, "fuzz case over");
        let _ = pending.wait_timeout(Duration::from_secs(5));
        let _ = self.pool.release(&desc.request_id);
    }
}

fn connect(desc: &TransferDescriptor) -> TcpStream {
    let addr = String::from_utf8_lossy(&desc.endpoint.as_ref().unwrap().address).into_owned();
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

fn ctl_frame(msg: &TransferControl) -> Vec<u8> {
    let body = msg.encode_to_vec();
    let mut f = vec![TAG_CONTROL];
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&body);
    f
}

/// Reads control frames until one with correlation id `id`; None on EOF or a broken frame.
fn read_reply(s: &mut TcpStream, id: u64) -> std::io::Result<Option<TransferControl>> {
    loop {
        let mut hdr = [0u8; 5];
        match s.read_exact(&mut hdr) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return Ok(None),
            Err(e) => return Err(e),
        }
        let len = u32::from_le_bytes(hdr[1..5].try_into().unwrap()) as usize;
        assert!(hdr[0] == TAG_CONTROL && len < 1 << 20, "the receiver wrote a bad frame header {hdr:?}");
        let mut body = vec![0u8; len];
        s.read_exact(&mut body)?;
        let msg = TransferControl::decode(body.as_slice()).expect("the receiver's reply decodes");
        if msg.correlation_id == id {
            return Ok(Some(msg));
        }
    }
}

fn begin_of(desc: &TransferDescriptor) -> TransferBegin {
    TransferBegin {
        request_id: desc.request_id.clone(),
        transfer_token: desc.transfer_token.clone(),
        num_tokens: desc.num_tokens,
        block_ids: desc.block_ids.clone(),
        layout: desc.layout,
        fingerprint: desc.fingerprint.clone(),
        sender_address: Vec::new(),
        receiver_mediated: false,
    }
}

/// A value that is the real one (so checks pass and deeper code runs) or arbitrary.
#[derive(Debug, Clone)]
enum Pick<T> {
    Real,
    Other(T),
}

impl<T: Clone> Pick<T> {
    fn or(&self, real: T) -> T {
        match self {
            Pick::Real => real,
            Pick::Other(v) => v.clone(),
        }
    }
}

fn pick<T: std::fmt::Debug + Clone>(other: impl Strategy<Value = T>) -> impl Strategy<Value = Pick<T>> {
    prop_oneof![2 => Just(Pick::Real), 1 => other.prop_map(Pick::Other)]
}

fn small_or_any() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..70_000, any::<u64>(), Just(u64::MAX), Just(1 << 40)]
}

#[derive(Debug, Clone)]
enum Frame {
    /// A control message; `damage` overwrites encoded bytes, `len` lies about the length.
    Ctl {
        body: CtlBody,
        correlation: u64,
        damage: Vec<(usize, u8)>,
        len: Option<u32>,
    },
    Data {
        session: Pick<u64>,
        token: Pick<[u8; 16]>,
        offset: u64,
        len: u64,
        payload: usize,
    },
    Barrier(u64),
    Raw(Vec<u8>),
}

#[derive(Debug, Clone)]
enum CtlBody {
    Begin { token: Pick<Vec<u8>>, num_tokens: Pick<u32>, blocks: Pick<Vec<u32>>, layout: Pick<Option<CacheLayout>> },
    Complete { session: Pick<u64>, token: Pick<Vec<u8>>, layers: Vec<LayerManifest> },
    Release { session: Pick<u64>, token: Pick<Vec<u8>>, finish: i32 },
    Abort { session: Pick<u64>, token: Pick<Vec<u8>>, status: i32 },
    Ack { session: Pick<u64>, status: i32 },
    Accept(u64),
    None,
}

fn layout() -> impl Strategy<Value = Option<CacheLayout>> {
    let f = || prop_oneof![Just(0u32), Just(64), Just(656), any::<u32>()];
    let g = || prop_oneof![Just(0u64), Just(1 << 20), any::<u64>()];
    proptest::option::of(((f(), f(), f(), f(), f()), (g(), g(), g(), g())).prop_map(
        |((block_size, num_layers, latent_bytes_per_token, indexer_bytes_per_block, num_blocks), (a, b, c, d))| {
            CacheLayout {
                block_size,
                num_layers,
                latent_bytes_per_token,
                indexer_bytes_per_block,
                num_blocks,
                latent_offset: a,
                latent_layer_stride: b,
                indexer_offset: c,
                indexer_layer_stride: d,
            }
        },
    ))
}

/// Tokens of the right length, and missing, short or long ones.
fn token_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![3 => proptest::collection::vec(any::<u8>(), 16), 1 => proptest::collection::vec(any::<u8>(), 0..20)]
}

fn ctl_body() -> impl Strategy<Value = CtlBody> {
    let session = || pick(small_or_any());
    let token = || pick(token_bytes());
    let manifest = (0u32..4, small_or_any(), small_or_any(), any::<Option<u64>>())
        .prop_map(|(layer, l, i, c)| LayerManifest { layer, latent_bytes: l, indexer_bytes: i, checksum: c });
    prop_oneof![
        3 => (token(), pick(any::<u32>()), pick(proptest::collection::vec(prop_oneof![0u32..70, any::<u32>()], 0..4)), pick(layout()))
            .prop_map(|(token, num_tokens, blocks, layout)| CtlBody::Begin { token, num_tokens, blocks, layout }),
        2 => (session(), token(), proptest::collection::vec(manifest, 0..4))
            .prop_map(|(session, token, layers)| CtlBody::Complete { session, token, layers }),
        1 => (session(), token(), 0i32..8).prop_map(|(session, token, finish)| CtlBody::Release { session, token, finish }),
        1 => (session(), token(), -1i32..12).prop_map(|(session, token, status)| CtlBody::Abort { session, token, status }),
        1 => (session(), -1i32..12).prop_map(|(session, status)| CtlBody::Ack { session, status }),
        1 => any::<u64>().prop_map(CtlBody::Accept),
        1 => Just(CtlBody::None),
    ]
}

fn frame() -> impl Strategy<Value = Frame> {
    let damage = proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3);
    let len = prop_oneof![4 => Just(None), 1 => prop_oneof![0u32..64, Just(16 << 20), Just((16 << 20) + 1), Just(u32::MAX)].prop_map(Some)];
    prop_oneof![
        4 => (ctl_body(), prop_oneof![0u64..4, any::<u64>()], damage, len)
            .prop_map(|(body, correlation, damage, len)| Frame::Ctl { body, correlation, damage, len }),
        3 => (pick(small_or_any()), pick(any::<[u8; 16]>()), small_or_any(), small_or_any(), 0usize..2048)
            .prop_map(|(session, token, offset, len, payload)| Frame::Data { session, token, offset, len, payload }),
        1 => any::<u64>().prop_map(Frame::Barrier),
        1 => fuzzing::bytes(256).prop_map(Frame::Raw),
    ]
}

/// `session` and `session_token`: from the Accept of a genuine handshake (zero and empty without one).
fn encode(f: &Frame, desc: &TransferDescriptor, session: u64, session_token: &[u8]) -> Vec<u8> {
    let tok = desc.transfer_token.clone();
    let stok = session_token.to_vec();
    match f {
        Frame::Ctl { body, correlation, damage, len } => {
            let body = match body {
                CtlBody::Begin { token, num_tokens, blocks, layout } => Some(Body::Begin(TransferBegin {
                    transfer_token: token.or(tok),
                    num_tokens: num_tokens.or(desc.num_tokens),
                    block_ids: blocks.or(desc.block_ids.clone()),
                    layout: layout.or(desc.layout),
                    ..begin_of(desc)
                })),
                CtlBody::Complete { session: s, token, layers } => Some(Body::Complete(TransferComplete {
                    session_id: s.or(session),
                    session_token: token.or(stok.clone()),
                    first_token: Some(GeneratedToken { token_id: 5, logprobs: None }),
                    draft: None,
                    layers: layers.clone(),
                })),
                CtlBody::Release { session: s, token, finish } => Some(Body::Release(TransferRelease {
                    session_id: s.or(session),
                    session_token: token.or(stok.clone()),
                    first_token: Some(GeneratedToken { token_id: 5, logprobs: None }),
                    finish_reason: *finish,
                })),
                CtlBody::Abort { session: s, token, status } => Some(Body::Abort(TransferAbort {
                    session_id: s.or(session),
                    session_token: token.or(stok.clone()),
                    reason: "fuzz".into(),
                    status: *status,
                })),
                CtlBody::Ack { session: s, status } => {
                    Some(Body::Ack(TransferAck { session_id: s.or(session), status: *status, message: String::new() }))
                }
                CtlBody::Accept(s) => Some(Body::Accept(TransferAccept { session_id: *s, ..Default::default() })),
                CtlBody::None => None,
            };
            let mut bytes = TransferControl { correlation_id: *correlation, body }.encode_to_vec();
            for &(at, b) in damage {
                if !bytes.is_empty() {
                    let n = bytes.len();
                    bytes[at % n] = b;
                }
            }
            let mut out = vec![TAG_CONTROL];
            out.extend_from_slice(&len.unwrap_or(bytes.len() as u32).to_le_bytes());
            out.extend_from_slice(&bytes);
            out
        }
        Frame::Data { session: s, token, offset, len, payload } => {
            let mut out = vec![TAG_DATA];
            let real: [u8; 16] = stok.as_slice().try_into().unwrap_or([0; 16]);
            let header = WriteHeader { session: s.or(session), token: token.or(real), offset: *offset, len: *len };
            out.extend_from_slice(&header.encode());
            out.extend((0..*payload).map(|i| i as u8));
            out
        }
        Frame::Barrier(id) => {
            let mut out = vec![TAG_BARRIER];
            out.extend_from_slice(&id.to_le_bytes());
            out
        }
        Frame::Raw(b) => b.clone(),
    }
}

/// The receiver still answers a handshake for a request it does not know, on a new connection.
fn still_serving(desc: &TransferDescriptor) -> Result<(), TestCaseError> {
    let mut s = connect(desc);
    let probe =
        Body::Begin(TransferBegin { request_id: "nobody".into(), transfer_token: vec![1; 16], ..begin_of(desc) });
    s.write_all(&ctl_frame(&TransferControl { correlation_id: PROBE, body: Some(probe) })).unwrap();
    match read_reply(&mut s, PROBE) {
        Ok(Some(TransferControl { body: Some(Body::Ack(a)), .. })) => {
            prop_assert_eq!(a.status, TransferStatus::UnknownRequest as i32);
            Ok(())
        }
        other => Err(TestCaseError::fail(format!("the receiver stopped answering handshakes: {other:?}"))),
    }
}

#[test]
fn wire_frames_never_crash_or_wedge_the_receiver() {
    count_panics();
    let r = Receiver::start();
    let case = (any::<bool>(), proptest::collection::vec(frame(), 0..6));
    fuzzing::run(CASES, "tcp frames", case, |(handshake, frames)| {
        let (desc, pending) = r.expect();
        let mut s = connect(&desc);
        let (mut session, mut session_token) = (0, Vec::new());
        if handshake {
            // Trusted from here on, with a live session for the frames to target.
            s.write_all(&ctl_frame(&TransferControl { correlation_id: 1, body: Some(Body::Begin(begin_of(&desc))) }))
                .unwrap();
            match read_reply(&mut s, 1) {
                Ok(Some(TransferControl { body: Some(Body::Accept(a)), .. })) => {
                    (session, session_token) = (a.session_id, a.session_token)
                }
                other => return Err(TestCaseError::fail(format!("a genuine handshake was not accepted: {other:?}"))),
            }
        }
        let mut bytes: Vec<u8> = frames.iter().flat_map(|f| encode(f, &desc, session, &session_token)).collect();
        let probe =
            Body::Begin(TransferBegin { request_id: "nobody".into(), transfer_token: vec![1; 16], ..begin_of(&desc) });
        bytes.extend(ctl_frame(&TransferControl { correlation_id: PROBE, body: Some(probe) }));
        // The receiver may close the connection before reading everything: that is an answer too.
        let _ = s.write_all(&bytes);
        let _ = s.shutdown(Shutdown::Write);
        // The probe's answer, or the connection closed: anything else within the timeout is a hang.
        if let Err(e) = read_reply(&mut s, PROBE) {
            prop_assert!(
                !matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut),
                "no answer and no close within 10 s"
            );
        }
        drop(s);
        still_serving(&desc)?;
        r.finish(&desc, pending);
        prop_assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a receiver thread panicked");
        Ok(())
    });
}

#[derive(Debug, Clone)]
struct DescriptorEdit {
    request_id: Pick<String>,
    token: Pick<Vec<u8>>,
    deadline: Pick<u64>,
    fingerprint: Pick<Option<ModelFingerprint>>,
    endpoint: Pick<Option<TransportEndpoint>>,
    layout: Pick<Option<CacheLayout>>,
    block_ids: Pick<Vec<u32>>,
    num_tokens: Pick<u32>,
}

fn descriptor_edit() -> impl Strategy<Value = DescriptorEdit> {
    let fp = proptest::option::of(
        (
            "[a-z-]{0,10}",
            "[0-9a-f]{0,32}",
            prop_oneof![Just("fp8".to_owned()), Just("full".to_owned()), "[a-z]{0,4}"],
            0u32..130,
            0u32..4,
        )
            .prop_map(|(model_name, checkpoint_hash, precision, block_size, num_layers)| ModelFingerprint {
                model_name,
                checkpoint_hash,
                precision,
                block_size,
                num_layers,
                kv_transfer_protocol: proto::KV_TRANSFER_PROTOCOL,
            }),
    );
    // Addresses that fail fast: no DNS look-ups, no waiting on a port that never answers.
    let endpoint = proptest::option::of(
        (
            prop_oneof![Just("tcp".to_owned()), Just("inproc".to_owned()), "[a-z]{0,5}"],
            prop_oneof![
                Just(b"".to_vec()),
                Just(b"127.0.0.1:1".to_vec()),
                Just(b"no-port".to_vec()),
                Just(b"[::1".to_vec())
            ],
        )
            .prop_map(|(kind, address)| TransportEndpoint { kind, address }),
    );
    (
        (pick("[a-z0-9]{0,6}"), pick(token_bytes()), pick(prop_oneof![Just(0u64), Just(1), Just(u64::MAX)]), pick(fp)),
        (pick(endpoint), pick(layout())),
        (
            pick(proptest::collection::vec(prop_oneof![0u32..70, any::<u32>()], 0..5)),
            pick(prop_oneof![0u32..200, any::<u32>()]),
        ),
    )
        .prop_map(|((request_id, token, deadline, fingerprint), (endpoint, layout), (block_ids, num_tokens))| {
            DescriptorEdit { request_id, token, deadline, fingerprint, endpoint, layout, block_ids, num_tokens }
        })
}

fn edited(d: &TransferDescriptor, e: &DescriptorEdit) -> TransferDescriptor {
    TransferDescriptor {
        request_id: e.request_id.or(d.request_id.clone()),
        transfer_token: e.token.or(d.transfer_token.clone()),
        deadline_unix_ms: e.deadline.or(d.deadline_unix_ms),
        fingerprint: e.fingerprint.or(d.fingerprint.clone()),
        endpoint: e.endpoint.or(d.endpoint.clone()),
        layout: e.layout.or(d.layout),
        block_ids: e.block_ids.or(d.block_ids.clone()),
        num_tokens: e.num_tokens.or(d.num_tokens),
        verify_checksum: d.verify_checksum,
    }
}

#[test]
fn a_descriptor_starts_the_transfer_it_describes_or_is_refused() {
    count_panics();
    let r = Receiver::start();
    let g = testkit::geometry(2, 64);
    let (scache, spool) = testkit::filled_cache(g, 9);
    let cfg = SenderConfig {
        transports: vec![TransportKind::Tcp],
        max_wait: Duration::from_secs(10),
        lanes: Some(1),
        ..SenderConfig::default()
    };
    let sender = KvSender::new(cfg, scache, testkit::fingerprint(&g)).unwrap();
    let src = spool.reserve("src", 64 * 8).unwrap();
    fuzzing::run(CASES, "descriptors", descriptor_edit(), |e| {
        let (desc, pending) = r.expect();
        let d = edited(&desc, &e);
        match sender.begin(&d, &src) {
            Ok(session) => {
                // The receiver accepted it: it must be the transfer it expected.
                prop_assert_eq!(&d.request_id, &desc.request_id);
                prop_assert_eq!(&d.transfer_token, &desc.transfer_token);
                prop_assert_eq!(&d.block_ids, &desc.block_ids);
                prop_assert_eq!(d.num_tokens, desc.num_tokens);
                let _ = session.abort("fuzz case over");
            }
            Err(err) => prop_assert!(!err.to_string().is_empty()),
        }
        r.finish(&desc, pending);
        prop_assert_eq!(PANICS.load(Ordering::SeqCst), 0, "a sender or receiver thread panicked");
        Ok(())
    });
}
