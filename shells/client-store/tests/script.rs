//! Script uploads across a crash (plan §7.3): a script whose bytes all
//! became durable before a crash that came before its verification is
//! verified at the next open, so the command can still launch.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::sync::Arc;

use rvbox_client_core::accept::check_dispatch;
use rvbox_client_core::ops::ScriptOutcome;
use rvbox_client_store::crash;
use rvbox_domain::hash::command_hash;
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_storage::crash::NoCrash;
use rvbox_storage::fs::{CrashMode, FaultyFs};
use support::{NOW, StopAt, issue, open_on, policy, reopen_after_crash};

#[test]
fn a_crash_between_the_last_chunk_and_the_verification_is_finished_at_open() {
    let script = b"echo from a script\n".repeat(100);
    let spec = wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::Script(
            wire::ScriptDescriptor {
                display_basename: "job.sh".into(),
                size_bytes: script.len() as u64,
                sha256: rvbox_segment::sha256(&script).to_vec(),
            },
        )),
        ..Default::default()
    };
    let normalized = check_execution_spec(&spec).unwrap();
    let d = wire::Dispatch {
        issue_uuid: issue(1),
        generation: 1,
        revision: 1,
        request_hash: command_hash(&policy().client_id, &normalized).0.to_vec(),
        spec: Some(spec),
        queue_expiry_time: None,
    };
    let checked = check_dispatch(&policy(), 1, NOW, &d).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("state");
    let fs = Arc::new(FaultyFs::new());
    let mut store = open_on(&root, fs.clone(), Arc::new(NoCrash));
    store.accept(&policy(), &checked, NOW).unwrap();
    store.set_crash_hook(Arc::new(StopAt::new(crash::SCRIPT_CHUNK_AFTER_COMMIT)));
    let chunk = wire::ScriptChunk {
        issue_uuid: issue(1),
        offset: 0,
        declared_size: script.len() as u64,
        compression: wire::Compression::None as i32,
        payload: script.clone(),
        raw_length: script.len() as u32,
        stored_length: script.len() as u32,
        raw_sha256: rvbox_segment::sha256(&script).to_vec(),
    };
    let crashed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        store.script_chunk(&checked.issue, &chunk, NOW).unwrap()
    }));
    assert!(crashed.is_err());
    store.close_as_crashed();
    let mut store = reopen_after_crash(&root, &fs, CrashMode::LoseUnsynced);
    assert_eq!(store.recovery_report().scripts_committed, 1);
    let rec = store.restore_records().unwrap();
    assert!(rec[0].script_committed, "the script is launch-eligible");
    // and a resent chunk is answered as committed
    assert_eq!(
        store.script_chunk(&checked.issue, &chunk, NOW).unwrap(),
        ScriptOutcome::Committed
    );
}
