//! NVRTC: CUDA C source to CUBIN for one architecture, without a GPU.
//!
//! libnvrtc is loaded at run time (cudarc's dynamic loading); where it is missing every call answers
//! [`CudaError::NoNvrtc`] instead of cudarc's panic.

use std::ffi::{CString, c_char, c_int};

use cudarc::nvrtc::{result, sys};

use super::CudaError;

/// Where the library is looked up, for error messages.
const NVRTC_HINT: &str = "libnvrtc.so.13 was not found on the library path (install the CUDA toolkit or the \
     `nvidia-cuda-nvrtc` wheel and add its lib folder to LD_LIBRARY_PATH)";

/// Whether libnvrtc can be loaded.
pub fn available() -> bool {
    // SAFETY: only tries dlopen on cudarc's candidate names.
    unsafe { sys::is_culib_present() }
}

fn require() -> Result<(), CudaError> {
    if available() { Ok(()) } else { Err(CudaError::NoNvrtc(NVRTC_HINT.into())) }
}

/// NVRTC's (major, minor) version.
pub fn version() -> Result<(i32, i32), CudaError> {
    require()?;
    let (mut major, mut minor) = (0 as c_int, 0 as c_int);
    // SAFETY: two valid out-pointers.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| CudaError::Driver(format!("nvrtcVersion: {e:?}")))?;
    Ok((major, minor))
}

/// One translation unit: its name, text and in-memory headers (`#include "name"` resolves to them).
pub struct Unit<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub headers: &'a [(&'a str, &'a str)],
}

/// Compiles `unit` with `options` (which must name a real architecture, e.g. `-arch=sm_90a`) and returns
/// the CUBIN. A failed compile returns the compiler log.
pub fn compile_cubin(unit: &Unit<'_>, options: &[String]) -> Result<Vec<u8>, CudaError> {
    require()?;
    let cstr = |s: &str| {
        CString::new(s).map_err(|_| CudaError::Compile { unit: unit.name.into(), log: "NUL byte in source".into() })
    };
    let src = cstr(unit.source)?;
    let name = cstr(unit.name)?;
    let header_texts = unit.headers.iter().map(|(_, t)| cstr(t)).collect::<Result<Vec<_>, _>>()?;
    let header_names = unit.headers.iter().map(|(n, _)| cstr(n)).collect::<Result<Vec<_>, _>>()?;
    let texts: Vec<*const c_char> = header_texts.iter().map(|s| s.as_ptr()).collect();
    let names: Vec<*const c_char> = header_names.iter().map(|s| s.as_ptr()).collect();

    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a NUL-terminated string that outlives the call; the arrays have
    // `headers.len()` entries.
    unsafe {
        sys::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            name.as_ptr(),
            texts.len() as c_int,
            texts.as_ptr(),
            names.as_ptr(),
        )
    }
    .result()
    .map_err(|e| CudaError::Driver(format!("nvrtcCreateProgram({}): {e:?}", unit.name)))?;

    // SAFETY: `prog` was created above and is destroyed exactly once, below.
    let compiled = unsafe { result::compile_program(prog, options) };
    let out = match compiled {
        Ok(()) => cubin_of(prog),
        Err(_) => {
            // SAFETY: as above.
            let log = unsafe { result::get_program_log(prog) }
                .map(|l| c_chars_to_string(&l))
                .unwrap_or_else(|e| format!("(no log: {e:?})"));
            Err(CudaError::Compile { unit: unit.name.into(), log })
        }
    };
    // SAFETY: as above.
    let _ = unsafe { result::destroy_program(prog) };
    out
}

fn cubin_of(prog: sys::nvrtcProgram) -> Result<Vec<u8>, CudaError> {
    let mut size = 0usize;
    // SAFETY: `prog` compiled successfully; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) }
        .result()
        .map_err(|e| CudaError::Driver(format!("nvrtcGetCUBINSize: {e:?} (options must name a real sm_ arch)")))?;
    if size == 0 {
        return Err(CudaError::Driver("NVRTC returned an empty CUBIN (options must name a real sm_ arch)".into()));
    }
    let mut buf = vec![0u8; size];
    // SAFETY: `buf` has the size NVRTC reported.
    unsafe { sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut c_char) }
        .result()
        .map_err(|e| CudaError::Driver(format!("nvrtcGetCUBIN: {e:?}")))?;
    Ok(buf)
}

fn c_chars_to_string(v: &[c_char]) -> String {
    let bytes: Vec<u8> = v.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}
