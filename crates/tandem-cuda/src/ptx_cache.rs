//! Compiled kernels on disk (the PTX and the CUBIN of each file), keyed by what determines
//! them: the kernel source, the GPU architecture, the compiler's version and its options. A
//! changed source or compiler misses the cache rather than loading stale code.

use std::io::Write;
use std::path::{Path, PathBuf};

use md5::{Digest, Md5};

use crate::arch::GpuArch;

/// Environment variable naming the cache folder, overriding the default.
pub const CACHE_DIR_ENV: &str = "TANDEM_PTX_CACHE";

/// A failure to read or write the cache.
#[derive(Debug, thiserror::Error)]
#[error("PTX cache {path}: {what}: {source}")]
pub struct CacheError {
    /// The file or folder.
    pub path: PathBuf,
    /// What was being done.
    pub what: &'static str,
    /// The operating system's error.
    #[source]
    pub source: std::io::Error,
}

/// The inputs that determine a compiled PTX.
#[derive(Debug, Clone, Copy)]
pub struct CacheKey<'a> {
    /// The kernel file's name, e.g. `batchnorm`.
    pub kernel: &'a str,
    /// Its CUDA C source.
    pub source: &'a str,
    /// The target architecture.
    pub arch: GpuArch,
    /// The compiler's version and options, as one string.
    pub compiler: &'a str,
}

impl CacheKey<'_> {
    /// The hex MD5 of source, compiler and architecture (MD5 names files here; it guards
    /// against stale entries, not against an adversary who can write the cache folder).
    pub fn digest(&self) -> String {
        md5_hex(&[self.source, self.compiler, &self.arch.to_string()])
    }

    /// The file name of the entry's PTX: `{kernel}-{arch}-{digest}.ptx`; its CUBIN is the
    /// same name ending in `.cubin`.
    pub fn file_name(&self) -> String {
        format!("{}-{}-{}.ptx", self.kernel, self.arch, self.digest())
    }
}

/// The hex MD5 of `parts`, each followed by a NUL byte but the last (names files in the
/// cache folder).
pub(crate) fn md5_hex(parts: &[&str]) -> String {
    let mut hasher = Md5::new();
    for (index, part) in parts.iter().enumerate() {
        if index > 0 {
            hasher.update(b"\0");
        }
        hasher.update(part.as_bytes());
    }
    hasher
        .finalize()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect()
}

/// A folder of cached PTX files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PtxCache {
    /// The folder.
    pub dir: PathBuf,
}

impl PtxCache {
    /// The cache in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> PtxCache {
        PtxCache { dir: dir.into() }
    }

    /// The default folder: `$TANDEM_PTX_CACHE`, else `$XDG_CACHE_HOME/tandem/ptx`, else
    /// `$HOME/.cache/tandem/ptx`; `None` when none of them is set.
    pub fn default_dir() -> Option<PathBuf> {
        let var = |name| std::env::var_os(name).filter(|value| !value.is_empty());
        if let Some(dir) = var(CACHE_DIR_ENV) {
            return Some(PathBuf::from(dir));
        }
        if let Some(cache) = var("XDG_CACHE_HOME") {
            return Some(Path::new(&cache).join("tandem/ptx"));
        }
        var("HOME").map(|home| Path::new(&home).join(".cache/tandem/ptx"))
    }

    /// The PTX file of an entry.
    pub fn path(&self, key: &CacheKey) -> PathBuf {
        self.dir.join(key.file_name())
    }

    /// The CUBIN file of an entry.
    pub fn cubin_path(&self, key: &CacheKey) -> PathBuf {
        self.path(key).with_extension("cubin")
    }

    /// The cached PTX and CUBIN of `key`, if both files are readable.
    pub fn load(&self, key: &CacheKey) -> Option<(String, Vec<u8>)> {
        let ptx = std::fs::read_to_string(self.path(key)).ok()?;
        let cubin = std::fs::read(self.cubin_path(key)).ok()?;
        Some((ptx, cubin))
    }

    /// Stores the PTX and CUBIN of `key`, the CUBIN first: each is written to a temporary
    /// file in the folder, flushed to disk and renamed into place, so a reader sees whole
    /// files, and a PTX file only once its CUBIN is there. Returns the PTX file's path.
    pub fn store(&self, key: &CacheKey, ptx: &str, cubin: &[u8]) -> Result<PathBuf, CacheError> {
        self.store_file(&self.cubin_path(key), cubin)?;
        let path = self.path(key);
        self.store_file(&path, ptx.as_bytes())?;
        Ok(path)
    }

    /// Writes `bytes` to `path` in the folder through a temporary file, fsync and rename
    /// (also for the measured cuDNN algorithms the executor keeps here).
    pub(crate) fn store_file(&self, path: &Path, bytes: &[u8]) -> Result<(), CacheError> {
        let error = |path: &Path, what| {
            let path = path.to_path_buf();
            move |source| CacheError { path, what, source }
        };
        std::fs::create_dir_all(&self.dir).map_err(error(&self.dir, "cannot create the folder"))?;
        let mut file = tempfile::NamedTempFile::new_in(&self.dir)
            .map_err(error(&self.dir, "cannot create a temporary file"))?;
        file.write_all(bytes)
            .and_then(|()| file.as_file().sync_all())
            .map_err(error(file.path(), "cannot write"))?;
        file.persist(path)
            .map_err(|persist| error(path, "cannot rename into place")(persist.error))?;
        Ok(())
    }
}
