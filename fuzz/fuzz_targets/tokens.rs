#![no_main]
//! libFuzzer entry of the `tokens` target (see `rvbox_fuzz::tokens`).

libfuzzer_sys::fuzz_target!(|data: &[u8]| rvbox_fuzz::tokens::run(data));
