//! Downloading CIFAR-10's binary archive: resumable (HTTP `Range`), checked against its md5,
//! and never visible under its final name until complete and verified.
//!
//! Both `http://` and `https://` addresses go through `ureq` (rustls for TLS): redirects
//! followed, `Content-Length`, chunked or read-to-close bodies, and every connect, read and
//! write bounded by [`DownloadLimits::stall_timeout`] so a silent server cannot hang the run.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use md5::{Digest, Md5};

use crate::cifar_bin;
use crate::error::DataError;

/// The official address of the archive.
pub const CIFAR10_URL: &str = "https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz";
/// The official md5 of the archive.
pub const CIFAR10_MD5: &str = "c32a1d4ab5d03f1284b67883e8d87530";
/// The archive's file name.
pub const CIFAR10_ARCHIVE_NAME: &str = "cifar-10-binary.tar.gz";

/// The most bytes [`download_cifar10`] accepts: the official archive is about 170 MB.
pub const CIFAR10_MAX_DOWNLOAD_BYTES: u64 = 180_000_000;
/// The most bytes [`download_file`] accepts.
pub const MAX_DOWNLOAD_BYTES: u64 = 1 << 30;

/// How long a connection may stay silent (connecting, or between two reads) by default.
pub const DOWNLOAD_STALL_TIMEOUT: Duration = Duration::from_secs(60);

/// Redirects followed before giving up.
const MAX_REDIRECTS: u32 = 5;

/// What one download may take: its size bound and how long the server may stay silent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DownloadLimits {
    /// The most bytes the file may have; a server announcing or sending more is refused.
    pub max_bytes: u64,
    /// Connecting, sending the request, and each read of the answer fail after this long
    /// without progress. The whole download has no deadline: a slow but steady one finishes.
    pub stall_timeout: Duration,
}

impl DownloadLimits {
    /// At most `max_bytes`, with the default [`DOWNLOAD_STALL_TIMEOUT`].
    pub fn up_to(max_bytes: u64) -> DownloadLimits {
        DownloadLimits {
            max_bytes,
            stall_timeout: DOWNLOAD_STALL_TIMEOUT,
        }
    }
}

/// Makes sure CIFAR-10's binary layout is in `dir`: if it is there in any form
/// [`crate::DataSource::Cifar10Bin`] accepts, nothing happens; otherwise the archive is
/// downloaded from `url` (progress every 10% on stderr). Returns `dir`.
pub fn ensure_cifar10_downloaded(dir: &Path, url: &str) -> Result<PathBuf, DataError> {
    if cifar_bin::is_present(dir) {
        return Ok(dir.to_path_buf());
    }
    let mut reported_tenths = 0;
    let mut report = |done: u64, total: Option<u64>| {
        if let Some(total) = total.filter(|&total| total > 0) {
            let tenths = done * 10 / total;
            if tenths > reported_tenths {
                reported_tenths = tenths;
                eprintln!(
                    "downloading {CIFAR10_ARCHIVE_NAME}: {}% of {} MB",
                    tenths * 10,
                    total >> 20
                );
            }
        }
    };
    download_cifar10(dir, url, &mut report)?;
    Ok(dir.to_path_buf())
}

/// Downloads `cifar-10-binary.tar.gz` from `url` into `dir` (created if needed) and returns
/// its path. An archive already there with the right md5 is kept; a partial download is
/// resumed. `progress(bytes_so_far, total_bytes)` is called as data arrives.
pub fn download_cifar10(
    dir: &Path,
    url: &str,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<PathBuf, DataError> {
    std::fs::create_dir_all(dir).map_err(|source| DataError::io(dir, source))?;
    let destination = dir.join(CIFAR10_ARCHIVE_NAME);
    download_file_bounded(
        url,
        &destination,
        CIFAR10_MD5,
        DownloadLimits::up_to(CIFAR10_MAX_DOWNLOAD_BYTES),
        progress,
    )?;
    Ok(destination)
}

/// Downloads `url` to `destination`, verifying `expected_md5` (lowercase hex). The data goes
/// to `<destination>.part` first; an existing partial file is resumed with a `Range`
/// request (or restarted if the server ignores it); the file is synced and renamed into
/// place only once its md5 matches. A file already at `destination` with the right md5 is
/// left alone. At most [`MAX_DOWNLOAD_BYTES`] are accepted (see [`download_file_bounded`]).
pub fn download_file(
    url: &str,
    destination: &Path,
    expected_md5: &str,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<(), DataError> {
    download_file_bounded(
        url,
        destination,
        expected_md5,
        DownloadLimits::up_to(MAX_DOWNLOAD_BYTES),
        progress,
    )
}

/// [`download_file`] within `limits`: a response announcing more than `limits.max_bytes` is
/// refused before its body is read, a body that runs past it is cut off and its partial file
/// removed, so a server cannot fill the disk; a server silent for `limits.stall_timeout`
/// fails the download (a partial file is kept for the next attempt to resume).
pub fn download_file_bounded(
    url: &str,
    destination: &Path,
    expected_md5: &str,
    limits: DownloadLimits,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<(), DataError> {
    if destination.is_file() && file_md5(destination)? == expected_md5 {
        return Ok(());
    }
    let max_bytes = limits.max_bytes;
    let partial = partial_path(destination);
    let already = std::fs::metadata(&partial)
        .map(|meta| meta.len())
        .unwrap_or(0);
    let response = get(url, already, limits.stall_timeout)?;
    let mut file = match response.start {
        Some(start) if start == already => OpenOptions::new()
            .append(true)
            .open(&partial)
            .map_err(|source| DataError::io(&partial, source))?,
        _ => File::create(&partial).map_err(|source| DataError::io(&partial, source))?,
    };
    let resumed_from = response.start.unwrap_or(0);
    let total = response
        .body_len
        .map(|len| len.saturating_add(resumed_from));
    if let Some(total) = total.filter(|&total| total > max_bytes) {
        drop(file);
        let _ = std::fs::remove_file(&partial);
        return Err(download_error(
            url,
            format!(
                "the server announces {total} bytes, more than the {max_bytes} this file can have"
            ),
        ));
    }
    let copied = copy_body(
        url,
        response,
        &mut file,
        &partial,
        Span {
            resumed_from,
            total,
            max_bytes,
        },
        limits.stall_timeout,
        progress,
    );
    if let Err(error) = copied {
        if matches!(&error, DataError::Download { message, .. } if message.starts_with(TOO_LONG)) {
            drop(file);
            let _ = std::fs::remove_file(&partial);
        }
        return Err(error);
    }
    file.sync_all()
        .map_err(|source| DataError::io(&partial, source))?;
    drop(file);
    let actual = file_md5(&partial)?;
    if actual != expected_md5 {
        let _ = std::fs::remove_file(&partial);
        return Err(DataError::Checksum {
            path: destination.to_path_buf(),
            expected: expected_md5.to_string(),
            actual,
        });
    }
    std::fs::rename(&partial, destination).map_err(|source| DataError::io(destination, source))?;
    if let Some(parent) = destination.parent() {
        if let Ok(folder) = File::open(parent) {
            let _ = folder.sync_all();
        }
    }
    Ok(())
}

/// `<destination>.part`.
fn partial_path(destination: &Path) -> PathBuf {
    let mut name = destination.file_name().unwrap_or_default().to_os_string();
    name.push(".part");
    destination.with_file_name(name)
}

/// Where a body lies in the file: from where it resumes, the announced total, and the most
/// the file may hold.
struct Span {
    resumed_from: u64,
    total: Option<u64>,
    max_bytes: u64,
}

/// How the error of a body that runs past the bound begins.
const TOO_LONG: &str = "the body runs past";

/// Appends the response body to `file`; a body cut short or stalled for `stall_timeout` is
/// an error that keeps the partial file for the next attempt to resume, a body longer than
/// the bound an error.
fn copy_body(
    url: &str,
    mut response: Response,
    file: &mut File,
    partial: &Path,
    span: Span,
    stall_timeout: Duration,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<(), DataError> {
    let Span {
        resumed_from,
        total,
        max_bytes,
    } = span;
    let mut received = 0u64;
    let mut chunk = vec![0u8; 256 * 1024];
    loop {
        let wanted = match response.body_len {
            Some(len) if received >= len => break,
            Some(len) => chunk.len().min((len - received) as usize),
            None => chunk.len(),
        };
        let count = match response.reader.read(&mut chunk[..wanted]) {
            Ok(count) => count,
            Err(error) if error.kind() == std::io::ErrorKind::Interrupted => continue,
            // ureq reports a body shorter than its Content-Length this way.
            Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(error) if error.kind() == std::io::ErrorKind::TimedOut => {
                return Err(download_error(
                    url,
                    format!(
                        "timed out: the server sent nothing for {stall_timeout:?} after {} bytes; the partial file {} is kept, run again to resume",
                        resumed_from + received,
                        partial.display()
                    ),
                ))
            }
            Err(error) => {
                return Err(download_error(
                    url,
                    format!(
                        "reading the body after {} bytes: {error}; the partial file {} is kept, run again to resume",
                        resumed_from + received,
                        partial.display()
                    ),
                ))
            }
        };
        if count == 0 {
            break;
        }
        if resumed_from + received + count as u64 > max_bytes {
            return Err(download_error(
                url,
                format!("{TOO_LONG} {max_bytes} bytes, more than this file can have; the partial file was removed"),
            ));
        }
        file.write_all(&chunk[..count])
            .map_err(|source| DataError::io(partial, source))?;
        received += count as u64;
        progress(resumed_from + received, total);
    }
    if let Some(len) = response.body_len {
        if received < len {
            return Err(download_error(
                url,
                format!(
                    "truncated: the connection closed after {} of {} bytes; the partial file {} is kept, run again to resume",
                    resumed_from + received,
                    resumed_from + len,
                    partial.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The md5 of a file, lowercase hex.
pub fn file_md5(path: &Path) -> Result<String, DataError> {
    let mut file = File::open(path).map_err(|source| DataError::io(path, source))?;
    let mut hasher = Md5::new();
    let mut chunk = vec![0u8; 1 << 20];
    loop {
        let count = file
            .read(&mut chunk)
            .map_err(|source| DataError::io(path, source))?;
        if count == 0 {
            break;
        }
        hasher.update(&chunk[..count]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect())
}

fn download_error(url: &str, message: impl Into<String>) -> DataError {
    DataError::Download {
        url: url.to_string(),
        message: message.into(),
    }
}

/// A response whose head has been read.
struct Response {
    /// Where the body starts in the file: `Some(n)` for `206 Partial Content` from byte n,
    /// `None` for a whole file.
    start: Option<u64>,
    /// Body length, if announced.
    body_len: Option<u64>,
    reader: Box<dyn Read + Send>,
}

/// Sends `GET url` (following redirects), asking for bytes from `from` on if `from > 0`.
fn get(url: &str, from: u64, stall_timeout: Duration) -> Result<Response, DataError> {
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(stall_timeout)
        .timeout_read(stall_timeout)
        .timeout_write(stall_timeout)
        // ureq counts the request that gets the last redirect among them.
        .redirects(MAX_REDIRECTS + 1)
        // One download, one connection at a time: nothing to gain from keeping any open.
        .max_idle_connections(0)
        .user_agent("tandem")
        .build();
    let mut request = agent.get(url).set("Accept-Encoding", "identity");
    if from > 0 {
        request = request.set("Range", &format!("bytes={from}-"));
    }
    let response = match request.call() {
        Ok(response) => response,
        // The partial file is already complete (or longer than the file): start afresh.
        Err(ureq::Error::Status(416, _)) if from > 0 => return get(url, 0, stall_timeout),
        Err(ureq::Error::Status(status, response)) => {
            return Err(download_error(
                url,
                format!("server answered {status} {}", response.status_text()),
            ))
        }
        Err(ureq::Error::Transport(transport)) => {
            return Err(download_error(
                url,
                describe_transport(&transport, stall_timeout),
            ))
        }
    };
    // Anything else below 400 (a redirect without a Location, 204, ...) is not the file.
    if !matches!(response.status(), 200 | 206) {
        return Err(download_error(
            url,
            format!(
                "server answered {} {} instead of the file",
                response.status(),
                response.status_text()
            ),
        ));
    }
    let body_len = match response.header("Content-Length") {
        Some(value) => Some(value.trim().parse::<u64>().map_err(|_| {
            download_error(url, format!("Content-Length {value:?} is not a number"))
        })?),
        None => None,
    };
    let start = if response.status() == 206 {
        let start = response
            .header("Content-Range")
            .and_then(|value| value.trim().strip_prefix("bytes "))
            .and_then(|range| range.split('-').next())
            .and_then(|start| start.trim().parse::<u64>().ok())
            .ok_or_else(|| {
                download_error(url, "206 Partial Content without a readable Content-Range")
            })?;
        Some(start)
    } else {
        None
    };
    Ok(Response {
        start,
        body_len,
        reader: response.into_reader(),
    })
}

/// What went wrong below HTTP (unreachable host, silent server, bad address, too many
/// redirects), without the address the error message already names.
fn describe_transport(transport: &ureq::Transport, stall_timeout: Duration) -> String {
    let causes: Vec<&dyn std::error::Error> =
        std::iter::successors(std::error::Error::source(transport), |cause| cause.source())
            .collect();
    let timed_out = causes.iter().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|error| error.kind() == std::io::ErrorKind::TimedOut)
    });
    let root_cause = causes
        .last()
        .map(|cause| cause.to_string())
        .or_else(|| transport.message().map(str::to_string))
        .unwrap_or_default();
    match transport.kind() {
        _ if timed_out => format!("timed out: the server sent nothing for {stall_timeout:?}"),
        ureq::ErrorKind::Dns => format!("cannot resolve the host: {root_cause}"),
        ureq::ErrorKind::ConnectionFailed => format!("cannot connect: {root_cause}"),
        ureq::ErrorKind::TooManyRedirects => format!("more than {MAX_REDIRECTS} redirects"),
        kind => format!("{kind}: {root_cause}"),
    }
}
