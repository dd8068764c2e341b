//! Helpers shared by the integration tests.
#![allow(dead_code)]

/// A CIFAR python-layout batch written the way Python 2 pickles it (protocol 2, str keys,
/// numpy array built by `_reconstruct` + `BUILD`), with knobs to break it.
pub struct PyBatch<'a> {
    pub data_key: &'a str,
    pub labels_key: &'a str,
    pub dtype: &'a str,
    pub rows: usize,
    pub row_len: usize,
    pub pixels: Vec<u8>,
    pub labels: Vec<i64>,
}

impl PyBatch<'_> {
    /// A valid batch of `rows` rows; pixel values and labels follow a simple pattern.
    pub fn valid(rows: usize) -> PyBatch<'static> {
        PyBatch {
            data_key: "data",
            labels_key: "labels",
            dtype: "u1",
            rows,
            row_len: 3072,
            pixels: (0..rows * 3072)
                .map(|index| (index * 7 % 251) as u8)
                .collect(),
            labels: (0..rows).map(|row| (row % 10) as i64).collect(),
        }
    }

    /// The pickle bytes.
    pub fn to_pickle(&self) -> Vec<u8> {
        let mut out = vec![0x80, 2, b'}', b'('];
        short_binstring(&mut out, self.labels_key.as_bytes());
        out.extend_from_slice(b"](");
        for &label in &self.labels {
            binint(&mut out, label as i32);
        }
        out.push(b'e');
        short_binstring(&mut out, self.data_key.as_bytes());
        out.extend_from_slice(b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85");
        short_binstring(&mut out, b"b");
        out.extend_from_slice(b"\x87R(K\x01");
        binint(&mut out, self.rows as i32);
        binint(&mut out, self.row_len as i32);
        out.extend_from_slice(b"\x86cnumpy\ndtype\n");
        short_binstring(&mut out, self.dtype.as_bytes());
        out.extend_from_slice(b"K\x00K\x01\x87R(K\x03");
        short_binstring(&mut out, b"|");
        out.extend_from_slice(b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb\x89");
        out.push(b'T');
        out.extend_from_slice(&(self.pixels.len() as i32).to_le_bytes());
        out.extend_from_slice(&self.pixels);
        out.extend_from_slice(b"tbu.");
        out
    }
}

fn binint(out: &mut Vec<u8>, value: i32) {
    out.push(b'J');
    out.extend_from_slice(&value.to_le_bytes());
}

fn short_binstring(out: &mut Vec<u8>, bytes: &[u8]) {
    out.push(b'U');
    out.push(bytes.len() as u8);
    out.extend_from_slice(bytes);
}

/// Converts HWC bytes of one 32x32 image back to CIFAR's R, G, B planes.
pub fn hwc_to_planes(hwc: &[u8]) -> Vec<u8> {
    let mut planes = vec![0u8; 3072];
    for pixel in 0..1024 {
        for channel in 0..3 {
            planes[channel * 1024 + pixel] = hwc[pixel * 3 + channel];
        }
    }
    planes
}
