//! NCCL's unique id: created only after the probe found libnccl, else an error naming it.

use tandem_cuda::nccl::{create_unique_id, unique_id_from_bytes, NcclError, UNIQUE_ID_BYTES};
use tandem_cuda::{Library, Probe, SearchPath};

#[test]
fn without_libnccl_the_id_is_an_error_naming_it_not_a_panic() {
    let empty = tempfile::tempdir().unwrap();
    let probe = Probe::run(&SearchPath::only(vec![empty.path().to_path_buf()]));
    match create_unique_id(&probe) {
        Err(NcclError::MissingLibrary(missing)) => {
            assert_eq!(missing.library, Library::Nccl);
            let message = missing.to_string();
            assert!(
                message.starts_with("libnccl not found: searched"),
                "{message}"
            );
            assert!(
                message.contains(&empty.path().display().to_string()),
                "{message}"
            );
        }
        other => panic!("expected libnccl missing, got {other:?}"),
    }
}

#[test]
fn received_bytes_become_the_same_nccl_unique_id() {
    let bytes: [u8; UNIQUE_ID_BYTES] = std::array::from_fn(|index| (index * 7 + 200) as u8);
    let id = unique_id_from_bytes(&bytes);
    let back: Vec<u8> = id.internal.iter().map(|&byte| byte as u8).collect();
    assert_eq!(back, bytes.to_vec());
}
