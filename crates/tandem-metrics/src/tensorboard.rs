//! TensorBoard event files, so that `tensorboard --logdir OUT` shows a run as it shows a
//! PyTorch one.
//!
//! An event file is a sequence of TFRecords: a little-endian u64 length, the masked CRC-32C
//! of those 8 bytes, the data, and the masked CRC-32C of the data. Each record's data is an
//! `Event` protocol buffer; the first holds `file_version = "brain.Event:2"`, the others a
//! `Summary` of scalar values, or a `SessionLog` that marks where a resumed run starts again.
//! The few fields needed are encoded here by hand.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::MetricsError;

/// The file-version string of the first event.
pub const FILE_VERSION: &str = "brain.Event:2";

/// Writes scalars to a new event file in a folder.
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Creates `folder/events.out.tfevents.<seconds>.<host>.<pid>` and writes its first
    /// event. The name must be free: a symbolic link planted there is refused, naming it.
    pub fn create(folder: &Path, host: &str) -> Result<Self, MetricsError> {
        let seconds = now_seconds() as u64;
        let path = folder.join(format!(
            "events.out.tfevents.{seconds}.{host}.{}",
            std::process::id()
        ));
        let file = match tandem_files::create_new_file(&path) {
            Ok(file) => file,
            Err(source) => {
                return Err(MetricsError::EventFile {
                    action: "create",
                    path,
                    source,
                })
            }
        };
        let mut writer = EventWriter {
            file: BufWriter::new(file),
            path,
        };
        let mut event = event_header(now_seconds(), 0);
        put_bytes(&mut event, 3, FILE_VERSION.as_bytes());
        writer.write_record(&event)?;
        writer.flush()?;
        Ok(writer)
    }

    /// Appends scalar values, all at `step`, as one event. Call [`EventWriter::flush`] to
    /// make them visible.
    pub fn add_scalars(&mut self, step: u64, scalars: &[(&str, f64)]) -> Result<(), MetricsError> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut entry = Vec::new();
            put_bytes(&mut entry, 1, tag.as_bytes());
            put_key(&mut entry, 2, WIRE_FIXED32);
            entry.extend_from_slice(&(*value as f32).to_le_bytes());
            put_bytes(&mut summary, 1, &entry);
        }
        let mut event = event_header(now_seconds(), step as i64);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)
    }

    /// Marks the start of a session that resumes at `first_step`, as TensorFlow's writers do
    /// after a restart: TensorBoard then drops what earlier files hold at `first_step` and
    /// later, which the resumed run writes again, so each step is shown once.
    pub fn add_session_start(&mut self, first_step: u64) -> Result<(), MetricsError> {
        let mut session_log = Vec::new();
        put_key(&mut session_log, 1, WIRE_VARINT);
        put_varint(&mut session_log, SESSION_STATUS_START);
        let mut event = event_header(now_seconds(), first_step as i64);
        put_bytes(&mut event, 7, &session_log);
        self.write_record(&event)
    }

    /// Pushes what was written to the file.
    pub fn flush(&mut self) -> Result<(), MetricsError> {
        self.file.flush().map_err(|source| self.write_error(source))
    }

    /// Writes `data` as one TFRecord.
    fn write_record(&mut self, data: &[u8]) -> Result<(), MetricsError> {
        let length = (data.len() as u64).to_le_bytes();
        let result = (|| {
            self.file.write_all(&length)?;
            self.file.write_all(&masked_crc32c(&length).to_le_bytes())?;
            self.file.write_all(data)?;
            self.file.write_all(&masked_crc32c(data).to_le_bytes())
        })();
        result.map_err(|source| self.write_error(source))
    }

    /// A failed write to the event file, naming it.
    fn write_error(&self, source: std::io::Error) -> MetricsError {
        MetricsError::EventFile {
            action: "write",
            path: self.path.clone(),
            source,
        }
    }
}

/// TFRecord's masked CRC-32C: the checksum rotated right by 15 bits plus a constant, so that
/// a CRC of data that holds CRCs stays well distributed.
pub fn masked_crc32c(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

/// Seconds since the Unix epoch.
fn now_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// `SessionLog.SessionStatus.START`.
const SESSION_STATUS_START: u64 = 1;

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LENGTH_DELIMITED: u8 = 2;
const WIRE_FIXED32: u8 = 5;

/// An `Event` with its `wall_time` (field 1) and `step` (field 2).
fn event_header(wall_time: f64, step: i64) -> Vec<u8> {
    let mut event = Vec::new();
    put_key(&mut event, 1, WIRE_FIXED64);
    event.extend_from_slice(&wall_time.to_le_bytes());
    put_key(&mut event, 2, WIRE_VARINT);
    put_varint(&mut event, step as u64);
    event
}

/// A field's key: its number and wire type.
fn put_key(buffer: &mut Vec<u8>, field: u32, wire_type: u8) {
    put_varint(buffer, (u64::from(field) << 3) | u64::from(wire_type));
}

/// A length-delimited field (string, bytes or message).
fn put_bytes(buffer: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(buffer, field, WIRE_LENGTH_DELIMITED);
    put_varint(buffer, bytes.len() as u64);
    buffer.extend_from_slice(bytes);
}

/// A base-128 varint, least significant group first.
fn put_varint(buffer: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        buffer.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    buffer.push(value as u8);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_crc_is_crc32c_masked_as_tfrecord_masks_it() {
        // CRC-32C's check value, then the mask: rotate right 15, add 0xa282ead8.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc32c(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn varints_and_keys_follow_protobuf() {
        let mut buffer = Vec::new();
        put_varint(&mut buffer, 300);
        assert_eq!(buffer, [0xac, 0x02]);
        buffer.clear();
        put_varint(&mut buffer, (-1i64) as u64);
        assert_eq!(buffer.len(), 10);
        buffer.clear();
        put_key(&mut buffer, 5, WIRE_LENGTH_DELIMITED);
        assert_eq!(buffer, [0x2a]);
        buffer.clear();
        put_key(&mut buffer, 2, WIRE_FIXED32);
        assert_eq!(buffer, [0x15]);
    }

    #[test]
    fn a_session_start_is_a_session_log_event_at_its_first_step() {
        let folder = tempfile::tempdir().unwrap();
        let mut writer = EventWriter::create(folder.path(), "host").unwrap();
        let header_bytes = std::fs::metadata(writer.path()).unwrap().len() as usize;
        writer.add_session_start(101).unwrap();
        writer.flush().unwrap();
        let bytes = std::fs::read(writer.path()).unwrap();
        let record = &bytes[header_bytes..];
        let length = u64::from_le_bytes(record[..8].try_into().unwrap()) as usize;
        assert_eq!(record.len(), 16 + length, "one record after the header");
        let data = &record[12..12 + length];
        assert_eq!(
            u32::from_le_bytes(record[12 + length..].try_into().unwrap()),
            masked_crc32c(data)
        );
        // wall_time (field 1, fixed64), step 101 (field 2, varint), then session_log
        // (field 7) holding status START (field 1 = 1).
        assert_eq!(data[0], 0x09);
        let wall_time = f64::from_le_bytes(data[1..9].try_into().unwrap());
        assert!((wall_time - now_seconds()).abs() < 60.0, "{wall_time}");
        assert_eq!(&data[9..], [0x10, 101, 0x3a, 0x02, 0x08, 0x01]);
    }
}
