//! Proof that a CUBIN holds the instructions its kernels were written for: `cuobjdump -sass` over the
//! file, searched for each family's expected instructions (e.g. `HGMMA` for wgmma kernels).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{CudaError, Family};

/// `cuobjdump`: `TANDEM_CUOBJDUMP`, else the one on `PATH`, else the CUDA toolkit's.
pub fn find_cuobjdump() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TANDEM_CUOBJDUMP") {
        return Some(PathBuf::from(p));
    }
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join("cuobjdump"));
    on_path.chain([PathBuf::from("/usr/local/cuda/bin/cuobjdump")]).find(|p| p.is_file())
}

/// The SASS of `cubin` as `cuobjdump -sass` prints it.
pub fn disassemble(cuobjdump: &Path, cubin: &Path) -> Result<String, CudaError> {
    let out = Command::new(cuobjdump).arg("-sass").arg(cubin).output().map_err(|e| CudaError::io(cuobjdump, e))?;
    if !out.status.success() {
        return Err(CudaError::Driver(format!(
            "{} -sass {}: {}",
            cuobjdump.display(),
            cubin.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The expected instructions of `family` that `sass` lacks, and whether every entry point is there.
pub fn missing(family: &Family, sass: &str) -> Vec<String> {
    let mut missing: Vec<String> =
        family.sass_expect.iter().filter(|i| !sass.contains(*i)).map(|i| format!("instruction {i}")).collect();
    missing.extend(family.functions.iter().filter(|f| !sass.contains(*f)).map(|f| format!("function {f}")));
    missing
}
