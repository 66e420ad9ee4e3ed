//! Wake-ups between replicas (docs/scaleout.md): a write that gives work
//! to a client sends `NOTIFY rvbox_client, '<client_id>'` (a new command,
//! or a terminal's open, input, resize or close) or
//! `'<client_id> <issue_uuid>'` (a signal or stdin of that command;
//! client ids never hold a space), and an append
//! group sends `NOTIFY rvbox_command, '<issue_uuid>'` once per command it
//! touched (a group of terminal reports likewise once per terminal whose
//! recording grew or that closed, with the terminal's id), each in the
//! writing transaction, so it is delivered only if that transaction
//! commits. A replica listens on both ([`Listener`]): the replica holding
//! the client's socket looks for the client's work at once, and
//! `FollowCommand` and `AttachPtySession` on any replica read what is new.
//!
//! Notifications are a hint, never the only path: a listener that was
//! not connected misses them, so the replica also polls (every second)
//! for the work of its live clients and for the commands it follows.

use std::time::Duration;

use postgres::{Client, NoTls, Transaction};

use crate::Fail;

/// The channel of clients that have new work (commands, signals, stdin).
pub const CLIENT_CHANNEL: &str = "rvbox_client";
/// The channel of fleet runs that may release now (a new or resumed run,
/// a late target): the replica holding the pump duty passes at once.
pub const FLEET_CHANNEL: &str = "rvbox_fleet";
/// The channel of lease heartbeats: every replica's keeper notifies it with
/// each renewal, so a listener that hears nothing on it for several
/// renewal periods knows its own connection went silent (a half-open
/// connection raises no error) and connects again.
pub const HEARTBEAT_CHANNEL: &str = "rvbox_heartbeat";
/// The channel of commands that have new events (and of terminals whose
/// recording grew or that closed).
pub const COMMAND_CHANNEL: &str = "rvbox_command";

/// Queues a wake-up for `client_id` (about `issue` when given: its signal
/// or stdin), delivered when `tx` commits.
pub(crate) fn client(
    tx: &mut Transaction<'_>,
    client_id: &str,
    issue: Option<&[u8; 16]>,
) -> Result<(), Fail> {
    let payload = match issue.map(|i| rvbox_domain::ids::Uuid7::from_bytes("issue_uuid", *i)) {
        Some(Ok(id)) => format!("{client_id} {id}"),
        _ => client_id.to_owned(),
    };
    crate::prep::execute(tx, "SELECT pg_notify($1, $2)", &[&CLIENT_CHANNEL, &payload])
        .map_err(Fail::db("notify a client's replica"))?;
    Ok(())
}

/// A client wake-up's payload: the client, and the command when given.
fn parse_client(payload: &str) -> WakeUp {
    match payload.split_once(' ') {
        Some((client, issue)) => WakeUp::Client {
            client: client.to_owned(),
            issue: rvbox_domain::ids::Uuid7::parse("issue_uuid", issue)
                .ok()
                .map(|u| *u.as_bytes()),
        },
        None => WakeUp::Client {
            client: payload.to_owned(),
            issue: None,
        },
    }
}

/// Queues a lease heartbeat, delivered when `tx` commits.
pub(crate) fn heartbeat(tx: &mut Transaction<'_>) -> Result<(), Fail> {
    crate::prep::execute(tx, "SELECT pg_notify($1, '')", &[&HEARTBEAT_CHANNEL])
        .map_err(Fail::db("notify a lease heartbeat"))?;
    Ok(())
}

/// Queues one wake-up per command (or terminal) of `issues` for their
/// followers, delivered when `tx` commits (one statement for the whole
/// group).
pub(crate) fn commands(
    tx: &mut Transaction<'_>,
    issues: &std::collections::BTreeSet<[u8; 16]>,
) -> Result<(), Fail> {
    let texts: Vec<String> = issues
        .iter()
        .filter_map(|i| rvbox_domain::ids::Uuid7::from_bytes("issue_uuid", *i).ok())
        .map(|u| u.to_string())
        .collect();
    if texts.is_empty() {
        return Ok(());
    }
    crate::prep::execute(
        tx,
        "SELECT pg_notify($1, t) FROM unnest($2::text[]) AS t",
        &[&COMMAND_CHANNEL, &texts],
    )
    .map_err(Fail::db("notify the commands' followers"))?;
    Ok(())
}

/// A wake-up as a listener receives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WakeUp {
    /// A client has new work: a command, or with `issue` a signal or
    /// stdin of that command.
    Client {
        /// The client.
        client: String,
        /// The command whose signal or stdin is new.
        issue: Option<[u8; 16]>,
    },
    /// A command has new events, or a terminal new output or its close
    /// (its canonical id).
    Command(String),
    /// A fleet run may release now.
    Fleet,
    /// A replica renewed its lease (the listener's connection is alive).
    Heartbeat,
}

/// A connection that listens on the three channels.
pub struct Listener {
    client: Client,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener").finish_non_exhaustive()
    }
}

impl Listener {
    /// Connects and listens.
    ///
    /// # Errors
    /// When the database cannot be reached.
    pub fn connect(conninfo: &str) -> Result<Self, Fail> {
        let mut config: postgres::Config = conninfo.parse().map_err(Fail::db("parse conninfo"))?;
        // a dead database host is noticed by the kernel; a silent
        // connection by the missing heartbeats (see HEARTBEAT_CHANNEL)
        config
            .connect_timeout(Duration::from_secs(5))
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(5))
            .keepalives_interval(Duration::from_secs(2))
            .keepalives_retries(3);
        let mut client = config
            .connect(NoTls)
            .map_err(Fail::db("connect a listener"))?;
        client
            .batch_execute(&format!(
                "LISTEN {CLIENT_CHANNEL}; LISTEN {COMMAND_CHANNEL}; LISTEN {FLEET_CHANNEL}; \
                 LISTEN {HEARTBEAT_CHANNEL}"
            ))
            .map_err(Fail::db("listen"))?;
        Ok(Self { client })
    }

    /// The wake-ups that arrive within `wait` (at most `max`); empty when
    /// none did. A closed connection is an error: the caller connects
    /// again (and polls meanwhile).
    ///
    /// # Errors
    /// When the connection failed or closed.
    pub fn wait(&mut self, wait: Duration, max: usize) -> Result<Vec<WakeUp>, Fail> {
        let mut out = Vec::new();
        let decode = |n: postgres::Notification| match n.channel() {
            CLIENT_CHANNEL => parse_client(n.payload()),
            FLEET_CHANNEL => WakeUp::Fleet,
            HEARTBEAT_CHANNEL => WakeUp::Heartbeat,
            _ => WakeUp::Command(n.payload().to_owned()),
        };
        let lost = |e| Fail::Db {
            context: "wait for notifications",
            source: e,
        };
        {
            use postgres::fallible_iterator::FallibleIterator as _;
            let mut notes = self.client.notifications();
            // the first within `wait`, then only what has arrived already:
            // a steady trickle never holds the batch back
            let first = notes.timeout_iter(wait).next().map_err(lost)?;
            if let Some(n) = first {
                out.push(decode(n));
                let mut ready = notes.iter();
                while out.len() < max {
                    match ready.next().map_err(lost)? {
                        Some(n) => out.push(decode(n)),
                        None => break,
                    }
                }
            }
        }
        if out.is_empty() && self.client.is_closed() {
            return Err(Fail::Integrity("the listener's connection closed".into()));
        }
        Ok(out)
    }
}
