//! Weights I/O: safetensors files and in-memory tensor lists, with PyTorch names, dtypes
//! (f32 parameters and buffers, int64 `num_batches_tracked`) and layouts (OIHW, `[out, in]`).

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, View};

use crate::error::ModelError;
use crate::model::Model;
use crate::tensors::TensorKind;

use tandem_pickle::{open_torch_state_dict, TensorDtype, TensorHeader, TorchStateDict};
/// Tensors by name (e.g. read from a `torch.save` file) share the pickle reader's types,
/// so a checkpoint read there loads here without conversion.
pub use tandem_pickle::{NamedTensor, TensorData, TorchCheckpoint};

/// Writes the model's `state_dict` to a safetensors file, atomically (a new temporary file
/// in the same directory, fsync, rename), with `metadata` as the header's string metadata.
pub fn save_safetensors(
    model: &Model,
    path: &Path,
    metadata: &BTreeMap<String, String>,
) -> Result<(), ModelError> {
    let bytes =
        state_dict_safetensors(model, metadata).map_err(|error| ModelError::SafeTensors {
            path: path.to_path_buf(),
            message: error.to_string(),
        })?;
    Ok(tandem_files::write_atomically(path, &bytes)?)
}

/// The model's `state_dict` serialized as safetensors, with `metadata` as the header's
/// string metadata: the bytes [`save_safetensors`] writes.
pub fn state_dict_safetensors(
    model: &Model,
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, safetensors::SafeTensorError> {
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
    serialize_safetensors(views, metadata)
}

/// Serializes tensors and string metadata as safetensors, the same bytes for the same
/// input: the safetensors crate writes the metadata in a `HashMap`'s random order, so the
/// header is written again with its keys sorted (the same length, so no offset moves).
pub fn serialize_safetensors<V: View>(
    views: Vec<(String, V)>,
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>, safetensors::SafeTensorError> {
    let header: HashMap<String, String> = metadata
        .iter()
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut bytes = safetensors::serialize(views, (!header.is_empty()).then_some(header))?;
    if metadata.len() > 1 {
        sort_header(&mut bytes);
    }
    Ok(bytes)
}

/// Rewrites the JSON header of serialized safetensors with sorted keys, in place, when the
/// result fits the header's space (it always does: the same entries, another order).
fn sort_header(bytes: &mut [u8]) {
    let Some(length) = bytes.get(..8).and_then(|b| b.try_into().ok()) else {
        return;
    };
    let header_len = u64::from_le_bytes(length) as usize;
    let Some(header) = bytes.get(8..8 + header_len) else {
        return;
    };
    let Ok(entries) = serde_json::from_slice::<BTreeMap<String, serde_json::Value>>(header) else {
        return;
    };
    let sorted: BTreeMap<&String, serde_json::Value> = entries
        .iter()
        .map(|(key, value)| (key, sorted_value(value)))
        .collect();
    let Ok(text) = serde_json::to_vec(&sorted) else {
        return;
    };
    if text.len() <= header_len {
        let space = &mut bytes[8..8 + header_len];
        space[..text.len()].copy_from_slice(&text);
        space[text.len()..].fill(b' ');
    }
}

/// A JSON value with the keys of its objects in sorted order, whatever `serde_json`'s
/// map keeps.
fn sorted_value(value: &serde_json::Value) -> serde_json::Value {
    match value {
        serde_json::Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            serde_json::Value::Object(
                entries
                    .into_iter()
                    .map(|(key, value)| (key.clone(), sorted_value(value)))
                    .collect(),
            )
        }
        other => other.clone(),
    }
}

/// Loads the model's `state_dict` from a safetensors file; every tensor must be present
/// with its exact shape and dtype, and no other tensor may be. Returns the header metadata.
/// On error the model is unchanged.
pub fn load_safetensors(
    model: &mut Model,
    path: &Path,
) -> Result<BTreeMap<String, String>, ModelError> {
    let (tensors, metadata) = read_safetensors(path, |name| {
        match model.tensor_info(name).map(|info| info.kind) {
            Some(TensorKind::BatchCount) => "I64",
            _ => "F32",
        }
    })?;
    apply_tensors(model, &tensors, None, &path.display().to_string())?;
    Ok(metadata)
}

/// Reads every tensor (F32 or I64) and the header metadata of a safetensors file.
/// `expected_dtype` names the dtype wanted for a tensor of another dtype, for the error.
pub fn read_safetensors(
    path: &Path,
    expected_dtype: impl Fn(&str) -> &'static str,
) -> Result<(Vec<NamedTensor>, BTreeMap<String, String>), ModelError> {
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
                return Err(ModelError::TensorDtype {
                    source_name: path.display().to_string(),
                    expected: expected_dtype(&name),
                    name,
                    found: format!("{other:?}"),
                });
            }
        };
        tensors.push(NamedTensor {
            name,
            shape: view.shape().to_vec(),
            data,
        });
    }
    Ok((tensors, string_metadata(&header)))
}

/// The `__metadata__` strings of a safetensors file, reading only its header.
pub fn read_safetensors_metadata(path: &Path) -> Result<BTreeMap<String, String>, ModelError> {
    Ok(read_safetensors_header(path)?.metadata)
}

/// What a safetensors file's header says: its `__metadata__` strings and each tensor's shape.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SafetensorsHeader {
    /// The `__metadata__` strings.
    pub metadata: BTreeMap<String, String>,
    /// Each tensor's shape, by name.
    pub shapes: BTreeMap<String, Vec<usize>>,
}

/// Reads a safetensors file's header alone (at most the safetensors crate's bound on a
/// header), none of its tensors' bytes.
pub fn read_safetensors_header(path: &Path) -> Result<SafetensorsHeader, ModelError> {
    use std::io::Read;
    let io_error = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let invalid = |message: String| ModelError::SafeTensors {
        path: path.to_path_buf(),
        message,
    };
    let mut file = std::fs::File::open(path).map_err(io_error)?;
    let mut length = [0u8; 8];
    file.read_exact(&mut length).map_err(io_error)?;
    let header_len = u64::from_le_bytes(length);
    if header_len > MAX_HEADER_BYTES {
        return Err(invalid(format!(
            "its header claims {header_len} bytes, more than {MAX_HEADER_BYTES}"
        )));
    }
    let mut header = Vec::new();
    file.take(header_len)
        .read_to_end(&mut header)
        .map_err(io_error)?;
    if header.len() as u64 != header_len {
        return Err(invalid("the file ends inside its header".into()));
    }
    let header: serde_json::Value = serde_json::from_slice(&header)
        .map_err(|error| invalid(format!("its header is not JSON: {error}")))?;
    let entries = header
        .as_object()
        .ok_or_else(|| invalid("its header is not a JSON object".into()))?;
    let mut parsed = SafetensorsHeader::default();
    for (name, entry) in entries {
        if name == "__metadata__" {
            let strings = entry
                .as_object()
                .ok_or_else(|| invalid("its __metadata__ is not an object".into()))?;
            for (key, value) in strings {
                let text = value.as_str().ok_or_else(|| {
                    invalid(format!("its __metadata__ entry `{key}` is not a string"))
                })?;
                parsed.metadata.insert(key.clone(), text.to_string());
            }
            continue;
        }
        let shape = entry
            .get("shape")
            .and_then(serde_json::Value::as_array)
            .and_then(|dims| {
                dims.iter()
                    .map(|dim| dim.as_u64().and_then(|dim| usize::try_from(dim).ok()))
                    .collect::<Option<Vec<usize>>>()
            })
            .ok_or_else(|| invalid(format!("tensor `{name}` has no shape of whole numbers")))?;
        parsed.shapes.insert(name.clone(), shape);
    }
    Ok(parsed)
}

/// The safetensors crate's own bound on a header's size.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// The `__metadata__` strings of a parsed header.
fn string_metadata(header: &safetensors::tensor::Metadata) -> BTreeMap<String, String> {
    header
        .metadata()
        .as_ref()
        .map(|m| m.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default()
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

/// A `torch.save` file opened for a model: its pickle is read (at most what a model of this
/// size can need once decompressed), none of its storages yet, so that what it declares can
/// be checked before anything large is read.
pub struct TorchSaveFile {
    source_name: String,
    state_dict: TorchStateDict<File>,
}

impl TorchSaveFile {
    /// Opens `path` and reads its pickle, capped by the size of `model`.
    pub fn open(model: &Model, path: &Path) -> Result<Self, ModelError> {
        Ok(TorchSaveFile {
            source_name: path.display().to_string(),
            state_dict: open_torch_state_dict(path, max_pickle_bytes(model))?,
        })
    }

    /// The tensor names and shapes the file declares.
    pub fn shapes(&self) -> BTreeMap<String, Vec<usize>> {
        self.state_dict
            .tensors()
            .iter()
            .map(|header| (header.name.clone(), header.shape.clone()))
            .collect()
    }

    /// Loads the model's `state_dict` from the file, removing `strip_prefix` (e.g. `module.`)
    /// from names that start with it. The names, shapes and dtypes are checked against the
    /// model before any storage is read, and the storages together may hold no more than the
    /// model's tensors; each storage is read once, however many tensors view it. Every tensor
    /// must be present and no other may be. On error the model is unchanged. Returns the
    /// file's contents (e.g. its scalars such as `EPOCHS_RUN`).
    pub fn load_into(
        self,
        model: &mut Model,
        strip_prefix: Option<&str>,
    ) -> Result<TorchCheckpoint, ModelError> {
        let source_name = self.source_name;
        let mut seen = BTreeSet::new();
        for header in self.state_dict.tensors() {
            let name = check_tensor(model, header, strip_prefix, &source_name)?;
            seen.insert(name);
        }
        check_none_missing(model, &source_name, |name| seen.contains(name))?;
        let checkpoint = self.state_dict.read_storages(state_dict_bytes(model))?;
        apply_tensors(model, &checkpoint.tensors, strip_prefix, &source_name)?;
        Ok(checkpoint)
    }
}

/// Fails naming the first of `model`'s tensors that the source `source_name` lacks, by
/// `has`.
fn check_none_missing(
    model: &Model,
    source_name: &str,
    has: impl Fn(&str) -> bool,
) -> Result<(), ModelError> {
    match model.tensors().iter().find(|info| !has(&info.name)) {
        Some(missing) => Err(ModelError::MissingTensor {
            source_name: source_name.to_string(),
            name: missing.name.clone(),
        }),
        None => Ok(()),
    }
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
    check_none_missing(model, &source_name, |name| by_name.contains_key(name))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serialization_is_the_same_bytes_every_time() {
        let metadata: BTreeMap<String, String> = (0..12)
            .map(|i| (format!("key.{i}"), format!("value \"{i}\"")))
            .collect();
        let views = || {
            ["b", "a", "c"].map(|name| {
                let view = ByteView {
                    dtype: Dtype::F32,
                    shape: vec![2],
                    bytes: vec![1; 8],
                };
                (name.to_string(), view)
            })
        };
        let first = serialize_safetensors(Vec::from(views()), &metadata).unwrap();
        for _ in 0..20 {
            assert_eq!(
                serialize_safetensors(Vec::from(views()), &metadata).unwrap(),
                first
            );
        }
        let (_, header) = SafeTensors::read_metadata(&first).unwrap();
        assert_eq!(string_metadata(&header), metadata);
        let file = SafeTensors::deserialize(&first).unwrap();
        assert_eq!(file.tensor("c").unwrap().data(), &[1; 8]);
    }
}
