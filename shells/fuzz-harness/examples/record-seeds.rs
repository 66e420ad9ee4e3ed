//! Writes the fuzz seed corpora under `fixtures/fuzz/<target>/` from the
//! real code (fixtures/fuzz/README.md says what each holds):
//!
//! ```text
//! cargo run -p rvbox-fuzz --example record-seeds
//! ```
//!
//! Frames come from two simulator runs (one calm, one with faults and the
//! adversary) recorded on the simulated network; output chunks, segments,
//! journal frames, tokens and JSON documents are made by the production
//! encoders from them; configuration files are the shipped examples, the
//! test data and the refused fixtures.
//! Existing seeds are replaced; `regressions/` is left alone.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use prost::Message as _;
use rvbox_domain::token::{
    OutputPosition, PagePosition, TokenCodec, TokenKey, TokenKind, encode_filters,
};
use rvbox_fuzz::server_core::program::Program;
use rvbox_proto::v1 as wire;
use rvbox_proto::v1::envelope::Payload;
use rvbox_sim::net::Dir;
use rvbox_sim::world::{SimConfig, World};

/// Largest seed file kept.
const MAX_SEED: usize = 4096;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

struct Corpus {
    dir: PathBuf,
    count: usize,
}

impl Corpus {
    fn new(name: &str) -> Self {
        let dir = root().join("fixtures/fuzz").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for e in std::fs::read_dir(&dir).unwrap().flatten() {
            if e.path().is_file() {
                std::fs::remove_file(e.path()).unwrap();
            }
        }
        Self { dir, count: 0 }
    }

    fn add(&mut self, label: &str, bytes: &[u8]) {
        if bytes.len() > MAX_SEED {
            return;
        }
        self.count += 1;
        let name = format!("{:03}-{label}", self.count);
        std::fs::write(self.dir.join(name), bytes).unwrap();
    }
}

fn record(seed: u64, faults: bool) -> Vec<rvbox_sim::net::RecordedFrame> {
    let config = SimConfig {
        faults,
        ..SimConfig::default()
    };
    let mut world = World::new(seed, config).expect("a simulated world");
    world.record_frames(20_000);
    let report = world.run();
    assert!(
        report.failure.is_none(),
        "seed {seed} failed: {:?}",
        report.failure
    );
    let mut frames = report.frames;
    for f in &mut frames {
        fixed_paths(&mut f.bytes);
    }
    frames
}

/// The run's temporary directory (`rvbox-sim-` and six random characters)
/// named the same in every recording, at the same length (so every
/// protobuf length stays right): the same seeds record the same bytes.
fn fixed_paths(bytes: &mut [u8]) {
    const PREFIX: &[u8] = b"rvbox-sim-";
    let mut i = 0;
    while i + PREFIX.len() + 6 <= bytes.len() {
        if bytes[i..].starts_with(PREFIX) {
            bytes[i + PREFIX.len()..i + PREFIX.len() + 6].copy_from_slice(b"RECORD");
            i += PREFIX.len() + 6;
        } else {
            i += 1;
        }
    }
}

fn payload_of(bytes: &[u8]) -> Option<Payload> {
    wire::Envelope::decode(bytes).ok()?.payload
}

fn main() {
    let calm = record(1, false);
    let faulty = record(2, true);
    println!(
        "recorded {} frames (calm seed 1) and {} (seed 2 with faults)",
        calm.len(),
        faulty.len()
    );
    envelope(&calm, &faulty);
    server_core(&calm);
    let chunks = output_chunks(&calm);
    zstd_output(&chunks);
    segment_tail(&chunks);
    tokens();
    jsonrpc();
    config();
}

/// The first few frames of each payload, each direction, plus the frames
/// that do not decode (the adversary's).
fn envelope(calm: &[rvbox_sim::net::RecordedFrame], faulty: &[rvbox_sim::net::RecordedFrame]) {
    let mut c = Corpus::new("envelope");
    let mut per_kind: BTreeMap<String, usize> = BTreeMap::new();
    for f in calm.iter().chain(faulty) {
        let dir = match f.dir {
            Dir::ToServer => "c2s",
            Dir::ToClient => "s2c",
        };
        let kind = payload_of(&f.bytes)
            .map_or("undecodable", |p| rvbox_session::payload_name(&p))
            .to_owned();
        let n = per_kind.entry(format!("{dir}-{kind}")).or_default();
        if *n < 3 {
            *n += 1;
            c.add(&format!("{dir}-{kind}.bin"), &f.bytes);
        }
    }
    println!("envelope: {} seeds", c.count);
}

/// Step programs: the scripted happy path and variants, and the client
/// frames of recorded connections replayed with the live session fields.
fn server_core(calm: &[rvbox_sim::net::RecordedFrame]) {
    let mut c = Corpus::new("server_core");
    let happy = Program::happy();
    c.add("happy-path.bin", &happy.bytes());
    let finished = happy
        .clone()
        .lifecycle(0, 1)
        .complete(8)
        .timeout(3)
        .complete(8);
    c.add("command-succeeds.bin", &finished.bytes());
    let control = happy
        .clone()
        .run_command(0, b"")
        .complete(8)
        .complete(8)
        .stdin(0, b"input\n")
        .complete(8)
        .complete(8);
    c.add("run-command-and-stdin.bin", &control.bytes());
    let script = happy
        .clone()
        .accept(2)
        .complete(8)
        .complete(8)
        .complete(8)
        .run_command(1, b"#!/bin/sh\necho hi\n")
        .complete(8);
    c.add("script-upload.bin", &script.bytes());
    let reconnect = happy
        .clone()
        .disconnect()
        .complete(8)
        .connect()
        .hello(0, 0)
        .complete(8)
        .complete(8)
        .snapshot(true)
        .complete(8)
        .complete(8);
    c.add("reconnect-and-reconcile.bin", &reconnect.bytes());
    let takeover = Program::new()
        .connect()
        .hello(1, 0)
        .complete(8)
        .connect()
        .hello(1, 1)
        .complete(8)
        .complete(8)
        .timeout(6)
        .complete(8);
    c.add("second-instance.bin", &takeover.bytes());
    let quiet = Program::new()
        .connect()
        .hello(0, 0)
        .complete(8)
        .timeout(4)
        .timeout(5)
        .timeout(6)
        .complete(8);
    c.add("silent-client.bin", &quiet.bytes());
    // recorded client frames: the first connections' frames, after a hello
    // of the harness (the recorded hello names the simulator's clients)
    let mut by_conn: BTreeMap<u64, Vec<&[u8]>> = BTreeMap::new();
    for f in calm.iter().filter(|f| f.dir == Dir::ToServer) {
        by_conn.entry(f.conn.0).or_default().push(&f.bytes);
    }
    for (conn, frames) in by_conn.iter().take(4) {
        let mut p = Program::new().connect();
        for (i, bytes) in frames.iter().take(12).enumerate() {
            p = p.frame(bytes).complete(8);
            if i == 0 {
                p = p.complete(8);
            }
        }
        c.add(&format!("recorded-connection-{conn}.bin"), &p.bytes());
    }
    for s in c.dir.read_dir().unwrap().flatten() {
        let seen = rvbox_fuzz::server_core::explore(&std::fs::read(s.path()).unwrap());
        println!(
            "  {}: {}",
            s.file_name().to_string_lossy(),
            seen.iter()
                .filter(|(k, _)| k.starts_with("frame"))
                .map(|(k, v)| format!("{}x{v}", k.trim_start_matches("frame ")))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    println!("server_core: {} seeds", c.count);
}

/// Output chunks the simulated clients sent: (raw, stored, declared raw
/// length).
fn output_chunks(frames: &[rvbox_sim::net::RecordedFrame]) -> Vec<(Vec<u8>, Vec<u8>, u32)> {
    let mut out = Vec::new();
    for f in frames {
        let Some(Payload::CommandEvent(e)) = payload_of(&f.bytes) else {
            continue;
        };
        let Some(wire::command_event::Body::Output(o)) = e.body else {
            continue;
        };
        let raw = zstd::bulk::decompress(&o.payload, o.raw_length as usize).unwrap_or_default();
        if out.iter().all(|(r, _, _)| *r != raw) {
            out.push((raw, o.payload, o.raw_length));
        }
        if out.len() >= 12 {
            break;
        }
    }
    out
}

fn zstd_output(chunks: &[(Vec<u8>, Vec<u8>, u32)]) {
    let mut c = Corpus::new("zstd_output");
    for (i, (raw, stored, raw_len)) in chunks.iter().enumerate() {
        // as sent: stored bytes with their declared length
        let mut v = vec![0u8];
        v.extend(raw_len.to_le_bytes());
        v.extend(stored);
        c.add(&format!("chunk-{i}-as-sent.bin"), &v);
        // the raw bytes, compressed by the harness (then damaged by mutation)
        let mut v = vec![1u8, 1, 0, 0, 0, 1, 0];
        v.extend(raw);
        c.add(&format!("chunk-{i}-raw.bin"), &v);
    }
    // uncompressed and wrong-length forms
    c.add(
        "uncompressed.bin",
        &[2, 5, 0, 0, 0, b'h', b'e', b'l', b'l', b'o'],
    );
    c.add(
        "declared-too-long.bin",
        &[1, 1, 0x10, 0, 0, 1, 7, b'a', b'b', b'c'],
    );
    println!("zstd_output: {} seeds", c.count);
}

fn segment_tail(chunks: &[(Vec<u8>, Vec<u8>, u32)]) {
    use rvbox_segment::journal::{JournalEntry, encode_frame};
    use rvbox_segment::{Compression, Kind, RecordMeta, Stream, encode, sha256};
    let mut c = Corpus::new("segment_tail");
    let limits = rvbox_store::store::record_limits();
    let mut segment = Vec::new();
    for (i, (raw, stored, raw_len)) in chunks.iter().enumerate() {
        let meta = RecordMeta {
            issue_uuid: [1; 16],
            seq: i as u64 + 1,
            observed_unix_ms: 1_800_000_000_000,
            receipt_unix_ms: 1_800_000_000_001,
            kind: Kind::Output,
            stream: Stream::Stdout,
            compression: Compression::Zstd,
            raw_len: *raw_len,
            sha256: sha256(raw),
        };
        segment.extend(encode(&meta, stored, &limits).unwrap());
        if segment.len() > MAX_SEED / 2 {
            break;
        }
    }
    // a whole segment, committed to its end
    let mut v = vec![0u8];
    v.extend(&segment);
    c.add("segment-clean.bin", &v);
    // a torn tail: committed end inside, bytes beyond it
    let half = (segment.len() / 2) as u16;
    let mut v = vec![1u8];
    v.extend(half.to_le_bytes());
    v.extend(&segment);
    c.add("segment-committed-half.bin", &v);
    // a segment cut short of its committed end
    let mut v = vec![1u8];
    v.extend((segment.len() as u16).to_le_bytes());
    v.extend(&segment[..segment.len() * 2 / 3]);
    c.add("segment-short-file.bin", &v);
    // one flipped byte inside the committed range
    let mut damaged = segment.clone();
    let at = damaged.len() / 3;
    damaged[at] ^= 0x40;
    let mut v = vec![0u8];
    v.extend(&damaged);
    c.add("segment-damaged.bin", &v);
    // programs: real segments from the input's bytes, tails cut or damaged
    for (i, tail) in [0u8, 1, 2, 3, 4].iter().enumerate() {
        let mut v = vec![2u8, 3];
        for r in 0..4u8 {
            v.extend([8, b'o', b'u', b't', b'p', b'u', b't', r, b'\n']);
            v.extend([r, 0]);
        }
        v.extend([2, *tail, 40, 0, 0x10]);
        c.add(&format!("program-segment-{i}.bin"), &v);
    }
    // journal frames of the real encoder
    let entries: Vec<JournalEntry<'_>> = vec![JournalEntry {
        issue_uuid: [1; 16],
        ordinal: 1,
        offset: 0,
        bytes: &segment[..segment.len().min(600)],
    }];
    let frame = encode_frame(1, &entries).unwrap();
    let mut v = vec![0u8];
    v.extend(&frame);
    v.extend(&frame);
    c.add("journal-two-frames.bin", &v);
    for (i, damage) in [0u8, 1, 2, 3].iter().enumerate() {
        c.add(
            &format!("program-journal-{i}.bin"),
            &[
                3, 1, 2, 1, 5, b'a', b'b', b'c', b'd', b'e', 2, 3, b'x', b'y', b'z', 0, b'q',
                *damage, 20, 0, 0x08,
            ],
        );
    }
    println!("segment_tail: {} seeds", c.count);
}

fn tokens() {
    let mut c = Corpus::new("tokens");
    // the key the target uses
    let codec = TokenCodec::new(TokenKey::new([7; 32]));
    let page = PagePosition {
        sort_key: 1_800_000_000_000,
        id: [0x42; 16],
    }
    .encode();
    let output = OutputPosition {
        issue_uuid: [0x17; 16],
        event_seq: 12,
        byte_offset: 4096,
        snapshot_seq: 40,
    }
    .encode();
    // at most 48 bytes: the target reads the filters with one length byte
    let filters = encode_filters(&[("client_id", b"web-01")]);
    for (kind_index, kind, position) in [
        (1u8, TokenKind::CommandPage, &page),
        (3, TokenKind::Output, &output),
        (0, TokenKind::ClientPage, &page),
    ] {
        let token = codec.seal(kind, &filters, position).unwrap();
        // mode 0: the token text opened as the server would
        let mut v = vec![0u8, kind_index, filters.len() as u8];
        v.extend(&filters);
        v.extend(token.as_bytes());
        c.add(&format!("open-{kind_index}.bin"), &v);
        // mode 1: the position sealed and opened
        let mut v = vec![1u8, kind_index, filters.len() as u8];
        v.extend(&filters);
        v.extend(position);
        c.add(&format!("seal-{kind_index}.bin"), &v);
        // mode 2: one character changed
        let mut v = vec![2u8, kind_index, filters.len() as u8];
        v.extend(&filters);
        v.extend([10, 0, b'A']);
        v.extend(position);
        c.add(&format!("changed-{kind_index}.bin"), &v);
    }
    println!("tokens: {} seeds", c.count);
}

fn jsonrpc() {
    use rvbox_control_api::json::to_value;
    use serde_json::json;
    let mut c = Corpus::new("jsonrpc");
    let issue = "01890a5d-ac96-774b-bcce-b30209a00001";
    let request = "01890a5d-ac96-774b-bcce-b30209a10001";
    let run = wire::RunCommandRequest {
        request_id: request.into(),
        client_id: "web-01".into(),
        spec: Some(wire::ExecutionSpec {
            shell_type: wire::ShellType::Sh as i32,
            cwd: "/srv".into(),
            env: [("LANG".to_owned(), "C".to_owned())].into_iter().collect(),
            profile_flags: vec![wire::ProfileFlag::Light as i32],
            source: Some(wire::execution_spec::Source::CommandText("echo hi".into())),
        }),
        script: Vec::new(),
        queue_ttl: Some(prost_types::Duration {
            seconds: 60,
            nanos: 0,
        }),
    };
    let bodies = [
        (
            "runCommand",
            to_value("rvbox.v1.RunCommandRequest", &run).unwrap(),
        ),
        ("getCommand", json!({ "issueUuid": issue })),
        (
            "getOutput",
            json!({ "issueUuid": issue, "pageToken": "", "maxBytes": 4096 }),
        ),
        (
            "listCommands",
            json!({ "clientId": "web-01", "pageSize": 10 }),
        ),
        ("listClients", json!({})),
        (
            "appendStdin",
            json!({ "requestId": request, "issueUuid": issue, "data": "aGVsbG8K" }),
        ),
        (
            "signalCommand",
            json!({ "requestId": request, "issueUuid": issue, "signal": "SIGNAL_KIND_TERM" }),
        ),
        ("closeStdin", json!({ "issueUuid": issue })),
        (
            "openPtySession",
            json!({ "clientId": "web-01", "rows": 24, "cols": 80 }),
        ),
        ("listFleetRuns", json!({ "pageSize": 5 })),
    ];
    for (i, (method, params)) in bodies.iter().enumerate() {
        let body = json!({ "jsonrpc": "2.0", "id": i, "method": method, "params": params });
        c.add(&format!("{method}.json"), body.to_string().as_bytes());
    }
    for (name, body) in [
        (
            "batch",
            r#"[{"jsonrpc":"2.0","id":1,"method":"listClients"}]"#,
        ),
        (
            "notification",
            r#"{"jsonrpc":"2.0","method":"listClients"}"#,
        ),
        (
            "unknown-method",
            r#"{"jsonrpc":"2.0","id":"x","method":"followCommand"}"#,
        ),
        (
            "params-array",
            r#"{"jsonrpc":"2.0","id":null,"method":"getCommand","params":[1]}"#,
        ),
        ("not-json", r#"{"jsonrpc":"2.0","id":1,"#),
    ] {
        c.add(&format!("{name}.json"), body.as_bytes());
    }
    println!("jsonrpc: {} seeds", c.count);
}

fn config() {
    let mut c = Corpus::new("config");
    let mut sources: Vec<PathBuf> = Vec::new();
    for dir in ["docs/examples", "fixtures/config", "core/config/tests/data"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap().flatten() {
            if e.path().extension().is_some_and(|x| x == "toml") {
                sources.push(e.path());
            }
        }
    }
    sources.sort();
    for p in sources {
        let name = p.file_name().unwrap().to_string_lossy().into_owned();
        c.add(&name, &std::fs::read(&p).unwrap());
    }
    println!("config: {} seeds", c.count);
}
