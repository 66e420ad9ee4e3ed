#![no_main]
//! libFuzzer entry of the `segment_tail` target (see `rvbox_fuzz::segment_tail`).

libfuzzer_sys::fuzz_target!(|data: &[u8]| rvbox_fuzz::segment_tail::run(data));
