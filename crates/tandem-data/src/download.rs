//! Downloading CIFAR-10's binary archive: resumable (HTTP `Range`), checked against its md5,
//! and never visible under its final name until complete and verified.
//!
//! `http://` addresses go through a minimal HTTP/1.1 `GET` over a plain TCP stream
//! (redirects followed, `Content-Length` or read-to-close bodies). `https://` addresses
//! (the official one) need the `https` feature, which uses `ureq` with rustls; without it
//! they are refused with a message saying how to fetch the file by hand.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
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

/// Redirects followed before giving up.
const MAX_REDIRECTS: usize = 5;
/// Longest response head accepted.
const MAX_HEAD_BYTES: usize = 64 * 1024;
/// A stalled connection fails after this long.
const IO_TIMEOUT: Duration = Duration::from_secs(60);

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
        CIFAR10_MAX_DOWNLOAD_BYTES,
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
    download_file_bounded(url, destination, expected_md5, MAX_DOWNLOAD_BYTES, progress)
}

/// [`download_file`] of a file that holds at most `max_bytes`: a response announcing more is
/// refused before its body is read, and a body that runs past it is cut off and its partial
/// file removed, so a server cannot fill the disk.
pub fn download_file_bounded(
    url: &str,
    destination: &Path,
    expected_md5: &str,
    max_bytes: u64,
    progress: &mut dyn FnMut(u64, Option<u64>),
) -> Result<(), DataError> {
    if destination.is_file() && file_md5(destination)? == expected_md5 {
        return Ok(());
    }
    let partial = partial_path(destination);
    let already = std::fs::metadata(&partial)
        .map(|meta| meta.len())
        .unwrap_or(0);
    let response = get(url, already)?;
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

/// Appends the response body to `file`; a body cut short is an error that keeps the
/// partial file for the next attempt to resume, a body longer than the bound an error.
fn copy_body(
    url: &str,
    mut response: Response,
    file: &mut File,
    partial: &Path,
    span: Span,
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
            Err(error) => {
                return Err(download_error(
                    url,
                    format!("reading the body: {error}; run again to resume"),
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
                    "connection closed after {} of {} bytes; the partial file {} is kept, run again to resume",
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
fn file_md5(path: &Path) -> Result<String, DataError> {
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

/// Sends `GET url`, asking for bytes from `from` on if `from > 0`; follows redirects.
fn get(url: &str, from: u64) -> Result<Response, DataError> {
    let mut current = url.to_string();
    for _ in 0..=MAX_REDIRECTS {
        if current.starts_with("https://") {
            return get_https(&current, from);
        }
        match get_once(&current, from)? {
            Fetched::Response(response) => return Ok(response),
            Fetched::Redirect(location) => current = resolve_location(&current, &location),
        }
    }
    Err(download_error(
        url,
        format!("more than {MAX_REDIRECTS} redirects"),
    ))
}

enum Fetched {
    Response(Response),
    Redirect(String),
}

/// The parts of an `http://host[:port]/path` address.
struct Address {
    host: String,
    port: u16,
    path: String,
}

fn parse_url(url: &str) -> Result<Address, DataError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| download_error(url, "expected an http:// address"))?;
    let (authority, path) = match rest.find('/') {
        Some(slash) => (&rest[..slash], &rest[slash..]),
        None => (rest, "/"),
    };
    let (host, port) = match authority.rsplit_once(':') {
        Some((host, port)) => (
            host,
            port.parse::<u16>()
                .map_err(|_| download_error(url, format!("port {port:?} is not a number")))?,
        ),
        None => (authority, 80),
    };
    if host.is_empty() {
        return Err(download_error(url, "no host in the address"));
    }
    Ok(Address {
        host: host.to_string(),
        port,
        path: path.to_string(),
    })
}

fn resolve_location(current: &str, location: &str) -> String {
    if location.contains("://") {
        return location.to_string();
    }
    let origin_end = current
        .find("://")
        .and_then(|scheme| {
            current[scheme + 3..]
                .find('/')
                .map(|slash| scheme + 3 + slash)
        })
        .unwrap_or(current.len());
    format!("{}{location}", &current[..origin_end])
}

fn get_once(url: &str, from: u64) -> Result<Fetched, DataError> {
    let address = parse_url(url)?;
    let stream = TcpStream::connect((address.host.as_str(), address.port))
        .map_err(|error| download_error(url, format!("cannot connect: {error}")))?;
    let _ = stream.set_read_timeout(Some(IO_TIMEOUT));
    let _ = stream.set_write_timeout(Some(IO_TIMEOUT));
    let mut request = format!(
        "GET {} HTTP/1.1\r\nHost: {}\r\nUser-Agent: tandem\r\nAccept-Encoding: identity\r\nConnection: close\r\n",
        address.path, address.host
    );
    if from > 0 {
        request.push_str(&format!("Range: bytes={from}-\r\n"));
    }
    request.push_str("\r\n");
    (&stream)
        .write_all(request.as_bytes())
        .map_err(|error| download_error(url, format!("sending the request: {error}")))?;
    let mut reader = BufReader::new(stream);
    let head = read_head(url, &mut reader)?;
    let header = |name: &str| {
        head.headers
            .iter()
            .find(|(key, _)| key.eq_ignore_ascii_case(name))
            .map(|(_, value)| value.as_str())
    };
    if header("Transfer-Encoding").is_some_and(|value| !value.eq_ignore_ascii_case("identity")) {
        return Err(download_error(
            url,
            "the server sent a chunked body, which this client does not read",
        ));
    }
    let body_len = match header("Content-Length") {
        Some(value) => Some(value.trim().parse::<u64>().map_err(|_| {
            download_error(url, format!("Content-Length {value:?} is not a number"))
        })?),
        None => None,
    };
    match head.status {
        200 => Ok(Fetched::Response(Response {
            start: None,
            body_len,
            reader: Box::new(reader),
        })),
        206 => {
            let start = header("Content-Range")
                .and_then(|value| value.trim().strip_prefix("bytes "))
                .and_then(|range| range.split('-').next())
                .and_then(|start| start.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    download_error(url, "206 Partial Content without a readable Content-Range")
                })?;
            Ok(Fetched::Response(Response {
                start: Some(start),
                body_len,
                reader: Box::new(reader),
            }))
        }
        // The partial file is already complete (or longer than the file): start afresh.
        416 if from > 0 => get_once(url, 0),
        301 | 302 | 303 | 307 | 308 => match header("Location") {
            Some(location) => Ok(Fetched::Redirect(location.trim().to_string())),
            None => Err(download_error(
                url,
                format!("redirect {} without a Location", head.status),
            )),
        },
        status => Err(download_error(
            url,
            format!("server answered {status} {}", head.reason),
        )),
    }
}

struct Head {
    status: u16,
    reason: String,
    headers: Vec<(String, String)>,
}

/// Reads the status line and headers, up to the blank line.
fn read_head(url: &str, reader: &mut BufReader<TcpStream>) -> Result<Head, DataError> {
    let mut lines = Vec::new();
    let mut total = 0;
    loop {
        let mut line = String::new();
        let count = reader
            .by_ref()
            .take((MAX_HEAD_BYTES - total) as u64 + 1)
            .read_line(&mut line)
            .map_err(|error| download_error(url, format!("reading the response head: {error}")))?;
        total += count;
        if count == 0 || total > MAX_HEAD_BYTES {
            return Err(download_error(
                url,
                "the response head is cut short or too long",
            ));
        }
        let line = line.trim_end_matches(['\r', '\n']).to_string();
        if line.is_empty() {
            break;
        }
        lines.push(line);
    }
    let mut lines = lines.into_iter();
    let status_line = lines.next().unwrap_or_default();
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let status = parts.next().and_then(|code| code.parse::<u16>().ok());
    let (true, Some(status)) = (version.starts_with("HTTP/"), status) else {
        return Err(download_error(
            url,
            format!("not an HTTP response: {status_line:?}"),
        ));
    };
    let reason = parts.next().unwrap_or_default().to_string();
    let headers = lines
        .filter_map(|line| {
            let (key, value) = line.split_once(':')?;
            Some((key.trim().to_string(), value.trim().to_string()))
        })
        .collect();
    Ok(Head {
        status,
        reason,
        headers,
    })
}

/// `GET` over TLS with `ureq` (feature `https`).
#[cfg(feature = "https")]
fn get_https(url: &str, from: u64) -> Result<Response, DataError> {
    let agent = ureq::AgentBuilder::new()
        .timeout_connect(IO_TIMEOUT)
        .timeout_read(IO_TIMEOUT)
        .redirects(MAX_REDIRECTS as u32)
        .build();
    let mut request = agent.get(url).set("Accept-Encoding", "identity");
    if from > 0 {
        request = request.set("Range", &format!("bytes={from}-"));
    }
    let response = match request.call() {
        Ok(response) => response,
        // The partial file is already complete (or longer than the file): start afresh.
        Err(ureq::Error::Status(416, _)) if from > 0 => return get_https(url, 0),
        Err(ureq::Error::Status(status, response)) => {
            return Err(download_error(
                url,
                format!("server answered {status} {}", response.status_text()),
            ))
        }
        Err(error) => return Err(download_error(url, error.to_string())),
    };
    let body_len = response
        .header("Content-Length")
        .and_then(|value| value.trim().parse::<u64>().ok());
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
        reader: Box::new(response.into_reader()),
    })
}

/// Without the `https` feature, TLS addresses are refused with what to do instead.
#[cfg(not(feature = "https"))]
fn get_https(url: &str, _from: u64) -> Result<Response, DataError> {
    Err(download_error(
        url,
        format!(
            "https is not built into this client (build with the `https` feature); download {CIFAR10_ARCHIVE_NAME} by hand into the data folder, or give an http:// mirror"
        ),
    ))
}
