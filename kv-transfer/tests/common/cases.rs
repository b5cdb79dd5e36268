//! Transfer scenarios, run once per transport (see `transfer.rs`).

use std::time::{Duration, Instant};

use kv_cache::{BlockTable, LayerIdx};
use kv_transfer::{ExpectRequest, Fault, RejectStatus, TransferError, TransferOutcome};
use proto::v1::{FinishReason, GeneratedToken, Logprobs, MtpDraft, TokenLogprob};

use super::*;

fn expect(
    p: &Pair,
    id: &str,
    table: &BlockTable,
    tokens: usize,
    timeout: Duration,
    checksum: bool,
) -> (proto::v1::TransferDescriptor, kv_transfer::PendingTransfer) {
    p.recv
        .expect(ExpectRequest {
            request_id: id.into(),
            blocks: table.clone(),
            num_tokens: tokens,
            timeout,
            verify_checksum: checksum,
        })
        .unwrap()
}

fn first_token() -> GeneratedToken {
    GeneratedToken {
        token_id: 4242,
        logprobs: Some(Logprobs {
            chosen: Some(TokenLogprob { token_id: 4242, logprob: -0.25 }),
            top: vec![TokenLogprob { token_id: 4242, logprob: -0.25 }, TokenLogprob { token_id: 7, logprob: -1.5 }],
        }),
    }
}

fn draft() -> Option<MtpDraft> {
    Some(MtpDraft { token_id: 99, prob: 0.75 })
}

/// A full transfer into blocks that differ from the source's, with a partial last block, verified byte
/// for byte and by checksum; the first token, logprobs and draft arrive intact; blocks stay reserved.
pub fn completes_with_partial_last_block(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    p.rpool.reserve("other", 64 * 3).unwrap(); // destination ids start at 3
    p.spool.reserve("gap", 64).unwrap();
    let tokens = 64 * 5 + 17;
    let (dst, src) = reserve(&p, "r1", tokens);
    let (desc, pending) = expect(&p, "r1", &dst, tokens, Duration::from_secs(10), true);
    let s = p.sender.begin(&desc, &src).unwrap();
    put_all(&s, 4);
    let report = s.complete(first_token(), draft()).unwrap();
    assert_eq!(report.bytes, 4 * (tokens as u64 * 656 + 6 * 8448));
    let out = pending.wait_timeout(Duration::from_secs(10)).expect("outcome").unwrap();
    let TransferOutcome::Completed(c) = out else { panic!("expected completion, got {out:?}") };
    assert_eq!(c.first_token, first_token());
    assert_eq!(c.draft, draft());
    assert!(c.checksum_verified);
    assert_eq!(c.bytes, report.bytes);
    assert_landed(&p, &desc, &src);
    assert_eq!(p.rpool.stats().used_blocks, 3 + 6, "completed blocks stay with the request");
    assert_eq!(p.recv.stats().pending, 0);
    p.rpool.release("r1").unwrap();
}

/// Five tokens: one partial block per layer.
pub fn prompt_shorter_than_one_block(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let (dst, src) = reserve(&p, "short", 5);
    let (desc, pending) = expect(&p, "short", &dst, 5, Duration::from_secs(10), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    put_all(&s, 4);
    s.complete(first_token(), None).unwrap();
    let TransferOutcome::Completed(c) = pending.wait_timeout(Duration::from_secs(10)).unwrap().unwrap() else {
        panic!()
    };
    assert_eq!(c.draft, None);
    assert!(!c.checksum_verified);
    assert_landed(&p, &desc, &src);
}

/// 128K tokens (2 layers to stay fast): 2048 blocks per layer, shipped as one run per region.
pub fn long_prompt_128k_tokens(kind: &Kind) {
    let o = Opts { layers: 2, recv_blocks: 2048 + 8, send_blocks: 2048, ..Default::default() };
    let Some(p) = pair(kind, o) else { return };
    p.rpool.reserve("pad", 64 * 8).unwrap();
    let tokens = 128 * 1024;
    let (dst, src) = reserve(&p, "long", tokens);
    let (desc, pending) = expect(&p, "long", &dst, tokens, Duration::from_secs(60), true);
    let s = p.sender.begin(&desc, &src).unwrap();
    put_all(&s, 2);
    s.complete(first_token(), draft()).unwrap();
    let out = pending.wait_timeout(Duration::from_secs(60)).unwrap().unwrap();
    assert!(matches!(out, TransferOutcome::Completed(ref c) if c.checksum_verified));
    assert_landed(&p, &desc, &src);
}

/// Prefill ended the request: the receiver frees the reservation and reports the first token.
pub fn release_frees_the_reservation(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let (dst, src) = reserve(&p, "rel", 100);
    let (desc, pending) = expect(&p, "rel", &dst, 100, Duration::from_secs(10), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    s.put_layer(LayerIdx(0)).unwrap();
    s.release(first_token(), FinishReason::Stop).unwrap();
    let out = pending.wait_timeout(Duration::from_secs(10)).unwrap().unwrap();
    let TransferOutcome::Released(r) = out else { panic!("{out:?}") };
    assert_eq!((r.first_token, r.finish_reason), (first_token(), FinishReason::Stop));
    wait_pool_used(&p.rpool, 0, Duration::from_secs(5));
    assert_eq!(p.recv.stats().released, 1);
}

/// Nobody connects: the deadline fails the transfer and frees its blocks.
pub fn deadline_expires_without_a_sender(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let (dst, _) = reserve(&p, "late", 300);
    let t0 = Instant::now();
    let (desc, pending) = expect(&p, "late", &dst, 300, Duration::from_millis(200), false);
    let e = pending.wait_timeout(Duration::from_secs(5)).expect("bounded").unwrap_err();
    assert_eq!(e, TransferError::DeadlineExceeded("late".into()));
    assert!(t0.elapsed() < Duration::from_secs(2));
    wait_pool_used(&p.rpool, 0, Duration::from_secs(2));
    // A sender arriving after the deadline is refused before writing.
    let src = p.spool.table("late").unwrap();
    assert!(p.sender.begin(&desc, &src).is_err());
}

/// The sender stalls mid-transfer; the deadline passes. The receiver reports the deadline, the sender's
/// later calls fail in bounded time, and blocks reused by another request never see a late write.
pub fn deadline_mid_transfer_and_no_late_write(kind: &Kind) {
    let mut scfg = kind.sender_config();
    scfg.fault = Some(Fault::StallAfterLayer(1, Duration::from_millis(1500)));
    let Some(p) = pair(kind, Opts { sender: Some(scfg), ..Default::default() }) else { return };
    let tokens = 64 * 10;
    let (dst, src) = reserve(&p, "stall", tokens);
    let (desc, pending) = expect(&p, "stall", &dst, tokens, Duration::from_millis(600), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    put_all(&s, 4);
    let e = pending.wait_timeout(Duration::from_secs(5)).expect("bounded").unwrap_err();
    assert_eq!(e, TransferError::DeadlineExceeded("stall".into()));
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
    // Another request takes the same blocks and fills them; the stalled sender's remaining layers
    // (2 and 3) must not land there.
    let again = p.rpool.reserve("next", tokens).unwrap();
    assert_eq!(again, dst, "the allocator hands the freed blocks out again");
    kv_transfer::testkit::fill(&p.rcache, 77);
    let before = arena_hash(&p.rcache);
    let t0 = Instant::now();
    let r = s.complete(first_token(), None);
    assert!(t0.elapsed() < Duration::from_secs(4), "complete must return in bounded time");
    assert!(
        matches!(r, Err(TransferError::DeadlineExceeded(_)) | Err(TransferError::Aborted { .. })),
        "sender sees the abort: {r:?}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(arena_hash(&p.rcache), before, "a late write landed in reused blocks");
    p.rpool.release("next").unwrap();
}

/// The decode worker's client goes away mid-transfer.
pub fn client_abort_mid_transfer(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let (dst, src) = reserve(&p, "gone", 64 * 4);
    let (desc, pending) = expect(&p, "gone", &dst, 64 * 4, Duration::from_secs(10), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    s.put_layer(LayerIdx(0)).unwrap();
    s.put_layer(LayerIdx(1)).unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(p.recv.abort("gone", "client disconnected"));
    let e = pending.wait_timeout(Duration::from_secs(5)).unwrap().unwrap_err();
    assert!(matches!(e, TransferError::Aborted { .. }), "{e:?}");
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
    // The sender learns it at its next call, in bounded time.
    let t0 = Instant::now();
    let mut r = Ok(());
    for l in 2..4 {
        r = r.and(s.put_layer(LayerIdx(l)));
    }
    let done = s.complete(first_token(), None);
    assert!(r.is_err() || done.is_err(), "the sender must see the abort");
    assert!(matches!(done, Err(TransferError::Aborted { .. })), "{done:?}");
    assert!(t0.elapsed() < Duration::from_secs(3));
    assert!(!p.recv.abort("gone", "again"), "nothing left to abort");
}

/// Prefill failed: the sender aborts, the receiver reports it and frees the blocks.
pub fn sender_abort(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let (dst, src) = reserve(&p, "sab", 64);
    let (desc, pending) = expect(&p, "sab", &dst, 64, Duration::from_secs(10), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    s.put_layer(LayerIdx(0)).unwrap();
    s.abort("prefill failed").unwrap();
    let e = pending.wait_timeout(Duration::from_secs(5)).unwrap().unwrap_err();
    assert!(matches!(&e, TransferError::Aborted { reason, .. } if reason.contains("prefill failed")), "{e:?}");
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
}

/// Every bad descriptor is refused before a single byte reaches the receiver's memory.
pub fn bad_descriptors_rejected_before_any_write(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let (dst, src) = reserve(&p, "good", 200);
    let (desc, pending) = expect(&p, "good", &dst, 200, Duration::from_secs(20), false);
    let before = arena_hash(&p.rcache);
    let rejected = |d: &proto::v1::TransferDescriptor, what: &str| -> TransferError {
        match p.sender.begin(d, &src) {
            Ok(_) => panic!("{what}: accepted"),
            Err(e) => e,
        }
    };
    let mut d = desc.clone();
    d.request_id = "nobody".into();
    let unknown = rejected(&d, "unknown request");
    assert!(matches!(unknown, TransferError::Rejected { status: RejectStatus::UnknownRequest, .. }), "{unknown:?}");
    let mut d = desc.clone();
    d.transfer_token[0] ^= 1;
    let e = rejected(&d, "wrong token");
    // The same answer as for an unknown request: a stranger learns nothing about which ids are awaited.
    match (&e, &unknown) {
        (
            TransferError::Rejected { status: RejectStatus::UnknownRequest, message: m, .. },
            TransferError::Rejected { message: m_unknown, .. },
        ) => assert_eq!(m, m_unknown),
        _ => panic!("wrong token: {e:?}"),
    }
    let mut d = desc.clone();
    d.transfer_token.clear();
    assert!(matches!(rejected(&d, "no token"), TransferError::BadDescriptor { .. }));
    let mut d = desc.clone();
    d.block_ids[1] = 64; // pool has 64 blocks
    assert!(matches!(rejected(&d, "out of range"), TransferError::BadDescriptor { .. }));
    let mut d = desc.clone();
    d.num_tokens = 1000;
    assert!(matches!(rejected(&d, "wrong size"), TransferError::BadDescriptor { .. }));
    let mut d = desc.clone();
    d.layout.as_mut().unwrap().num_layers = 5;
    assert!(matches!(rejected(&d, "layer count"), TransferError::BadDescriptor { .. }));
    let mut d = desc.clone();
    d.layout.as_mut().unwrap().latent_bytes_per_token = 2304;
    assert!(matches!(rejected(&d, "entry size"), TransferError::BadDescriptor { .. }));
    let mut d = desc.clone();
    d.fingerprint.as_mut().unwrap().checkpoint_hash = "feedface".into();
    assert!(matches!(rejected(&d, "fingerprint"), TransferError::FingerprintMismatch(_)));
    // Blocks that are in range but not the reservation's: the receiver refuses them.
    let mut d = desc.clone();
    d.block_ids.swap(0, 3);
    let e = rejected(&d, "other blocks");
    assert!(matches!(e, TransferError::Rejected { status: RejectStatus::BadBlocks, .. }), "{e:?}");
    assert_eq!(arena_hash(&p.rcache), before, "a rejected sender wrote into the receiver's memory");
    // The token-matching sender with the wrong blocks failed the transfer; it freed the blocks.
    let e = pending.wait_timeout(Duration::from_secs(5)).unwrap().unwrap_err();
    assert!(matches!(e, TransferError::Rejected { status: RejectStatus::BadBlocks, .. }), "{e:?}");
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
    assert!(p.recv.stats().rejected_handshakes >= 3);
    // A mismatched receiver fingerprint (another model) is refused by the receiver too.
    let (dst, src) = reserve(&p, "fp", 64);
    let (desc, pending) = expect(&p, "fp", &dst, 64, Duration::from_secs(20), false);
    let mut fp = kv_transfer::testkit::fingerprint(p.scache.geometry());
    fp.checkpoint_hash = "another-model".into();
    let other = kv_transfer::KvSender::new(p.kind.sender_config(), p.scache.clone(), fp).unwrap();
    let mut d = desc.clone();
    d.fingerprint.as_mut().unwrap().checkpoint_hash = "another-model".into(); // pass the local check
    let e = other.begin(&d, &src).map(|_| ()).unwrap_err();
    assert!(matches!(e, TransferError::Rejected { status: RejectStatus::FingerprintMismatch, .. }), "{e:?}");
    assert!(pending.wait_timeout(Duration::from_secs(5)).unwrap().is_err());
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
    assert_eq!(arena_hash(&p.rcache), before);
}

/// API misuse is a typed error, and the receiver never schedules an incomplete request.
pub fn incomplete_sessions_are_refused(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let (dst, src) = reserve(&p, "inc", 64);
    let (desc, pending) = expect(&p, "inc", &dst, 64, Duration::from_secs(10), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    s.put_layer(LayerIdx(0)).unwrap();
    assert!(matches!(s.put_layer(LayerIdx(0)), Err(TransferError::Usage { .. })), "a layer twice");
    assert!(matches!(s.put_layer(LayerIdx(4)), Err(TransferError::Usage { .. })), "a layer out of range");
    let e = s.complete(first_token(), None).unwrap_err();
    assert!(matches!(e, TransferError::Usage { .. }), "{e:?}");
    // The failed completion aborts the session; the receiver frees the blocks.
    let e = pending.wait_timeout(Duration::from_secs(5)).unwrap().unwrap_err();
    assert!(matches!(e, TransferError::Aborted { .. }), "{e:?}");
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
}

/// Many requests at once share the connection; every one completes and the pool balances.
pub fn concurrent_requests(kind: &Kind) {
    let Some(p) = pair(kind, Opts { recv_blocks: 128, send_blocks: 128, ..Default::default() }) else { return };
    let p = std::sync::Arc::new(p);
    let handles: Vec<_> = (0..6)
        .map(|i| {
            let p = p.clone();
            std::thread::spawn(move || {
                let id = format!("c{i}");
                let tokens = 64 * (i + 1) + i;
                let (dst, src) = reserve(&p, &id, tokens);
                let (desc, pending) = expect(&p, &id, &dst, tokens, Duration::from_secs(20), true);
                let s = p.sender.begin(&desc, &src).unwrap();
                put_all(&s, 4);
                s.complete(first_token(), None).unwrap();
                assert!(matches!(
                    pending.wait_timeout(Duration::from_secs(20)).unwrap(),
                    Ok(TransferOutcome::Completed(_))
                ));
                (desc, src)
            })
        })
        .collect();
    for h in handles {
        let (desc, src) = h.join().unwrap();
        assert_landed(&p, &desc, &src);
        p.rpool.release(&desc.request_id).unwrap();
    }
    wait_pool_used(&p.rpool, 0, Duration::from_secs(1));
}

/// A layer handed over with a pending marker is shipped only once the marker is reached: bytes written
/// after the hand-over (as a GPU stream writes them after the compute thread moved on) are what lands.
pub fn layers_wait_for_their_completion_marker(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let tokens = 64 * 2 + 5;
    let (dst, src) = reserve(&p, "fenced", tokens);
    let (desc, pending) = expect(&p, "fenced", &dst, tokens, Duration::from_secs(10), true);
    let s = p.sender.begin(&desc, &src).unwrap();
    let fence = std::sync::Arc::new(kv_transfer::testkit::Gate::default());
    let t0 = Instant::now();
    s.put_layer_when(LayerIdx(0), kv_cache::LayerReady::pending(fence.clone())).unwrap();
    assert!(t0.elapsed() < Duration::from_millis(100), "put_layer_when must not wait for the marker");
    for l in 1..4 {
        s.put_layer(LayerIdx(l)).unwrap();
    }
    // Give a shipper that ignored the marker time to ship layer 0's old bytes, then "write" the layer
    // (through copy_in: the pool may be device memory).
    std::thread::sleep(Duration::from_millis(200));
    let g = *p.scache.geometry();
    let per = g.latent_bytes_per_token();
    for &b in &src.blocks {
        let latent: Vec<u8> =
            (0..64 * per).map(|i| ((i % per) as u8).wrapping_mul(31).wrapping_add((i / per) as u8) ^ 0x5a).collect();
        write(&p.scache, g.latent_block_offset(LayerIdx(0), b), &latent);
        write(&p.scache, g.indexer_block_offset(LayerIdx(0), b), &vec![0xc3; g.indexer_bytes_per_block()]);
    }
    fence.open();
    s.complete(first_token(), draft()).unwrap();
    let out = pending.wait_timeout(Duration::from_secs(10)).expect("outcome").unwrap();
    assert!(matches!(out, TransferOutcome::Completed(ref c) if c.checksum_verified), "{out:?}");
    assert_landed(&p, &desc, &src);
}

/// Layers ship as their markers are reached, not at completion: layer 0 is in the receiver while layer
/// 1's marker is still pending and the later layers are not even queued. (Counted where writes pass
/// through the receiver; one-sided puts into a host pool are invisible to it, so there the case checks
/// only that every layer lands.)
pub fn layers_stream_as_their_markers_are_reached(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let tokens = 64 * 3 + 7;
    let layer_bytes = tokens as u64 * 656 + 4 * 8448;
    let (dst, src) = reserve(&p, "stream", tokens);
    let (desc, pending) = expect(&p, "stream", &dst, tokens, Duration::from_secs(20), true);
    let s = p.sender.begin(&desc, &src).unwrap();
    let fence = std::sync::Arc::new(kv_transfer::testkit::Gate::default());
    s.put_layer(LayerIdx(0)).unwrap();
    s.put_layer_when(LayerIdx(1), kv_cache::LayerReady::pending(fence.clone())).unwrap();
    let one_sided = kind.data_path() == Some(kv_transfer::transport::ucx::DataPath::Put) && !kind.on_device().1;
    if !one_sided {
        let until = Instant::now() + Duration::from_secs(10);
        while p.recv.stats().bytes_received < layer_bytes {
            assert!(Instant::now() < until, "layer 0 did not arrive before layer 1's marker was reached");
            std::thread::sleep(Duration::from_millis(5));
        }
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(p.recv.stats().bytes_received, layer_bytes, "only layer 0 may ship while layer 1 waits");
        assert_layer_landed(&p, &desc, &src, LayerIdx(0));
    }
    fence.open();
    for l in 2..4 {
        s.put_layer(LayerIdx(l)).unwrap();
    }
    s.complete(first_token(), None).unwrap();
    let out = pending.wait_timeout(Duration::from_secs(10)).expect("outcome").unwrap();
    assert!(matches!(out, TransferOutcome::Completed(ref c) if c.checksum_verified), "{out:?}");
    assert_landed(&p, &desc, &src);
}

/// The sender's device copier fails mid-transfer: `complete` names the failure and the blocks go the way
/// of any shipping failure (a layer whose marker failed): the sender skips its abort after a shipping
/// error, so the receiver fails the transfer at its deadline and frees the blocks then. The next transfer
/// from the same sender works (no staging buffer was lost).
pub fn sender_copier_failure(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let dev = p.sdev.clone().expect("a device sender");
    let tokens = 64 * 8 + 3;
    let (dst, src) = reserve(&p, "bad-read", tokens);
    let (desc, pending) = expect(&p, "bad-read", &dst, tokens, Duration::from_millis(1500), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    dev.fail_reads_after(3); // layer 0's two puts, then one of layer 1's
    // Once the shipping thread has failed, a later put may already be refused with the same failure.
    for l in 0..4 {
        if let Err(e) = s.put_layer(LayerIdx(l)) {
            assert!(e.to_string().contains("read failed"), "put of layer {l} refused for another reason: {e}");
        }
    }
    let e = s.complete(first_token(), None).unwrap_err();
    let TransferError::Transport(msg) = &e else { panic!("{e:?}") };
    assert!(msg.contains("bad-read") && msg.contains("device 0") && msg.contains("read failed"), "{msg}");
    let e = pending.wait_timeout(Duration::from_secs(5)).expect("bounded").unwrap_err();
    assert_eq!(e, TransferError::DeadlineExceeded("bad-read".into()));
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
    assert_eq!(p.recv.stats().pending, 0);
    dev.heal();
    p.spool.release("bad-read").unwrap();
    next_transfer_completes(&p, "after-bad-read");
}

/// The receiver's device copier fails mid-transfer: the receiver fails the transfer naming the failure,
/// frees the blocks once writes in progress end, and the sender learns it; the next transfer works.
pub fn receiver_copier_failure(kind: &Kind) {
    let Some(p) = pair(kind, Opts::default()) else { return };
    let dev = p.rdev.clone().expect("a device receiver");
    let tokens = 64 * 8 + 3;
    let (dst, src) = reserve(&p, "bad-write", tokens);
    let (desc, pending) = expect(&p, "bad-write", &dst, tokens, Duration::from_secs(10), false);
    let s = p.sender.begin(&desc, &src).unwrap();
    dev.fail_writes_after(2);
    put_all(&s, 4);
    let r = s.complete(first_token(), None);
    let e = pending.wait_timeout(Duration::from_secs(5)).expect("bounded").unwrap_err();
    let TransferError::Transport(msg) = &e else { panic!("{e:?}") };
    assert!(msg.contains("bad-write") && msg.contains("device 0") && msg.contains("write failed"), "{msg}");
    let sent = r.expect_err("the sender must see the receiver's failure").to_string();
    assert!(sent.contains("write failed"), "{sent}");
    wait_pool_used(&p.rpool, 0, Duration::from_secs(3));
    assert_eq!(p.recv.stats().pending, 0);
    dev.heal();
    p.spool.release("bad-write").unwrap();
    next_transfer_completes(&p, "after-bad-write");
}

fn next_transfer_completes(p: &Pair, id: &str) {
    let tokens = 64 * 20 + 1;
    let (dst, src) = reserve(p, id, tokens);
    let (desc, pending) = expect(p, id, &dst, tokens, Duration::from_secs(10), true);
    let s = p.sender.begin(&desc, &src).unwrap();
    put_all(&s, 4);
    s.complete(first_token(), None).unwrap();
    let out = pending.wait_timeout(Duration::from_secs(10)).expect("outcome").unwrap();
    assert!(matches!(out, TransferOutcome::Completed(ref c) if c.checksum_verified), "{out:?}");
    assert_landed(p, &desc, &src);
    p.rpool.release(id).unwrap();
}
