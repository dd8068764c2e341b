//! One release of each library: with the GPU check's search path
//! (`scripts/gpu-check/library-path.sh`), a library that two folders hold (PyTorch's wheel and
//! the toolkit) is loaded from the first folder only, and the probe reports that file; with the
//! toolkit's folder ahead of the links, the probe refuses
//! the second copy by name instead of loading both.
//!
//! The loader reads `LD_LIBRARY_PATH` when a process starts, so each case runs in a child:
//! this test binary again, running only `child_reports_the_probe` with the case's paths.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Set in the child, which then prints what its probe found.
const CHILD_ENV: &str = "TANDEM_PROBE_SEARCH_ORDER_CHILD";

/// Builds a stand-in `libcublas.so.13` (its SONAME too) in `folder` whose `cublasGetProperty`
/// reports version `major.minor.0`.
fn build_cublas(folder: &Path, minor: i32) {
    std::fs::create_dir_all(folder).unwrap();
    let source = folder.join("cublas.c");
    std::fs::write(
        &source,
        format!(
            "int cublasGetProperty(int type, int *value) {{\n\
             \x20   static const int parts[3] = {{13, {minor}, 0}};\n\
             \x20   *value = parts[type];\n\
             \x20   return 0;\n\
             }}\n"
        ),
    )
    .unwrap();
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let output = Command::new(&compiler)
        .args([
            "-x",
            "c",
            "-shared",
            "-fPIC",
            "-Wl,-soname,libcublas.so.13",
            "-o",
        ])
        .arg(folder.join("libcublas.so.13"))
        .arg(&source)
        .output()
        .unwrap_or_else(|error| panic!("this test needs a C compiler ({compiler}): {error}"));
    assert!(
        output.status.success(),
        "{compiler}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// The folders of the case: PyTorch's wheel (`libcublas.so.13`, version 13.1) and the toolkit
/// (its own `libcublas.so.13`, version 13.0, and the unversioned link to it).
fn two_releases(root: &Path) -> (PathBuf, PathBuf) {
    let wheel = root.join("site-packages/nvidia/cublas/lib");
    let toolkit = root.join("cuda/lib64");
    build_cublas(&wheel, 1);
    build_cublas(&toolkit, 0);
    std::os::unix::fs::symlink("libcublas.so.13", toolkit.join("libcublas.so")).unwrap();
    (wheel, toolkit)
}

/// The repository's scripts folder.
fn gpu_check_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/gpu-check/library-path.sh")
}

/// The two assignments `library-path.sh` prints for `folders`, with links in `aliases`.
fn search_path(aliases: &Path, folders: &[&Path]) -> (String, String) {
    let output = Command::new("bash")
        .arg(gpu_check_script())
        .arg(aliases)
        .args(folders)
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .expect("bash");
    assert!(
        output.status.success(),
        "library-path.sh: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let text = String::from_utf8(output.stdout).unwrap();
    let value = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {text}"))
            .to_string()
    };
    (value("TANDEM_CUDA_LIBRARY_PATH"), value("LD_LIBRARY_PATH"))
}

/// The child's report with these paths: its probe's libcublas line, and the libraries it had
/// mapped from more than one file (`mapped twice: ...`, empty when none).
fn probe_in_child(library_path: &str, ld_library_path: &str) -> (String, String) {
    let output = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_reports_the_probe", "--nocapture"])
        .env(CHILD_ENV, "1")
        .env("TANDEM_CUDA_LIBRARY_PATH", library_path)
        .env("LD_LIBRARY_PATH", ld_library_path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(output.status.success(), "child failed: {stdout}");
    let line = |prefix: &str| {
        stdout
            .lines()
            .find(|line| line.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix} line from the child: {stdout}"))
            .to_string()
    };
    (line("libcublas"), line("mapped twice:"))
}

#[test]
fn the_gpu_checks_search_path_loads_each_library_from_its_first_folder_only() {
    let root = tempfile::tempdir().unwrap();
    let (wheel, toolkit) = two_releases(root.path());
    let aliases = root.path().join("aliases");
    let (library_path, ld_library_path) = search_path(&aliases, &[&wheel, &toolkit]);
    assert!(library_path.starts_with(&format!("{}:", aliases.display())));
    assert!(ld_library_path.starts_with(&format!("{}:", aliases.display())));
    for name in ["libcublas.so", "libcublas.so.13"] {
        assert_eq!(
            std::fs::canonicalize(aliases.join(name)).unwrap(),
            std::fs::canonicalize(wheel.join("libcublas.so.13")).unwrap(),
            "{name} links to the wheel's file"
        );
    }
    let (line, mapped_twice) = probe_in_child(&library_path, &ld_library_path);
    let wheel_file = std::fs::canonicalize(wheel.join("libcublas.so.13")).unwrap();
    assert_eq!(
        line,
        format!(
            "libcublas: {} -> {} (version 13.1.0)",
            aliases.join("libcublas.so").display(),
            wheel_file.display()
        )
    );
    assert_eq!(mapped_twice, "mapped twice: []");
}

#[test]
fn a_toolkit_folder_ahead_of_the_links_is_refused_naming_both_files() {
    let root = tempfile::tempdir().unwrap();
    let (wheel, toolkit) = two_releases(root.path());
    // The order the GPU check had: the wheel first for the probe, the toolkit first for the
    // loader's bare-name search.
    let library_path = format!("{}:{}", wheel.display(), toolkit.display());
    let ld_library_path = toolkit.display().to_string();
    let (line, mapped_twice) = probe_in_child(&library_path, &ld_library_path);
    // The refused files are closed again: cudarc never runs on two releases.
    assert_eq!(mapped_twice, "mapped twice: []");
    assert_eq!(
        line,
        format!(
            "libcublas: libcublas not found: searched TANDEM_CUDA_LIBRARY_PATH={library_path}, \
             then the system's search (LD_LIBRARY_PATH={ld_library_path}, ld.so.cache, /lib, \
             /usr/lib) for libcublas.so.13 and {} other names; dlopen said: libcublas.so: two \
             files of libcublas would be loaded: {} from TANDEM_CUDA_LIBRARY_PATH, and {} for \
             the bare name cudarc asks for; put the folder of the first (or a folder of links \
             to it) first on LD_LIBRARY_PATH",
            tandem_cuda::Library::Cublas.candidate_names().len() - 1,
            wheel.join("libcublas.so.13").display(),
            toolkit.join("libcublas.so").display(),
        )
    );
}

/// Not a test of its own: the child of the tests above prints its probe's lines and the CUDA
/// libraries mapped into it from more than one file.
#[test]
fn child_reports_the_probe() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let probe = tandem_cuda::Probe::run(&tandem_cuda::SearchPath::from_env());
    for line in probe.to_string().lines() {
        println!("{line}");
    }
    let mapped = tandem_cuda::probe::mapped_cuda_files();
    let duplicated = tandem_cuda::probe::duplicated_stems(&mapped);
    println!("mapped twice: {duplicated:?}");
}
