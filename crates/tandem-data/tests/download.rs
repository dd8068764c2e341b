//! Downloads against a local HTTP server started by each test (no internet here): whole,
//! cut short and resumed, resumed by a server that ignores `Range`, corrupted, redirected,
//! chunked, too long, silent, and a host nobody listens on.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use md5::{Digest, Md5};
use tandem_data::{
    download_cifar10, download_file, download_file_bounded, DataError, DownloadLimits,
    CIFAR10_ARCHIVE_NAME, CIFAR10_MD5,
};

/// What the server does with one connection.
#[derive(Clone, Copy)]
enum Reply {
    /// Honour `Range` with 206, else 200 with the whole body.
    Serve,
    /// Announce the whole remaining length but close after `n` body bytes.
    CutAfter(usize),
    /// Always 200 with the whole body, whatever `Range` says.
    IgnoreRange,
    /// 200 with one byte of the body flipped.
    Corrupt,
    /// 302 to `/file`.
    Redirect,
    /// 302 without a `Location`.
    RedirectNowhere,
    /// 404.
    Missing,
    /// 200 with the whole body and no `Content-Length`: the body ends when the connection closes.
    Unannounced,
    /// 200 with the whole body in `Transfer-Encoding: chunked`.
    Chunked,
    /// Announce the whole body, send `n` bytes of it, then fall silent until the client hangs up.
    StallAfter(usize),
}

/// Serves `body` to one connection per reply; returns the address and the request heads.
fn serve(body: Vec<u8>, replies: Vec<Reply>) -> (String, JoinHandle<Vec<String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/file", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let mut heads = Vec::new();
        for reply in replies {
            let (stream, _) = listener.accept().unwrap();
            heads.push(answer(stream, &body, reply));
        }
        heads
    });
    (url, handle)
}

fn answer(mut stream: TcpStream, body: &[u8], reply: Reply) -> String {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut head = String::new();
    loop {
        let mut line = String::new();
        reader.read_line(&mut line).unwrap();
        if line == "\r\n" || line.is_empty() {
            break;
        }
        head.push_str(&line);
    }
    let range_start = head
        .lines()
        .find_map(|line| line.strip_prefix("Range: bytes="))
        .and_then(|range| range.trim_end_matches('-').parse::<usize>().ok());
    let response = match (reply, range_start) {
        (Reply::Serve | Reply::CutAfter(_), Some(start)) => {
            let rest = &body[start..];
            let mut out = format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {start}-{}/{}\r\n\r\n",
                rest.len(),
                body.len() - 1,
                body.len()
            )
            .into_bytes();
            out.extend_from_slice(rest);
            cut(out, reply, rest.len())
        }
        (Reply::Serve | Reply::CutAfter(_) | Reply::IgnoreRange | Reply::StallAfter(_), _) => {
            let mut out =
                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
            out.extend_from_slice(body);
            cut(out, reply, body.len())
        }
        (Reply::Corrupt, _) => {
            let mut out =
                format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n", body.len()).into_bytes();
            let flipped = out.len() + body.len() / 2;
            out.extend_from_slice(body);
            out[flipped] ^= 0xff;
            out
        }
        (Reply::Redirect, _) => {
            b"HTTP/1.1 302 Found\r\nLocation: /file\r\nContent-Length: 0\r\n\r\n".to_vec()
        }
        (Reply::RedirectNowhere, _) => b"HTTP/1.1 302 Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
        (Reply::Missing, _) => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".to_vec(),
        (Reply::Unannounced, _) => {
            let mut out = b"HTTP/1.1 200 OK\r\n\r\n".to_vec();
            out.extend_from_slice(body);
            out
        }
        (Reply::Chunked, _) => {
            let mut out = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n".to_vec();
            for piece in body.chunks(70_000) {
                out.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
                out.extend_from_slice(piece);
                out.extend_from_slice(b"\r\n");
            }
            out.extend_from_slice(b"0\r\n\r\n");
            out
        }
    };
    let _ = stream.write_all(&response);
    if let Reply::StallAfter(_) = reply {
        // Silent, but bounded: returns once the client closes the connection or after 20 s.
        let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
        let _ = std::io::Read::read(&mut stream, &mut [0u8; 1]);
    }
    head
}

/// Drops the end of a response so only `n` body bytes are sent.
fn cut(mut out: Vec<u8>, reply: Reply, body_len: usize) -> Vec<u8> {
    if let Reply::CutAfter(n) | Reply::StallAfter(n) = reply {
        out.truncate(out.len() - body_len + n);
    }
    out
}

fn body() -> Vec<u8> {
    (0..300_000u32)
        .map(|index| (index * 7 + index / 1000) as u8)
        .collect()
}

fn md5_hex(bytes: &[u8]) -> String {
    Md5::digest(bytes)
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

fn no_progress() -> impl FnMut(u64, Option<u64>) {
    |_, _| {}
}

/// A test's body and where it downloads it to, in a folder of its own.
struct Fixture {
    body: Vec<u8>,
    dir: tempfile::TempDir,
    destination: PathBuf,
}

impl Fixture {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let destination = dir.path().join("archive.tar.gz");
        Self {
            body: body(),
            dir,
            destination,
        }
    }

    /// Serves the body to one connection per reply.
    fn serve(&self, replies: Vec<Reply>) -> (String, JoinHandle<Vec<String>>) {
        serve(self.body.clone(), replies)
    }

    /// Downloads `url` to the destination, expecting the body's md5.
    fn fetch(&self, url: &str) -> Result<(), DataError> {
        download_file(
            url,
            &self.destination,
            &md5_hex(&self.body),
            &mut no_progress(),
        )
    }

    /// Downloads `url` to the destination within `limits`, expecting the body's md5.
    fn fetch_bounded(&self, url: &str, limits: DownloadLimits) -> Result<(), DataError> {
        let md5 = md5_hex(&self.body);
        download_file_bounded(url, &self.destination, &md5, limits, &mut no_progress())
    }

    /// Asserts the whole body under the final name.
    fn assert_downloaded(&self) {
        assert_eq!(std::fs::read(&self.destination).unwrap(), self.body);
    }

    /// Asserts neither the file nor its partial file there.
    fn assert_nothing_left(&self) {
        assert!(!self.destination.exists() && !partial(&self.destination).exists());
    }

    /// Asserts nothing under the final name and the first `len` bytes in the partial file.
    fn assert_part_kept(&self, len: usize) {
        assert!(!self.destination.exists(), "nothing under the final name");
        assert_eq!(
            std::fs::read(partial(&self.destination)).unwrap(),
            self.body[..len]
        );
    }
}

/// Limits that give up on a server silent for 300 ms.
fn stall_after_300ms() -> DownloadLimits {
    DownloadLimits {
        stall_timeout: Duration::from_millis(300),
        ..DownloadLimits::up_to(1 << 20)
    }
}

/// `<destination>.part`, where an unfinished download lives.
fn partial(destination: &Path) -> std::path::PathBuf {
    let mut name = destination.file_name().unwrap().to_os_string();
    name.push(".part");
    destination.with_file_name(name)
}

#[test]
fn whole_download_lands_under_its_final_name() {
    let body = body();
    let (url, server) = serve(body.clone(), vec![Reply::Serve]);
    let dir = tempfile::tempdir().unwrap();
    let destination = dir.path().join("archive.tar.gz");
    let mut last = (0, None);
    download_file(&url, &destination, &md5_hex(&body), &mut |done, total| {
        last = (done, total)
    })
    .unwrap();
    assert_eq!(std::fs::read(&destination).unwrap(), body);
    assert!(!partial(&destination).exists());
    assert_eq!(last, (body.len() as u64, Some(body.len() as u64)));
    let heads = server.join().unwrap();
    assert!(!heads[0].contains("Range:"), "{}", heads[0]);

    // Already there with the right md5: nothing is fetched (no server is listening now).
    download_file(&url, &destination, &md5_hex(&body), &mut no_progress()).unwrap();
}

#[test]
fn cut_short_download_keeps_its_part_and_resumes_with_range() {
    let fixture = Fixture::new();
    let (url, server) = fixture.serve(vec![Reply::CutAfter(100_000), Reply::Serve]);
    let error = fixture.fetch(&url).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!(
            "download of {url}: truncated: the connection closed after 100000 of 300000 bytes; the partial file {} is kept, run again to resume",
            partial(&fixture.destination).display()
        )
    );
    fixture.assert_part_kept(100_000);

    fixture.fetch(&url).unwrap();
    fixture.assert_downloaded();
    let heads = server.join().unwrap();
    assert!(heads[1].contains("Range: bytes=100000-"), "{}", heads[1]);
}

#[test]
fn server_ignoring_range_restarts_the_file() {
    let fixture = Fixture::new();
    let (url, server) = fixture.serve(vec![Reply::IgnoreRange]);
    std::fs::write(partial(&fixture.destination), &fixture.body[..5000]).unwrap();
    fixture.fetch(&url).unwrap();
    fixture.assert_downloaded();
    assert!(server.join().unwrap()[0].contains("Range: bytes=5000-"));
}

#[test]
fn corrupted_download_is_refused_and_removed() {
    let fixture = Fixture::new();
    let (url, server) = fixture.serve(vec![Reply::Corrupt]);
    let error = fixture.fetch(&url).unwrap_err();
    let mut corrupted = fixture.body.clone();
    corrupted[fixture.body.len() / 2] ^= 0xff;
    assert_eq!(
        error.to_string(),
        format!(
            "{}: md5 is {}, expected {} (the partial file was removed; run again to download afresh)",
            fixture.destination.display(),
            md5_hex(&corrupted),
            md5_hex(&fixture.body)
        )
    );
    fixture.assert_nothing_left();
    server.join().unwrap();
}

#[test]
fn redirects_are_followed_and_http_errors_reported() {
    let fixture = Fixture::new();
    let (url, server) = fixture.serve(vec![
        Reply::Redirect,
        Reply::Serve,
        Reply::Missing,
        Reply::RedirectNowhere,
    ]);
    fixture.fetch(&url).unwrap();
    fixture.assert_downloaded();
    let body = &fixture.body;
    let other = fixture.dir.path().join("other.tar.gz");
    let error = download_file(&url, &other, &md5_hex(body), &mut no_progress()).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("download of {url}: server answered 404 Not Found")
    );
    let error = download_file(&url, &other, &md5_hex(body), &mut no_progress()).unwrap_err();
    assert_eq!(
        error.to_string(),
        format!("download of {url}: server answered 302 Found instead of the file")
    );
    assert!(!other.exists() && !partial(&other).exists());
    server.join().unwrap();
}

#[test]
fn a_redirect_loop_gives_up() {
    // Every request is sent back to the same absolute address, until the client stops asking.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/file", listener.local_addr().unwrap());
    let redirect =
        format!("HTTP/1.1 301 Moved Permanently\r\nLocation: {url}\r\nContent-Length: 0\r\n\r\n");
    listener.set_nonblocking(true).unwrap();
    let (done, wait_for_done) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let mut requests = 0;
        let deadline = Instant::now() + Duration::from_secs(20);
        while wait_for_done.try_recv().is_err() && Instant::now() < deadline {
            match listener.accept() {
                Ok((mut stream, _)) => {
                    stream.set_nonblocking(false).unwrap();
                    let mut head = String::new();
                    let mut reader = BufReader::new(stream.try_clone().unwrap());
                    while reader.read_line(&mut head).unwrap_or(0) > 2 {}
                    let _ = stream.write_all(redirect.as_bytes());
                    requests += 1;
                }
                Err(_) => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        requests
    });
    let fixture = Fixture::new();
    let error = download_file(&url, &fixture.destination, "00", &mut no_progress()).unwrap_err();
    done.send(()).unwrap();
    let requests = server.join().unwrap();
    assert_eq!(
        error.to_string(),
        format!("download of {url}: more than 5 redirects")
    );
    assert_eq!(requests, 6, "the first request and 5 redirects followed");
    fixture.assert_nothing_left();
}

#[test]
fn cifar10_download_checks_the_official_md5() {
    let (url, server) = serve(body(), vec![Reply::Serve]);
    let dir = tempfile::tempdir().unwrap();
    let error = download_cifar10(&dir.path().join("data"), &url, &mut no_progress()).unwrap_err();
    let DataError::Checksum { path, expected, .. } = &error else {
        panic!("{error}")
    };
    assert_eq!(expected, CIFAR10_MD5);
    assert_eq!(path, &dir.path().join("data").join(CIFAR10_ARCHIVE_NAME));
    server.join().unwrap();
}

#[test]
fn chunked_body_is_read_whole() {
    let fixture = Fixture::new();
    let (url, server) = fixture.serve(vec![Reply::Chunked]);
    fixture.fetch(&url).unwrap();
    fixture.assert_downloaded();
    assert!(!partial(&fixture.destination).exists());
    server.join().unwrap();
}

#[test]
fn a_silent_server_times_out_and_leaves_nothing() {
    // Accepts, reads nothing, answers nothing, until the test is done with it.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/file", listener.local_addr().unwrap());
    let (done, wait_for_done) = mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        let _ = wait_for_done.recv_timeout(Duration::from_secs(20));
        drop(stream);
    });
    let fixture = Fixture::new();
    let started = Instant::now();
    let error = download_file_bounded(
        &url,
        &fixture.destination,
        "00",
        stall_after_300ms(),
        &mut no_progress(),
    )
    .unwrap_err();
    let waited = started.elapsed();
    done.send(()).unwrap();
    server.join().unwrap();
    let message = error.to_string();
    assert_eq!(
        message,
        format!("download of {url}: timed out: the server sent nothing for 300ms")
    );
    // Bounded by the stall timeout, not by the 20 s the server would have held on.
    assert!(waited < Duration::from_secs(10), "{waited:?}");
    fixture.assert_nothing_left();
}

#[test]
fn a_body_that_stalls_times_out_and_keeps_its_part() {
    let fixture = Fixture::new();
    let (url, server) = fixture.serve(vec![Reply::StallAfter(100_000)]);
    let error = fixture
        .fetch_bounded(&url, stall_after_300ms())
        .unwrap_err();
    server.join().unwrap();
    assert_eq!(
        error.to_string(),
        format!(
            "download of {url}: timed out: the server sent nothing for 300ms after 100000 bytes; the partial file {} is kept, run again to resume",
            partial(&fixture.destination).display()
        )
    );
    fixture.assert_part_kept(100_000);
}

#[test]
fn an_unreachable_host_is_named_in_the_error() {
    // A port that was free a moment ago: nothing listens there.
    let url = format!("http://127.0.0.1:{}/file", tandem_testdata::free_port());
    let fixture = Fixture::new();
    let error = download_file(&url, &fixture.destination, "00", &mut no_progress()).unwrap_err();
    let message = error.to_string();
    assert!(
        message.starts_with(&format!("download of {url}: cannot connect: ")),
        "{message}"
    );
    fixture.assert_nothing_left();
}

#[test]
fn ensure_downloaded_keeps_data_already_there_and_fetches_otherwise() {
    // A batches folder is enough: no connection is attempted (nothing listens on port 9).
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("cifar-10-batches-bin")).unwrap();
    let kept = tandem_data::ensure_cifar10_downloaded(dir.path(), "http://127.0.0.1:9/x").unwrap();
    assert_eq!(kept, dir.path());

    let empty = tempfile::tempdir().unwrap();
    let (url, server) = serve(body(), vec![Reply::Serve]);
    let error = tandem_data::ensure_cifar10_downloaded(empty.path(), &url).unwrap_err();
    assert!(matches!(error, DataError::Checksum { .. }), "{error}");
    server.join().unwrap();
}

#[test]
fn a_file_longer_than_its_bound_is_refused_and_not_kept() {
    let fixture = Fixture::new();
    let len = fixture.body.len();
    let bound = len as u64 - 1;
    let past_the_bound = |replies| {
        let (url, server) = fixture.serve(replies);
        let error = fixture
            .fetch_bounded(&url, DownloadLimits::up_to(bound))
            .unwrap_err();
        server.join().unwrap();
        (url, error.to_string())
    };

    // Announced by Content-Length: refused before the body is read.
    let (url, message) = past_the_bound(vec![Reply::Serve]);
    assert_eq!(
        message,
        format!(
            "download of {url}: the server announces {len} bytes, more than the {bound} this file can have"
        )
    );
    fixture.assert_nothing_left();

    // Resumed from a partial file: the announced rest plus what is there is too long.
    std::fs::write(partial(&fixture.destination), &fixture.body[..1000]).unwrap();
    let (_, message) = past_the_bound(vec![Reply::Serve]);
    assert!(message.contains("more than the"), "{message}");
    fixture.assert_nothing_left();

    // Not announced: cut off once it runs past the bound, and the partial file removed.
    let (url, message) = past_the_bound(vec![Reply::Unannounced]);
    assert_eq!(
        message,
        format!("download of {url}: the body runs past {bound} bytes, more than this file can have; the partial file was removed")
    );
    fixture.assert_nothing_left();
}
