//! The store's wire format: length-prefixed frames holding one request or one response.
//!
//! ```text
//! frame    = u64 LE length, then that many bytes (at most MAX_FRAME_BYTES)
//! request  = opcode u8, then the opcode's fields
//! response = status u8, then the status's fields
//! bytes    = u32 LE length, then the bytes;  key = bytes (UTF-8, at most MAX_KEY)
//! ```

use std::io::{Read, Write};
use std::time::Duration;

/// Largest key, in bytes.
pub const MAX_KEY_BYTES: usize = 4096;
/// Largest value, in bytes.
pub const MAX_VALUE_BYTES: usize = 64 << 20;
/// Largest number of keys in one `wait`.
pub const MAX_WAIT_KEYS: usize = 65_536;
/// Largest frame: a compare-and-set carries a key and two values.
pub(crate) const MAX_FRAME_BYTES: usize = 2 * MAX_VALUE_BYTES + MAX_KEY_BYTES + 64;

/// One request from a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    Set {
        key: String,
        value: Vec<u8>,
    },
    Get {
        key: String,
    },
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
    Add {
        key: String,
        delta: i64,
    },
    CompareSet {
        key: String,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    },
    Delete {
        key: String,
    },
    NumKeys,
    /// A request of a client that fails over between replicas: `seq` counts its requests,
    /// so that a write retried on another replica is applied once.
    Session {
        client: u64,
        seq: u64,
        request: Box<Request>,
    },
    /// A Raft message from another replica of a replicated store; it gets no answer.
    Raft {
        message: Vec<u8>,
    },
}

/// One response from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    Done,
    Value(Vec<u8>),
    NotFound,
    Integer(i64),
    Deleted(bool),
    Count(u64),
    TimedOut {
        missing: Vec<String>,
    },
    Error(String),
    /// This replica does not lead the replicated store; `leader` is the address of the one
    /// it knows to lead, if any.
    NotLeader {
        leader: Option<String>,
    },
}

const SET: u8 = 1;
const GET: u8 = 2;
const WAIT: u8 = 3;
const ADD: u8 = 4;
const COMPARE_SET: u8 = 5;
const DELETE: u8 = 6;
const NUM_KEYS: u8 = 7;
const SESSION: u8 = 8;
const RAFT: u8 = 9;

const DONE: u8 = 0;
const VALUE: u8 = 1;
const NOT_FOUND: u8 = 2;
const INTEGER: u8 = 3;
const DELETED: u8 = 4;
const COUNT: u8 = 5;
const TIMED_OUT: u8 = 6;
const ERROR: u8 = 7;
const NOT_LEADER: u8 = 8;

/// Why a frame could not be read or decoded.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The connection broke, closed or timed out.
    Io(std::io::Error),
    /// The frame is malformed or over a limit; the message says how.
    Malformed(String),
}

/// Writes one frame holding `payload`.
pub(crate) fn write_frame(stream: &mut impl Write, payload: &[u8]) -> std::io::Result<()> {
    let length = payload.len() as u64;
    let mut frame = Vec::with_capacity(8 + payload.len());
    frame.extend_from_slice(&length.to_le_bytes());
    frame.extend_from_slice(payload);
    stream.write_all(&frame)
}

/// Reads one frame, refusing lengths above `MAX_FRAME_BYTES` before allocating anything.
pub(crate) fn read_frame(stream: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut prefix = [0u8; 8];
    stream.read_exact(&mut prefix).map_err(FrameError::Io)?;
    let length = u64::from_le_bytes(prefix);
    if length > MAX_FRAME_BYTES as u64 {
        return Err(FrameError::Malformed(format!(
            "frame of {length} bytes is above the limit of {MAX_FRAME_BYTES} bytes"
        )));
    }
    let mut payload = vec![0u8; length as usize];
    stream.read_exact(&mut payload).map_err(FrameError::Io)?;
    Ok(payload)
}

impl Request {
    /// The request's bytes, to put in a frame.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Request::Set { key, value } => {
                out.push(SET);
                put_bytes(&mut out, key.as_bytes());
                put_bytes(&mut out, value);
            }
            Request::Get { key } => {
                out.push(GET);
                put_bytes(&mut out, key.as_bytes());
            }
            Request::Wait { keys, timeout } => {
                out.push(WAIT);
                out.extend_from_slice(&duration_millis(*timeout).to_le_bytes());
                out.extend_from_slice(&(keys.len() as u32).to_le_bytes());
                for key in keys {
                    put_bytes(&mut out, key.as_bytes());
                }
            }
            Request::Add { key, delta } => {
                out.push(ADD);
                put_bytes(&mut out, key.as_bytes());
                out.extend_from_slice(&delta.to_le_bytes());
            }
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                out.push(COMPARE_SET);
                put_bytes(&mut out, key.as_bytes());
                match expected {
                    Some(expected) => {
                        out.push(1);
                        put_bytes(&mut out, expected);
                    }
                    None => out.push(0),
                }
                put_bytes(&mut out, desired);
            }
            Request::Delete { key } => {
                out.push(DELETE);
                put_bytes(&mut out, key.as_bytes());
            }
            Request::NumKeys => out.push(NUM_KEYS),
            Request::Session {
                client,
                seq,
                request,
            } => {
                out.push(SESSION);
                out.extend_from_slice(&client.to_le_bytes());
                out.extend_from_slice(&seq.to_le_bytes());
                out.extend_from_slice(&request.encode());
            }
            Request::Raft { message } => {
                out.push(RAFT);
                put_bytes(&mut out, message);
            }
        }
        out
    }

    /// Parses a request, checking every length against the limits.
    pub(crate) fn decode(payload: &[u8]) -> Result<Request, String> {
        let mut reader = Cursor { bytes: payload };
        let request = match reader.u8()? {
            SET => Request::Set {
                key: reader.key()?,
                value: reader.value()?,
            },
            GET => Request::Get { key: reader.key()? },
            WAIT => {
                let timeout = Duration::from_millis(reader.u64()?);
                let count = reader.u32()? as usize;
                if count > MAX_WAIT_KEYS {
                    return Err(format!(
                        "wait for {count} keys is above the limit of {MAX_WAIT_KEYS}"
                    ));
                }
                let keys = (0..count).map(|_| reader.key()).collect::<Result<_, _>>()?;
                Request::Wait { keys, timeout }
            }
            ADD => Request::Add {
                key: reader.key()?,
                delta: reader.u64()? as i64,
            },
            COMPARE_SET => {
                let key = reader.key()?;
                let expected = match reader.u8()? {
                    0 => None,
                    _ => Some(reader.value()?),
                };
                Request::CompareSet {
                    key,
                    expected,
                    desired: reader.value()?,
                }
            }
            DELETE => Request::Delete { key: reader.key()? },
            NUM_KEYS => Request::NumKeys,
            SESSION => {
                let client = reader.u64()?;
                let seq = reader.u64()?;
                let request = Request::decode(reader.bytes)?;
                if matches!(request, Request::Session { .. } | Request::Raft { .. }) {
                    return Err("a session holds a session or a Raft message".into());
                }
                reader.bytes = &[];
                Request::Session {
                    client,
                    seq,
                    request: Box::new(request),
                }
            }
            RAFT => Request::Raft {
                message: reader.value()?,
            },
            other => return Err(format!("unknown opcode {other}")),
        };
        reader.finish()?;
        Ok(request)
    }
}

impl Response {
    /// The response's bytes, to put in a frame.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        match self {
            Response::Done => out.push(DONE),
            Response::Value(value) => {
                out.push(VALUE);
                put_bytes(&mut out, value);
            }
            Response::NotFound => out.push(NOT_FOUND),
            Response::Integer(value) => {
                out.push(INTEGER);
                out.extend_from_slice(&value.to_le_bytes());
            }
            Response::Deleted(existed) => {
                out.push(DELETED);
                out.push(u8::from(*existed));
            }
            Response::Count(count) => {
                out.push(COUNT);
                out.extend_from_slice(&count.to_le_bytes());
            }
            Response::TimedOut { missing } => {
                out.push(TIMED_OUT);
                out.extend_from_slice(&(missing.len() as u32).to_le_bytes());
                for key in missing {
                    put_bytes(&mut out, key.as_bytes());
                }
            }
            Response::Error(message) => {
                out.push(ERROR);
                put_bytes(&mut out, message.as_bytes());
            }
            Response::NotLeader { leader } => {
                out.push(NOT_LEADER);
                match leader {
                    Some(addr) => {
                        out.push(1);
                        put_bytes(&mut out, addr.as_bytes());
                    }
                    None => out.push(0),
                }
            }
        }
        out
    }

    /// Parses a response, checking every length against the limits.
    pub(crate) fn decode(payload: &[u8]) -> Result<Response, String> {
        let mut reader = Cursor { bytes: payload };
        let response = match reader.u8()? {
            DONE => Response::Done,
            VALUE => Response::Value(reader.value()?),
            NOT_FOUND => Response::NotFound,
            INTEGER => Response::Integer(reader.u64()? as i64),
            DELETED => Response::Deleted(reader.u8()? != 0),
            COUNT => Response::Count(reader.u64()?),
            TIMED_OUT => {
                let count = reader.u32()? as usize;
                if count > MAX_WAIT_KEYS {
                    return Err(format!(
                        "{count} missing keys is above the limit of {MAX_WAIT_KEYS}"
                    ));
                }
                let missing = (0..count).map(|_| reader.key()).collect::<Result<_, _>>()?;
                Response::TimedOut { missing }
            }
            ERROR => Response::Error(String::from_utf8_lossy(&reader.value()?).into_owned()),
            NOT_LEADER => Response::NotLeader {
                leader: match reader.u8()? {
                    0 => None,
                    _ => Some(reader.key()?),
                },
            },
            other => return Err(format!("unknown status {other}")),
        };
        reader.finish()?;
        Ok(response)
    }
}

pub(crate) fn put_bytes(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn duration_millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Reads fields off the front of a payload; every read is bounds-checked.
pub(crate) struct Cursor<'a> {
    pub(crate) bytes: &'a [u8],
}

impl Cursor<'_> {
    fn take(&mut self, count: usize) -> Result<&[u8], String> {
        if count > self.bytes.len() {
            return Err(format!(
                "truncated message: needed {count} more bytes, {} left",
                self.bytes.len()
            ));
        }
        let (head, tail) = self.bytes.split_at(count);
        self.bytes = tail;
        Ok(head)
    }

    pub(crate) fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, String> {
        let mut word = [0u8; 4];
        word.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(word))
    }

    pub(crate) fn u64(&mut self) -> Result<u64, String> {
        let mut word = [0u8; 8];
        word.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(word))
    }

    fn sized(&mut self, max: usize, what: &str) -> Result<&[u8], String> {
        let length = self.u32()? as usize;
        if length > max {
            return Err(format!(
                "{what} of {length} bytes is above the limit of {max} bytes"
            ));
        }
        self.take(length)
    }

    pub(crate) fn key(&mut self) -> Result<String, String> {
        let bytes = self.sized(MAX_KEY_BYTES, "key")?;
        String::from_utf8(bytes.to_vec()).map_err(|_| "key is not valid UTF-8".to_string())
    }

    pub(crate) fn value(&mut self) -> Result<Vec<u8>, String> {
        Ok(self.sized(MAX_VALUE_BYTES, "value")?.to_vec())
    }

    pub(crate) fn finish(&self) -> Result<(), String> {
        match self.bytes.len() {
            0 => Ok(()),
            extra => Err(format!("{extra} unexpected bytes after the message")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_round_trips() {
        let requests = [
            Request::Set {
                key: "a".into(),
                value: vec![1, 2, 3],
            },
            Request::Get {
                key: "ключ".into()
            },
            Request::Wait {
                keys: vec!["x".into(), "y".into()],
                timeout: Duration::from_millis(1500),
            },
            Request::Add {
                key: "n".into(),
                delta: -7,
            },
            Request::CompareSet {
                key: "c".into(),
                expected: None,
                desired: vec![9],
            },
            Request::CompareSet {
                key: "c".into(),
                expected: Some(vec![]),
                desired: vec![],
            },
            Request::Delete { key: "d".into() },
            Request::NumKeys,
            Request::Session {
                client: u64::MAX,
                seq: 3,
                request: Box::new(Request::Add {
                    key: "n".into(),
                    delta: 1,
                }),
            },
            Request::Raft {
                message: vec![8, 1],
            },
        ];
        for request in requests {
            assert_eq!(Request::decode(&request.encode()), Ok(request));
        }
    }

    #[test]
    fn every_response_round_trips() {
        let responses = [
            Response::Done,
            Response::Value(vec![0, 255]),
            Response::NotFound,
            Response::Integer(i64::MIN),
            Response::Deleted(true),
            Response::Count(42),
            Response::TimedOut {
                missing: vec!["k".into()],
            },
            Response::Error("bad".into()),
            Response::NotLeader { leader: None },
            Response::NotLeader {
                leader: Some("10.0.0.2:29400".into()),
            },
        ];
        for response in responses {
            assert_eq!(Response::decode(&response.encode()), Ok(response));
        }
    }

    #[test]
    fn oversized_and_truncated_fields_are_rejected() {
        let mut oversized_key = vec![GET];
        oversized_key.extend_from_slice(&(MAX_KEY_BYTES as u32 + 1).to_le_bytes());
        assert_eq!(
            Request::decode(&oversized_key),
            Err(format!(
                "key of {} bytes is above the limit of {MAX_KEY_BYTES} bytes",
                MAX_KEY_BYTES + 1
            ))
        );
        let truncated = [SET, 5, 0, 0, 0, b'a'];
        assert_eq!(
            Request::decode(&truncated),
            Err("truncated message: needed 5 more bytes, 1 left".into())
        );
        let mut trailing = Request::NumKeys.encode();
        trailing.push(0);
        assert_eq!(
            Request::decode(&trailing),
            Err("1 unexpected bytes after the message".into())
        );
        assert_eq!(Request::decode(&[200]), Err("unknown opcode 200".into()));
        let nested = Request::Session {
            client: 1,
            seq: 1,
            request: Box::new(Request::Session {
                client: 1,
                seq: 2,
                request: Box::new(Request::NumKeys),
            }),
        };
        assert_eq!(
            Request::decode(&nested.encode()),
            Err("a session holds a session or a Raft message".into())
        );
        assert_eq!(
            Request::decode(&[]),
            Err("truncated message: needed 1 more bytes, 0 left".into())
        );
    }

    #[test]
    fn frame_length_above_limit_is_rejected_before_allocation() {
        let mut bytes = (1u64 << 40).to_le_bytes().to_vec();
        bytes.extend_from_slice(&[0; 16]);
        match read_frame(&mut bytes.as_slice()) {
            Err(FrameError::Malformed(message)) => assert_eq!(
                message,
                format!(
                    "frame of 1099511627776 bytes is above the limit of {MAX_FRAME_BYTES} bytes"
                )
            ),
            other => panic!("expected a malformed-frame error, got {other:?}"),
        }
    }
}
