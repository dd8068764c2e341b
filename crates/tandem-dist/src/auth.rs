//! The job token and the challenge-response handshake that proves both ends of a connection
//! know it, without sending the token itself.
//!
//! ```text
//! acceptor  -> connector: MAGIC, purpose byte, acceptor nonce (32 bytes)
//! connector -> acceptor : MAGIC, connector nonce (32 bytes), HMAC-SHA256(token, "connector" | purpose | nonces)
//! acceptor  -> connector: ACCEPTED + HMAC-SHA256(token, "acceptor" | purpose | nonces)   or   REFUSED, then close
//! ```

use std::io::{Read, Write};

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{DistError, Result};

/// The environment variable holding the job token.
pub const JOB_TOKEN_ENV: &str = "TANDEM_JOB_TOKEN";

const MAGIC: &[u8; 8] = b"TANDEM01";
const NONCE_LEN: usize = 32;
const MAC_LEN: usize = 32;
const ACCEPTED: u8 = 1;
const REFUSED: u8 = 0;

/// What a connection is for; part of the proof so a proof for one cannot be replayed for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Purpose {
    /// A client of the rendezvous store.
    Store = b'S' as isize,
    /// A ring link between two ranks.
    Peer = b'P' as isize,
}

/// The secret shared by every process of one job. Its `Debug` form never shows the secret.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(Vec<u8>);

impl JobToken {
    /// Wraps a token given by the user or the launcher; it must not be empty.
    pub fn new(token: &str) -> Result<JobToken> {
        if token.is_empty() {
            return Err(DistError::InvalidArgument("the job token is empty".into()));
        }
        Ok(JobToken(token.as_bytes().to_vec()))
    }

    /// A fresh random token: 32 random bytes as 64 hex digits, so it can travel in an
    /// environment variable.
    pub fn generate() -> Result<JobToken> {
        let mut bytes = [0u8; 32];
        fill_random(&mut bytes)?;
        let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
        JobToken::new(&hex)
    }

    /// Reads the token from `TANDEM_JOB_TOKEN`; `None` when the variable is unset.
    pub fn from_env() -> Result<Option<JobToken>> {
        match std::env::var(JOB_TOKEN_ENV) {
            Ok(value) => JobToken::new(&value).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(DistError::InvalidArgument(format!(
                "{JOB_TOKEN_ENV} is not valid UTF-8"
            ))),
        }
    }

    /// The token as text, to hand to child processes in `TANDEM_JOB_TOKEN`.
    pub fn expose_secret(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    fn mac(
        &self,
        role: &[u8],
        purpose: Purpose,
        acceptor_nonce: &[u8],
        connector_nonce: &[u8],
    ) -> [u8; MAC_LEN] {
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.0)
            .unwrap_or_else(|_| unreachable!("HMAC accepts keys of any length"));
        mac.update(role);
        mac.update(&[purpose as u8]);
        mac.update(acceptor_nonce);
        mac.update(connector_nonce);
        mac.finalize().into_bytes().into()
    }
}

impl std::fmt::Debug for JobToken {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.write_str("JobToken(<secret>)")
    }
}

/// Fills `bytes` from the operating system's random source.
pub(crate) fn fill_random(bytes: &mut [u8]) -> Result<()> {
    getrandom::fill(bytes).map_err(|error| DistError::Io {
        context: "read the operating system's random source".into(),
        message: error.to_string(),
    })
}

/// Why the acceptor side of a handshake failed.
#[derive(Debug)]
pub(crate) enum AcceptError {
    /// The connection broke or timed out.
    Broken,
    /// The connector spoke another protocol or failed the proof; it was refused.
    Refused,
}

/// The acceptor's half of one handshake: its nonce, the hello that carries it, and the check
/// of the connector's reply. Split from the I/O so that a server can run many handshakes
/// without a thread each (see the store's gate).
pub(crate) struct AcceptorChallenge {
    purpose: Purpose,
    nonce: [u8; NONCE_LEN],
}

/// Bytes of the connector's reply: magic, its nonce, its proof.
pub(crate) const CONNECTOR_REPLY_LEN: usize = 8 + NONCE_LEN + MAC_LEN;
/// What the acceptor sends before closing a connection that failed the proof.
pub(crate) const REFUSAL: [u8; 1] = [REFUSED];

impl AcceptorChallenge {
    /// A fresh challenge with a random nonce.
    pub(crate) fn new(purpose: Purpose) -> std::result::Result<AcceptorChallenge, AcceptError> {
        let mut nonce = [0u8; NONCE_LEN];
        fill_random(&mut nonce).map_err(|_| AcceptError::Refused)?;
        Ok(AcceptorChallenge { purpose, nonce })
    }

    /// The first message, acceptor to connector.
    pub(crate) fn hello(&self) -> Vec<u8> {
        let mut hello = Vec::with_capacity(MAGIC.len() + 1 + NONCE_LEN);
        hello.extend_from_slice(MAGIC);
        hello.push(self.purpose as u8);
        hello.extend_from_slice(&self.nonce);
        hello
    }

    /// Checks the connector's reply; on success returns the acceptance to send back (which
    /// proves that this end knows the token too).
    pub(crate) fn verify(
        &self,
        token: &JobToken,
        reply: &[u8; CONNECTOR_REPLY_LEN],
    ) -> std::result::Result<Vec<u8>, AcceptError> {
        let (magic, rest) = reply.split_at(MAGIC.len());
        let (connector_nonce, proof) = rest.split_at(NONCE_LEN);
        let expected = token.mac(b"connector", self.purpose, &self.nonce, connector_nonce);
        if magic != MAGIC || !constant_time_eq(proof, &expected) {
            return Err(AcceptError::Refused);
        }
        let mut answer = Vec::with_capacity(1 + MAC_LEN);
        answer.push(ACCEPTED);
        answer.extend_from_slice(&token.mac(
            b"acceptor",
            self.purpose,
            &self.nonce,
            connector_nonce,
        ));
        Ok(answer)
    }
}

/// Runs the acceptor side; on success the connector has proved it knows `token`.
/// The stream's read and write timeouts must already be set.
pub(crate) fn accept_handshake(
    mut stream: impl Read + Write,
    token: &JobToken,
    purpose: Purpose,
) -> std::result::Result<(), AcceptError> {
    let challenge = AcceptorChallenge::new(purpose)?;
    stream
        .write_all(&challenge.hello())
        .map_err(|_| AcceptError::Broken)?;
    let mut reply = [0u8; CONNECTOR_REPLY_LEN];
    stream
        .read_exact(&mut reply)
        .map_err(|_| AcceptError::Broken)?;
    match challenge.verify(token, &reply) {
        Ok(answer) => stream.write_all(&answer).map_err(|_| AcceptError::Broken),
        Err(refused) => {
            // Best effort: tell the connector why before closing.
            let _ = stream.write_all(&REFUSAL);
            Err(refused)
        }
    }
}

/// Why the connector side of a handshake failed.
#[derive(Debug)]
pub(crate) enum ConnectError {
    /// The connection broke or timed out.
    Io(std::io::Error),
    /// The acceptor refused our proof of the token.
    Refused,
    /// The acceptor is not a Tandem endpoint of this job.
    NotTrusted(String),
}

/// Runs the connector side; on success both ends have proved they know `token`.
/// The stream's read and write timeouts must already be set.
pub(crate) fn connect_handshake(
    mut stream: impl Read + Write,
    token: &JobToken,
    purpose: Purpose,
) -> std::result::Result<(), ConnectError> {
    let mut hello = [0u8; 8 + 1 + NONCE_LEN];
    stream.read_exact(&mut hello).map_err(ConnectError::Io)?;
    let (magic, rest) = hello.split_at(MAGIC.len());
    let (their_purpose, acceptor_nonce) = rest.split_at(1);
    if magic != MAGIC {
        return Err(ConnectError::NotTrusted(
            "it does not speak the Tandem protocol".into(),
        ));
    }
    if their_purpose != [purpose as u8] {
        return Err(ConnectError::NotTrusted(format!(
            "it serves {:?} connections, not {purpose:?}",
            their_purpose.first().map(|&byte| byte as char)
        )));
    }
    let mut connector_nonce = [0u8; NONCE_LEN];
    fill_random(&mut connector_nonce)
        .map_err(|error| ConnectError::NotTrusted(error.to_string()))?;
    let mut reply = Vec::with_capacity(8 + NONCE_LEN + MAC_LEN);
    reply.extend_from_slice(MAGIC);
    reply.extend_from_slice(&connector_nonce);
    reply.extend_from_slice(&token.mac(b"connector", purpose, acceptor_nonce, &connector_nonce));
    stream.write_all(&reply).map_err(ConnectError::Io)?;

    let mut verdict = [0u8; 1];
    // A refusing acceptor sends its verdict before closing; a close without one is a busy
    // acceptor shedding connections (the store's gate does), worth another try.
    stream.read_exact(&mut verdict).map_err(ConnectError::Io)?;
    if verdict[0] != ACCEPTED {
        return Err(ConnectError::Refused);
    }
    let mut proof = [0u8; MAC_LEN];
    stream.read_exact(&mut proof).map_err(ConnectError::Io)?;
    let expected = token.mac(b"acceptor", purpose, acceptor_nonce, &connector_nonce);
    if !constant_time_eq(&proof, &expected) {
        return Err(ConnectError::NotTrusted(
            "its proof of the job token is wrong".into(),
        ));
    }
    Ok(())
}

/// True for the errors a connection closed by the other end produces.
pub(crate) fn is_closed(error: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        error.kind(),
        UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe
    )
}

fn constant_time_eq(left: &[u8], right: &[u8]) -> bool {
    left.len() == right.len()
        && left
            .iter()
            .zip(right)
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}
