//! Loads libucp at run time (the crate builds and runs without UCX) and wraps its status codes.

use std::sync::OnceLock;

use super::sys::{UcpLib, ucs_status_t};

static LIB: OnceLock<Result<UcpLib, String>> = OnceLock::new();

/// libucp, loaded once per process.
pub fn load() -> Result<&'static UcpLib, String> {
    LIB.get_or_init(|| {
        let mut errors = Vec::new();
        for name in ["libucp.so.0", "libucp.so"] {
            // SAFETY: loading libucp runs its constructors, which only initialise UCX's own globals.
            match unsafe { UcpLib::new(name) } {
                Ok(lib) => return Ok(lib),
                Err(e) => errors.push(format!("{name}: {e}")),
            }
        }
        Err(errors.join("; "))
    })
    .as_ref()
    .map_err(Clone::clone)
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
