//! Shared helpers of the client store tests: real files in a temp dir,
//! the fault-injecting filesystem for power cuts, a crash hook.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use rvbox_client_core::accept::{AcceptPolicy, CheckedDispatch, check_dispatch};
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions};
use rvbox_domain::hash::command_hash;
use rvbox_domain::ids::ClientId;
use rvbox_domain::validate::check_execution_spec;
use rvbox_proto::v1 as wire;
use rvbox_storage::crash::{CrashHook, NoCrash};
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::{CrashMode, FaultyFs, RealFs, StoreFs};

/// A fixed wall time for the tests.
pub const NOW: i64 = 1_800_000_000_000;

/// Panics (an in-process power cut) the `after`-th time `point` is reached.
#[derive(Debug)]
pub struct StopAt {
    point: &'static str,
    after: u32,
    hits: AtomicU32,
}

impl StopAt {
    pub fn new(point: &'static str) -> Self {
        Self::nth(point, 1)
    }

    pub fn nth(point: &'static str, after: u32) -> Self {
        Self {
            point,
            after,
            hits: AtomicU32::new(0),
        }
    }
}

impl CrashHook for StopAt {
    fn at(&self, point: &'static str) {
        if point == self.point && self.hits.fetch_add(1, Ordering::SeqCst) + 1 >= self.after {
            panic!("power cut at {point}");
        }
    }
}

pub fn open_with(root: &Path, opts: ClientStoreOptions) -> ClientStore {
    ClientStore::open(
        ClientLayout::new(root),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        opts,
        NOW,
    )
    .unwrap()
}

pub fn open(root: &Path) -> ClientStore {
    open_with(root, ClientStoreOptions::default())
}

pub fn open_on(root: &Path, fs: Arc<dyn StoreFs>, hook: Arc<dyn CrashHook>) -> ClientStore {
    ClientStore::open_with_hook(
        ClientLayout::new(root),
        fs,
        Arc::new(OsEntropy),
        hook,
        ClientStoreOptions::default(),
        NOW,
    )
    .unwrap()
}

/// After a panic at a crash point: the power cut on `fs`, then a fresh open.
pub fn reopen_after_crash(root: &Path, fs: &Arc<FaultyFs>, mode: CrashMode) -> ClientStore {
    fs.crash(mode).unwrap();
    open_on(root, fs.clone(), Arc::new(NoCrash))
}

pub fn policy() -> AcceptPolicy {
    AcceptPolicy {
        client_id: ClientId::parse("client_id", "web-1").unwrap(),
        shells: vec![wire::ShellType::Sh, wire::ShellType::Bash],
        default_shell: wire::ShellType::Sh,
        profiles: vec![wire::ProfileFlag::Light],
        cwd_roots: vec!["/tmp".into()],
        default_cwd: "/tmp".into(),
        max_running: 2,
        max_queued: 2,
        closeout_reserve: 64 * 1024,
        storage_budget: 256 << 20,
        command_total: 32 << 20,
        command_streams: 11 << 20,
        free_space_floor: 0,
    }
}

/// A UUIDv7 text for test command `n`.
pub fn issue(n: u32) -> String {
    format!(
        "01890a5d-ac96-7{:03x}-bcce-b302099a{:04x}",
        n % 0x1000,
        n % 0x10000
    )
}

pub fn dispatch(n: u32, text: &str) -> wire::Dispatch {
    let spec = wire::ExecutionSpec {
        source: Some(wire::execution_spec::Source::CommandText(text.into())),
        ..Default::default()
    };
    let normalized = check_execution_spec(&spec).unwrap();
    wire::Dispatch {
        issue_uuid: issue(n),
        generation: 1,
        revision: 1,
        request_hash: command_hash(&policy().client_id, &normalized).0.to_vec(),
        spec: Some(spec),
        queue_expiry_time: None,
    }
}

pub fn checked(n: u32, text: &str) -> CheckedDispatch {
    check_dispatch(&policy(), 1, NOW, &dispatch(n, text)).unwrap()
}
