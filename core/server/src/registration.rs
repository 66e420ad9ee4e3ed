//! Registration and fencing (plan §6.2): the client record is read, the
//! session core decides, the store installs the registration (re-checking
//! it in its transaction), and only then is the welcome sent and the
//! prior connection of the client fenced.

use rvbox_dispatch::SessionCapacity;
use rvbox_domain::error::{Code, DomainError};
use rvbox_session::{
    Input as SessionInput, Registration as Decision, RegistrationToken, SessionId, ValidHello,
};
use rvbox_store_port::ops::{Completion, OpResult, StoreOp};
use rvbox_store_port::sessions::{ClientRecord, Registration};

use crate::connections::ConnId;
use crate::{Pending as Any, ServerCore, convert, reconcile};

#[derive(Debug)]
pub(crate) enum Pending {
    /// The client record, for the decision.
    Load {
        conn: ConnId,
        token: RegistrationToken,
        hello: Box<ValidHello>,
    },
    /// The refused instance's claim.
    Claim {
        conn: ConnId,
        token: RegistrationToken,
    },
    /// The registration transaction.
    Install {
        conn: ConnId,
        token: RegistrationToken,
        client: String,
        key: [u8; 16],
        session_id: SessionId,
    },
}

fn unavailable(reason: &str) -> DomainError {
    DomainError::new(Code::Unavailable, reason)
}

impl ServerCore {
    pub(crate) fn register(
        &mut self,
        conn: ConnId,
        token: RegistrationToken,
        hello: Box<ValidHello>,
    ) {
        let client_id = hello.client_id.as_str().to_owned();
        self.store(
            StoreOp::LoadClient { client_id },
            Any::Registration(Pending::Load { conn, token, hello }),
        );
    }

    fn reject(&mut self, conn: ConnId, token: RegistrationToken, error: DomainError) {
        self.session_input(conn, SessionInput::RegistrationRejected { token, error });
    }

    fn random_session_id(&mut self) -> Option<([u8; 16], SessionId)> {
        let mut b = [0u8; 16];
        if let Err(e) = self.entropy.fill(&mut b) {
            self.stats.entropy_failures += 1;
            tracing::error!(error = %e, "no randomness for a session id");
            return None;
        }
        let text: String = b.iter().map(|x| format!("{x:02x}")).collect();
        SessionId::parse(&text).ok().map(|s| (b, s))
    }

    pub(crate) fn registration_done(&mut self, p: Pending, result: OpResult) {
        match p {
            Pending::Load { conn, token, hello } => {
                if !self.conns.contains_key(&conn) {
                    return;
                }
                match result {
                    Ok(Completion::Client(record)) => {
                        self.decide(conn, token, &hello, record.as_ref());
                    }
                    Ok(_) => {
                        self.mismatch("load_client");
                        self.reject(conn, token, unavailable("server store unavailable"));
                    }
                    Err(e) => {
                        tracing::error!(error = %e, "client record not readable");
                        self.reject(conn, token, unavailable("server store unavailable"));
                    }
                }
            }
            Pending::Claim { conn, token } => {
                if let Err(e) = &result {
                    tracing::error!(error = %e, "pending claim not recorded");
                    // the claim's transaction carried the refusal's audit
                    // record; without it the record goes on its own
                    let client = self.client_of(conn);
                    self.audit_alone(
                        client,
                        &rvbox_session::Audit {
                            kind: rvbox_session::AuditKind::LiveConflict,
                            detail: format!(
                                "live conflict refused; the claim was not recorded: {e}"
                            ),
                        },
                    );
                }
                self.stats.live_conflicts += 1;
                self.reject(
                    conn,
                    token,
                    DomainError::new(
                        Code::LiveConflict,
                        "another instance of this client id is connected; an operator can authorize a takeover",
                    ),
                );
            }
            Pending::Install {
                conn,
                token,
                client,
                key,
                session_id,
            } => match result {
                Ok(Completion::Registered { generation }) => {
                    self.installed(conn, token, client, key, session_id, generation);
                }
                Ok(_) => {
                    self.mismatch("register");
                    self.reject(conn, token, unavailable("server store unavailable"));
                }
                Err(e) => self.reject(conn, token, e.to_domain()),
            },
        }
    }

    fn decide(
        &mut self,
        conn: ConnId,
        token: RegistrationToken,
        hello: &ValidHello,
        record: Option<&ClientRecord>,
    ) {
        let client = hello.client_id.as_str().to_owned();
        let core_record = convert::client_record(record);
        let Some((key, session_id)) = self.random_session_id() else {
            return self.reject(conn, token, unavailable("no randomness for a session id"));
        };
        let wall = u64::try_from(self.wall_ms).unwrap_or(0);
        let decision =
            match rvbox_session::decide_registration(&core_record, hello, session_id.clone(), wall)
            {
                Ok(d) => d,
                Err(e) => {
                    return self.reject(
                        conn,
                        token,
                        DomainError::new(Code::FailedPrecondition, e.to_string()),
                    );
                }
            };
        match decision {
            Decision::RejectLiveConflict { claim, .. } => {
                self.store(
                    StoreOp::RecordPendingClaim {
                        client_id: client,
                        instance_id: *claim.instance.as_bytes(),
                    },
                    Any::Registration(Pending::Claim { conn, token }),
                );
            }
            Decision::Accept(acc) => {
                let fence_key = record.and_then(|r| r.live).map(|l| l.session_id);
                let grant_id = if acc.consume_grant {
                    record.and_then(|r| r.grant).map(|g| g.id)
                } else {
                    None
                };
                let reg = Registration {
                    client_id: client.clone(),
                    instance_id: *acc.instance.as_bytes(),
                    expected_generation: core_record.generation,
                    session_id: key,
                    fence: if acc.fence.is_some() { fence_key } else { None },
                    consume_grant: grant_id,
                    capabilities: hello.capabilities.clone(),
                    cwd_policy: Some(hello.cwd_policy.clone()),
                    labels: hello.labels.to_string(),
                };
                self.store(
                    StoreOp::Register(reg),
                    Any::Registration(Pending::Install {
                        conn,
                        token,
                        client,
                        key,
                        session_id,
                    }),
                );
            }
        }
    }

    fn installed(
        &mut self,
        conn: ConnId,
        token: RegistrationToken,
        client: String,
        key: [u8; 16],
        session_id: SessionId,
        generation: u64,
    ) {
        if !self.conns.contains_key(&conn) {
            // the connection went away while its registration committed:
            // the session row it installed ends now
            self.store(
                StoreOp::CloseSession {
                    session_id: key,
                    reason: "connection closed during registration".into(),
                },
                Any::Background("close_session"),
            );
            return;
        }
        self.stats.registered += 1;
        // fence the prior connection of this client, if it is ours
        let prior = self.clients.get(&client).and_then(|s| s.conn);
        if let Some(old) = prior
            && old != conn
        {
            self.stats.fenced += 1;
            if let Some(c) = self.conns.get_mut(&old) {
                c.session_key = None; // the store already fenced it
            }
            self.session_input(
                old,
                SessionInput::Fenced {
                    by_generation: generation,
                },
            );
        }
        let st = self.clients.entry_or_default(client.clone());
        st.conn = Some(conn);
        st.ready = false;
        st.capacity = SessionCapacity::new();
        st.in_flight.clear();
        st.dispatching.clear();
        if let Some(c) = self.conns.get_mut(&conn) {
            c.client = Some(client.clone());
            c.session_key = Some(key);
            c.generation = generation;
        }
        self.session_input(
            conn,
            SessionInput::Registered {
                token,
                session_id,
                generation,
            },
        );
        self.store(
            StoreOp::NonTerminalCommands { client_id: client },
            Any::Reconcile(reconcile::Pending::Rows { conn, generation }),
        );
    }
}
