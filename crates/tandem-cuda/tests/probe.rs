//! The library probe: what it reports found and missing, and its messages.

mod common;

use tandem_cuda::probe::LIBRARY_PATH_ENV;
use tandem_cuda::{Library, Probe, SearchPath};

#[test]
fn an_empty_folder_without_the_system_search_reports_every_library_missing_by_name() {
    let empty = tempfile::tempdir().unwrap();
    let probe = Probe::run(&SearchPath::only(vec![empty.path().to_path_buf()]));
    for library in Library::ALL {
        let missing = probe.get(library).unwrap_err();
        assert_eq!(missing.library, library);
        assert_eq!(missing.names, library.candidate_names());
        let message = missing.to_string();
        let folder = empty.path().display().to_string();
        assert!(
            message.starts_with(&format!("{} not found: searched", library.file_stem())),
            "{message}"
        );
        assert!(message.contains(&folder), "{message}");
        // Nothing was there to load: dlopen's message is the "no such file" of the usual name.
        let usual = format!("{folder}/{}", library.usual_name());
        assert!(
            missing.dlopen_error.contains(&usual)
                && missing.dlopen_error.contains("No such file or directory"),
            "{message}"
        );
        assert!(
            message.contains(&format!("for {} and ", library.usual_name())),
            "{message}"
        );
    }
}

#[test]
fn the_names_tried_are_cudarcs_for_cuda_13() {
    let names = Library::Driver.candidate_names();
    assert_eq!(names.first().map(String::as_str), Some("libcuda.so"));
    assert!(names.contains(&"libcuda.so.1".to_string()));
    assert!(names.contains(&"libnvcuda.so".to_string()));
    assert!(Library::Nvrtc
        .candidate_names()
        .contains(&"libnvrtc.so.13".to_string()));
    for library in Library::ALL {
        assert!(library
            .candidate_names()
            .contains(&library.usual_name().to_string()));
    }
    // cudarc 0.19 does not try libnccl.so.2, NCCL's usual SONAME: only `libnccl.so` reaches it.
    assert!(!Library::Nccl
        .candidate_names()
        .contains(&"libnccl.so.2".to_string()));
}

#[test]
fn a_file_that_is_not_a_library_is_reported_with_dlopens_reason() {
    let folder = tempfile::tempdir().unwrap();
    std::fs::write(folder.path().join("libcudnn.so.9"), b"not an ELF file").unwrap();
    let probe = Probe::run(&SearchPath::only(vec![folder.path().to_path_buf()]));
    let missing = probe.get(Library::Cudnn).unwrap_err();
    assert!(
        missing.dlopen_error.contains("libcudnn.so.9")
            && !missing.dlopen_error.contains("No such file or directory"),
        "the reason should be the file that did not load: {}",
        missing.dlopen_error
    );
}

#[test]
fn with_the_system_search_a_missing_library_names_both_places() {
    let empty = tempfile::tempdir().unwrap();
    let probe = Probe::run(&SearchPath::from_list(&format!(
        "{}:",
        empty.path().display()
    )));
    assert_eq!(probe.search.folders, vec![empty.path().to_path_buf()]);
    let mut missing_any = false;
    for library in Library::ALL {
        if let Err(missing) = probe.get(library) {
            missing_any = true;
            let message = missing.to_string();
            assert!(
                message.contains(&format!("{LIBRARY_PATH_ENV}={}", empty.path().display())),
                "{message}"
            );
            assert!(message.contains("the system's search"), "{message}");
        }
    }
    if !missing_any {
        eprintln!("every CUDA library is installed here: no missing-library message to check");
    }
    // The report has one line per library.
    assert_eq!(probe.to_string().lines().count(), Library::ALL.len());
}

#[test]
fn nvrtc_found_through_the_library_path_is_the_file_cudarc_loads() {
    let Some(probe) = common::probe_with_nvrtc("nvrtc_found_through_the_library_path") else {
        return;
    };
    let nvrtc = probe.get(Library::Nvrtc).unwrap();
    assert!(nvrtc.path.is_absolute(), "{}", nvrtc.path.display());
    let file_name = nvrtc
        .path
        .file_name()
        .unwrap()
        .to_string_lossy()
        .to_string();
    assert!(file_name.starts_with("libnvrtc.so"), "{file_name}");
    assert!(Library::Nvrtc.candidate_names().contains(&nvrtc.loaded_as));
    assert!(
        nvrtc.version.starts_with("13."),
        "version {}",
        nvrtc.version
    );
    // A library preloaded from a TANDEM_CUDA_LIBRARY_PATH folder is what the bare name that
    // cudarc asks for resolves to (the loader matches it by SONAME before searching).
    if let Some(folder) = probe
        .search
        .folders
        .iter()
        .find(|folder| folder.join(&nvrtc.loaded_as).is_file())
    {
        assert_eq!(
            nvrtc.path.canonicalize().unwrap(),
            folder.join(&nvrtc.loaded_as).canonicalize().unwrap()
        );
    }
}

#[test]
fn mapped_files_are_listed_by_their_resolved_path_and_a_library_mapped_twice_is_named() {
    use std::path::PathBuf;
    use tandem_cuda::probe::{duplicated_stems, mapped_cuda_files, MappedFile};
    let file = |stem: &str, path: &str| MappedFile {
        stem: stem.to_string(),
        path: PathBuf::from(path),
    };
    let files = [
        file("libcublas", "/toolkit/libcublas.so.13"),
        file("libcublas", "/wheel/libcublas.so.13"),
        file("libcublasLt", "/wheel/libcublasLt.so.13"),
    ];
    assert_eq!(
        duplicated_stems(&files),
        vec![(
            "libcublas".to_string(),
            vec![
                PathBuf::from("/toolkit/libcublas.so.13"),
                PathBuf::from("/wheel/libcublas.so.13")
            ]
        )]
    );
    // In this process: a library the probe found is listed once, as the file it resolves to.
    let probe = Probe::process();
    let Ok(nvrtc) = probe.get(Library::Nvrtc) else {
        eprintln!("mapped files: skipped the process's own list, {probe}");
        return;
    };
    let mapped = mapped_cuda_files();
    let nvrtc_files: Vec<&MappedFile> = mapped
        .iter()
        .filter(|file| file.stem == "libnvrtc")
        .collect();
    assert_eq!(nvrtc_files.len(), 1, "{mapped:?}");
    assert_eq!(nvrtc_files[0].path, nvrtc.resolved);
}
