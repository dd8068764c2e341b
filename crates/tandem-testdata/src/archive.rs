//! Hand-made `.tar.gz` archives, streamed as they are written so that a member of
//! hundreds of megabytes (a decompression bomb) costs no memory.

use std::io::Read;
use std::path::Path;

/// Writes a gzip-compressed tar at `path` holding `members`: each a name, a length in
/// bytes, and the byte that fills it.
pub fn tar_gz(path: &Path, members: &[(&str, u64, u8)]) {
    let file = std::fs::File::create(path).expect("create the archive");
    let encoder = flate2::write::GzEncoder::new(file, flate2::Compression::fast());
    let mut builder = tar::Builder::new(encoder);
    for &(name, len, byte) in members {
        let mut header = tar::Header::new_gnu();
        header.set_size(len);
        header.set_mode(0o644);
        header.set_cksum();
        let content = std::io::repeat(byte).take(len);
        builder
            .append_data(&mut header, name, content)
            .expect("append a member");
    }
    let encoder = builder.into_inner().expect("end the tar");
    encoder.finish().expect("end the gzip stream");
}
