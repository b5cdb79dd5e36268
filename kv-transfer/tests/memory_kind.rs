//! Which pools kv-transfer moves: host memory, and device memory with a `DeviceCopy` (staged through host
//! memory); a device pool nothing on the host can reach is refused by both sides with the reason.

use std::ptr::NonNull;
use std::sync::Arc;

use kv_cache::{KvArena, KvCache, MemoryKind};
use kv_transfer::{KvReceiver, KvSender, ReceiverConfig, SenderConfig, TcpConfig, TransportConfig, testkit};

#[test]
fn a_device_pool_without_a_copier_is_refused_by_both_sides_with_the_reason() {
    let g = testkit::geometry(2, 4);
    // A stand-in device pointer that is never dereferenced: both sides must refuse before touching it.
    let arena = unsafe {
        KvArena::from_raw_parts(NonNull::dangling(), g.total_bytes(), MemoryKind::Device { ordinal: 1 }, Box::new(()))
    };
    let cache = Arc::new(KvCache::with_arena(g, arena).unwrap());
    let (_, pool) = testkit::filled_cache(g, 1);
    let cfg = ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()));
    let e = KvReceiver::start(cfg, cache.clone(), pool, testkit::fingerprint(&g)).err().expect("refused").to_string();
    assert!(e.contains("device 1") && e.contains("host memory only") && e.contains("DeviceCopy"), "{e}");
    let e = KvSender::new(SenderConfig::default(), cache, testkit::fingerprint(&g)).err().expect("refused").to_string();
    assert!(e.contains("device 1"), "{e}");
}

#[test]
fn a_device_pool_with_a_copier_is_accepted_by_both_sides() {
    let g = testkit::geometry(2, 4);
    let (cache, pool, _dev) = testkit::device_cache(g, 1);
    assert!(cache.stages_through_host() && cache.host().is_err());
    let cfg = ReceiverConfig::new(TransportConfig::Tcp(TcpConfig::default()));
    KvReceiver::start(cfg, cache.clone(), pool, testkit::fingerprint(&g)).expect("receiver");
    KvSender::new(SenderConfig::default(), cache, testkit::fingerprint(&g)).expect("sender");
}
