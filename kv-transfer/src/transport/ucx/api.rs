//! Loads libucp at run time (the crate builds and runs without UCX) and wraps its status codes.

use std::cell::Cell;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use super::sys::{
    UCP_API_MAJOR, UCP_API_MINOR, UcpLib, ucp_am_cb_flags, ucp_am_handler_param_field, ucp_am_handler_param_t,
    ucp_am_recv_callback_t, ucp_config_t, ucp_context_attr_field, ucp_context_attr_t, ucp_context_h, ucp_feature,
    ucp_params_field, ucp_params_t, ucs_memory_type_UCS_MEMORY_TYPE_CUDA, ucs_status_t,
};

static LIB: OnceLock<Result<UcpLib, String>> = OnceLock::new();

/// libucp, loaded once per process.
pub fn load() -> Result<&'static UcpLib, String> {
    LIB.get_or_init(|| {
        let mut errors = Vec::new();
        for name in ["libucp.so.0", "libucp.so"] {
            // SAFETY: loading libucp runs its constructors, which only initialise UCX's own globals.
            match unsafe { UcpLib::new(name) } {
                Ok(lib) => {
                    install_log_filter();
                    return Ok(lib);
                }
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        Err(errors.join("; "))
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// The loaded libucp's version, `major.minor.release` (for start-up logs).
pub fn version() -> String {
    match version_parts() {
        Some((major, minor, release)) => format!("{major}.{minor}.{release}"),
        None => "not loaded".into(),
    }
}

/// The loaded libucp's (major, minor, release); `None` where it cannot be loaded.
pub fn version_parts() -> Option<(u32, u32, u32)> {
    let lib = load().ok()?;
    let (mut major, mut minor, mut release) = (0, 0, 0);
    // SAFETY: plain out-pointers.
    unsafe { (lib.ucp_get_version)(&mut major, &mut minor, &mut release) };
    Some((major, minor, release))
}

/// Whether a libucp of this version can abort the process on the assertion UCX 1.14 removed
/// (openucx/ucx#8175): a peer that dies while its connection's wireup reply is still queued (seen over TCP
/// lanes when a prefill process is killed mid-transfer) makes the surviving side's libucp assert in
/// `ucp_request_send_state_ff` ("got REP message") where it was built with assertions, as Debian's 1.13 is.
pub fn may_abort_on_peer_loss_in_wireup(version: (u32, u32, u32)) -> bool {
    version < (1, 14, 0)
}

/// Whether the loaded libucp moves CUDA device memory (its context reports the CUDA memory type: built
/// with CUDA and able to load its CUDA modules here). Asked once per process.
pub fn cuda_memory() -> bool {
    static CUDA: OnceLock<bool> = OnceLock::new();
    *CUDA.get_or_init(|| {
        let Ok(lib) = load() else { return false };
        // SAFETY: UCX's initialisation sequence with valid out-pointers; the context is cleaned up here.
        unsafe {
            let mut config: *mut ucp_config_t = std::ptr::null_mut();
            if (lib.ucp_config_read)(std::ptr::null(), std::ptr::null(), &mut config) != ucs_status_t::UCS_OK {
                return false;
            }
            let mut params: ucp_params_t = std::mem::zeroed();
            params.field_mask = ucp_params_field::UCP_PARAM_FIELD_FEATURES.0 as u64;
            params.features = ucp_feature::UCP_FEATURE_AM.0 as u64;
            let mut ctx: ucp_context_h = std::ptr::null_mut();
            let s = (lib.ucp_init_version)(UCP_API_MAJOR, UCP_API_MINOR, &params, config, &mut ctx);
            (lib.ucp_config_release)(config);
            if s != ucs_status_t::UCS_OK {
                return false;
            }
            let mut attr: ucp_context_attr_t = std::mem::zeroed();
            attr.field_mask = ucp_context_attr_field::UCP_ATTR_FIELD_MEMORY_TYPES.0 as u64;
            let cuda = (lib.ucp_context_query)(ctx, &mut attr) == ucs_status_t::UCS_OK
                && attr.memory_types & (1 << ucs_memory_type_UCS_MEMORY_TYPE_CUDA) != 0;
            (lib.ucp_cleanup)(ctx);
            cuda
        }
    })
}

thread_local! {
    static QUIET_PROBE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with UCX's "no <feature> transport to <peer>" error hidden on this thread. Used where that
/// failure is expected and handled: probing whether an endpoint can detect peer failure, which UCX 1.13's
/// shared-memory transports cannot (the caller logs its own line and connects without it).
pub fn quiet_probe<T>(f: impl FnOnce() -> T) -> T {
    QUIET_PROBE.with(|q| q.set(true));
    let r = f();
    QUIET_PROBE.with(|q| q.set(false));
    r
}

/// `ucs_log_func_t` (ucs/debug/log_def.h). `ap` is a `va_list`, a pointer on x86-64 and aarch64; never read.
type UcsLogFn = unsafe extern "C" fn(
    file: *const c_char,
    line: c_uint,
    function: *const c_char,
    level: c_int,
    comp_conf: *const c_void,
    message: *const c_char,
    ap: *mut c_void,
) -> c_int;

const UCS_LOG_FUNC_RC_STOP: c_int = 0;
const UCS_LOG_FUNC_RC_CONTINUE: c_int = 1;

unsafe extern "C" fn log_filter(
    _file: *const c_char,
    _line: c_uint,
    _function: *const c_char,
    _level: c_int,
    _comp_conf: *const c_void,
    message: *const c_char,
    _ap: *mut c_void,
) -> c_int {
    let probing = QUIET_PROBE.try_with(Cell::get).unwrap_or(false);
    // SAFETY: UCX passes its NUL-terminated format string.
    if probing && !message.is_null() && unsafe { CStr::from_ptr(message) }.to_bytes().starts_with(b"no %s transport") {
        return UCS_LOG_FUNC_RC_STOP;
    }
    UCS_LOG_FUNC_RC_CONTINUE
}

/// Pushes [`log_filter`] onto libucs's log handler stack (it runs before the default printer). A libucs
/// without `ucs_log_push_handler` just keeps printing everything.
fn install_log_filter() {
    for name in ["libucs.so.0", "libucs.so"] {
        // SAFETY: libucs is already loaded as libucp's dependency; this only takes another reference,
        // kept for the process's life so the pushed handler's library never unloads.
        let Ok(lib) = (unsafe { libloading::Library::new(name) }) else { continue };
        // SAFETY: the symbol has this signature in every UCX release that exports it (>= 1.9).
        if let Ok(push) = unsafe { lib.get::<unsafe extern "C" fn(UcsLogFn)>(b"ucs_log_push_handler\0") } {
            // SAFETY: log_filter matches ucs_log_func_t and never unwinds.
            unsafe { push(log_filter) };
        }
        std::mem::forget(lib);
        return;
    }
}

pub fn status_str(lib: &UcpLib, s: ucs_status_t) -> String {
    // SAFETY: ucs_status_string returns a static C string for any status.
    let p = unsafe { (lib.ucs_status_string)(s) };
    if p.is_null() {
        return format!("status {}", s.0);
    }
    // SAFETY: non-null static NUL-terminated string.
    unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// What a `ucs_status_ptr_t` means.
pub enum StatusPtr {
    Done,
    Error(ucs_status_t),
    Pending(*mut core::ffi::c_void),
}

pub fn classify(p: *mut core::ffi::c_void) -> StatusPtr {
    let v = p as isize;
    if v == 0 {
        StatusPtr::Done
    } else if (-100..0).contains(&v) {
        StatusPtr::Error(ucs_status_t(v as i8))
    } else {
        StatusPtr::Pending(p)
    }
}

/// The parameters that make `cb` (called with `arg`) the handler of active messages `id`, each delivered whole
/// (`ucp_worker_set_am_recv_handler`).
pub fn whole_message_handler(id: u32, cb: ucp_am_recv_callback_t, arg: *mut c_void) -> ucp_am_handler_param_t {
    // SAFETY: a plain C struct of integers, a function pointer option and a pointer: all-zero is valid.
    let mut hp: ucp_am_handler_param_t = unsafe { std::mem::zeroed() };
    hp.field_mask = (ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ID.0
        | ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_FLAGS.0
        | ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_CB.0
        | ucp_am_handler_param_field::UCP_AM_HANDLER_PARAM_FIELD_ARG.0) as u64;
    hp.id = id;
    hp.flags = ucp_am_cb_flags::UCP_AM_FLAG_WHOLE_MSG.0;
    hp.cb = cb;
    hp.arg = arg;
    hp
}

#[cfg(test)]
mod tests {
    use super::may_abort_on_peer_loss_in_wireup;

    #[test]
    fn libucp_before_1_14_is_flagged_for_its_wireup_assertion() {
        assert!(may_abort_on_peer_loss_in_wireup((1, 13, 1)));
        assert!(may_abort_on_peer_loss_in_wireup((1, 12, 1)));
        assert!(!may_abort_on_peer_loss_in_wireup((1, 14, 0)));
        assert!(!may_abort_on_peer_loss_in_wireup((1, 22, 0)));
        assert!(!may_abort_on_peer_loss_in_wireup((2, 0, 0)));
    }
}
