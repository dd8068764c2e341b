//! The byte streams under ring links: TCP between hosts, Unix sockets between ranks of one
//! host (they skip the TCP/IP stack and carry several times the bandwidth of loopback TCP).
//!
//! A rank advertises its Unix socket as "`boot id` `path`". A peer tries it only when it
//! runs under the same kernel (same boot id) and falls back to TCP when the path cannot be
//! reached (another container, another mount namespace). The socket file exists only during
//! the rendezvous.

use std::io::{Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use crate::auth::fill_random;
use crate::error::{DistError, Result};

/// A connected stream to a peer.
pub(crate) enum PeerStream {
    /// Between hosts, or when Unix sockets are off.
    Tcp(TcpStream),
    /// Between ranks of one host.
    Unix(UnixStream),
}

impl PeerStream {
    /// Blocking mode, no Nagle delay, and the given timeouts for the handshake.
    pub(crate) fn configure(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        match self {
            PeerStream::Tcp(stream) => {
                stream.set_nonblocking(false)?;
                stream.set_nodelay(true)?;
            }
            PeerStream::Unix(stream) => stream.set_nonblocking(false)?,
        }
        self.set_read_timeout(timeout)?;
        self.set_write_timeout(timeout)
    }

    /// Bounds each later read.
    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        match self {
            PeerStream::Tcp(stream) => stream.set_read_timeout(timeout),
            PeerStream::Unix(stream) => stream.set_read_timeout(timeout),
        }
    }

    /// Bounds each later write.
    pub(crate) fn set_write_timeout(&self, timeout: Option<Duration>) -> std::io::Result<()> {
        match self {
            PeerStream::Tcp(stream) => stream.set_write_timeout(timeout),
            PeerStream::Unix(stream) => stream.set_write_timeout(timeout),
        }
    }

    /// Closes both directions; blocked reads and writes on either end fail at once.
    pub(crate) fn shutdown(&self) {
        let _ = match self {
            PeerStream::Tcp(stream) => stream.shutdown(Shutdown::Both),
            PeerStream::Unix(stream) => stream.shutdown(Shutdown::Both),
        };
    }

    /// A second handle to the same connection (to shut it down from another thread).
    pub(crate) fn try_clone(&self) -> std::io::Result<PeerStream> {
        Ok(match self {
            PeerStream::Tcp(stream) => PeerStream::Tcp(stream.try_clone()?),
            PeerStream::Unix(stream) => PeerStream::Unix(stream.try_clone()?),
        })
    }

    /// "tcp" or "unix", for messages and tests.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            PeerStream::Tcp(_) => "tcp",
            PeerStream::Unix(_) => "unix",
        }
    }
}

impl Read for &PeerStream {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        match self {
            PeerStream::Tcp(stream) => (&*stream).read(buffer),
            PeerStream::Unix(stream) => (&*stream).read(buffer),
        }
    }
}

impl Write for &PeerStream {
    fn write(&mut self, buffer: &[u8]) -> std::io::Result<usize> {
        match self {
            PeerStream::Tcp(stream) => (&*stream).write(buffer),
            PeerStream::Unix(stream) => (&*stream).write(buffer),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A stream whose every read and write ends by one deadline: however slowly the other end
/// trickles its bytes, the exchange as a whole is bounded.
pub(crate) struct DeadlineStream<'a> {
    stream: &'a PeerStream,
    deadline: std::time::Instant,
}

impl<'a> DeadlineStream<'a> {
    /// `stream`, bounded by `deadline`.
    pub(crate) fn new(stream: &'a PeerStream, deadline: std::time::Instant) -> Self {
        DeadlineStream { stream, deadline }
    }

    /// The time left, or a timeout error once the deadline has passed.
    fn left(&self) -> std::io::Result<Duration> {
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "the handshake's deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for DeadlineStream<'_> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        self.stream.set_read_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.read(buffer)
    }
}

impl Write for DeadlineStream<'_> {
    fn write(&mut self, buffer: &[u8]) -> std::io::Result<usize> {
        self.stream.set_write_timeout(Some(self.left()?))?;
        let mut stream = self.stream;
        stream.write(buffer)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A rank's listeners during the rendezvous: TCP always, a Unix socket when possible.
pub(crate) struct PeerListeners {
    tcp: TcpListener,
    unix: Option<(UnixListener, PathBuf)>,
}

impl PeerListeners {
    /// Listens on a free TCP port of `host` (all interfaces when `host` is a name), and on a
    /// fresh Unix socket in the temporary directory when `unix_sockets` is set.
    pub(crate) fn bind(host: &str, unix_sockets: bool) -> Result<PeerListeners> {
        let ip = host.parse::<IpAddr>().unwrap_or(IpAddr::from([0, 0, 0, 0]));
        let tcp = TcpListener::bind(SocketAddr::new(ip, 0))
            .or_else(|_| TcpListener::bind(SocketAddr::new(IpAddr::from([0, 0, 0, 0]), 0)))
            .map_err(|error| DistError::io(format!("bind the peer listener for {host}"), &error))?;
        tcp.set_nonblocking(true)
            .map_err(|error| DistError::io("make the peer listener non-blocking", &error))?;
        let unix = match unix_sockets {
            true => bind_unix(),
            false => None,
        };
        Ok(PeerListeners { tcp, unix })
    }

    /// The TCP port.
    pub(crate) fn port(&self) -> Result<u16> {
        let addr = self
            .tcp
            .local_addr()
            .map_err(|error| DistError::io("read the peer listener's address", &error))?;
        Ok(addr.port())
    }

    /// What to publish so that peers on this host can use the Unix socket.
    pub(crate) fn local_endpoint(&self) -> Option<String> {
        let (_, path) = self.unix.as_ref()?;
        Some(format!("{} {}", boot_id()?, path.to_str()?))
    }

    /// An incoming connection, if one is waiting (never blocks).
    pub(crate) fn try_accept(&self) -> Option<PeerStream> {
        if let Some((listener, _)) = &self.unix {
            if let Ok((stream, _)) = listener.accept() {
                return Some(PeerStream::Unix(stream));
            }
        }
        self.tcp
            .accept()
            .ok()
            .map(|(stream, _)| PeerStream::Tcp(stream))
    }
}

impl Drop for PeerListeners {
    fn drop(&mut self) {
        if let Some((_, path)) = &self.unix {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A non-blocking Unix listener at an unguessable path, or `None` if that fails (then TCP
/// carries everything).
fn bind_unix() -> Option<(UnixListener, PathBuf)> {
    let mut nonce = [0u8; 12];
    fill_random(&mut nonce).ok()?;
    let name: String = nonce.iter().map(|byte| format!("{byte:02x}")).collect();
    let path = std::env::temp_dir().join(format!("tandem-{}-{name}.sock", std::process::id()));
    let listener = UnixListener::bind(&path).ok()?;
    if listener.set_nonblocking(true).is_err() {
        let _ = std::fs::remove_file(&path);
        return None;
    }
    Some((listener, path))
}

/// Connects to a peer's published Unix endpoint when it runs under this kernel.
pub(crate) fn connect_local(endpoint: &str) -> Option<PeerStream> {
    let (their_boot, path) = endpoint.split_once(' ')?;
    if their_boot != boot_id()? {
        return None;
    }
    UnixStream::connect(path).ok().map(PeerStream::Unix)
}

/// The kernel's boot id: equal for processes that can share Unix sockets.
pub(crate) fn boot_id() -> Option<String> {
    let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    Some(text.trim().to_string()).filter(|id| !id.is_empty())
}
