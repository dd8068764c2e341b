//! The values a pickle program produces.

/// One decoded pickle value. Nothing here is ever executed: class references are kept as
/// [`Value::Global`] and calls to them as [`Value::Object`].
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Python `None`.
    None,
    /// Python `bool`.
    Bool(bool),
    /// A Python `int` that fits in 64 bits.
    Int(i64),
    /// A Python `int` wider than 64 bits, as little-endian two's-complement bytes.
    BigInt(Vec<u8>),
    /// Python `float`.
    Float(f64),
    /// Python `bytes`, and Python 2 `str` (read as `encoding='bytes'`).
    Bytes(Vec<u8>),
    /// Python `bytearray`.
    ByteArray(Vec<u8>),
    /// Python `str` (unicode).
    String(String),
    /// Python `tuple`.
    Tuple(Vec<Value>),
    /// Python `list`.
    List(Vec<Value>),
    /// Python `dict`, in insertion order.
    Dict(Vec<(Value, Value)>),
    /// Python `set` or `frozenset`.
    Set(Vec<Value>),
    /// A reference to `module.name` (a class or function), never resolved.
    Global {
        /// The module path, e.g. `collections`.
        module: String,
        /// The attribute name, e.g. `OrderedDict`.
        name: String,
    },
    /// The result of calling or instantiating something (`REDUCE`, `NEWOBJ`), with what
    /// `BUILD`, `APPENDS` and `SETITEMS` later did to it.
    Object {
        /// What was called, usually a [`Value::Global`].
        callable: Box<Value>,
        /// The argument tuple.
        args: Box<Value>,
        /// The state passed to `BUILD`, if any.
        state: Option<Box<Value>>,
        /// Items appended with `APPEND`/`APPENDS`.
        list_items: Vec<Value>,
        /// Items set with `SETITEM`/`SETITEMS`.
        dict_items: Vec<(Value, Value)>,
    },
    /// A persistent id (`BINPERSID`), e.g. a torch storage reference.
    PersistentId(Box<Value>),
}

impl Value {
    /// A short description of the kind of value, for error messages.
    pub fn describe(&self) -> String {
        match self {
            Value::None => "None".to_string(),
            Value::Bool(value) => format!("bool {value}"),
            Value::Int(value) => format!("int {value}"),
            Value::BigInt(bytes) => format!("int of {} bytes", bytes.len()),
            Value::Float(value) => format!("float {value}"),
            Value::Bytes(bytes) => format!("bytes of length {}", bytes.len()),
            Value::ByteArray(bytes) => format!("bytearray of length {}", bytes.len()),
            Value::String(text) if text.len() <= 40 => format!("str {text:?}"),
            Value::String(text) => format!("str of length {}", text.len()),
            Value::Tuple(items) => format!("tuple of {} items", items.len()),
            Value::List(items) => format!("list of {} items", items.len()),
            Value::Dict(items) => format!("dict of {} items", items.len()),
            Value::Set(items) => format!("set of {} items", items.len()),
            Value::Global { module, name } => format!("global {module}.{name}"),
            Value::Object { callable, .. } => format!("object made by {}", callable.describe()),
            Value::PersistentId(_) => "persistent id".to_string(),
        }
    }

    /// What made the object, its arguments and its `BUILD` state, if this is an object.
    pub fn as_object(&self) -> Option<(&Value, &Value, Option<&Value>)> {
        match self {
            Value::Object {
                callable,
                args,
                state,
                ..
            } => Some((callable, args, state.as_deref())),
            _ => None,
        }
    }

    /// The integer, if this is an `int` (or a `bool`, as Python treats it).
    pub fn as_int(&self) -> Option<i64> {
        match self {
            Value::Int(value) => Some(*value),
            Value::Bool(value) => Some(i64::from(*value)),
            _ => None,
        }
    }

    /// The text, if this is a `str`.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(text) => Some(text),
            _ => None,
        }
    }

    /// The bytes of a `bytes`, `bytearray`, or Python 2 `str` value.
    pub fn as_bytes(&self) -> Option<&[u8]> {
        match self {
            Value::Bytes(bytes) | Value::ByteArray(bytes) => Some(bytes),
            _ => None,
        }
    }

    /// The text of a `str`, or of `bytes` that are valid UTF-8 (Python 2 `str` keys).
    pub fn as_text(&self) -> Option<&str> {
        match self {
            Value::String(text) => Some(text),
            Value::Bytes(bytes) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }

    /// The items of a tuple or a list.
    pub fn as_sequence(&self) -> Option<&[Value]> {
        match self {
            Value::Tuple(items) | Value::List(items) => Some(items),
            _ => None,
        }
    }

    /// Whether this is the global `module.name`.
    pub fn is_global(&self, wanted_module: &str, wanted_name: &str) -> bool {
        matches!(self, Value::Global { module, name } if module == wanted_module && name == wanted_name)
    }

    /// The entries of a `dict`, or of an `collections.OrderedDict` built by calling the
    /// class with no arguments and then setting items (how pickle writes it).
    pub fn as_dict(&self) -> Option<&[(Value, Value)]> {
        match self {
            Value::Dict(items) => Some(items),
            Value::Object {
                callable,
                dict_items,
                ..
            } if callable.is_global("collections", "OrderedDict") => Some(dict_items),
            _ => None,
        }
    }

    /// Looks up a key of a dict (see [`Value::as_dict`]) given as text; matches both
    /// `str` keys and Python 2 `bytes` keys.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let entries = self.as_dict()?;
        entries
            .iter()
            .find(|(entry_key, _)| entry_key.as_text() == Some(key))
            .map(|(_, value)| value)
    }
}
