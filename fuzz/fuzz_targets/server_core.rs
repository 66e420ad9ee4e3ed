#![no_main]
//! libFuzzer entry of the `server_core` target (see `rvbox_fuzz::server_core`).

libfuzzer_sys::fuzz_target!(|data: &[u8]| rvbox_fuzz::server_core::run(data));
