//! `s3://bucket/key` and `obs://bucket/key`: where an object or a prefix of objects lives.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::RemoteError;

/// The scheme of an object URL. OBS speaks the S3 protocol, so both are served alike; the
/// scheme is kept only to print the URL as the user wrote it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// `s3://`: Amazon S3 or any S3-compatible server.
    S3,
    /// `obs://`: Huawei Cloud's Object Storage Service.
    Obs,
}

impl Scheme {
    fn prefix(self) -> &'static str {
        match self {
            Scheme::S3 => "s3://",
            Scheme::Obs => "obs://",
        }
    }
}

/// An object, or a prefix of objects ("folder"), in a bucket. The key has no leading or
/// trailing `/`; an empty key is the whole bucket.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ObjectUrl {
    scheme: Scheme,
    bucket: String,
    key: String,
}

impl ObjectUrl {
    /// Reads `text` as an object URL: `Ok(None)` when it is not one (a local path), an
    /// error when it starts like one but is not valid.
    pub fn parse(text: &str) -> Result<Option<ObjectUrl>, RemoteError> {
        let Some((scheme, rest)) = [Scheme::S3, Scheme::Obs]
            .into_iter()
            .find_map(|scheme| Some((scheme, text.strip_prefix(scheme.prefix())?)))
        else {
            return Ok(None);
        };
        let invalid = |reason: &str| RemoteError::InvalidUrl {
            url: redact_userinfo(text),
            reason: reason.to_string(),
        };
        let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.contains('@') || bucket.contains(':') {
            return Err(invalid(
                "credentials do not belong in the URL; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
            ));
        }
        if bucket.is_empty() {
            return Err(invalid(
                "the bucket name is missing (expected s3://BUCKET/KEY)",
            ));
        }
        if !bucket.bytes().all(|byte| {
            byte.is_ascii_lowercase() || byte.is_ascii_digit() || b".-_".contains(&byte)
        }) {
            return Err(invalid(
                "a bucket name has lowercase letters, digits, '.', '-' and '_' only",
            ));
        }
        let key = key.trim_matches('/');
        if key.split('/').any(|segment| {
            (segment.is_empty() && !key.is_empty()) || segment == "." || segment == ".."
        }) {
            return Err(invalid("the key has an empty, '.' or '..' segment"));
        }
        if key.chars().any(char::is_control) {
            return Err(invalid("the key has a control character"));
        }
        Ok(Some(ObjectUrl {
            scheme,
            bucket: bucket.to_string(),
            key: key.to_string(),
        }))
    }

    /// The scheme, as the user wrote it.
    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The bucket's name.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The key within the bucket (empty for the bucket itself).
    pub fn key(&self) -> &str {
        &self.key
    }

    /// `CACHE/AREA/BUCKET/KEY`: where this object is kept in area `area` (`data`, `objects`,
    /// `runs`) of the cache folder `cache_dir`.
    pub fn staging_path(&self, cache_dir: &Path, area: &str) -> PathBuf {
        let mut path = cache_dir.join(area).join(self.bucket());
        for segment in self.key.split('/').filter(|segment| !segment.is_empty()) {
            path.push(segment);
        }
        path
    }

    /// The object `relative` below this prefix (`relative` is a `/`-separated path).
    pub fn join(&self, relative: &str) -> ObjectUrl {
        let relative = relative.trim_matches('/');
        let key = match (self.key.is_empty(), relative.is_empty()) {
            (_, true) => self.key.clone(),
            (true, false) => relative.to_string(),
            (false, false) => format!("{}/{relative}", self.key),
        };
        ObjectUrl {
            key,
            ..self.clone()
        }
    }

    /// The object `key` in the same bucket.
    pub fn with_key(&self, key: &str) -> ObjectUrl {
        ObjectUrl {
            key: key.trim_matches('/').to_string(),
            ..self.clone()
        }
    }

    /// The key of `object` relative to this prefix, if it is below it.
    pub fn relative_key<'a>(&self, object: &'a ObjectUrl) -> Option<&'a str> {
        if object.bucket != self.bucket {
            return None;
        }
        if self.key.is_empty() {
            return Some(&object.key);
        }
        object.key.strip_prefix(&self.key)?.strip_prefix('/')
    }

    /// The last segment of the key (the object's "file name"), empty for a bucket.
    pub fn file_name(&self) -> &str {
        self.key.rsplit('/').next().unwrap_or_default()
    }
}

impl fmt::Display for ObjectUrl {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(formatter, "{}{}", self.scheme.prefix(), self.bucket)?;
        if !self.key.is_empty() {
            write!(formatter, "/{}", self.key)?;
        }
        Ok(())
    }
}

/// `text` with whatever sits between the scheme and an `@` replaced, so that an error
/// about a URL that wrongly carries credentials does not repeat them.
fn redact_userinfo(text: &str) -> String {
    let Some((scheme, rest)) = text.split_once("://") else {
        return text.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => text.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(text: &str) -> ObjectUrl {
        ObjectUrl::parse(text)
            .expect("valid")
            .expect("an object URL")
    }

    #[test]
    fn local_paths_are_not_object_urls() {
        for text in ["runs/a", "/data/cifar", "s3:/x", "file:///tmp/x", ""] {
            assert_eq!(
                ObjectUrl::parse(text).expect("not an error"),
                None,
                "{text}"
            );
        }
    }

    #[test]
    fn bucket_and_key_are_split_and_trimmed() {
        let prefix = url("obs://train-bucket/DDP-examples/output_dir/");
        assert_eq!(prefix.bucket(), "train-bucket");
        assert_eq!(prefix.key(), "DDP-examples/output_dir");
        assert_eq!(
            prefix.to_string(),
            "obs://train-bucket/DDP-examples/output_dir"
        );
        let object = prefix.join("epoch_3.safetensors");
        assert_eq!(
            object.to_string(),
            "obs://train-bucket/DDP-examples/output_dir/epoch_3.safetensors"
        );
        assert_eq!(object.file_name(), "epoch_3.safetensors");
        assert_eq!(prefix.relative_key(&object), Some("epoch_3.safetensors"));
        assert_eq!(url("s3://b").join("x/y").key(), "x/y");
        assert_eq!(url("s3://b").to_string(), "s3://b");
        assert_eq!(url("s3://b/ab").relative_key(&url("s3://b/abc")), None);
    }

    #[test]
    fn bad_urls_are_named_with_the_reason() {
        let message = |text: &str| ObjectUrl::parse(text).expect_err("invalid").to_string();
        assert_eq!(
            message("s3:///key"),
            "s3:///key: not a valid object URL: the bucket name is missing (expected s3://BUCKET/KEY)"
        );
        assert_eq!(
            message("s3://b/a//c"),
            "s3://b/a//c: not a valid object URL: the key has an empty, '.' or '..' segment"
        );
        assert_eq!(
            message("s3://b/a/../c"),
            "s3://b/a/../c: not a valid object URL: the key has an empty, '.' or '..' segment"
        );
        assert_eq!(
            message("s3://My_Bucket/x"),
            "s3://My_Bucket/x: not a valid object URL: a bucket name has lowercase letters, digits, '.', '-' and '_' only"
        );
    }

    #[test]
    fn credentials_in_a_url_are_refused_without_being_repeated() {
        let message = ObjectUrl::parse("s3://AKIDEXAMPLE:s3cr3t@bucket/key")
            .expect_err("refused")
            .to_string();
        assert!(
            !message.contains("s3cr3t") && !message.contains("AKIDEXAMPLE"),
            "{message}"
        );
        assert!(message.starts_with("s3://***@bucket/key: "), "{message}");
    }
}
