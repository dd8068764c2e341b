//! Any text as a seed-004 annotation file.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_data::parse_annotations;

fuzz_target!(|bytes: &[u8]| {
    if let Ok(text) = std::str::from_utf8(bytes) {
        let _ = parse_annotations(std::path::Path::new("fuzz.json"), text);
    }
});
