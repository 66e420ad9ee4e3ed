#![no_main]
//! libFuzzer entry of the `jsonrpc` target (see `rvbox_fuzz::jsonrpc`).

libfuzzer_sys::fuzz_target!(|data: &[u8]| rvbox_fuzz::jsonrpc::run(data));
