//! Any bytes as a torch.save archive.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_pickle::read_torch_state_dict_from_bytes;

fuzz_target!(|bytes: &[u8]| {
    let _ = read_torch_state_dict_from_bytes(bytes, std::path::Path::new("fuzz.pt"));
});
