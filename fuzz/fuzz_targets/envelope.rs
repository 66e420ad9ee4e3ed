#![no_main]
//! libFuzzer entry of the `envelope` target (see `rvbox_fuzz::envelope`).

libfuzzer_sys::fuzz_target!(|data: &[u8]| rvbox_fuzz::envelope::run(data));
