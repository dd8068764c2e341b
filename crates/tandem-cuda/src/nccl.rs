//! NCCL, as far as it is needed before a communicator exists: rank 0's unique id.
//!
//! Rank 0 creates the id with `ncclGetUniqueId` and the job's store carries it to the other
//! ranks (`tandem_dist::publish_nccl_unique_id`), which need it to join the communicator.
//! `cudarc` panics when libnccl is missing, so the id is created only after the probe found it.

use crate::probe::{Library, MissingLibrary, Probe};

/// The size of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES` of nccl.h).
pub const UNIQUE_ID_BYTES: usize = 128;

// The bytes handed between ranks are exactly cudarc's `ncclUniqueId`.
const _: () = assert!(std::mem::size_of::<cudarc::nccl::sys::ncclUniqueId>() == UNIQUE_ID_BYTES);

/// Why no NCCL unique id could be created.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NcclError {
    /// libnccl was not found.
    #[error(transparent)]
    MissingLibrary(#[from] MissingLibrary),
    /// NCCL returned an error.
    #[error("ncclGetUniqueId failed: {0}")]
    Call(String),
}

/// Creates an NCCL unique id (rank 0's part), or says why not: libnccl missing (named with the
/// places searched) or NCCL's own error.
pub fn create_unique_id(probe: &Probe) -> Result<[u8; UNIQUE_ID_BYTES], NcclError> {
    probe.require(Library::Nccl)?;
    let id = cudarc::nccl::result::get_uniqueid()
        .map_err(|error| NcclError::Call(format!("{:?}", error.0)))?;
    Ok(id.internal.map(|byte| byte as u8))
}

/// The `ncclUniqueId` of bytes received from rank 0, for `ncclCommInitRank`.
pub fn unique_id_from_bytes(bytes: &[u8; UNIQUE_ID_BYTES]) -> cudarc::nccl::sys::ncclUniqueId {
    cudarc::nccl::sys::ncclUniqueId {
        internal: bytes.map(|byte| byte as std::ffi::c_char),
    }
}
