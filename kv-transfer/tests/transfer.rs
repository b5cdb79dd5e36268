//! Transfer scenarios over every transport in one process: in-process, TCP, and UCX over its tcp and
//! shared-memory transports, with one-sided puts and (over tcp) with active-message data, and striped over
//! several lanes (skipped with a printed reason where libucp is missing).

mod common;

use common::{Kind, cases};

macro_rules! transport_tests {
    ($m:ident, $kind:expr) => {
        mod $m {
            use super::*;
            #[test]
            fn completes_with_partial_last_block() {
                cases::completes_with_partial_last_block(&$kind)
            }
            #[test]
            fn prompt_shorter_than_one_block() {
                cases::prompt_shorter_than_one_block(&$kind)
            }
            #[test]
            fn long_prompt_128k_tokens() {
                cases::long_prompt_128k_tokens(&$kind)
            }
            #[test]
            fn release_frees_the_reservation() {
                cases::release_frees_the_reservation(&$kind)
            }
            #[test]
            fn deadline_expires_without_a_sender() {
                cases::deadline_expires_without_a_sender(&$kind)
            }
            #[test]
            fn deadline_mid_transfer_and_no_late_write() {
                cases::deadline_mid_transfer_and_no_late_write(&$kind)
            }
            #[test]
            fn client_abort_mid_transfer() {
                cases::client_abort_mid_transfer(&$kind)
            }
            #[test]
            fn sender_abort() {
                cases::sender_abort(&$kind)
            }
            #[test]
            fn bad_descriptors_rejected_before_any_write() {
                cases::bad_descriptors_rejected_before_any_write(&$kind)
            }
            #[test]
            fn incomplete_sessions_are_refused() {
                cases::incomplete_sessions_are_refused(&$kind)
            }
            #[test]
            fn layers_wait_for_their_completion_marker() {
                cases::layers_wait_for_their_completion_marker(&$kind)
            }
            #[test]
            fn concurrent_requests() {
                cases::concurrent_requests(&$kind)
            }
        }
    };
}

transport_tests!(inproc, Kind::InProc);
transport_tests!(tcp, Kind::Tcp);
transport_tests!(tcp_striped, Kind::Striped(Box::new(Kind::Tcp), 3));
transport_tests!(ucx_tcp, Kind::Ucx("tcp"));
transport_tests!(ucx_shm, Kind::Ucx("sm,self"));
transport_tests!(ucx_tcp_am, Kind::UcxAm("tcp"));
transport_tests!(ucx_tcp_am_striped, Kind::Striped(Box::new(Kind::UcxAm("tcp")), 3));
transport_tests!(ucx_shm_striped, Kind::Striped(Box::new(Kind::Ucx("sm,self")), 3));
