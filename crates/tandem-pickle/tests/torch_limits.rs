//! `open_torch_state_dict`: the tensors are known before any storage is read, a storage
//! shared by several tensors is read once and gives each its own elements, and the pickle
//! and storages are capped.

use std::io::Write;
use std::path::Path;

use tandem_pickle::{open_torch_state_dict, TensorData, TensorDtype, TensorHeader};

/// `data.pkl` of a state dict whose float tensors are `(name, shape, storage key, offset,
/// storage length)`, as `torch.save` writes it (protocol 2).
fn state_dict_pickle(tensors: &[(&str, &[usize], &str, usize, usize)]) -> Vec<u8> {
    let text = |out: &mut Vec<u8>, text: &str| {
        out.push(b'X');
        out.extend((text.len() as u32).to_le_bytes());
        out.extend(text.as_bytes());
    };
    let int = |out: &mut Vec<u8>, value: usize| {
        out.push(b'J');
        out.extend((value as i32).to_le_bytes());
    };
    let mut out = vec![0x80, 2, b'}', b'('];
    for &(name, shape, key, offset, storage_len) in tensors {
        text(&mut out, name);
        out.extend(b"ctorch._utils\n_rebuild_tensor_v2\n((");
        text(&mut out, "storage");
        out.extend(b"ctorch\nFloatStorage\n");
        text(&mut out, key);
        text(&mut out, "cpu");
        int(&mut out, storage_len);
        out.extend(b"tQ");
        int(&mut out, offset);
        out.push(b'(');
        for &dim in shape {
            int(&mut out, dim);
        }
        out.extend(b"t(");
        let mut stride = 1;
        let mut strides = Vec::new();
        for &dim in shape.iter().rev() {
            strides.push(stride);
            stride *= dim;
        }
        for &value in strides.iter().rev() {
            int(&mut out, value);
        }
        out.extend(b"t\x89tR");
    }
    out.extend(b"u.");
    out
}

fn write_archive(path: &Path, pickle: &[u8], storages: &[(&str, Vec<u8>)]) {
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    let mut zip = zip::ZipWriter::new(std::fs::File::create(path).expect("archive"));
    zip.start_file("archive/data.pkl", options).expect("entry");
    zip.write_all(pickle).expect("pickle");
    for (key, bytes) in storages {
        zip.start_file(format!("archive/data/{key}"), options)
            .expect("entry");
        zip.write_all(bytes).expect("storage");
    }
    zip.finish().expect("finish");
}

fn floats(values: &[f32]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|value| value.to_le_bytes())
        .collect()
}

#[test]
fn tensors_viewing_one_storage_each_get_their_own_elements() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("shared.pt");
    let pickle = state_dict_pickle(&[("a", &[2], "0", 0, 6), ("b", &[2, 2], "0", 2, 6)]);
    write_archive(&path, &pickle, &[("0", floats(&[1., 2., 3., 4., 5., 6.]))]);

    let state_dict = open_torch_state_dict(&path, 4096).expect("open");
    assert_eq!(
        state_dict.tensors(),
        &[
            TensorHeader {
                name: "a".into(),
                shape: vec![2],
                dtype: TensorDtype::F32,
            },
            TensorHeader {
                name: "b".into(),
                shape: vec![2, 2],
                dtype: TensorDtype::F32,
            },
        ]
    );
    let checkpoint = state_dict.read_storages(24).expect("read");
    assert_eq!(checkpoint.tensors[0].data, TensorData::F32(vec![1., 2.]));
    assert_eq!(
        checkpoint.tensors[1].data,
        TensorData::F32(vec![3., 4., 5., 6.])
    );

    let error = open_torch_state_dict(&path, 4096)
        .expect("open")
        .read_storages(23)
        .expect_err("over the cap");
    assert_eq!(
        error.to_string(),
        format!(
            "{}: its storages hold 24 bytes, more than the 23 bytes the tensors being loaded need",
            path.display()
        )
    );
}

#[test]
fn a_storage_declared_with_two_sizes_and_an_oversized_pickle_are_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("conflict.pt");
    let pickle = state_dict_pickle(&[("a", &[2], "0", 0, 2), ("b", &[2], "0", 0, 4)]);
    write_archive(&path, &pickle, &[("0", floats(&[1., 2., 3., 4.]))]);
    let error = open_torch_state_dict(&path, 4096)
        .expect("open")
        .read_storages(u64::MAX)
        .expect_err("conflicting sizes");
    assert_eq!(
        error.to_string(),
        format!(
            "{}: tensor b: storage 0 is declared as F32 x 4, and elsewhere as F32 x 2",
            path.display()
        )
    );

    let error = match open_torch_state_dict(&path, pickle.len() as u64 - 1) {
        Ok(_) => panic!("a pickle over its cap was read"),
        Err(error) => error,
    };
    assert_eq!(
        error.to_string(),
        format!(
            "{}: entry archive/data.pkl is longer than {} bytes",
            path.display(),
            pickle.len() - 1
        )
    );
}

#[test]
fn a_repeated_key_is_refused_before_any_storage_is_read() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("repeated.pt");
    // The largest key of a real file repeated: each entry would decode the whole storage.
    let entries: Vec<(&str, &[usize], &str, usize, usize)> = (0..200)
        .map(|_| ("layer4.weight", &[4usize, 4][..], "0", 0, 16))
        .collect();
    let pickle = state_dict_pickle(&entries);
    write_archive(&path, &pickle, &[("0", floats(&[0.5; 16]))]);
    let error = match open_torch_state_dict(&path, 1 << 20) {
        Ok(_) => panic!("a repeated key was accepted"),
        Err(error) => error,
    };
    assert_eq!(
        error.to_string(),
        format!(
            "{}: state dict key \"layer4.weight\" appears more than once (entries 1 and 2): a \
             state dict names each tensor once",
            path.display()
        )
    );
}

#[test]
fn tensors_that_together_hold_more_than_the_cap_are_refused_though_their_storage_fits() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("views.pt");
    // Three names viewing one 16-float storage whole: 64 bytes of storage, 192 decoded.
    let pickle = state_dict_pickle(&[
        ("a", &[16], "0", 0, 16),
        ("b", &[16], "0", 0, 16),
        ("c", &[16], "0", 0, 16),
    ]);
    write_archive(&path, &pickle, &[("0", floats(&[1.0; 16]))]);
    let error = open_torch_state_dict(&path, 4096)
        .expect("open")
        .read_storages(64)
        .expect_err("over the cap once decoded");
    assert_eq!(
        error.to_string(),
        format!(
            "{}: its tensors hold 192 bytes, more than the 64 bytes the tensors being loaded need",
            path.display()
        )
    );
    let checkpoint = open_torch_state_dict(&path, 4096)
        .expect("open")
        .read_storages(192)
        .expect("within the cap");
    assert_eq!(checkpoint.tensors.len(), 3);
}
