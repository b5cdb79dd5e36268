//! The C callbacks UCX calls during progress. They only record events (or keep a payload descriptor);
//! the progress loop acts on them after `ucp_worker_progress` returns.

use super::*;

/// The event queue behind a callback's address.
///
/// # Safety
/// `p` is the address of a node's [`Events`], alive for the returned lifetime.
unsafe fn events<'a, T>(p: *const T) -> &'a Events {
    // SAFETY: the caller's contract.
    unsafe { &*(p as *const Events) }
}

pub(super) unsafe extern "C" fn on_request_done(
    request: *mut core::ffi::c_void,
    status: ucs_status_t,
    user: *mut core::ffi::c_void,
) {
    // SAFETY: `user` is the (events, token) pair registered with the request; the lib is loaded.
    unsafe {
        let (events_at, token) = *(user as *const (usize, u64));
        let q = events(events_at as *const u8);
        q.push(Event::Done(token, status));
        drop(Box::from_raw(user as *mut (usize, u64)));
        if let Ok(lib) = crate::transport::ucx::api::load() {
            (lib.ucp_request_free)(request);
        }
    }
}

pub(super) unsafe extern "C" fn on_ep_error(arg: *mut core::ffi::c_void, _ep: ucp_ep_h, status: ucs_status_t) {
    // SAFETY: `arg` is the endpoint's (events, id) pair, alive while the endpoint exists.
    unsafe {
        let (events_at, id) = *(arg as *const (usize, u64));
        let q = events(events_at as *const u8);
        q.push(Event::EpError(id, status));
    }
}

pub(super) unsafe extern "C" fn on_am(
    arg: *mut core::ffi::c_void,
    header: *const core::ffi::c_void,
    header_length: size_t,
    data: *mut core::ffi::c_void,
    length: size_t,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the node's event queue; header/data are valid for the call (eager, whole message).
    unsafe {
        let q = events(arg);
        if header_length != 8 || (*param).recv_attr & ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            return ucs_status_t::UCS_OK;
        }
        let origin =
            u64::from_le_bytes(std::slice::from_raw_parts(header as *const u8, 8).try_into().unwrap_or([0; 8]));
        q.push_control(origin, std::slice::from_raw_parts(data as *const u8, length as usize));
    }
    ucs_status_t::UCS_OK
}

/// A data message's header: `decode` sees the `header_length` bytes at `header` (it refuses a wrong
/// length), none for a null header.
///
/// # Safety
/// `header` points to `header_length` readable bytes, or is null.
unsafe fn data_header<H>(
    header: *const core::ffi::c_void,
    header_length: size_t,
    decode: impl FnOnce(&[u8]) -> Option<H>,
) -> Option<H> {
    if header.is_null() {
        return None;
    }
    // SAFETY: the caller's contract.
    decode(unsafe { std::slice::from_raw_parts(header as *const u8, header_length as usize) })
}

pub(super) unsafe extern "C" fn on_am_data(
    arg: *mut core::ffi::c_void,
    header: *const core::ffi::c_void,
    header_length: size_t,
    data: *mut core::ffi::c_void,
    length: size_t,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: `arg` is the node's event queue; header/data are valid for the call, and beyond it when we
    // return UCS_INPROGRESS for rendezvous and persistent payloads (released or received later).
    unsafe {
        let q = events(arg);
        let Some(hdr) = data_header(header, header_length, WriteHeader::decode) else { return ucs_status_t::UCS_OK };
        let attr = (*param).recv_attr;
        if attr & ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            // `length` is what the rendezvous will deliver; the progress loop compares it with the header's.
            q.push(Event::Data(hdr, Payload::Rndv(data, length)));
            return ucs_status_t::UCS_INPROGRESS;
        }
        if hdr.len != length {
            return ucs_status_t::UCS_OK;
        }
        if attr & ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_DATA as u64 != 0 {
            q.push(Event::Data(hdr, Payload::Persistent(data)));
            return ucs_status_t::UCS_INPROGRESS;
        }
        let bytes = std::slice::from_raw_parts(data as *const u8, length as usize).to_vec();
        q.push(Event::Data(hdr, Payload::Copied(bytes)));
    }
    ucs_status_t::UCS_OK
}

pub(super) unsafe extern "C" fn on_am_stream(
    arg: *mut core::ffi::c_void,
    header: *const core::ffi::c_void,
    header_length: size_t,
    data: *mut core::ffi::c_void,
    length: size_t,
    param: *const ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: as on_am_data.
    unsafe {
        let q = events(arg);
        let Some(hdr) = data_header(header, header_length, StreamHeader::decode) else { return ucs_status_t::UCS_OK };
        if (*param).recv_attr & ucp_am_recv_attr_t_UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
            q.push(Event::Stream(hdr, Payload::Rndv(data, length)));
            return ucs_status_t::UCS_INPROGRESS;
        }
        // Gathered writes come by rendezvous only; an eager one is refused (and its sender failed).
        q.push(Event::Stream(hdr, Payload::Copied(Vec::new())));
    }
    ucs_status_t::UCS_OK
}

pub(super) unsafe extern "C" fn on_recv_done(
    request: *mut core::ffi::c_void,
    status: ucs_status_t,
    _len: size_t,
    user: *mut core::ffi::c_void,
) {
    // SAFETY: same contract as on_request_done.
    unsafe { on_request_done(request, status, user) }
}
