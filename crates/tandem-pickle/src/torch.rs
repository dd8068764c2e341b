//! `torch.save` checkpoints (the zip format): a pickled state dict whose tensors point at
//! raw little-endian storages stored next to it in the archive.
//!
//! ```text
//! <archive>/data.pkl      the pickle; tensors are _rebuild_tensor_v2(storage, offset, size, stride, ...)
//! <archive>/data/<key>    the bytes of storage <key>
//! <archive>/byteorder     "little"
//! ```

use std::collections::HashMap;
use std::fs::File;
use std::io::{Cursor, Read, Seek};
use std::path::{Path, PathBuf};

use crate::error::PickleError;
use crate::machine::loads;
use crate::value::Value;
use crate::zip_end::check_declared_entries;

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

/// Most bytes of `data.pkl` the plain readers ([`read_torch_state_dict`],
/// [`read_torch_state_dict_from_bytes`]) decompress; [`open_torch_state_dict`] takes its own.
pub const DEFAULT_MAX_PICKLE_BYTES: u64 = 64 << 20;

/// Reads a torch.save zip file holding a state dict, or a dict that wraps one state dict
/// together with scalars (seed 004's snapshot: `{"MODEL_STATE": ..., "EPOCHS_RUN": 7}`).
/// `data.pkl` may decompress to at most [`DEFAULT_MAX_PICKLE_BYTES`]; the storages are
/// bounded only by what the pickle declares. To read a file for a known model, use
/// [`open_torch_state_dict`], which checks the tensors before reading any storage.
pub fn read_torch_state_dict(path: &Path) -> Result<TorchCheckpoint, PickleError> {
    open_torch_state_dict(path, DEFAULT_MAX_PICKLE_BYTES)?.read_storages(u64::MAX)
}

/// [`read_torch_state_dict`] on bytes already in memory; `path` only names them in errors.
pub fn read_torch_state_dict_from_bytes(
    bytes: &[u8],
    path: &Path,
) -> Result<TorchCheckpoint, PickleError> {
    let archive = Archive::open(Cursor::new(bytes), path)?;
    TorchStateDict::parse(archive, DEFAULT_MAX_PICKLE_BYTES)?.read_storages(u64::MAX)
}

/// Opens a torch.save file and reads its pickle (at most `max_pickle_bytes` once
/// decompressed), but none of its storages: the caller checks [`TorchStateDict::tensors`]
/// against what it expects, then reads them with [`TorchStateDict::read_storages`].
pub fn open_torch_state_dict(
    path: &Path,
    max_pickle_bytes: u64,
) -> Result<TorchStateDict<File>, PickleError> {
    let file = File::open(path).map_err(|source| PickleError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    TorchStateDict::parse(Archive::open(file, path)?, max_pickle_bytes)
}

/// The element type of a tensor in a torch.save file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorDtype {
    /// `torch.float32`.
    F32,
    /// `torch.int64`.
    I64,
}

impl TensorDtype {
    /// Bytes per element.
    pub fn element_size(self) -> usize {
        match self {
            TensorDtype::F32 => 4,
            TensorDtype::I64 => 8,
        }
    }
}

/// What the pickle says of one tensor, before its storage is read.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorHeader {
    /// The state-dict key.
    pub name: String,
    /// The dimensions, PyTorch order.
    pub shape: Vec<usize>,
    /// The element type.
    pub dtype: TensorDtype,
}

/// A tensor whose storage has not been read yet: its header and where its elements lie.
struct PendingTensor {
    header: TensorHeader,
    storage: StorageRef,
    offset: usize,
}

/// A storage of the archive, as the persistent id names it.
#[derive(Debug, Clone, PartialEq)]
struct StorageRef {
    key: String,
    dtype: TensorDtype,
    len: usize,
}

impl StorageRef {
    fn byte_len(&self) -> Option<usize> {
        self.len.checked_mul(self.dtype.element_size())
    }
}

/// A torch.save file whose pickle has been read and whose storages have not.
pub struct TorchStateDict<R> {
    archive: Archive<R>,
    pending: Vec<PendingTensor>,
    headers: Vec<TensorHeader>,
    state_dict_key: Option<String>,
    scalars: Vec<(String, Scalar)>,
}

impl<R: Read + Seek> TorchStateDict<R> {
    fn parse(mut archive: Archive<R>, max_pickle_bytes: u64) -> Result<Self, PickleError> {
        let pickle = archive.read_entry("data.pkl", Some(max_pickle_bytes))?;
        let root = loads(&pickle).map_err(|error| archive.error(format!("data.pkl: {error}")))?;
        drop(pickle);
        let (state_dict, state_dict_key, scalars) = find_state_dict(&root, &archive.path)?;
        let mut pending = Vec::with_capacity(state_dict.len());
        let mut entries: HashMap<&str, usize> = HashMap::with_capacity(state_dict.len());
        for (index, (key, value)) in state_dict.iter().enumerate() {
            let name = key.as_text().ok_or_else(|| {
                archive.error(format!("state dict key {} is not text", key.describe()))
            })?;
            // torch.save writes each key once; a repeated one would be decoded once per entry.
            if let Some(first) = entries.insert(name, index) {
                return Err(archive.error(format!(
                    "state dict key {name:?} appears more than once (entries {} and {}): a \
                     state dict names each tensor once",
                    first + 1,
                    index + 1
                )));
            }
            pending.push(archive.parse_tensor(name, value)?);
        }
        let headers = pending.iter().map(|tensor| tensor.header.clone()).collect();
        Ok(TorchStateDict {
            archive,
            pending,
            headers,
            state_dict_key,
            scalars,
        })
    }

    /// The tensors of the state dict, in the file's order.
    pub fn tensors(&self) -> &[TensorHeader] {
        &self.headers
    }

    /// Reads the storages the tensors view, each once, refusing before reading any when
    /// together they would hold more than `max_storage_bytes`, or when the tensors' own
    /// elements would (many tensors viewing one storage each get a copy); a storage is
    /// released as soon as the tensors that view it have their elements.
    pub fn read_storages(mut self, max_storage_bytes: u64) -> Result<TorchCheckpoint, PickleError> {
        let storages = self.distinct_storages()?;
        let total: u64 = storages
            .iter()
            .map(|storage| storage.byte_len().unwrap_or(usize::MAX) as u64)
            .fold(0u64, u64::saturating_add);
        if total > max_storage_bytes {
            return Err(self.archive.error(format!(
                "its storages hold {total} bytes, more than the {max_storage_bytes} bytes the tensors being loaded need"
            )));
        }
        let decoded: u64 = self
            .headers
            .iter()
            .map(|header| {
                let numel = header
                    .shape
                    .iter()
                    .try_fold(1usize, |n, &dim| n.checked_mul(dim));
                numel
                    .and_then(|numel| numel.checked_mul(header.dtype.element_size()))
                    .unwrap_or(usize::MAX) as u64
            })
            .fold(0u64, u64::saturating_add);
        if decoded > max_storage_bytes {
            return Err(self.archive.error(format!(
                "its tensors hold {decoded} bytes, more than the {max_storage_bytes} bytes the tensors being loaded need"
            )));
        }
        let mut tensors: Vec<Option<NamedTensor>> = vec![None; self.pending.len()];
        for storage in &storages {
            let bytes = self.archive.storage_bytes(storage)?;
            for (index, tensor) in self.pending.iter().enumerate() {
                if tensor.storage.key == storage.key {
                    tensors[index] = Some(tensor.decode(&bytes));
                }
            }
        }
        Ok(TorchCheckpoint {
            tensors: tensors.into_iter().flatten().collect(),
            state_dict_key: self.state_dict_key,
            scalars: self.scalars,
        })
    }

    /// The storages viewed by the tensors, each once; a key named with two types or sizes
    /// is an error.
    fn distinct_storages(&self) -> Result<Vec<StorageRef>, PickleError> {
        let mut storages: Vec<StorageRef> = Vec::new();
        let mut by_key: HashMap<&str, usize> = HashMap::new();
        for tensor in &self.pending {
            match by_key.get(tensor.storage.key.as_str()) {
                Some(&index) if storages[index] != tensor.storage => {
                    return Err(self.archive.tensor_error(
                        &tensor.header.name,
                        format!(
                            "storage {} is declared as {:?} x {}, and elsewhere as {:?} x {}",
                            tensor.storage.key,
                            tensor.storage.dtype,
                            tensor.storage.len,
                            storages[index].dtype,
                            storages[index].len
                        ),
                    ))
                }
                Some(_) => {}
                None => {
                    by_key.insert(&tensor.storage.key, storages.len());
                    storages.push(tensor.storage.clone());
                }
            }
        }
        Ok(storages)
    }
}

impl PendingTensor {
    /// Copies this tensor's elements out of its storage's bytes (already checked to hold them).
    fn decode(&self, storage: &[u8]) -> NamedTensor {
        let numel: usize = self.header.shape.iter().product();
        let element_size = self.header.dtype.element_size();
        let range = &storage[self.offset * element_size..(self.offset + numel) * element_size];
        let data = match self.header.dtype {
            TensorDtype::F32 => TensorData::F32(
                range
                    .chunks_exact(4)
                    .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
                    .collect(),
            ),
            TensorDtype::I64 => TensorData::I64(
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
        NamedTensor {
            name: self.header.name.clone(),
            shape: self.header.shape.clone(),
            data,
        }
    }
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

/// The zip archive of a torch.save file, with its storages read on demand.
struct Archive<R> {
    zip: zip::ZipArchive<R>,
    prefix: String,
    path: PathBuf,
}

impl<R: Read + Seek> Archive<R> {
    fn open(mut reader: R, path: &Path) -> Result<Archive<R>, PickleError> {
        check_declared_entries(&mut reader, path)?;
        let zip = zip::ZipArchive::new(reader).map_err(|error| PickleError::Archive {
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

    /// Parses `_rebuild_tensor_v2(storage, storage_offset, size, stride, ...)`, checking that
    /// the elements lie inside the storage the persistent id declares; reads no storage.
    fn parse_tensor(&self, name: &str, value: &Value) -> Result<PendingTensor, PickleError> {
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
        let storage = self.parse_storage_id(name, storage)?;
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
            .is_none_or(|end| end > storage.len)
        {
            return Err(self.tensor_error(
                name,
                format!(
                    "elements {offset}..{offset}+{numel} lie outside its storage of {}",
                    storage.len
                ),
            ));
        }
        if storage.byte_len().is_none() {
            return Err(self.tensor_error(name, format!("storage {} is too large", storage.key)));
        }
        Ok(PendingTensor {
            header: TensorHeader {
                name: name.to_string(),
                shape,
                dtype: storage.dtype,
            },
            storage,
            offset,
        })
    }

    /// Parses the persistent id `('storage', torch.FloatStorage, key, location, numel)`.
    fn parse_storage_id(&self, name: &str, storage: &Value) -> Result<StorageRef, PickleError> {
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
        let dtype = if class.is_global("torch", "FloatStorage") {
            TensorDtype::F32
        } else if class.is_global("torch", "LongStorage") {
            TensorDtype::I64
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
        let len = self.non_negative(name, "storage size", numel)?;
        Ok(StorageRef {
            key: key.to_string(),
            dtype,
            len,
        })
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

    /// The bytes of a storage, checked to be exactly as many as its persistent id declares.
    fn storage_bytes(&mut self, storage: &StorageRef) -> Result<Vec<u8>, PickleError> {
        let expected = storage.byte_len().unwrap_or(usize::MAX);
        let bytes = self.read_entry(&format!("data/{}", storage.key), Some(expected as u64))?;
        if bytes.len() != expected {
            return Err(self.error(format!(
                "storage {} holds {} bytes, expected {expected}",
                storage.key,
                bytes.len()
            )));
        }
        Ok(bytes)
    }
}
