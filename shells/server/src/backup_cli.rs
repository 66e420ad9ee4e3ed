//! `rvbox-server backup` and `rvbox-server restore` (docs/operations.md,
//! "Backup and restore"). `backup` copies a SQLite data directory,
//! live or stopped, without its lock (the consistency argument is in
//! `rvbox_store::backup`); `restore` verifies a backup against its
//! manifest, copies it into a new directory, then opens the store there
//! as a start would (migrations, recovery, the integrity check), verifies
//! every segment (a scrub cycle) and the audit chain, and lists what
//! needs an operator.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Arg, ArgGroup, ArgMatches, Command, value_parser};
use rvbox_config::StoreBackend;
use rvbox_proto::v1 as wire;
use rvbox_store::backup::{
    self, BackupError, DEFAULT_ATTEMPTS, MAX_ATTEMPTS, RestoreError, read_manifest, restore_files,
    verify_backup,
};
use rvbox_store::entropy::OsEntropy;
use rvbox_store::fs::RealFs;
use rvbox_store::layout::Layout;
use rvbox_store::{Store, StoreOptions};

use crate::audit_cli::EXIT_TAMPERED;
use crate::repair::{EXIT_STORE, print_row, utc};

/// Exit status when the backup does not match its manifest (or has none),
/// or, for `backup`, when retention removed a file in every attempt.
pub(crate) const EXIT_INCOMPLETE: i32 = 7;
/// Exit status when the target directory is not empty.
pub(crate) const EXIT_TARGET: i32 = 8;
/// Exit status of a restore that finished with open storage incidents.
pub(crate) const EXIT_INCIDENTS: i32 = 9;
/// Most incidents a restore lists.
const LIST_LIMIT: u32 = 1000;

/// The `backup` subcommand.
#[must_use]
pub(crate) fn backup_command() -> Command {
    Command::new("backup")
        .about("Copy the SQLite data directory, consistently, while the server runs (or not) into a new directory")
        .arg(
            Arg::new("config")
                .long("config")
                .value_name("FILE")
                .help("The server's configuration: its storage.data_dir is backed up"),
        )
        .arg(
            Arg::new("data-dir")
                .long("data-dir")
                .value_name("DIR")
                .help("The data directory to back up (instead of --config)"),
        )
        .group(
            ArgGroup::new("source")
                .args(["config", "data-dir"])
                .required(true),
        )
        .arg(
            Arg::new("to")
                .long("to")
                .value_name("DIR")
                .required(true)
                .help("Where the backup goes: a new or an empty directory (its parent must exist)"),
        )
        .arg(
            Arg::new("attempts")
                .long("attempts")
                .value_name("N")
                .value_parser(value_parser!(u32).range(1..=i64::from(MAX_ATTEMPTS)))
                .default_value(DEFAULT_ATTEMPTS.to_string())
                .help("Attempts when retention removes a file while it is being copied (1-10)"),
        )
}

/// The `restore` subcommand.
#[must_use]
pub(crate) fn restore_command() -> Command {
    Command::new("restore")
        .about("Verify a backup against its manifest, copy it into a new data directory, then recover and check the store there")
        .arg(
            Arg::new("from")
                .long("from")
                .value_name("DIR")
                .required(true)
                .help("The backup (a directory `rvbox-server backup` wrote)"),
        )
        .arg(
            Arg::new("data-dir")
                .long("data-dir")
                .value_name("DIR")
                .required(true)
                .help("The new data directory: missing or empty (its parent must exist)"),
        )
}

/// The data directory `backup` reads: `--data-dir`, or `storage.data_dir`
/// of `--config`.
fn source_dir(m: &ArgMatches) -> Result<PathBuf, i32> {
    if let Some(dir) = m.get_one::<String>("data-dir") {
        return Ok(PathBuf::from(dir));
    }
    let Some(path) = m.get_one::<String>("config").map(PathBuf::from) else {
        return Err(rvbox_daemon_common::EXIT_CONFIG);
    };
    let config =
        match rvbox_daemon_common::load_server_config(&path, &[], &rvbox_daemon_common::RealHost) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("{e}");
                eprintln!(
                    "rvbox-server backup: configuration {} is invalid",
                    path.display()
                );
                return Err(rvbox_daemon_common::EXIT_CONFIG);
            }
        };
    if let StoreBackend::Postgres(_) = config.store {
        eprintln!(
            "rvbox-server backup: {} uses server.store = \"postgres\": back up the PostgreSQL database with its own tools (pg_basebackup, pg_dump); this command copies a SQLite data directory",
            path.display()
        );
        return Err(rvbox_daemon_common::EXIT_CONFIG);
    }
    Ok(config.storage.data_dir)
}

/// Runs `backup`; returns the process exit status.
#[must_use]
pub(crate) fn run_backup(m: &ArgMatches) -> i32 {
    let data = match source_dir(m) {
        Ok(d) => d,
        Err(status) => return status,
    };
    let Some(to) = m.get_one::<String>("to").map(PathBuf::from) else {
        return 2;
    };
    let attempts = m
        .get_one::<u32>("attempts")
        .copied()
        .unwrap_or(DEFAULT_ATTEMPTS);
    let started = crate::core_loop::Clock::wall_ms();
    let layout = Layout::new(&data);
    let report = match backup::backup(&RealFs, &layout, &to, attempts, started, &mut |n, stage| {
        if n > 1 && stage == backup::Stage::Start {
            eprintln!("rvbox-server backup: attempt {n} of {attempts}");
        }
    }) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rvbox-server backup: {e}");
            return match e {
                BackupError::NoStore(_) | BackupError::Store(_) => EXIT_STORE,
                BackupError::TargetNotEmpty(_) | BackupError::Overlap { .. } => EXIT_TARGET,
                BackupError::Removed { .. } => EXIT_INCOMPLETE,
            };
        }
    };
    println!(
        "backup of {} in {}: {} files, {} bytes (database {} bytes), {} commands, {} segment files, {} audit segment files",
        data.display(),
        to.display(),
        report.files,
        report.bytes,
        report.database_bytes,
        report.commands,
        report.segments,
        report.audit_segments
    );
    println!(
        "server id {}, schema version {}, taken {} (attempt {} of {attempts}); segment bytes copied before the database {}, committed during the backup {}",
        uuid::Uuid::from_bytes(report.server_id).hyphenated(),
        report.schema_version,
        utc(started),
        report.attempts,
        report.precopied_bytes,
        report.caught_up_bytes
    );
    if !report.token_key {
        eprintln!(
            "rvbox-server backup: warning: {} has no token.key; the restored store makes a new one and refuses earlier page tokens",
            data.display()
        );
    }
    for file in &report.damaged {
        eprintln!(
            "rvbox-server backup: warning: the live store lacks committed bytes of {file}: copied as found (see `rvc storage incidents`)"
        );
    }
    println!(
        "ok: restore with rvbox-server restore --from {} --data-dir NEWDIR",
        to.display()
    );
    0
}

fn restore_error(e: &RestoreError) -> i32 {
    eprintln!("rvbox-server restore: {e}");
    match e {
        RestoreError::NoManifest(_)
        | RestoreError::Manifest { .. }
        | RestoreError::Mismatch { .. } => EXIT_INCOMPLETE,
        RestoreError::TargetNotEmpty(_) => EXIT_TARGET,
        RestoreError::Store(_) => EXIT_STORE,
    }
}

/// Runs `restore`; returns the process exit status.
#[must_use]
pub(crate) fn run_restore(m: &ArgMatches) -> i32 {
    let (Some(from), Some(to)) = (
        m.get_one::<String>("from").map(PathBuf::from),
        m.get_one::<String>("data-dir").map(PathBuf::from),
    ) else {
        return 2;
    };
    let fs = RealFs;
    let manifest = match read_manifest(&fs, &from) {
        Ok(m) => m,
        Err(e) => return restore_error(&e),
    };
    // refused before the long verification
    if std::fs::read_dir(&to).is_ok_and(|mut d| d.next().is_some()) {
        return restore_error(&RestoreError::TargetNotEmpty(to));
    }
    let bytes = match verify_backup(&fs, &from, &manifest) {
        Ok(b) => b,
        Err(e) => return restore_error(&e),
    };
    println!(
        "backup of server {} taken {} (schema version {}, {} commands): {} files, {bytes} bytes, match the manifest",
        manifest.server_id,
        utc(manifest.created_ms),
        manifest.schema_version,
        manifest.commands,
        manifest.files.len()
    );
    let layout = Layout::new(&to);
    if let Err(e) = restore_files(&fs, &from, &manifest, &layout) {
        let status = restore_error(&e);
        if matches!(e, RestoreError::Mismatch { .. } | RestoreError::Store(_)) {
            eprintln!(
                "rvbox-server restore: {} holds a partial copy; remove it before trying again",
                to.display()
            );
        }
        return status;
    }
    println!("copied into {}", to.display());
    check_restored(layout)
}

/// Opens the restored store as a start does, then checks every segment,
/// the counters and the audit chain; lists open incidents.
fn check_restored(layout: Layout) -> i32 {
    let now = crate::core_loop::Clock::wall_ms();
    let dir = layout.root().to_path_buf();
    let mut store = match Store::open(
        layout,
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        now,
    ) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("rvbox-server restore: the restored store cannot be opened: {e}");
            return EXIT_STORE;
        }
    };
    match store.recover(now) {
        Ok(r) if r.integrity_ok => println!(
            "recovery: {} segments scanned, {} uncommitted tails cut, {} damaged; integrity check passed",
            r.segments_scanned, r.tails_truncated, r.segments_damaged
        ),
        Ok(_) => {
            eprintln!(
                "rvbox-server restore: the restored database failed its integrity check (see rvbox-server repair --data-dir {} list)",
                dir.display()
            );
            return EXIT_STORE;
        }
        Err(e) => {
            eprintln!("rvbox-server restore: recovery failed: {e}");
            return EXIT_STORE;
        }
    }
    match store.scrub_cycle(now) {
        Ok(s) => println!(
            "scrub: {} segments verified, {} damaged, {} counter mismatches",
            s.segments_verified, s.segments_damaged, s.counter_mismatches
        ),
        Err(e) => {
            eprintln!("rvbox-server restore: verifying the segments failed: {e}");
            return EXIT_STORE;
        }
    }
    let mut status = 0;
    match store.verify_audit() {
        Ok(v) if v.problems.is_empty() => println!(
            "audit log: {} segments, {} chained records, {} unchained (older) records; every committed record matches the chain",
            v.segments, v.chained, v.unchained
        ),
        Ok(v) => {
            for p in &v.problems {
                println!("problem: {p}");
            }
            eprintln!(
                "rvbox-server restore: {} audit chain problem(s)",
                v.problems.len()
            );
            status = EXIT_TAMPERED;
        }
        Err(e) => {
            eprintln!("rvbox-server restore: the audit log cannot be read: {e}");
            return EXIT_STORE;
        }
    }
    match store.list_incidents(Some(wire::IncidentState::Open), None, LIST_LIMIT) {
        Ok(rows) if rows.is_empty() => println!("no open storage incidents"),
        Ok(rows) => {
            for i in &rows {
                print_row(i);
            }
            eprintln!(
                "rvbox-server restore: {} open storage incident(s): see rvbox-server repair --data-dir {} list",
                rows.len(),
                dir.display()
            );
            if status == 0 {
                status = EXIT_INCIDENTS;
            }
        }
        Err(e) => {
            eprintln!("rvbox-server restore: cannot list incidents: {e}");
            return EXIT_STORE;
        }
    }
    if status == 0 {
        println!(
            "ok: start the server with storage.data_dir = \"{}\"",
            dir.display()
        );
    }
    status
}
