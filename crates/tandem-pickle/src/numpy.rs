//! numpy arrays inside pickles: `numpy.core.multiarray._reconstruct` + `BUILD`.
//!
//! A pickled array is `_reconstruct(numpy.ndarray, (0,), b'b')` followed by `BUILD` with the
//! state `(version, shape, dtype, is_fortran_order, raw_data)`, where `dtype` is itself
//! `numpy.dtype(code, align, copy)` built with `(version, byte_order, ...)`.

use crate::error::PickleError;
use crate::value::Value;

/// The element types Tandem reads from numpy arrays.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    /// `bool` (`b1`).
    Bool,
    /// `uint8` (`u1`).
    U8,
    /// `int8` (`i1`).
    I8,
    /// `uint16` (`u2`).
    U16,
    /// `int16` (`i2`).
    I16,
    /// `uint32` (`u4`).
    U32,
    /// `int32` (`i4`).
    I32,
    /// `uint64` (`u8`).
    U64,
    /// `int64` (`i8`).
    I64,
    /// `float16` (`f2`).
    F16,
    /// `float32` (`f4`).
    F32,
    /// `float64` (`f8`).
    F64,
}

impl DType {
    /// Parses a numpy type code such as `u1`, `i8` or `f4`.
    pub fn from_code(code: &str) -> Option<DType> {
        Some(match code {
            "b1" => DType::Bool,
            "u1" => DType::U8,
            "i1" => DType::I8,
            "u2" => DType::U16,
            "i2" => DType::I16,
            "u4" => DType::U32,
            "i4" => DType::I32,
            "u8" => DType::U64,
            "i8" => DType::I64,
            "f2" => DType::F16,
            "f4" => DType::F32,
            "f8" => DType::F64,
            _ => return None,
        })
    }

    /// The numpy type code, e.g. `u1`.
    pub fn code(self) -> &'static str {
        match self {
            DType::Bool => "b1",
            DType::U8 => "u1",
            DType::I8 => "i1",
            DType::U16 => "u2",
            DType::I16 => "i2",
            DType::U32 => "u4",
            DType::I32 => "i4",
            DType::U64 => "u8",
            DType::I64 => "i8",
            DType::F16 => "f2",
            DType::F32 => "f4",
            DType::F64 => "f8",
        }
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::Bool | DType::U8 | DType::I8 => 1,
            DType::U16 | DType::I16 | DType::F16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }
}

/// A numpy array read from a pickle: C order, little-endian bytes.
#[derive(Debug, Clone, PartialEq)]
pub struct NdArray {
    /// The dimensions.
    pub shape: Vec<usize>,
    /// The element type.
    pub dtype: DType,
    /// The elements, row-major, little-endian, `shape.product() * dtype.size()` bytes.
    pub data: Vec<u8>,
}

impl NdArray {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    /// Whether the array has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Interprets a value as a pickled numpy array.
pub fn ndarray_from_value(value: &Value) -> Result<NdArray, PickleError> {
    let Some((callable, args, state)) = value.as_object() else {
        return Err(unexpected(
            "numpy array",
            "a call to numpy _reconstruct",
            value,
        ));
    };
    let is_reconstruct = callable.is_global("numpy.core.multiarray", "_reconstruct")
        || callable.is_global("numpy._core.multiarray", "_reconstruct");
    if !is_reconstruct {
        return Err(unexpected(
            "numpy array",
            "a call to numpy.core.multiarray._reconstruct",
            callable,
        ));
    }
    let subtype = args.as_sequence().and_then(|items| items.first());
    if !subtype.is_some_and(|subtype| subtype.is_global("numpy", "ndarray")) {
        return Err(unexpected("numpy array subtype", "numpy.ndarray", args));
    }
    let Some(state) = state else {
        return Err(unexpected("numpy array state", "a BUILD state", value));
    };
    let fields = state
        .as_sequence()
        .filter(|fields| fields.len() == 5)
        .ok_or_else(|| {
            unexpected(
                "numpy array state",
                "(version, shape, dtype, fortran_order, data)",
                state,
            )
        })?;
    let shape = parse_shape(&fields[1])?;
    let (dtype, big_endian) = parse_dtype(&fields[2])?;
    if fields[3].as_int() != Some(0) {
        return Err(unexpected(
            "numpy array order",
            "C order (fortran_order False)",
            &fields[3],
        ));
    }
    let mut data = raw_bytes(&fields[4])?;
    let expected_bytes = shape
        .iter()
        .try_fold(dtype.size(), |total, &dim| total.checked_mul(dim))
        .ok_or_else(|| {
            unexpected(
                "numpy array shape",
                "a size that fits in memory",
                &fields[1],
            )
        })?;
    if data.len() != expected_bytes {
        return Err(PickleError::UnexpectedValue {
            context: "numpy array data".to_string(),
            expected: format!(
                "{expected_bytes} bytes for shape {shape:?} of dtype {}",
                dtype.code()
            ),
            found: format!("{} bytes", data.len()),
        });
    }
    if big_endian && dtype.size() > 1 {
        for element in data.chunks_exact_mut(dtype.size()) {
            element.reverse();
        }
    }
    Ok(NdArray { shape, dtype, data })
}

fn parse_shape(value: &Value) -> Result<Vec<usize>, PickleError> {
    let dims = value
        .as_sequence()
        .ok_or_else(|| unexpected("numpy array shape", "a tuple of ints", value))?;
    dims.iter()
        .map(|dim| {
            dim.as_int()
                .and_then(|dim| usize::try_from(dim).ok())
                .ok_or_else(|| unexpected("numpy array shape", "non-negative ints", value))
        })
        .collect()
}

/// Returns the element type and whether its bytes are big-endian.
fn parse_dtype(value: &Value) -> Result<(DType, bool), PickleError> {
    let Some((callable, args, state)) = value.as_object() else {
        return Err(unexpected(
            "numpy array dtype",
            "a numpy.dtype object",
            value,
        ));
    };
    if !callable.is_global("numpy", "dtype") {
        return Err(unexpected("numpy array dtype", "numpy.dtype", callable));
    }
    let code = args
        .as_sequence()
        .and_then(|items| items.first())
        .and_then(Value::as_text)
        .ok_or_else(|| unexpected("numpy dtype", "a type code such as 'u1'", args))?;
    let dtype = DType::from_code(code).ok_or_else(|| PickleError::UnexpectedValue {
        context: "numpy dtype".to_string(),
        expected: "one of b1, u1, i1, u2, i2, u4, i4, u8, i8, f2, f4, f8".to_string(),
        found: format!("{code:?}"),
    })?;
    let byte_order = state
        .and_then(Value::as_sequence)
        .and_then(|fields| fields.get(1))
        .and_then(Value::as_text)
        .unwrap_or("|");
    Ok((dtype, byte_order == ">"))
}

/// The raw data of an array: `bytes`, a Python 2 `str`, or `_codecs.encode(text, 'latin1')`
/// (how Python 3 writes bytes at protocol 2).
fn raw_bytes(value: &Value) -> Result<Vec<u8>, PickleError> {
    if let Some(bytes) = value.as_bytes() {
        return Ok(bytes.to_vec());
    }
    if let Value::Object { callable, args, .. } = value {
        if callable.is_global("_codecs", "encode") {
            let items = args.as_sequence().unwrap_or(&[]);
            if let [Value::String(text), Value::String(encoding)] = items {
                if encoding == "latin1" || encoding == "latin-1" {
                    return text
                        .chars()
                        .map(|character| u8::try_from(u32::from(character)).ok())
                        .collect::<Option<Vec<u8>>>()
                        .ok_or_else(|| unexpected("numpy array data", "latin-1 text", value));
                }
            }
        }
    }
    Err(unexpected("numpy array data", "bytes", value))
}

fn unexpected(context: &str, expected: &str, found: &Value) -> PickleError {
    PickleError::UnexpectedValue {
        context: context.to_string(),
        expected: expected.to_string(),
        found: found.describe(),
    }
}
