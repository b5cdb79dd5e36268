//! HF safetensors checkpoints: memory-mapped shards listed in `model.safetensors.index.json` (or a single
//! `model.safetensors`), every tensor checked against the config by name, shape and dtype, zero-copy
//! access to tensor bytes, FP8 block-scale dequantization and 128->64 re-blocking.

pub mod names;
pub mod quant;
pub mod verify;
pub mod writer;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors, tensor::TensorInfo};
use sha2::{Digest, Sha256};

use crate::ModelConfig;
use crate::config::ConfigError;
use names::{Expect, TensorSpec, expected_tensors, scale_name};

pub const INDEX_FILE: &str = "model.safetensors.index.json";
pub const SINGLE_FILE: &str = "model.safetensors";
/// Bytes sampled from each end of every tensor for the fingerprint.
const FINGERPRINT_SAMPLE: usize = 256;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("{dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")]
    NoWeights { dir: PathBuf },
    #[error("tensor `{name}` (in {file}): {msg}")]
    Tensor { name: String, file: String, msg: String },
    #[error("tensor `{0}` is not in the checkpoint")]
    MissingTensor(String),
    #[error("checkpoint does not match its config:\n{0}")]
    Mismatch(String),
    #[error("{0}")]
    Synthetic(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CheckpointError + '_ {
    move |source| CheckpointError::Io { path: path.to_path_buf(), source }
}

/// A shard's bytes: a memory-mapped file, or (a synthetic checkpoint, crate::synthetic) memory of ours.
enum ShardBytes {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for ShardBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            ShardBytes::Mapped(m) => m,
            ShardBytes::Owned(v) => v,
        }
    }
}

struct Shard {
    file_name: String,
    mmap: ShardBytes,
    /// Byte offset of the data section (8 + header length).
    data_start: usize,
}

/// A zero-copy view of one tensor.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub file: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

impl TensorRef<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    fn err(&self, msg: impl Into<String>) -> CheckpointError {
        CheckpointError::Tensor { name: self.name.to_string(), file: self.file.to_string(), msg: msg.into() }
    }

    /// Values as f32 (bf16, f16 and f32 tensors; FP8 gives the raw e4m3 values without scales).
    pub fn to_f32(&self) -> Result<Vec<f32>, CheckpointError> {
        let d = self.data;
        Ok(match self.dtype {
            Dtype::F32 => d.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            Dtype::BF16 => d.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F16 => d.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            Dtype::F8_E4M3 => d.iter().map(|&b| crate::fp8::e4m3_to_f32(b)).collect(),
            other => return Err(self.err(format!("dtype {other:?} cannot be read as floats"))),
        })
    }
}

/// An opened checkpoint. Tensor data stays in the page cache (mmap) until a backend converts it.
pub struct Checkpoint {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Shard>,
    tensors: HashMap<String, (usize, TensorInfo)>,
    fingerprint: String,
    /// Names present in the files but not implied by the config.
    unexpected: Vec<String>,
    /// Per decoder layer, the layer whose tensors it shares (itself, except in a synthetic checkpoint whose
    /// layers share weight sets): backends may load a layer's weights once for all that share them.
    layer_sources: Option<Vec<usize>>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

/// The shard files of a checkpoint directory, from its index (or the single-file form), with the index's
/// tensor -> file map.
pub fn shard_files(dir: &Path) -> Result<(Vec<String>, BTreeMap<String, String>), CheckpointError> {
    let index_path = dir.join(INDEX_FILE);
    if index_path.exists() {
        let text = std::fs::read_to_string(&index_path).map_err(io_err(&index_path))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| CheckpointError::Format { path: index_path.clone(), msg: format!("not valid JSON: {e}") })?;
        let map = v.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| CheckpointError::Format {
            path: index_path.clone(),
            msg: "no `weight_map` object".into(),
        })?;
        let mut weight_map = BTreeMap::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| CheckpointError::Format {
                path: index_path.clone(),
                msg: format!("weight_map[`{name}`] is not a file name"),
            })?;
            if file.contains('/') || file.contains("..") {
                return Err(CheckpointError::Format {
                    path: index_path.clone(),
                    msg: format!("weight_map[`{name}`] = `{file}` points outside the checkpoint directory"),
                });
            }
            weight_map.insert(name.clone(), file.to_string());
        }
        let mut files: Vec<String> = weight_map.values().cloned().collect();
        files.sort();
        files.dedup();
        Ok((files, weight_map))
    } else if dir.join(SINGLE_FILE).exists() {
        Ok((vec![SINGLE_FILE.to_string()], BTreeMap::new()))
    } else {
        Err(CheckpointError::NoWeights { dir: dir.to_path_buf() })
    }
}

impl Checkpoint {
    /// Opens `dir`, maps every shard, and checks every tensor against the config. Missing tensors and
    /// wrong shapes/dtypes are errors naming the tensor and file; unexpected tensors are reported with a
    /// warning (`unexpected()`).
    pub fn open(dir: &Path) -> Result<Self, CheckpointError> {
        let config = ModelConfig::from_path(dir)?;
        let config_bytes = std::fs::read(dir.join("config.json")).map_err(io_err(&dir.join("config.json")))?;
        let (files, weight_map) = shard_files(dir)?;

        let mut shards = Vec::with_capacity(files.len());
        let mut tensors = HashMap::new();
        let mut hasher = Sha256::new();
        hasher.update(&config_bytes);
        for (i, file_name) in files.iter().enumerate() {
            let path = dir.join(file_name);
            let file = File::open(&path).map_err(io_err(&path))?;
            // SAFETY: the checkpoint is read-only for our lifetime; a concurrent truncation by another
            // process is outside what any mmap-based loader can defend against.
            let mmap = unsafe { Mmap::map(&file) }.map_err(io_err(&path))?;
            let (n, metadata) = SafeTensors::read_metadata(&mmap).map_err(|e| CheckpointError::Format {
                path: path.clone(),
                msg: format!("not a valid safetensors file: {e}"),
            })?;
            hasher.update(file_name.as_bytes());
            hasher.update(&mmap[8..8 + n]);
            let mut infos: Vec<(String, &TensorInfo)> = metadata.tensors().into_iter().collect();
            infos.sort_by_key(|(_, i)| i.data_offsets);
            for (_, info) in &infos {
                // Samples of every tensor's bytes, so checkpoints that differ only in values (another
                // seed, another fine-tune) differ in fingerprint without hashing hundreds of GB.
                let (a, b) = (8 + n + info.data_offsets.0, 8 + n + info.data_offsets.1);
                hasher.update(&mmap[a..b.min(a + FINGERPRINT_SAMPLE)]);
                hasher.update(&mmap[b.saturating_sub(FINGERPRINT_SAMPLE).max(a)..b]);
            }
            for (name, info) in infos {
                let info: &TensorInfo = info;
                if let Some(listed) = weight_map.get(&name)
                    && listed != file_name
                {
                    return Err(CheckpointError::Format {
                        path: dir.join(INDEX_FILE),
                        msg: format!("index puts `{name}` in {listed} but it is in {file_name}"),
                    });
                }
                if let Some((other, _)) = tensors.insert(name.clone(), (i, info.clone())) {
                    return Err(CheckpointError::Format {
                        path: path.clone(),
                        msg: format!("tensor `{name}` also appears in {}", files[other]),
                    });
                }
            }
            shards.push(Shard { file_name: file_name.clone(), mmap: ShardBytes::Mapped(mmap), data_start: 8 + n });
        }
        for (name, file) in &weight_map {
            if !tensors.contains_key(name) {
                return Err(CheckpointError::Format {
                    path: dir.join(file),
                    msg: format!("the index lists `{name}` in this file but it is not there"),
                });
            }
        }
        let fingerprint = hex(&hasher.finalize());
        let mut ckpt = Checkpoint {
            dir: dir.to_path_buf(),
            config,
            shards,
            tensors,
            fingerprint,
            unexpected: Vec::new(),
            layer_sources: None,
        };
        ckpt.validate()?;
        Ok(ckpt)
    }

    /// What a `--model` value names: a checkpoint directory, or a synthetic model built in memory
    /// (`synthetic:v32[,...]`, crate::synthetic).
    pub fn open_model(model: &Path) -> Result<Self, CheckpointError> {
        match model.to_str() {
            Some(s) if crate::synthetic::is_synthetic(s) => {
                s.parse::<crate::synthetic::SyntheticSpec>().map_err(CheckpointError::Synthetic)?.build()
            }
            _ => Self::open(model),
        }
    }

    /// A checkpoint held in memory (crate::synthetic): `physical` tensors, and every name with the physical
    /// tensor it reads (names may share one: their bytes are the same memory). `label` stands for the
    /// directory in messages.
    pub(crate) fn in_memory(
        label: &str,
        config: ModelConfig,
        physical: Vec<crate::checkpoint::writer::OwnedTensor>,
        names: Vec<(String, usize)>,
        fingerprint: String,
        layer_sources: Vec<usize>,
    ) -> Result<Self, CheckpointError> {
        let mut infos = Vec::with_capacity(physical.len());
        let mut shards = Vec::with_capacity(physical.len());
        for (i, t) in physical.into_iter().enumerate() {
            infos.push(TensorInfo { dtype: t.dtype, shape: t.shape, data_offsets: (0, t.data.len()) });
            shards.push(Shard { file_name: format!("{label}#{i}"), mmap: ShardBytes::Owned(t.data), data_start: 0 });
        }
        let mut tensors = HashMap::with_capacity(names.len());
        for (name, p) in names {
            let info = infos.get(p).ok_or_else(|| CheckpointError::MissingTensor(name.clone()))?.clone();
            tensors.insert(name, (p, info));
        }
        let mut ckpt = Checkpoint {
            dir: PathBuf::from(label),
            config,
            shards,
            tensors,
            fingerprint,
            unexpected: Vec::new(),
            layer_sources: Some(layer_sources),
        };
        ckpt.validate()?;
        Ok(ckpt)
    }

    /// The decoder layer whose tensors layer `i` shares (`i` itself in a checkpoint read from files).
    pub fn layer_source(&self, i: usize) -> usize {
        self.layer_sources.as_ref().and_then(|v| v.get(i).copied()).unwrap_or(i)
    }

    fn validate(&mut self) -> Result<(), CheckpointError> {
        let specs = expected_tensors(&self.config);
        let mut problems = Vec::new();
        let mut missing = Vec::new();
        let mut known: std::collections::HashSet<String> = std::collections::HashSet::new();
        let block = self.config.quantization.as_ref().map(|q| q.weight_block_size).unwrap_or([128, 128]);
        for spec in &specs {
            known.insert(spec.name.clone());
            let Some(t) = self.get(&spec.name) else {
                if !spec.optional {
                    missing.push(spec.name.clone());
                }
                continue;
            };
            if let Err(msg) = check_tensor(spec, &t) {
                problems.push(format!("  `{}` (in {}): {msg}", spec.name, t.file));
                continue;
            }
            if spec.expect == Expect::Linear && t.dtype == Dtype::F8_E4M3 {
                let sname = scale_name(&spec.name);
                known.insert(sname.clone());
                let want = vec![spec.shape[0].div_ceil(block[0]), spec.shape[1].div_ceil(block[1])];
                match self.get(&sname) {
                    None => missing.push(sname),
                    Some(s) if s.dtype != Dtype::F32 => {
                        problems.push(format!("  `{sname}` (in {}): dtype {:?}, expected F32", s.file, s.dtype))
                    }
                    Some(s) if s.shape != want.as_slice() => problems.push(format!(
                        "  `{sname}` (in {}): shape {:?}, expected {want:?} (ceil of {:?} / {block:?})",
                        s.file, s.shape, spec.shape
                    )),
                    Some(_) => {}
                }
            }
        }
        let mut unexpected: Vec<String> = self.tensors.keys().filter(|n| !known.contains(*n)).cloned().collect();
        unexpected.sort();
        if !missing.is_empty() {
            let shown: Vec<_> = missing.iter().take(20).map(|n| format!("  missing `{n}`")).collect();
            problems.push(format!(
                "{} tensor(s) missing{}:\n{}",
                missing.len(),
                if missing.len() > 20 { " (first 20 shown)" } else { "" },
                shown.join("\n")
            ));
        }
        if !problems.is_empty() {
            return Err(CheckpointError::Mismatch(problems.join("\n")));
        }
        if !unexpected.is_empty() {
            tracing::warn!(
                count = unexpected.len(),
                first = %unexpected.iter().take(5).cloned().collect::<Vec<_>>().join(", "),
                "checkpoint has tensors the config does not use; they are ignored"
            );
        }
        self.unexpected = unexpected;
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Hex sha256 over config.json, every shard's name and header (names, dtypes, shapes, offsets) and the
    /// first and last 256 bytes of every tensor.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn unexpected(&self) -> &[String] {
        &self.unexpected
    }

    pub fn num_tensors(&self) -> usize {
        self.tensors.len()
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn get(&self, name: &str) -> Option<TensorRef<'_>> {
        let (name, (shard, info)) = self.tensors.get_key_value(name)?;
        let s = &self.shards[*shard];
        let (a, b) = info.data_offsets;
        Some(TensorRef {
            name,
            file: &s.file_name,
            dtype: info.dtype,
            shape: &info.shape,
            data: &s.mmap[s.data_start + a..s.data_start + b],
        })
    }

    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>, CheckpointError> {
        self.get(name).ok_or_else(|| CheckpointError::MissingTensor(name.to_string()))
    }

    /// A float tensor as f32.
    pub fn f32(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        self.tensor(name)?.to_f32()
    }

    /// A linear weight `[out, in]` fully dequantized to f32 (FP8 x block scale, or the float values).
    pub fn dequantized(&self, name: &str) -> Result<Vec<f32>, CheckpointError> {
        let w = self.tensor(name)?;
        if w.dtype != Dtype::F8_E4M3 {
            return w.to_f32();
        }
        let s = self.tensor(&scale_name(name))?;
        let block = self.config.quantization.as_ref().map(|q| q.weight_block_size).unwrap_or([128, 128]);
        Ok(quant::dequantize(w.data, &s.to_f32()?, w.shape[0], w.shape[1], block))
    }

    /// Bytes of tensor data across all shards.
    pub fn total_bytes(&self) -> usize {
        self.tensors.values().map(|(_, i)| i.data_offsets.1 - i.data_offsets.0).sum()
    }
}

fn check_tensor(spec: &TensorSpec, t: &TensorRef<'_>) -> Result<(), String> {
    if t.shape != spec.shape.as_slice() {
        return Err(format!("shape {:?}, expected {:?}", t.shape, spec.shape));
    }
    let ok = match spec.expect {
        Expect::Linear => matches!(t.dtype, Dtype::F8_E4M3 | Dtype::BF16 | Dtype::F16 | Dtype::F32),
        Expect::Float => matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32),
    };
    if !ok {
        let want = match spec.expect {
            Expect::Linear => "F8_E4M3 (with weight_scale_inv), BF16, F16 or F32",
            Expect::Float => "BF16, F16 or F32",
        };
        return Err(format!("dtype {:?}, expected {want}", t.dtype));
    }
    Ok(())
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
