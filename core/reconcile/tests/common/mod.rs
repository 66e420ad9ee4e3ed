//! Shared builders for the reconciliation tests.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;

use rvbox_domain::hash::RequestHash;
use rvbox_domain::ids::Uuid7;
use rvbox_domain::lifecycle::{Lifecycle, Phase, Revision};
use rvbox_proto::v1 as wire;
use rvbox_reconcile::{
    Assembly, CompleteSnapshot, Outcome, ReconcileError, ServerCommand, ServerKnown,
    SnapshotAssembler, SnapshotError, Source, reconcile,
};

pub const ROUND: u64 = 1;

/// A valid UUIDv7 whose order follows `i`.
pub fn uuid(i: u32) -> Uuid7 {
    let mut b = [0u8; 16];
    b[2..6].copy_from_slice(&i.to_be_bytes());
    b[6] = 0x70;
    b[8] = 0x80;
    b[15] = 0x01;
    Uuid7::from_bytes("test", b).unwrap()
}

pub fn hash(i: u32) -> RequestHash {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_be_bytes());
    h[31] = 0xaa;
    RequestHash(h)
}

/// A command-text server row for command `i` (hash `hash(i)`).
pub fn row(i: u32, phase: Phase, revision: u64, durable: u64) -> ServerCommand {
    ServerCommand {
        issue_uuid: uuid(i),
        request_hash: hash(i),
        phase,
        revision: Revision(revision),
        durable_event_seq: durable,
        source: Source::CommandText,
    }
}

/// A wire record for command `i` with its own hash.
pub fn rec(
    i: u32,
    lifecycle: Lifecycle,
    revision: u64,
    assigned: u64,
    acked: u64,
) -> wire::SnapshotRecord {
    wire::SnapshotRecord {
        issue_uuid: uuid(i).to_string(),
        request_hash: hash(i).as_bytes().to_vec(),
        revision,
        lifecycle: lifecycle.to_wire() as i32,
        last_assigned_event_seq: assigned,
        acked_event_seq: acked,
        script_received_bytes: 0,
    }
}

pub fn tomb(i: u32) -> wire::SnapshotTombstone {
    wire::SnapshotTombstone {
        issue_uuid: uuid(i).to_string(),
        request_hash: hash(i).as_bytes().to_vec(),
    }
}

pub fn chunk(
    round: u64,
    index: u32,
    final_chunk: bool,
    records: Vec<wire::SnapshotRecord>,
    tombstones: Vec<wire::SnapshotTombstone>,
) -> wire::ClientSnapshot {
    wire::ClientSnapshot {
        round,
        chunk_index: index,
        final_chunk,
        store_health: wire::ScopeState::Ready as i32,
        records,
        tombstones,
    }
}

/// Feeds `chunks` in order; the last must complete the snapshot.
pub fn assemble(
    round: u64,
    chunks: &[wire::ClientSnapshot],
) -> Result<CompleteSnapshot, SnapshotError> {
    let mut asm = SnapshotAssembler::new(round);
    for (i, c) in chunks.iter().enumerate() {
        match asm.push(c)? {
            Assembly::Incomplete(next) => asm = next,
            Assembly::Complete(done) => {
                assert_eq!(i + 1, chunks.len(), "completed before the last chunk");
                return Ok(done);
            }
        }
    }
    panic!("snapshot never completed");
}

/// One READY final chunk.
pub fn snap(
    records: Vec<wire::SnapshotRecord>,
    tombstones: Vec<wire::SnapshotTombstone>,
) -> CompleteSnapshot {
    assemble(ROUND, &[chunk(ROUND, 0, true, records, tombstones)]).unwrap()
}

/// Splits the lists into chunks: a `true` in `rec_cuts[i]` / `tomb_cuts[i]`
/// starts a new chunk before item `i`; `empty_final` appends an empty final
/// chunk.
pub fn split(
    round: u64,
    records: &[wire::SnapshotRecord],
    tombstones: &[wire::SnapshotTombstone],
    rec_cuts: &[bool],
    tomb_cuts: &[bool],
    empty_final: bool,
) -> Vec<wire::ClientSnapshot> {
    let mut rec_chunk = Vec::new();
    let mut c = 0usize;
    for (i, _) in records.iter().enumerate() {
        if i > 0 && rec_cuts.get(i).copied().unwrap_or(false) {
            c += 1;
        }
        rec_chunk.push(c);
    }
    let mut tomb_chunk = Vec::new();
    let mut c = 0usize;
    for (i, _) in tombstones.iter().enumerate() {
        if i > 0 && tomb_cuts.get(i).copied().unwrap_or(false) {
            c += 1;
        }
        tomb_chunk.push(c);
    }
    let n = rec_chunk
        .iter()
        .chain(&tomb_chunk)
        .copied()
        .max()
        .map_or(1, |m| m + 1)
        + usize::from(empty_final);
    let mut chunks: Vec<wire::ClientSnapshot> = (0..n)
        .map(|i| chunk(round, u32::try_from(i).unwrap(), i + 1 == n, vec![], vec![]))
        .collect();
    for (r, ci) in records.iter().zip(rec_chunk) {
        chunks[ci].records.push(r.clone());
    }
    for (t, ci) in tombstones.iter().zip(tomb_chunk) {
        chunks[ci].tombstones.push(t.clone());
    }
    chunks
}

pub fn run(
    rows: &[ServerCommand],
    known: &BTreeMap<Uuid7, ServerKnown>,
    snapshot: &CompleteSnapshot,
) -> Result<Outcome, ReconcileError> {
    reconcile(ROUND, rows, known, snapshot)
}

pub fn no_known() -> BTreeMap<Uuid7, ServerKnown> {
    BTreeMap::new()
}

pub fn known(entries: &[(u32, ServerKnown)]) -> BTreeMap<Uuid7, ServerKnown> {
    entries.iter().map(|(i, k)| (uuid(*i), *k)).collect()
}

pub fn terminal(i: u32, lifecycle: Lifecycle, durable: u64) -> ServerKnown {
    ServerKnown::Terminal {
        request_hash: hash(i),
        lifecycle,
        durable_event_seq: durable,
    }
}

pub fn tombstoned(i: u32) -> ServerKnown {
    ServerKnown::Tombstoned {
        request_hash: hash(i),
    }
}

pub fn strings(ids: &[u32]) -> Vec<String> {
    ids.iter().map(|i| uuid(*i).to_string()).collect()
}
