//! The end of a zip archive, read before the zip crate sees the file: the end-of-central-
//! directory record (and the zip64 one) declares how many entries the central directory
//! holds, and the zip crate allocates and loops for that many. An archive that declares more
//! entries than its file can hold, or more than any `torch.save` checkpoint has, is refused
//! here, having read at most the last 64 KiB of the file and the 56-byte zip64 record.

use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use crate::error::PickleError;

/// Most entries a `torch.save` archive may declare. A checkpoint holds one entry per storage
/// and a few more; the largest models have a few thousand.
pub const MAX_ARCHIVE_ENTRIES: u64 = 65_536;

/// The fewest bytes one entry takes in the central directory (its fixed part; the name,
/// extra field and comment follow it).
const MIN_CENTRAL_ENTRY_BYTES: u64 = 46;

const END_SIGNATURE: u32 = 0x0605_4b50;
/// The end-of-central-directory record without its comment.
const END_BYTES: usize = 22;
const MAX_COMMENT_BYTES: usize = 0xffff;

const ZIP64_LOCATOR_SIGNATURE: u32 = 0x0706_4b50;
const ZIP64_LOCATOR_BYTES: u64 = 20;
const ZIP64_END_SIGNATURE: u32 = 0x0606_4b50;
/// The zip64 end-of-central-directory record without its extensible data.
const ZIP64_END_BYTES: usize = 56;
/// The part of the zip64 record that its own size field does not count.
const ZIP64_END_LEADING_BYTES: u64 = 12;

/// What the end of an archive declares about its central directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Declared {
    /// Entries (the larger of "on this disk" and "in total").
    entries: u64,
    /// Bytes of the central directory.
    directory_bytes: u64,
    /// Where the record that follows the central directory starts: no directory reaches
    /// past it.
    directory_end: u64,
}

/// Refuses an archive whose end records cannot be found or declare more entries than the
/// file can hold or than [`MAX_ARCHIVE_ENTRIES`]. Leaves the reader's position anywhere.
pub(crate) fn check_declared_entries<R: Read + Seek>(
    reader: &mut R,
    path: &Path,
) -> Result<(), PickleError> {
    let refuse = |message: String| PickleError::Archive {
        path: path.to_path_buf(),
        message,
    };
    let io_error = |source| PickleError::Io {
        path: path.to_path_buf(),
        source,
    };
    let file_bytes = reader.seek(SeekFrom::End(0)).map_err(io_error)?;
    let declared = read_declared(reader, file_bytes)
        .map_err(io_error)?
        .map_err(|problem| refuse(format!("not a torch.save zip archive: {problem}")))?;
    let Declared {
        entries,
        directory_bytes,
        directory_end,
    } = declared;
    if directory_bytes > directory_end {
        return Err(refuse(format!(
            "the zip archive declares {entries} entries in a central directory of \
             {directory_bytes} bytes, but only {directory_end} bytes precede its \
             end-of-central-directory record"
        )));
    }
    let fits = directory_bytes / MIN_CENTRAL_ENTRY_BYTES;
    if entries > fits {
        return Err(refuse(format!(
            "the zip archive declares {entries} entries in a central directory of \
             {directory_bytes} bytes, which holds at most {fits} (each entry takes at least \
             {MIN_CENTRAL_ENTRY_BYTES} bytes)"
        )));
    }
    if entries > MAX_ARCHIVE_ENTRIES {
        return Err(refuse(format!(
            "the zip archive declares {entries} entries, more than the {MAX_ARCHIVE_ENTRIES} \
             a torch.save checkpoint may have"
        )));
    }
    Ok(())
}

/// Reads the end records of an archive of `file_bytes` bytes: the declared directory, or
/// what is wrong with the records.
fn read_declared<R: Read + Seek>(
    reader: &mut R,
    file_bytes: u64,
) -> std::io::Result<Result<Declared, String>> {
    let window = file_bytes.min((END_BYTES + MAX_COMMENT_BYTES) as u64);
    let window_start = file_bytes - window;
    let tail = read_at(reader, window_start, window as usize)?;
    let Some(end_at) = find_end_record(&tail) else {
        return Ok(Err(format!(
            "no end-of-central-directory record in its last {window} bytes"
        )));
    };
    let end = &tail[end_at..end_at + END_BYTES];
    let end_position = window_start + end_at as u64;
    let on_this_disk = u16_at(end, 8);
    let total = u16_at(end, 10);
    let directory_bytes = u32_at(end, 12);
    let directory_offset = u32_at(end, 16);
    let zip32 = Declared {
        entries: u64::from(on_this_disk.max(total)),
        directory_bytes: u64::from(directory_bytes),
        directory_end: end_position,
    };
    // The zip crate reads the zip64 records exactly when these markers and a locator are there.
    let may_be_zip64 = total == u16::MAX || directory_offset == u32::MAX;
    if !may_be_zip64 || end_position < ZIP64_LOCATOR_BYTES {
        return Ok(Ok(zip32));
    }
    let locator_position = end_position - ZIP64_LOCATOR_BYTES;
    let locator = read_at(reader, locator_position, ZIP64_LOCATOR_BYTES as usize)?;
    if u32_at(&locator, 0) != ZIP64_LOCATOR_SIGNATURE {
        return Ok(Ok(zip32));
    }
    let zip64_position = u64_at(&locator, 8);
    let record_fits = zip64_position
        .checked_add(ZIP64_END_BYTES as u64)
        .is_some_and(|record_end| record_end <= locator_position);
    if !record_fits {
        return Ok(Err(format!(
            "its zip64 locator points at byte {zip64_position}, where no zip64 \
             end-of-central-directory record fits before the locator (byte {locator_position})"
        )));
    }
    let zip64 = read_at(reader, zip64_position, ZIP64_END_BYTES)?;
    let record_bytes = u64_at(&zip64, 4);
    let ends_at_the_locator = record_bytes.checked_add(ZIP64_END_LEADING_BYTES)
        == Some(locator_position - zip64_position);
    if u32_at(&zip64, 0) != ZIP64_END_SIGNATURE || !ends_at_the_locator {
        return Ok(Err(format!(
            "no zip64 end-of-central-directory record at byte {zip64_position}, where its \
             locator points"
        )));
    }
    Ok(Ok(Declared {
        entries: u64_at(&zip64, 24).max(u64_at(&zip64, 32)),
        directory_bytes: u64_at(&zip64, 40),
        directory_end: zip64_position,
    }))
}

/// The offset in `tail` (the end of a file) of the last end-of-central-directory signature
/// whose record and comment fit in it, as the zip crate looks for it.
fn find_end_record(tail: &[u8]) -> Option<usize> {
    let last_start = tail.len().checked_sub(END_BYTES)?;
    (0..=last_start).rev().find(|&at| {
        u32_at(tail, at) == END_SIGNATURE
            && at + END_BYTES + usize::from(u16_at(tail, at + 20)) <= tail.len()
    })
}

fn read_at<R: Read + Seek>(reader: &mut R, at: u64, len: usize) -> std::io::Result<Vec<u8>> {
    reader.seek(SeekFrom::Start(at))?;
    let mut bytes = vec![0; len];
    reader.read_exact(&mut bytes)?;
    Ok(bytes)
}

// The readers below take offsets their callers checked against the slice's length.

fn u16_at(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_le_bytes(word)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An end-of-central-directory record declaring `entries` in `directory_bytes` bytes at
    /// `directory_offset`, with `comment`.
    fn end_record(
        entries: u16,
        directory_bytes: u32,
        directory_offset: u32,
        comment: &[u8],
    ) -> Vec<u8> {
        let mut record = END_SIGNATURE.to_le_bytes().to_vec();
        record.extend([0; 4]);
        record.extend(entries.to_le_bytes());
        record.extend(entries.to_le_bytes());
        record.extend(directory_bytes.to_le_bytes());
        record.extend(directory_offset.to_le_bytes());
        record.extend((comment.len() as u16).to_le_bytes());
        record.extend(comment);
        record
    }

    #[test]
    fn the_last_end_record_whose_comment_fits_is_the_one_read() {
        // A signature inside the comment would overrun the file with its own comment length.
        let mut comment = END_SIGNATURE.to_le_bytes().to_vec();
        comment.extend([0; 16]);
        comment.extend(40u16.to_le_bytes());
        let mut file = vec![0u8; 100];
        file.extend(end_record(2, 92, 8, &comment));
        let declared = read_declared(&mut std::io::Cursor::new(&file), file.len() as u64)
            .unwrap()
            .unwrap();
        assert_eq!(
            declared,
            Declared {
                entries: 2,
                directory_bytes: 92,
                directory_end: 100,
            }
        );
    }

    #[test]
    fn a_file_shorter_than_an_end_record_has_none() {
        assert_eq!(find_end_record(&[0x50, 0x4b, 0x05, 0x06]), None);
        let file = b"PK\x05\x06 too short".to_vec();
        let problem = read_declared(&mut std::io::Cursor::new(&file), file.len() as u64)
            .unwrap()
            .unwrap_err();
        assert_eq!(
            problem,
            "no end-of-central-directory record in its last 14 bytes"
        );
    }
}
