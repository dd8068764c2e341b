//! `torch.save` checkpoints (the zip format): a pickled state dict whose tensors point at
//! raw little-endian storages stored next to it in the archive.
//!
//! ```text
//! <archive>/data.pkl      the pickle; tensors are _rebuild_tensor_v2(storage, offset, size, stride, ...)
//! <archive>/data/<key>    the bytes of storage <key>
//! <archive>/byteorder     "little"
//! ```

use std::collections::HashMap;
use std::io::{Cursor, Read};
use std::path::{Path, PathBuf};

use crate::error::PickleError;
use crate::machine::loads;
use crate::value::Value;

/// One named tensor of a state dict, contiguous and row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct NamedTensor {
    /// The state-dict key, e.g. `0.conv.weight`.
    pub name: String,
    /// The dimensions, PyTorch order (e.g. OIHW for a convolution weight).
    pub shape: Vec<usize>,
    /// The elements.
    pub data: TensorData,
}

/// The elements of a [`NamedTensor`].
#[derive(Debug, Clone, PartialEq)]
pub enum TensorData {
    /// `torch.float32`.
    F32(Vec<f32>),
    /// `torch.int64` (e.g. BatchNorm's `num_batches_tracked`).
    I64(Vec<i64>),
}

impl TensorData {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(values) => values.len(),
            TensorData::I64(values) => values.len(),
        }
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A non-tensor entry stored next to a state dict (e.g. `EPOCHS_RUN`).
#[derive(Debug, Clone, PartialEq)]
pub enum Scalar {
    /// `None`.
    None,
    /// A `bool`.
    Bool(bool),
    /// An `int`.
    Int(i64),
    /// A `float`.
    Float(f64),
    /// A `str`.
    String(String),
}

/// What a torch.save file holds: a state dict, and the scalars stored beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchCheckpoint {
    /// The tensors, in the file's order.
    pub tensors: Vec<NamedTensor>,
    /// The key of the state dict when the file wraps it in a dict (e.g. `MODEL_STATE`);
    /// `None` when the file is the state dict itself.
    pub state_dict_key: Option<String>,
    /// The other scalar entries of the wrapping dict, e.g. `("EPOCHS_RUN", Int(7))`.
    pub scalars: Vec<(String, Scalar)>,
}

impl TorchCheckpoint {
    /// The tensor with this name.
    pub fn tensor(&self, name: &str) -> Option<&NamedTensor> {
        self.tensors.iter().find(|tensor| tensor.name == name)
    }

    /// The scalar entry with this key.
    pub fn scalar(&self, key: &str) -> Option<&Scalar> {
        self.scalars
            .iter()
            .find(|(entry_key, _)| entry_key == key)
            .map(|(_, value)| value)
    }
}

/// Reads a torch.save zip file holding a state dict, or a dict that wraps one state dict
/// together with scalars (seed 004's snapshot: `{"MODEL_STATE": ..., "EPOCHS_RUN": 7}`).
pub fn read_torch_state_dict(path: &Path) -> Result<TorchCheckpoint, PickleError> {
    let bytes = std::fs::read(path).map_err(|source| PickleError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    read_torch_state_dict_from_bytes(&bytes, path)
}

/// [`read_torch_state_dict`] on bytes already in memory; `path` only names them in errors.
pub fn read_torch_state_dict_from_bytes(
    bytes: &[u8],
    path: &Path,
) -> Result<TorchCheckpoint, PickleError> {
    let mut archive = Archive::open(bytes, path)?;
    let pickle = archive.read_entry("data.pkl", None)?;
    let root = loads(&pickle).map_err(|error| archive.error(format!("data.pkl: {error}")))?;
    let (state_dict, state_dict_key, scalars) = find_state_dict(&root, path)?;
    let mut tensors = Vec::with_capacity(state_dict.len());
    for (key, value) in state_dict {
        let name = key.as_text().ok_or_else(|| {
            archive.error(format!("state dict key {} is not text", key.describe()))
        })?;
        tensors.push(archive.rebuild_tensor(name, value)?);
    }
    Ok(TorchCheckpoint {
        tensors,
        state_dict_key,
        scalars,
    })
}

/// Splits the unpickled root into the state dict, its key, and the scalars beside it.
#[allow(clippy::type_complexity)]
fn find_state_dict<'v>(
    root: &'v Value,
    path: &Path,
) -> Result<(&'v [(Value, Value)], Option<String>, Vec<(String, Scalar)>), PickleError> {
    let entries = root.as_dict().ok_or_else(|| PickleError::Archive {
        path: path.to_path_buf(),
        message: format!("data.pkl holds {}, expected a dict", root.describe()),
    })?;
    if entries.iter().all(|(_, value)| is_tensor(value)) {
        return Ok((entries, None, Vec::new()));
    }
    let is_state_dict = |value: &Value| {
        value
            .as_dict()
            .is_some_and(|inner| !inner.is_empty() && inner.iter().all(|(_, v)| is_tensor(v)))
    };
    let wrapped: Vec<&(Value, Value)> = entries
        .iter()
        .filter(|(_, value)| is_state_dict(value))
        .collect();
    let [(key, state_dict)] = wrapped.as_slice() else {
        let keys: Vec<String> = entries.iter().map(|(key, _)| key.describe()).collect();
        return Err(PickleError::Archive {
            path: path.to_path_buf(),
            message: format!(
                "expected a state dict or a dict holding exactly one state dict, found {} among keys [{}]",
                wrapped.len(),
                keys.join(", ")
            ),
        });
    };
    let scalars = entries
        .iter()
        .filter_map(|(key, value)| Some((key.as_text()?.to_string(), as_scalar(value)?)))
        .collect();
    let state_dict = state_dict.as_dict().unwrap_or(&[]);
    Ok((state_dict, key.as_text().map(str::to_string), scalars))
}

fn is_tensor(value: &Value) -> bool {
    matches!(value, Value::Object { callable, .. } if callable.is_global("torch._utils", "_rebuild_tensor_v2"))
}

fn as_scalar(value: &Value) -> Option<Scalar> {
    Some(match value {
        Value::None => Scalar::None,
        Value::Bool(flag) => Scalar::Bool(*flag),
        Value::Int(number) => Scalar::Int(*number),
        Value::Float(number) => Scalar::Float(*number),
        Value::String(text) => Scalar::String(text.clone()),
        _ => return None,
    })
}

/// The element types of storages this reader turns into tensors.
#[derive(Clone, Copy)]
enum StorageKind {
    Float,
    Long,
}

impl StorageKind {
    fn element_size(self) -> usize {
        match self {
            StorageKind::Float => 4,
            StorageKind::Long => 8,
        }
    }
}

/// The zip archive of a torch.save file, with its storages read on demand.
struct Archive<'a> {
    zip: zip::ZipArchive<Cursor<&'a [u8]>>,
    prefix: String,
    path: PathBuf,
    storages: HashMap<String, Vec<u8>>,
}

impl<'a> Archive<'a> {
    fn open(bytes: &'a [u8], path: &Path) -> Result<Archive<'a>, PickleError> {
        let zip =
            zip::ZipArchive::new(Cursor::new(bytes)).map_err(|error| PickleError::Archive {
                path: path.to_path_buf(),
                message: format!("not a torch.save zip archive: {error}"),
            })?;
        let pickles: Vec<&str> = zip
            .file_names()
            .filter(|name| name.ends_with("/data.pkl") || *name == "data.pkl")
            .collect();
        let [pickle_name] = pickles.as_slice() else {
            return Err(PickleError::Archive {
                path: path.to_path_buf(),
                message: format!(
                    "expected exactly one data.pkl entry in the archive, found {}",
                    pickles.len()
                ),
            });
        };
        let prefix = pickle_name.trim_end_matches("data.pkl").to_string();
        let mut archive = Archive {
            zip,
            prefix,
            path: path.to_path_buf(),
            storages: HashMap::new(),
        };
        archive.check_byte_order()?;
        Ok(archive)
    }

    fn check_byte_order(&mut self) -> Result<(), PickleError> {
        let name = format!("{}byteorder", self.prefix);
        if self.zip.index_for_name(&name).is_none() {
            return Ok(());
        }
        let order = self.read_entry("byteorder", Some(16))?;
        if order != b"little" {
            return Err(self.error(format!(
                "byteorder is {:?}, expected \"little\"",
                String::from_utf8_lossy(&order)
            )));
        }
        Ok(())
    }

    /// Reads `<prefix><relative_name>`, refusing to read more than `limit` bytes.
    fn read_entry(
        &mut self,
        relative_name: &str,
        limit: Option<u64>,
    ) -> Result<Vec<u8>, PickleError> {
        let name = format!("{}{relative_name}", self.prefix);
        let mut entry = self
            .zip
            .by_name(&name)
            .map_err(|error| PickleError::Archive {
                path: self.path.clone(),
                message: format!("entry {name}: {error}"),
            })?;
        let limit = limit.unwrap_or(entry.size());
        let mut bytes = Vec::new();
        entry
            .by_ref()
            .take(limit.saturating_add(1))
            .read_to_end(&mut bytes)
            .map_err(|error| PickleError::Archive {
                path: self.path.clone(),
                message: format!("entry {name}: {error}"),
            })?;
        drop(entry);
        if bytes.len() as u64 > limit {
            return Err(self.error(format!("entry {name} is longer than {limit} bytes")));
        }
        Ok(bytes)
    }

    fn error(&self, message: String) -> PickleError {
        PickleError::Archive {
            path: self.path.clone(),
            message,
        }
    }

    fn tensor_error(&self, tensor: &str, message: String) -> PickleError {
        PickleError::Tensor {
            path: self.path.clone(),
            tensor: tensor.to_string(),
            message,
        }
    }

    /// Rebuilds `_rebuild_tensor_v2(storage, storage_offset, size, stride, ...)`.
    fn rebuild_tensor(&mut self, name: &str, value: &Value) -> Result<NamedTensor, PickleError> {
        let Value::Object { args, .. } = value else {
            return Err(self.tensor_error(
                name,
                format!("expected a tensor, found {}", value.describe()),
            ));
        };
        let args = args.as_sequence().unwrap_or(&[]);
        let [storage, offset, size, stride, ..] = args else {
            return Err(self.tensor_error(
                name,
                format!(
                    "_rebuild_tensor_v2 has {} arguments, expected at least 4",
                    args.len()
                ),
            ));
        };
        let (kind, key, storage_len) = self.parse_storage_id(name, storage)?;
        let offset = self.non_negative(name, "storage offset", offset)?;
        let shape = self.dims(name, "size", size)?;
        let strides = self.dims(name, "stride", stride)?;
        self.check_contiguous(name, &shape, &strides)?;
        let numel = shape
            .iter()
            .try_fold(1usize, |total, &dim| total.checked_mul(dim))
            .ok_or_else(|| self.tensor_error(name, format!("shape {shape:?} is too large")))?;
        if offset
            .checked_add(numel)
            .is_none_or(|end| end > storage_len)
        {
            return Err(self.tensor_error(
                name,
                format!(
                    "elements {offset}..{offset}+{numel} lie outside its storage of {storage_len}"
                ),
            ));
        }
        let bytes = self.storage_bytes(name, &key, kind, storage_len)?;
        let element_size = kind.element_size();
        let range = &bytes[offset * element_size..(offset + numel) * element_size];
        let data = match kind {
            StorageKind::Float => TensorData::F32(
                range
                    .chunks_exact(4)
                    .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
                    .collect(),
            ),
            StorageKind::Long => TensorData::I64(
                range
                    .chunks_exact(8)
                    .map(|chunk| {
                        let mut word = [0u8; 8];
                        word.copy_from_slice(chunk);
                        i64::from_le_bytes(word)
                    })
                    .collect(),
            ),
        };
        Ok(NamedTensor {
            name: name.to_string(),
            shape,
            data,
        })
    }

    /// Parses the persistent id `('storage', torch.FloatStorage, key, location, numel)`.
    fn parse_storage_id(
        &self,
        name: &str,
        storage: &Value,
    ) -> Result<(StorageKind, String, usize), PickleError> {
        let fields = match storage {
            Value::PersistentId(id) => id.as_sequence().unwrap_or(&[]),
            _ => &[],
        };
        let [tag, class, key, _location, numel] = fields else {
            return Err(self.tensor_error(
                name,
                format!(
                    "storage is {}, expected a persistent id ('storage', class, key, location, numel)",
                    storage.describe()
                ),
            ));
        };
        if tag.as_text() != Some("storage") {
            return Err(self.tensor_error(
                name,
                format!("storage tag is {}, expected 'storage'", tag.describe()),
            ));
        }
        let kind = if class.is_global("torch", "FloatStorage") {
            StorageKind::Float
        } else if class.is_global("torch", "LongStorage") {
            StorageKind::Long
        } else {
            return Err(self.tensor_error(
                name,
                format!(
                    "storage type {} is not supported, expected torch.FloatStorage or torch.LongStorage",
                    class.describe()
                ),
            ));
        };
        let key = key.as_text().ok_or_else(|| {
            self.tensor_error(
                name,
                format!("storage key is {}, expected text", key.describe()),
            )
        })?;
        let numel = self.non_negative(name, "storage size", numel)?;
        Ok((kind, key.to_string(), numel))
    }

    fn non_negative(&self, name: &str, what: &str, value: &Value) -> Result<usize, PickleError> {
        value
            .as_int()
            .and_then(|number| usize::try_from(number).ok())
            .ok_or_else(|| {
                self.tensor_error(
                    name,
                    format!(
                        "{what} is {}, expected a non-negative int",
                        value.describe()
                    ),
                )
            })
    }

    fn dims(&self, name: &str, what: &str, value: &Value) -> Result<Vec<usize>, PickleError> {
        let items = value.as_sequence().ok_or_else(|| {
            self.tensor_error(
                name,
                format!("{what} is {}, expected a tuple", value.describe()),
            )
        })?;
        items
            .iter()
            .map(|item| self.non_negative(name, what, item))
            .collect()
    }

    /// Only contiguous row-major tensors are accepted; dimensions of size 1 may have any
    /// stride, as in PyTorch's own contiguity test.
    fn check_contiguous(
        &self,
        name: &str,
        shape: &[usize],
        strides: &[usize],
    ) -> Result<(), PickleError> {
        if shape.len() != strides.len() {
            return Err(self.tensor_error(
                name,
                format!("size {shape:?} and stride {strides:?} have different lengths"),
            ));
        }
        let mut expected = 1usize;
        for (&dim, &stride) in shape.iter().zip(strides).rev() {
            if dim != 1 && stride != expected {
                return Err(self.tensor_error(
                    name,
                    format!("stride {strides:?} for size {shape:?} is not contiguous (row-major expected)"),
                ));
            }
            expected = expected.saturating_mul(dim);
        }
        Ok(())
    }

    /// The bytes of storage `key`, checked to hold `storage_len` elements.
    fn storage_bytes(
        &mut self,
        name: &str,
        key: &str,
        kind: StorageKind,
        storage_len: usize,
    ) -> Result<&[u8], PickleError> {
        let expected = storage_len
            .checked_mul(kind.element_size())
            .ok_or_else(|| self.tensor_error(name, format!("storage {key} is too large")))?;
        if !self.storages.contains_key(key) {
            let bytes = self.read_entry(&format!("data/{key}"), Some(expected as u64))?;
            self.storages.insert(key.to_string(), bytes);
        }
        let bytes = self.storages.get(key).map(Vec::as_slice).unwrap_or(&[]);
        if bytes.len() != expected {
            return Err(self.tensor_error(
                name,
                format!(
                    "storage {key} holds {} bytes, expected {expected}",
                    bytes.len()
                ),
            ));
        }
        Ok(bytes)
    }
}
