//! R1: a gap is always a record. A command offline for longer than its
//! spool window holds writes far more than the window; the client rolls
//! its oldest unsent output into `CLIENT_SPOOL` records, and what the
//! server stores afterwards is the newest output plus records that count
//! exactly the bytes that went.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use rvbox_chaos::{Chaos, Command, Dir, Options, check_stream, gated};

#[test]
fn r1_offline_spool_overflow_becomes_client_spool_records_that_count_every_byte() {
    let mut c = Chaos::start(&Options {
        client_extra: "[spool]\ncommand_output_window = \"2MiB\"\n".into(),
        ..Options::default()
    });
    // 6 MB that do not compress, written in slices slower than the spool
    // makes them durable (so none of it is dropped as overload)
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let data: Vec<u8> = (0..6_000_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    std::fs::write(c.stack.work().join("data.bin"), &data).unwrap();
    let body = format!(
        "i=0; while [ $i -lt 60 ]; do dd if=data.bin bs=100000 skip=$i count=1 2>/dev/null; i=$((i+1)); sleep 0.1; done; touch {}",
        c.marker("wrote").display()
    );
    let uuid = c.run_bg(&gated(&body));
    c.wait_running(&uuid);
    c.fault("a", &Command::Blackhole(Dir::Both));
    c.go();
    c.stack.wait_until_for(
        "the command wrote everything",
        Duration::from_secs(60),
        || c.marker("wrote").exists(),
    );
    std::thread::sleep(Duration::from_secs(1));
    c.fault("a", &Command::Pass);
    let cmd = c.wait_ended(&uuid, Duration::from_secs(90));
    assert_eq!(cmd["lifecycle"], "LIFECYCLE_SUCCEEDED", "{cmd}");
    let mut wrote = b"start\n".to_vec();
    wrote.extend_from_slice(&data);
    let pieces = c.stored_output(&uuid, "stdout");
    let gaps = check_stream(&pieces, &wrote)
        .unwrap_or_else(|e| panic!("stdout of {uuid}: {e}\n{}", c.stack.logs()));
    assert!(
        gaps.iter()
            .any(|(_, s)| s == "TRUNCATION_SOURCE_CLIENT_SPOOL"),
        "6 MB offline through a 2 MiB window left no CLIENT_SPOOL record: {gaps:?}"
    );
    let lost: u64 = gaps.iter().map(|(n, _)| n).sum();
    assert!(lost >= 2_000_000, "only {lost} bytes rolled away: {gaps:?}");
    // the operator is told, in the CLI too
    let (_, notes) = c.output(&uuid, "stdout");
    assert!(notes.contains("CLIENT_SPOOL"), "{notes}");
    c.assert_client_alive();
    c.assert_clean();
}
