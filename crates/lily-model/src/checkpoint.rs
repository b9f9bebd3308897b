//! Memory-mapped safetensors checkpoints: a single `model.safetensors` or shards listed by
//! `model.safetensors.index.json`. Every header is validated before any tensor is touched; every error names the
//! file and, where there is one, the tensor.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};

/// A file's tensors as its header lists them: name and where the data lies.
type TensorInfos = Vec<(String, TensorInfo)>;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("{path}: tensor `{tensor}`: {message}")]
    Tensor {
        path: PathBuf,
        tensor: String,
        message: String,
    },
    #[error("{dir}: no tensor `{tensor}` in the checkpoint")]
    Missing { dir: PathBuf, tensor: String },
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
}

fn file_err(path: &Path, message: impl Into<String>) -> CheckpointError {
    CheckpointError::File {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range within the mapped file.
    pub start: usize,
    pub end: usize,
}

/// The bytes of one safetensors file: mapped from disk, or generated in memory.
pub enum Buffer {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Buffer {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Buffer::Mapped(m) => m,
            Buffer::Owned(v) => v,
        }
    }
}

struct Shard {
    path: PathBuf,
    map: Arc<Buffer>,
}

pub struct Checkpoint {
    pub dir: PathBuf,
    shards: Vec<Shard>,
    tensors: HashMap<String, (usize, TensorInfo)>,
}

/// A located tensor: its file, mapping and byte range.
#[derive(Clone, Copy)]
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub path: &'a Path,
    pub map: &'a Arc<Buffer>,
    pub info: &'a TensorInfo,
}

impl TensorRef<'_> {
    pub fn bytes(&self) -> &[u8] {
        &self.map[self.info.start..self.info.end]
    }

    pub fn error(&self, message: impl Into<String>) -> CheckpointError {
        CheckpointError::Tensor {
            path: self.path.to_path_buf(),
            tensor: self.name.to_string(),
            message: message.into(),
        }
    }

    pub fn expect(&self, dtype: Dtype, shape: &[usize]) -> Result<(), CheckpointError> {
        if self.info.dtype != dtype || self.info.shape != shape {
            return Err(self.error(format!(
                "expected {dtype:?} {shape:?}, found {:?} {:?}",
                self.info.dtype, self.info.shape
            )));
        }
        Ok(())
    }

    /// A small float tensor (norms, conv weights, gates) of the given element count, converted to f32.
    pub fn to_f32(&self, len: usize) -> Result<Vec<f32>, CheckpointError> {
        let n: usize = self.info.shape.iter().product();
        if n != len {
            return Err(self.error(format!("expected {len} elements, found shape {:?}", self.info.shape)));
        }
        self.f32_range(0, len)
    }

    /// Elements `start..start + len` of a float tensor (in storage order), converted to f32: a large tensor is
    /// read a block at a time without converting all of it.
    pub fn f32_range(&self, start: usize, len: usize) -> Result<Vec<f32>, CheckpointError> {
        let n: usize = self.info.shape.iter().product();
        if start + len > n {
            return Err(self.error(format!(
                "elements {start}..{} are past the end of shape {:?}",
                start + len,
                self.info.shape
            )));
        }
        let size = match self.info.dtype {
            Dtype::F32 => 4,
            Dtype::BF16 | Dtype::F16 => 2,
            other => {
                return Err(self.error(format!(
                    "dtype {other:?} is not a float type (expected BF16, F16 or F32)"
                )))
            }
        };
        let b = &self.bytes()[start * size..(start + len) * size];
        let values: Vec<f32> = match self.info.dtype {
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Dtype::BF16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => unreachable!("checked above"),
        };
        match values.iter().position(|v| !v.is_finite()) {
            Some(i) => Err(self.not_finite(start + i, values[i])),
            None => Ok(values),
        }
    }

    /// The first element of a bf16 tensor (an MLX module's scales or biases, which the backends take as stored)
    /// that is a NaN or an infinity, as an error.
    pub fn check_finite_bf16(&self) -> Result<(), CheckpointError> {
        self.expect(Dtype::BF16, &self.info.shape)?;
        let values = self
            .bytes()
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]));
        match values.enumerate().find(|(_, v)| !v.is_finite()) {
            Some((i, v)) => Err(self.not_finite(i, v.to_f32())),
            None => Ok(()),
        }
    }

    /// Weights must be finite: a NaN or an infinity would make every logit after it NaN, and the routing and
    /// sampling would then pick experts and tokens from values that mean nothing.
    fn not_finite(&self, index: usize, value: f32) -> CheckpointError {
        self.error(format!(
            "element {index} is {value}, not a finite number: the checkpoint is corrupt"
        ))
    }
}

impl Checkpoint {
    pub fn open(dir: &Path) -> Result<Checkpoint, CheckpointError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let files: Vec<PathBuf> = if index_path.exists() {
            shard_files(&index_path)?
        } else if single.exists() {
            vec![single]
        } else {
            return Err(file_err(
                dir,
                "no model.safetensors or model.safetensors.index.json in this directory",
            ));
        };

        let mut opened = Vec::new();
        for path in files {
            let (map, infos) = open_safetensors(&path)?;
            opened.push((path, map, infos));
        }
        Checkpoint::from_shards(dir, opened)
    }

    /// A checkpoint over safetensors buffers already in memory (the synthetic generator's).
    pub fn from_buffers(dir: &Path, buffers: Vec<(PathBuf, Vec<u8>)>) -> Result<Checkpoint, CheckpointError> {
        let mut opened = Vec::new();
        for (path, bytes) in buffers {
            let infos = parse_header(&bytes).map_err(|m| file_err(&path, m))?;
            opened.push((path, Arc::new(Buffer::Owned(bytes)), infos));
        }
        Checkpoint::from_shards(dir, opened)
    }

    fn from_shards(
        dir: &Path,
        opened: Vec<(PathBuf, Arc<Buffer>, TensorInfos)>,
    ) -> Result<Checkpoint, CheckpointError> {
        let mut shards: Vec<Shard> = Vec::new();
        let mut tensors = HashMap::new();
        for (path, map, infos) in opened {
            let shard_index = shards.len();
            for (name, info) in infos {
                if let Some((other, _)) = tensors.insert(name.clone(), (shard_index, info)) {
                    let other: &Shard = &shards[other];
                    return Err(file_err(
                        &path,
                        format!("tensor `{name}` also appears in {}", other.path.display()),
                    ));
                }
            }
            shards.push(Shard { path, map });
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            tensors,
        })
    }

    pub fn get(&self, name: &str) -> Result<TensorRef<'_>, CheckpointError> {
        let (key, (shard, info)) = self
            .tensors
            .get_key_value(name)
            .ok_or_else(|| CheckpointError::Missing {
                dir: self.dir.clone(),
                tensor: name.to_string(),
            })?;
        let shard = &self.shards[*shard];
        Ok(TensorRef {
            name: key,
            path: &shard.path,
            map: &shard.map,
            info,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }
}

fn shard_files(index_path: &Path) -> Result<Vec<PathBuf>, CheckpointError> {
    let text = std::fs::read_to_string(index_path).map_err(|e| file_err(index_path, e.to_string()))?;
    let index: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| file_err(index_path, format!("not valid JSON: {e}")))?;
    let map = index
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| file_err(index_path, "no `weight_map` object"))?;
    let dir = index_path.parent().unwrap_or(Path::new("."));
    let mut files = BTreeMap::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| file_err(index_path, format!("weight_map entry for `{tensor}` is not a string")))?;
        if file.is_empty() || file.contains('/') || file.contains('\\') || file.starts_with('.') {
            return Err(file_err(
                index_path,
                format!("weight_map names an invalid shard file `{file}`"),
            ));
        }
        let path = dir.join(file);
        if !path.is_file() {
            return Err(file_err(
                index_path,
                format!("shard `{file}` (for tensor `{tensor}`) does not exist"),
            ));
        }
        files.insert(file.to_string(), path);
    }
    if files.is_empty() {
        return Err(file_err(index_path, "weight_map is empty"));
    }
    Ok(files.into_values().collect())
}

/// Maps a safetensors file and validates its header against the file's size.
pub fn open_safetensors(path: &Path) -> Result<(Arc<Buffer>, TensorInfos), CheckpointError> {
    let file = File::open(path).map_err(|e| file_err(path, e.to_string()))?;
    // SAFETY: the file is opened read-only; lily never writes to a checkpoint it has mapped.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| file_err(path, format!("cannot map: {e}")))?;
    let infos = parse_header(&map).map_err(|m| file_err(path, m))?;
    Ok((Arc::new(Buffer::Mapped(map)), infos))
}

/// Parses and validates a safetensors buffer; returns each tensor's absolute byte range.
pub fn parse_header(buffer: &[u8]) -> Result<Vec<(String, TensorInfo)>, String> {
    if buffer.len() < 8 {
        return Err(format!(
            "truncated: {} bytes, too short for a safetensors header",
            buffer.len()
        ));
    }
    let header_len = u64::from_le_bytes(buffer[..8].try_into().unwrap());
    if header_len > (buffer.len() - 8) as u64 {
        return Err(format!(
            "truncated or corrupt: header claims {header_len} bytes but the file has {}",
            buffer.len()
        ));
    }
    let st = SafeTensors::deserialize(buffer).map_err(|e| format!("corrupt safetensors file: {e}"))?;
    let data_start = 8 + header_len as usize;
    let mut infos = Vec::new();
    for (name, view) in st.tensors() {
        let start = view.data().as_ptr() as usize - buffer.as_ptr() as usize;
        debug_assert!(start >= data_start);
        infos.push((
            name,
            TensorInfo {
                dtype: view.dtype(),
                shape: view.shape().to_vec(),
                start,
                end: start + view.data().len(),
            },
        ));
    }
    Ok(infos)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn valid_file() -> Vec<u8> {
        let data: Vec<u8> = (0..48u8).collect();
        let a = safetensors::tensor::TensorView::new(Dtype::F32, vec![2, 2], &data[..16]).unwrap();
        let b = safetensors::tensor::TensorView::new(Dtype::U32, vec![8], &data[16..48]).unwrap();
        safetensors::serialize(vec![("a", a), ("b", b)], None).unwrap()
    }

    #[test]
    fn a_valid_file_parses() {
        let buf = valid_file();
        let infos = parse_header(&buf).unwrap();
        assert_eq!(infos.len(), 2);
    }

    #[test]
    fn truncation_is_reported() {
        let buf = valid_file();
        for cut in [0, 4, 8, 20, buf.len() - 1] {
            let err = parse_header(&buf[..cut]).unwrap_err();
            assert!(err.contains("truncated") || err.contains("corrupt"), "{cut}: {err}");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]
        #[test]
        fn corrupt_headers_never_panic(flips in proptest::collection::vec((0usize..200, any::<u8>()), 1..6)) {
            let mut buf = valid_file();
            let n = buf.len();
            for (pos, byte) in flips {
                buf[pos % n] = byte;
            }
            let _ = parse_header(&buf);
        }

        #[test]
        fn random_json_headers_never_panic(header in "\\{[\"a-z0-9_:,\\[\\]{} .-]{0,120}\\}", tail in 0usize..64) {
            let mut buf = (header.len() as u64).to_le_bytes().to_vec();
            buf.extend_from_slice(header.as_bytes());
            buf.extend(std::iter::repeat_n(7u8, tail));
            let _ = parse_header(&buf);
        }
    }
}
