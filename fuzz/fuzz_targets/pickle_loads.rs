//! Any bytes through the pickle machine and the numpy interpreter: errors are fine,
//! panics, hangs and huge allocations are not.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tandem_pickle::{loads, ndarray_from_value, Value};

fuzz_target!(|bytes: &[u8]| {
    if let Ok(value) = loads(bytes) {
        let _ = ndarray_from_value(&value);
        if let Some(data) = value.get("data") {
            let _ = ndarray_from_value(data);
        }
        let _ = value.describe();
        let _ = matches!(value, Value::Dict(_));
    }
});
