#![no_main]
//! libFuzzer entry of the `config` target (see `rvbox_fuzz::config`).

libfuzzer_sys::fuzz_target!(|data: &[u8]| rvbox_fuzz::config::run(data));
