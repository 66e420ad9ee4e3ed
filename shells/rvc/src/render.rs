//! Text rendering of listings and records, readable at 80 columns.

use std::fmt::Write as _;

use rvbox_proto::v1 as wire;

/// A lifecycle's short name (`running`, `succeeded`, ...).
pub(crate) fn lifecycle_name(l: i32) -> String {
    wire::Lifecycle::try_from(l).map_or_else(
        |_| "unknown".into(),
        |l| {
            l.as_str_name()
                .strip_prefix("LIFECYCLE_")
                .unwrap_or("UNKNOWN")
                .to_ascii_lowercase()
        },
    )
}

/// A signal's name (`TERM`, ...).
pub(crate) fn signal_name(s: wire::SignalKind) -> &'static str {
    s.as_str_name()
        .strip_prefix("SIGNAL_KIND_")
        .unwrap_or("UNKNOWN")
}

fn time(t: Option<&prost_types::Timestamp>) -> String {
    t.map_or_else(
        || "-".into(),
        |t| {
            let mut t = *t;
            // whole seconds are enough for a table
            t.nanos = 0;
            t.to_string()
        },
    )
}

fn shorten(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        text.to_owned()
    } else {
        let mut s: String = text.chars().take(max.saturating_sub(1)).collect();
        s.push('…');
        s
    }
}

/// `text` from another party (a client's words, a command's text, a
/// script's name) made safe to print on an operator's terminal: every
/// control character (C0, DEL, C1; newlines and tabs included) is shown
/// as `\xNN` or `\u{NNNN}`, so no escape sequence reaches the terminal.
pub(crate) fn visible(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c.is_control() {
            let n = u32::from(c);
            if n < 0x100 {
                let _ = write!(out, "\\x{n:02x}");
            } else {
                let _ = write!(out, "\\u{{{n:04x}}}");
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// A command's text (or its script's name) shortened to `max` characters.
pub(crate) fn command_summary(spec: Option<&wire::ExecutionSpec>, max: usize) -> String {
    shorten(&command_text(spec), max)
}

fn command_text(spec: Option<&wire::ExecutionSpec>) -> String {
    match spec.and_then(|s| s.source.as_ref()) {
        Some(wire::execution_spec::Source::CommandText(t)) => visible(&t.replace('\n', " ")),
        Some(wire::execution_spec::Source::Script(d)) => {
            format!("script {}", visible(&d.display_basename))
        }
        None => String::new(),
    }
}

fn exit_text(r: Option<&wire::ExitResult>) -> String {
    match r {
        Some(wire::ExitResult {
            exit_code: Some(c), ..
        }) => format!("exit {c}"),
        Some(wire::ExitResult {
            signal_number: Some(n),
            signal_name,
            ..
        }) => {
            if signal_name.is_empty() {
                format!("signal {n}")
            } else {
                format!("signal {signal_name}")
            }
        }
        _ => String::new(),
    }
}

/// Width every table fits in.
const WIDTH: u16 = 80;

/// A borderless table (as kubectl and systemctl print them) fitted to
/// [`WIDTH`] columns: a long cell wraps within its column instead of
/// pushing the line past 80.
fn table(header: &[&str]) -> comfy_table::Table {
    let mut t = comfy_table::Table::new();
    t.load_style(comfy_table::presets::NOTHING)
        .set_content_arrangement(comfy_table::ContentArrangement::Dynamic)
        .set_width(WIDTH)
        .set_header(header.iter().copied());
    t
}

/// A table's text: lines without trailing blanks, one newline each.
fn finish(t: &comfy_table::Table) -> String {
    let mut out = String::new();
    for line in t.lines() {
        let line = line.trim_end();
        // the preset pads a leading column of one blank
        let line = line.strip_prefix(' ').unwrap_or(line);
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// `rvc stat`: the clients.
pub(crate) fn clients(list: &[wire::ClientSummary]) -> String {
    let mut t = table(&["CLIENT", "STATE", "GEN", "LAST SEEN", "LABELS"]);
    for c in list {
        t.add_row(vec![
            c.client_id.clone(),
            if c.connected { "connected" } else { "offline" }.to_owned(),
            c.generation.to_string(),
            time(c.last_seen_time.as_ref()),
            shorten(&labels_text(&c.labels), 60),
        ]);
    }
    finish(&t)
}

/// `rvc list`: commands, newest first.
pub(crate) fn commands(list: &[wire::CommandRecord]) -> String {
    let mut t = table(&["UUID", "CLIENT", "STATE", "COMMAND"]);
    // a UUID never wraps: it is copied to the next command
    if let Some(c) = t.column_mut(0) {
        c.set_constraint(comfy_table::ColumnConstraint::Absolute(
            comfy_table::Width::Fixed(38),
        ));
    }
    for c in list {
        t.add_row(vec![
            c.issue_uuid.clone(),
            c.client_id.clone(),
            lifecycle_name(c.lifecycle),
            shorten(&command_text(c.spec.as_ref()), 60),
        ]);
    }
    finish(&t)
}

/// Labels as `key=value,key=value` (sorted by key, as the server keeps
/// them); empty without labels.
pub(crate) fn labels_text(labels: &[wire::Label]) -> String {
    labels
        .iter()
        .map(|l| format!("{}={}", l.key, l.value))
        .collect::<Vec<_>>()
        .join(",")
}

/// A time as the tables show it (whole seconds, UTC).
pub(crate) fn time_text(t: Option<&prost_types::Timestamp>) -> String {
    time(t)
}

/// `rvc client show`: one client's registration.
pub(crate) fn client(r: &wire::GetClientResponse) -> String {
    let mut out = String::new();
    if let Some(c) = &r.client {
        let _ = writeln!(out, "client      {}", c.client_id);
        let _ = writeln!(
            out,
            "state       {}",
            if c.connected { "connected" } else { "offline" }
        );
        let _ = writeln!(out, "generation  {}", c.generation);
        let _ = writeln!(out, "last seen   {}", time(c.last_seen_time.as_ref()));
        if !c.labels.is_empty() {
            let _ = writeln!(out, "labels      {}", labels_text(&c.labels));
        }
    }
    match &r.pending_claim {
        Some(p) => {
            let _ = writeln!(
                out,
                "claim       instance {} tried to connect at {}",
                p.client_instance_id,
                time(p.observed_time.as_ref())
            );
        }
        None => {
            let _ = writeln!(out, "claim       none");
        }
    }
    if r.takeover_grant_expiry_time.is_some() {
        let _ = writeln!(
            out,
            "takeover    granted until {}",
            time(r.takeover_grant_expiry_time.as_ref())
        );
    }
    for d in &r.dirty_scopes {
        let state = enum_name(
            wire::ScopeState::try_from(d.state)
                .ok()
                .map(|k| k.as_str_name()),
            "SCOPE_STATE_",
        );
        let _ = writeln!(out, "scope       {} {state}", shorten(&d.scope_key, 60));
    }
    out
}

fn enum_name(name: Option<&str>, prefix: &str) -> String {
    name.map_or_else(
        || "unknown".to_owned(),
        |n| n.strip_prefix(prefix).unwrap_or(n).to_ascii_lowercase(),
    )
}

/// `rvc storage incidents` (and the answers of repair and acknowledge):
/// one incident per row, what it concerns, its summary and note beneath
/// it; every line within 80 columns.
pub(crate) fn incidents(list: &[wire::StorageIncident]) -> String {
    let mut out = String::new();
    if list.is_empty() {
        let _ = writeln!(out, "{:<36} {:<12} DETECTED", "INCIDENT", "STATE");
    }
    for i in list {
        let kind = enum_name(
            wire::IncidentKind::try_from(i.kind)
                .ok()
                .map(|k| k.as_str_name()),
            "INCIDENT_KIND_",
        );
        let state = enum_name(
            wire::IncidentState::try_from(i.state)
                .ok()
                .map(|k| k.as_str_name()),
            "INCIDENT_STATE_",
        );
        let scope = enum_name(
            wire::ScopeKind::try_from(i.scope_kind)
                .ok()
                .map(|k| k.as_str_name()),
            "SCOPE_KIND_",
        );
        if out.is_empty() {
            let _ = writeln!(out, "{:<36} {:<12} DETECTED", "INCIDENT", "STATE");
        }
        let _ = writeln!(
            out,
            "{:<36} {:<12} {}",
            i.incident_id,
            state,
            time(i.detected_time.as_ref())
        );
        let _ = writeln!(
            out,
            "  {}",
            shorten(&format!("{kind} in {scope} {}", i.scope_key), 78)
        );
        let what = match (i.data_loss, i.repairable) {
            (true, _) => "data lost; repair refuses it: acknowledge it with a note",
            (false, true) => "no data lost; repairable",
            (false, false) => "no data lost; acknowledge it with a note",
        };
        let _ = writeln!(out, "  {what}");
        if !i.summary.is_empty() {
            let _ = writeln!(out, "  {}", shorten(&i.summary.replace('\n', " "), 78));
        }
        if !i.acknowledgement_note.is_empty() {
            let _ = writeln!(
                out,
                "  note: {}",
                shorten(&i.acknowledgement_note.replace('\n', " "), 72)
            );
        }
    }
    out
}

/// `rvc stat CLIENT UUID`: one command, its lifecycle and its history
/// apart, and its client's pending takeover claim.
pub(crate) fn command(c: &wire::CommandRecord, client: &wire::GetClientResponse) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "command     {}", c.issue_uuid);
    let _ = writeln!(out, "client      {}", c.client_id);
    let _ = writeln!(out, "run         {}", command_text(c.spec.as_ref()));
    let _ = writeln!(out);
    let _ = writeln!(out, "lifecycle");
    let exit = exit_text(c.exit_result.as_ref());
    let _ = writeln!(
        out,
        "  state     {}{}",
        lifecycle_name(c.lifecycle),
        if exit.is_empty() {
            String::new()
        } else {
            format!(" ({exit})")
        }
    );
    let _ = writeln!(out, "  revision  {}", c.revision);
    if let Some(r) = &c.rejection {
        let _ = writeln!(out, "  rejected  {}", visible(&r.reason));
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "history");
    let _ = writeln!(out, "  issued    {}", time(c.issue_time.as_ref()));
    let _ = writeln!(
        out,
        "  expires   {}",
        c.queue_expiry_time
            .as_ref()
            .map_or_else(|| "never (no queue TTL)".into(), |t| time(Some(t)))
    );
    if let Some(e) = &c.expiry {
        let _ = writeln!(
            out,
            "  expired   {}: {}",
            time(e.expired_time.as_ref()),
            visible(&e.reason)
        );
    }
    if c.expiry.is_some() && c.lifecycle != wire::Lifecycle::Expired as i32 {
        let _ = writeln!(
            out,
            "  late      its client's result came after the expiry; the state above is that result"
        );
    }
    if c.expired_pending_reconciliation {
        let _ = writeln!(
            out,
            "  note      past its queue TTL while dispatched; the client's answer decides"
        );
    }
    if c.terminal_time.is_some() {
        let _ = writeln!(out, "  ended     {}", time(c.terminal_time.as_ref()));
    }
    let _ = writeln!(out);
    let _ = writeln!(out, "output");
    let range = c.retained_range.unwrap_or_default();
    let _ = writeln!(
        out,
        "  events    {} (retained {}-{}, {})",
        c.last_event_seq,
        range.first_event_seq,
        range.last_event_seq,
        wire::RetentionStatus::try_from(c.retention_status).map_or("unknown".into(), |s| s
            .as_str_name()
            .strip_prefix("RETENTION_STATUS_")
            .unwrap_or("UNKNOWN")
            .to_ascii_lowercase())
    );
    if c.terminal_output_incomplete {
        let _ = writeln!(out, "  warning   the output is incomplete (see rvc follow)");
    }
    for s in &c.dirty_scopes {
        let _ = writeln!(
            out,
            "  storage   {} {} dirty: incidents {}",
            wire::ScopeKind::try_from(s.scope_kind).map_or("UNKNOWN", |k| k.as_str_name()),
            s.scope_key,
            s.incident_ids.join(", ")
        );
    }
    if let Some(p) = &client.pending_claim {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "client      instance {} claims {} (rvc client takeover)",
            p.client_instance_id, c.client_id
        );
    }
    out
}

/// A terminal's state's short name (`opening`, `open`, `closed`).
pub(crate) fn pty_state_name(s: i32) -> String {
    enum_name(
        wire::PtyState::try_from(s).ok().map(|k| k.as_str_name()),
        "PTY_STATE_",
    )
}

/// `rvc terminals`: one row per terminal (id, client, state, size,
/// viewers, idle time), and beneath it when it opened and, once closed,
/// when, why and how its shell ended; every line within 80 columns.
pub(crate) fn terminals(list: &[wire::PtySessionInfo], now: std::time::SystemTime) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<36} {:<12} {:<7} {:<9} {:<7} IDLE",
        "TERMINAL", "CLIENT", "STATE", "SIZE", "VIEWERS"
    );
    for t in list {
        let closed = t.state == wire::PtyState::Closed as i32;
        let idle = if closed {
            "-".to_owned()
        } else {
            t.last_activity_time
                .as_ref()
                .or(t.opened_time.as_ref())
                .and_then(|at| std::time::SystemTime::try_from(*at).ok())
                .map_or_else(
                    || "-".to_owned(),
                    // a time ahead of this host's clock reads as 0s
                    |at| crate::terminal::idle_text(now.duration_since(at).unwrap_or_default()),
                )
        };
        let _ = writeln!(
            out,
            "{:<36} {:<12} {:<7} {:<9} {:<7} {idle}",
            shorten(&t.pty_session_id, 36),
            shorten(&t.client_id, 12),
            pty_state_name(t.state),
            format!("{}x{}", t.cols, t.rows),
            t.viewers,
        );
        let mut when = format!("  opened {}", time(t.opened_time.as_ref()));
        if closed {
            let reason = if t.close_reason.is_empty() {
                "closed".to_owned()
            } else {
                visible(&t.close_reason.replace('\n', " "))
            };
            let _ = write!(when, ", closed {}", time(t.closed_time.as_ref()));
            let _ = writeln!(out, "{when}");
            let how = crate::viewer::exit_text(t.exit_result.as_ref());
            let _ = writeln!(out, "  {}", shorten(&format!("{reason} ({how})"), 78));
        } else {
            let _ = writeln!(out, "{when}");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Words from a client or a command never put a control character on
    /// the operator's terminal: a rejection reason, a command's text and a
    /// script's name carrying escape sequences are shown escaped.
    #[test]
    fn text_from_other_parties_reaches_the_terminal_without_control_characters() {
        let evil = "ok\u{1b}]0;pwned\u{7}\u{1b}[2J\rgone\u{9b}31m";
        assert_eq!(
            visible(evil),
            "ok\\x1b]0;pwned\\x07\\x1b[2J\\x0dgone\\x9b31m"
        );
        assert_eq!(
            visible("plain words, é and 漢字"),
            "plain words, é and 漢字"
        );
        let record = wire::CommandRecord {
            issue_uuid: "0199aaaa-0000-7000-8000-000000000001".into(),
            client_id: "web-1".into(),
            spec: Some(wire::ExecutionSpec {
                source: Some(wire::execution_spec::Source::CommandText(evil.into())),
                ..Default::default()
            }),
            rejection: Some(wire::ErrorDetail {
                reason: evil.into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let shown = command(&record, &wire::GetClientResponse::default());
        assert!(
            !shown.chars().any(|c| c.is_control() && c != '\n'),
            "{shown:?}"
        );
        assert!(shown.contains("\\x1b]0;pwned"), "{shown}");
        let listed = commands(std::slice::from_ref(&record));
        assert!(
            !listed.chars().any(|c| c.is_control() && c != '\n'),
            "{listed:?}"
        );
    }

    #[test]
    fn the_terminals_table_reads_at_80_columns() {
        let at = |s: i64| {
            Some(prost_types::Timestamp {
                seconds: s,
                nanos: 0,
            })
        };
        let now = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_800_000_000);
        let open = wire::PtySessionInfo {
            pty_session_id: "0199aaaa-0000-7000-8000-000000000001".into(),
            client_id: "web-1".into(),
            state: wire::PtyState::Open as i32,
            opened_time: at(1_800_000_000 - 7200),
            last_activity_time: at(1_800_000_000 - 185),
            rows: 24,
            cols: 80,
            viewers: 2,
            ..Default::default()
        };
        let closed = wire::PtySessionInfo {
            pty_session_id: "0199aaaa-0000-7000-8000-000000000002".into(),
            client_id: "a-client-with-a-very-long-name".into(),
            state: wire::PtyState::Closed as i32,
            opened_time: at(1_800_000_000 - 9000),
            closed_time: at(1_800_000_000 - 8000),
            rows: 50,
            cols: 200,
            close_reason: "the shell exited".into(),
            exit_result: Some(wire::ExitResult {
                lifecycle: wire::Lifecycle::Failed as i32,
                exit_code: Some(2),
                ..Default::default()
            }),
            ..Default::default()
        };
        let text = terminals(&[open, closed], now);
        assert_eq!(
            text,
            "TERMINAL                             CLIENT       STATE   SIZE      VIEWERS IDLE\n\
             0199aaaa-0000-7000-8000-000000000001 web-1        open    80x24     2       3m\n  \
             opened 2027-01-15T06:00:00Z\n\
             0199aaaa-0000-7000-8000-000000000002 a-client-wi… closed  200x50    0       -\n  \
             opened 2027-01-15T05:30:00Z, closed 2027-01-15T05:46:40Z\n  \
             the shell exited (exit status 2)\n"
        );
        assert!(text.lines().all(|l| l.chars().count() <= 80), "{text}");
    }
}
