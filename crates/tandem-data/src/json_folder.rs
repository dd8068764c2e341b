//! Seed 004's `CIFAR10_IMG` layout: `<root>/annotations/cifar10_{train,test}.json` holds
//! `{"images": [file names], "categories": [labels]}` and the files lie in
//! `<root>/{train,test}_cifar10/`. Images are PNG or JPEG, 32x32 RGB.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde_json::Value as Json;

use crate::dataset::{cifar10_class_names, Dataset, Split};
use crate::error::DataError;
use crate::image_file::decode_rgb_exact;

/// The annotation file of a split.
pub(crate) fn annotation_path(root: &Path, split: Split) -> PathBuf {
    root.join("annotations")
        .join(format!("cifar10_{}.json", split.name()))
}

/// The image folder of a split.
fn image_folder(root: &Path, split: Split) -> PathBuf {
    root.join(format!("{}_cifar10", split.name()))
}

/// Reads one split: the annotations, then every image they name (in parallel).
pub(crate) fn load(root: &Path, split: Split) -> Result<Dataset, DataError> {
    let annotation = annotation_path(root, split);
    let text = std::fs::read_to_string(&annotation)
        .map_err(|source| DataError::io(&annotation, source))?;
    let (file_names, labels) = parse_annotations(&annotation, &text)?;
    let folder = image_folder(root, split);
    check_entries_fit_folder(&annotation, &folder, file_names.len())?;
    let images: Vec<Vec<u8>> = file_names
        .par_iter()
        .map(|name| decode_rgb_exact(&folder.join(name), 32, 32))
        .collect::<Result<_, _>>()?;
    Ok(Dataset::cifar10(
        images.concat(),
        labels,
        cifar10_class_names(),
    ))
}

/// Refuses more annotation entries than the image folder holds files, before any image is
/// decoded (each entry is one image in memory). A folder that cannot be read is left for the
/// first image's error to name.
fn check_entries_fit_folder(
    annotation: &Path,
    folder: &Path,
    entries: usize,
) -> Result<(), DataError> {
    let Ok(listing) = std::fs::read_dir(folder) else {
        return Ok(());
    };
    let files = listing
        .filter_map(Result::ok)
        .filter(|entry| entry.file_type().is_ok_and(|kind| !kind.is_dir()))
        .take(entries + 1)
        .count();
    if entries > files {
        return Err(DataError::format(
            annotation,
            format!(
                "{entries} images listed, but the folder {} holds fewer files ({files}): each \
                 image is a file of its own",
                folder.display()
            ),
        ));
    }
    Ok(())
}

/// Parses `{"images": [...], "categories": [...]}` into file names and labels; a file named
/// twice is refused.
pub fn parse_annotations(path: &Path, text: &str) -> Result<(Vec<String>, Vec<u32>), DataError> {
    let json: Json = serde_json::from_str(text)
        .map_err(|error| DataError::format(path, format!("malformed JSON: {error}")))?;
    let images = array_field(path, &json, "images")?;
    let categories = array_field(path, &json, "categories")?;
    if images.len() != categories.len() {
        return Err(DataError::format(
            path,
            format!(
                "{} images but {} categories, expected one category per image",
                images.len(),
                categories.len()
            ),
        ));
    }
    let file_names = images
        .iter()
        .enumerate()
        .map(|(index, name)| match name.as_str() {
            Some(name) if is_plain_file_name(name) => Ok(name.to_string()),
            _ => Err(DataError::format(
                path,
                format!("images[{index}] is {name}, expected a file name inside the image folder"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut first_index: std::collections::HashMap<&str, usize> =
        std::collections::HashMap::with_capacity(file_names.len());
    for (index, name) in file_names.iter().enumerate() {
        if let Some(first) = first_index.insert(name, index) {
            return Err(DataError::format(
                path,
                format!("images[{index}] is {name:?} again (as images[{first}]), expected each image once"),
            ));
        }
    }
    let labels = categories
        .iter()
        .enumerate()
        .map(|(index, label)| match label.as_u64() {
            Some(value @ 0..=9) => Ok(value as u32),
            _ => Err(DataError::format(
                path,
                format!("categories[{index}] is {label}, expected an integer in 0..=9"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok((file_names, labels))
}

fn array_field<'j>(path: &Path, json: &'j Json, key: &str) -> Result<&'j Vec<Json>, DataError> {
    let Some(object) = json.as_object() else {
        return Err(DataError::format(
            path,
            "top level is not a JSON object, expected {\"images\": [...], \"categories\": [...]}",
        ));
    };
    match object.get(key) {
        Some(Json::Array(items)) => Ok(items),
        Some(other) => Err(DataError::format(
            path,
            format!("key \"{key}\" is {other}, expected an array"),
        )),
        None => Err(DataError::format(path, format!("missing key \"{key}\""))),
    }
}

/// A relative name without separators or `..`, so annotations cannot point outside the folder.
fn is_plain_file_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\\'])
}
