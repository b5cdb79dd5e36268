//! Where a backend runs (`--device cpu|cuda[:N]`) and the factory that builds it: the one place a
//! backend is constructed, so workers, `tandem generate` and the benchmarks never name a backend type.

use std::sync::Arc;

use crate::backend::{Backend, EngineError, Precision};
use crate::checkpoint::Checkpoint;
use crate::cpu::CpuBackend;

/// A compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// The CPU reference backend.
    #[default]
    Cpu,
    /// NVIDIA GPU `ordinal` (`cuda` is `cuda:0`).
    Cuda(u32),
}

impl std::str::FromStr for Device {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("unknown device `{s}` (expected cpu, cuda or cuda:N)");
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Device::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// What a backend is built from besides the checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendOptions {
    pub device: Device,
    pub precision: Precision,
    /// CPU compute threads (`None`: rayon's global pool, one thread per core).
    pub threads: Option<usize>,
}

/// Whether `device` can be used here (checked before loading weights, so a command fails at once): for a
/// GPU, the driver, the device ordinal and NVRTC. Never a fall-back to the CPU.
pub fn check_available(device: Device) -> Result<(), EngineError> {
    match device {
        Device::Cpu => Ok(()),
        Device::Cuda(n) => {
            let count = crate::cuda::device::device_count()
                .map_err(|e| EngineError::Device(format!("--device cuda:{n}: {e}")))?;
            if n as usize >= count {
                return Err(EngineError::Device(format!(
                    "--device cuda:{n}: this machine has {count} GPU{} (cuda:0{})",
                    if count == 1 { "" } else { "s" },
                    if count > 1 { format!("..cuda:{}", count - 1) } else { String::new() }
                )));
            }
            if !crate::cuda::nvrtc::available() {
                return Err(EngineError::Device(format!(
                    "--device cuda:{n}: NVRTC (libnvrtc.so) is not installed; the kernels are compiled at start-up"
                )));
            }
            Ok(())
        }
    }
}

/// Builds the backend for `opts.device` over an opened checkpoint.
pub fn load_backend(ckpt: &Checkpoint, opts: BackendOptions) -> Result<Arc<dyn Backend>, EngineError> {
    load_backend_ep(ckpt, opts, None)
}

/// [`load_backend`] as one rank of an expert-parallel group when `ep` is given (GPUs only): returns once
/// every rank has joined.
pub fn load_backend_ep(
    ckpt: &Checkpoint,
    opts: BackendOptions,
    ep: Option<&crate::cuda::ep::EpConfig>,
) -> Result<Arc<dyn Backend>, EngineError> {
    match (opts.device, ep) {
        (Device::Cpu, None) => {
            Ok(Arc::new(CpuBackend::from_checkpoint(ckpt, opts.precision)?.with_threads(opts.threads)?))
        }
        (Device::Cpu, Some(_)) => {
            Err(EngineError::Unsupported("expert parallelism runs on GPUs (--device cuda:N), not on the CPU".into()))
        }
        (Device::Cuda(n), ep) => {
            check_available(opts.device)?;
            let cache = crate::cuda::kernels::default_cache_dir();
            let (n, prec) = (n as usize, opts.precision);
            Ok(Arc::new(match ep {
                Some(ep) => crate::cuda::CudaBackend::load_ep(ckpt, prec, n, &cache, ep)?,
                None => crate::cuda::CudaBackend::load(ckpt, prec, n, &cache)?,
            }))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse::<Device>(), Ok(Device::Cpu));
        assert_eq!("cuda".parse::<Device>(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse::<Device>(), Ok(Device::Cuda(3)));
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        for bad in ["gpu", "cuda:", "cuda:x", "cuda:-1", "CPU"] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{e}");
        }
    }

    #[test]
    fn a_missing_gpu_is_a_clear_error_never_the_cpu() {
        let dir = tempfile::tempdir().unwrap();
        crate::tiny::write(dir.path(), 0, 256).unwrap();
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        // An ordinal no machine has: refused with the reason wherever the test runs.
        let opts = BackendOptions { device: Device::Cuda(99), precision: Precision::Fp8, threads: None };
        let e = load_backend(&ckpt, opts).err().expect("cuda:99 is refused");
        let msg = e.to_string();
        assert!(msg.contains("cuda:99"), "{msg}");
        assert!(msg.contains("GPU") || msg.contains("CUDA") || msg.contains("driver"), "{msg}");
        let cpu = load_backend(&ckpt, BackendOptions { device: Device::Cpu, ..opts }).unwrap();
        assert_eq!(cpu.name(), "cpu");
    }
}
