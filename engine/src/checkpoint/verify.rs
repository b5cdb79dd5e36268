//! `tandem verify`: integrity of a downloaded checkpoint without loading it. Every shard listed in the
//! index exists and parses, its size matches its header, every indexed tensor is where the index says,
//! and optionally every file's sha256 matches a manifest (`sha256sum` format).

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use sha2::{Digest, Sha256};

use super::{CheckpointError, hex, shard_files};

#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct VerifyReport {
    pub shards: usize,
    pub tensors: usize,
    pub bytes: u64,
    /// Files whose sha256 was checked against the manifest.
    pub hashed: usize,
    /// Everything wrong; empty means the checkpoint verified.
    pub problems: Vec<String>,
}

impl VerifyReport {
    pub fn ok(&self) -> bool {
        self.problems.is_empty()
    }
}

/// Parses a `sha256sum`-style manifest: `<hex digest>  <file>` (or `<hex> *<file>`), `#` comments.
pub fn parse_manifest(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (digest, name) = line
            .split_once(char::is_whitespace)
            .ok_or_else(|| format!("line {}: expected `<sha256>  <file>`", i + 1))?;
        let name = name.trim_start().trim_start_matches('*');
        if digest.len() != 64 || !digest.chars().all(|c| c.is_ascii_hexdigit()) || name.is_empty() {
            return Err(format!("line {}: expected `<sha256>  <file>`, got `{line}`", i + 1));
        }
        out.push((digest.to_ascii_lowercase(), name.to_string()));
    }
    Ok(out)
}

pub fn sha256_file(path: &Path, progress: &indicatif::ProgressBar) -> std::io::Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        progress.inc(n as u64);
    }
    Ok(hex(&h.finalize()))
}

/// Verifies `dir`. Returns Err only when there is nothing to verify (no index, no weights).
pub fn verify(dir: &Path, manifest: Option<&Path>) -> Result<VerifyReport, CheckpointError> {
    let mut report = VerifyReport::default();
    if let Err(e) = crate::ModelConfig::from_path(dir) {
        report.problems.push(e.to_string());
    }
    let (files, weight_map) = shard_files(dir)?;
    for file in &files {
        let path = dir.join(file);
        match check_shard(&path) {
            Err(p) => report.problems.push(p),
            Ok((names, bytes)) => {
                report.shards += 1;
                report.tensors += names.len();
                report.bytes += bytes;
                for (name, listed) in &weight_map {
                    if listed == file && !names.iter().any(|n| n == name) {
                        report.problems.push(format!("{file}: the index lists `{name}` here but the file lacks it"));
                    }
                }
                if !weight_map.is_empty() {
                    for n in &names {
                        if !weight_map.contains_key(n) {
                            report.problems.push(format!("{file}: tensor `{n}` is not in the index"));
                        }
                    }
                }
            }
        }
    }
    if let Some(m) = manifest {
        check_manifest(dir, m, &mut report);
    }
    Ok(report)
}

/// Parses one shard's header; the safetensors parser checks that offsets are contiguous and in range and
/// that the file is exactly header + data long.
fn check_shard(path: &Path) -> Result<(Vec<String>, u64), String> {
    let file = File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    // SAFETY: read-only map of a file we do not modify.
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| format!("{}: {e}", path.display()))?;
    let (_, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| {
        format!(
            "{}: does not parse or its size does not match its header ({e}); file is {} bytes",
            path.display(),
            mmap.len()
        )
    })?;
    let mut names = Vec::new();
    for (name, info) in meta.tensors() {
        let numel: usize = info.shape.iter().product();
        let want = (numel * info.dtype.bitsize()).div_ceil(8);
        let got = info.data_offsets.1 - info.data_offsets.0;
        if want != got {
            return Err(format!(
                "{}: tensor `{name}` has {got} bytes but {:?} {:?} needs {want}",
                path.display(),
                info.dtype,
                info.shape
            ));
        }
        names.push(name);
    }
    Ok((names, mmap.len() as u64))
}

fn check_manifest(dir: &Path, manifest: &Path, report: &mut VerifyReport) {
    let text = match std::fs::read_to_string(manifest) {
        Ok(t) => t,
        Err(e) => return report.problems.push(format!("{}: {e}", manifest.display())),
    };
    let entries = match parse_manifest(&text) {
        Ok(e) => e,
        Err(e) => return report.problems.push(format!("{}: {e}", manifest.display())),
    };
    let paths: Vec<(String, PathBuf, String)> = entries.into_iter().map(|(d, n)| (d, dir.join(&n), n)).collect();
    let total: u64 = paths.iter().filter_map(|(_, p, _)| std::fs::metadata(p).ok()).map(|m| m.len()).sum();
    let bar = indicatif::ProgressBar::with_draw_target(Some(total), indicatif::ProgressDrawTarget::stderr());
    bar.set_style(
        indicatif::ProgressStyle::with_template("sha256 {bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    for (digest, path, name) in paths {
        bar.set_message(name.clone());
        match sha256_file(&path, &bar) {
            Err(e) => report.problems.push(format!("{name}: listed in the manifest but cannot be read: {e}")),
            Ok(got) if got != digest => report.problems.push(format!("{name}: sha256 {got}, manifest says {digest}")),
            Ok(_) => report.hashed += 1,
        }
    }
    bar.finish_and_clear();
}
