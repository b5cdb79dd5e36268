//! `tandem compile-kernels`: compiles every kernel family with NVRTC for an architecture, without a GPU,
//! into the kernel cache (or `--out`), optionally proving each CUBIN's instructions with `cuobjdump -sass`.
//! CI runs it so a kernel that does not compile fails the build; images run it to ship a warm cache.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, bail};
use engine::cuda::{Arch, kernels, sass};

#[derive(clap::Args)]
pub struct Args {
    /// Target architecture (Hopper: sm_90a).
    #[arg(long, default_value = "sm_90a", env = "TANDEM_KERNEL_ARCH")]
    arch: String,
    /// Cache folder to fill (default: TANDEM_KERNEL_CACHE, else ~/.cache/tandem/kernels).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Disassemble each CUBIN with cuobjdump (TANDEM_CUOBJDUMP, PATH or /usr/local/cuda/bin) and fail unless
    /// it holds the instructions its family expects.
    #[arg(long)]
    check_sass: bool,
    /// Print a JSON report instead of the table.
    #[arg(long)]
    json: bool,
}

pub fn run(a: Args) -> anyhow::Result<ExitCode> {
    let arch = Arch::parse(&a.arch)?;
    let dir = a.out.unwrap_or_else(kernels::default_cache_dir);
    let compiled =
        kernels::compile_all(&arch, &dir).with_context(|| format!("compiling kernels for {}", arch.as_str()))?;
    let cuobjdump = if a.check_sass {
        Some(sass::find_cuobjdump().context("--check-sass: cuobjdump not found (set TANDEM_CUOBJDUMP)")?)
    } else {
        None
    };
    let mut failed = Vec::new();
    let mut rows = Vec::new();
    for c in &compiled {
        let sass_state = match &cuobjdump {
            None => "not checked".to_string(),
            Some(tool) => {
                let missing = sass::missing(&c.family, &sass::disassemble(tool, &c.path)?);
                if missing.is_empty() {
                    format!("ok ({})", c.family.sass_expect.join(", "))
                } else {
                    failed.push(format!("{}: SASS lacks {}", c.family.name, missing.join(", ")));
                    format!("MISSING {}", missing.join(", "))
                }
            }
        };
        rows.push(serde_json::json!({
            "family": c.family.name,
            "functions": c.family.functions,
            "cubin": c.path.display().to_string(),
            "bytes": c.cubin.len(),
            "compiled_now": c.compiled_now,
            "seconds": c.seconds,
            "sass": sass_state,
        }));
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "arch": arch.as_str(), "kernels": rows }))?);
    } else {
        println!("{:<14} {:>9} {:>8} {:>7}  sass", "family", "bytes", "source", "secs");
        for (c, r) in compiled.iter().zip(&rows) {
            let source = if c.compiled_now { "nvrtc" } else { "cache" };
            println!(
                "{:<14} {:>9} {:>8} {:>7.2}  {}",
                c.family.name,
                c.cubin.len(),
                source,
                c.seconds,
                r["sass"].as_str().unwrap_or("")
            );
        }
        println!("{} kernel families for {} in {}", compiled.len(), arch.as_str(), dir.display());
    }
    if !failed.is_empty() {
        bail!("{}", failed.join("; "));
    }
    Ok(ExitCode::SUCCESS)
}
