//! Finding the CUDA libraries before anything calls them.
//!
//! `cudarc` loads each library on first use by trying a list of file names with `dlopen`, and
//! panics when none loads. So Tandem probes first, once, with the same names in the same order:
//! a library the probe did not find is never handed to `cudarc`, and its absence is an error
//! that names the library, the places searched and what `dlopen` said.
//!
//! Folders listed in `TANDEM_CUDA_LIBRARY_PATH` (colon-separated) are tried before the system's
//! search: a library found there is loaded by its full path first, so that `cudarc`'s later
//! `dlopen` by bare name finds the already-loaded library, which `dlopen` does only when the
//! bare name is the library's SONAME (`libnvrtc.so.13`, `libcudnn.so.9`, `libcuda.so.1`). NCCL's
//! SONAME is `libnccl.so.2`, a name `cudarc` 0.19 never asks for: its `libnccl.so` must resolve
//! through `LD_LIBRARY_PATH` or the linker cache (a link `libnccl.so -> libnccl.so.2` in a
//! folder on `LD_LIBRARY_PATH`). What the probe reports as found is what that bare-name
//! `dlopen` resolved, which is the file `cudarc` will use. The libraries those libraries open
//! by bare name themselves (NVRTC's builtins, cuDNN 9's sub-libraries) are preloaded from
//! beside them the same way, so a folder of `TANDEM_CUDA_LIBRARY_PATH` needs no
//! `LD_LIBRARY_PATH` entry.

use std::ffi::{c_int, c_void, CStr};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library as LoadedLibrary;

/// Environment variable with extra folders to search first, separated by colons.
pub const LIBRARY_PATH_ENV: &str = "TANDEM_CUDA_LIBRARY_PATH";

/// The CUDA libraries Tandem uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Library {
    /// The CUDA driver, `libcuda`.
    Driver,
    /// The runtime compiler of CUDA C, `libnvrtc`.
    Nvrtc,
    /// Dense linear algebra, `libcublas`.
    Cublas,
    /// Convolutions, `libcudnn`.
    Cudnn,
    /// Collectives between GPUs, `libnccl`.
    Nccl,
}

impl Library {
    /// Every library, in the order they are probed and reported.
    pub const ALL: [Library; 5] = [
        Library::Driver,
        Library::Nvrtc,
        Library::Cublas,
        Library::Cudnn,
        Library::Nccl,
    ];

    /// The short name used in messages, as the file names start (`libcuda`, `libnvrtc`, …).
    pub fn file_stem(self) -> &'static str {
        match self {
            Library::Driver => "libcuda",
            Library::Nvrtc => "libnvrtc",
            Library::Cublas => "libcublas",
            Library::Cudnn => "libcudnn",
            Library::Nccl => "libnccl",
        }
    }

    /// The usual file name on Linux among [`Library::candidate_names`] (the SONAME of CUDA 13
    /// and cuDNN 9), named in messages.
    pub fn usual_name(self) -> &'static str {
        match self {
            Library::Driver => "libcuda.so.1",
            Library::Nvrtc => "libnvrtc.so.13",
            Library::Cublas => "libcublas.so.13",
            Library::Cudnn => "libcudnn.so.9",
            // NCCL's SONAME is libnccl.so.2, which cudarc 0.19 does not try.
            Library::Nccl => "libnccl.so",
        }
    }

    /// The names `cudarc` passes to its candidate list (its `lib_names` per module).
    fn cudarc_names(self) -> &'static [&'static str] {
        match self {
            Library::Driver => &["cuda", "nvcuda"],
            Library::Nvrtc => &["nvrtc"],
            Library::Cublas => &["cublas"],
            Library::Cudnn => &["cudnn"],
            Library::Nccl => &["nccl"],
        }
    }

    /// The file names `cudarc` tries, in its order.
    pub fn candidate_names(self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for name in self.cudarc_names() {
            for candidate in cudarc::get_lib_name_candidates(name) {
                if !names.contains(&candidate) {
                    names.push(candidate);
                }
            }
        }
        names
    }
}

impl fmt::Display for Library {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.file_stem())
    }
}

/// Where the probe looks: the folders of [`LIBRARY_PATH_ENV`], then the system's search.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchPath {
    /// Folders tried first, in order.
    pub folders: Vec<PathBuf>,
    /// Whether the system's search (`dlopen` by bare name, as `cudarc` loads) follows. Only
    /// `false` in tests that need a library to be missing on any machine: a library is then
    /// reported found only when one of `folders` has it.
    pub system_search: bool,
}

impl SearchPath {
    /// The folders of a colon-separated list (empty entries are skipped), then the system's
    /// search.
    pub fn from_list(list: &str) -> SearchPath {
        SearchPath {
            folders: list
                .split(':')
                .filter(|entry| !entry.is_empty())
                .map(PathBuf::from)
                .collect(),
            system_search: true,
        }
    }

    /// Only these folders, without the system's search.
    pub fn only(folders: Vec<PathBuf>) -> SearchPath {
        SearchPath {
            folders,
            system_search: false,
        }
    }

    /// The folders of [`LIBRARY_PATH_ENV`] (none when it is unset), then the system's search.
    pub fn from_env() -> SearchPath {
        SearchPath::from_list(&std::env::var(LIBRARY_PATH_ENV).unwrap_or_default())
    }

    /// The places searched, in words, for messages.
    fn describe(&self) -> String {
        let system = match std::env::var("LD_LIBRARY_PATH") {
            Ok(list) if !list.is_empty() => {
                format!("the system's search (LD_LIBRARY_PATH={list}, ld.so.cache, /lib, /usr/lib)")
            }
            _ => "the system's search (LD_LIBRARY_PATH unset, ld.so.cache, /lib, /usr/lib)"
                .to_string(),
        };
        let folders = self
            .folders
            .iter()
            .map(|folder| folder.display().to_string())
            .collect::<Vec<_>>()
            .join(":");
        match (self.folders.is_empty(), self.system_search) {
            (true, true) => system,
            (false, true) => format!("{LIBRARY_PATH_ENV}={folders}, then {system}"),
            (_, false) => format!("only the folders {folders:?}"),
        }
    }
}

/// A library the probe loaded.
#[derive(Debug)]
pub struct FoundLibrary {
    /// The file `dlopen` resolved (as the dynamic loader names it).
    pub path: PathBuf,
    /// That file with every symbolic link resolved: the file actually mapped.
    pub resolved: PathBuf,
    /// The name that loaded it, as `cudarc` will ask for it.
    pub loaded_as: String,
    /// The library's own version report, e.g. `13.0` (empty when it has none to give).
    pub version: String,
    /// Kept open for the life of the probe, so that the library stays loaded.
    _handles: Vec<LoadedLibrary>,
}

/// A library that was not found, or found but not loadable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{library} not found: searched {places} for {usual} and {others} other names; dlopen said: \
     {dlopen_error}",
    usual = library.usual_name(),
    others = names.len().saturating_sub(1)
)]
pub struct MissingLibrary {
    /// Which library.
    pub library: Library,
    /// The places searched, in words.
    pub places: String,
    /// The file names tried, in order.
    pub names: Vec<String>,
    /// The most telling `dlopen` message: one that is not "no such file" when a file was there
    /// but did not load, else the usual name's, else the last name's.
    pub dlopen_error: String,
}

/// What was found of every library, from one probe.
#[derive(Debug)]
pub struct Probe {
    /// Where the probe looked.
    pub search: SearchPath,
    results: Vec<(Library, Result<FoundLibrary, MissingLibrary>)>,
}

impl Probe {
    /// Probes every library, searching `search`'s folders first.
    pub fn run(search: &SearchPath) -> Probe {
        let results = Library::ALL
            .iter()
            .map(|&library| (library, probe_library(library, search)))
            .collect();
        Probe {
            search: search.clone(),
            results,
        }
    }

    /// The probe of this process, with the folders of [`LIBRARY_PATH_ENV`], run on first use.
    pub fn process() -> &'static Probe {
        static PROBE: OnceLock<Probe> = OnceLock::new();
        PROBE.get_or_init(|| Probe::run(&SearchPath::from_env()))
    }

    /// The result for one library.
    pub fn get(&self, library: Library) -> Result<&FoundLibrary, &MissingLibrary> {
        match self.results.iter().find(|(probed, _)| *probed == library) {
            Some((_, result)) => result.as_ref(),
            None => unreachable!("every library is probed"),
        }
    }

    /// The library, or the error saying why it is missing.
    pub fn require(&self, library: Library) -> Result<&FoundLibrary, MissingLibrary> {
        self.get(library).map_err(Clone::clone)
    }

    /// Whether the library was found.
    pub fn found(&self, library: Library) -> bool {
        self.get(library).is_ok()
    }
}

impl fmt::Display for Probe {
    /// One line per library: where it was found and its version, or why not.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, (library, result)) in self.results.iter().enumerate() {
            if index > 0 {
                writeln!(f)?;
            }
            match result {
                Ok(found) => {
                    write!(f, "{library}: {}", found.path.display())?;
                    if found.resolved != found.path {
                        write!(f, " -> {}", found.resolved.display())?;
                    }
                    if !found.version.is_empty() {
                        write!(f, " (version {})", found.version)?;
                    }
                }
                Err(missing) => write!(f, "{library}: {missing}")?,
            }
        }
        Ok(())
    }
}

/// Probes one library: preloads it from the extra folders, then resolves it by bare name as
/// `cudarc` will.
fn probe_library(library: Library, search: &SearchPath) -> Result<FoundLibrary, MissingLibrary> {
    let names = library.candidate_names();
    let mut errors = Vec::new();
    let mut handles = Vec::new();
    'folders: for folder in &search.folders {
        for name in &names {
            match open(&folder.join(name)) {
                Ok(handle) => {
                    handles.push(handle);
                    break 'folders;
                }
                Err(error) => errors.push(error),
            }
        }
    }
    let bare_names = if search.system_search || !handles.is_empty() {
        &names[..]
    } else {
        &[]
    };
    for name in bare_names {
        match open(Path::new(name)) {
            Ok(handle) => {
                return identify(library, name, handle, handles).map_err(|error| MissingLibrary {
                    library,
                    places: search.describe(),
                    names: names.clone(),
                    dlopen_error: format!("{name}: {error}"),
                })
            }
            Err(error) => errors.push(error),
        }
    }
    if let Some(handle) = handles.first() {
        // Loaded from a folder by a name that `cudarc`'s bare names do not reach.
        let path = loaded_path(library, handle).unwrap_or_default();
        errors.push(format!(
            "{} loaded, but its SONAME is none of the names cudarc asks for \
             (put a link named {} to it in a folder on LD_LIBRARY_PATH)",
            path.display(),
            library.usual_name()
        ));
    }
    let dlopen_error = errors
        .iter()
        .rev()
        .find(|error| !error.contains("No such file or directory"))
        .or_else(|| {
            errors
                .iter()
                .find(|error| error.contains(&format!("{}:", library.usual_name())))
        })
        .or(errors.last())
        .cloned()
        .unwrap_or_default();
    Err(MissingLibrary {
        library,
        places: search.describe(),
        names,
        dlopen_error,
    })
}

/// `dlopen` of a path or bare name, with its message on failure.
fn open(path: &Path) -> Result<LoadedLibrary, String> {
    // SAFETY: loading a CUDA library runs its initializers; these libraries are made to be
    // loaded with dlopen (cudarc and PyTorch do the same) and do no unsound work at load.
    unsafe { LoadedLibrary::new(path.as_os_str()) }.map_err(|error| with_sources(&error))
}

/// An error's message followed by those of its sources (libloading keeps dlopen's own text in
/// the source).
fn with_sources(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(inner) = source {
        message = format!("{message}: {inner}");
        source = inner.source();
    }
    message
}

/// The path and version of a loaded library; an error when its main symbol is missing.
fn identify(
    library: Library,
    name: &str,
    handle: LoadedLibrary,
    mut handles: Vec<LoadedLibrary>,
) -> Result<FoundLibrary, String> {
    let path = loaded_path(library, &handle)?;
    let resolved = resolved_path(&path);
    if let Some(preloaded) = handles.first() {
        // A bare name that reached another file than the folder's would give the process two
        // releases of the library (and of what each brings in by SONAME).
        let preloaded = loaded_path(library, preloaded)?;
        if resolved_path(&preloaded) != resolved {
            return Err(format!(
                "two files of {library} would be loaded: {} from {LIBRARY_PATH_ENV}, and {} \
                 for the bare name cudarc asks for; put the folder of the first (or a folder \
                 of links to it) first on LD_LIBRARY_PATH",
                preloaded.display(),
                path.display()
            ));
        }
    }
    let version = version(library, &handle);
    let preloaded_from_folder = !handles.is_empty();
    handles.push(handle);
    handles.extend(companion(library, &path, &version));
    if preloaded_from_folder && library == Library::Cudnn {
        handles.extend(cudnn_sublibraries(&path, &version));
    }
    Ok(FoundLibrary {
        path,
        resolved,
        loaded_as: name.to_string(),
        version,
        _handles: handles,
    })
}

/// A library that `library` itself loads by bare name, preloaded from beside it so that a folder
/// of [`LIBRARY_PATH_ENV`] works without `LD_LIBRARY_PATH`: NVRTC opens
/// `libnvrtc-builtins.so.MAJOR.MINOR` at its first compilation. `None` when there is none, or
/// when it does not load (NVRTC's log then names it).
fn companion(library: Library, path: &Path, version: &str) -> Option<LoadedLibrary> {
    if library != Library::Nvrtc || version.is_empty() {
        return None;
    }
    let builtins = path
        .parent()?
        .join(format!("libnvrtc-builtins.so.{version}"));
    builtins.exists().then(|| open(&builtins).ok()).flatten()
}

/// cuDNN 9's sub-libraries beside `libcudnn.so.MAJOR` (`libcudnn_graph`, `_ops`, `_cnn`,
/// `_engines_*`, `_heuristic`, …), preloaded for a libcudnn found in a folder of
/// [`LIBRARY_PATH_ENV`]: `libcudnn.so.9` opens them by bare name at its first call and fails
/// with `CUDNN_STATUS_SUBLIBRARY_LOADING_FAILED` when the loader cannot find them. Some need
/// others, so the files are opened in rounds until a round loads nothing new; one that never
/// loads is left for cuDNN's own error to name.
fn cudnn_sublibraries(path: &Path, version: &str) -> Vec<LoadedLibrary> {
    let Some(major) = version.split('.').next().filter(|major| !major.is_empty()) else {
        return Vec::new();
    };
    let suffix = format!(".so.{major}");
    let Some(folder) = path.parent() else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    let mut pending: Vec<PathBuf> = entries
        .filter_map(|entry| entry.ok().map(|entry| entry.path()))
        .filter(|file| {
            file.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with("libcudnn_") && name.ends_with(&suffix))
        })
        .collect();
    pending.sort();
    let mut loaded = Vec::new();
    loop {
        let before = pending.len();
        pending.retain(|file| match open(file) {
            Ok(handle) => {
                loaded.push(handle);
                false
            }
            Err(_) => true,
        });
        if pending.is_empty() || pending.len() == before {
            return loaded;
        }
    }
}

/// `path` with every symbolic link resolved, or `path` itself when that fails.
fn resolved_path(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A CUDA library file mapped into this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MappedFile {
    /// The file's name up to `.so` (`libcublasLt`, `libcudnn_ops`, …).
    pub stem: String,
    /// The file as the loader mapped it, every symbolic link resolved.
    pub path: PathBuf,
}

/// The name stems of the CUDA libraries and of what they bring in, as [`mapped_cuda_files`]
/// lists them.
const CUDA_STEMS: [&str; 7] = [
    "libcuda",
    "libnvrtc",
    "libcublas",
    "libcudnn",
    "libnccl",
    "libcudart",
    "libnvJitLink",
];

/// Every CUDA library file mapped into this process now, from `/proc/self/maps`, sorted by
/// stem and path: what was actually loaded, the libraries' own dependencies included. Empty
/// where `/proc` cannot be read.
pub fn mapped_cuda_files() -> Vec<MappedFile> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut files: Vec<MappedFile> = maps
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/'))
        .filter_map(|path| {
            let name = Path::new(path).file_name()?.to_str()?;
            let stem = name.split(".so").next()?;
            let family = stem.split(['_', '-']).next()?;
            let family = family.strip_suffix("Lt").unwrap_or(family);
            CUDA_STEMS.contains(&family).then(|| MappedFile {
                stem: stem.to_string(),
                path: resolved_path(Path::new(path)),
            })
        })
        .collect();
    files.sort_by(|a, b| (&a.stem, &a.path).cmp(&(&b.stem, &b.path)));
    files.dedup();
    files
}

/// The stems of `files` mapped from more than one file, each with its files: two releases of
/// one library in one process.
pub fn duplicated_stems(files: &[MappedFile]) -> Vec<(String, Vec<PathBuf>)> {
    let mut duplicated: Vec<(String, Vec<PathBuf>)> = Vec::new();
    for file in files {
        match duplicated.last_mut() {
            Some((stem, paths)) if *stem == file.stem => paths.push(file.path.clone()),
            _ => duplicated.push((file.stem.clone(), vec![file.path.clone()])),
        }
    }
    duplicated.retain(|(_, paths)| paths.len() > 1);
    duplicated
}

/// The symbol whose presence marks the library, and whose address names its file.
fn marker_symbol(library: Library) -> &'static str {
    match library {
        Library::Driver => "cuDriverGetVersion",
        Library::Nvrtc => "nvrtcVersion",
        Library::Cublas => "cublasGetProperty",
        Library::Cudnn => "cudnnGetVersion",
        Library::Nccl => "ncclGetVersion",
    }
}

/// The file the loader mapped for `handle`, from `dladdr` on the library's marker symbol.
fn loaded_path(library: Library, handle: &LoadedLibrary) -> Result<PathBuf, String> {
    let symbol = marker_symbol(library);
    // SAFETY: the symbol is only read as an address, never called.
    let address = unsafe { handle.get::<*const c_void>(symbol.as_bytes()) }
        .map(|symbol| *symbol)
        .map_err(|error| format!("loaded, but without the symbol {symbol}: {error}"))?;
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: `address` lies in a loaded object and `info` is valid for writing.
    let status = unsafe { libc::dladdr(address, info.as_mut_ptr()) };
    // SAFETY: dladdr filled `info` when it returned non-zero; it was zeroed before.
    let info = unsafe { info.assume_init() };
    if status == 0 || info.dli_fname.is_null() {
        return Err(format!("dladdr cannot name the file holding {symbol}"));
    }
    // SAFETY: dli_fname is a NUL-terminated string owned by the loader while the object is
    // loaded, and the handle keeps it loaded during this call.
    let name = unsafe { CStr::from_ptr(info.dli_fname) };
    Ok(PathBuf::from(name.to_string_lossy().into_owned()))
}

/// The library's version in its own terms, or an empty string when the call fails.
fn version(library: Library, handle: &LoadedLibrary) -> String {
    // SAFETY (every arm): the function types are those of the libraries' public headers
    // (cuda.h, nvrtc.h, cublas_api.h, cudnn.h, nccl.h); none needs prior initialization.
    unsafe {
        match library {
            Library::Driver => {
                let mut value: c_int = 0;
                call_status(handle, "cuDriverGetVersion", |f: FnIntOut| f(&mut value))
                    .map(|()| format!("{}.{}", value / 1000, value % 1000 / 10))
            }
            Library::Nvrtc => {
                let (mut major, mut minor): (c_int, c_int) = (0, 0);
                handle
                    .get::<unsafe extern "C" fn(*mut c_int, *mut c_int) -> c_int>(b"nvrtcVersion")
                    .ok()
                    .filter(|f| f(&mut major, &mut minor) == 0)
                    .map(|_| format!("{major}.{minor}"))
            }
            Library::Cublas => {
                let mut parts = [0 as c_int; 3];
                let ok = handle
                    .get::<unsafe extern "C" fn(c_int, *mut c_int) -> c_int>(b"cublasGetProperty")
                    .ok()
                    .is_some_and(|f| {
                        (0..3).all(|property| f(property, &mut parts[property as usize]) == 0)
                    });
                ok.then(|| format!("{}.{}.{}", parts[0], parts[1], parts[2]))
            }
            Library::Cudnn => handle
                .get::<unsafe extern "C" fn() -> usize>(b"cudnnGetVersion")
                .ok()
                .map(|f| f())
                .map(|value| format!("{}.{}.{}", value / 10000, value % 10000 / 100, value % 100)),
            Library::Nccl => {
                let mut value: c_int = 0;
                call_status(handle, "ncclGetVersion", |f: FnIntOut| f(&mut value))
                    .map(|()| format!("{}.{}.{}", value / 10000, value % 10000 / 100, value % 100))
            }
        }
    }
    .unwrap_or_default()
}

/// `int f(int *out)`, the shape of `cuDriverGetVersion` and `ncclGetVersion`.
type FnIntOut = unsafe extern "C" fn(*mut c_int) -> c_int;

/// Calls `symbol` through `call` and turns a non-zero status into `None`.
///
/// # Safety
/// `symbol` must have the type [`FnIntOut`].
unsafe fn call_status(
    handle: &LoadedLibrary,
    symbol: &str,
    call: impl FnOnce(FnIntOut) -> c_int,
) -> Option<()> {
    let function = *handle.get::<FnIntOut>(symbol.as_bytes()).ok()?;
    (call(function) == 0).then_some(())
}
