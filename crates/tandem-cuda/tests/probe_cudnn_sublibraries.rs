//! cuDNN 9's sub-libraries are preloaded from beside a `libcudnn.so.9` found in a folder of
//! `TANDEM_CUDA_LIBRARY_PATH`, because `libcudnn.so.9` opens them by bare name.
//!
//! Alone in its test binary: it loads libraries named like cuDNN's into the process.

use std::ffi::CString;
use std::path::Path;
use std::process::Command;

use tandem_cuda::{Library, Probe, SearchPath};

/// Builds a shared library named `file` (its SONAME too) from C source, linked against the
/// libraries in `needs` found in `folder`.
fn build_library(folder: &Path, file: &str, source: &str, needs: &[&str]) {
    let source_path = folder.join(format!("{file}.c"));
    std::fs::write(&source_path, source).unwrap();
    let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
    let mut command = Command::new(&compiler);
    command
        .args(["-x", "c", "-shared", "-fPIC", "-o"])
        .arg(folder.join(file))
        .arg(format!("-Wl,-soname,{file}"))
        .arg(&source_path)
        .arg(format!("-L{}", folder.display()));
    for needed in needs {
        command.arg(format!("-l:{needed}"));
    }
    let output = command
        .output()
        .unwrap_or_else(|error| panic!("this test needs a C compiler ({compiler}): {error}"));
    assert!(
        output.status.success(),
        "{compiler} failed on {file}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Whether a library with this SONAME is loaded in the process, and if so the value of its
/// `marker` function.
fn loaded_marker(soname: &str, marker: &str) -> Option<i32> {
    let name = CString::new(soname).unwrap();
    // SAFETY: RTLD_NOLOAD only looks the name up among loaded objects; it loads nothing.
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    let symbol = CString::new(marker).unwrap();
    // SAFETY: `handle` is a live handle from dlopen above.
    let function = unsafe { libc::dlsym(handle, symbol.as_ptr()) };
    assert!(!function.is_null(), "{soname} is loaded without {marker}");
    // SAFETY: the marker functions built below have the type `int f(void)`.
    let value =
        unsafe { std::mem::transmute::<*mut libc::c_void, extern "C" fn() -> i32>(function)() };
    // SAFETY: balances the reference RTLD_NOLOAD took.
    unsafe { libc::dlclose(handle) };
    Some(value)
}

#[test]
fn cudnn_sub_libraries_beside_a_library_path_cudnn_are_preloaded_in_dependency_order() {
    let folder = tempfile::tempdir().unwrap();
    let folder = folder.path();
    // `_cnn` links to `_ops` and neither has a RUNPATH, so `_cnn` loads only once `_ops` is
    // loaded; it sorts first, so the first round fails it.
    build_library(
        folder,
        "libcudnn_ops.so.9",
        "int tandem_ops_marker(void) { return 3; }",
        &[],
    );
    build_library(
        folder,
        "libcudnn_cnn.so.9",
        "int tandem_ops_marker(void);\n\
         int tandem_cnn_marker(void) { return tandem_ops_marker() + 1; }",
        &["libcudnn_ops.so.9"],
    );
    // cudnnGetVersion 90100 is version 9.1.0, whose major names the sub-libraries' suffix.
    build_library(
        folder,
        "libcudnn.so.9",
        "unsigned long cudnnGetVersion(void) { return 90100; }",
        &[],
    );
    // A file for another major version is not opened.
    build_library(
        folder,
        "libcudnn_adv.so.8",
        "int tandem_adv_marker(void) { return 8; }",
        &[],
    );

    let probe = Probe::run(&SearchPath::only(vec![folder.to_path_buf()]));
    let cudnn = probe
        .get(Library::Cudnn)
        .unwrap_or_else(|missing| panic!("{missing}"));
    assert_eq!(cudnn.version, "9.1.0");
    assert_eq!(
        loaded_marker("libcudnn_ops.so.9", "tandem_ops_marker"),
        Some(3)
    );
    assert_eq!(
        loaded_marker("libcudnn_cnn.so.9", "tandem_cnn_marker"),
        Some(4)
    );
    assert_eq!(
        loaded_marker("libcudnn_adv.so.8", "tandem_adv_marker"),
        None
    );
}
