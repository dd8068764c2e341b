//! The PTX cache: its keys and its atomic writes. No NVRTC needed.

use tandem_cuda::ptx_cache::CacheKey;
use tandem_cuda::{GpuArch, PtxCache};

fn key<'a>(source: &'a str, arch: GpuArch, compiler: &'a str) -> CacheKey<'a> {
    CacheKey {
        kernel: "pooling",
        source,
        arch,
        compiler,
    }
}

#[test]
fn the_key_changes_with_source_architecture_and_compiler_only() {
    let sm_80 = "sm_80".parse::<GpuArch>().unwrap();
    let base = key("a", GpuArch::SM_90, "nvrtc 13.0");
    assert_eq!(
        base.digest(),
        key("a", GpuArch::SM_90, "nvrtc 13.0").digest()
    );
    assert_eq!(base.digest().len(), 32);
    for other in [
        key("b", GpuArch::SM_90, "nvrtc 13.0"),
        key("a", sm_80, "nvrtc 13.0"),
        key("a", GpuArch::SM_90, "nvrtc 13.1"),
        // Parts do not run into each other.
        key("a\0nvrtc 13.0", GpuArch::SM_90, ""),
    ] {
        assert_ne!(base.digest(), other.digest());
    }
    assert_eq!(
        base.file_name(),
        format!("pooling-sm_90-{}.ptx", base.digest())
    );
}

#[test]
fn a_stored_entry_is_read_back_and_leaves_no_temporary_file() {
    let folder = tempfile::tempdir().unwrap();
    let cache = PtxCache::new(folder.path().join("nested/ptx"));
    let entry = key("source", GpuArch::SM_90, "nvrtc 13.0");
    assert_eq!(cache.load(&entry), None);
    let path = cache
        .store(&entry, ".version 9.0\n.target sm_90\n")
        .unwrap();
    assert_eq!(path, cache.path(&entry));
    assert_eq!(
        cache.load(&entry).as_deref(),
        Some(".version 9.0\n.target sm_90\n")
    );
    assert_eq!(
        cache.load(&key("other", GpuArch::SM_90, "nvrtc 13.0")),
        None
    );
    let files = std::fs::read_dir(&cache.dir).unwrap().count();
    assert_eq!(files, 1);
    // Storing again replaces the entry in place.
    cache.store(&entry, "new").unwrap();
    assert_eq!(cache.load(&entry).as_deref(), Some("new"));
    assert_eq!(std::fs::read_dir(&cache.dir).unwrap().count(), 1);
}

#[test]
fn a_cache_folder_that_cannot_be_made_is_an_error_naming_it() {
    let folder = tempfile::tempdir().unwrap();
    let file = folder.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let cache = PtxCache::new(file.join("ptx"));
    let error = cache
        .store(&key("s", GpuArch::SM_90, "c"), "ptx")
        .unwrap_err()
        .to_string();
    assert!(
        error.contains(&file.join("ptx").display().to_string()),
        "{error}"
    );
    assert!(error.contains("cannot create the folder"), "{error}");
}

#[test]
fn architectures_parse_and_print_as_nvrtc_names_them() {
    assert_eq!("sm_90".parse::<GpuArch>().unwrap(), GpuArch::SM_90);
    let blackwell = "sm_120".parse::<GpuArch>().unwrap();
    assert_eq!((blackwell.major, blackwell.minor), (12, 0));
    assert_eq!(blackwell.to_string(), "sm_120");
    assert_eq!(
        GpuArch::SM_90.nvrtc_option(),
        "--gpu-architecture=compute_90"
    );
    for bad in ["90", "sm_9", "sm_", "sm_9a", "compute_90"] {
        let error = bad.parse::<GpuArch>().unwrap_err().to_string();
        assert!(error.contains(bad) && error.contains("sm_XY"), "{error}");
    }
}
