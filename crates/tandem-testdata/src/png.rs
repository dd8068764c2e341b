//! Hand-made PNG files, for tests of what a reader does with a file that says one thing in
//! its header and holds another.

/// An RGB PNG of `width` x `height` 8-bit pixels whose image data is `idat`, the zlib
/// stream as given: a PNG signature, then the IHDR, IDAT and IEND chunks.
pub fn rgb_png(width: u32, height: u32, idat: &[u8]) -> Vec<u8> {
    let mut header = Vec::new();
    header.extend(width.to_be_bytes());
    header.extend(height.to_be_bytes());
    header.extend([8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    push_chunk(&mut png, b"IHDR", &header);
    push_chunk(&mut png, b"IDAT", idat);
    push_chunk(&mut png, b"IEND", &[]);
    png
}

/// Appends one chunk: its length, kind, data and CRC.
fn push_chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend((data.len() as u32).to_be_bytes());
    let mut crc = flate2::Crc::new();
    crc.update(kind);
    crc.update(data);
    out.extend(kind);
    out.extend(data);
    out.extend(crc.sum().to_be_bytes());
}
