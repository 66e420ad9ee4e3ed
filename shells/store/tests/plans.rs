#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Every statement the writer runs on a per-operation path is served by
//! an index: none scans a table that grows with the store's history
//! (`commands`, `command_events`, `command_segments`, `command_tombstones`,
//! `sessions`, `control_mutations`), and every foreign key's child column
//! leads an index, so the cascade of a parent's deletion searches. The statements are the ones the store really runs,
//! captured while a workload goes through RunCommand, dispatch,
//! acceptance, event appends, the terminal transition with its tombstone,
//! requeue, signals and stdin, a whole start's scope recovery (bounded
//! work, docs/storage.md) and the background scrub's slices, and the reads the Control service serves from its pooled readers (a
//! command, command lists and output by page token, history for a
//! follow, clients, incidents); each is planned with `EXPLAIN QUERY PLAN`.

mod support;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use prost::Message as _;
use rvbox_domain::lifecycle::Lifecycle;
use rvbox_proto::v1 as wire;
use rvbox_store::events::{EventAppend, EventBody};
use rvbox_store::operator::Caller;
use support::*;

/// Tables whose size follows the store's history.
const GROWING: [&str; 6] = [
    "commands",
    "control_mutations",
    "command_events",
    "command_segments",
    "command_tombstones",
    "sessions",
];

/// Partial indexes of rows the store keeps few of: `commands_evicting`
/// (commands whose eviction is in progress, at most one maintenance
/// batch), `commands_live` (non-terminal commands, bounded by the queue and
/// running limits), `command_segments_unverified` (their active segments
/// and the sealed ones not yet verified) and `sessions_one_live` (one per
/// connected client).
const BOUNDED_INDEXES: [&str; 4] = [
    "commands_evicting",
    "commands_live",
    "command_segments_unverified",
    "sessions_one_live",
];

/// The names a growing table goes by in `sql`: its own and its aliases.
fn names(sql: &str) -> BTreeSet<String> {
    const KEYWORDS: [&str; 16] = [
        "where", "on", "join", "set", "values", "left", "inner", "order", "group", "limit",
        "using", "select", "and", "or", "natural", "cross",
    ];
    let words: Vec<String> = sql
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    // every growing table by name (a trigger or a foreign-key check may
    // scan one the statement does not name), and the aliases it gives them
    let mut out: BTreeSet<String> = GROWING.iter().map(|t| (*t).to_owned()).collect();
    for (i, w) in words.iter().enumerate() {
        if GROWING.contains(&w.as_str()) {
            out.insert(w.clone());
            let next = match words.get(i + 1).map(String::as_str) {
                Some("as") => words.get(i + 2),
                _ => words.get(i + 1),
            };
            if let Some(alias) = next
                && !KEYWORDS.contains(&alias.as_str())
                && !GROWING.contains(&alias.as_str())
            {
                out.insert(alias.clone());
            }
        }
    }
    out
}

/// The full scans of a growing table in the plan of `sql` (a scan of a
/// covering index is a full scan too; a SEARCH, and a scan of one of the
/// [`BOUNDED_INDEXES`], are bounded).
fn scans(db: &rusqlite::Connection, sql: &str) -> Vec<String> {
    let mut stmt = match db.prepare(&format!("EXPLAIN QUERY PLAN {sql}")) {
        Ok(s) => s,
        // a statement of a trigger program or a transaction control one
        Err(_) => return Vec::new(),
    };
    let n = stmt.parameter_count();
    let params: Vec<rusqlite::types::Null> = vec![rusqlite::types::Null; n];
    let rows: Vec<String> = stmt
        .query_map(rusqlite::params_from_iter(params), |r| {
            r.get::<_, String>(3)
        })
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let names = names(sql);
    // partial indexes that hold a bounded set of rows: scanning them is
    // bounded (named one by one: a partial index of a growing set, such
    // as closed sessions, would not be)
    let partial: BTreeSet<&str> = BOUNDED_INDEXES.into_iter().collect();
    rows.into_iter()
        .filter(|d| {
            let Some(rest) = d.strip_prefix("SCAN ") else {
                return false;
            };
            let growing = rest
                .split_whitespace()
                .next()
                .is_some_and(|t| names.contains(&t.to_ascii_lowercase()));
            let index = rest
                .split_once("INDEX ")
                .and_then(|(_, i)| i.split_whitespace().next());
            growing && !index.is_some_and(|i| partial.contains(i))
        })
        .collect()
}

#[test]
fn no_per_operation_statement_scans_a_growing_table() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    // some history first, so the planner sees real tables
    for _ in 0..20 {
        let id = running_command(&mut s, "old");
        s.append_events(&[lifecycle(&id, 2, Lifecycle::Succeeded)], NOW)
            .unwrap();
    }
    s.db().execute_batch("ANALYZE").unwrap();

    let seen = Arc::new(Mutex::new(BTreeSet::<String>::new()));
    let sink = Arc::clone(&seen);
    s.trace_statements(Some(move |sql: &str| {
        sink.lock().unwrap().insert(sql.to_owned());
    }))
    .unwrap();

    // the per-operation paths
    let a = new_id();
    s.run_command(&run_request(&a, "web-1", "cat"), NOW)
        .unwrap();
    s.mark_dispatched(&a, 1).unwrap();
    s.record_accepted(&a, 1, wire::ShellType::Sh as i32)
        .unwrap();
    s.append_events(&[lifecycle(&a, 1, Lifecycle::Running)], NOW)
        .unwrap();
    s.append_events(&[output(&a, 2, b"hello\n"), output(&a, 3, b"more\n")], NOW)
        .unwrap();
    let append = wire::AppendStdinRequest {
        request_id: text(&new_id()),
        issue_uuid: text(&a),
        data: b"in".to_vec(),
        newline: wire::StdinNewline::Append as i32,
    };
    s.append_stdin_as(&append, &Caller::local(), NOW).unwrap();
    s.pending_stdin(&a, 0, 1 << 20, 64).unwrap();
    let ack = EventAppend {
        session: None,
        issue_uuid: a,
        event_seq: 4,
        observed_ms: NOW,
        body: EventBody::Other {
            kind: rvbox_store_port::events::body_kind::STDIN_ACK,
            encoded: wire::StdinAck {
                write_seq: 1,
                delivery: wire::StdinDelivery::Written as i32,
                closed: false,
                reason: String::new(),
            }
            .encode_to_vec(),
        },
    };
    s.append_events(&[ack], NOW).unwrap();
    let close = wire::CloseStdinRequest {
        request_id: text(&new_id()),
        issue_uuid: text(&a),
    };
    s.close_stdin_as(&close, &Caller::local(), NOW).unwrap();
    let signal = wire::SignalCommandRequest {
        request_id: text(&new_id()),
        issue_uuid: text(&a),
        signal: wire::SignalKind::Term as i32,
    };
    s.signal_command(
        &signal,
        |_| Ok(rvbox_store::signals::SignalPlan::Deliver),
        NOW,
    )
    .unwrap();
    s.pending_signals(&a).unwrap();
    s.append_events(&[lifecycle(&a, 5, Lifecycle::Succeeded)], NOW)
        .unwrap();
    // a requeue and a server-side end
    let b = new_id();
    s.run_command(&run_request(&b, "web-1", "true"), NOW)
        .unwrap();
    s.mark_dispatched(&b, 1).unwrap();
    s.requeue(None, &b, 1, NOW).unwrap();
    s.command_view(&b).unwrap();
    // the eviction sweep that runs at every start, the whole start's
    // scope recovery, and a cycle of the background scrub's slices on the
    // writer (its recount reads a snapshot of its own, in slices)
    s.sweep(NOW).unwrap();
    s.recover(NOW).unwrap();
    s.scrub_cycle(NOW).unwrap();
    s.trace_statements(None::<fn(&str)>).unwrap();

    // the reads the Control service serves, on a pooled reader
    let writes = seen.lock().unwrap().len();
    let mut r = s.reader().unwrap();
    let sink = Arc::clone(&seen);
    r.trace_statements(Some(move |sql: &str| {
        sink.lock().unwrap().insert(sql.to_owned());
    }))
    .unwrap();
    r.command_record(&a).unwrap();
    let first = r
        .list_commands(&wire::ListCommandsRequest {
            client_id: Some("old".into()),
            page_size: 5,
            ..Default::default()
        })
        .unwrap();
    r.list_commands(&wire::ListCommandsRequest {
        client_id: Some("old".into()),
        page_size: 5,
        page_token: first.next_page_token,
        ..Default::default()
    })
    .unwrap();
    let all = r
        .list_commands(&wire::ListCommandsRequest {
            page_size: 5,
            ..Default::default()
        })
        .unwrap();
    r.list_commands(&wire::ListCommandsRequest {
        page_size: 5,
        page_token: all.next_page_token,
        ..Default::default()
    })
    .unwrap();
    let page = r
        .get_output(&wire::GetOutputRequest {
            issue_uuid: text(&a),
            streams: vec![
                wire::OutputStream::Stdout as i32,
                wire::OutputStream::Stderr as i32,
            ],
            max_bytes: 6,
            ..Default::default()
        })
        .unwrap();
    r.get_output(&wire::GetOutputRequest {
        issue_uuid: text(&a),
        streams: vec![
            wire::OutputStream::Stdout as i32,
            wire::OutputStream::Stderr as i32,
        ],
        max_bytes: 6,
        page_token: page.next_page_token,
        ..Default::default()
    })
    .unwrap();
    r.events_after(&a, 1, 100).unwrap();
    r.list_clients(&wire::ListClientsRequest::default())
        .unwrap();
    // the filtered scans: a selector and a glob over clients, a selector
    // over every client's commands and over one client's
    r.list_clients(&wire::ListClientsRequest {
        selector: "role=web".into(),
        client_glob: "web-*".into(),
        ..Default::default()
    })
    .unwrap();
    r.list_commands(&wire::ListCommandsRequest {
        selector: "role=web".into(),
        ..Default::default()
    })
    .unwrap();
    r.list_commands(&wire::ListCommandsRequest {
        client_id: Some("old".into()),
        selector: "role=web".into(),
        ..Default::default()
    })
    .unwrap();
    r.get_client("web-1", NOW).unwrap();
    r.incident_page(&wire::ListStorageIncidentsRequest::default())
        .unwrap();
    r.trace_statements(None::<fn(&str)>).unwrap();
    assert!(
        seen.lock().unwrap().len() > writes + 5,
        "the reader's statements were seen"
    );

    let statements = seen.lock().unwrap().clone();
    assert!(
        statements.len() > 20,
        "the trace saw the workload: {statements:?}"
    );
    let mut found = Vec::new();
    for sql in &statements {
        for scan in scans(s.db(), sql) {
            found.push(format!(
                "{scan}  <-  {}",
                sql.split_whitespace().collect::<Vec<_>>().join(" ")
            ));
        }
    }
    assert!(
        found.is_empty(),
        "per-operation statements that scan a growing table:\n{}",
        found.join("\n")
    );
}

/// A foreign key's action (the cascade of an evicted command, an idle
/// client's deletion, a pruned incident) looks its child rows up by the
/// child column; `EXPLAIN QUERY PLAN` of the statement does not show that
/// lookup, so every key of the schema is planned here on its own.
#[test]
fn every_foreign_key_lookup_is_a_search() {
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    let tables: Vec<String> = s
        .db()
        .prepare("SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'")
        .unwrap()
        .query_map([], |r| r.get(0))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    let mut keys = Vec::new();
    let mut scanned = Vec::new();
    for table in &tables {
        let columns: Vec<(String, String)> = s
            .db()
            .prepare("SELECT \"from\", \"table\" FROM pragma_foreign_key_list(?1)")
            .unwrap()
            .query_map([table], |r| Ok((r.get(0)?, r.get(1)?)))
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        for (column, parent) in columns {
            let sql = format!("SELECT 1 FROM {table} WHERE {column} = ?1");
            let plan: Vec<String> = s
                .db()
                .prepare(&format!("EXPLAIN QUERY PLAN {sql}"))
                .unwrap()
                .query_map([rusqlite::types::Null], |r| r.get(3))
                .unwrap()
                .collect::<Result<_, _>>()
                .unwrap();
            if plan.iter().any(|d| d.starts_with("SCAN ")) {
                scanned.push(format!("{table}.{column} -> {parent}: {plan:?}"));
            }
            keys.push(format!("{table}.{column}"));
        }
    }
    assert!(
        keys.len() >= 10,
        "the schema's foreign keys were read: {keys:?}"
    );
    assert!(
        scanned.is_empty(),
        "foreign keys whose child lookup scans its table:\n{}",
        scanned.join("\n")
    );
}

#[test]
fn aliases_of_growing_tables_are_recognised() {
    let n = names("SELECT 1 FROM commands c JOIN command_events AS e ON e.x = c.x WHERE c.y = 1");
    assert!(n.contains("c") && n.contains("e") && n.contains("commands"));
    assert!(!names("SELECT 1 FROM commands WHERE x = 1").contains("where"));
    let dir = tempfile::tempdir().unwrap();
    let s = open(dir.path());
    // a scan through an alias is found
    assert!(!scans(s.db(), "SELECT 1 FROM commands c WHERE c.exit_code = 3").is_empty());
    // a primary-key lookup is not a scan
    assert!(scans(s.db(), "SELECT 1 FROM commands c WHERE c.issue_uuid = ?1").is_empty());
}
