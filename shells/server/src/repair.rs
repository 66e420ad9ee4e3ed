//! `rvbox-server repair --data-dir DIR`: offline storage-incident handling
//! (plan §5.5). It opens the store through the same library and the same
//! single-instance lock as the daemon, so it refuses to touch a live store,
//! runs recovery, then lists, repairs or acknowledges incidents.

use std::path::PathBuf;
use std::sync::Arc;

use clap::{Arg, ArgAction, ArgMatches, Command};
use rvbox_proto::v1 as wire;
use rvbox_store::entropy::{OsEntropy, uuid_v7};
use rvbox_store::fs::RealFs;
use rvbox_store::incidents::Incident;
use rvbox_store::layout::Layout;
use rvbox_store::mutations::OpError;
use rvbox_store::operator::Caller;
use rvbox_store::{Store, StoreError, StoreOptions};

/// Exit status when another process holds the data directory.
pub(crate) const EXIT_LOCKED: i32 = 4;
/// Exit status when the store cannot be opened or used.
pub(crate) const EXIT_STORE: i32 = 5;
/// Most incidents `list` prints.
const LIST_LIMIT: u32 = 1000;

/// The `repair` subcommand.
#[must_use]
pub(crate) fn command() -> Command {
    Command::new("repair")
        .about("Offline storage repair: list, repair or acknowledge storage incidents (the server must be stopped)")
        .arg(data_dir_arg())
        .subcommand_required(true)
        .subcommand(
            Command::new("list")
                .about("List storage incidents, newest first")
                .arg(
                    Arg::new("all")
                        .long("all")
                        .action(ArgAction::SetTrue)
                        .help("Include repaired and acknowledged incidents"),
                ),
        )
        .subcommand(
            Command::new("repair")
                .about("Run the incident's safe repair (never discards committed data)")
                .arg(Arg::new("incident").value_name("INCIDENT-ID").required(true)),
        )
        .subcommand(
            Command::new("acknowledge")
                .about("Accept an incident's recorded loss with a note (1 byte to 4 KiB)")
                .arg(Arg::new("incident").value_name("INCIDENT-ID").required(true))
                .arg(
                    Arg::new("note")
                        .long("note")
                        .value_name("TEXT")
                        .required(true)
                        .help("Why the loss is accepted"),
                ),
        )
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// The `--data-dir DIR` argument of the offline tools.
pub(crate) fn data_dir_arg() -> Arg {
    Arg::new("data-dir")
        .long("data-dir")
        .value_name("DIR")
        .required(true)
        .help("The server's data directory (storage.data_dir)")
}

/// Opens the store of `--data-dir` for the offline tool `tool`, with the
/// daemon's single-instance lock; the exit status (said on stderr) when
/// it cannot: no store there, a live server, or a store that fails to
/// open.
pub(crate) fn open_offline(matches: &ArgMatches, tool: &str, now: i64) -> Result<Store, i32> {
    let Some(dir) = matches.get_one::<String>("data-dir").map(PathBuf::from) else {
        return Err(2);
    };
    if !Layout::new(&dir).db_file().exists() {
        eprintln!(
            "rvbox-server {tool}: {} holds no RVBox store (no db/rvbox.sqlite3)",
            dir.display()
        );
        return Err(EXIT_STORE);
    }
    match Store::open(
        Layout::new(&dir),
        Arc::new(RealFs),
        Arc::new(OsEntropy),
        StoreOptions::default(),
        now,
    ) {
        Ok(s) => Ok(s),
        Err(e @ StoreError::Locked { .. }) => {
            eprintln!("rvbox-server {tool}: {e}; stop the server first");
            Err(EXIT_LOCKED)
        }
        Err(e) => {
            eprintln!("rvbox-server {tool}: cannot open the store: {e}");
            Err(EXIT_STORE)
        }
    }
}

/// Runs `repair`; returns the process exit status.
#[must_use]
pub(crate) fn run(matches: &ArgMatches) -> i32 {
    let now = now_ms();
    let mut store = match open_offline(matches, "repair", now) {
        Ok(s) => s,
        Err(status) => return status,
    };
    match store.recover(now) {
        Ok(r) => {
            if r.tails_truncated + r.segments_damaged + r.orphans_removed > 0 {
                println!(
                    "recovery: {} uncommitted tail(s) cut, {} damaged segment(s) recorded, {} orphan file(s) removed",
                    r.tails_truncated, r.segments_damaged, r.orphans_removed
                );
            }
        }
        Err(e) => {
            eprintln!("rvbox-server repair: recovery failed: {e}");
            return EXIT_STORE;
        }
    }
    match matches.subcommand() {
        Some(("list", m)) => list(&store, m.get_flag("all")),
        Some(("repair", m)) => {
            let Some(id) = m.get_one::<String>("incident") else {
                return 2;
            };
            let req = wire::RepairStorageIncidentRequest {
                request_id: request_id(now),
                incident_id: id.clone(),
            };
            report(
                store
                    .repair_incident(&req, &caller(), now)
                    .map(|r| r.incident),
            )
        }
        Some(("acknowledge", m)) => {
            let (Some(id), Some(note)) =
                (m.get_one::<String>("incident"), m.get_one::<String>("note"))
            else {
                return 2;
            };
            let req = wire::AcknowledgeStorageIncidentRequest {
                request_id: request_id(now),
                incident_id: id.clone(),
                note: note.clone(),
            };
            report(
                store
                    .acknowledge_incident(&req, &caller(), now)
                    .map(|r| r.incident),
            )
        }
        _ => 2,
    }
}

/// The offline tool's identity in the audit log: the invoking uid.
fn caller() -> Caller {
    let uid = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().nth(1).map(str::to_owned))
        })
        .unwrap_or_default();
    Caller {
        transport: "offline-repair".into(),
        principal: if uid.is_empty() {
            String::new()
        } else {
            format!("uid:{uid}")
        },
    }
}

fn request_id(now: i64) -> String {
    uuid_v7(&OsEntropy, now)
        .map(|b| uuid::Uuid::from_bytes(b).hyphenated().to_string())
        .unwrap_or_default()
}

fn report(result: Result<Option<wire::StorageIncident>, OpError>) -> i32 {
    match result {
        Ok(Some(i)) => {
            let state = wire::IncidentState::try_from(i.state).map_or("?", |s| {
                s.as_str_name().trim_start_matches("INCIDENT_STATE_")
            });
            println!("{} {}", i.incident_id, state.to_ascii_lowercase());
            0
        }
        Ok(None) => 0,
        Err(e) => {
            let d = e.to_domain();
            eprintln!("rvbox-server repair: {d}");
            i32::from(d.code().exit_status())
        }
    }
}

fn list(store: &Store, all: bool) -> i32 {
    let state = if all {
        None
    } else {
        Some(wire::IncidentState::Open)
    };
    match store.list_incidents(state, None, LIST_LIMIT) {
        Ok(rows) if rows.is_empty() => {
            println!(
                "{}",
                if all {
                    "no storage incidents"
                } else {
                    "no open storage incidents"
                }
            );
            0
        }
        Ok(rows) => {
            println!(
                "{:<36}  {:<12}  {:<24}  {:<20}  {:<4}  SUMMARY",
                "INCIDENT", "STATE", "KIND", "DETECTED (UTC)", "LOSS"
            );
            for i in &rows {
                print_row(i);
            }
            0
        }
        Err(e) => {
            eprintln!("rvbox-server repair: cannot list incidents: {e}");
            EXIT_STORE
        }
    }
}

pub(crate) fn print_row(i: &Incident) {
    let name = |s: &str, prefix: &str| s.trim_start_matches(prefix).to_ascii_lowercase();
    println!(
        "{:<36}  {:<12}  {:<24}  {:<20}  {:<4}  {}",
        uuid::Uuid::from_bytes(i.id).hyphenated(),
        name(i.state.as_str_name(), "INCIDENT_STATE_"),
        name(i.kind.as_str_name(), "INCIDENT_KIND_"),
        utc(i.detected_ms),
        if i.data_loss { "yes" } else { "no" },
        i.summary
    );
}

/// `YYYY-MM-DDTHH:MM:SSZ` for Unix milliseconds (proleptic Gregorian).
pub(crate) fn utc(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // civil-from-days (H. Hinnant), valid for the whole i64 day range we use
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::utc;

    #[test]
    fn utc_formatting() {
        assert_eq!(utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc(1_800_000_000_123), "2027-01-15T08:00:00Z");
        assert_eq!(utc(-1000), "1969-12-31T23:59:59Z");
    }
}
