//! Shared helpers of the store's integration tests: real temporary data
//! directories, real SQLite, real segment files.
#![allow(
    dead_code,
    unreachable_pub,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_segment::{Compression, Stream};
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store::events::{EventAppend, EventBody, EventOutcome};
use rvbox_store::fs::StoreFs;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

pub const NOW: i64 = 1_800_000_000_000;

pub fn open_with(dir: &Path, fs: Arc<dyn StoreFs>, opts: StoreOptions) -> Store {
    open_with_report(dir, fs, opts).0
}

/// [`open_with`], and what its recovery did.
pub fn open_with_report(
    dir: &Path,
    fs: Arc<dyn StoreFs>,
    opts: StoreOptions,
) -> (Store, rvbox_store::recovery::RecoveryReport) {
    // Another test of this binary may be forking a child process right now;
    // between fork and exec the child holds a copy of every descriptor,
    // including a just-dropped store's lock file, so a reopen can briefly
    // see the lock held. Retry for a moment rather than flake.
    let mut tries = 0;
    let mut s = loop {
        match Store::open(
            Layout::new(dir),
            fs.clone(),
            Arc::new(OsEntropy),
            opts.clone(),
            NOW,
        ) {
            Err(rvbox_store::StoreError::Locked { .. }) if tries < 100 => {
                tries += 1;
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => break other.unwrap(),
        }
    };
    let report = s.recover(NOW).unwrap();
    (s, report)
}

pub fn open(dir: &Path) -> Store {
    open_with(
        dir,
        Arc::new(rvbox_store::fs::RealFs),
        StoreOptions::default(),
    )
}

pub fn new_id() -> [u8; 16] {
    uuid_v7(&OsEntropy, NOW).unwrap()
}

pub fn text(id: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*id).hyphenated().to_string()
}

pub fn run_request(id: &[u8; 16], client: &str, command: &str) -> wire::RunCommandRequest {
    wire::RunCommandRequest {
        request_id: text(id),
        client_id: client.into(),
        spec: Some(wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText(command.into())),
            ..Default::default()
        }),
        script: Vec::new(),
        queue_ttl: None,
    }
}

/// Creates a command and moves it to `running` (as the session layer will).
pub fn running_command(store: &mut Store, client: &str) -> [u8; 16] {
    let id = new_id();
    store
        .run_command(&run_request(&id, client, "make test"), NOW)
        .unwrap();
    store.record_transition(&id, Lifecycle::Dispatched).unwrap();
    store.record_transition(&id, Lifecycle::Accepted).unwrap();
    let running = lifecycle(&id, 1, Lifecycle::Running);
    let r = store.append_events(&[running], NOW).unwrap();
    assert_eq!(r.outcomes, vec![EventOutcome::Appended]);
    id
}

pub fn output(id: &[u8; 16], seq: u64, raw: &[u8]) -> EventAppend {
    EventAppend {
        session: None,
        issue_uuid: *id,
        event_seq: seq,
        observed_ms: NOW + i64::try_from(seq).unwrap(),
        body: EventBody::Output {
            stream: if seq.is_multiple_of(2) {
                Stream::Stdout
            } else {
                Stream::Stderr
            },
            compression: Compression::Zstd,
            raw_len: u32::try_from(raw.len()).unwrap(),
            stored: zstd::bulk::compress(raw, 1).unwrap(),
        },
    }
}

pub fn lifecycle(id: &[u8; 16], seq: u64, to: Lifecycle) -> EventAppend {
    let exit_code = (to == Lifecycle::Succeeded).then_some(0);
    EventAppend {
        session: None,
        issue_uuid: *id,
        event_seq: seq,
        observed_ms: NOW,
        body: EventBody::Lifecycle {
            to,
            exit_code,
            exit_signal: None,
            encoded: vec![to.to_wire() as u8],
        },
    }
}

/// Raw bytes of output chunk `seq` used by the tests: distinct per seq and
/// incompressible (xorshift noise), so record sizes are predictable.
pub fn chunk(seq: u64, len: usize) -> Vec<u8> {
    let mut x = seq.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x & 0xff) as u8
        })
        .collect()
}

pub fn last_seq(store: &Store, id: &[u8; 16]) -> u64 {
    let v: i64 = store
        .db()
        .query_row(
            "SELECT last_event_seq FROM commands WHERE issue_uuid = ?1",
            [id.as_slice()],
            |r| r.get(0),
        )
        .unwrap();
    u64::try_from(v).unwrap()
}

pub fn assert_counters(store: &Store) {
    let c = store.check_counters().unwrap();
    assert!(c.consistent(), "counters differ from a recount: {c:?}");
}

/// Reads every committed record of a command back from its segment files
/// and checks each against its event row (digest of the raw bytes).
pub fn verify_output(store: &Store, id: &[u8; 16]) -> Vec<u64> {
    let mut stmt = store
        .db()
        .prepare(
            "SELECT e.event_seq, e.segment_ordinal, e.segment_offset, e.content_sha256
             FROM command_events e JOIN command_segments s
               ON s.issue_uuid = e.issue_uuid AND s.ordinal = e.segment_ordinal
             WHERE e.issue_uuid = ?1 AND s.state IN ('active', 'sealed') ORDER BY e.event_seq",
        )
        .unwrap();
    let rows: Vec<(i64, u32, i64, Vec<u8>)> = stmt
        .query_map([id.as_slice()], |r| {
            Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut seqs = Vec::new();
    for (seq, ordinal, offset, digest) in rows {
        let path = store.layout().segment_path(id, ordinal).unwrap();
        let bytes = std::fs::read(path).unwrap();
        let rec = rvbox_segment::decode(
            &bytes[usize::try_from(offset).unwrap()..],
            &rvbox_store::store::record_limits(),
        )
        .unwrap();
        assert_eq!(rec.meta.seq, u64::try_from(seq).unwrap());
        assert_eq!(rec.meta.sha256.as_slice(), digest.as_slice());
        let raw = zstd::bulk::decompress(rec.payload, rec.meta.raw_len as usize).unwrap();
        assert_eq!(rvbox_segment::sha256(&raw).as_slice(), digest.as_slice());
        seqs.push(u64::try_from(seq).unwrap());
    }
    seqs
}

/// Parks the writer at one crash point until the test lets it go.
#[derive(Debug)]
pub struct Park {
    point: &'static str,
    reached: Mutex<Option<mpsc::Sender<()>>>,
    release: Mutex<Option<mpsc::Receiver<()>>>,
}

impl Park {
    /// A hook that parks at `point` once; the receiver hears when the
    /// writer got there, and a send on the sender lets it go on.
    #[allow(dead_code)]
    pub fn at(point: &'static str) -> (Arc<Self>, mpsc::Receiver<()>, mpsc::Sender<()>) {
        let (reached_tx, reached) = mpsc::channel();
        let (release, release_rx) = mpsc::channel();
        let park = Arc::new(Self {
            point,
            reached: Mutex::new(Some(reached_tx)),
            release: Mutex::new(Some(release_rx)),
        });
        (park, reached, release)
    }
}

impl rvbox_store::crash::CrashHook for Park {
    fn at(&self, point: &'static str) {
        if point != self.point {
            return;
        }
        let Some(reached) = self.reached.lock().unwrap().take() else {
            return;
        };
        reached.send(()).unwrap();
        let release = self.release.lock().unwrap().take().unwrap();
        release.recv().unwrap();
    }
}

/// A registration of `client` by `instance` expecting `expected`, as
/// session `session_id`, fencing `fence`.
pub fn registration(
    client: &str,
    instance: [u8; 16],
    expected: u64,
    session_id: [u8; 16],
    fence: Option<[u8; 16]>,
) -> rvbox_store::sessions::Registration {
    rvbox_store::sessions::Registration {
        client_id: client.into(),
        instance_id: instance,
        expected_generation: expected,
        session_id,
        fence,
        consume_grant: None,
        capabilities: wire::Capabilities {
            software_version: "1.0.0".into(),
            max_running: 4,
            max_queued: 10,
            ..Default::default()
        },
        cwd_policy: None,
        labels: String::new(),
    }
}

/// Registers a new live session of `client` (fencing its live one, if
/// any), as the server does for a connection, and returns the fence its
/// writes carry.
pub fn live_session(store: &mut Store, client: &str) -> rvbox_store::sessions::SessionFence {
    let record = store.client_record(client).unwrap();
    let (generation, live) =
        record.map_or((0, None), |r| (r.generation, r.live.map(|l| l.session_id)));
    let session_id = new_id();
    store
        .register_session(
            &registration(client, [9; 16], generation, session_id, live),
            NOW,
        )
        .unwrap();
    rvbox_store::sessions::SessionFence { session_id }
}
