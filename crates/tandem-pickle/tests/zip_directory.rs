//! The end records of a `torch.save` zip archive are checked before the zip crate reads the
//! central directory: hand-made archives whose end-of-central-directory record (or zip64
//! record) declares more entries than the file holds, or than any checkpoint has, are
//! refused with the count; the same archives with honest counts load.

use std::path::Path;

use tandem_pickle::{
    open_torch_state_dict, read_torch_state_dict_from_bytes, TensorData, MAX_ARCHIVE_ENTRIES,
};

/// CRC-32 (IEEE), as zip entries carry it.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in bytes {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = (crc >> 1) ^ (0xedb8_8320 & (crc & 1).wrapping_neg());
        }
    }
    !crc
}

/// `data.pkl` of `{"w": tensor([1.5, -2.0])}` over storage `0`, as `torch.save` writes it.
fn one_tensor_pickle() -> Vec<u8> {
    let text = |out: &mut Vec<u8>, text: &str| {
        out.push(b'X');
        out.extend((text.len() as u32).to_le_bytes());
        out.extend(text.as_bytes());
    };
    let int = |out: &mut Vec<u8>, value: i32| {
        out.push(b'J');
        out.extend(value.to_le_bytes());
    };
    let mut out = vec![0x80, 2, b'}', b'('];
    text(&mut out, "w");
    out.extend(b"ctorch._utils\n_rebuild_tensor_v2\n((");
    text(&mut out, "storage");
    out.extend(b"ctorch\nFloatStorage\n");
    text(&mut out, "0");
    text(&mut out, "cpu");
    int(&mut out, 2);
    out.extend(b"tQ");
    int(&mut out, 0);
    out.push(b'(');
    int(&mut out, 2);
    out.extend(b"t(");
    int(&mut out, 1);
    out.extend(b"t\x89tRu.");
    out
}

/// The stored (uncompressed) entries of an archive and its central directory, without the
/// end records.
struct Body {
    bytes: Vec<u8>,
    directory_offset: u64,
    directory_bytes: u64,
    entries: u64,
}

fn body(files: &[(&str, Vec<u8>)]) -> Body {
    let mut bytes = Vec::new();
    let mut directory = Vec::new();
    for (name, data) in files {
        let offset = bytes.len() as u32;
        let crc = crc32(data);
        let size = (data.len() as u32).to_le_bytes();
        let name_len = (name.len() as u16).to_le_bytes();
        // Local header: signature, version 2.0, flags, stored, time, date.
        bytes.extend(0x0403_4b50u32.to_le_bytes());
        bytes.extend([20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        bytes.extend(crc.to_le_bytes());
        bytes.extend(size);
        bytes.extend(size);
        bytes.extend(name_len);
        bytes.extend([0, 0]);
        bytes.extend(name.as_bytes());
        bytes.extend(data);
        // Central header: signature, made by and needs 2.0, flags, stored, time, date.
        directory.extend(0x0201_4b50u32.to_le_bytes());
        directory.extend([20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        directory.extend(crc.to_le_bytes());
        directory.extend(size);
        directory.extend(size);
        directory.extend(name_len);
        // Extra field, comment, disk, internal and external attributes.
        directory.extend([0; 12]);
        directory.extend(offset.to_le_bytes());
        directory.extend(name.as_bytes());
    }
    let directory_offset = bytes.len() as u64;
    let directory_bytes = directory.len() as u64;
    bytes.extend(directory);
    Body {
        bytes,
        directory_offset,
        directory_bytes,
        entries: files.len() as u64,
    }
}

/// The end-of-central-directory record.
fn zip32_end(entries: u16, directory_bytes: u32, directory_offset: u32) -> Vec<u8> {
    let mut end = 0x0605_4b50u32.to_le_bytes().to_vec();
    end.extend([0; 4]);
    end.extend(entries.to_le_bytes());
    end.extend(entries.to_le_bytes());
    end.extend(directory_bytes.to_le_bytes());
    end.extend(directory_offset.to_le_bytes());
    end.extend([0, 0]);
    end
}

/// `body` ended by a plain end-of-central-directory record declaring `entries` and
/// `directory_bytes`.
fn with_zip32_end(body: &Body, entries: u16, directory_bytes: u32) -> Vec<u8> {
    let mut bytes = body.bytes.clone();
    bytes.extend(zip32_end(
        entries,
        directory_bytes,
        body.directory_offset as u32,
    ));
    bytes
}

/// `body` ended by a zip64 end-of-central-directory record declaring `entries` and
/// `directory_bytes`, its locator (pointing at the record, or at `locator_target`), and the
/// plain record that defers to them.
fn with_zip64_end(
    body: &Body,
    entries: u64,
    directory_bytes: u64,
    locator_target: Option<u64>,
) -> Vec<u8> {
    let mut bytes = body.bytes.clone();
    let record_at = bytes.len() as u64;
    bytes.extend(0x0606_4b50u32.to_le_bytes());
    bytes.extend(44u64.to_le_bytes());
    bytes.extend([45, 0, 45, 0]);
    bytes.extend([0; 8]);
    bytes.extend(entries.to_le_bytes());
    bytes.extend(entries.to_le_bytes());
    bytes.extend(directory_bytes.to_le_bytes());
    bytes.extend(body.directory_offset.to_le_bytes());
    bytes.extend(0x0706_4b50u32.to_le_bytes());
    bytes.extend([0; 4]);
    bytes.extend(locator_target.unwrap_or(record_at).to_le_bytes());
    bytes.extend(1u32.to_le_bytes());
    bytes.extend(zip32_end(u16::MAX, u32::MAX, u32::MAX));
    bytes
}

fn checkpoint_body() -> Body {
    body(&[
        ("archive/data.pkl", one_tensor_pickle()),
        ("archive/byteorder", b"little".to_vec()),
        (
            "archive/data/0",
            [1.5f32, -2.0]
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect(),
        ),
    ])
}

fn refusal(bytes: &[u8], name: &str) -> String {
    match read_torch_state_dict_from_bytes(bytes, Path::new(name)) {
        Ok(checkpoint) => panic!("{name} was read: {checkpoint:?}"),
        Err(error) => error.to_string(),
    }
}

#[test]
fn a_hand_made_archive_loads_with_either_end_record() {
    let body = checkpoint_body();
    let entries = body.entries;
    let zip32 = with_zip32_end(&body, entries as u16, body.directory_bytes as u32);
    let zip64 = with_zip64_end(&body, entries, body.directory_bytes, None);
    for (name, bytes) in [("zip32.pt", zip32), ("zip64.pt", zip64)] {
        let checkpoint = read_torch_state_dict_from_bytes(&bytes, Path::new(name))
            .unwrap_or_else(|error| panic!("{name}: {error}"));
        assert_eq!(checkpoint.tensors.len(), 1, "{name}");
        assert_eq!(checkpoint.tensors[0].name, "w");
        assert_eq!(checkpoint.tensors[0].data, TensorData::F32(vec![1.5, -2.0]));
    }
}

#[test]
fn four_million_entries_declared_in_a_small_file_are_refused_before_it_is_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let body = body(&[("data.pkl", b"\x80\x02}.".to_vec())]);
    let bytes = with_zip64_end(&body, 4_000_000, body.directory_bytes, None);
    assert_eq!(bytes.len(), 194);
    let path = dir.path().join("four-million.pt");
    std::fs::write(&path, &bytes).expect("write");
    let error = match open_torch_state_dict(&path, 1 << 20) {
        Ok(_) => panic!("an archive declaring 4,000,000 entries was opened"),
        Err(error) => error.to_string(),
    };
    assert_eq!(
        error,
        format!(
            "{}: the zip archive declares 4000000 entries in a central directory of 54 bytes, \
             which holds at most 1 (each entry takes at least 46 bytes)",
            path.display()
        )
    );
}

#[test]
fn a_plain_end_record_declaring_more_entries_than_its_directory_holds_is_refused() {
    let body = checkpoint_body();
    let bytes = with_zip32_end(&body, 60_000, body.directory_bytes as u32);
    assert_eq!(body.directory_bytes, 185);
    assert_eq!(
        refusal(&bytes, "zip32.pt"),
        "zip32.pt: the zip archive declares 60000 entries in a central directory of 185 \
         bytes, which holds at most 4 (each entry takes at least 46 bytes)"
    );
}

#[test]
fn a_directory_larger_than_the_bytes_before_the_end_records_is_refused() {
    let body = checkpoint_body();
    let bytes = with_zip64_end(&body, 1 << 40, 46 << 40, None);
    assert_eq!(
        refusal(&bytes, "huge-directory.pt"),
        format!(
            "huge-directory.pt: the zip archive declares 1099511627776 entries in a central \
             directory of 50577534877696 bytes, but only {} bytes precede its \
             end-of-central-directory record",
            body.bytes.len()
        )
    );
}

#[test]
fn more_entries_than_a_checkpoint_has_are_refused_though_the_file_could_hold_them() {
    let entries = MAX_ARCHIVE_ENTRIES + 1;
    let mut body = checkpoint_body();
    // Room for every declared entry before the end records.
    body.bytes.resize((entries * 46) as usize, 0);
    let bytes = with_zip64_end(&body, entries, entries * 46, None);
    assert_eq!(
        refusal(&bytes, "many.pt"),
        "many.pt: the zip archive declares 65537 entries, more than the 65536 a torch.save \
         checkpoint may have"
    );
}

#[test]
fn a_zip64_locator_pointing_elsewhere_than_its_record_is_refused() {
    let body = checkpoint_body();
    let record_at = body.bytes.len() as u64;
    let locator_at = record_at + 56;
    for target in [record_at + 1, u64::MAX - 10] {
        let bytes = with_zip64_end(&body, body.entries, body.directory_bytes, Some(target));
        assert_eq!(
            refusal(&bytes, "locator.pt"),
            format!(
                "locator.pt: not a torch.save zip archive: its zip64 locator points at byte \
                 {target}, where no zip64 end-of-central-directory record fits before the \
                 locator (byte {locator_at})"
            )
        );
    }
    let bytes = with_zip64_end(&body, body.entries, body.directory_bytes, Some(0));
    assert_eq!(
        refusal(&bytes, "locator.pt"),
        "locator.pt: not a torch.save zip archive: no zip64 end-of-central-directory record \
         at byte 0, where its locator points"
    );
}

#[test]
fn files_without_an_end_record_in_their_last_64_kib_are_refused() {
    assert_eq!(
        refusal(b"not a zip at all", "short.pt"),
        "short.pt: not a torch.save zip archive: no end-of-central-directory record in its \
         last 16 bytes"
    );
    let body = checkpoint_body();
    let mut bytes = with_zip32_end(&body, 3, body.directory_bytes as u32);
    bytes.resize(bytes.len() + 70_000, 0);
    assert_eq!(
        refusal(&bytes, "trailing.pt"),
        "trailing.pt: not a torch.save zip archive: no end-of-central-directory record in its \
         last 65557 bytes"
    );
}
