#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
//! The output oracle breaks when the promise breaks: what a process wrote
//! against what the server serves, with output lost silently, duplicated,
//! reordered, invented, or covered by a record whose count is wrong, and
//! stays quiet for every honest shape (pages split anywhere, exact
//! records, a tail lost with its daemon). The other oracles (exit, stdin,
//! signals) read the store; the planted-bug table of docs/simulator.md
//! shows each of them firing on a seed batch.

use rvbox_proto::v1 as wire;
use rvbox_sim::oracles::{Served, check_output};

const SPOOL: i32 = wire::TruncationSource::ClientSpool as i32;

fn data(stream: usize, bytes: &[u8]) -> Served {
    Served::Data {
        stream,
        bytes: bytes.to_vec(),
    }
}

fn gap(mask: u8, raw: u64) -> Served {
    Served::Gap {
        mask,
        raw: Some(raw),
        source: SPOOL,
    }
}

/// Unique bytes (no run repeats), as the simulated processes write.
fn wrote() -> [Vec<u8>; 2] {
    let out: Vec<u8> = (0..40u32)
        .flat_map(|i| format!("out line {i}\n").into_bytes())
        .collect();
    let err: Vec<u8> = (0..10u32)
        .flat_map(|i| format!("err line {i}\n").into_bytes())
        .collect();
    [out, err]
}

#[test]
fn everything_served_in_any_split_is_clean() {
    let w = wrote();
    let (a, b) = w[0].split_at(37);
    let served = vec![
        data(0, a),
        data(1, &w[1][..5]),
        data(0, b),
        data(1, &w[1][5..]),
    ];
    assert_eq!(check_output(&served, &w, false), Ok(0));
}

#[test]
fn a_run_missing_without_a_record_is_caught() {
    let w = wrote();
    let served = vec![data(0, &w[0][..50]), data(0, &w[0][80..]), data(1, &w[1])];
    let e = check_output(&served, &w, false).unwrap_err();
    assert!(e.contains("30 bytes of stdout"), "{e}");
}

#[test]
fn a_run_covered_by_an_exact_record_is_clean() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..50]),
        gap(1, 30),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert_eq!(check_output(&served, &w, false), Ok(30));
}

#[test]
fn a_record_that_counts_wrong_is_caught() {
    let w = wrote();
    let short = vec![
        data(0, &w[0][..50]),
        gap(1, 29),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&short, &w, false).is_err());
    let long = vec![
        data(0, &w[0][..50]),
        gap(1, 31),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    let e = check_output(&long, &w, false).unwrap_err();
    assert!(e.contains("1 more bytes"), "{e}");
}

#[test]
fn a_record_of_the_other_stream_covers_nothing() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..50]),
        gap(2, 30),
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn a_record_in_the_wrong_place_covers_nothing() {
    let w = wrote();
    // the record comes after the bytes that follow the run
    let served = vec![
        data(0, &w[0][..50]),
        data(0, &w[0][80..]),
        gap(1, 30),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn duplicated_output_is_caught() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..60]),
        data(0, &w[0][40..60]),
        data(0, &w[0][60..]),
        data(1, &w[1]),
    ];
    let e = check_output(&served, &w, false).unwrap_err();
    assert!(e.contains("invented, duplicated or reordered"), "{e}");
}

#[test]
fn reordered_output_is_caught() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..20]),
        data(0, &w[0][60..100]),
        data(0, &w[0][20..60]),
        data(0, &w[0][100..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn invented_output_is_caught() {
    let w = wrote();
    let served = vec![data(0, &w[0]), data(0, b"not written"), data(1, &w[1])];
    assert!(check_output(&served, &w, false).is_err());
    // bytes of the other stream served as this one's
    let crossed = vec![data(0, &w[0]), data(0, &w[1])];
    assert!(check_output(&crossed, &w, false).is_err());
}

#[test]
fn a_lost_tail_is_clean_only_when_the_process_died_with_its_daemon() {
    let w = wrote();
    let served = vec![data(0, &w[0][..100]), data(1, &w[1]), Served::Incomplete];
    assert!(check_output(&served, &w, false).is_err());
    assert_eq!(check_output(&served, &w, true), Ok(0));
}

#[test]
fn one_record_of_both_streams_covers_a_run_of_each() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..10]),
        data(1, &w[1][..10]),
        gap(3, 15),
        data(0, &w[0][20..]),
        data(1, &w[1][15..]),
    ];
    assert_eq!(check_output(&served, &w, false), Ok(15));
}

#[test]
fn two_runs_never_share_one_narrow_record() {
    let w = wrote();
    // one stdout record of 20 bytes cannot cover a 10-byte stdout run and
    // a 10-byte stderr run
    let served = vec![
        data(0, &w[0][..10]),
        data(1, &w[1][..10]),
        gap(1, 20),
        data(0, &w[0][20..]),
        data(1, &w[1][20..]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn a_record_without_a_count_is_refused() {
    let w = wrote();
    let served = vec![
        data(0, &w[0][..50]),
        Served::Gap {
            mask: 1,
            raw: None,
            source: SPOOL,
        },
        data(0, &w[0][80..]),
        data(1, &w[1]),
    ];
    assert!(check_output(&served, &w, false).is_err());
}

#[test]
fn a_short_chunk_that_recurs_is_placed_where_a_record_explains_it() {
    // "sim output line " occurs at 0 and at 18: after a record of the
    // first line only the second place is honest
    let out = b"sim output line 1\nsim output line 2\n".to_vec();
    let w = [out.clone(), Vec::new()];
    let served = vec![gap(1, 18), data(0, &out[18..34]), data(0, &out[34..])];
    assert_eq!(check_output(&served, &w, false), Ok(18));
    // the same chunks without the record: the first line is missing
    // wherever they are placed
    let bare = vec![data(0, &out[18..34]), data(0, &out[34..])];
    let e = check_output(&bare, &w, false).unwrap_err();
    assert!(e.contains("18 bytes of stdout"), "{e}");
    // and a record of the wrong size explains no placement
    let wrong = vec![gap(1, 17), data(0, &out[18..34]), data(0, &out[34..])];
    assert!(check_output(&wrong, &w, false).is_err());
}
