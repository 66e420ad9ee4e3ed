#![no_main]
//! libFuzzer entry of the `zstd_output` target (see `rvbox_fuzz::zstd_output`).

libfuzzer_sys::fuzz_target!(|data: &[u8]| rvbox_fuzz::zstd_output::run(data));
