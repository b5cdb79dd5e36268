//! Cache pools in device memory move staged through host memory, with the guarantees of host pools: every
//! scenario of `transfer.rs` with the sender's pool, the receiver's or both in a simulated device
//! (`testkit::SimulatedDevice`: kind `Device { ordinal: 0 }`, reachable only through its `DeviceCopy`), over
//! TCP and UCX (one-sided puts from staging buffers, active messages into staging buffers, several lanes),
//! and a copier that fails mid-transfer on either side. UCX cases skip with a printed reason where libucp
//! is missing (and fail under `CI`).

#[macro_use]
mod common;

use common::{Kind, OnDevice, cases};

fn dev(k: Kind, on: OnDevice) -> Kind {
    Kind::Device(Box::new(k), on)
}

fn striped(k: Kind) -> Kind {
    Kind::Striped(Box::new(k), 3)
}

transport_tests!(inproc_both, dev(Kind::InProc, OnDevice::Both));
transport_tests!(tcp_sender, dev(Kind::Tcp, OnDevice::Sender));
transport_tests!(tcp_receiver, dev(Kind::Tcp, OnDevice::Receiver));
transport_tests!(tcp_both, dev(Kind::Tcp, OnDevice::Both));
transport_tests!(tcp_striped_both, dev(striped(Kind::Tcp), OnDevice::Both));
// One-sided puts from the sender's staging buffers into a registered host pool.
transport_tests!(ucx_tcp_sender, dev(Kind::Ucx("tcp"), OnDevice::Sender));
// A sender configured for puts meets an unregistered device pool: it sends active messages instead.
transport_tests!(ucx_tcp_receiver, dev(Kind::Ucx("tcp"), OnDevice::Receiver));
transport_tests!(ucx_tcp_am_both, dev(Kind::UcxAm("tcp"), OnDevice::Both));
transport_tests!(ucx_tcp_am_striped_both, dev(striped(Kind::UcxAm("tcp")), OnDevice::Both));
transport_tests!(ucx_shm_striped_both, dev(striped(Kind::Ucx("sm,self")), OnDevice::Both));

mod copier_failure {
    use super::*;

    #[test]
    fn tcp_sender_read_fails() {
        cases::sender_copier_failure(&dev(Kind::Tcp, OnDevice::Sender))
    }
    #[test]
    fn tcp_receiver_write_fails() {
        cases::receiver_copier_failure(&dev(Kind::Tcp, OnDevice::Receiver))
    }
    #[test]
    fn ucx_tcp_put_sender_read_fails() {
        cases::sender_copier_failure(&dev(Kind::Ucx("tcp"), OnDevice::Sender))
    }
    #[test]
    fn ucx_tcp_am_sender_read_fails() {
        cases::sender_copier_failure(&dev(Kind::UcxAm("tcp"), OnDevice::Both))
    }
    #[test]
    fn ucx_tcp_receiver_write_fails() {
        cases::receiver_copier_failure(&dev(Kind::Ucx("tcp"), OnDevice::Receiver))
    }
    #[test]
    fn ucx_shm_striped_receiver_write_fails() {
        cases::receiver_copier_failure(&dev(striped(Kind::UcxAm("sm,self")), OnDevice::Both))
    }
}
