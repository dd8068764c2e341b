//! The pickle stack machine: runs the opcodes of a pickle program into a [`Value`].
//!
//! Values are built in an arena of nodes so that the memo can share a container that is
//! filled after it was memoized (as pickle does); the finished tree is copied out of the
//! arena at `STOP`, within the bounds of [`Limits`].

use std::collections::HashMap;

use crate::error::PickleError;
use crate::value::Value;

/// Bounds on what one pickle may produce.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Deepest nesting of containers in the result.
    pub max_depth: usize,
    /// Most bytes of strings, bytes and big integers in the result (shared references count
    /// once per use).
    pub max_output_bytes: u64,
    /// Most values in the result (shared references count once per use).
    pub max_output_values: u64,
}

impl Limits {
    /// Limits proportional to the size of the input: shared references may repeat values,
    /// but the result stays within a few times the input (plus a little slack).
    pub fn for_input_len(input_len: usize) -> Limits {
        let input_len = input_len as u64;
        Limits {
            max_depth: 200,
            max_output_bytes: 8 * input_len + (1 << 20),
            max_output_values: 8 * input_len + 10_000,
        }
    }
}

/// Runs the pickle program in `bytes` and returns the value it builds.
pub fn loads(bytes: &[u8]) -> Result<Value, PickleError> {
    loads_with_limits(bytes, Limits::for_input_len(bytes.len()))
}

/// Like [`loads`], with explicit [`Limits`].
pub fn loads_with_limits(bytes: &[u8], limits: Limits) -> Result<Value, PickleError> {
    let mut machine = Machine::new(bytes);
    let root = machine.run()?;
    let mut budget = Budget {
        limits,
        bytes: 0,
        values: 0,
    };
    machine.materialize(root, 0, &mut budget)
}

type NodeId = usize;

/// A value under construction. Containers refer to other nodes by index.
enum Node {
    Leaf(Value),
    Tuple(Vec<NodeId>),
    List(Vec<NodeId>),
    Dict(Vec<(NodeId, NodeId)>),
    Set(Vec<NodeId>),
    Object {
        callable: NodeId,
        args: NodeId,
        state: Option<NodeId>,
        list_items: Vec<NodeId>,
        dict_items: Vec<(NodeId, NodeId)>,
    },
    Persistent(NodeId),
}

/// What the copy out of the arena has used so far.
struct Budget {
    limits: Limits,
    bytes: u64,
    values: u64,
}

/// The highest protocol this reader understands.
const HIGHEST_PROTOCOL: u8 = 5;

struct Machine<'a> {
    input: &'a [u8],
    position: usize,
    opcode_offset: usize,
    nodes: Vec<Node>,
    stack: Vec<NodeId>,
    marks: Vec<usize>,
    memo: HashMap<u64, NodeId>,
}

impl<'a> Machine<'a> {
    fn new(input: &'a [u8]) -> Machine<'a> {
        Machine {
            input,
            position: 0,
            opcode_offset: 0,
            nodes: Vec::new(),
            stack: Vec::new(),
            marks: Vec::new(),
            memo: HashMap::new(),
        }
    }

    /// Runs opcodes until `STOP` and returns the node on top of the stack.
    fn run(&mut self) -> Result<NodeId, PickleError> {
        loop {
            self.opcode_offset = self.position;
            let opcode = self.read_u8("an opcode")?;
            if opcode == b'.' {
                return self.pop("STOP");
            }
            self.step(opcode)?;
        }
    }

    fn step(&mut self, opcode: u8) -> Result<(), PickleError> {
        match opcode {
            0x80 => self.protocol()?,
            0x95 => self.frame()?,
            b'(' => self.marks.push(self.stack.len()),
            b'0' => {
                self.pop("POP")?;
            }
            b'1' => {
                self.pop_mark("POP_MARK")?;
            }
            b'2' => {
                let top = self.peek("DUP")?;
                self.stack.push(top);
            }
            b'N' => self.push_leaf(Value::None),
            0x88 => self.push_leaf(Value::Bool(true)),
            0x89 => self.push_leaf(Value::Bool(false)),
            b'J' => {
                let value = i32::from_le_bytes(self.read_array("BININT argument")?);
                self.push_leaf(Value::Int(i64::from(value)));
            }
            b'K' => {
                let value = self.read_u8("BININT1 argument")?;
                self.push_leaf(Value::Int(i64::from(value)));
            }
            b'M' => {
                let value = u16::from_le_bytes(self.read_array("BININT2 argument")?);
                self.push_leaf(Value::Int(i64::from(value)));
            }
            0x8a => {
                let length = u64::from(self.read_u8("LONG1 length")?);
                self.long(length)?;
            }
            0x8b => {
                let length = self.read_signed_length("LONG4 length")?;
                self.long(length)?;
            }
            b'G' => {
                let value = f64::from_be_bytes(self.read_array("BINFLOAT argument")?);
                self.push_leaf(Value::Float(value));
            }
            b'U' | b'C' => {
                let length = u64::from(self.read_u8("string length")?);
                let bytes = self.read_bytes(length, "SHORT_BINSTRING/SHORT_BINBYTES data")?;
                self.push_leaf(Value::Bytes(bytes.to_vec()));
            }
            b'T' => {
                let length = self.read_signed_length("BINSTRING length")?;
                let bytes = self.read_bytes(length, "BINSTRING data")?;
                self.push_leaf(Value::Bytes(bytes.to_vec()));
            }
            b'B' => {
                let length = u64::from(self.read_u32("BINBYTES length")?);
                let bytes = self.read_bytes(length, "BINBYTES data")?;
                self.push_leaf(Value::Bytes(bytes.to_vec()));
            }
            0x8e => {
                let length = self.read_u64("BINBYTES8 length")?;
                let bytes = self.read_bytes(length, "BINBYTES8 data")?;
                self.push_leaf(Value::Bytes(bytes.to_vec()));
            }
            0x96 => {
                let length = self.read_u64("BYTEARRAY8 length")?;
                let bytes = self.read_bytes(length, "BYTEARRAY8 data")?;
                self.push_leaf(Value::ByteArray(bytes.to_vec()));
            }
            0x8c => {
                let length = u64::from(self.read_u8("SHORT_BINUNICODE length")?);
                self.unicode(length)?;
            }
            b'X' => {
                let length = u64::from(self.read_u32("BINUNICODE length")?);
                self.unicode(length)?;
            }
            0x8d => {
                let length = self.read_u64("BINUNICODE8 length")?;
                self.unicode(length)?;
            }
            b')' => self.push_node(Node::Tuple(Vec::new())),
            b't' => {
                let items = self.pop_mark("TUPLE")?;
                self.push_node(Node::Tuple(items));
            }
            0x85..=0x87 => {
                let count = usize::from(opcode - 0x84);
                let items = self.pop_many(count, "TUPLE1/2/3")?;
                self.push_node(Node::Tuple(items));
            }
            b']' => self.push_node(Node::List(Vec::new())),
            b'l' => {
                let items = self.pop_mark("LIST")?;
                self.push_node(Node::List(items));
            }
            b'a' => {
                let item = self.pop("APPEND")?;
                self.append(vec![item])?;
            }
            b'e' => {
                let items = self.pop_mark("APPENDS")?;
                self.append(items)?;
            }
            b'}' => self.push_node(Node::Dict(Vec::new())),
            b'd' => {
                let items = self.pop_mark("DICT")?;
                let pairs = self.pairs(items, "DICT")?;
                self.push_node(Node::Dict(pairs));
            }
            b's' => {
                let items = self.pop_many(2, "SETITEM")?;
                let pairs = self.pairs(items, "SETITEM")?;
                self.set_items(pairs)?;
            }
            b'u' => {
                let items = self.pop_mark("SETITEMS")?;
                let pairs = self.pairs(items, "SETITEMS")?;
                self.set_items(pairs)?;
            }
            0x8f => self.push_node(Node::Set(Vec::new())),
            0x90 => {
                let items = self.pop_mark("ADDITEMS")?;
                self.add_items(items)?;
            }
            0x91 => {
                let items = self.pop_mark("FROZENSET")?;
                self.push_node(Node::Set(items));
            }
            b'c' => {
                let module = self.read_line("GLOBAL module")?;
                let name = self.read_line("GLOBAL name")?;
                self.push_leaf(Value::Global { module, name });
            }
            0x93 => {
                let name = self.pop_string("STACK_GLOBAL name")?;
                let module = self.pop_string("STACK_GLOBAL module")?;
                self.push_leaf(Value::Global { module, name });
            }
            b'R' | 0x81 => {
                let args = self.pop("REDUCE/NEWOBJ arguments")?;
                if !matches!(self.node(args), Node::Tuple(_)) {
                    return Err(self.malformed("REDUCE/NEWOBJ expects a tuple of arguments"));
                }
                let callable = self.pop("REDUCE/NEWOBJ callable")?;
                self.push_node(Node::Object {
                    callable,
                    args,
                    state: None,
                    list_items: Vec::new(),
                    dict_items: Vec::new(),
                });
            }
            b'b' => {
                let new_state = self.pop("BUILD state")?;
                let target = self.peek("BUILD")?;
                match self.nodes.get_mut(target) {
                    Some(Node::Object { state, .. }) => *state = Some(new_state),
                    _ => return Err(self.malformed("BUILD expects an object below its state")),
                }
            }
            b'Q' => {
                let id = self.pop("BINPERSID")?;
                self.push_node(Node::Persistent(id));
            }
            0x94 => self.put(self.memo.len() as u64)?,
            b'q' | b'r' | b'h' | b'j' => {
                let index = match opcode {
                    b'q' => u64::from(self.read_u8("BINPUT index")?),
                    b'r' => u64::from(self.read_u32("LONG_BINPUT index")?),
                    b'h' => u64::from(self.read_u8("BINGET index")?),
                    _ => u64::from(self.read_u32("LONG_BINGET index")?),
                };
                if matches!(opcode, b'q' | b'r') {
                    self.put(index)?;
                } else {
                    self.get(index)?;
                }
            }
            _ => {
                return Err(PickleError::UnsupportedOpcode {
                    offset: self.opcode_offset,
                    opcode,
                    name: unsupported_opcode_name(opcode),
                })
            }
        }
        Ok(())
    }

    // ---- opcode bodies ----

    fn protocol(&mut self) -> Result<(), PickleError> {
        let protocol = self.read_u8("PROTO argument")?;
        if protocol > HIGHEST_PROTOCOL {
            return Err(self.malformed(format!(
                "protocol {protocol}, expected at most {HIGHEST_PROTOCOL}"
            )));
        }
        Ok(())
    }

    /// A frame only announces how many bytes follow; check it, then read on.
    fn frame(&mut self) -> Result<(), PickleError> {
        let length = self.read_u64("FRAME length")?;
        let remaining = (self.input.len() - self.position) as u64;
        if length > remaining {
            return Err(self.truncated(length - remaining, "FRAME contents"));
        }
        Ok(())
    }

    fn long(&mut self, length: u64) -> Result<(), PickleError> {
        let bytes = self.read_bytes(length, "LONG data")?;
        let value = match bytes.len() {
            0 => Value::Int(0),
            1..=8 => {
                let negative = bytes.last().is_some_and(|byte| byte & 0x80 != 0);
                let mut widened = if negative { [0xff; 8] } else { [0; 8] };
                widened[..bytes.len()].copy_from_slice(bytes);
                Value::Int(i64::from_le_bytes(widened))
            }
            _ => Value::BigInt(bytes.to_vec()),
        };
        self.push_leaf(value);
        Ok(())
    }

    fn unicode(&mut self, length: u64) -> Result<(), PickleError> {
        let offset = self.position;
        let bytes = self.read_bytes(length, "unicode string data")?;
        match std::str::from_utf8(bytes) {
            Ok(text) => {
                let text = text.to_string();
                self.push_leaf(Value::String(text));
                Ok(())
            }
            Err(error) => Err(PickleError::Malformed {
                offset: offset + error.valid_up_to(),
                message: "unicode string is not valid UTF-8".to_string(),
            }),
        }
    }

    fn append(&mut self, items: Vec<NodeId>) -> Result<(), PickleError> {
        let expects = "APPEND/APPENDS expects a list or an object";
        self.extend_target("APPEND/APPENDS target", expects, items, |node| match node {
            Node::List(list)
            | Node::Object {
                list_items: list, ..
            } => Some(list),
            _ => None,
        })
    }

    fn set_items(&mut self, pairs: Vec<(NodeId, NodeId)>) -> Result<(), PickleError> {
        let expects = "SETITEM/SETITEMS expects a dict or an object";
        self.extend_target(
            "SETITEM/SETITEMS target",
            expects,
            pairs,
            |node| match node {
                Node::Dict(dict)
                | Node::Object {
                    dict_items: dict, ..
                } => Some(dict),
                _ => None,
            },
        )
    }

    fn add_items(&mut self, items: Vec<NodeId>) -> Result<(), PickleError> {
        let expects = "ADDITEMS expects a set";
        self.extend_target("ADDITEMS target", expects, items, |node| match node {
            Node::Set(set) => Some(set),
            _ => None,
        })
    }

    /// Adds `items` to the collection `collection_of` finds in the node below the top of the
    /// stack (`target` names it); fails saying `expects` where it finds none.
    fn extend_target<T>(
        &mut self,
        target: &str,
        expects: &str,
        items: Vec<T>,
        collection_of: impl FnOnce(&mut Node) -> Option<&mut Vec<T>>,
    ) -> Result<(), PickleError> {
        let index = self.peek(target)?;
        match self.nodes.get_mut(index).and_then(collection_of) {
            Some(collection) => {
                collection.extend(items);
                Ok(())
            }
            None => Err(self.malformed(expects)),
        }
    }

    fn pairs(
        &self,
        items: Vec<NodeId>,
        opcode: &str,
    ) -> Result<Vec<(NodeId, NodeId)>, PickleError> {
        if !items.len().is_multiple_of(2) {
            return Err(self.malformed(format!(
                "{opcode} expects key/value pairs, found an odd count of {} items",
                items.len()
            )));
        }
        Ok(items
            .chunks_exact(2)
            .map(|pair| (pair[0], pair[1]))
            .collect())
    }

    fn put(&mut self, index: u64) -> Result<(), PickleError> {
        let top = self.peek("memo PUT")?;
        self.memo.insert(index, top);
        Ok(())
    }

    fn get(&mut self, index: u64) -> Result<(), PickleError> {
        match self.memo.get(&index) {
            Some(&node) => {
                self.stack.push(node);
                Ok(())
            }
            None => Err(self.malformed(format!("memo GET of index {index}, which was never PUT"))),
        }
    }

    fn pop_string(&mut self, what: &str) -> Result<String, PickleError> {
        let node = self.pop(what)?;
        match self.node(node) {
            Node::Leaf(Value::String(text)) => Ok(text.clone()),
            _ => Err(self.malformed(format!("{what} must be a str"))),
        }
    }

    // ---- the stack ----

    fn push_node(&mut self, node: Node) {
        self.nodes.push(node);
        self.stack.push(self.nodes.len() - 1);
    }

    fn push_leaf(&mut self, value: Value) {
        self.push_node(Node::Leaf(value));
    }

    fn node(&self, id: NodeId) -> &Node {
        // Node ids only ever come from push_node, so they are always in range.
        &self.nodes[id]
    }

    /// The bottom of the part of the stack the current MARK frame may touch.
    fn frame_floor(&self) -> usize {
        self.marks.last().copied().unwrap_or(0)
    }

    fn peek(&self, opcode: &str) -> Result<NodeId, PickleError> {
        if self.stack.len() <= self.frame_floor() {
            return Err(self.malformed(format!("{opcode} found an empty stack")));
        }
        self.stack
            .last()
            .copied()
            .ok_or_else(|| self.malformed(format!("{opcode} found an empty stack")))
    }

    fn pop(&mut self, opcode: &str) -> Result<NodeId, PickleError> {
        let top = self.peek(opcode)?;
        self.stack.pop();
        Ok(top)
    }

    fn pop_many(&mut self, count: usize, opcode: &str) -> Result<Vec<NodeId>, PickleError> {
        let available = self.stack.len() - self.frame_floor();
        if available < count {
            return Err(self.malformed(format!(
                "{opcode} needs {count} stack items, found {available}"
            )));
        }
        Ok(self.stack.split_off(self.stack.len() - count))
    }

    fn pop_mark(&mut self, opcode: &str) -> Result<Vec<NodeId>, PickleError> {
        match self.marks.pop() {
            Some(mark) => Ok(self.stack.split_off(mark)),
            None => Err(self.malformed(format!("{opcode} without a MARK"))),
        }
    }

    // ---- reading the input ----

    fn read_bytes(&mut self, length: u64, what: &'static str) -> Result<&'a [u8], PickleError> {
        let remaining = (self.input.len() - self.position) as u64;
        if length > remaining {
            return Err(self.truncated(length - remaining, what));
        }
        let start = self.position;
        // length <= remaining, which fits in usize.
        self.position += length as usize;
        Ok(&self.input[start..self.position])
    }

    fn read_array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], PickleError> {
        let bytes = self.read_bytes(N as u64, what)?;
        let mut array = [0u8; N];
        array.copy_from_slice(bytes);
        Ok(array)
    }

    fn read_u8(&mut self, what: &'static str) -> Result<u8, PickleError> {
        Ok(self.read_array::<1>(what)?[0])
    }

    fn read_u32(&mut self, what: &'static str) -> Result<u32, PickleError> {
        Ok(u32::from_le_bytes(self.read_array(what)?))
    }

    fn read_u64(&mut self, what: &'static str) -> Result<u64, PickleError> {
        Ok(u64::from_le_bytes(self.read_array(what)?))
    }

    fn read_signed_length(&mut self, what: &'static str) -> Result<u64, PickleError> {
        let length = i32::from_le_bytes(self.read_array(what)?);
        u64::try_from(length).map_err(|_| self.malformed(format!("{what} is negative ({length})")))
    }

    /// Reads a newline-terminated ASCII line (the text arguments of `GLOBAL`).
    fn read_line(&mut self, what: &'static str) -> Result<String, PickleError> {
        let rest = &self.input[self.position..];
        let Some(length) = rest.iter().position(|&byte| byte == b'\n') else {
            return Err(self.truncated(1, what));
        };
        let start = self.position;
        let line = &rest[..length];
        self.position += length + 1;
        match std::str::from_utf8(line) {
            Ok(text) => Ok(text.to_string()),
            Err(_) => Err(PickleError::Malformed {
                offset: start,
                message: format!("{what} is not valid UTF-8"),
            }),
        }
    }

    fn malformed(&self, message: impl Into<String>) -> PickleError {
        PickleError::Malformed {
            offset: self.opcode_offset,
            message: message.into(),
        }
    }

    fn truncated(&self, needed: u64, what: &'static str) -> PickleError {
        PickleError::Truncated {
            offset: self.input.len(),
            needed,
            what,
        }
    }

    // ---- copying the result out of the arena ----

    fn materialize(
        &self,
        id: NodeId,
        depth: usize,
        budget: &mut Budget,
    ) -> Result<Value, PickleError> {
        if depth > budget.limits.max_depth {
            return Err(PickleError::LimitExceeded {
                message: format!(
                    "values nested deeper than {} levels (or a recursive structure)",
                    budget.limits.max_depth
                ),
            });
        }
        budget.values += 1;
        if budget.values > budget.limits.max_output_values {
            return Err(PickleError::LimitExceeded {
                message: format!("more than {} values", budget.limits.max_output_values),
            });
        }
        let list = |ids: &[NodeId], budget: &mut Budget| -> Result<Vec<Value>, PickleError> {
            ids.iter()
                .map(|&item| self.materialize(item, depth + 1, budget))
                .collect()
        };
        let pairs = |ids: &[(NodeId, NodeId)],
                     budget: &mut Budget|
         -> Result<Vec<(Value, Value)>, PickleError> {
            ids.iter()
                .map(|&(key, value)| {
                    Ok((
                        self.materialize(key, depth + 1, budget)?,
                        self.materialize(value, depth + 1, budget)?,
                    ))
                })
                .collect()
        };
        Ok(match self.node(id) {
            Node::Leaf(value) => {
                budget.bytes += leaf_bytes(value);
                if budget.bytes > budget.limits.max_output_bytes {
                    return Err(PickleError::LimitExceeded {
                        message: format!(
                            "more than {} bytes of strings and bytes",
                            budget.limits.max_output_bytes
                        ),
                    });
                }
                value.clone()
            }
            Node::Tuple(items) => Value::Tuple(list(items, budget)?),
            Node::List(items) => Value::List(list(items, budget)?),
            Node::Set(items) => Value::Set(list(items, budget)?),
            Node::Dict(items) => Value::Dict(pairs(items, budget)?),
            Node::Object {
                callable,
                args,
                state,
                list_items,
                dict_items,
            } => Value::Object {
                callable: Box::new(self.materialize(*callable, depth + 1, budget)?),
                args: Box::new(self.materialize(*args, depth + 1, budget)?),
                state: match state {
                    Some(state) => Some(Box::new(self.materialize(*state, depth + 1, budget)?)),
                    None => None,
                },
                list_items: list(list_items, budget)?,
                dict_items: pairs(dict_items, budget)?,
            },
            Node::Persistent(inner) => {
                Value::PersistentId(Box::new(self.materialize(*inner, depth + 1, budget)?))
            }
        })
    }
}

/// The payload size of a leaf value, for the output budget.
fn leaf_bytes(value: &Value) -> u64 {
    match value {
        Value::Bytes(bytes) | Value::ByteArray(bytes) | Value::BigInt(bytes) => bytes.len() as u64,
        Value::String(text) => text.len() as u64,
        Value::Global { module, name } => (module.len() + name.len()) as u64,
        _ => 0,
    }
}

/// Names of the valid opcodes this reader refuses, for the error message.
fn unsupported_opcode_name(opcode: u8) -> &'static str {
    match opcode {
        b'I' => "INT (protocol 0)",
        b'L' => "LONG (protocol 0)",
        b'F' => "FLOAT (protocol 0)",
        b'S' => "STRING (protocol 0)",
        b'V' => "UNICODE (protocol 0)",
        b'P' => "PERSID (protocol 0)",
        b'p' => "PUT (protocol 0)",
        b'g' => "GET (protocol 0)",
        b'i' => "INST (protocol 0)",
        b'o' => "OBJ (protocol 1)",
        0x82..=0x84 => "EXT1/EXT2/EXT4 (extension registry)",
        0x92 => "NEWOBJ_EX",
        0x97 => "NEXT_BUFFER (out-of-band buffers)",
        0x98 => "READONLY_BUFFER (out-of-band buffers)",
        _ => "unknown",
    }
}
