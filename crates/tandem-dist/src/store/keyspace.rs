//! The store's state: a map of keys to values, and what each failing-over client was last
//! answered. A single server answers requests from it directly; each replica of a replicated
//! store applies the requests in the order of its log.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::protocol::{put_bytes, Cursor, Request, Response};

/// The longest `wait` the store honours, whatever the client asks.
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// The keys and values of a store, with the waiters on them.
pub(crate) struct Keyspace {
    state: Mutex<State>,
    changed: Condvar,
    stopping: AtomicBool,
}

#[derive(Default)]
struct State {
    map: HashMap<String, Vec<u8>>,
    /// Per client of a session: its last request's number and the answer it got. A request
    /// retried on another replica after a failover gets that answer again, not a second
    /// application.
    sessions: HashMap<u64, (u64, Response)>,
}

impl Keyspace {
    /// An empty keyspace.
    pub(crate) fn new() -> Keyspace {
        Keyspace {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
        }
    }

    /// Whether `request` changes the keyspace (and so goes through a replicated log).
    pub(crate) fn is_write(request: &Request) -> bool {
        match request {
            Request::Set { .. }
            | Request::Add { .. }
            | Request::CompareSet { .. }
            | Request::Delete { .. } => true,
            Request::Session { request, .. } => Keyspace::is_write(request),
            Request::Get { .. }
            | Request::Wait { .. }
            | Request::NumKeys
            | Request::Raft { .. } => false,
        }
    }

    /// Applies a write or answers a read. A `wait` blocks until its keys are set, its
    /// timeout passes or the keyspace stops.
    pub(crate) fn answer(&self, request: Request) -> Response {
        match request {
            Request::Wait { keys, timeout } => self.wait(&keys, timeout.min(MAX_WAIT)),
            Request::Session {
                client,
                seq,
                request,
            } => self.answer_in_session(client, seq, *request),
            other => self.apply(&mut lock(&self.state), other),
        }
    }

    /// Ends every `wait` now, and every later one at once.
    pub(crate) fn stop(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.changed.notify_all();
    }

    fn answer_in_session(&self, client: u64, seq: u64, request: Request) -> Response {
        if !Keyspace::is_write(&request) {
            return self.answer(request);
        }
        let mut state = lock(&self.state);
        match state.sessions.get(&client) {
            Some((last, answer)) if *last == seq => return answer.clone(),
            Some((last, _)) if *last > seq => {
                return Response::Error(format!(
                    "request {seq} of client {client:#x} arrived after its request {last}"
                ))
            }
            _ => {}
        }
        let answer = self.apply(&mut state, request);
        state.sessions.insert(client, (seq, answer.clone()));
        answer
    }

    fn apply(&self, state: &mut State, request: Request) -> Response {
        let map = &mut state.map;
        let answer = match request {
            Request::Set { key, value } => {
                map.insert(key, value);
                Response::Done
            }
            Request::Get { key } => match map.get(&key) {
                Some(value) => Response::Value(value.clone()),
                None => Response::NotFound,
            },
            Request::Add { key, delta } => add(map, &key, delta),
            Request::CompareSet {
                key,
                expected,
                desired,
            } => {
                let current = map.get(&key);
                if current.map(Vec::as_slice) == expected.as_deref() {
                    map.insert(key, desired.clone());
                    Response::Value(desired)
                } else {
                    // c10d semantics: on a mismatch, answer what is stored (empty when missing).
                    Response::Value(current.cloned().unwrap_or_default())
                }
            }
            Request::Delete { key } => Response::Deleted(map.remove(&key).is_some()),
            Request::NumKeys => Response::Count(map.len() as u64),
            Request::Wait { .. } | Request::Session { .. } | Request::Raft { .. } => {
                Response::Error("this request cannot be applied to the keyspace".into())
            }
        };
        self.changed.notify_all();
        answer
    }

    fn wait(&self, keys: &[String], timeout: Duration) -> Response {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        loop {
            let missing: Vec<String> = keys
                .iter()
                .filter(|key| !state.map.contains_key(*key))
                .cloned()
                .collect();
            if missing.is_empty() {
                return Response::Done;
            }
            let now = Instant::now();
            if now >= deadline || self.stopping.load(Ordering::SeqCst) {
                return Response::TimedOut { missing };
            }
            state = match self.changed.wait_timeout(state, deadline - now) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// The whole keyspace as bytes: the map, then the sessions.
    pub(crate) fn encode(&self) -> Vec<u8> {
        let state = lock(&self.state);
        let mut out = Vec::new();
        out.extend_from_slice(&(state.map.len() as u64).to_le_bytes());
        for (key, value) in &state.map {
            put_bytes(&mut out, key.as_bytes());
            put_bytes(&mut out, value);
        }
        out.extend_from_slice(&(state.sessions.len() as u64).to_le_bytes());
        for (client, (seq, answer)) in &state.sessions {
            out.extend_from_slice(&client.to_le_bytes());
            out.extend_from_slice(&seq.to_le_bytes());
            put_bytes(&mut out, &answer.encode());
        }
        out
    }

    /// Replaces the whole keyspace with one that [`encode`](Self::encode) wrote.
    pub(crate) fn restore(&self, bytes: &[u8]) -> Result<(), String> {
        let mut reader = Cursor { bytes };
        let mut restored = State::default();
        for _ in 0..reader.u64()? {
            let key = reader.key()?;
            restored.map.insert(key, reader.value()?);
        }
        for _ in 0..reader.u64()? {
            let client = reader.u64()?;
            let seq = reader.u64()?;
            let answer = Response::decode(&reader.value()?)?;
            restored.sessions.insert(client, (seq, answer));
        }
        reader.finish()?;
        *lock(&self.state) = restored;
        self.changed.notify_all();
        Ok(())
    }
}

fn add(map: &mut HashMap<String, Vec<u8>>, key: &str, delta: i64) -> Response {
    let current = match map.get(key) {
        None => 0,
        Some(bytes) => match std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse::<i64>().ok())
        {
            Some(number) => number,
            None => {
                return Response::Error(format!("value of key {key:?} is not a decimal integer"))
            }
        },
    };
    let Some(sum) = current.checked_add(delta) else {
        return Response::Error(format!(
            "adding {delta} to {current} (key {key:?}) overflows i64"
        ));
    };
    map.insert(key.to_string(), sum.to_string().into_bytes());
    Response::Integer(sum)
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // No thread panics while holding the lock, but recover the data if one did.
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn add_in_session(keyspace: &Keyspace, seq: u64) -> Response {
        keyspace.answer(Request::Session {
            client: 7,
            seq,
            request: Box::new(Request::Add {
                key: "n".into(),
                delta: 5,
            }),
        })
    }

    #[test]
    fn a_retried_write_of_a_session_is_applied_once_and_answered_alike() {
        let keyspace = Keyspace::new();
        assert_eq!(add_in_session(&keyspace, 1), Response::Integer(5));
        assert_eq!(add_in_session(&keyspace, 1), Response::Integer(5));
        assert_eq!(add_in_session(&keyspace, 2), Response::Integer(10));
        assert_eq!(
            add_in_session(&keyspace, 1),
            Response::Error("request 1 of client 0x7 arrived after its request 2".into())
        );
    }

    #[test]
    fn a_restored_keyspace_holds_the_same_keys_and_sessions() {
        let keyspace = Keyspace::new();
        keyspace.answer(Request::Set {
            key: "a".into(),
            value: vec![1, 2],
        });
        add_in_session(&keyspace, 1);
        let copy = Keyspace::new();
        copy.restore(&keyspace.encode()).expect("restore");
        assert_eq!(
            copy.answer(Request::Get { key: "a".into() }),
            Response::Value(vec![1, 2])
        );
        assert_eq!(add_in_session(&copy, 1), Response::Integer(5));
        assert_eq!(copy.answer(Request::NumKeys), Response::Count(2));
        let mut truncated = keyspace.encode();
        truncated.pop();
        assert!(Keyspace::new().restore(&truncated).is_err());
    }
}
