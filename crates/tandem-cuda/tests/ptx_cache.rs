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
    let ptx = ".version 9.0\n.target sm_90\n";
    let cubin = [0x7f, b'E', b'L', b'F', 0, 1];
    let path = cache.store(&entry, ptx, &cubin).unwrap();
    assert_eq!(path, cache.path(&entry));
    assert_eq!(cache.load(&entry), Some((ptx.to_string(), cubin.to_vec())));
    assert_eq!(
        cache.load(&key("other", GpuArch::SM_90, "nvrtc 13.0")),
        None
    );
    let mut files: Vec<String> = std::fs::read_dir(&cache.dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    let ptx_name = entry.file_name();
    assert_eq!(files, [ptx_name.replace(".ptx", ".cubin"), ptx_name]);
    // Storing again replaces the entry in place.
    cache.store(&entry, "new", b"bin").unwrap();
    assert_eq!(
        cache.load(&entry),
        Some(("new".to_string(), b"bin".to_vec()))
    );
    assert_eq!(std::fs::read_dir(&cache.dir).unwrap().count(), 2);
    // An entry missing its CUBIN (e.g. written by a build that kept only PTX) is a miss.
    std::fs::remove_file(cache.cubin_path(&entry)).unwrap();
    assert_eq!(cache.load(&entry), None);
}

#[test]
fn a_cache_folder_that_cannot_be_made_is_an_error_naming_it() {
    let folder = tempfile::tempdir().unwrap();
    let file = folder.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let cache = PtxCache::new(file.join("ptx"));
    let error = cache
        .store(&key("s", GpuArch::SM_90, "c"), "ptx", b"cubin")
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
    assert_eq!(GpuArch::SM_90.nvrtc_option(), "--gpu-architecture=sm_90");
    for bad in ["90", "sm_9", "sm_", "sm_9a", "compute_90"] {
        let error = bad.parse::<GpuArch>().unwrap_err().to_string();
        assert!(error.contains(bad) && error.contains("sm_XY"), "{error}");
    }
}
