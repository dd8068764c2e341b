//! Buffers in shared memory, for a one-copy all-reduce between the ranks of one host.
//!
//! A [`SharedBuffer`] made by [`ProcessGroup::shared_buffer`](crate::ProcessGroup::shared_buffer)
//! lives in an anonymous memory file (memfd) that every other rank maps read-only. An
//! all-reduce on it sends no data through sockets: rank `r` combines chunk `r` straight from
//! its peers' buffers into its own, and after a barrier copies every other chunk from the rank
//! that combined it. Each byte then crosses the memory bus about 2.5 times per rank, against
//! about 6 times through a ring over Unix sockets (copy into the kernel, out again, combine).
//!
//! A peer opens a rank's memory file through `/proc/<pid>/fd/<fd>`. That needs the same kernel,
//! the same PID namespace and permission to inspect the owner (same user, no stricter ptrace
//! policy); a random nonce in the file's first page proves the peer opened the right file.
//! When any rank cannot map any peer's file, every rank keeps its buffer on the heap and
//! all-reduces it through the ring instead.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;

use crate::auth::fill_random;
use crate::element::{chunk_range, combine_slices, Element, ReduceOp};
use crate::transport::boot_id;

/// Bytes before the data in a memory file: one page, holding the nonce.
const HEADER_BYTES: usize = 4096;
/// Bytes of the nonce that identifies a memory file.
const NONCE_BYTES: usize = 16;
/// Elements combined per pass when more than two ranks share a chunk (fits in L1/L2 cache).
const PIECE_ELEMENTS: usize = 8192;

/// A buffer that collectives of its process group can reach without copying through sockets.
///
/// It dereferences to a slice like a `Vec`. Only
/// [`all_reduce_shared`](crate::ProcessGroup::all_reduce_shared) on the group that made it
/// uses the shared path; every other use sees plain memory.
pub struct SharedBuffer<T: Element> {
    /// The position of this buffer among the group's shared buffers; equal on every rank.
    id: u64,
    len: usize,
    storage: Storage<T>,
}

enum Storage<T> {
    /// Not shared: all-reduced through the ring.
    Heap(Vec<T>),
    /// This rank's memory file and its peers' (`None` at this rank's own index).
    Mapped {
        own: Mapping,
        peers: Vec<Option<Mapping>>,
        /// Two pieces of scratch for folding more than two ranks; empty for two.
        scratch: [Vec<T>; 2],
    },
}

impl<T: Element> SharedBuffer<T> {
    /// A zero-filled buffer on the heap, outside any group's shared memory: all-reducing it
    /// goes through the ring, and every rank must pass such a buffer for the same call.
    pub fn heap(len: usize) -> SharedBuffer<T> {
        SharedBuffer {
            id: u64::MAX,
            len,
            storage: Storage::Heap(vec![T::zeroed(); len]),
        }
    }

    /// Whether peers read this buffer directly (else all-reduces go through the ring).
    pub fn is_shared(&self) -> bool {
        matches!(self.storage, Storage::Mapped { .. })
    }

    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    pub(crate) fn with_storage(id: u64, len: usize, mapped: Option<MappedParts>) -> Self {
        let storage = match mapped {
            None => Storage::Heap(vec![T::zeroed(); len]),
            Some(MappedParts { own, peers }) => {
                let scratch_len = match peers.len() > 2 {
                    true => PIECE_ELEMENTS.min(len),
                    false => 0,
                };
                Storage::Mapped {
                    own,
                    peers,
                    scratch: [
                        vec![T::zeroed(); scratch_len],
                        vec![T::zeroed(); scratch_len],
                    ],
                }
            }
        };
        SharedBuffer { id, len, storage }
    }

    /// The heap vector, when the buffer is not shared.
    pub(crate) fn heap_values(&mut self) -> Option<&mut Vec<T>> {
        match &mut self.storage {
            Storage::Heap(values) => Some(values),
            Storage::Mapped { .. } => None,
        }
    }

    /// Combines chunk `rank` of every rank's buffer into this rank's, in the ring's order
    /// (ranks `rank + 1`, `rank + 2`, ... then `rank` itself), so the result is bit for bit
    /// what the ring computes; finishes `Mean` by dividing.
    pub(crate) fn combine_own_chunk(&mut self, rank: usize, op: ReduceOp) {
        let len = self.len;
        let Storage::Mapped {
            own,
            peers,
            scratch,
        } = &mut self.storage
        else {
            return;
        };
        let world_size = peers.len();
        let chunk = chunk_range(len, world_size, rank);
        // SAFETY: between the caller's barriers no rank writes chunk `rank` except this one,
        // and every mapping holds at least `len` elements after its header.
        let own_values = unsafe { own.data_mut::<T>(len) };
        let peer_values: Vec<&[T]> = (1..world_size)
            .filter_map(|offset| peers[(rank + offset) % world_size].as_ref())
            .map(|mapping| unsafe { mapping.data::<T>(len) })
            .collect();
        let [accumulated, next] = scratch;
        let mut start = chunk.start;
        while start < chunk.end {
            let end = (start + PIECE_ELEMENTS).min(chunk.end);
            let target = &mut own_values[start..end];
            match peer_values.as_slice() {
                [only] => combine_slices(op, target, &only[start..end]),
                [first, rest @ ..] => {
                    let accumulated = &mut accumulated[..end - start];
                    let next = &mut next[..end - start];
                    accumulated.copy_from_slice(&first[start..end]);
                    for values in rest {
                        next.copy_from_slice(&values[start..end]);
                        combine_slices(op, next, accumulated);
                        accumulated.copy_from_slice(next);
                    }
                    combine_slices(op, target, accumulated);
                }
                [] => {}
            }
            if op == ReduceOp::Mean {
                target
                    .iter_mut()
                    .for_each(|value| *value = value.divide(world_size));
            }
            start = end;
        }
    }

    /// Copies every other rank's chunk of the result from the rank that combined it.
    pub(crate) fn copy_peer_chunks(&mut self) {
        let len = self.len;
        let Storage::Mapped { own, peers, .. } = &mut self.storage else {
            return;
        };
        let world_size = peers.len();
        // SAFETY: between the caller's barriers every chunk is final and nobody writes.
        let own_values = unsafe { own.data_mut::<T>(len) };
        for (peer, mapping) in peers.iter().enumerate() {
            let Some(mapping) = mapping else { continue };
            let chunk = chunk_range(len, world_size, peer);
            let peer_values = unsafe { mapping.data::<T>(len) };
            own_values[chunk.clone()].copy_from_slice(&peer_values[chunk]);
        }
    }
}

impl<T: Element> std::ops::Deref for SharedBuffer<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        match &self.storage {
            Storage::Heap(values) => values,
            // SAFETY: the mapping holds `len` elements after its header; peers only read it.
            Storage::Mapped { own, .. } => unsafe { own.data::<T>(self.len) },
        }
    }
}

impl<T: Element> std::ops::DerefMut for SharedBuffer<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match &mut self.storage {
            Storage::Heap(values) => values,
            // SAFETY: as in `deref`; `&mut self` keeps this process's other users away, and
            // peers read it only inside an all-reduce, which also takes `&mut self`.
            Storage::Mapped { own, .. } => unsafe { own.data_mut::<T>(self.len) },
        }
    }
}

impl<T: Element> std::fmt::Debug for SharedBuffer<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("SharedBuffer")
            .field("id", &self.id)
            .field("len", &self.len)
            .field("shared", &self.is_shared())
            .finish()
    }
}

/// A rank's own mapped file and its peers', ready to become a [`SharedBuffer`].
pub(crate) struct MappedParts {
    pub own: Mapping,
    pub peers: Vec<Option<Mapping>>,
}

/// A memory mapping, unmapped on drop.
#[derive(Debug)]
pub(crate) struct Mapping {
    address: NonNull<u8>,
    bytes: usize,
}

// SAFETY: the mapping is plain memory owned by this value; access goes through `&`/`&mut`.
unsafe impl Send for Mapping {}
// SAFETY: shared access only reads.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `bytes` of `fd`, read-write or read-only, with the pages faulted in up front.
    fn map(fd: &OwnedFd, bytes: usize, writable: bool) -> std::io::Result<Mapping> {
        let protection = match writable {
            true => libc::PROT_READ | libc::PROT_WRITE,
            false => libc::PROT_READ,
        };
        // SAFETY: a fresh shared mapping of a file we hold open; checked for failure below.
        let address = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                bytes,
                protection,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                0,
            )
        };
        if address == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        NonNull::new(address.cast::<u8>())
            .map(|address| Mapping { address, bytes })
            .ok_or_else(|| std::io::Error::other("mmap returned a null address"))
    }

    fn header(&self) -> &[u8] {
        // SAFETY: every mapping is at least HEADER_BYTES long.
        unsafe { std::slice::from_raw_parts(self.address.as_ptr(), NONCE_BYTES) }
    }

    /// The `len` elements after the header.
    ///
    /// # Safety
    /// The mapping must hold `len` elements after its header, and no one may write them while
    /// the slice lives.
    unsafe fn data<T: Element>(&self, len: usize) -> &[T] {
        debug_assert!(HEADER_BYTES + len * std::mem::size_of::<T>() <= self.bytes);
        std::slice::from_raw_parts(self.address.as_ptr().add(HEADER_BYTES).cast::<T>(), len)
    }

    /// The `len` elements after the header, writable.
    ///
    /// # Safety
    /// As for [`data`](Self::data), and the mapping must be writable.
    #[allow(clippy::mut_from_ref)]
    unsafe fn data_mut<T: Element>(&self, len: usize) -> &mut [T] {
        debug_assert!(HEADER_BYTES + len * std::mem::size_of::<T>() <= self.bytes);
        std::slice::from_raw_parts_mut(self.address.as_ptr().add(HEADER_BYTES).cast::<T>(), len)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped; no slice into it outlives `self`.
        unsafe {
            libc::munmap(self.address.as_ptr().cast(), self.bytes);
        }
    }
}

/// This rank's new memory file, open until every peer has mapped it.
pub(crate) struct OwnFile {
    fd: OwnedFd,
    mapping: Mapping,
    nonce: [u8; NONCE_BYTES],
}

impl OwnFile {
    /// Creates and maps a zero-filled memory file for `len` elements of `T`. The memory is
    /// reserved up front, so running out of it fails here rather than faulting later.
    pub(crate) fn create<T: Element>(len: usize) -> Result<OwnFile, String> {
        let bytes = file_bytes::<T>(len)?;
        let name = CString::new("tandem-shared-buffer").map_err(|error| error.to_string())?;
        // SAFETY: a plain system call with a valid C string.
        let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
        if raw < 0 {
            return Err(os_error("memfd_create"));
        }
        // SAFETY: `raw` is a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let size =
            libc::off_t::try_from(bytes).map_err(|_| format!("{bytes} bytes is too large"))?;
        // SAFETY: plain system calls on a descriptor we own.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(os_error("ftruncate the memory file"));
        }
        let reserved = unsafe { libc::fallocate(fd.as_raw_fd(), 0, 0, size) };
        if reserved != 0 {
            return Err(os_error(&format!("reserve {bytes} bytes of shared memory")));
        }
        let mapping = Mapping::map(&fd, bytes, true)
            .map_err(|error| format!("map the memory file: {error}"))?;
        let mut nonce = [0u8; NONCE_BYTES];
        fill_random(&mut nonce).map_err(|error| error.to_string())?;
        // SAFETY: the mapping is writable and at least HEADER_BYTES long.
        unsafe {
            std::ptr::copy_nonoverlapping(nonce.as_ptr(), mapping.address.as_ptr(), NONCE_BYTES)
        };
        Ok(OwnFile { fd, mapping, nonce })
    }

    /// What a peer needs to map this file: "`boot id` `pid` `fd` `nonce`".
    pub(crate) fn endpoint(&self) -> String {
        let nonce: String = self
            .nonce
            .iter()
            .map(|byte| format!("{byte:02x}"))
            .collect();
        format!(
            "{} {} {} {nonce}",
            boot_id().unwrap_or_default(),
            std::process::id(),
            self.fd.as_raw_fd()
        )
    }

    /// The mapping, once peers have opened the file (closing the descriptor keeps it).
    pub(crate) fn into_mapping(self) -> Mapping {
        self.mapping
    }
}

/// Maps a peer's memory file read-only from its published endpoint, checking its size and
/// nonce; the error says why it cannot be used.
pub(crate) fn map_peer<T: Element>(endpoint: &str, len: usize) -> Result<Mapping, String> {
    let fields: Vec<&str> = endpoint.split(' ').collect();
    let [their_boot, pid, fd, nonce] = fields[..] else {
        return Err(format!("malformed endpoint {endpoint:?}"));
    };
    if boot_id().as_deref() != Some(their_boot) {
        return Err("it runs under another kernel".into());
    }
    let path = format!("/proc/{pid}/fd/{fd}");
    let file = std::fs::File::open(&path).map_err(|error| format!("open {path}: {error}"))?;
    let bytes = file_bytes::<T>(len)?;
    let size = file
        .metadata()
        .map_err(|error| format!("stat {path}: {error}"))?
        .len();
    if size < bytes as u64 {
        return Err(format!("{path} holds {size} bytes, expected {bytes}"));
    }
    let fd = OwnedFd::from(file);
    let mapping =
        Mapping::map(&fd, bytes, false).map_err(|error| format!("map {path}: {error}"))?;
    let found: String = mapping
        .header()
        .iter()
        .map(|byte| format!("{byte:02x}"))
        .collect();
    if found != nonce {
        return Err(format!("{path} is not the file the peer published"));
    }
    Ok(mapping)
}

/// The size of a memory file for `len` elements of `T`.
fn file_bytes<T: Element>(len: usize) -> Result<usize, String> {
    len.checked_mul(std::mem::size_of::<T>())
        .and_then(|bytes| bytes.checked_add(HEADER_BYTES))
        .ok_or_else(|| format!("{len} elements do not fit in memory"))
}

fn os_error(what: &str) -> String {
    format!("{what}: {}", std::io::Error::last_os_error())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_maps_the_published_file_and_sees_the_owners_writes() {
        let own = OwnFile::create::<f32>(10).expect("memory file");
        let peer = map_peer::<f32>(&own.endpoint(), 10).expect("peer mapping");
        let own = own.into_mapping();
        // SAFETY: both mappings hold 10 elements; nothing else touches them in this test.
        unsafe {
            own.data_mut::<f32>(10)[7] = 2.5;
            assert_eq!(peer.data::<f32>(10)[7], 2.5);
        }
    }

    #[test]
    fn endpoints_that_cannot_be_used_are_refused_with_the_reason() {
        let own = OwnFile::create::<f32>(4).expect("memory file");
        let endpoint = own.endpoint();
        let fields: Vec<&str> = endpoint.split(' ').collect();
        let [boot, pid, fd, nonce] = fields[..] else {
            panic!("endpoint {endpoint:?}")
        };

        let error = map_peer::<f32>("garbage", 4).expect_err("malformed");
        assert_eq!(error, "malformed endpoint \"garbage\"");

        let other_kernel = format!("not-{boot} {pid} {fd} {nonce}");
        let error = map_peer::<f32>(&other_kernel, 4).expect_err("other kernel");
        assert_eq!(error, "it runs under another kernel");

        let wrong_nonce = format!("{boot} {pid} {fd} {}", "0".repeat(nonce.len()));
        let error = map_peer::<f32>(&wrong_nonce, 4).expect_err("wrong nonce");
        assert_eq!(
            error,
            format!("/proc/{pid}/fd/{fd} is not the file the peer published")
        );

        let error = map_peer::<f32>(&endpoint, 5000).expect_err("too small");
        assert_eq!(
            error,
            format!("/proc/{pid}/fd/{fd} holds 4112 bytes, expected 24096")
        );

        let closed = format!("{boot} {pid} 987654 {nonce}");
        let error = map_peer::<f32>(&closed, 4).expect_err("no such descriptor");
        assert!(
            error.starts_with(&format!("open /proc/{pid}/fd/987654: ")),
            "{error}"
        );
    }
}
