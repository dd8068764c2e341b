//! For tests only (feature `test-server`): a real S3-protocol server on loopback, `s3s-fs`,
//! which checks every request's signature; a proxy that breaks one upload mid-way; and one
//! that stands for an outage starting at a chosen request.
//!
//! `s3s-fs` is found through `TANDEM_S3S_FS` (its path) or on `PATH`; `.ci/run` installs
//! it. Where it is missing, [`S3Server::start`] returns `None` after printing why, unless
//! `CI` is set, where it panics: CI must run these tests.

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The access key id the server accepts.
pub const ACCESS_KEY: &str = "tandem-test-key";
/// The secret key the server accepts.
pub const SECRET_KEY: &str = "tandem-test-secret-0123456789";
/// Bound on the server's start.
const START_LIMIT: Duration = Duration::from_secs(20);

/// An `s3s-fs` server on a free loopback port, serving the folders of a temporary root as
/// buckets; stopped and removed when dropped.
pub struct S3Server {
    child: Option<Child>,
    program: PathBuf,
    root: tempfile::TempDir,
    port: u16,
}

impl S3Server {
    /// Starts the server, or returns `None` (printing why) where `s3s-fs` is missing and
    /// `CI` is unset.
    pub fn start() -> Option<S3Server> {
        let Some(program) = find_program() else {
            let reason = "s3s-fs not found (set TANDEM_S3S_FS or put it on PATH; \
                          `cargo install --locked s3s-fs@0.14.1 --features binary`)";
            if std::env::var_os("CI").is_some() {
                panic!("{reason}");
            }
            eprintln!("skipped: {reason}");
            return None;
        };
        let root = tempfile::tempdir().expect("a temporary folder for the buckets");
        std::fs::create_dir_all(root.path().join("data")).expect("the buckets' folder");
        let mut last_failure = String::new();
        // The free port is found by binding and releasing it; another process may take it
        // in between, so a start that fails is tried again on another port.
        for _ in 0..3 {
            let port = tandem_testdata::free_port();
            match spawn_server(&program, root.path(), port) {
                Ok(child) => {
                    return Some(S3Server {
                        child: Some(child),
                        program,
                        root,
                        port,
                    })
                }
                Err(failure) => last_failure = failure,
            }
        }
        panic!("s3s-fs did not start: {last_failure}");
    }

    /// Starts the stopped server again, on the same port with the same buckets (as a
    /// store back from an outage).
    pub fn restart(&mut self) {
        self.stop();
        let child = spawn_server(&self.program, self.root.path(), self.port)
            .unwrap_or_else(|failure| panic!("s3s-fs did not start again: {failure}"));
        self.child = Some(child);
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The server's port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Creates an empty bucket `name`; returns its folder.
    pub fn create_bucket(&self, name: &str) -> PathBuf {
        let folder = self.bucket_folder(name);
        std::fs::create_dir_all(&folder).expect("the bucket's folder");
        folder
    }

    /// The folder that holds bucket `name`'s objects, one file per key.
    pub fn bucket_folder(&self, name: &str) -> PathBuf {
        self.root.path().join("data").join(name)
    }

    /// The variables that point a client at this server with its credentials.
    pub fn variables(&self) -> Vec<(String, String)> {
        vec![
            ("AWS_ENDPOINT_URL".into(), self.endpoint()),
            ("AWS_ACCESS_KEY_ID".into(), ACCESS_KEY.into()),
            ("AWS_SECRET_ACCESS_KEY".into(), SECRET_KEY.into()),
            ("AWS_REGION".into(), "us-east-1".into()),
        ]
    }

    /// Stops the server (it can no longer be reached); the buckets stay until drop.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Which way of a connection [`CuttingProxy`] cuts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Bytes towards the server: a request body in flight (an upload).
    Requests,
    /// Bytes towards the client: a response body in flight (a download).
    Responses,
    /// No bytes: the request is answered `503 Slow Down` (S3's throttling) instead of being
    /// passed on (for requests without a body).
    Throttle,
}

/// A TCP proxy on loopback in front of a server that cuts the first connection carrying
/// more than `cut_after` bytes in the direction `cut`, once, after passing exactly
/// `cut_after` of them; every other connection is passed through whole.
pub struct CuttingProxy {
    port: u16,
    stopped: Arc<AtomicBool>,
    cutter: Arc<Cutter>,
}

/// The cut a proxy makes: once, or on every connection.
struct Cutter {
    after: u64,
    every_connection: bool,
    done: AtomicBool,
    cuts: AtomicU64,
}

impl Cutter {
    /// Whether a connection that has forwarded `forwarded` bytes and now has `count` more
    /// is to be cut.
    fn cuts_now(&self, forwarded: u64, count: usize) -> bool {
        forwarded + count as u64 > self.after && self.cuts_this_connection()
    }

    /// Whether this cutter still cuts (always, or the first time only).
    fn cuts_this_connection(&self) -> bool {
        self.every_connection
            || self
                .done
                .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
    }
}

impl CuttingProxy {
    /// Starts the proxy in front of `127.0.0.1:target_port`, cutting one connection.
    pub fn start(target_port: u16, cut: Cut, cut_after: u64) -> CuttingProxy {
        CuttingProxy::start_cutting(target_port, cut, cut_after, false)
    }

    /// Starts the proxy in front of `127.0.0.1:target_port`, cutting every connection that
    /// carries more than `cut_after` bytes the `cut` way.
    pub fn start_cutting_all(target_port: u16, cut: Cut, cut_after: u64) -> CuttingProxy {
        CuttingProxy::start_cutting(target_port, cut, cut_after, true)
    }

    fn start_cutting(
        target_port: u16,
        cut: Cut,
        cut_after: u64,
        every_connection: bool,
    ) -> CuttingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a loopback port for the proxy");
        listener
            .set_nonblocking(true)
            .expect("a non-blocking listener");
        let port = listener.local_addr().expect("the proxy's address").port();
        let stopped = Arc::new(AtomicBool::new(false));
        let cutter = Arc::new(Cutter {
            after: cut_after,
            every_connection,
            done: AtomicBool::new(false),
            cuts: AtomicU64::new(0),
        });
        {
            let stopped = Arc::clone(&stopped);
            let cutter = Arc::clone(&cutter);
            std::thread::spawn(move || {
                while !stopped.load(Ordering::Relaxed) {
                    match listener.accept() {
                        Ok((client, _)) => {
                            let cutter = Arc::clone(&cutter);
                            std::thread::spawn(move || relay(client, target_port, cut, cutter));
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(5)),
                    }
                }
            });
        }
        CuttingProxy {
            port,
            stopped,
            cutter,
        }
    }

    /// `http://127.0.0.1:PORT` of the proxy.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// How many connections the proxy has cut.
    pub fn cuts(&self) -> u64 {
        self.cutter.cuts.load(Ordering::SeqCst)
    }
}

impl Drop for CuttingProxy {
    fn drop(&mut self) {
        self.stopped.store(true, Ordering::Relaxed);
    }
}

/// A proxy on loopback in front of a server that goes dark, as a store in an outage does,
/// at the first request whose request line starts with `trigger` (say `PUT /runs/f/`): that
/// request never reaches the server, every open connection is dropped and new ones are
/// refused, until [`OutageProxy::restore`].
pub struct OutageProxy {
    port: u16,
    outage: Arc<Outage>,
}

/// The state an outage proxy's threads share.
struct Outage {
    trigger: Vec<u8>,
    /// The trigger has passed: there is no second outage.
    spent: AtomicBool,
    dark: AtomicBool,
    stopped: AtomicBool,
}

impl Outage {
    /// Starts the outage when `recent` (what passed towards the server lately) holds the
    /// trigger, unless it is spent.
    fn begin_if_triggered(&self, recent: &[u8]) {
        if recent
            .windows(self.trigger.len())
            .any(|window| window == self.trigger.as_slice())
            && !self.spent.swap(true, Ordering::SeqCst)
        {
            self.dark.store(true, Ordering::SeqCst);
        }
    }
}

/// A listener on loopback port `port` (0: any) that does not block on accept.
fn nonblocking_listener(port: u16) -> std::io::Result<TcpListener> {
    let listener = TcpListener::bind(("127.0.0.1", port))?;
    listener.set_nonblocking(true)?;
    Ok(listener)
}

impl OutageProxy {
    /// Starts the proxy in front of `127.0.0.1:target_port`.
    pub fn start(target_port: u16, trigger: &str) -> OutageProxy {
        let listener = nonblocking_listener(0).expect("a loopback port for the proxy");
        let port = listener.local_addr().expect("the proxy's address").port();
        let outage = Arc::new(Outage {
            trigger: trigger.as_bytes().to_vec(),
            spent: AtomicBool::new(false),
            dark: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
        });
        {
            let outage = Arc::clone(&outage);
            std::thread::spawn(move || serve_until_stopped(listener, port, target_port, &outage));
        }
        OutageProxy { port, outage }
    }

    /// `http://127.0.0.1:PORT` of the proxy.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Whether the outage has begun (and not been restored).
    pub fn is_dark(&self) -> bool {
        self.outage.dark.load(Ordering::SeqCst)
    }

    /// Ends the outage: connections are accepted and passed on again, and the trigger is
    /// spent.
    pub fn restore(&self) {
        self.outage.dark.store(false, Ordering::SeqCst);
    }
}

impl Drop for OutageProxy {
    fn drop(&mut self) {
        self.outage.stopped.store(true, Ordering::SeqCst);
    }
}

/// Accepts connections on `listener` (port `port`) and passes them on to `target_port`; in
/// an outage the port is closed, and bound again once it ends.
fn serve_until_stopped(listener: TcpListener, port: u16, target_port: u16, outage: &Arc<Outage>) {
    let mut listener = Some(listener);
    while !outage.stopped.load(Ordering::SeqCst) {
        let dark = outage.dark.load(Ordering::SeqCst);
        match (&listener, dark) {
            (Some(_), true) => listener = None,
            (None, false) => listener = nonblocking_listener(port).ok(),
            _ => {}
        }
        let accepted = listener.as_ref().map(TcpListener::accept);
        match accepted {
            Some(Ok((client, _))) => {
                let _ = client.set_nonblocking(false);
                let outage = Arc::clone(outage);
                std::thread::spawn(move || relay_until_dark(client, target_port, &outage));
            }
            _ => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Passes one connection through both ways until either side closes or the outage begins.
fn relay_until_dark(client: TcpStream, target_port: u16, outage: &Arc<Outage>) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)) else {
        return;
    };
    let (Ok(client_back), Ok(server_back)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let backward = {
        let outage = Arc::clone(outage);
        std::thread::spawn(move || pump_until_dark(server_back, client_back, &outage, false))
    };
    pump_until_dark(client, server, outage, true);
    let _ = backward.join();
}

/// Copies `from` to `to` until either side closes or the outage begins; `watch` looks for
/// the trigger in what passes (across the reads' boundaries) and starts the outage there,
/// before passing it on.
fn pump_until_dark(mut from: TcpStream, mut to: TcpStream, outage: &Outage, watch: bool) {
    let mut buffer = [0u8; 16 * 1024];
    let mut recent: Vec<u8> = Vec::new();
    loop {
        let count = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(count) => count,
        };
        if watch && !outage.spent.load(Ordering::SeqCst) {
            recent.extend_from_slice(&buffer[..count]);
            outage.begin_if_triggered(&recent);
            let keep = recent.len().min(outage.trigger.len());
            recent.drain(..recent.len() - keep);
        }
        if outage.dark.load(Ordering::SeqCst) || to.write_all(&buffer[..count]).is_err() {
            break;
        }
    }
    let _ = from.shutdown(Shutdown::Both);
    let _ = to.shutdown(Shutdown::Both);
}

/// Passes one connection through both ways, the `cut` way through the cutter.
fn relay(client: TcpStream, target_port: u16, cut: Cut, cutter: Arc<Cutter>) {
    let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)) else {
        return;
    };
    let (Ok(client_back), Ok(server_back)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let (up, down) = match cut {
        Cut::Requests => (Some(cutter), None),
        Cut::Responses => (None, Some(cutter)),
        Cut::Throttle => {
            if cutter.cuts_this_connection() {
                cutter.cuts.fetch_add(1, Ordering::SeqCst);
                throttle(client);
                return;
            }
            (None, None)
        }
    };
    let backward = std::thread::spawn(move || pump(server_back, client_back, down));
    pump(client, server, up);
    let _ = backward.join();
}

/// Reads a request's head and answers it as S3 does when it throttles.
fn throttle(mut client: TcpStream) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && head.len() < 64 * 1024 {
        match client.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => return,
        }
    }
    let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code>\
                <Message>Please reduce your request rate.</Message></Error>";
    let _ = write!(
        client,
        "HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = client.shutdown(Shutdown::Both);
}

/// Copies `from` to `to` until either side closes; with a cutter that has not cut yet, the
/// byte past its limit closes both sides instead.
fn pump(mut from: TcpStream, mut to: TcpStream, cutter: Option<Arc<Cutter>>) {
    let mut forwarded = 0u64;
    let mut buffer = [0u8; 16 * 1024];
    loop {
        let count = match from.read(&mut buffer) {
            Ok(0) | Err(_) => break,
            Ok(count) => count,
        };
        if let Some(cutter) = cutter
            .as_ref()
            .filter(|cutter| cutter.cuts_now(forwarded, count))
        {
            cutter.cuts.fetch_add(1, Ordering::SeqCst);
            let kept = (cutter.after - forwarded) as usize;
            let _ = to.write_all(&buffer[..kept]);
            let _ = from.shutdown(Shutdown::Both);
            let _ = to.shutdown(Shutdown::Both);
            return;
        }
        if to.write_all(&buffer[..count]).is_err() {
            break;
        }
        forwarded += count as u64;
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Starts `program` on `port` serving the folder `root/data`, and waits until it listens;
/// the failure, with the server's log, when it does not.
fn spawn_server(program: &Path, root: &Path, port: u16) -> Result<Child, String> {
    let log = root.join(format!("s3s-fs-{port}.log"));
    let mut child = Command::new(program)
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--access-key", ACCESS_KEY, "--secret-key", SECRET_KEY])
        .arg(root.join("data"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("the server's log file"))
        .spawn()
        .unwrap_or_else(|error| panic!("cannot start {}: {error}", program.display()));
    match wait_ready(&mut child, port) {
        Ok(()) => Ok(child),
        Err(failure) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!(
                "{failure}; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            ))
        }
    }
}

/// Waits until `port` accepts connections, or the server exits, within [`START_LIMIT`].
fn wait_ready(child: &mut Child, port: u16) -> Result<(), String> {
    let deadline = Instant::now() + START_LIMIT;
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return Err(format!("s3s-fs exited with {status}"));
        }
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Err(format!("s3s-fs did not listen within {START_LIMIT:?}"))
}

/// `s3s-fs`, from `TANDEM_S3S_FS` or `PATH`.
fn find_program() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("TANDEM_S3S_FS") {
        return Some(PathBuf::from(path)).filter(|path| path.is_file());
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|folder| folder.join("s3s-fs"))
            .find(|candidate| candidate.is_file())
    })
}
