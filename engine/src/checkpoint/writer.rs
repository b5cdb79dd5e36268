//! Writes checkpoints in the HF layout: safetensors shards named `model-0000i-of-0000n.safetensors` and a
//! `model.safetensors.index.json` mapping every tensor to its shard.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use safetensors::{Dtype, View};

use super::{CheckpointError, INDEX_FILE};

/// An owned tensor to write.
#[derive(Debug, Clone)]
pub struct OwnedTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    pub fn bf16(shape: Vec<usize>, values: &[f32]) -> Self {
        let data = values.iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect();
        OwnedTensor { dtype: Dtype::BF16, shape, data }
    }

    pub fn f32(shape: Vec<usize>, values: &[f32]) -> Self {
        OwnedTensor { dtype: Dtype::F32, shape, data: values.iter().flat_map(|v| v.to_le_bytes()).collect() }
    }

    pub fn fp8(shape: Vec<usize>, codes: Vec<u8>) -> Self {
        OwnedTensor { dtype: Dtype::F8_E4M3, shape, data: codes }
    }
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes `tensors` into `num_shards` shards of roughly equal size (tensor order kept, so a layer's
/// tensors stay together) plus the index.
pub fn write_sharded(dir: &Path, tensors: &[(String, OwnedTensor)], num_shards: usize) -> Result<(), CheckpointError> {
    let num_shards = num_shards.clamp(1, tensors.len().max(1));
    let total: usize = tensors.iter().map(|(_, t)| t.data.len()).sum();
    let per_shard = total.div_ceil(num_shards);
    let mut groups: Vec<Vec<&(String, OwnedTensor)>> = vec![Vec::new(); num_shards];
    let (mut shard, mut filled) = (0, 0usize);
    for (i, t) in tensors.iter().enumerate() {
        // Move on when this shard is full, but leave at least one tensor for every remaining shard.
        let remaining_tensors = tensors.len() - i;
        let remaining_shards = num_shards - shard - 1;
        if shard + 1 < num_shards
            && !groups[shard].is_empty()
            && (filled >= per_shard || remaining_tensors <= remaining_shards)
        {
            shard += 1;
            filled = 0;
        }
        groups[shard].push(t);
        filled += t.1.data.len();
    }
    let mut weight_map = BTreeMap::new();
    for (i, group) in groups.iter().enumerate() {
        let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, num_shards);
        let path = dir.join(&file);
        safetensors::serialize_to_file(group.iter().map(|(n, t)| (n.as_str(), t)), None, &path)
            .map_err(|e| CheckpointError::Format { path: path.clone(), msg: format!("cannot write: {e}") })?;
        // safetensors writes through a private temp file (0600); checkpoints are shared read-only files.
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644))
                .map_err(|source| CheckpointError::Io { path: path.clone(), source })?;
        }
        for (name, _) in group {
            weight_map.insert(name.clone(), file.clone());
        }
    }
    let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    let path = dir.join(INDEX_FILE);
    let text = serde_json::to_string_pretty(&index).expect("index serializes");
    std::fs::write(&path, text).map_err(|source| CheckpointError::Io { path, source })
}
