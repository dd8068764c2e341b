//! The one error type of the crate, and how object_store's errors map onto it.
//!
//! Every message names the URL (which never carries credentials) and the cause in words a
//! user can act on; the server's error code is kept, the request's signature never is.

use std::path::PathBuf;

use crate::Connection;

/// Why an object could not be read, written, listed or deleted.
#[derive(Debug, thiserror::Error)]
pub enum RemoteError {
    /// A string that starts like an object URL but is not one.
    #[error("{url}: not a valid object URL: {reason}")]
    InvalidUrl {
        /// The URL, with anything that looked like credentials removed.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The settings or variables are inconsistent.
    #[error("object storage settings: {0}")]
    Settings(String),
    /// No credentials were found for an endpoint that needs them.
    #[error(
        "no credentials for {endpoint}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
         (or OBS_ACCESS_KEY_ID and OBS_SECRET_ACCESS_KEY)"
    )]
    NoCredentials {
        /// The endpoint.
        endpoint: String,
    },
    /// An `obs://` URL with no endpoint set: Amazon S3, the default, does not serve it.
    #[error(
        "{url}: no endpoint is set, and Amazon S3 (the default) does not serve obs:// buckets: \
         set OBS_ENDPOINT or --s3-endpoint to the OBS endpoint of the bucket's region, e.g. \
         https://obs.cn-north-4.myhuaweicloud.com"
    )]
    NoObsEndpoint {
        /// The object or prefix.
        url: String,
    },
    /// The server refused the credentials or the operation.
    #[error(
        "{url}: access denied ({detail}) at {endpoint} ({origin}); check the credentials, the \
         bucket's policy, and that this endpoint serves the bucket"
    )]
    AccessDenied {
        /// The object or prefix.
        url: String,
        /// The server's code and message.
        detail: String,
        /// The endpoint that refused.
        endpoint: String,
        /// Where the endpoint came from, in words.
        origin: String,
    },
    /// The bucket does not exist.
    #[error("{url}: no such bucket '{bucket}'")]
    NoSuchBucket {
        /// The object or prefix.
        url: String,
        /// The bucket.
        bucket: String,
    },
    /// The object does not exist.
    #[error("{url}: no such object")]
    NoSuchKey {
        /// The object.
        url: String,
    },
    /// The endpoint could not be reached, after the retries.
    #[error("{url}: endpoint {endpoint} unreachable ({detail})")]
    Unreachable {
        /// The object or prefix.
        url: String,
        /// The endpoint tried.
        endpoint: String,
        /// The transport error.
        detail: String,
    },
    /// Fewer bytes arrived than the object holds.
    #[error("{url}: truncated download: {received} of {expected} bytes arrived")]
    Truncated {
        /// The object.
        url: String,
        /// The object's size.
        expected: u64,
        /// The bytes received.
        received: u64,
    },
    /// Any other failure of a request, after the retries.
    #[error("{url}: {detail}")]
    Request {
        /// The object or prefix.
        url: String,
        /// What failed.
        detail: String,
    },
    /// A local file could not be read or written.
    #[error("{path}: {source} (while transferring {url})")]
    Local {
        /// The object.
        url: String,
        /// The local file.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
}

impl RemoteError {
    /// The error `error` of a request on `url` (bucket `bucket`, through `connection`) means.
    pub(crate) fn from_store(
        error: object_store::Error,
        url: &str,
        bucket: &str,
        connection: &Connection,
    ) -> RemoteError {
        let chain = error_chain(&error);
        let code = server_code(&chain);
        let url = url.to_string();
        match (&error, code.as_deref()) {
            (_, Some("NoSuchBucket")) => RemoteError::NoSuchBucket {
                url,
                bucket: bucket.to_string(),
            },
            (object_store::Error::NotFound { .. }, _) | (_, Some("NoSuchKey")) => {
                RemoteError::NoSuchKey { url }
            }
            (
                object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. },
                _,
            )
            | (
                _,
                Some(
                    "AccessDenied"
                    | "InvalidAccessKeyId"
                    | "SignatureDoesNotMatch"
                    | "InvalidToken"
                    | "ExpiredToken",
                ),
            ) => RemoteError::AccessDenied {
                url,
                detail: server_detail(&chain).unwrap_or_else(|| "HTTP 403".to_string()),
                endpoint: connection.endpoint_url(),
                origin: connection.endpoint_origin(),
            },
            _ if is_unreachable(&chain) => RemoteError::Unreachable {
                url,
                endpoint: connection.endpoint_url(),
                detail: innermost(&chain),
            },
            _ => RemoteError::Request {
                url,
                detail: server_detail(&chain).unwrap_or_else(|| innermost(&chain)),
            },
        }
    }
}

/// The messages of `error` and of each error beneath it.
fn error_chain(error: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut chain = vec![error.to_string()];
    let mut source = error.source();
    while let Some(error) = source {
        chain.push(error.to_string());
        source = error.source();
    }
    chain
}

/// The S3 error code in a response body (`<Code>NoSuchBucket</Code>`).
fn server_code(chain: &[String]) -> Option<String> {
    chain
        .iter()
        .find_map(|message| xml_element(message, "Code"))
}

/// `CODE: MESSAGE` from the server's error response, if it sent one.
fn server_detail(chain: &[String]) -> Option<String> {
    let code = server_code(chain)?;
    let message = chain
        .iter()
        .find_map(|message| xml_element(message, "Message"));
    Some(match message {
        Some(message) => format!("{code}: {message}"),
        None => code,
    })
}

/// The text of the first `<name>...</name>` in `text`.
fn xml_element(text: &str, name: &str) -> Option<String> {
    let start = text.find(&format!("<{name}>"))? + name.len() + 2;
    let end = start + text[start..].find(&format!("</{name}>"))?;
    Some(text[start..end].trim().to_string())
}

/// Whether the request never reached a server (refused, no route, name not resolved).
fn is_unreachable(chain: &[String]) -> bool {
    chain.iter().any(|message| {
        let message = message.to_ascii_lowercase();
        [
            "connection refused",
            "error trying to connect",
            "tcp connect error",
            "dns error",
            "failed to lookup address",
            "no route to host",
            "network is unreachable",
        ]
        .iter()
        .any(|marker| message.contains(marker))
    })
}

/// The deepest message of the chain: the cause itself.
fn innermost(chain: &[String]) -> String {
    chain.last().cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_codes_and_messages_are_read_from_the_body() {
        let chain = vec![
            "Error performing GET http://127.0.0.1:1/b/k in 2ms - Server returned non-2xx status code: 404 Not Found: <?xml version=\"1.0\"?><Error><Code>NoSuchBucket</Code><Message>The specified bucket does not exist</Message></Error>".to_string(),
        ];
        assert_eq!(server_code(&chain).as_deref(), Some("NoSuchBucket"));
        assert_eq!(
            server_detail(&chain).as_deref(),
            Some("NoSuchBucket: The specified bucket does not exist")
        );
        assert_eq!(server_code(&["plain text".to_string()]), None);
        assert!(is_unreachable(&[
            "tcp connect error: Connection refused (os error 111)".to_string()
        ]));
        assert!(!is_unreachable(&["HTTP 500".to_string()]));
    }

    #[test]
    fn a_refusal_names_the_endpoint_that_refused_and_where_it_came_from() {
        let connection = Connection::resolve(&crate::ConnectionOptions::default(), |name| {
            (name == "AWS_ACCESS_KEY_ID" || name == "AWS_SECRET_ACCESS_KEY").then(|| "x".into())
        })
        .expect("resolves");
        let refused = object_store::Error::PermissionDenied {
            path: "cifar/data_batch_1.bin".into(),
            source: "HTTP 403".into(),
        };
        let error = RemoteError::from_store(
            refused,
            "s3://data/cifar/data_batch_1.bin",
            "data",
            &connection,
        );
        assert_eq!(
            error.to_string(),
            "s3://data/cifar/data_batch_1.bin: access denied (HTTP 403) at \
             https://s3.us-east-1.amazonaws.com (Amazon S3: no endpoint is set; --s3-endpoint, \
             AWS_ENDPOINT_URL or OBS_ENDPOINT sets one); check the credentials, the bucket's \
             policy, and that this endpoint serves the bucket"
        );
    }
}
