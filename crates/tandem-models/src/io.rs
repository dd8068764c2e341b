//! Weights I/O: safetensors files and in-memory tensor lists, with PyTorch names, dtypes
//! (f32 parameters and buffers, int64 `num_batches_tracked`) and layouts (OIHW, `[out, in]`).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};

use crate::error::ModelError;
use crate::model::Model;
use crate::tensors::TensorKind;

use tandem_pickle::{open_torch_state_dict, TensorDtype, TensorHeader};
/// Tensors by name (e.g. read from a `torch.save` file) share the pickle reader's types,
/// so a checkpoint read there loads here without conversion.
pub use tandem_pickle::{NamedTensor, TensorData, TorchCheckpoint};

/// Writes the model's `state_dict` to a safetensors file, atomically (temporary file in the
/// same directory, fsync, rename), with `metadata` as the header's string metadata.
pub fn save_safetensors(
    model: &Model,
    path: &Path,
    metadata: &BTreeMap<String, String>,
) -> Result<(), ModelError> {
    let mut views = Vec::with_capacity(model.tensors().len());
    for info in model.tensors() {
        let view = match info.kind {
            TensorKind::BatchCount => {
                let count = i64::try_from(model.num_batches_tracked()).unwrap_or(i64::MAX);
                ByteView {
                    dtype: Dtype::I64,
                    shape: info.shape.clone(),
                    bytes: count.to_le_bytes().to_vec(),
                }
            }
            TensorKind::Param | TensorKind::Buffer => {
                let values = model.tensor_values(&info.name).unwrap_or_default();
                let bytes = values
                    .iter()
                    .flat_map(|value| value.to_le_bytes())
                    .collect();
                ByteView {
                    dtype: Dtype::F32,
                    shape: info.shape.clone(),
                    bytes,
                }
            }
        };
        views.push((info.name.clone(), view));
    }
    let header: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let header = (!header.is_empty()).then_some(header);
    let bytes = safetensors::serialize(views, header).map_err(|error| ModelError::SafeTensors {
        path: path.to_path_buf(),
        message: error.to_string(),
    })?;
    write_atomically(path, &bytes)
}

/// Loads the model's `state_dict` from a safetensors file; every tensor must be present
/// with its exact shape and dtype, and no other tensor may be. Returns the header metadata.
/// On error the model is unchanged.
pub fn load_safetensors(
    model: &mut Model,
    path: &Path,
) -> Result<BTreeMap<String, String>, ModelError> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let parse_error = |error: safetensors::SafeTensorError| ModelError::SafeTensors {
        path: path.to_path_buf(),
        message: error.to_string(),
    };
    let (_, header) = SafeTensors::read_metadata(&bytes).map_err(parse_error)?;
    let file = SafeTensors::deserialize(&bytes).map_err(parse_error)?;
    let source_name = path.display().to_string();
    let mut tensors = Vec::new();
    for (name, view) in file.tensors() {
        let data = match view.dtype() {
            Dtype::F32 => TensorData::F32(
                view.data()
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect(),
            ),
            Dtype::I64 => TensorData::I64(
                view.data()
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]))
                    .collect(),
            ),
            other => {
                let expected = match model.tensor_info(&name).map(|info| info.kind) {
                    Some(TensorKind::BatchCount) => "I64",
                    _ => "F32",
                };
                return Err(ModelError::TensorDtype {
                    source_name,
                    name,
                    found: format!("{other:?}"),
                    expected,
                });
            }
        };
        tensors.push(NamedTensor {
            name,
            shape: view.shape().to_vec(),
            data,
        });
    }
    apply_tensors(model, &tensors, None, &source_name)?;
    let metadata = header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    Ok(metadata)
}

/// Loads the model's `state_dict` from in-memory tensors (e.g. read from a `torch.save`
/// file), removing `strip_prefix` (e.g. `module.`) from names that start with it. Every
/// tensor must be present with its exact shape, and no other tensor may be. On error the
/// model is unchanged.
pub fn load_named_tensors(
    model: &mut Model,
    tensors: &[NamedTensor],
    strip_prefix: Option<&str>,
) -> Result<(), ModelError> {
    apply_tensors(model, tensors, strip_prefix, "tensor list")
}

/// Most bytes a `torch.save` file's pickle may decompress to: a fixed allowance plus one per
/// tensor of the model (a tensor takes a few hundred bytes of pickle; this leaves room for
/// wrappers such as an optimizer state beside the weights).
fn max_pickle_bytes(model: &Model) -> u64 {
    const BASE: u64 = 1 << 20;
    const PER_TENSOR: u64 = 16 << 10;
    BASE + PER_TENSOR * model.tensors().len() as u64
}

/// Bytes of the model's `state_dict` as `torch.save` stores it: f32 parameters and buffers,
/// int64 batch counts.
fn state_dict_bytes(model: &Model) -> u64 {
    model
        .tensors()
        .iter()
        .map(|info| {
            let numel: usize = info.shape.iter().product();
            (numel * expected_dtype(info.kind).element_size()) as u64
        })
        .sum()
}

fn expected_dtype(kind: TensorKind) -> TensorDtype {
    match kind {
        TensorKind::BatchCount => TensorDtype::I64,
        TensorKind::Param | TensorKind::Buffer => TensorDtype::F32,
    }
}

fn dtype_name(dtype: TensorDtype) -> &'static str {
    match dtype {
        TensorDtype::F32 => "F32",
        TensorDtype::I64 => "I64",
    }
}

/// Loads the model's `state_dict` from a `torch.save` file, removing `strip_prefix` (e.g.
/// `module.`) from names that start with it. The names, shapes and dtypes the pickle
/// declares are checked against the model before any storage is read, the pickle may
/// decompress to no more than a model of this size can need, and the storages together may
/// hold no more than the model's tensors; each storage is read once, however many tensors
/// view it. Every tensor must be present and no other may be. On error the model is
/// unchanged. Returns the file's contents (e.g. its scalars such as `EPOCHS_RUN`).
pub fn load_torch_save(
    model: &mut Model,
    path: &Path,
    strip_prefix: Option<&str>,
) -> Result<TorchCheckpoint, ModelError> {
    let source_name = path.display().to_string();
    let state_dict = open_torch_state_dict(path, max_pickle_bytes(model))?;
    let mut seen = BTreeSet::new();
    for header in state_dict.tensors() {
        let name = check_tensor(model, header, strip_prefix, &source_name)?;
        seen.insert(name);
    }
    if let Some(missing) = model
        .tensors()
        .iter()
        .find(|info| !seen.contains(&info.name))
    {
        return Err(ModelError::MissingTensor {
            source_name,
            name: missing.name.clone(),
        });
    }
    let checkpoint = state_dict.read_storages(state_dict_bytes(model))?;
    apply_tensors(model, &checkpoint.tensors, strip_prefix, &source_name)?;
    Ok(checkpoint)
}

/// Checks a tensor the file declares against the model's table: a known name (once
/// `strip_prefix` is removed), the same shape and dtype. Returns the model's name for it.
fn check_tensor(
    model: &Model,
    header: &TensorHeader,
    strip_prefix: Option<&str>,
    source_name: &str,
) -> Result<String, ModelError> {
    let name = match strip_prefix {
        Some(prefix) => header.name.strip_prefix(prefix).unwrap_or(&header.name),
        None => &header.name,
    };
    let Some(info) = model.tensor_info(name) else {
        return Err(ModelError::UnexpectedTensor {
            source_name: source_name.to_string(),
            name: header.name.clone(),
        });
    };
    if header.shape != info.shape {
        return Err(ModelError::TensorShape {
            source_name: source_name.to_string(),
            name: header.name.clone(),
            found: header.shape.clone(),
            expected: info.shape.clone(),
        });
    }
    let expected = expected_dtype(info.kind);
    if header.dtype != expected {
        return Err(ModelError::TensorDtype {
            source_name: source_name.to_string(),
            name: header.name.clone(),
            found: dtype_name(header.dtype).to_string(),
            expected: dtype_name(expected),
        });
    }
    Ok(name.to_string())
}

/// Checks every tensor against the model's table, then copies them in.
fn apply_tensors(
    model: &mut Model,
    tensors: &[NamedTensor],
    strip_prefix: Option<&str>,
    source_name: &str,
) -> Result<(), ModelError> {
    let source_name = source_name.to_string();
    let strip = |name: &str| -> String {
        match strip_prefix {
            Some(prefix) => name.strip_prefix(prefix).unwrap_or(name).to_string(),
            None => name.to_string(),
        }
    };
    let mut by_name: BTreeMap<String, &NamedTensor> = BTreeMap::new();
    for tensor in tensors {
        let name = strip(&tensor.name);
        let Some(info) = model.tensor_info(&name) else {
            return Err(ModelError::UnexpectedTensor {
                source_name,
                name: tensor.name.clone(),
            });
        };
        if tensor.shape != info.shape {
            return Err(ModelError::TensorShape {
                source_name,
                name: tensor.name.clone(),
                found: tensor.shape.clone(),
                expected: info.shape.clone(),
            });
        }
        let element_count: usize = tensor.shape.iter().product();
        let (dtype_ok, len) = match (&tensor.data, info.kind) {
            (TensorData::I64(values), TensorKind::BatchCount) => (true, values.len()),
            (TensorData::F32(values), TensorKind::Param | TensorKind::Buffer) => {
                (true, values.len())
            }
            (TensorData::F32(values), TensorKind::BatchCount) => (false, values.len()),
            (TensorData::I64(values), _) => (false, values.len()),
        };
        if !dtype_ok {
            let (found, expected) = match info.kind {
                TensorKind::BatchCount => ("F32".to_string(), "I64"),
                _ => ("I64".to_string(), "F32"),
            };
            return Err(ModelError::TensorDtype {
                source_name,
                name: tensor.name.clone(),
                found,
                expected,
            });
        }
        if len != element_count {
            return Err(ModelError::TensorShape {
                source_name,
                name: tensor.name.clone(),
                found: vec![len],
                expected: info.shape.clone(),
            });
        }
        by_name.insert(name, tensor);
    }
    if let Some(missing) = model
        .tensors()
        .iter()
        .find(|info| !by_name.contains_key(&info.name))
    {
        return Err(ModelError::MissingTensor {
            source_name,
            name: missing.name.clone(),
        });
    }
    let mut batch_count = None;
    for (name, tensor) in by_name {
        match &tensor.data {
            TensorData::F32(values) => {
                model.set_tensor_values(&name, values);
            }
            TensorData::I64(values) => {
                let count = values.first().copied().unwrap_or(0).max(0) as u64;
                batch_count = Some(batch_count.map_or(count, |previous: u64| previous.max(count)));
            }
        }
    }
    model.set_num_batches_tracked(batch_count.unwrap_or(0));
    Ok(())
}

/// A tensor's bytes for safetensors serialization.
struct ByteView {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for ByteView {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Writes `bytes` to `path` via a temporary file in the same directory, synced, then renamed.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    let io_error = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file_name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "weights".into());
    let temporary = path.with_file_name(format!(".{file_name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(bytes)?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        if let Some(directory) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            // Persist the rename; not every platform or file system allows syncing a directory.
            if let Ok(directory) = std::fs::File::open(directory) {
                let _ = directory.sync_all();
            }
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result.map_err(io_error)
}
