//! `rvbox-server audit --data-dir DIR`: the audit log offline (docs/storage.md,
//! "The audit chain"). `verify` checks every committed record against the
//! hash chain and the hashes the database keeps per segment, and prints the
//! chain's head to keep elsewhere; `list` prints records. It opens the
//! store through the same library and single-instance lock as the daemon
//! (so the server must be stopped), runs no recovery and changes nothing.

use std::fmt::Write as _;

use clap::{Arg, ArgMatches, Command, value_parser};
use rvbox_store::Store;
use rvbox_store::audit::{AuditOutcome, AuditRecord};

use crate::repair::EXIT_STORE;

/// Exit status of `verify` when the log does not match its chain.
pub(crate) const EXIT_TAMPERED: i32 = 6;
/// Most records one `list` prints.
const MAX_LIST: usize = 100_000;

/// The `audit` subcommand.
#[must_use]
pub(crate) fn command() -> Command {
    Command::new("audit")
        .about("The audit log offline: verify its hash chain, or list records (the server must be stopped)")
        .arg(crate::repair::data_dir_arg())
        .subcommand_required(true)
        .subcommand(Command::new("verify").about(
            "Check every committed audit record against the hash chain; exit 6 and name each problem when a record was edited, removed or reordered",
        ))
        .subcommand(
            Command::new("list")
                .about("Print audit records, oldest first, one per line")
                .arg(
                    Arg::new("after")
                        .long("after")
                        .value_name("SEQ")
                        .value_parser(value_parser!(u64))
                        .default_value("0")
                        .help("Only records after this sequence"),
                )
                .arg(
                    Arg::new("limit")
                        .long("limit")
                        .value_name("N")
                        .value_parser(value_parser!(u64).range(1..=MAX_LIST as u64))
                        .default_value("1000")
                        .help("Most records printed (at most 100000)"),
                ),
        )
}

/// Runs `audit`; returns the process exit status.
#[must_use]
pub(crate) fn run(matches: &ArgMatches) -> i32 {
    let store =
        match crate::repair::open_offline(matches, "audit", crate::core_loop::Clock::wall_ms()) {
            Ok(s) => s,
            Err(status) => return status,
        };
    match matches.subcommand() {
        Some(("verify", _)) => verify(&store),
        Some(("list", m)) => {
            let after = m.get_one::<u64>("after").copied().unwrap_or(0);
            let limit = m.get_one::<u64>("limit").copied().unwrap_or(1000);
            list(&store, after, usize::try_from(limit).unwrap_or(MAX_LIST))
        }
        _ => 2,
    }
}

fn hex(b: &[u8]) -> String {
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

fn verify(store: &Store) -> i32 {
    let v = match store.verify_audit() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("rvbox-server audit: the audit log cannot be read: {e}");
            return EXIT_STORE;
        }
    };
    let waiting = store.audit_outbox_len().unwrap_or(0);
    println!(
        "segments {}  chained records {}  unchained (older) records {}  waiting in the outbox {}",
        v.segments, v.chained, v.unchained, waiting
    );
    println!("head {}", hex(&v.head));
    if v.problems.is_empty() {
        tracing::info!(
            segments = v.segments,
            records = v.chained,
            "audit log verified"
        );
        println!("ok: every committed record matches the chain");
        return 0;
    }
    tracing::error!(
        problems = v.problems.len(),
        "the audit log does not match its chain"
    );
    for p in &v.problems {
        println!("problem: {p}");
    }
    eprintln!(
        "rvbox-server audit: {} problem(s): the audit log was changed after it was written",
        v.problems.len()
    );
    EXIT_TAMPERED
}

fn line(seq: u64, r: &AuditRecord) -> String {
    let outcome = match r.outcome {
        AuditOutcome::Ok => "ok",
        AuditOutcome::Refused => "refused",
        AuditOutcome::Failed => "failed",
    };
    let mut s = format!(
        "{seq} {} {} {} {} {outcome}",
        r.time_ms,
        if r.transport.is_empty() {
            "-"
        } else {
            &r.transport
        },
        if r.principal.is_empty() {
            "-"
        } else {
            &r.principal
        },
        r.action
    );
    if let Some(c) = &r.client_id {
        let _ = write!(s, " client={c}");
    }
    if let Some(u) = &r.issue_uuid {
        let _ = write!(s, " issue={}", uuid::Uuid::from_bytes(*u).hyphenated());
    }
    if let Some(e) = r.error_code {
        let _ = write!(s, " error_code={e}");
    }
    if !r.env_keys.is_empty() {
        let _ = write!(s, " env_keys={}", r.env_keys.join(","));
    }
    if !r.detail.is_empty() {
        // one line per record, whatever the detail holds
        let detail: String = r
            .detail
            .chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .collect();
        let _ = write!(s, " detail={detail:?}");
    }
    s
}

fn list(store: &Store, after: u64, limit: usize) -> i32 {
    match store.read_audit(after, limit) {
        Ok(records) => {
            for (seq, r) in &records {
                println!("{}", line(*seq, r));
            }
            0
        }
        Err(e) => {
            eprintln!("rvbox-server audit: the audit log cannot be read: {e}");
            EXIT_STORE
        }
    }
}
