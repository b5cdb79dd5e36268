//! kv-transfer moves host memory only (for now): a pool in device memory is refused with the reason.

use kv_transfer::{KvReceiver, ReceiverConfig, TcpConfig, TransportConfig, testkit};

#[test]
fn a_pool_in_device_memory_is_refused_by_both_sides_with_the_reason() {
    use std::ptr::NonNull;
    use std::sync::Arc;

    use kv_cache::{KvArena, KvCache, MemoryKind};
    use kv_transfer::{KvSender, SenderConfig};

    let g = testkit::geometry(2, 4);
    // A stand-in device pointer that is never dereferenced: both sides must refuse before touching it.
    let arena = unsafe {
        KvArena::from_raw_parts(NonNull::dangling(), g.total_bytes(), MemoryKind::Device { ordinal: 1 }, Box::new(()))
    };
    let cache = Arc::new(KvCache::with_arena(g, arena).unwrap());
    let (_, pool) = testkit::filled_cache(g, 1);
    let cfg = ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()));
    let e = KvReceiver::start(cfg, cache.clone(), pool, testkit::fingerprint(&g)).err().expect("refused").to_string();
    assert!(e.contains("device 1") && e.contains("host memory only"), "{e}");
    let e = KvSender::new(SenderConfig::default(), cache, testkit::fingerprint(&g)).err().expect("refused").to_string();
    assert!(e.contains("device 1"), "{e}");
}
