//! Whole-file transfers between local files and objects, blocking, over object_store.
//!
//! A download is written to a temporary name, synced and renamed, and its length checked
//! against the object's; an upload is one PUT, or a multipart upload that is completed or
//! aborted, so no object is ever left half-written under its final name. object_store
//! retries each request with back-off (connection errors, 5xx, throttling) for
//! [`Connection::retry_timeout`].

use std::collections::HashMap;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as StorePath;
use object_store::{BackoffConfig, ClientOptions, ObjectStore, PutPayload, RetryConfig};

use crate::{Connection, ObjectUrl, RemoteError, Scheme};

/// Objects up to this size are uploaded with one PUT; larger ones in parts of this size.
pub const PART_BYTES: usize = 16 << 20;
/// Downloads ask for ranges of this size, so a failed request repeats only its range.
const RANGE_BYTES: u64 = 16 << 20;
/// Bound on connecting to the endpoint.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Bound on one request (a range or a part at most).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(120);
/// Retries of one request, within the retry timeout.
const MAX_RETRIES: usize = 10;

/// What a listing says of one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ObjectInfo {
    /// The object.
    pub url: ObjectUrl,
    /// Its size in bytes.
    pub size: u64,
    /// Its entity tag, if the server gave one.
    pub e_tag: Option<String>,
}

/// A blocking client of one S3-protocol service, for any number of buckets.
pub struct RemoteStore {
    connection: Connection,
    runtime: tokio::runtime::Runtime,
    buckets: Mutex<HashMap<String, Arc<dyn ObjectStore>>>,
}

impl RemoteStore {
    /// A client for `connection`; nothing is sent until the first transfer.
    pub fn new(connection: Connection) -> Result<RemoteStore, RemoteError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tandem-remote")
            .enable_all()
            .build()
            .map_err(|error| {
                RemoteError::Settings(format!("cannot start the transfer runtime: {error}"))
            })?;
        Ok(RemoteStore {
            connection,
            runtime,
            buckets: Mutex::new(HashMap::new()),
        })
    }

    /// The connection this client uses.
    pub fn connection(&self) -> &Connection {
        &self.connection
    }

    /// Copies the object at `url` to `local` (atomically), returning its size.
    pub fn download(&self, url: &ObjectUrl, local: &Path) -> Result<u64, RemoteError> {
        let store = self.bucket(url)?;
        let location = store_path(url)?;
        let size = self
            .runtime
            .block_on(store.head(&location))
            .map_err(|error| self.error_of_object(error, url))?
            .size;
        self.download_listed(url, size, local).map(|()| size)
    }

    /// Copies the object at `url`, whose listing gave its `size`, to `local` (atomically);
    /// fewer bytes than `size` is an error.
    pub fn download_listed(
        &self,
        url: &ObjectUrl,
        size: u64,
        local: &Path,
    ) -> Result<(), RemoteError> {
        let store = self.bucket(url)?;
        let location = store_path(url)?;
        let fail = |error| self.error_of_object(error, url);
        let local_error = |source| RemoteError::Local {
            url: url.to_string(),
            path: local.to_path_buf(),
            source,
        };
        if let Some(parent) = local
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
        {
            std::fs::create_dir_all(parent).map_err(local_error)?;
        }
        let temporary = tandem_files::temporary_path(local);
        let result = (|| {
            // A new file only: a name that exists (a link planted there) is never written
            // through.
            let mut file = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temporary)
                .map_err(local_error)?;
            let mut received = 0;
            while received < size {
                let end = (received + RANGE_BYTES).min(size);
                let bytes = self
                    .runtime
                    .block_on(store.get_range(&location, received..end))
                    .map_err(|error| match fail(error) {
                        // The body broke off, and kept breaking off through the retries.
                        RemoteError::Request { .. } => RemoteError::Truncated {
                            url: url.to_string(),
                            expected: size,
                            received,
                        },
                        other => other,
                    })?;
                if bytes.is_empty() {
                    break;
                }
                file.write_all(&bytes).map_err(local_error)?;
                received += bytes.len() as u64;
            }
            if received != size {
                return Err(RemoteError::Truncated {
                    url: url.to_string(),
                    expected: size,
                    received,
                });
            }
            file.sync_all().map_err(local_error)?;
            std::fs::rename(&temporary, local).map_err(local_error)
        })();
        if result.is_err() {
            let _ = std::fs::remove_file(&temporary);
        }
        result
    }

    /// Copies `local` to the object at `url`, returning its size. The object appears
    /// whole or not at all; an object already there stays until the new one replaces it.
    pub fn upload(&self, local: &Path, url: &ObjectUrl) -> Result<u64, RemoteError> {
        let store = self.bucket(url)?;
        let location = store_path(url)?;
        let local_error = |source| RemoteError::Local {
            url: url.to_string(),
            path: local.to_path_buf(),
            source,
        };
        let mut file = std::fs::File::open(local).map_err(local_error)?;
        let size = file.metadata().map_err(local_error)?.len();
        if size <= PART_BYTES as u64 {
            let mut bytes = Vec::with_capacity(size as usize);
            file.read_to_end(&mut bytes).map_err(local_error)?;
            let size = bytes.len() as u64;
            self.runtime
                .block_on(store.put(&location, PutPayload::from(bytes)))
                .map_err(|error| self.error(error, url))?;
            return Ok(size);
        }
        file.seek(SeekFrom::Start(0)).map_err(local_error)?;
        let mut upload = self
            .runtime
            .block_on(store.put_multipart(&location))
            .map_err(|error| self.error(error, url))?;
        let parts = (|| {
            let mut sent = 0u64;
            loop {
                let mut part = Vec::with_capacity(PART_BYTES);
                (&mut file)
                    .take(PART_BYTES as u64)
                    .read_to_end(&mut part)
                    .map_err(local_error)?;
                if part.is_empty() {
                    return Ok(sent);
                }
                sent += part.len() as u64;
                self.runtime
                    .block_on(upload.put_part(PutPayload::from(part)))
                    .map_err(|error| self.error(error, url))?;
            }
        })();
        let completed = parts.and_then(|sent| {
            self.runtime
                .block_on(upload.complete())
                .map(|_| sent)
                .map_err(|error| self.error(error, url))
        });
        if completed.is_err() {
            // The parts sent so far are discarded; the object under `url` is untouched.
            let _ = self.runtime.block_on(upload.abort());
        }
        completed
    }

    /// The objects below the prefix `url`, in key order.
    pub fn list(&self, url: &ObjectUrl) -> Result<Vec<ObjectInfo>, RemoteError> {
        let store = self.bucket(url)?;
        let prefix = (!url.key().is_empty())
            .then(|| store_path(url))
            .transpose()?;
        let found: Vec<object_store::ObjectMeta> = self
            .runtime
            .block_on(async {
                let mut stream = store.list(prefix.as_ref());
                let mut found = Vec::new();
                while let Some(meta) = stream.next().await {
                    found.push(meta?);
                }
                Ok(found)
            })
            .map_err(|error| self.error(error, url))?;
        let mut objects: Vec<ObjectInfo> = found
            .into_iter()
            .map(|meta| ObjectInfo {
                url: url.with_key(meta.location.as_ref()),
                size: meta.size,
                e_tag: meta.e_tag,
            })
            .collect();
        objects.sort_by(|a, b| a.url.key().cmp(b.url.key()));
        Ok(objects)
    }

    /// What the store says of the object at `url`, or `None` when there is none.
    pub fn head(&self, url: &ObjectUrl) -> Result<Option<ObjectInfo>, RemoteError> {
        let store = self.bucket(url)?;
        let location = store_path(url)?;
        match self.runtime.block_on(store.head(&location)) {
            Ok(meta) => Ok(Some(ObjectInfo {
                url: url.clone(),
                size: meta.size,
                e_tag: meta.e_tag,
            })),
            Err(error) => match self.error_of_object(error, url) {
                RemoteError::NoSuchKey { .. } => Ok(None),
                other => Err(other),
            },
        }
    }

    /// Deletes the object at `url`; deleting one that is not there is not an error.
    pub fn delete(&self, url: &ObjectUrl) -> Result<(), RemoteError> {
        let store = self.bucket(url)?;
        let location = store_path(url)?;
        match self.runtime.block_on(store.delete(&location)) {
            Ok(()) => Ok(()),
            Err(error) => match self.error(error, url) {
                RemoteError::NoSuchKey { .. } => Ok(()),
                other => Err(other),
            },
        }
    }

    /// The object_store client of `url`'s bucket, built once. An `obs://` URL needs an
    /// endpoint: nothing is sent to Amazon S3 for it.
    fn bucket(&self, url: &ObjectUrl) -> Result<Arc<dyn ObjectStore>, RemoteError> {
        if url.scheme() == Scheme::Obs && self.connection.endpoint.is_none() {
            return Err(RemoteError::NoObsEndpoint {
                url: url.to_string(),
            });
        }
        let mut buckets = self
            .buckets
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(store) = buckets.get(url.bucket()) {
            return Ok(Arc::clone(store));
        }
        let store: Arc<dyn ObjectStore> = Arc::new(
            self.builder(url.bucket())
                .build()
                .map_err(|error| RemoteError::Settings(format!("{url}: {error}")))?,
        );
        buckets.insert(url.bucket().to_string(), Arc::clone(&store));
        Ok(store)
    }

    /// The builder of a client for `bucket`.
    fn builder(&self, bucket: &str) -> AmazonS3Builder {
        let connection = &self.connection;
        // Amazon's credential chain (web identity, container, instance metadata) reads its
        // own variables; every setting this crate resolves is then set explicitly.
        let mut builder = AmazonS3Builder::from_env()
            .with_bucket_name(bucket)
            .with_region(&connection.region)
            .with_virtual_hosted_style_request(!connection.path_style)
            .with_retry(RetryConfig {
                backoff: BackoffConfig {
                    init_backoff: Duration::from_millis(100),
                    max_backoff: Duration::from_secs(10),
                    base: 2.0,
                },
                max_retries: MAX_RETRIES,
                retry_timeout: connection.retry_timeout,
            })
            .with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(CONNECT_TIMEOUT)
                    .with_timeout(REQUEST_TIMEOUT)
                    .with_allow_http(
                        connection
                            .endpoint
                            .as_deref()
                            .is_some_and(|endpoint| endpoint.starts_with("http://")),
                    ),
            );
        if let Some(endpoint) = &connection.endpoint {
            builder = builder.with_endpoint(if connection.path_style {
                endpoint.clone()
            } else {
                virtual_hosted_endpoint(endpoint, bucket)
            });
        }
        if let Some(credentials) = &connection.credentials {
            builder = builder
                .with_access_key_id(&credentials.access_key_id)
                .with_secret_access_key(credentials.secret_access_key.expose());
            if let Some(token) = &credentials.session_token {
                builder = builder.with_token(token.expose());
            }
        }
        builder
    }

    /// The error of a request on the object `url`. A HEAD carries no body to say which of
    /// the bucket and the key is missing, so a missing object is told apart from a missing
    /// bucket by listing the bucket.
    fn error_of_object(&self, error: object_store::Error, url: &ObjectUrl) -> RemoteError {
        match self.error(error, url) {
            RemoteError::NoSuchKey { url: missing } => match self.list_first(url) {
                Err(RemoteError::NoSuchBucket { bucket, .. }) => RemoteError::NoSuchBucket {
                    url: missing,
                    bucket,
                },
                _ => RemoteError::NoSuchKey { url: missing },
            },
            other => other,
        }
    }

    /// Lists at most the first object under `url`'s key (to learn whether the bucket exists).
    fn list_first(&self, url: &ObjectUrl) -> Result<(), RemoteError> {
        let store = self.bucket(url)?;
        let prefix = store_path(url)?;
        self.runtime
            .block_on(async {
                let mut stream = store.list(Some(&prefix));
                stream.next().await.transpose().map(|_| ())
            })
            .map_err(|error| self.error(error, url))
    }

    /// The error of a request on `url`, in this crate's terms.
    fn error(&self, error: object_store::Error, url: &ObjectUrl) -> RemoteError {
        RemoteError::from_store(error, &url.to_string(), url.bucket(), &self.connection)
    }
}

/// `https://BUCKET.HOST` for a virtual-hosted endpoint `https://HOST`.
fn virtual_hosted_endpoint(endpoint: &str, bucket: &str) -> String {
    match endpoint.split_once("://") {
        Some((scheme, host)) => format!("{scheme}://{bucket}.{host}"),
        None => format!("{bucket}.{endpoint}"),
    }
}

/// The object_store path of an object URL's key.
fn store_path(url: &ObjectUrl) -> Result<StorePath, RemoteError> {
    StorePath::parse(url.key()).map_err(|error| RemoteError::InvalidUrl {
        url: url.to_string(),
        reason: error.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_obs_url_without_an_endpoint_is_refused_before_any_request() {
        let connection = Connection::resolve(&crate::ConnectionOptions::default(), |name| {
            (name == "OBS_ACCESS_KEY_ID" || name == "OBS_SECRET_ACCESS_KEY").then(|| "x".into())
        })
        .expect("resolves");
        let store = RemoteStore::new(connection).expect("a client");
        let url = ObjectUrl::parse("obs://runs/seed-000/snapshot.safetensors")
            .expect("valid")
            .expect("an object URL");
        let error = store.head(&url).expect_err("refused");
        assert_eq!(
            error.to_string(),
            "obs://runs/seed-000/snapshot.safetensors: no endpoint is set, and Amazon S3 (the \
             default) does not serve obs:// buckets: set OBS_ENDPOINT or --s3-endpoint to the OBS \
             endpoint of the bucket's region, e.g. https://obs.cn-north-4.myhuaweicloud.com"
        );
    }
}
