//! Every kernel family compiles with NVRTC for sm_90a (no GPU needed), goes through the disk cache once
//! even when several compilers race, and holds the instructions it was written for (`cuobjdump -sass`).
//!
//! NVRTC and cuobjdump come from the CUDA toolkit or from the `nvidia-cuda-nvrtc` / `nvidia-cuda-cuobjdump`
//! wheels that scripts/test.sh installs. Without them these tests skip with a message, except under
//! `CI=true` (or `TANDEM_REQUIRE_NVRTC=1`), where a missing tool is a failure.

use std::path::Path;

use engine::cuda::{Arch, FAMILIES, kernels, nvrtc, sass};

fn required() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true") || std::env::var("TANDEM_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

fn nvrtc_or_skip() -> bool {
    if nvrtc::available() {
        return true;
    }
    assert!(!required(), "NVRTC is required here (CI=true): scripts/test.sh installs the nvidia-cuda-nvrtc wheel");
    eprintln!("skipped: NVRTC not found (scripts/test.sh installs it)");
    false
}

fn sm90a() -> Arch {
    Arch::parse("sm_90a").unwrap()
}

fn cubins(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".cubin"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_family_compiles_once_and_is_then_served_from_the_cache() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let first = kernels::compile_all(&sm90a(), dir.path()).unwrap();
    assert_eq!(first.len(), FAMILIES.len());
    assert!(first.iter().all(|c| c.compiled_now && c.cubin.starts_with(b"\x7fELF")));
    let again = kernels::compile_all(&sm90a(), dir.path()).unwrap();
    assert!(again.iter().all(|c| !c.compiled_now), "second start must hit the cache");
    for (a, b) in first.iter().zip(&again) {
        assert_eq!(a.cubin, b.cubin, "{}", a.family.name);
    }
    assert_eq!(cubins(dir.path()).len(), FAMILIES.len());
}

#[test]
fn racing_compilers_write_each_entry_once() {
    if !nvrtc_or_skip() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let version = nvrtc::version().unwrap();
    let family = &FAMILIES[0];
    let results: Vec<_> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..4)
            .map(|_| s.spawn(|| kernels::compile_cached(family, &sm90a(), dir.path(), version).unwrap()))
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    assert_eq!(results.iter().filter(|c| c.compiled_now).count(), 1, "exactly one compiler ran");
    assert!(results.windows(2).all(|w| w[0].cubin == w[1].cubin));
    assert_eq!(cubins(dir.path()).len(), 1);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind");
}

#[test]
fn a_kernel_that_does_not_compile_reports_the_compiler_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let unit = nvrtc::Unit {
        name: "broken.cu",
        source: "extern \"C\" __global__ void k() { undefined_thing(); }",
        headers: &[],
    };
    let e = nvrtc::compile_cubin(&unit, &kernels::options(&sm90a())).unwrap_err().to_string();
    assert!(e.contains("broken.cu") && e.contains("undefined_thing"), "{e}");
}

#[test]
fn every_cubin_holds_its_expected_instructions() {
    if !nvrtc_or_skip() {
        return;
    }
    let Some(tool) = sass::find_cuobjdump() else {
        assert!(
            !required(),
            "cuobjdump is required here (CI=true): scripts/test.sh installs the nvidia-cuda-cuobjdump wheel"
        );
        eprintln!("skipped: cuobjdump not found");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for c in kernels::compile_all(&sm90a(), dir.path()).unwrap() {
        let text = sass::disassemble(&tool, &c.path).unwrap();
        let missing = sass::missing(&c.family, &text);
        assert!(missing.is_empty(), "{}: SASS lacks {missing:?}", c.family.name);
    }
}

#[test]
fn a_family_that_includes_the_cuda_headers_compiles_with_their_version_in_the_key() {
    if !nvrtc_or_skip() {
        return;
    }
    let version = match engine::cuda::External::Cuda.resolve() {
        Ok((_, v)) => v,
        Err(e) => {
            assert!(!required(), "CUDA headers are required here (CI=true): {e}");
            eprintln!("skipped: {e}");
            return;
        }
    };
    assert!(version.starts_with("CUDA_VERSION=1"), "{version}");
    let family = engine::cuda::Family {
        name: "fp8_probe",
        source: "#include <cuda_fp8.h>\nextern \"C\" __global__ void fp8_probe(const float* x, __nv_fp8_e4m3* y) \
                 { y[threadIdx.x] = __nv_fp8_e4m3(x[threadIdx.x]); }\n",
        functions: &["fp8_probe"],
        externals: &[engine::cuda::External::Cuda],
        sass_expect: &["F2FP"],
    };
    let dir = tempfile::tempdir().unwrap();
    let c = kernels::compile_cached(&family, &sm90a(), dir.path(), nvrtc::version().unwrap()).unwrap();
    assert!(c.compiled_now && c.cubin.starts_with(b"\x7fELF"));
    assert_eq!(
        c.path,
        dir.path().join(format!(
            "fp8_probe-sm_90a-{}.cubin",
            &kernels::cache_key(&family, &sm90a(), nvrtc::version().unwrap(), &[version])[..24]
        ))
    );
}
