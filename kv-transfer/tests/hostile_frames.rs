//! Frames a stranger (or a broken sender) writes to the decode worker's TCP listener: nothing before a
//! valid handshake is answered, a peer that does not read its replies is disconnected instead of
//! growing the receiver's memory, and the transfer tokens hold: a handshake without the reservation's
//! unused token gets only its refusal, writes need the session token of an accepted handshake and land
//! only inside the transfer's blocks, and tokens die with their transfer. Each check reads the whole
//! pool back (nothing written), the pool's block count (nothing leaked) and ends with an honest
//! transfer.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_cache::{BlockId, BlockPool, KvCache, LayerIdx};
use kv_transfer::transport::WriteHeader;
use kv_transfer::{
    ExpectRequest, KvReceiver, KvSender, PendingTransfer, ReceiverConfig, SenderConfig, TcpConfig, TransferError,
    TransferOutcome, TransportConfig, TransportKind, testkit,
};
use prost::Message;
use proto::v1::transfer_control::Body;
use proto::v1::{GeneratedToken, TransferBegin, TransferControl, TransferDescriptor, TransferStatus};

const BARRIER: [u8; 9] = [3, 1, 0, 0, 0, 0, 0, 0, 0];

fn receiver() -> (KvReceiver, Arc<BlockPool>) {
    let (recv, pool, _) = receiver_with_cache();
    (recv, pool)
}

fn receiver_with_cache() -> (KvReceiver, Arc<BlockPool>, Arc<KvCache>) {
    let g = testkit::geometry(2, 16);
    let (cache, pool) = testkit::filled_cache(g, 7);
    let cfg = ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()));
    let recv = KvReceiver::start(cfg, cache.clone(), pool.clone(), testkit::fingerprint(&g)).unwrap();
    (recv, pool, cache)
}

fn connect(address: &[u8]) -> TcpStream {
    let s = TcpStream::connect(String::from_utf8_lossy(address).as_ref()).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.set_write_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

/// Writes barriers until the receiver cuts the connection; returns the bytes written by then.
fn flood_until_closed(s: &mut TcpStream, budget: usize) -> Option<usize> {
    let chunk: Vec<u8> = BARRIER.iter().copied().cycle().take(9 * 4096).collect();
    let mut written = 0;
    let start = Instant::now();
    while written < budget && start.elapsed() < Duration::from_secs(60) {
        match s.write_all(&chunk) {
            Ok(()) => written += chunk.len(),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => return None,
            Err(_) => return Some(written),
        }
    }
    None
}

#[test]
fn frames_before_a_handshake_get_no_answer_and_close_the_connection() {
    let (recv, pool) = receiver();
    let blocks = recv_blocks(&pool, "r1");
    let (desc, _pending) = recv.expect(expect("r1", blocks)).unwrap();
    let address = desc.endpoint.unwrap().address;

    let mut s = connect(&address);
    let closed_after = flood_until_closed(&mut s, 100 << 20);
    assert!(closed_after.is_some(), "the receiver kept reading barriers from a stranger");
    let mut got = Vec::new();
    let _ = s.read_to_end(&mut got);
    assert!(got.is_empty(), "the receiver answered {} bytes before any handshake", got.len());
}

#[test]
fn a_peer_that_does_not_read_its_replies_is_disconnected() {
    let (recv, pool) = receiver();
    let blocks = recv_blocks(&pool, "r2");
    let (desc, _pending) = recv.expect(expect("r2", blocks)).unwrap();
    let address = desc.endpoint.clone().unwrap().address;

    let mut s = connect(&address);
    // An accepted handshake: the connection is trusted.
    accepted(&handshake(&mut s, 1, &desc, desc.transfer_token.clone()));
    // Barriers are answered on a trusted connection; never reading the answers must not queue them
    // without bound.
    let closed_after = flood_until_closed(&mut s, 100 << 20);
    assert!(closed_after.is_some(), "100 MB of barriers were accepted without reading a reply");
}

fn recv_blocks(pool: &BlockPool, id: &str) -> kv_cache::BlockTable {
    pool.reserve(id, 64).unwrap()
}

fn expect(id: &str, blocks: kv_cache::BlockTable) -> ExpectRequest {
    ExpectRequest {
        request_id: id.into(),
        blocks,
        num_tokens: 64,
        timeout: Duration::from_secs(60),
        verify_checksum: false,
    }
}

/// Every byte of the receiver's pool.
fn pool_bytes(cache: &KvCache) -> Vec<u8> {
    let mut v = vec![0u8; cache.arena().len()];
    // SAFETY: no transfer writes while the tests read (each reads between steps, after replies).
    unsafe { cache.arena().copy_out(0, &mut v) }.unwrap();
    v
}

fn ctl(correlation_id: u64, body: Body) -> Vec<u8> {
    let bytes = TransferControl { correlation_id, body: Some(body) }.encode_to_vec();
    let mut frame = vec![1u8];
    frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    frame.extend_from_slice(&bytes);
    frame
}

fn data(header: WriteHeader, payload: &[u8]) -> Vec<u8> {
    let mut frame = vec![2u8];
    frame.extend_from_slice(&header.encode());
    frame.extend_from_slice(payload);
    frame
}

/// The next control frame from the receiver (`None`: the connection closed).
fn next_reply(s: &mut TcpStream) -> Option<TransferControl> {
    let mut hdr = [0u8; 5];
    s.read_exact(&mut hdr).ok()?;
    assert_eq!(hdr[0], 1, "the receiver sends only control frames");
    let mut body = vec![0u8; u32::from_le_bytes(hdr[1..].try_into().unwrap()) as usize];
    s.read_exact(&mut body).unwrap();
    Some(TransferControl::decode(body.as_slice()).unwrap())
}

/// Sends a handshake for `desc`'s request presenting `token` and returns the receiver's answer.
fn handshake(s: &mut TcpStream, corr: u64, desc: &TransferDescriptor, token: Vec<u8>) -> TransferControl {
    let begin = TransferBegin {
        request_id: desc.request_id.clone(),
        transfer_token: token,
        num_tokens: desc.num_tokens,
        block_ids: desc.block_ids.clone(),
        layout: desc.layout,
        fingerprint: desc.fingerprint.clone(),
        ..Default::default()
    };
    s.write_all(&ctl(corr, Body::Begin(begin))).unwrap();
    let reply = next_reply(s).expect("an answer to the handshake");
    assert_eq!(reply.correlation_id, corr);
    reply
}

fn refused_with(reply: &TransferControl, status: TransferStatus) {
    match &reply.body {
        Some(Body::Ack(a)) => assert_eq!(a.status, status as i32, "refused for another reason: {}", a.message),
        other => panic!("expected a refusal ({status:?}), got {other:?}"),
    }
}

/// Session id and session token of an accepted handshake.
fn accepted(reply: &TransferControl) -> (u64, [u8; 16]) {
    match &reply.body {
        Some(Body::Accept(a)) => (a.session_id, a.session_token.as_slice().try_into().expect("a 16-byte token")),
        other => panic!("expected an Accept, got {other:?}"),
    }
}

fn flipped(token: &[u8]) -> Vec<u8> {
    let mut t = token.to_vec();
    t[15] ^= 0x80;
    t
}

/// The transfer is still waiting for its sender (wrong tokens must not end it).
fn still_pending(p: &PendingTransfer) {
    assert!(
        p.wait_timeout(Duration::from_millis(1)).is_none(),
        "the transfer ended: {:?}",
        p.wait_timeout(Duration::ZERO)
    );
}

/// A real TCP sender moves `desc`'s request end to end (checksums verified), then the blocks go back.
fn honest_transfer(pool: &BlockPool, desc: &TransferDescriptor, pending: PendingTransfer) {
    let g = testkit::geometry(2, 16);
    let (cache, spool) = testkit::filled_cache(g, 99);
    let cfg = SenderConfig { transports: vec![TransportKind::Tcp], lanes: Some(1), ..SenderConfig::default() };
    let sender = KvSender::new(cfg, cache, testkit::fingerprint(&g)).unwrap();
    let src = spool.reserve("src", desc.num_tokens as usize).unwrap();
    let s = sender.begin(desc, &src).expect("the honest sender's handshake is accepted");
    for l in 0..2 {
        s.put_layer(LayerIdx(l)).unwrap();
    }
    s.complete(GeneratedToken { token_id: 5, logprobs: None }, None).unwrap();
    match pending.wait_timeout(Duration::from_secs(20)) {
        Some(Ok(TransferOutcome::Completed(c))) => assert!(c.checksum_verified),
        other => panic!("honest transfer: {other:?}"),
    }
    pool.release(&desc.request_id).unwrap();
}

fn expect_checked(recv: &KvReceiver, pool: &BlockPool, id: &str) -> (TransferDescriptor, PendingTransfer) {
    let blocks = pool.reserve(id, 64).unwrap();
    recv.expect(ExpectRequest { verify_checksum: true, ..expect(id, blocks) }).unwrap()
}

fn wait_used(pool: &BlockPool, used: usize) {
    let end = Instant::now() + Duration::from_secs(10);
    while pool.stats().used_blocks != used {
        assert!(Instant::now() < end, "the pool holds {} blocks, expected {used}", pool.stats().used_blocks);
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn handshakes_without_the_reservations_token_get_only_a_refusal() {
    let (recv, pool, cache) = receiver_with_cache();
    let (d1, p1) = expect_checked(&recv, &pool, "r1");
    let (d2, p2) = expect_checked(&recv, &pool, "r2");
    let address = d1.endpoint.clone().unwrap().address;
    let before = pool_bytes(&cache);

    let mut s = connect(&address);
    // A request nobody expects: the answer every refused token below must get too, word for word, so
    // that a stranger cannot tell an awaited request id from an unknown one.
    let nobody = TransferDescriptor { request_id: "nobody".into(), ..d1.clone() };
    let unknown = handshake(&mut s, 9, &nobody, d1.transfer_token.clone());
    refused_with(&unknown, TransferStatus::UnknownRequest);
    let Some(Body::Ack(unknown)) = unknown.body else { unreachable!() };
    let cases = [
        (Vec::new(), "no token"),
        (flipped(&d1.transfer_token), "a wrong token"),
        (d2.transfer_token.clone(), "r2's token"),
    ];
    for (i, (token, what)) in cases.into_iter().enumerate() {
        let reply = handshake(&mut s, 10 + i as u64, &d1, token);
        refused_with(&reply, TransferStatus::UnknownRequest);
        let Some(Body::Ack(a)) = reply.body else { unreachable!() };
        assert_eq!(a.session_id, 0, "{what}: the refusal names no session");
        assert_eq!(a.message, unknown.message, "{what}: told apart from an unknown request");
    }
    // Still a stranger: anything but a handshake closes the connection, unanswered.
    s.write_all(&BARRIER).unwrap();
    assert!(next_reply(&mut s).is_none(), "a stranger's barrier was answered");

    assert_eq!(recv.stats().rejected_handshakes, 4);
    assert!(pool_bytes(&cache) == before, "a refused handshake changed the pool");
    still_pending(&p1);
    still_pending(&p2);
    assert_eq!(pool.stats().used_blocks, 2);
    honest_transfer(&pool, &d1, p1);
    honest_transfer(&pool, &d2, p2);
    assert_eq!(pool.stats().used_blocks, 0);
}

#[test]
fn a_used_token_opens_nothing_and_writes_stay_inside_the_granted_blocks() {
    let (recv, pool, cache) = receiver_with_cache();
    let g = *cache.geometry();
    let (d1, p1) = expect_checked(&recv, &pool, "r1");
    let (d2, p2) = expect_checked(&recv, &pool, "r2");
    let address = d1.endpoint.clone().unwrap().address;
    let before = pool_bytes(&cache);
    let (mine, theirs) = (BlockId(d1.block_ids[0]), BlockId(d2.block_ids[0]));
    let entry = g.latent_bytes_per_token() as u64;
    let at = |b: BlockId| g.latent_block_offset(LayerIdx(0), b) as u64;
    let payload = vec![0x5au8; entry as usize];

    // The token's holder is accepted once and gets the session token.
    let mut holder = connect(&address);
    let (session, session_token) = accepted(&handshake(&mut holder, 1, &d1, d1.transfer_token.clone()));

    // A copy of the used descriptor: its handshake is refused, and its writes (with the descriptor's
    // token, all it has) into r1's own blocks are refused and close the connection.
    let mut copy = connect(&address);
    refused_with(&handshake(&mut copy, 2, &d1, d1.transfer_token.clone()), TransferStatus::AlreadyStarted);
    let token: [u8; 16] = d1.transfer_token.as_slice().try_into().unwrap();
    copy.write_all(&data(WriteHeader { session, token, offset: at(mine), len: entry }, &payload)).unwrap();
    assert!(next_reply(&mut copy).is_none(), "the copy's connection stayed open");

    // The holder's writes: with a wrong, empty or other request's token, refused (the transfer goes on).
    let other: [u8; 16] = d2.transfer_token.as_slice().try_into().unwrap();
    let dropped = recv.stats().dropped_untrusted;
    for token in [[0u8; 16], other, token] {
        holder.write_all(&data(WriteHeader { session, token, offset: at(mine), len: entry }, &payload)).unwrap();
    }
    // A barrier orders the check behind those frames.
    holder.write_all(&BARRIER).unwrap();
    let ack = next_reply(&mut holder).expect("the barrier's answer");
    assert_eq!(ack.correlation_id, 1);
    assert!(pool_bytes(&cache) == before, "a write without the session token landed");
    // Dropped and counted (logged at debug only: a trusted peer may send any number of them).
    assert_eq!(recv.stats().dropped_untrusted, dropped + 3);
    still_pending(&p1);

    // With the session token, aimed at r2's block: refused, and r1 fails (its sender broke the rules);
    // nothing lands, r1's block goes back.
    holder
        .write_all(&data(WriteHeader { session, token: session_token, offset: at(theirs), len: entry }, &payload))
        .unwrap();
    let outcome = p1.wait_timeout(Duration::from_secs(10)).expect("r1 ends");
    assert!(matches!(outcome, Err(TransferError::BadCompletion { .. })), "{outcome:?}");
    assert!(pool_bytes(&cache) == before, "a write outside the granted blocks landed");
    wait_used(&pool, 1);
    still_pending(&p2);

    // The token died with r1: a handshake with it is refused, a write with the old session token dropped.
    let mut late = connect(&address);
    refused_with(&handshake(&mut late, 3, &d1, d1.transfer_token.clone()), TransferStatus::UnknownRequest);
    holder
        .write_all(&data(WriteHeader { session, token: session_token, offset: at(mine), len: entry }, &payload))
        .unwrap();
    holder.write_all(&BARRIER).unwrap();
    // (The receiver's abort of r1 may come first.)
    while next_reply(&mut holder).is_some_and(|m| m.correlation_id != 1) {}
    assert!(pool_bytes(&cache) == before, "a write to a finished transfer landed");

    // Other ways out of the granted block, each on a fresh transfer: into the next block, past the pool's
    // end, a length that wraps around, another block's indexer entry, a length of zero.
    let pool_end = g.total_bytes() as u64;
    let indexer = |b: BlockId| g.indexer_block_offset(LayerIdx(1), b) as u64;
    for (i, (offset_of, len, what)) in [
        (&(|b: BlockId| at(b) + 63 * entry) as &dyn Fn(BlockId) -> u64, 2 * entry, "into the next block"),
        (&|_| pool_end - entry, 2 * entry, "past the pool's end"),
        (&|b| at(b) + entry, u64::MAX - entry + 1, "a wrapping length"),
        (&|b| indexer(BlockId(b.0 ^ 1)), entry, "another block's indexer entry"),
        (&|b| at(b), 0, "nothing"),
    ]
    .into_iter()
    .enumerate()
    {
        let id = format!("out-{i}");
        let (d, p) = expect_checked(&recv, &pool, &id);
        let mut s = connect(&address);
        let (session, token) = accepted(&handshake(&mut s, 1, &d, d.transfer_token.clone()));
        let offset = offset_of(BlockId(d.block_ids[0]));
        let body = vec![0x5au8; len.min(2 * entry) as usize];
        s.write_all(&data(WriteHeader { session, token, offset, len }, &body)).unwrap();
        let outcome = p.wait_timeout(Duration::from_secs(10)).unwrap_or_else(|| panic!("{what}: the transfer went on"));
        assert!(matches!(outcome, Err(TransferError::BadCompletion { .. })), "{what}: {outcome:?}");
        assert!(pool_bytes(&cache) == before, "{what}: the write landed");
        wait_used(&pool, 1);
    }

    honest_transfer(&pool, &d2, p2);
    let (d3, p3) = expect_checked(&recv, &pool, "r3");
    honest_transfer(&pool, &d3, p3);
    assert_eq!(pool.stats().used_blocks, 0);
}

#[test]
fn tokens_die_with_their_reservation() {
    let (recv, pool, cache) = receiver_with_cache();
    let before = pool_bytes(&cache);
    // Expired: the deadline passed before any handshake.
    let blocks = pool.reserve("expired", 64).unwrap();
    let (expired, pe) =
        recv.expect(ExpectRequest { timeout: Duration::from_millis(100), ..expect("expired", blocks) }).unwrap();
    assert!(matches!(pe.wait_timeout(Duration::from_secs(5)), Some(Err(TransferError::DeadlineExceeded(_)))));
    // Aborted by the decode worker (client gone).
    let (aborted, pa) = expect_checked(&recv, &pool, "aborted");
    assert!(pa.abort("client went away"));
    // Freed behind the transfer's back (a decode-worker bug): the token must not open the blocks, which
    // may belong to another request by now.
    let (freed, pf) = expect_checked(&recv, &pool, "freed");
    pool.release("freed").unwrap();
    let (taken, pt) = expect_checked(&recv, &pool, "taken");
    assert_eq!(taken.block_ids, freed.block_ids, "the freed block was reserved again");

    let mut s = connect(&expired.endpoint.clone().unwrap().address);
    refused_with(&handshake(&mut s, 1, &expired, expired.transfer_token.clone()), TransferStatus::UnknownRequest);
    refused_with(&handshake(&mut s, 2, &aborted, aborted.transfer_token.clone()), TransferStatus::UnknownRequest);
    refused_with(&handshake(&mut s, 3, &freed, freed.transfer_token.clone()), TransferStatus::UnknownRequest);
    let outcome = pf.wait_timeout(Duration::from_secs(5)).expect("the orphaned transfer ends");
    assert!(matches!(outcome, Err(TransferError::Aborted { .. })), "{outcome:?}");
    // Refused handshakes, even with a reservation's real token, leave the connection a stranger: its
    // barrier is not answered and closes it.
    s.write_all(&BARRIER).unwrap();
    assert!(next_reply(&mut s).is_none(), "a connection whose handshakes were all refused was trusted");

    assert!(pool_bytes(&cache) == before);
    // The orphan freed nothing: the block is still "taken"'s, whose transfer goes on.
    assert_eq!(pool.stats().used_blocks, 1);
    assert!(pool.holds("taken"));
    still_pending(&pt);
    honest_transfer(&pool, &taken, pt);
    assert_eq!(pool.stats().used_blocks, 0);
}

/// A trusted peer (the sender of another transfer) that sends Complete, Release or Abort for session ids
/// that are not its own learns nothing: a live session, an ended one (its tombstone holds the reason)
/// and one that never existed all answer UNKNOWN_REQUEST, "no such transfer". Only the session's own
/// token gets a live session's answer or an ended one's reason.
#[test]
fn session_messages_without_the_session_token_reveal_nothing() {
    use proto::v1::{TransferAbort, TransferComplete, TransferRelease};
    let (recv, pool, cache) = receiver_with_cache();
    let (d1, p1) = expect_checked(&recv, &pool, "r1");
    let (d2, p2) = expect_checked(&recv, &pool, "r2");
    let address = d1.endpoint.clone().unwrap().address;
    let before = pool_bytes(&cache);
    let mut prober = connect(&address);
    let (s1, t1) = accepted(&handshake(&mut prober, 1, &d1, d1.transfer_token.clone()));
    let mut owner = connect(&address);
    let (s2, t2) = accepted(&handshake(&mut owner, 1, &d2, d2.transfer_token.clone()));
    assert!(s1.abs_diff(s2) > 1 << 20, "session ids are not sequential: {s1}, {s2}");

    let probes = |session: u64, token: &[u8; 16]| {
        let token = token.to_vec();
        [
            Body::Complete(TransferComplete {
                session_id: session,
                session_token: token.clone(),
                ..Default::default()
            }),
            Body::Release(TransferRelease { session_id: session, session_token: token.clone(), ..Default::default() }),
            Body::Abort(TransferAbort { session_id: session, session_token: token, ..Default::default() }),
        ]
    };
    let answer = |s: &mut TcpStream, corr: u64, body: Body| -> (i32, String) {
        s.write_all(&ctl(corr, body)).unwrap();
        loop {
            let m = next_reply(s).expect("an answer");
            if m.correlation_id == corr {
                let Some(Body::Ack(a)) = m.body else { panic!("expected an Ack, got {m:?}") };
                return (a.status, a.message);
            }
        }
    };
    let nothing = (TransferStatus::UnknownRequest as i32, "no such transfer".to_string());
    let mut corr = 10;
    // r2 is live: with r1's session token (or a flipped one of r2's), nothing but "no such transfer".
    let never = s1.wrapping_add(s2) | 1;
    for (session, token, what) in [(s2, t1, "r2 with r1's token"), (never, t1, "a session that never existed")] {
        for body in probes(session, &token) {
            corr += 1;
            assert_eq!(answer(&mut prober, corr, body), nothing, "{what}");
        }
    }
    let flipped2: [u8; 16] = flipped(&t2).try_into().unwrap();
    for body in probes(s2, &flipped2) {
        corr += 1;
        assert_eq!(answer(&mut owner, corr, body), nothing, "r2 with a flipped token");
    }
    still_pending(&p2);

    // r2 ends (client gone): its tombstone's reason goes to r2's token only.
    assert!(p2.abort("the client went away"));
    wait_used(&pool, 1);
    for body in probes(s2, &t1) {
        corr += 1;
        assert_eq!(answer(&mut prober, corr, body), nothing, "ended r2 with r1's token");
    }
    corr += 1;
    let body = Body::Release(TransferRelease { session_id: s2, session_token: t2.to_vec(), ..Default::default() });
    let (status, why) = answer(&mut owner, corr, body);
    assert_eq!(status, TransferStatus::Aborted as i32, "{why}");
    assert!(why.contains("the client went away"), "{why}");

    assert!(pool_bytes(&cache) == before);
    still_pending(&p1);
    drop(prober);
    let outcome = p1.wait_timeout(Duration::from_secs(10)).expect("r1 ends with its connection");
    assert!(matches!(outcome, Err(TransferError::PeerLost { .. })), "{outcome:?}");
    wait_used(&pool, 0);
}

/// A sender that stops in the middle of a data frame holds that write's permit: the transfer's blocks
/// come back anyway. Aborted (client gone), its sender is cut off after `abort_ack_timeout`; not
/// aborted, its connection is dropped once the frame stalled for `write_stall`.
#[test]
fn a_sender_stalled_mid_frame_does_not_pin_the_blocks() {
    let g = testkit::geometry(2, 16);
    let (cache, pool) = testkit::filled_cache(g, 7);
    let cfg = ReceiverConfig {
        abort_ack_timeout: Duration::from_millis(300),
        write_stall: Duration::from_secs(600),
        ..ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()))
    };
    let recv = KvReceiver::start(cfg, cache.clone(), pool.clone(), testkit::fingerprint(&g)).unwrap();
    let entry = g.latent_bytes_per_token() as u64;
    let stall_in = |d: &TransferDescriptor| -> TcpStream {
        let mut s = connect(&d.endpoint.clone().unwrap().address);
        let (session, token) = accepted(&handshake(&mut s, 1, d, d.transfer_token.clone()));
        let offset = g.latent_block_offset(LayerIdx(0), BlockId(d.block_ids[0])) as u64;
        let mut frame = data(WriteHeader { session, token, offset, len: 4 * entry }, &vec![0x5a; entry as usize]);
        frame.truncate(frame.len() - 1);
        s.write_all(&frame).unwrap();
        s
    };

    // Aborted while its sender sits in the frame: cut off after abort_ack_timeout, blocks back.
    let (d1, p1) = expect_checked(&recv, &pool, "r1");
    let _held = stall_in(&d1);
    std::thread::sleep(Duration::from_millis(200));
    assert!(p1.abort("the client went away"));
    wait_used(&pool, 0);
    assert_eq!(recv.stats().cut_off_peers, 1);

    // Not aborted: the frame's stall drops the connection, the transfer fails, blocks back.
    let cfg = ReceiverConfig {
        write_stall: Duration::from_millis(300),
        ..ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()))
    };
    let (cache, pool) = testkit::filled_cache(g, 7);
    let recv = KvReceiver::start(cfg, cache, pool.clone(), testkit::fingerprint(&g)).unwrap();
    let (d2, p2) = expect_checked(&recv, &pool, "r2");
    let _held = stall_in(&d2);
    let outcome = p2.wait_timeout(Duration::from_secs(10)).expect("the stalled transfer ends");
    assert!(
        matches!(&outcome, Err(TransferError::PeerLost { reason, .. }) if reason.contains("stalled")),
        "{outcome:?}"
    );
    wait_used(&pool, 0);
}
