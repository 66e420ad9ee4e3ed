//! `rvbox repair --state-dir DIR`: offline handling of local incidents
//! (plan §7.1). It opens the client store through the same library and the
//! same single-instance lock as the daemon, so it refuses a live store;
//! opening runs recovery and the identity check; then it lists, repairs or
//! acknowledges incidents.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Arg, ArgAction, ArgMatches, Command};
use rvbox_client_store::incidents::LocalIncident;
use rvbox_client_store::{ClientLayout, ClientStore, ClientStoreOptions, StoreError};
use rvbox_proto::v1 as wire;
use rvbox_storage::entropy::OsEntropy;
use rvbox_storage::fs::RealFs;

/// Exit status when another process holds the state directory.
pub(crate) const EXIT_LOCKED: i32 = 4;
/// Exit status when the store cannot be opened or used.
pub(crate) const EXIT_STORE: i32 = 5;
/// Exit status when the incident cannot be repaired or acknowledged as asked.
pub(crate) const EXIT_REFUSED: i32 = 6;

/// The `repair` subcommand.
#[must_use]
pub(crate) fn command() -> Command {
    Command::new("repair")
        .about("Offline repair of the client store: list, repair or acknowledge local incidents (the daemon must be stopped)")
        .arg(
            Arg::new("state-dir")
                .long("state-dir")
                .value_name("DIR")
                .required(true)
                .help("The client's state directory (client.state_dir)"),
        )
        .subcommand_required(true)
        .subcommand(
            Command::new("list")
                .about("List local incidents, open ones first")
                .arg(
                    Arg::new("all")
                        .long("all")
                        .action(ArgAction::SetTrue)
                        .help("Include repaired and acknowledged incidents"),
                ),
        )
        .subcommand(
            Command::new("repair")
                .about("Run the incident's safe repair (a damaged identity is rewritten from the store's copy)")
                .arg(Arg::new("incident").value_name("INCIDENT-ID").required(true)),
        )
        .subcommand(
            Command::new("acknowledge")
                .about("Accept an incident with a note; for an identity without a copy, start a new installation")
                .arg(Arg::new("incident").value_name("INCIDENT-ID").required(true))
                .arg(
                    Arg::new("note")
                        .long("note")
                        .value_name("TEXT")
                        .required(true)
                        .help("Why it is accepted (1 byte to 4 KiB)"),
                ),
        )
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn parse_id(text: &str) -> Option<[u8; 16]> {
    uuid::Uuid::parse_str(text).ok().map(|u| *u.as_bytes())
}

fn id_text(id: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*id).hyphenated().to_string()
}

fn state_name(s: wire::IncidentState) -> String {
    s.as_str_name()
        .trim_start_matches("INCIDENT_STATE_")
        .to_ascii_lowercase()
}

/// Runs `repair`; returns the process exit status.
#[must_use]
pub(crate) fn run(matches: &ArgMatches) -> i32 {
    let Some(dir) = matches.get_one::<String>("state-dir").map(PathBuf::from) else {
        return 2;
    };
    let layout = ClientLayout::new(&dir);
    if !layout.db_file().exists() {
        eprintln!(
            "rvbox repair: {} holds no RVBox client store (no db/client.sqlite3)",
            dir.display()
        );
        return EXIT_STORE;
    }
    let now = now_ms();
    let mut store = match ClientStore::open(
        layout,
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        ClientStoreOptions::default(),
        now,
    ) {
        Ok(s) => s,
        Err(e @ StoreError::Locked { .. }) => {
            eprintln!("rvbox repair: {e}; stop the client daemon first");
            return EXIT_LOCKED;
        }
        Err(e) => {
            eprintln!("rvbox repair: cannot open the client store: {e}");
            return EXIT_STORE;
        }
    };
    let r = store.recovery_report();
    if r.tails_truncated + r.segments_damaged + r.orphans_removed > 0 {
        println!(
            "recovery: {} uncommitted tail(s) cut, {} damaged segment(s) recorded, {} orphan file(s) removed",
            r.tails_truncated, r.segments_damaged, r.orphans_removed
        );
    }
    match matches.subcommand() {
        Some(("list", m)) => list(&store, m.get_flag("all")),
        Some(("repair", m)) => {
            let Some(id) = m.get_one::<String>("incident").and_then(|t| parse_id(t)) else {
                eprintln!("rvbox repair: INCIDENT-ID must be a UUID");
                return 2;
            };
            outcome(store.repair(&id, now))
        }
        Some(("acknowledge", m)) => {
            let (Some(id), Some(note)) = (
                m.get_one::<String>("incident").and_then(|t| parse_id(t)),
                m.get_one::<String>("note"),
            ) else {
                eprintln!("rvbox repair: INCIDENT-ID must be a UUID");
                return 2;
            };
            if note.len() > 4096 {
                eprintln!("rvbox repair: --note is {} bytes; at most 4096", note.len());
                return 2;
            }
            outcome(store.acknowledge(&id, note, now))
        }
        _ => 2,
    }
}

fn outcome(r: Result<String, StoreError>) -> i32 {
    match r {
        Ok(said) => {
            println!("{said}");
            0
        }
        Err(StoreError::Layout { reason, .. }) => {
            eprintln!("rvbox repair: {reason}");
            EXIT_REFUSED
        }
        Err(e) => {
            eprintln!("rvbox repair: {e}");
            EXIT_STORE
        }
    }
}

fn list(store: &ClientStore, all: bool) -> i32 {
    let rows: Vec<LocalIncident> = match store.incidents() {
        Ok(rows) => rows
            .into_iter()
            .filter(|i| all || i.state == wire::IncidentState::Open)
            .collect(),
        Err(e) => {
            eprintln!("rvbox repair: cannot read incidents: {e}");
            return EXIT_STORE;
        }
    };
    if rows.is_empty() {
        println!(
            "{}",
            if all {
                "no local incidents"
            } else {
                "no open local incidents"
            }
        );
        return 0;
    }
    println!(
        "{:<36}  {:<12}  {:<28}  SUMMARY",
        "INCIDENT", "STATE", "KIND"
    );
    for i in rows {
        let kind = i
            .kind
            .as_str_name()
            .trim_start_matches("INCIDENT_KIND_")
            .to_ascii_lowercase();
        println!(
            "{:<36}  {:<12}  {:<28}  {}",
            id_text(&i.incident_id),
            state_name(i.state),
            kind,
            i.summary
        );
        if let Some(note) = &i.note {
            println!("{:<36}  note: {note}", "");
        }
    }
    0
}
