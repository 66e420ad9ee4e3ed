//! Scoped store health (plan §5.1): `recovering`, `ready`, `dirty_readable`
//! and `unavailable`, for the global store and for each scope with an open
//! incident. The state lives behind a shared handle so the server's
//! liveness and incident-inspection endpoints can answer while recovery
//! runs on the writer; mutations check only the scopes they touch.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::Connection;
use rvbox_domain::error::{Code, DomainError};
use rvbox_proto::v1 as wire;

use crate::error::StoreError;
use crate::incidents;

/// Most scopes a health report lists (the wire bound).
pub const MAX_REPORTED_SCOPES: usize = 1000;
/// Most incident ids listed per scope.
const MAX_IDS_PER_SCOPE: usize = 100;
/// Most open incidents health derivation reads.
const MAX_OPEN_INCIDENTS: u32 = 100_000;

/// The state of one scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScopeState {
    /// Recovery has not finished.
    Recovering,
    /// Usable.
    Ready,
    /// Readable; mutations refused until the open incidents are resolved.
    DirtyReadable,
    /// Not usable (the database failed its integrity check).
    Unavailable,
}

impl ScopeState {
    fn to_wire(self) -> wire::ScopeState {
        match self {
            Self::Recovering => wire::ScopeState::Recovering,
            Self::Ready => wire::ScopeState::Ready,
            Self::DirtyReadable => wire::ScopeState::DirtyReadable,
            Self::Unavailable => wire::ScopeState::Unavailable,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Recovering => "recovering",
            Self::Ready => "ready",
            Self::DirtyReadable => "dirty_readable",
            Self::Unavailable => "unavailable",
        }
    }
}

/// Where the start-up integrity check (`PRAGMA quick_check`) stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntegrityState {
    Running,
    Passed,
    Failed,
}

#[derive(Debug)]
struct State {
    global: ScopeState,
    audit: ScopeState,
    /// The start's scope recovery finished: client, session and command
    /// scopes serve (plan §5.1 item 6) while the global scope may still
    /// wait for the integrity check.
    scopes_recovered: bool,
    integrity: IntegrityState,
    /// An open incident names the global scope.
    global_dirty: bool,
    /// Scopes with open incidents: (kind, key) -> incident ids.
    dirty: BTreeMap<(i32, String), Vec<String>>,
    open_incidents: u32,
    bootstrap: Option<wire::StorageIncident>,
}

/// A shared view of the store's health. Cloning shares the state.
#[derive(Debug, Clone)]
pub struct Health {
    state: Arc<Mutex<State>>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                global: ScopeState::Recovering,
                audit: ScopeState::Recovering,
                scopes_recovered: false,
                integrity: IntegrityState::Passed,
                global_dirty: false,
                dirty: BTreeMap::new(),
                open_incidents: 0,
                bootstrap: None,
            })),
        }
    }
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The global state once recovery and the integrity check say so.
fn settle(s: &mut State) {
    if s.global == ScopeState::Unavailable {
        return;
    }
    if s.global == ScopeState::Recovering
        && !(s.scopes_recovered && s.integrity == IntegrityState::Passed)
    {
        return;
    }
    s.global = if s.global_dirty {
        ScopeState::DirtyReadable
    } else {
        ScopeState::Ready
    };
}

/// Scope recovery finished and the integrity check is still running.
/// The refusal of a write while the store as a whole is `state` (not
/// ready): every store backend answers it so.
#[must_use]
pub fn store_not_ready(state: &str) -> DomainError {
    DomainError::new(
        Code::Unavailable,
        format!("the server store is {state}; retry later"),
    )
}

/// The refusal of a write to a scope with an open storage incident (the
/// first such incident's id attached, when known).
#[must_use]
pub fn dirty_scope(kind: wire::ScopeKind, incident: Option<&str>) -> DomainError {
    let e = DomainError::new(
        Code::Unavailable,
        format!(
            "the {} scope has an open storage incident; repair or acknowledge it first",
            kind.as_str_name()
                .trim_start_matches("SCOPE_KIND_")
                .to_ascii_lowercase()
        ),
    );
    match incident {
        Some(id) => e.with_incident(id.to_owned()),
        None => e,
    }
}

fn serving_scopes(s: &State) -> bool {
    s.global == ScopeState::Recovering
        && s.scopes_recovered
        && s.integrity == IntegrityState::Running
}

fn canonical(id: &[u8; 16]) -> String {
    uuid::Uuid::from_bytes(*id).hyphenated().to_string()
}

impl Health {
    /// The global store state.
    #[must_use]
    pub fn global(&self) -> ScopeState {
        lock(&self.state).global
    }

    /// Marks recovery as running (every mutation is gated).
    pub fn set_recovering(&self) {
        let mut s = lock(&self.state);
        s.global = ScopeState::Recovering;
        s.audit = ScopeState::Recovering;
        s.scopes_recovered = false;
        tracing::info!(state = "recovering", "store scope state");
    }

    /// Marks a store whose recovery is its database's own (PostgreSQL:
    /// what committed is there, what did not is not) as recovered, with
    /// no scope dirty.
    pub fn ready_without_recovery(&self) {
        let mut s = lock(&self.state);
        s.scopes_recovered = true;
        s.integrity = IntegrityState::Passed;
        s.audit = ScopeState::Ready;
        settle(&mut s);
        tracing::info!(state = "ready", "store scope state");
    }

    /// Marks the database unusable (integrity failure).
    pub fn set_unavailable(&self) {
        let mut s = lock(&self.state);
        s.global = ScopeState::Unavailable;
        s.scopes_recovered = false;
        tracing::error!(state = "unavailable", "store scope state");
    }

    /// The start-up integrity check began: global readiness waits for it.
    pub(crate) fn integrity_running(&self) {
        lock(&self.state).integrity = IntegrityState::Running;
    }

    /// The start-up integrity check passed: the global scope becomes ready
    /// once the scopes are recovered too.
    pub(crate) fn integrity_passed(&self) {
        let mut s = lock(&self.state);
        s.integrity = IntegrityState::Passed;
        settle(&mut s);
        tracing::info!(global = s.global.name(), "start-up integrity check passed");
    }

    /// The start-up integrity check failed (findings, or it could not read
    /// the database): unavailable until the offline repair or a restart.
    pub(crate) fn integrity_failed(&self) {
        let mut s = lock(&self.state);
        s.integrity = IntegrityState::Failed;
        s.global = ScopeState::Unavailable;
        s.scopes_recovered = false;
        tracing::error!(state = "unavailable", "store scope state");
    }

    /// Whether the start-up integrity check has finished (passed or not).
    #[must_use]
    pub fn integrity_settled(&self) -> bool {
        lock(&self.state).integrity != IntegrityState::Running
    }

    /// Holds an incident the database could not take (plan §5.1: "expose an
    /// in-memory bootstrap incident through health and require the offline
    /// repair tool").
    pub fn set_bootstrap(&self, incident: &incidents::NewIncident, now_ms: i64) {
        let mut s = lock(&self.state);
        s.bootstrap = Some(wire::StorageIncident {
            incident_id: String::new(),
            kind: incident.kind as i32,
            state: wire::IncidentState::Open as i32,
            scope_kind: incident.scope_kind as i32,
            scope_key: incident.scope_key.clone(),
            detected_time: Some(crate::store::to_timestamp(now_ms)),
            resolved_time: None,
            summary: incident.summary.clone(),
            repairable: false,
            data_loss: incident.data_loss,
            acknowledgement_note: String::new(),
        });
    }

    /// Re-derives every scope from the open incidents: a scope with an open
    /// incident is dirty; the global and audit scopes are ready unless an
    /// open incident names them (or the store was marked unavailable).
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn refresh(&self, conn: &Connection) -> Result<(), StoreError> {
        let open = incidents::open(conn, MAX_OPEN_INCIDENTS)?;
        let mut dirty: BTreeMap<(i32, String), Vec<String>> = BTreeMap::new();
        for i in open.iter().filter(|i| incidents::gates_scope(i.kind)) {
            let ids = dirty
                .entry((i.scope_kind as i32, i.scope_key.clone()))
                .or_default();
            if ids.len() < MAX_IDS_PER_SCOPE {
                ids.push(canonical(&i.id));
            }
        }
        let mut s = lock(&self.state);
        s.global_dirty = dirty.contains_key(&(wire::ScopeKind::GlobalStore as i32, String::new()));
        // while recovery runs, only the dirty map changes; readiness comes
        // from `recovered` and the integrity check
        settle(&mut s);
        s.audit = if dirty
            .keys()
            .any(|(k, _)| *k == wire::ScopeKind::Audit as i32)
        {
            ScopeState::DirtyReadable
        } else {
            ScopeState::Ready
        };
        s.open_incidents = u32::try_from(open.len()).unwrap_or(u32::MAX);
        s.dirty = dirty;
        tracing::info!(
            global = s.global.name(),
            dirty_scopes = s.dirty.len(),
            open_incidents = s.open_incidents,
            "store scope states"
        );
        Ok(())
    }

    /// Ends recovery: the global store becomes ready (unless it was marked
    /// unavailable or an open incident names it) and every scope is
    /// re-derived.
    ///
    /// # Errors
    /// [`StoreError::Sqlite`].
    pub fn recovered(&self, conn: &Connection) -> Result<(), StoreError> {
        {
            let mut s = lock(&self.state);
            if s.global == ScopeState::Recovering {
                s.scopes_recovered = true;
            }
        }
        self.refresh(conn)
    }

    /// Whether the store takes writes at all: the global scope is ready, or
    /// the start's scope recovery finished while the integrity check runs
    /// (then only writes confined to client, session and command scopes).
    ///
    /// # Errors
    /// `UNAVAILABLE` naming the global state.
    pub fn check_serving(&self) -> Result<(), DomainError> {
        let s = lock(&self.state);
        if s.global == ScopeState::Ready || serving_scopes(&s) {
            return Ok(());
        }
        Err(DomainError::new(
            Code::Unavailable,
            format!("the server store is {}; retry later", s.global.name()),
        ))
    }

    /// Refuses a mutation unless the global store and each named scope are
    /// ready: `UNAVAILABLE` (retryable) naming the first scope that is not.
    ///
    /// # Errors
    /// `UNAVAILABLE` with the scope and, when dirty, an incident id.
    pub fn check_writable(&self, scopes: &[(wire::ScopeKind, &str)]) -> Result<(), DomainError> {
        let s = lock(&self.state);
        // before global readiness, a recovered client, session or command
        // scope serves (plan §5.1 item 6); nothing global does
        let confined = !scopes.is_empty()
            && scopes.iter().all(|(k, _)| {
                matches!(
                    k,
                    wire::ScopeKind::Client | wire::ScopeKind::Command | wire::ScopeKind::Segment
                )
            });
        if s.global != ScopeState::Ready && !(confined && serving_scopes(&s)) {
            return Err(store_not_ready(s.global.name()));
        }
        for (kind, key) in scopes {
            if let Some(ids) = s.dirty.get(&(*kind as i32, (*key).to_owned())) {
                return Err(dirty_scope(*kind, ids.first().map(String::as_str)));
            }
        }
        Ok(())
    }

    /// The scopes with open incidents that `wanted` selects (by kind and
    /// key), as `ScopeHealth` rows, sorted; at most `limit`.
    #[must_use]
    pub fn dirty_scopes(
        &self,
        wanted: impl Fn(wire::ScopeKind, &str) -> bool,
        limit: usize,
    ) -> Vec<wire::ScopeHealth> {
        let s = lock(&self.state);
        s.dirty
            .iter()
            .filter(|((kind, key), _)| {
                wire::ScopeKind::try_from(*kind).is_ok_and(|k| wanted(k, key))
            })
            .take(limit)
            .map(|((kind, key), ids)| wire::ScopeHealth {
                scope_kind: *kind,
                scope_key: key.clone(),
                state: ScopeState::DirtyReadable.to_wire() as i32,
                incident_ids: ids.clone(),
            })
            .collect()
    }

    /// The health report (`ServerHealth`): liveness is true while this
    /// process answers; readiness only when the global and audit scopes are
    /// ready. Lists the global and audit scopes, then every dirty scope.
    #[must_use]
    pub fn report(&self, now_ms: i64) -> wire::ServerHealth {
        let s = lock(&self.state);
        let mut scopes = vec![
            wire::ScopeHealth {
                scope_kind: wire::ScopeKind::GlobalStore as i32,
                scope_key: String::new(),
                state: s.global.to_wire() as i32,
                incident_ids: s
                    .dirty
                    .get(&(wire::ScopeKind::GlobalStore as i32, String::new()))
                    .cloned()
                    .unwrap_or_default(),
            },
            wire::ScopeHealth {
                scope_kind: wire::ScopeKind::Audit as i32,
                scope_key: String::new(),
                state: s.audit.to_wire() as i32,
                incident_ids: Vec::new(),
            },
        ];
        let mut omitted = 0u32;
        for ((kind, key), ids) in &s.dirty {
            if *kind == wire::ScopeKind::GlobalStore as i32 {
                continue;
            }
            if scopes.len() >= MAX_REPORTED_SCOPES {
                omitted = omitted.saturating_add(1);
                continue;
            }
            scopes.push(wire::ScopeHealth {
                scope_kind: *kind,
                scope_key: key.clone(),
                state: wire::ScopeState::DirtyReadable as i32,
                incident_ids: ids.clone(),
            });
        }
        wire::ServerHealth {
            live: true,
            ready: s.global == ScopeState::Ready && s.audit == ScopeState::Ready,
            report_time: Some(crate::store::to_timestamp(now_ms)),
            scopes,
            omitted_scope_count: omitted,
            open_incident_count: s.open_incidents,
            bootstrap_incident: s.bootstrap.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn conn() -> Connection {
        let mut c = Connection::open_in_memory().unwrap_or_else(|e| panic!("{e}"));
        crate::db::migrate(&mut c, 0).unwrap_or_else(|e| panic!("{e}"));
        c
    }

    #[test]
    fn client_scopes_serve_while_the_integrity_check_runs_and_global_readiness_waits() {
        let c = conn();
        let h = Health::default();
        h.set_recovering();
        h.integrity_running();
        let client = [(wire::ScopeKind::Client, "web-1")];
        assert!(
            h.check_writable(&client).is_err(),
            "not before the scopes recover"
        );
        assert!(h.check_serving().is_err());
        h.recovered(&c).unwrap_or_else(|e| panic!("{e}"));
        // the scopes serve; nothing global does, and readiness waits
        assert!(h.check_writable(&client).is_ok());
        assert!(h.check_serving().is_ok());
        assert!(h.check_writable(&[]).is_err());
        assert!(
            h.check_writable(&[(wire::ScopeKind::GlobalStore, "")])
                .is_err()
        );
        assert_eq!(h.global(), ScopeState::Recovering);
        assert!(!h.report(0).ready);
        h.integrity_passed();
        assert_eq!(h.global(), ScopeState::Ready);
        assert!(h.report(0).ready);
        assert!(h.check_writable(&[]).is_ok());
    }

    #[test]
    fn a_failed_integrity_check_stops_the_scopes_too() {
        let c = conn();
        let h = Health::default();
        h.set_recovering();
        h.integrity_running();
        h.recovered(&c).unwrap_or_else(|e| panic!("{e}"));
        h.integrity_failed();
        assert_eq!(h.global(), ScopeState::Unavailable);
        assert!(
            h.check_writable(&[(wire::ScopeKind::Client, "web-1")])
                .is_err()
        );
        assert!(h.check_serving().is_err());
        // a refresh never makes an unusable store ready
        h.refresh(&c).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(h.global(), ScopeState::Unavailable);
        assert!(!h.report(0).ready);
    }
}
