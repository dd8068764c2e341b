//! How to reach the object store: endpoint, region, addressing and credentials, from flags
//! first and then the variables that AWS tools, Huawei's OBS tools and ModelArts set.

use std::fmt;
use std::net::IpAddr;
use std::time::Duration;

use crate::RemoteError;

/// What the user gave as flags or config keys; each overrides the environment.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ConnectionOptions {
    /// `http://HOST:PORT` or `https://HOST`; a bare host means https.
    pub endpoint: Option<String>,
    /// The signing region.
    pub region: Option<String>,
    /// Path-style addressing (`ENDPOINT/BUCKET/KEY`) instead of virtual-hosted
    /// (`BUCKET.ENDPOINT/KEY`).
    pub path_style: Option<bool>,
    /// How long one request is retried (with back-off) before its failure is final.
    pub retry_timeout: Option<Duration>,
}

/// The default of [`ConnectionOptions::retry_timeout`].
pub const DEFAULT_RETRY_TIMEOUT: Duration = Duration::from_secs(120);
/// The flag that sets the endpoint, as messages name it.
const ENDPOINT_FLAG: &str = "--s3-endpoint";
/// The region signed for when nothing names one (what AWS's own tools assume).
const DEFAULT_REGION: &str = "us-east-1";

/// The variables read, in order of precedence, for each setting.
const ENDPOINT_VARIABLES: [&str; 5] = [
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "OBS_ENDPOINT",
    // MoXing's name on ModelArts, often a bare host with S3_USE_HTTPS beside it.
    "S3_ENDPOINT",
];
const REGION_VARIABLES: [&str; 3] = ["AWS_REGION", "AWS_DEFAULT_REGION", "OBS_REGION"];
/// (access key id, secret, session token) as AWS tools, the OBS SDKs and MoXing name them.
const CREDENTIAL_VARIABLES: [(&str, &str, &str); 3] = [
    (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
    ),
    (
        "OBS_ACCESS_KEY_ID",
        "OBS_SECRET_ACCESS_KEY",
        "OBS_SECURITY_TOKEN",
    ),
    ("ACCESS_KEY_ID", "SECRET_ACCESS_KEY", "SECURITY_TOKEN"),
];

/// A secret string: shown as `***` by `Debug`, so that no log or error can print it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The secret itself, for signing.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str("***")
    }
}

/// Static credentials.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    /// The access key id (not secret: it names the key).
    pub access_key_id: String,
    /// The secret access key.
    pub secret_access_key: Secret,
    /// The session (security) token of temporary credentials.
    pub session_token: Option<Secret>,
    /// The variable the access key id came from, for messages.
    pub source: &'static str,
}

/// Everything needed to talk to the store.
#[derive(Clone, Debug, PartialEq)]
pub struct Connection {
    /// The endpoint with its scheme, or `None` for Amazon S3 itself.
    pub endpoint: Option<String>,
    /// Where the endpoint came from: `--s3-endpoint` or the variable that set it.
    pub endpoint_source: Option<&'static str>,
    /// The signing region.
    pub region: String,
    /// Path-style addressing.
    pub path_style: bool,
    /// Static credentials; `None` leaves Amazon's credential chain (web identity, container,
    /// instance metadata) to find them.
    pub credentials: Option<Credentials>,
    /// How long one request is retried.
    pub retry_timeout: Duration,
}

impl Connection {
    /// The connection `options` and the process's environment describe.
    pub fn from_env(options: &ConnectionOptions) -> Result<Connection, RemoteError> {
        Connection::resolve(options, |name| std::env::var(name).ok())
    }

    /// The connection `options` and the variables `lookup` gives describe. An endpoint
    /// other than Amazon's needs static credentials, as no credential chain serves it.
    pub fn resolve(
        options: &ConnectionOptions,
        lookup: impl Fn(&str) -> Option<String>,
    ) -> Result<Connection, RemoteError> {
        let lookup = |name: &str| lookup(name).filter(|value| !value.trim().is_empty());
        let first_of = |names: &[&str]| names.iter().find_map(|name| lookup(name));
        let (endpoint, endpoint_source) = match options.endpoint.clone() {
            Some(endpoint) => (Some(endpoint), Some(ENDPOINT_FLAG)),
            None => ENDPOINT_VARIABLES
                .iter()
                .find_map(|name| Some((Some(lookup(name)?), Some(*name))))
                .unwrap_or((None, None)),
        };
        let endpoint = endpoint
            .map(|endpoint| with_scheme(endpoint.trim(), lookup("S3_USE_HTTPS").as_deref()))
            .transpose()?;
        let host = endpoint.as_deref().map(endpoint_host);
        let region = options
            .region
            .clone()
            .or_else(|| first_of(&REGION_VARIABLES))
            .or_else(|| host.and_then(obs_region))
            .unwrap_or_else(|| DEFAULT_REGION.to_string());
        let path_style = options
            .path_style
            .unwrap_or_else(|| host.is_some_and(is_ip_or_localhost));
        let credentials = find_credentials(&lookup)?;
        if credentials.is_none() {
            if let Some(endpoint) = &endpoint {
                return Err(RemoteError::NoCredentials {
                    endpoint: endpoint.clone(),
                });
            }
        }
        Ok(Connection {
            endpoint,
            endpoint_source,
            region,
            path_style,
            credentials,
            retry_timeout: options.retry_timeout.unwrap_or(DEFAULT_RETRY_TIMEOUT),
        })
    }
}

impl Connection {
    /// The endpoint requests go to: the one set, else Amazon S3's of the region.
    pub fn endpoint_url(&self) -> String {
        self.endpoint
            .clone()
            .unwrap_or_else(|| format!("https://s3.{}.amazonaws.com", self.region))
    }

    /// Where [`Connection::endpoint_url`] comes from, in words.
    pub fn endpoint_origin(&self) -> String {
        match self.endpoint_source {
            Some(source) => format!("from {source}"),
            None => format!(
                "Amazon S3: no endpoint is set; {ENDPOINT_FLAG}, AWS_ENDPOINT_URL or \
                 OBS_ENDPOINT sets one"
            ),
        }
    }
}

/// The first complete set of credentials; a key id without its secret (or the reverse) is
/// an error that names both variables.
fn find_credentials(
    lookup: &impl Fn(&str) -> Option<String>,
) -> Result<Option<Credentials>, RemoteError> {
    for (id_name, secret_name, token_name) in CREDENTIAL_VARIABLES {
        match (lookup(id_name), lookup(secret_name)) {
            (Some(access_key_id), Some(secret)) => {
                return Ok(Some(Credentials {
                    access_key_id,
                    secret_access_key: Secret(secret),
                    session_token: lookup(token_name).map(Secret),
                    source: id_name,
                }))
            }
            (Some(_), None) => {
                return Err(RemoteError::Settings(format!(
                    "{id_name} is set but {secret_name} is not; set both"
                )))
            }
            (None, Some(_)) => {
                return Err(RemoteError::Settings(format!(
                    "{secret_name} is set but {id_name} is not; set both"
                )))
            }
            (None, None) => {}
        }
    }
    Ok(None)
}

/// `endpoint` with a scheme: a bare host gets https, or http where `S3_USE_HTTPS` is `0`
/// (MoXing's convention).
fn with_scheme(endpoint: &str, use_https: Option<&str>) -> Result<String, RemoteError> {
    if endpoint.starts_with("http://") || endpoint.starts_with("https://") {
        return Ok(endpoint.trim_end_matches('/').to_string());
    }
    if endpoint.contains("://") {
        return Err(RemoteError::Settings(format!(
            "endpoint {endpoint}: expected http://HOST[:PORT] or https://HOST[:PORT]"
        )));
    }
    let scheme = match use_https.map(str::trim) {
        Some("0" | "false" | "False" | "FALSE") => "http",
        _ => "https",
    };
    Ok(format!("{scheme}://{}", endpoint.trim_end_matches('/')))
}

/// The host of an endpoint with a scheme (no port, no path).
fn endpoint_host(endpoint: &str) -> &str {
    let authority = endpoint
        .split_once("://")
        .map_or(endpoint, |(_, rest)| rest)
        .split('/')
        .next()
        .unwrap_or_default();
    if let Some(bracketed) = authority.strip_prefix('[') {
        return bracketed.split(']').next().unwrap_or_default();
    }
    authority
        .rsplit_once(':')
        .map_or(authority, |(host, _)| host)
}

/// Path-style is the only addressing an IP address or `localhost` can serve.
fn is_ip_or_localhost(host: &str) -> bool {
    host == "localhost" || host.parse::<IpAddr>().is_ok()
}

/// The region in an OBS endpoint host, `obs.REGION.myhuaweicloud.com`.
fn obs_region(host: &str) -> Option<String> {
    let rest = host.strip_prefix("obs.")?;
    let (region, domain) = rest.split_once('.')?;
    domain.contains("huaweicloud").then(|| region.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn resolve(variables: &[(&str, &str)]) -> Result<Connection, RemoteError> {
        resolve_with(&ConnectionOptions::default(), variables)
    }

    fn resolve_with(
        options: &ConnectionOptions,
        variables: &[(&str, &str)],
    ) -> Result<Connection, RemoteError> {
        let variables: HashMap<String, String> = variables
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_string()))
            .collect();
        Connection::resolve(options, |name| variables.get(name).cloned())
    }

    /// Fails unless `connection` goes to `endpoint` in `region`, addressing buckets in the
    /// path (`path_style`) or in the host name.
    fn assert_place(connection: &Connection, endpoint: &str, region: &str, path_style: bool) {
        assert_eq!(connection.endpoint.as_deref(), Some(endpoint));
        assert_eq!(connection.region, region);
        assert_eq!(connection.path_style, path_style);
    }

    #[test]
    fn a_loopback_endpoint_from_the_aws_variables_is_path_style_plain_http() {
        let connection = resolve(&[
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000/"),
            ("AWS_ACCESS_KEY_ID", "tandem"),
            ("AWS_SECRET_ACCESS_KEY", "secret-key"),
            ("AWS_REGION", "eu-west-3"),
        ])
        .expect("resolves");
        assert_place(&connection, "http://127.0.0.1:9000", "eu-west-3", true);
        let credentials = connection.credentials.expect("credentials");
        assert_eq!(credentials.access_key_id, "tandem");
        assert_eq!(credentials.secret_access_key.expose(), "secret-key");
        assert_eq!(credentials.source, "AWS_ACCESS_KEY_ID");
        assert_eq!(connection.retry_timeout, DEFAULT_RETRY_TIMEOUT);
    }

    #[test]
    fn modelarts_variables_give_an_obs_connection_with_its_region() {
        let connection = resolve(&[
            ("S3_ENDPOINT", "obs.cn-north-4.myhuaweicloud.com"),
            ("S3_USE_HTTPS", "1"),
            ("ACCESS_KEY_ID", "AK"),
            ("SECRET_ACCESS_KEY", "SK"),
        ])
        .expect("resolves");
        let endpoint = "https://obs.cn-north-4.myhuaweicloud.com";
        assert_place(&connection, endpoint, "cn-north-4", false);
        assert_eq!(
            connection.credentials.expect("credentials").source,
            "ACCESS_KEY_ID"
        );
        let plain = resolve(&[
            ("S3_ENDPOINT", "10.0.0.5:9000"),
            ("S3_USE_HTTPS", "0"),
            ("OBS_ACCESS_KEY_ID", "AK"),
            ("OBS_SECRET_ACCESS_KEY", "SK"),
            ("OBS_SECURITY_TOKEN", "TOKEN"),
        ])
        .expect("resolves");
        assert_place(&plain, "http://10.0.0.5:9000", DEFAULT_REGION, true);
        let credentials = plain.credentials.expect("credentials");
        assert_eq!(
            credentials
                .session_token
                .map(|token| token.expose().to_string()),
            Some("TOKEN".to_string())
        );
    }

    #[test]
    fn flags_override_the_variables_and_aws_names_come_first() {
        let options = ConnectionOptions {
            endpoint: Some("https://minio.example".into()),
            region: Some("here".into()),
            path_style: Some(true),
            retry_timeout: Some(Duration::from_secs(3)),
        };
        let connection = resolve_with(
            &options,
            &[
                ("AWS_ENDPOINT_URL", "http://127.0.0.1:1"),
                ("AWS_REGION", "there"),
                ("AWS_ACCESS_KEY_ID", "aws"),
                ("AWS_SECRET_ACCESS_KEY", "aws-secret"),
                ("OBS_ACCESS_KEY_ID", "obs"),
                ("OBS_SECRET_ACCESS_KEY", "obs-secret"),
            ],
        )
        .expect("resolves");
        assert_place(&connection, "https://minio.example", "here", true);
        assert_eq!(connection.retry_timeout, Duration::from_secs(3));
        assert_eq!(
            connection.credentials.expect("credentials").access_key_id,
            "aws"
        );
    }

    #[test]
    fn missing_or_half_credentials_are_named() {
        assert_eq!(
            resolve(&[("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")])
                .expect_err("no credentials")
                .to_string(),
            "no credentials for http://127.0.0.1:9000: set AWS_ACCESS_KEY_ID and \
             AWS_SECRET_ACCESS_KEY (or OBS_ACCESS_KEY_ID and OBS_SECRET_ACCESS_KEY)"
        );
        assert_eq!(
            resolve(&[("AWS_ACCESS_KEY_ID", "AK")])
                .expect_err("half")
                .to_string(),
            "object storage settings: AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not; set both"
        );
        let chain = resolve(&[]).expect("Amazon's own chain may find credentials");
        assert_eq!(chain.credentials, None);
        assert_eq!(chain.endpoint, None);
        assert!(resolve(&[("AWS_ENDPOINT_URL", "ftp://x")]).is_err());
    }

    #[test]
    fn the_endpoint_and_where_it_came_from_are_named() {
        let from_variable = resolve(&[
            ("OBS_ENDPOINT", "obs.cn-north-4.myhuaweicloud.com"),
            ("OBS_ACCESS_KEY_ID", "AK"),
            ("OBS_SECRET_ACCESS_KEY", "SK"),
        ])
        .expect("resolves");
        assert_eq!(
            from_variable.endpoint_url(),
            "https://obs.cn-north-4.myhuaweicloud.com"
        );
        assert_eq!(from_variable.endpoint_origin(), "from OBS_ENDPOINT");
        let from_flag = resolve_with(
            &ConnectionOptions {
                endpoint: Some("http://127.0.0.1:9000".into()),
                ..ConnectionOptions::default()
            },
            &[("AWS_ACCESS_KEY_ID", "AK"), ("AWS_SECRET_ACCESS_KEY", "SK")],
        )
        .expect("resolves");
        assert_eq!(from_flag.endpoint_origin(), "from --s3-endpoint");
        let amazon = resolve(&[("AWS_REGION", "eu-west-3")]).expect("resolves");
        assert_eq!(amazon.endpoint_url(), "https://s3.eu-west-3.amazonaws.com");
        assert_eq!(
            amazon.endpoint_origin(),
            "Amazon S3: no endpoint is set; --s3-endpoint, AWS_ENDPOINT_URL or OBS_ENDPOINT \
             sets one"
        );
    }

    #[test]
    fn secrets_never_appear_in_debug_output() {
        let connection = resolve(&[
            ("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"),
            ("AWS_ACCESS_KEY_ID", "AK"),
            ("AWS_SECRET_ACCESS_KEY", "very-secret-value"),
            ("AWS_SESSION_TOKEN", "session-token-value"),
        ])
        .expect("resolves");
        let debug = format!("{connection:?}");
        assert!(!debug.contains("very-secret-value"), "{debug}");
        assert!(!debug.contains("session-token-value"), "{debug}");
        assert!(debug.contains("***"), "{debug}");
    }
}
