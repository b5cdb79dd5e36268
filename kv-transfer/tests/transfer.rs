//! Transfer scenarios over every transport in one process: in-process, TCP, and UCX over its tcp and
//! shared-memory transports, with one-sided puts and (over tcp) with active-message data, and striped over
//! several lanes (skipped with a printed reason where libucp is missing).

#[macro_use]
mod common;

use common::Kind;

transport_tests!(inproc, Kind::InProc);
transport_tests!(tcp, Kind::Tcp);
transport_tests!(tcp_striped, Kind::Striped(Box::new(Kind::Tcp), 3));
transport_tests!(ucx_tcp, Kind::Ucx("tcp"));
transport_tests!(ucx_shm, Kind::Ucx("sm,self"));
transport_tests!(ucx_tcp_am, Kind::UcxAm("tcp"));
transport_tests!(ucx_tcp_am_striped, Kind::Striped(Box::new(Kind::UcxAm("tcp")), 3));
transport_tests!(ucx_shm_striped, Kind::Striped(Box::new(Kind::Ucx("sm,self")), 3));
