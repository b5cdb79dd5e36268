//! Every kernel family's source, its compile options, and the on-disk CUBIN cache.
//!
//! A family is one file under `engine/kernels/` (embedded in the binary), compiled by NVRTC for the
//! device's architecture at start-up. Compiled CUBINs are cached under a key that covers everything that
//! changes the binary: the source and our headers (their text), the CUDA and CUTLASS header versions when a
//! family uses them, the options, NVRTC's version and the architecture. Several workers starting at once
//! compile each family once: the writer holds a per-entry file lock, writes a temporary file and renames it
//! into place, and the others find the finished file when they get the lock.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::CudaError;
use super::nvrtc::{self, Unit};

/// Headers of our own, passed to NVRTC in memory.
const HEADERS: &[(&str, &str)] = &[
    ("common.cuh", include_str!("../../kernels/common.cuh")),
    ("topk_key.cuh", include_str!("../../kernels/topk_key.cuh")),
    ("wgmma.cuh", include_str!("../../kernels/wgmma.cuh")),
    ("sync.cuh", include_str!("../../kernels/sync.cuh")),
];

/// Header sets outside the repository a family may include. Their versions join the cache key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum External {
    /// The CUDA toolkit's headers (`cuda_fp8.h`, `cuda_bf16.h`, libcu++ under `cccl/`):
    /// `TANDEM_CUDA_INCLUDE`, else `$CUDA_HOME/include`, else `/usr/local/cuda/include`.
    Cuda,
    /// CUTLASS / CuTe, a dependency from the `nvidia-cutlass` wheel, never copied in:
    /// `TANDEM_CUTLASS_INCLUDE` (the folder holding `cutlass/` and `cute/`).
    Cutlass,
}

impl External {
    fn dir(self) -> Option<PathBuf> {
        let (var, fallbacks): (&str, Vec<PathBuf>) = match self {
            External::Cuda => (
                "TANDEM_CUDA_INCLUDE",
                std::env::var_os("CUDA_HOME")
                    .map(|h| PathBuf::from(h).join("include"))
                    .into_iter()
                    .chain([PathBuf::from("/usr/local/cuda/include")])
                    .collect(),
            ),
            External::Cutlass => ("TANDEM_CUTLASS_INCLUDE", vec![]),
        };
        std::env::var_os(var).map(PathBuf::from).into_iter().chain(fallbacks).find(|d| d.join(self.marker()).is_file())
    }

    /// The file that proves the folder is the right one and carries the version.
    fn marker(self) -> &'static str {
        match self {
            External::Cuda => "cuda.h",
            External::Cutlass => "cutlass/version.h",
        }
    }

    fn version_defines(self) -> &'static [&'static str] {
        match self {
            External::Cuda => &["CUDA_VERSION"],
            External::Cutlass => &["CUTLASS_MAJOR", "CUTLASS_MINOR", "CUTLASS_PATCH"],
        }
    }

    /// The include folder and its version (e.g. `CUDA_VERSION=13000`), or why it cannot be used.
    pub fn resolve(self) -> Result<(PathBuf, String), CudaError> {
        self.resolve_in(self.dir())
    }

    /// [`External::resolve`] for a folder already looked up (`None`: not found).
    fn resolve_in(self, dir: Option<PathBuf>) -> Result<(PathBuf, String), CudaError> {
        let dir = dir.filter(|d| d.join(self.marker()).is_file()).ok_or_else(|| {
            CudaError::MissingHeaders(match self {
                External::Cuda => "the CUDA headers (cuda.h) were not found: set TANDEM_CUDA_INCLUDE (CUDA toolkit's \
                                   include folder, or the nvidia-cuda-runtime wheel's nvidia/cu13/include)"
                    .into(),
                External::Cutlass => "the CUTLASS headers (cutlass/version.h) were not found: set \
                                      TANDEM_CUTLASS_INCLUDE to the nvidia-cutlass wheel's \
                                      cutlass_library/source/include"
                    .into(),
            })
        })?;
        let marker = dir.join(self.marker());
        let text = fs::read_to_string(&marker).map_err(|e| CudaError::io(&marker, e))?;
        let version = self
            .version_defines()
            .iter()
            .map(|d| {
                let value = text.lines().find_map(|l| {
                    let mut w = l.split_whitespace();
                    (w.next() == Some("#define") && w.next() == Some(d)).then(|| w.next().unwrap_or("").to_string())
                });
                format!("{d}={}", value.unwrap_or_else(|| "?".into()))
            })
            .collect::<Vec<_>>()
            .join(",");
        Ok((dir, version))
    }
}

/// One kernel family: a `.cu` file, the entry points it defines, the header sets it includes, and the
/// SASS instructions its CUBIN must contain (checked with `cuobjdump -sass` by `tandem compile-kernels
/// --check-sass`).
#[derive(Debug, Clone, Copy)]
pub struct Family {
    pub name: &'static str,
    pub source: &'static str,
    pub functions: &'static [&'static str],
    pub externals: &'static [External],
    /// Substrings that must each appear in the SASS (e.g. `F2FP` for the e4m3 conversions, `HGMMA` for
    /// wgmma kernels): proof that the intended instructions were emitted.
    pub sass_expect: &'static [&'static str],
}

/// Every family tandem compiles.
pub const FAMILIES: &[Family] = &[
    Family {
        name: "cache_quant",
        source: include_str!("../../kernels/cache_quant.cu"),
        functions: &["tandem_quantize_latent_fp8", "tandem_quantize_index_keys_fp8"],
        externals: &[],
        sass_expect: &["F2FP.SATFINITE.E4M3.F32.PACK_AB", "F2FP.BF16.F32.PACK_AB", "SHFL.BFLY"],
    },
    Family {
        name: "kv_transfer",
        source: include_str!("../../kernels/kv_transfer.cu"),
        functions: &["tandem_kv_hash", "tandem_kv_copy"],
        externals: &[],
        // 64-bit integer products of the checksum term, the atomic add of each CTA's sum, and the copy's
        // 16-byte streaming global loads and stores.
        sass_expect: &["IMAD.WIDE.U32", "REDG.E.ADD.64", "LDG.E.EF.128", "STG.E.EF.128"],
    },
    Family {
        name: "topk",
        source: include_str!("../../kernels/topk.cu"),
        functions: &[
            "tandem_topk_rule",
            "tandem_topk_split_plan",
            "tandem_topk_split_scan",
            "tandem_topk_split_resolve",
            "tandem_topk_split_emit",
        ],
        externals: &[],
        // Warp-aggregated shared-memory histogram atomics and warp scans.
        sass_expect: &["MATCH.ANY", "ATOMS.ADD", "SHFL.UP"],
    },
    Family {
        name: "indexer",
        source: include_str!("../../kernels/indexer.cu"),
        functions: &["tandem_indexer_scores"],
        externals: &[],
        // The q . k products as FP8 wgmma on the tensor cores, key blocks streamed in as TMA boxes.
        sass_expect: &["QGMMA.64x128x32.F32.E4M3.E4M3", "QGMMA.64x64x32.F32.E4M3.E4M3", "UTMALDG.2D"],
    },
    Family {
        name: "sparse_mla",
        source: include_str!("../../kernels/sparse_mla.cu"),
        functions: &[
            "tandem_sparse_mla_decode",
            "tandem_sparse_mla_decode_pair",
            "tandem_sparse_mla_prefill",
            "tandem_sparse_mla_stage",
            "tandem_sparse_mla_combine",
        ],
        externals: &[],
        // bf16 wgmma from shared memory (S = Q K^T), with P from registers and a transposed V (O += P V),
        // and the mbarriers of the producer pipeline.
        sass_expect: &["HGMMA.64x64x16.F32.BF16", "HGMMA.64x256x16.F32.BF16", "SYNCS"],
    },
    Family {
        name: "gemm",
        source: include_str!("../../kernels/gemm.cu"),
        functions: &[
            "tandem_gemm_fp8_n128_f32",
            "tandem_gemm_fp8_n64_f32",
            "tandem_gemm_fp8_n128_bf16",
            "tandem_gemm_fp8_n64_bf16",
            "tandem_gemm_fp8_n128_f32_chains",
            "tandem_gemm_fp8_n64_f32_chains",
            "tandem_gemm_fp8_n128_bf16_chains",
            "tandem_gemm_fp8_n64_bf16_chains",
            "tandem_gemm_fp8_m64_n128_f32",
            "tandem_gemm_fp8_m64_n128_bf16",
            "tandem_gemm_fp8_m64_n64_f32",
            "tandem_gemm_fp8_m64_n64_bf16",
            "tandem_gemm_fp8_combine_f32",
            "tandem_gemm_fp8_combine_bf16",
        ],
        externals: &[],
        // FP8 wgmma from shared memory fed by 2-D TMA loads through mbarriers; 128-row tiles leave by TMA stores.
        sass_expect: &[
            "QGMMA.64x128x32.F32.E4M3.E4M3",
            "QGMMA.64x64x32.F32.E4M3.E4M3",
            "UTMALDG.2D",
            "UTMASTG.2D",
            "SYNCS",
        ],
    },
    Family {
        name: "bf16_mma",
        source: include_str!("../../kernels/bf16_mma.cu"),
        functions: &["tandem_gemm_bf16_mma"],
        externals: &[],
        // bf16 MMA with f32 accumulation, ldmatrix operands, cp.async stages.
        sass_expect: &["HMMA.16816.F32.BF16", "LDSM.16.M88.4", "LDGSTS.E.BYPASS.128"],
    },
    Family {
        name: "moe",
        source: include_str!("../../kernels/moe.cu"),
        functions: &[
            "tandem_moe_plan",
            "tandem_moe_scatter",
            "tandem_moe_map_ids",
            "tandem_moe_drop_padding",
            "tandem_ep_pack_ids",
            "tandem_eplb_count",
            "tandem_ep_local_ids",
            "tandem_ep_gather",
        ],
        externals: &[],
        // Shared-memory counts per expert (warp-aggregated increments), then global cursors the pairs take
        // their rows from.
        sass_expect: &["ATOMS.POPC.INC", "ATOMG.E.ADD"],
    },
    Family {
        name: "sample",
        source: include_str!("../../kernels/sample.cu"),
        functions: &["tandem_sample_rows", "tandem_draft_rows"],
        externals: &[],
        // Butterfly reductions in a fixed order, stable radix-sort ranks from warp matches, Philox's
        // 32x32 -> 64-bit products, and the race keys in f64.
        sass_expect: &["SHFL.BFLY", "MATCH.ANY", "IMAD.HI.U32", "DADD"],
    },
    Family {
        name: "model",
        source: include_str!("../../kernels/model.cu"),
        functions: &[
            "tandem_embed",
            "tandem_rms_norm",
            "tandem_add",
            "tandem_silu_mul",
            "tandem_gather_rows",
            "tandem_step_draft_rows",
            "tandem_act_quant",
            "tandem_gemm_fp8",
            "tandem_gemm_f32",
            "tandem_gemm_f32_combine",
            "tandem_gemm_f32_tiled",
            "tandem_gemm_bf16w",
            "tandem_mla_post",
            "tandem_indexer_post",
            "tandem_write_cache_f32",
            "tandem_read_latents",
            "tandem_indexer_scores_f32",
            "tandem_mla_decode",
            "tandem_mla_absorb_q",
            "tandem_mla_absorb_q_bf16w",
            "tandem_mla_up_v",
            "tandem_mla_up_v_bf16w",
            "tandem_mla_prefill",
            "tandem_route",
            "tandem_moe_combine",
            "tandem_moe_combine_bf16",
        ],
        externals: &[],
        // e4m3 activation quantization and decoding, the warps' butterfly sums, double-precision RoPE angles.
        sass_expect: &["F2FP.SATFINITE.E4M3.F32.PACK_AB", "SHFL.BFLY", "DMUL"],
    },
];

/// A real GPU architecture NVRTC compiles to, e.g. `sm_90a`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arch(String);

impl Arch {
    /// The architectures tandem's kernels are written for.
    pub const SUPPORTED: &'static [&'static str] = &["sm_90a"];

    pub fn parse(s: &str) -> Result<Self, CudaError> {
        if Self::SUPPORTED.contains(&s) {
            Ok(Arch(s.to_string()))
        } else {
            Err(CudaError::UnsupportedArch(format!(
                "`{s}`: tandem's kernels are built for {} (Hopper: H100, H200)",
                Self::SUPPORTED.join(", ")
            )))
        }
    }

    /// The architecture for a device of compute capability `major.minor`.
    pub fn for_compute_capability(major: i32, minor: i32) -> Result<Self, CudaError> {
        match (major, minor) {
            (9, 0) => Ok(Arch("sm_90a".into())),
            _ => Err(CudaError::UnsupportedArch(format!(
                "compute capability {major}.{minor}: tandem's kernels need Hopper (9.0: H100, H200)"
            ))),
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Compile options for every family: exact IEEE arithmetic (no fast math: the kernels must match the
/// CPU backend bit for bit where the docs say so), line info for the profilers and compute-sanitizer.
pub fn options(arch: &Arch) -> Vec<String> {
    vec![format!("-arch={}", arch.as_str()), "-std=c++17".into(), "-lineinfo".into(), "-DTANDEM_NVRTC=1".into()]
}

/// A family's options plus the include folders of its external headers, and those headers' versions.
fn family_options(family: &Family, arch: &Arch) -> Result<(Vec<String>, Vec<String>), CudaError> {
    let mut opts = options(arch);
    let mut versions = Vec::new();
    for ext in family.externals {
        let (dir, version) = ext.resolve()?;
        opts.push(format!("-I{}", dir.display()));
        if *ext == External::Cuda && dir.join("cccl").is_dir() {
            // CUDA 13 keeps libcu++ (cuda/std/...) under include/cccl.
            opts.push(format!("-I{}", dir.join("cccl").display()));
        }
        versions.push(version);
    }
    Ok((opts, versions))
}

/// The on-disk cache folder: `TANDEM_KERNEL_CACHE`, else `$XDG_CACHE_HOME/tandem/kernels`, else
/// `~/.cache/tandem/kernels`.
pub fn default_cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("TANDEM_KERNEL_CACHE") {
        return PathBuf::from(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir);
    base.join("tandem").join("kernels")
}

/// The cache key of `family` for `arch`: hex sha256. `external_versions` are the versions of the header
/// sets the family includes (their folders are not in the key: the same version elsewhere is the same text).
pub fn cache_key(family: &Family, arch: &Arch, nvrtc_version: (i32, i32), external_versions: &[String]) -> String {
    let mut h = Sha256::new();
    let mut put = |tag: &str, bytes: &[u8]| {
        h.update(tag.as_bytes());
        h.update((bytes.len() as u64).to_le_bytes());
        h.update(bytes);
    };
    put("tandem-kernel-cache-v1", b"");
    put("family", family.name.as_bytes());
    put("source", family.source.as_bytes());
    for (name, text) in HEADERS {
        put(name, text.as_bytes());
    }
    for o in options(arch) {
        put("option", o.as_bytes());
    }
    for v in external_versions {
        put("external", v.as_bytes());
    }
    put("nvrtc", format!("{}.{}", nvrtc_version.0, nvrtc_version.1).as_bytes());
    put("arch", arch.as_str().as_bytes());
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// A compiled family.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub family: Family,
    pub cubin: Vec<u8>,
    pub path: PathBuf,
    /// False when the CUBIN came from the cache.
    pub compiled_now: bool,
    pub seconds: f64,
}

/// Compiles (or finds in `cache_dir`) every family for `arch`, one thread per family.
pub fn compile_all(arch: &Arch, cache_dir: &Path) -> Result<Vec<Compiled>, CudaError> {
    let version = nvrtc::version()?;
    fs::create_dir_all(cache_dir).map_err(|e| CudaError::io(cache_dir, e))?;
    std::thread::scope(|s| {
        let jobs: Vec<_> =
            FAMILIES.iter().map(|f| s.spawn(move || compile_cached(f, arch, cache_dir, version))).collect();
        jobs.into_iter()
            .map(|j| j.join().unwrap_or_else(|_| Err(CudaError::Driver("compile thread panicked".into()))))
            .collect()
    })
}

/// One family through the cache.
pub fn compile_cached(family: &Family, arch: &Arch, dir: &Path, version: (i32, i32)) -> Result<Compiled, CudaError> {
    let started = Instant::now();
    let (opts, external_versions) = family_options(family, arch)?;
    let key = cache_key(family, arch, version, &external_versions);
    let stem = format!("{}-{}-{}", family.name, arch.as_str(), &key[..24]);
    let path = dir.join(format!("{stem}.cubin"));
    let done = |cubin: Vec<u8>, compiled_now: bool| Compiled {
        family: *family,
        cubin,
        path: path.clone(),
        compiled_now,
        seconds: started.elapsed().as_secs_f64(),
    };
    if let Some(cubin) = read_valid(&path) {
        return Ok(done(cubin, false));
    }
    let lock_path = dir.join(format!("{stem}.lock"));
    let lock = File::create(&lock_path).map_err(|e| CudaError::io(&lock_path, e))?;
    lock.lock().map_err(|e| CudaError::io(&lock_path, e))?;
    // Another process may have finished it while we waited for the lock.
    if let Some(cubin) = read_valid(&path) {
        return Ok(done(cubin, false));
    }
    let unit = Unit { name: family.name, source: family.source, headers: HEADERS };
    let cubin = nvrtc::compile_cubin(&unit, &opts)?;
    let tmp = dir.join(format!("{stem}.{}.tmp", std::process::id()));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&cubin)?;
        f.sync_all()?;
        fs::rename(&tmp, &path)
    };
    write().map_err(|e| {
        let _ = fs::remove_file(&tmp);
        CudaError::io(&path, e)
    })?;
    drop(lock);
    Ok(done(cubin, true))
}

/// A cache entry is used only if it is a whole ELF file (a crash mid-write leaves a `.tmp`, never a
/// partial `.cubin`, but a disk full or a hand edit could).
fn read_valid(path: &Path) -> Option<Vec<u8>> {
    let bytes = fs::read(path).ok()?;
    (bytes.len() > 64 && bytes.starts_with(b"\x7fELF")).then_some(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sm90a() -> Arch {
        Arch::parse("sm_90a").unwrap()
    }

    #[test]
    fn the_key_changes_with_source_options_version_and_arch() {
        let f = FAMILIES[0];
        let base = cache_key(&f, &sm90a(), (13, 0), &[]);
        assert_eq!(base, cache_key(&f, &sm90a(), (13, 0), &[]), "deterministic");
        assert_ne!(base, cache_key(&f, &sm90a(), (13, 1), &[]));
        let edited = Family { source: "// edited\n", ..f };
        assert_ne!(base, cache_key(&edited, &sm90a(), (13, 0), &[]));
        let renamed = Family { name: "other", ..f };
        assert_ne!(base, cache_key(&renamed, &sm90a(), (13, 0), &[]));
        let cuda = |v: &str| cache_key(&f, &sm90a(), (13, 0), &[v.to_string()]);
        assert_ne!(base, cuda("CUDA_VERSION=13000"));
        assert_ne!(cuda("CUDA_VERSION=13000"), cuda("CUDA_VERSION=13010"));
        assert_eq!(base.len(), 64);
    }

    #[test]
    fn unsupported_architectures_are_refused_with_a_reason() {
        let e = Arch::parse("sm_80").unwrap_err().to_string();
        assert!(e.contains("sm_80") && e.contains("sm_90a"), "{e}");
        let e = Arch::for_compute_capability(8, 6).unwrap_err().to_string();
        assert!(e.contains("8.6") && e.contains("Hopper"), "{e}");
        assert_eq!(Arch::for_compute_capability(9, 0).unwrap().as_str(), "sm_90a");
    }

    #[test]
    fn external_headers_resolve_to_their_version_or_say_what_is_missing() {
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir_all(dir.path().join("cutlass")).unwrap();
        fs::write(
            dir.path().join("cutlass/version.h"),
            "#define CUTLASS_MAJOR 4\n#define CUTLASS_MINOR 2\n#define CUTLASS_PATCH 0\n",
        )
        .unwrap();
        let (found, version) = External::Cutlass.resolve_in(Some(dir.path().to_path_buf())).unwrap();
        assert_eq!(found, dir.path());
        assert_eq!(version, "CUTLASS_MAJOR=4,CUTLASS_MINOR=2,CUTLASS_PATCH=0");
        let e = External::Cutlass.resolve_in(Some(dir.path().join("nowhere"))).unwrap_err().to_string();
        assert!(e.contains("TANDEM_CUTLASS_INCLUDE"), "{e}");
        assert!(External::Cutlass.resolve_in(None).is_err());
    }

    #[test]
    fn truncated_cache_entries_are_not_used() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.cubin");
        fs::write(&p, b"\x7fELF").unwrap();
        assert!(read_valid(&p).is_none());
        fs::write(&p, [b"\x7fELF".as_slice(), &[0u8; 100]].concat()).unwrap();
        assert!(read_valid(&p).is_some());
    }

    #[test]
    fn every_family_names_its_functions_and_expected_sass() {
        for f in FAMILIES {
            assert!(!f.functions.is_empty() && !f.sass_expect.is_empty(), "{}", f.name);
            for func in f.functions {
                // The entry point is declared `extern "C" __global__` itself (its mangled name would not load),
                // or by a macro `M(func, ...)` whose definition declares it so.
                let direct = f.source.find(&format!(" {func}(")).is_some_and(|at| {
                    let decl = &f.source[f.source[..at].rfind(';').map_or(0, |i| i + 1)..at];
                    decl.contains("extern \"C\" __global__")
                });
                let by_macro = f.source.lines().any(|line| {
                    line.split_once(&format!("({func},")).is_some_and(|(mac, _)| {
                        !mac.is_empty()
                            && mac.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                            && f.source.split(&format!("#define {mac}(")).nth(1).is_some_and(|body| {
                                let body = body.split("\n\n").next().unwrap_or("");
                                body.contains("extern \"C\" __global__")
                            })
                    })
                });
                assert!(direct || by_macro, "{} does not define {func}", f.name);
            }
        }
    }
}
