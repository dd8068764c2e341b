//! Transfers against a real S3-protocol server on loopback (`s3s-fs`, which checks request
//! signatures): round trips of small and multipart objects, listing and deletion, each
//! failure as its named error, and an upload whose connection is cut mid-way.

use std::time::Duration;

use tandem_remote::test_server::{Cut, CuttingProxy, S3Server, ACCESS_KEY, SECRET_KEY};
use tandem_remote::{Connection, ConnectionOptions, ObjectUrl, RemoteError, RemoteStore};

fn url(text: &str) -> ObjectUrl {
    ObjectUrl::parse(text)
        .expect("valid")
        .expect("an object URL")
}

/// A client of `endpoint` with the given key pair, retrying for `retry` at most.
fn client(endpoint: &str, access_key: &str, secret_key: &str, retry: Duration) -> RemoteStore {
    let variables = [
        ("AWS_ENDPOINT_URL", endpoint.to_string()),
        ("AWS_ACCESS_KEY_ID", access_key.to_string()),
        ("AWS_SECRET_ACCESS_KEY", secret_key.to_string()),
    ];
    let options = ConnectionOptions {
        retry_timeout: Some(retry),
        ..ConnectionOptions::default()
    };
    let connection = Connection::resolve(&options, |name| {
        variables
            .iter()
            .find(|(key, _)| *key == name)
            .map(|(_, value)| value.clone())
    })
    .expect("a connection");
    RemoteStore::new(connection).expect("a client")
}

fn good_client(server: &S3Server) -> RemoteStore {
    client(
        &server.endpoint(),
        ACCESS_KEY,
        SECRET_KEY,
        Duration::from_secs(5),
    )
}

/// A client that reaches the server through `proxy`, retrying for `retry` at most.
fn proxied_client(proxy: &CuttingProxy, retry: Duration) -> RemoteStore {
    client(&proxy.endpoint(), ACCESS_KEY, SECRET_KEY, retry)
}

/// A server whose bucket `data` holds the object `name` of `len` pattern bytes.
fn server_with_object(name: &str, len: usize) -> Option<S3Server> {
    let server = S3Server::start()?;
    let bucket = server.create_bucket("data");
    std::fs::write(bucket.join(name), pattern(len)).expect("the object");
    Some(server)
}

/// How many entries `folder` holds.
fn entries_in(folder: &std::path::Path) -> usize {
    std::fs::read_dir(folder).expect("list").count()
}

/// Bytes that differ at every position, so a misplaced part cannot go unnoticed.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|index| (index * 31 % 251) as u8).collect()
}

#[test]
fn a_link_planted_at_a_downloads_temporary_name_is_not_written_through() {
    let Some(server) = server_with_object("data.bin", 1000) else {
        return;
    };
    let store = good_client(&server);
    let folder = tempfile::tempdir().expect("a temporary folder");
    let victim = folder.path().join("victim.txt");
    std::fs::write(&victim, b"keep me").expect("the victim");
    let local = folder.path().join("data.bin");
    let planted = folder
        .path()
        .join(format!("data.bin.{}.tmp", std::process::id()));
    std::os::unix::fs::symlink(&victim, &planted).expect("the link");
    let error = store
        .download(&url("s3://data/data.bin"), &local)
        .expect_err("a taken temporary name");
    assert!(error.to_string().contains("exists"), "{error}");
    assert_eq!(std::fs::read(&victim).expect("the victim"), b"keep me");
    assert!(!local.exists());
    // The refused name was cleared: the next download lands whole.
    assert_eq!(
        store
            .download(&url("s3://data/data.bin"), &local)
            .expect("download"),
        1000
    );
    assert_eq!(std::fs::read(&local).expect("the copy"), pattern(1000));
    assert_eq!(std::fs::read(&victim).expect("the victim"), b"keep me");
}

#[test]
fn files_round_trip_whole_single_and_multipart() {
    let Some(server) = S3Server::start() else {
        return;
    };
    server.create_bucket("runs");
    let store = good_client(&server);
    let folder = tempfile::tempdir().expect("a temporary folder");
    for (name, len) in [
        ("small.bin", 1000),
        ("large.bin", tandem_remote::PART_BYTES * 2 + 12345),
    ] {
        let local = folder.path().join(name);
        std::fs::write(&local, pattern(len)).expect("the local file");
        let object = url(&format!("s3://runs/job-1/{name}"));
        assert_eq!(store.upload(&local, &object).expect("upload"), len as u64);
        let back = folder.path().join(format!("back-{name}"));
        assert_eq!(
            store.download(&object, &back).expect("download"),
            len as u64
        );
        assert_eq!(std::fs::read(&back).expect("the copy"), pattern(len));
    }
    let listed = store.list(&url("s3://runs/job-1")).expect("list");
    let names: Vec<(String, u64)> = listed
        .iter()
        .map(|object| (object.url.to_string(), object.size))
        .collect();
    assert_eq!(
        names,
        vec![
            (
                "s3://runs/job-1/large.bin".to_string(),
                (tandem_remote::PART_BYTES * 2 + 12345) as u64
            ),
            ("s3://runs/job-1/small.bin".to_string(), 1000),
        ]
    );
    store
        .delete(&url("s3://runs/job-1/small.bin"))
        .expect("delete");
    store
        .delete(&url("s3://runs/job-1/small.bin"))
        .expect("deleting twice is fine");
    assert_eq!(
        store.head(&url("s3://runs/job-1/small.bin")).expect("head"),
        None
    );
    assert_eq!(store.list(&url("s3://runs/job-1")).expect("list").len(), 1);
}

#[test]
fn each_failure_is_its_named_error() {
    let Some(mut server) = S3Server::start() else {
        return;
    };
    server.create_bucket("data");
    let folder = tempfile::tempdir().expect("a temporary folder");
    let target = folder.path().join("copy.bin");
    let store = good_client(&server);

    let missing_key = store.download(&url("s3://data/nothing-here.bin"), &target);
    assert!(
        matches!(missing_key, Err(RemoteError::NoSuchKey { ref url }) if url == "s3://data/nothing-here.bin"),
        "{missing_key:?}"
    );
    let missing_bucket = store.download(&url("s3://no-such-bucket/x.bin"), &target);
    let message = missing_bucket.expect_err("no bucket").to_string();
    assert_eq!(
        message,
        "s3://no-such-bucket/x.bin: no such bucket 'no-such-bucket'"
    );

    let impostor = client(
        &server.endpoint(),
        ACCESS_KEY,
        "not-the-secret",
        Duration::from_secs(2),
    );
    let denied = impostor.list(&url("s3://data")).expect_err("denied");
    assert!(
        matches!(denied, RemoteError::AccessDenied { .. }),
        "{denied:?}"
    );
    let message = denied.to_string();
    assert!(
        message.starts_with("s3://data: access denied ("),
        "{message}"
    );
    assert!(!message.contains("not-the-secret"), "{message}");

    let endpoint = server.endpoint();
    server.stop();
    let stopped = store
        .head(&url("s3://data/x.bin"))
        .expect_err("unreachable");
    let message = stopped.to_string();
    assert!(
        matches!(stopped, RemoteError::Unreachable { .. }),
        "{message}"
    );
    assert!(
        message.starts_with(&format!(
            "s3://data/x.bin: endpoint {endpoint} unreachable ("
        )),
        "{message}"
    );
    assert!(!target.exists(), "no file is left by failed downloads");
    assert_eq!(entries_in(folder.path()), 0, "nor a temporary");
}

#[test]
fn an_upload_cut_mid_way_is_retried_and_leaves_no_partial_object() {
    let Some(server) = S3Server::start() else {
        return;
    };
    let bucket = server.create_bucket("runs");
    let folder = tempfile::tempdir().expect("a temporary folder");
    for (name, len) in [
        ("single.bin", 3_000_000),
        ("multi.bin", tandem_remote::PART_BYTES + 777),
    ] {
        let proxy = CuttingProxy::start(server.port(), Cut::Requests, 1_000_000);
        let store = proxied_client(&proxy, Duration::from_secs(10));
        let local = folder.path().join(name);
        std::fs::write(&local, pattern(len)).expect("the local file");
        let object = url(&format!("s3://runs/{name}"));
        store
            .upload(&local, &object)
            .expect("the retried upload succeeds");
        assert_eq!(proxy.cuts(), 1, "the proxy cut one connection mid-upload");
        assert_eq!(
            std::fs::read(bucket.join(name)).expect("the stored object"),
            pattern(len),
            "the object is whole"
        );
    }
    let names: Vec<String> = std::fs::read_dir(&bucket)
        .expect("the bucket's folder")
        .map(|entry| {
            entry
                .expect("an entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter(|name| !name.starts_with('.'))
        .collect();
    let mut names = names;
    names.sort();
    assert_eq!(
        names,
        ["multi.bin", "single.bin"],
        "nothing else in the bucket"
    );
}

#[test]
fn a_download_cut_mid_way_is_retried_and_lands_whole() {
    let len = tandem_remote::PART_BYTES + 4321;
    let Some(server) = server_with_object("batch.bin", len) else {
        return;
    };
    let proxy = CuttingProxy::start(server.port(), Cut::Responses, 3_000_000);
    let store = proxied_client(&proxy, Duration::from_secs(10));
    let folder = tempfile::tempdir().expect("a temporary folder");
    let local = folder.path().join("batch.bin");
    let outcome = store.download(&url("s3://data/batch.bin"), &local);
    assert_eq!(proxy.cuts(), 1, "the proxy cut a response mid-way");
    match outcome {
        Ok(size) => {
            assert_eq!(size, len as u64);
            assert!(
                std::fs::read(&local).expect("the copy") == pattern(len),
                "the copy is whole"
            );
        }
        Err(error) => panic!("the cut download was not retried: {error}"),
    }
    assert_eq!(entries_in(folder.path()), 1, "no temporary left");
}

#[test]
fn a_download_that_keeps_breaking_off_is_a_truncated_download() {
    let len = 2 * tandem_remote::PART_BYTES;
    let Some(server) = server_with_object("batch.bin", len) else {
        return;
    };
    let proxy = CuttingProxy::start_cutting_all(server.port(), Cut::Responses, 2_000);
    let store = proxied_client(&proxy, Duration::from_secs(1));
    let folder = tempfile::tempdir().expect("a temporary folder");
    let error = store
        .download(
            &url("s3://data/batch.bin"),
            &folder.path().join("batch.bin"),
        )
        .expect_err("every response breaks off");
    assert_eq!(
        error.to_string(),
        format!("s3://data/batch.bin: truncated download: 0 of {len} bytes arrived")
    );
    assert!(proxy.cuts() >= 2, "the cut range was asked for again");
    assert_eq!(entries_in(folder.path()), 0, "nothing left");
}

#[test]
fn a_throttled_request_is_retried() {
    let Some(server) = server_with_object("small.bin", 5000) else {
        return;
    };
    let proxy = CuttingProxy::start(server.port(), Cut::Throttle, 0);
    let store = proxied_client(&proxy, Duration::from_secs(10));
    let folder = tempfile::tempdir().expect("a temporary folder");
    let local = folder.path().join("small.bin");
    assert_eq!(
        store
            .download(&url("s3://data/small.bin"), &local)
            .expect("retried"),
        5000
    );
    assert_eq!(
        proxy.cuts(),
        1,
        "the first request was answered 503 Slow Down"
    );
    assert!(std::fs::read(&local).expect("the copy") == pattern(5000));
}
