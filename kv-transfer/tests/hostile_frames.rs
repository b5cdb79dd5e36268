//! Frames a stranger (or a broken sender) writes to the decode worker's TCP listener: nothing before a
//! valid handshake is answered, and a peer that does not read its replies is disconnected instead of
//! growing the receiver's memory.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_cache::BlockPool;
use kv_transfer::{ExpectRequest, KvReceiver, ReceiverConfig, TcpConfig, TransportConfig, testkit};
use prost::Message;
use proto::v1::transfer_control::Body;
use proto::v1::{TransferBegin, TransferControl};

const BARRIER: [u8; 9] = [3, 1, 0, 0, 0, 0, 0, 0, 0];

fn receiver() -> (KvReceiver, Arc<BlockPool>) {
    let g = testkit::geometry(2, 16);
    let (cache, pool) = testkit::filled_cache(g, 7);
    let cfg = ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()));
    let recv = KvReceiver::start(cfg, cache, pool.clone(), testkit::fingerprint(&g)).unwrap();
    (recv, pool)
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
    // The right token (so the connection is trusted), a layout that does not match: refused, but the
    // peer proved it holds the descriptor.
    let begin = TransferControl {
        correlation_id: 1,
        body: Some(Body::Begin(TransferBegin {
            request_id: "r2".into(),
            transfer_token: desc.transfer_token,
            ..Default::default()
        })),
    };
    let bytes = begin.encode_to_vec();
    let mut frame = vec![1u8];
    frame.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    frame.extend_from_slice(&bytes);
    s.write_all(&frame).unwrap();
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
