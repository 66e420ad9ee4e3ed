//! The `Control` gRPC service on the mode-0600 Unix socket (plan §9.1).
//!
//! Owns: the socket (created only after a stale one is proven ours and
//! dead), the mapping of each RPC to the core (mutations: `RunCommand`,
//! `SignalCommand`, `AppendStdin`, `CloseStdin`, the takeover grant and
//! the incident repairs, answered only after the store committed them with
//! their idempotency row) or to a read-only store connection (reads:
//! `GetCommand`, `ListCommands`, `ListClients`, `GetClient`, `GetOutput`,
//! `FollowCommand`), and the mapping of domain errors to non-OK statuses
//! carrying the `rvbox.v1.ErrorDetail`.
//!
//! Must never: touch the store's writer (reads have their own read-only
//! connections, mutations go through the core), or send a remote signal
//! when a follow ends: a stream that stops only stops reading.

use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rvbox_control_api::v1::control_server::{Control, ControlServer};
use rvbox_domain::error::{Code, DomainError};
use rvbox_domain::ids::Uuid7;
use rvbox_proto::v1 as wire;
use rvbox_server_core::{Caller, ControlAnswer, ControlCall, PtyAnswer};
use rvbox_store::mutations::OpError;
use rvbox_store::output::HistoryItem;
use rvbox_store::reader::{ControlReads, ReaderSource};
use rvbox_store_port::fleet::{FleetAction, FleetAnswer};
use rvbox_store_port::ops::PortError;
use rvbox_store_port::pty::PtyMutation;
use tokio::sync::{Semaphore, mpsc, oneshot, watch};
use tokio_stream::wrappers::{ReceiverStream, UnixListenerStream};
use tonic::{Request, Response, Status};

use crate::core_loop::ToCore;
use crate::state::Shared;

/// Read-only store connections the control plane keeps (and reads it runs
/// at once; more wait for one).
pub(crate) const READERS: usize = 8;
/// Events one history read of a follow takes.
pub(crate) const FOLLOW_BATCH: usize = 256;
/// Items a follow stream buffers before it waits for its reader.
pub(crate) const FOLLOW_BUFFER: usize = 16;
/// A follow that saw no store change looks again after this long.
pub(crate) const FOLLOW_POLL: Duration = Duration::from_secs(1);

/// The status of a domain error, with its detail.
pub(crate) fn status(e: &DomainError) -> Status {
    let g = e.to_grpc();
    Status::with_details(
        tonic::Code::from_i32(g.code as i32),
        g.message,
        g.details.into(),
    )
}

fn port_status(e: &PortError) -> Status {
    if let PortError::Unavailable(detail) = e {
        tracing::warn!(error = %detail, "control call failed in the store");
    }
    status(&e.to_domain())
}

fn op_status(e: OpError) -> Status {
    match e {
        OpError::Refused(d) => status(&d),
        OpError::Store(s) => {
            tracing::warn!(error = %s, "control read failed in the store");
            status(&DomainError::new(
                Code::Unavailable,
                "the server store could not complete the read; retry",
            ))
        }
    }
}

fn unavailable(why: &str) -> Status {
    status(&DomainError::new(Code::Unavailable, why))
}

/// A small pool of read-only connections.
#[derive(Debug)]
pub(crate) struct Readers {
    source: Arc<dyn ReaderSource>,
    idle: Mutex<Vec<Box<dyn ControlReads>>>,
    permits: Semaphore,
}

impl Readers {
    pub(crate) fn new(source: Arc<dyn ReaderSource>) -> Self {
        Self {
            source,
            idle: Mutex::new(Vec::new()),
            permits: Semaphore::new(READERS),
        }
    }

    /// Runs one read on a pooled connection, off the async threads.
    pub(crate) async fn read<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&mut dyn ControlReads) -> Result<T, OpError> + Send + 'static,
    ) -> Result<T, Status> {
        let _permit = self
            .permits
            .acquire()
            .await
            .map_err(|_| unavailable("the server is stopping"))?;
        let this = Arc::clone(self);
        tokio::task::spawn_blocking(move || {
            let mut reader = match this.idle.lock().ok().and_then(|mut v| v.pop()) {
                Some(r) => r,
                None => this
                    .source
                    .open_reader()
                    .map_err(|e| op_status(OpError::Store(e)))?,
            };
            let out = f(reader.as_mut());
            // a reader whose store failed (a lost database connection) is
            // dropped; the next read opens a fresh one
            let healthy = !matches!(out, Err(OpError::Store(_)));
            if healthy && let Ok(mut v) = this.idle.lock() {
                v.push(reader);
            }
            out.map_err(op_status)
        })
        .await
        .map_err(|_| unavailable("a control read failed"))?
    }
}

/// The service.
/// The paging keys of `[control]`, applied to every list and output
/// request before the store sees it: a size of 0 takes the default, one
/// above the maximum is refused naming the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Paging {
    /// `control.default_page_size`.
    pub(crate) default_page: u32,
    /// `control.max_page_size`.
    pub(crate) max_page: u32,
    /// `control.default_output_page`.
    pub(crate) default_output: u32,
    /// `control.max_output_page`.
    pub(crate) max_output: u32,
}

impl Paging {
    /// From the configuration.
    pub(crate) fn of(c: &rvbox_config::ControlConfig) -> Self {
        let n = |v: u64| u32::try_from(v).unwrap_or(u32::MAX);
        Self {
            default_page: n(c.default_page_size),
            max_page: n(c.max_page_size),
            default_output: n(c.default_output_page),
            max_output: n(c.max_output_page),
        }
    }

    /// A list request's `page_size`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` naming `page_size` above `control.max_page_size`.
    pub(crate) fn page_size(self, asked: u32) -> Result<u32, Status> {
        Self::size(
            asked,
            self.default_page,
            self.max_page,
            "page_size",
            "control.max_page_size",
        )
    }

    /// A `GetOutput` request's `max_bytes`.
    ///
    /// # Errors
    /// `INVALID_ARGUMENT` naming `max_bytes` above `control.max_output_page`.
    pub(crate) fn output_bytes(self, asked: u32) -> Result<u32, Status> {
        Self::size(
            asked,
            self.default_output,
            self.max_output,
            "max_bytes",
            "control.max_output_page",
        )
    }

    fn size(asked: u32, default: u32, max: u32, field: &str, key: &str) -> Result<u32, Status> {
        match asked {
            0 => Ok(default),
            n if n > max => Err(status(
                &DomainError::new(
                    rvbox_domain::error::Code::InvalidArgument,
                    format!("{field} {n} is above this server's {key} of {max}"),
                )
                .with_field(field.to_owned()),
            )),
            n => Ok(n),
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) struct ControlService {
    shared: Arc<Shared>,
    /// `[control]` paging.
    paging: Paging,
    readers: Arc<Readers>,
    changes: watch::Receiver<u64>,
    stop: watch::Receiver<bool>,
    /// Viewers attached to each terminal on this server.
    viewers: Arc<crate::pty_follow::Viewers>,
}

impl ControlService {
    pub(crate) fn new(
        shared: Arc<Shared>,
        reads: Arc<dyn ReaderSource>,
        changes: watch::Receiver<u64>,
        stop: watch::Receiver<bool>,
        paging: Paging,
    ) -> Self {
        Self {
            shared,
            paging,
            readers: Arc::new(Readers::new(reads)),
            changes,
            stop,
            viewers: Arc::new(crate::pty_follow::Viewers::default()),
        }
    }

    /// The daemon's shared state.
    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// A terminal mutation through the core.
    async fn pty(
        &self,
        caller: Caller,
        mutation: PtyMutation,
    ) -> Result<rvbox_server_core::PtyAnswer, Status> {
        match self.call(caller, ControlCall::Pty(mutation)).await? {
            ControlAnswer::Pty(Ok(a)) => Ok(*a),
            ControlAnswer::Pty(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn call(&self, caller: Caller, call: ControlCall) -> Result<ControlAnswer, Status> {
        let core = self
            .shared
            .core()
            .ok_or_else(|| unavailable("the server is not serving (recovering or stopping); retry with the same request_id"))?;
        let (reply, answer) = oneshot::channel();
        core.send(ToCore::Control {
            caller,
            call,
            reply,
        })
        .await
        .map_err(|_| unavailable("the server is stopping; retry with the same request_id"))?;
        answer.await.map_err(|_| {
            unavailable("the server stopped before answering; retry with the same request_id")
        })
    }
}

fn caller<T>(req: &Request<T>) -> Caller {
    // the request decoded and reached its handler: a write's audit is the
    // store's from here
    crate::edge_audit::reached();
    // the JSON-RPC adapter names its own transport and peer
    if let Some(c) = req.extensions().get::<Caller>() {
        return c.clone();
    }
    let principal = req
        .extensions()
        .get::<tonic::transport::server::UdsConnectInfo>()
        .and_then(|i| i.peer_cred)
        .map_or_else(String::new, |c| format!("uid:{}", c.uid()));
    Caller {
        transport: "grpc-unix".into(),
        principal,
    }
}

fn issue_of(field: &'static str, text: &str) -> Result<[u8; 16], Status> {
    Uuid7::parse(field, text)
        .map(|u| *u.as_bytes())
        .map_err(|e| status(&DomainError::from(e)))
}

type FollowStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<wire::FollowCommandResponse, Status>> + Send>>;
type FleetFollowStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<wire::FollowFleetRunResponse, Status>> + Send>>;
type PtyStream = Pin<
    Box<dyn tokio_stream::Stream<Item = Result<wire::AttachPtySessionResponse, Status>> + Send>,
>;
type RecordingStream = Pin<
    Box<dyn tokio_stream::Stream<Item = Result<wire::ReadPtyRecordingResponse, Status>> + Send>,
>;

#[tonic::async_trait]
impl Control for ControlService {
    async fn list_clients(
        &self,
        request: Request<wire::ListClientsRequest>,
    ) -> Result<Response<wire::ListClientsResponse>, Status> {
        let mut req = request.into_inner();
        req.page_size = self.paging.page_size(req.page_size)?;
        let out = self.readers.read(move |r| r.list_clients(&req)).await?;
        Ok(Response::new(out))
    }

    async fn get_client(
        &self,
        request: Request<wire::GetClientRequest>,
    ) -> Result<Response<wire::GetClientResponse>, Status> {
        let req = request.into_inner();
        crate::edge_audit::note(Some(&req.client_id), None, "");
        rvbox_domain::ids::ClientId::parse("client_id", &req.client_id)
            .map_err(|e| status(&DomainError::from(e)))?;
        let now = crate::core_loop::Clock::wall_ms();
        let out = self
            .readers
            .read(move |r| r.get_client(&req.client_id, now))
            .await?;
        Ok(Response::new(out))
    }

    async fn list_commands(
        &self,
        request: Request<wire::ListCommandsRequest>,
    ) -> Result<Response<wire::ListCommandsResponse>, Status> {
        let mut req = request.into_inner();
        crate::edge_audit::note(req.client_id.as_deref(), None, "");
        if let Some(c) = &req.client_id {
            rvbox_domain::ids::ClientId::parse("client_id", c)
                .map_err(|e| status(&DomainError::from(e)))?;
        }
        req.page_size = self.paging.page_size(req.page_size)?;
        let out = self.readers.read(move |r| r.list_commands(&req)).await?;
        Ok(Response::new(out))
    }

    async fn get_command(
        &self,
        request: Request<wire::GetCommandRequest>,
    ) -> Result<Response<wire::GetCommandResponse>, Status> {
        let issue = issue_of("issue_uuid", &request.get_ref().issue_uuid)?;
        crate::edge_audit::note(None, Some(issue), "");
        let command = self.readers.read(move |r| r.command_record(&issue)).await?;
        Ok(Response::new(wire::GetCommandResponse {
            command: Some(command),
        }))
    }

    async fn authorize_client_takeover(
        &self,
        request: Request<wire::AuthorizeClientTakeoverRequest>,
    ) -> Result<Response<wire::AuthorizeClientTakeoverResponse>, Status> {
        let who = caller(&request);
        match self
            .call(
                who,
                ControlCall::AuthorizeClientTakeover(request.into_inner()),
            )
            .await?
        {
            ControlAnswer::AuthorizeClientTakeover(Ok(r)) => Ok(Response::new(r)),
            ControlAnswer::AuthorizeClientTakeover(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn run_command(
        &self,
        request: Request<wire::RunCommandRequest>,
    ) -> Result<Response<wire::RunCommandResponse>, Status> {
        let who = caller(&request);
        match self
            .call(who, ControlCall::RunCommand(request.into_inner()))
            .await?
        {
            ControlAnswer::RunCommand(Ok(r)) => Ok(Response::new(r)),
            ControlAnswer::RunCommand(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    type FollowCommandStream = FollowStream;

    async fn follow_command(
        &self,
        request: Request<wire::FollowCommandRequest>,
    ) -> Result<Response<Self::FollowCommandStream>, Status> {
        let req = request.into_inner();
        let issue = issue_of("issue_uuid", &req.issue_uuid)?;
        crate::edge_audit::note(None, Some(issue), "");
        let id =
            Uuid7::from_bytes("issue_uuid", issue).map_err(|e| status(&DomainError::from(e)))?;
        // an unknown command is an error of the call, not of the stream
        let first = self.readers.read(move |r| r.command_record(&issue)).await?;
        let (tx, rx) = mpsc::channel(FOLLOW_BUFFER);
        let follower = Follower {
            readers: Arc::clone(&self.readers),
            changes: self.changes.clone(),
            stop: self.stop.clone(),
            issue,
            id,
            cursor: req.after_event_seq,
            tx,
        };
        tokio::spawn(follower.run(first));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn append_stdin(
        &self,
        request: Request<wire::AppendStdinRequest>,
    ) -> Result<Response<wire::AppendStdinResponse>, Status> {
        let who = caller(&request);
        match self
            .call(who, ControlCall::AppendStdin(request.into_inner()))
            .await?
        {
            ControlAnswer::AppendStdin(Ok(r)) => Ok(Response::new(r)),
            ControlAnswer::AppendStdin(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn close_stdin(
        &self,
        request: Request<wire::CloseStdinRequest>,
    ) -> Result<Response<wire::CloseStdinResponse>, Status> {
        let who = caller(&request);
        match self
            .call(who, ControlCall::CloseStdin(request.into_inner()))
            .await?
        {
            ControlAnswer::CloseStdin(Ok(r)) => Ok(Response::new(r)),
            ControlAnswer::CloseStdin(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn signal_command(
        &self,
        request: Request<wire::SignalCommandRequest>,
    ) -> Result<Response<wire::SignalCommandResponse>, Status> {
        let who = caller(&request);
        match self
            .call(who, ControlCall::SignalCommand(request.into_inner()))
            .await?
        {
            ControlAnswer::SignalCommand(Ok(r)) => Ok(Response::new(r)),
            ControlAnswer::SignalCommand(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn get_output(
        &self,
        request: Request<wire::GetOutputRequest>,
    ) -> Result<Response<wire::GetOutputResponse>, Status> {
        let mut req = request.into_inner();
        if let Ok(issue) = issue_of("issue_uuid", &req.issue_uuid) {
            crate::edge_audit::note(None, Some(issue), "");
        }
        req.max_bytes = self.paging.output_bytes(req.max_bytes)?;
        let out = self.readers.read(move |r| r.get_output(&req)).await?;
        Ok(Response::new(out))
    }

    async fn list_storage_incidents(
        &self,
        request: Request<wire::ListStorageIncidentsRequest>,
    ) -> Result<Response<wire::ListStorageIncidentsResponse>, Status> {
        let mut req = request.into_inner();
        req.page_size = self.paging.page_size(req.page_size)?;
        let out = self.readers.read(move |r| r.incident_page(&req)).await?;
        Ok(Response::new(out))
    }

    async fn repair_storage_incident(
        &self,
        request: Request<wire::RepairStorageIncidentRequest>,
    ) -> Result<Response<wire::RepairStorageIncidentResponse>, Status> {
        let who = caller(&request);
        match self
            .call(
                who,
                ControlCall::RepairStorageIncident(request.into_inner()),
            )
            .await?
        {
            ControlAnswer::RepairStorageIncident(Ok(r)) => Ok(Response::new(r)),
            ControlAnswer::RepairStorageIncident(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn acknowledge_storage_incident(
        &self,
        request: Request<wire::AcknowledgeStorageIncidentRequest>,
    ) -> Result<Response<wire::AcknowledgeStorageIncidentResponse>, Status> {
        let who = caller(&request);
        match self
            .call(
                who,
                ControlCall::AcknowledgeStorageIncident(request.into_inner()),
            )
            .await?
        {
            ControlAnswer::AcknowledgeStorageIncident(Ok(r)) => Ok(Response::new(r)),
            ControlAnswer::AcknowledgeStorageIncident(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn run_fleet(
        &self,
        request: Request<wire::RunFleetRequest>,
    ) -> Result<Response<wire::RunFleetResponse>, Status> {
        let who = caller(&request);
        match self
            .call(who, ControlCall::RunFleet(request.into_inner()))
            .await?
        {
            ControlAnswer::Fleet(Ok(a)) => match *a {
                FleetAnswer::Run(r) => Ok(Response::new(r)),
                _ => Err(unavailable("mismatched answer")),
            },
            ControlAnswer::Fleet(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn get_fleet_run(
        &self,
        request: Request<wire::GetFleetRunRequest>,
    ) -> Result<Response<wire::GetFleetRunResponse>, Status> {
        let req = request.into_inner();
        crate::edge_audit::note(None, None, &format!("fleet run {}", req.fleet_run_id));
        let out = self.readers.read(move |r| r.get_fleet_run(&req)).await?;
        Ok(Response::new(out))
    }

    async fn list_fleet_runs(
        &self,
        request: Request<wire::ListFleetRunsRequest>,
    ) -> Result<Response<wire::ListFleetRunsResponse>, Status> {
        let mut req = request.into_inner();
        req.page_size = self.paging.page_size(req.page_size)?;
        let out = self.readers.read(move |r| r.list_fleet_runs(&req)).await?;
        Ok(Response::new(out))
    }

    async fn list_fleet_targets(
        &self,
        request: Request<wire::ListFleetTargetsRequest>,
    ) -> Result<Response<wire::ListFleetTargetsResponse>, Status> {
        let mut req = request.into_inner();
        crate::edge_audit::note(None, None, &format!("fleet run {}", req.fleet_run_id));
        req.page_size = self.paging.page_size(req.page_size)?;
        let out = self
            .readers
            .read(move |r| r.list_fleet_targets(&req))
            .await?;
        Ok(Response::new(out))
    }

    type FollowFleetRunStream = FleetFollowStream;

    async fn follow_fleet_run(
        &self,
        request: Request<wire::FollowFleetRunRequest>,
    ) -> Result<Response<Self::FollowFleetRunStream>, Status> {
        let req = request.into_inner();
        crate::edge_audit::note(None, None, &format!("fleet run {}", req.fleet_run_id));
        // an unknown run is an error of the call, not of the stream
        let run = req.fleet_run_id.clone();
        let (first, _) = self
            .readers
            .read(move |r| r.fleet_changes(&run, u64::MAX, 0))
            .await?;
        let (tx, rx) = mpsc::channel(FOLLOW_BUFFER);
        let follower = crate::fleet_follow::FleetFollower {
            readers: Arc::clone(&self.readers),
            changes: self.changes.clone(),
            stop: self.stop.clone(),
            run: req.fleet_run_id,
            cursor: req.after_change_seq,
            tx,
        };
        tokio::spawn(follower.run(first));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn signal_fleet_run(
        &self,
        request: Request<wire::SignalFleetRunRequest>,
    ) -> Result<Response<wire::SignalFleetRunResponse>, Status> {
        let who = caller(&request);
        let action = FleetAction::Signal(request.into_inner());
        match self.call(who, ControlCall::FleetAction(action)).await? {
            ControlAnswer::Fleet(Ok(a)) => match *a {
                FleetAnswer::Signal(r) => Ok(Response::new(r)),
                _ => Err(unavailable("mismatched answer")),
            },
            ControlAnswer::Fleet(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn cancel_fleet_run(
        &self,
        request: Request<wire::CancelFleetRunRequest>,
    ) -> Result<Response<wire::CancelFleetRunResponse>, Status> {
        let who = caller(&request);
        let action = FleetAction::Cancel(request.into_inner());
        match self.call(who, ControlCall::FleetAction(action)).await? {
            ControlAnswer::Fleet(Ok(a)) => match *a {
                FleetAnswer::Cancel(r) => Ok(Response::new(r)),
                _ => Err(unavailable("mismatched answer")),
            },
            ControlAnswer::Fleet(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn pause_fleet_run(
        &self,
        request: Request<wire::PauseFleetRunRequest>,
    ) -> Result<Response<wire::PauseFleetRunResponse>, Status> {
        let who = caller(&request);
        let action = FleetAction::Pause(request.into_inner());
        match self.call(who, ControlCall::FleetAction(action)).await? {
            ControlAnswer::Fleet(Ok(a)) => match *a {
                FleetAnswer::Pause(r) => Ok(Response::new(r)),
                _ => Err(unavailable("mismatched answer")),
            },
            ControlAnswer::Fleet(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn resume_fleet_run(
        &self,
        request: Request<wire::ResumeFleetRunRequest>,
    ) -> Result<Response<wire::ResumeFleetRunResponse>, Status> {
        let who = caller(&request);
        let action = FleetAction::Resume(request.into_inner());
        match self.call(who, ControlCall::FleetAction(action)).await? {
            ControlAnswer::Fleet(Ok(a)) => match *a {
                FleetAnswer::Resume(r) => Ok(Response::new(r)),
                _ => Err(unavailable("mismatched answer")),
            },
            ControlAnswer::Fleet(Err(e)) => Err(port_status(&e)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn open_pty_session(
        &self,
        request: Request<wire::OpenPtySessionRequest>,
    ) -> Result<Response<wire::OpenPtySessionResponse>, Status> {
        let who = caller(&request);
        match self
            .pty(who, PtyMutation::Open(request.into_inner()))
            .await?
        {
            PtyAnswer::Open(r) => Ok(Response::new(r)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    type AttachPtySessionStream = PtyStream;

    async fn attach_pty_session(
        &self,
        request: Request<wire::AttachPtySessionRequest>,
    ) -> Result<Response<Self::AttachPtySessionStream>, Status> {
        let who = caller(&request);
        let req = request.into_inner();
        crate::edge_audit::note(None, None, &format!("terminal {}", req.pty_session_id));
        let id = issue_of("pty_session_id", &req.pty_session_id)?;
        // an unknown terminal, or an offset past what was recorded, is an
        // error of the call, not of the stream
        let info = self.readers.read(move |r| r.pty_session(&id)).await?;
        if req.from_offset > info.output_offset {
            return Err(status(
                &DomainError::new(
                    Code::InvalidArgument,
                    format!(
                        "from_offset {} is past the end of the terminal's output ({})",
                        req.from_offset, info.output_offset
                    ),
                )
                .with_field("from_offset"),
            ));
        }
        let (tx, rx) = mpsc::channel(FOLLOW_BUFFER);
        let viewer = crate::pty_follow::PtyViewer {
            readers: Arc::clone(&self.readers),
            changes: self.changes.clone(),
            stop: self.stop.clone(),
            id,
            want: req.from_offset,
            tx,
            viewers: Arc::clone(&self.viewers),
        };
        let this = self.clone();
        let text = info.pty_session_id.clone();
        let client_id = info.client_id.clone();
        let _ = self
            .call(
                who.clone(),
                ControlCall::PtyViewer {
                    pty_session_id: text.clone(),
                    client_id: client_id.clone(),
                    attach: true,
                    offset: req.from_offset,
                },
            )
            .await;
        tokio::spawn(async move {
            let offset = viewer.run().await;
            let _ = this
                .call(
                    who,
                    ControlCall::PtyViewer {
                        pty_session_id: text,
                        client_id,
                        attach: false,
                        offset,
                    },
                )
                .await;
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn write_pty_input(
        &self,
        request: Request<wire::WritePtyInputRequest>,
    ) -> Result<Response<wire::WritePtyInputResponse>, Status> {
        let who = caller(&request);
        match self
            .pty(who, PtyMutation::Write(request.into_inner()))
            .await?
        {
            PtyAnswer::Write(r) => Ok(Response::new(r)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn resize_pty_session(
        &self,
        request: Request<wire::ResizePtySessionRequest>,
    ) -> Result<Response<wire::ResizePtySessionResponse>, Status> {
        let who = caller(&request);
        match self
            .pty(who, PtyMutation::Resize(request.into_inner()))
            .await?
        {
            PtyAnswer::Resize(r) => Ok(Response::new(r)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn close_pty_session(
        &self,
        request: Request<wire::ClosePtySessionRequest>,
    ) -> Result<Response<wire::ClosePtySessionResponse>, Status> {
        let who = caller(&request);
        match self
            .pty(who, PtyMutation::Close(request.into_inner()))
            .await?
        {
            PtyAnswer::Close(r) => Ok(Response::new(r)),
            _ => Err(unavailable("mismatched answer")),
        }
    }

    async fn list_pty_sessions(
        &self,
        request: Request<wire::ListPtySessionsRequest>,
    ) -> Result<Response<wire::ListPtySessionsResponse>, Status> {
        let mut req = request.into_inner();
        crate::edge_audit::note(req.client_id.as_deref(), None, "");
        if let Some(c) = &req.client_id {
            rvbox_domain::ids::ClientId::parse("client_id", c)
                .map_err(|e| status(&DomainError::from(e)))?;
        }
        req.page_size = self.paging.page_size(req.page_size)?;
        let mut out = self
            .readers
            .read(move |r| r.list_pty_sessions(&req))
            .await?;
        self.viewers.fill(&mut out.sessions);
        Ok(Response::new(out))
    }

    type ReadPtyRecordingStream = RecordingStream;

    async fn read_pty_recording(
        &self,
        request: Request<wire::ReadPtyRecordingRequest>,
    ) -> Result<Response<Self::ReadPtyRecordingStream>, Status> {
        crate::edge_audit::note(
            None,
            None,
            &format!("terminal {}", request.get_ref().pty_session_id),
        );
        let id = issue_of("pty_session_id", &request.get_ref().pty_session_id)?;
        let info = self.readers.read(move |r| r.pty_session(&id)).await?;
        let (tx, rx) = mpsc::channel(FOLLOW_BUFFER);
        tokio::spawn(crate::pty_follow::stream_recording(
            Arc::clone(&self.readers),
            id,
            info,
            tx,
        ));
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// Where a follow continues after an item.
#[derive(Debug, Clone, Copy)]
enum Position {
    /// After this event.
    After(u64),
    /// After this position, named by a cursor reset.
    ResetTo(u64),
}

/// One `FollowCommand` stream: the current status, the history after the
/// cursor, then live items as the store commits them, until the command
/// is terminal and every event up to its last was sent.
struct Follower {
    readers: Arc<Readers>,
    changes: watch::Receiver<u64>,
    /// The server is stopping: the stream ends with `UNAVAILABLE`, and
    /// the follower resumes from its cursor on the next server.
    stop: watch::Receiver<bool>,
    issue: [u8; 16],
    id: Uuid7,
    cursor: u64,
    tx: mpsc::Sender<Result<wire::FollowCommandResponse, Status>>,
}

fn status_item(r: &wire::CommandRecord) -> wire::FollowCommandResponse {
    wire::FollowCommandResponse {
        item: Some(wire::follow_command_response::Item::Status(
            wire::CommandStatus {
                lifecycle: r.lifecycle,
                revision: r.revision,
                changed_time: r.terminal_time.or(r.issue_time),
                exit_result: r.exit_result.clone(),
                rejection: r.rejection.clone(),
                expired_pending_reconciliation: r.expired_pending_reconciliation,
            },
        )),
    }
}

fn terminal(r: &wire::CommandRecord) -> bool {
    rvbox_domain::lifecycle::Lifecycle::from_wire(r.lifecycle).is_ok_and(|l| l.is_terminal())
}

impl Follower {
    async fn send(&self, item: Result<wire::FollowCommandResponse, Status>) -> bool {
        self.tx.send(item).await.is_ok()
    }

    /// Ends the stream with `UNAVAILABLE` because the server stops, so
    /// the follower resumes from its cursor on the next server.
    async fn restarting(&self) {
        let _ = self
            .send(Err(unavailable(
                "rvbox-server is restarting; follow again from the last event received",
            )))
            .await;
    }

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    async fn run(mut self, first: wire::CommandRecord) {
        let mut shown = (first.lifecycle, first.revision);
        if !self.send(Ok(status_item(&first))).await {
            return;
        }
        loop {
            if self.stopping() {
                self.restarting().await;
                return;
            }
            // note the change counter before reading, so a commit between
            // the read and the wait wakes the wait
            let _ = self.changes.borrow_and_update();
            let (issue, id, after) = (self.issue, self.id, self.cursor);
            let batch = self
                .readers
                .read(move |r| {
                    let items = r.events_after(&issue, after, FOLLOW_BATCH)?;
                    let mut out = Vec::with_capacity(items.len());
                    let mut caught_up = None;
                    for item in items {
                        // where the stream continues: after an event, after
                        // the position a reset names, and after the last
                        // event once caught up (removed events at the end
                        // are covered by the retention items before it)
                        let position = match &item {
                            HistoryItem::Event(e) => Some(Position::After(e.event_seq)),
                            HistoryItem::Reset(r) => {
                                Some(Position::ResetTo(r.resumed_after_event_seq))
                            }
                            HistoryItem::CaughtUp { last_event_seq } => {
                                caught_up = Some(*last_event_seq);
                                continue;
                            }
                            HistoryItem::Retention(_) => None,
                        };
                        if let Some(w) = item.to_wire(&id)? {
                            out.push((position, w));
                        }
                    }
                    let record = match caught_up {
                        Some(last) => Some((last, r.command_record(&issue)?)),
                        None => None,
                    };
                    Ok((out, record))
                })
                .await;
            let (items, record) = match batch {
                Ok(b) => b,
                Err(status) => {
                    let _ = self.send(Err(status)).await;
                    return;
                }
            };
            for (position, item) in items {
                match position {
                    Some(Position::After(seq)) => self.cursor = self.cursor.max(seq),
                    // a cursor ahead of the log continues from where the
                    // log is (lower), so the events that come are sent
                    Some(Position::ResetTo(seq)) => self.cursor = seq,
                    None => {}
                }
                if self.stopping() {
                    self.restarting().await;
                    return;
                }
                if !self.send(Ok(item)).await {
                    return;
                }
            }
            let Some((last, record)) = record else {
                continue;
            };
            self.cursor = self.cursor.max(last);
            if (record.lifecycle, record.revision) != shown {
                shown = (record.lifecycle, record.revision);
                if !self.send(Ok(status_item(&record))).await {
                    return;
                }
            }
            if terminal(&record) && self.cursor >= record.last_event_seq {
                return;
            }
            if self.cursor < record.last_event_seq {
                // committed after the history read: read on
                continue;
            }
            let mut stopping = false;
            tokio::select! {
                _ = self.changes.changed() => {}
                () = tokio::time::sleep(FOLLOW_POLL) => {}
                () = self.tx.closed() => return,
                _ = self.stop.wait_for(|s| *s) => stopping = true,
            }
            if stopping {
                self.restarting().await;
                return;
            }
        }
    }
}

/// Why the control socket could not be created.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SocketError {
    /// Something that is not a stale socket of ours is in the way.
    #[error("{path}: {why}; remove it or set control.socket_path")]
    InTheWay {
        /// The path.
        path: PathBuf,
        /// What is there.
        why: String,
    },
    /// A live server answers on it.
    #[error("{0}: another rvbox-server is serving on this control socket")]
    Live(PathBuf),
    /// An I/O failure.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> SocketError + '_ {
    move |source| SocketError::Io {
        path: path.to_owned(),
        source,
    }
}

/// Binds the control socket: the runtime directory is created private
/// (0700) when missing; an existing path is removed only when it is a
/// socket owned by this account that nobody answers on; the socket is
/// set to 0600 at once.
pub(crate) fn bind(
    runtime_dir: &Path,
    path: &Path,
) -> Result<tokio::net::UnixListener, SocketError> {
    if !runtime_dir.exists() {
        std::fs::create_dir_all(runtime_dir).map_err(io(runtime_dir))?;
        std::fs::set_permissions(runtime_dir, std::fs::Permissions::from_mode(0o700))
            .map_err(io(runtime_dir))?;
    }
    if let Some(parent) = path.parent()
        && !parent.exists()
    {
        std::fs::create_dir_all(parent).map_err(io(parent))?;
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o700))
            .map_err(io(parent))?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            if !meta.file_type().is_socket() {
                return Err(SocketError::InTheWay {
                    path: path.to_owned(),
                    why: "exists and is not a socket".into(),
                });
            }
            let me = rustix::process::geteuid().as_raw();
            if meta.uid() != me {
                return Err(SocketError::InTheWay {
                    path: path.to_owned(),
                    why: format!(
                        "is a socket owned by uid {}, not this account ({me})",
                        meta.uid()
                    ),
                });
            }
            match std::os::unix::net::UnixStream::connect(path) {
                Ok(_) => return Err(SocketError::Live(path.to_owned())),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    tracing::info!(path = %path.display(), "removing the stale control socket of an earlier run");
                    std::fs::remove_file(path).map_err(io(path))?;
                }
                Err(e) => {
                    return Err(SocketError::InTheWay {
                        path: path.to_owned(),
                        why: format!("is a socket that cannot be probed ({e})"),
                    });
                }
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(path)(e)),
    }
    // created owner-only (umask 0177 around the bind, at start-up before
    // any other thread creates files), then set to 0600 explicitly
    let previous = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = tokio::net::UnixListener::bind(path);
    rustix::process::umask(previous);
    let listener = bound.map_err(io(path))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io(path))?;
    Ok(listener)
}

/// How often the health service's overall status follows readiness.
pub(crate) const HEALTH_REFRESH: Duration = Duration::from_secs(1);

/// Why the control server could not be served.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServeError {
    /// The reflection service refused the descriptor set.
    #[error("reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The transport failed.
    #[error("{0}")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves the service on `listener` until `stop` turns true, beside
/// `grpc.health.v1` (the overall status `""` follows global readiness,
/// `rvbox.v1.Control` is serving while the socket is) and gRPC server
/// reflection of `rvbox.v1` and `grpc.health.v1`.
pub(crate) async fn serve(
    listener: tokio::net::UnixListener,
    service: ControlService,
    max_request: usize,
    mut stop: watch::Receiver<bool>,
) -> Result<(), ServeError> {
    let shared = Arc::clone(&service.shared);
    let audit_shared = Arc::clone(&service.shared);
    let svc = ControlServer::new(service)
        .max_decoding_message_size(max_request)
        .max_encoding_message_size(usize::MAX);
    let (reporter, health) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<ControlServer<ControlService>>()
        .await;
    let mut health_stop = stop.clone();
    let follow_readiness = tokio::spawn(async move {
        loop {
            let status = if shared.readiness().is_ok() {
                tonic_health::ServingStatus::Serving
            } else {
                tonic_health::ServingStatus::NotServing
            };
            reporter.set_service_status("", status).await;
            let mut stopping = false;
            tokio::select! {
                () = tokio::time::sleep(HEALTH_REFRESH) => {}
                _ = health_stop.wait_for(|s| *s) => stopping = true,
            }
            if stopping {
                reporter
                    .set_service_status("", tonic_health::ServingStatus::NotServing)
                    .await;
                reporter
                    .set_not_serving::<ControlServer<ControlService>>()
                    .await;
                return;
            }
        }
    });
    let reflection = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(rvbox_control_api::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let served = tonic::transport::Server::builder()
        .layer(crate::edge_audit::AuditLayer {
            shared: audit_shared,
        })
        .add_service(health)
        .add_service(reflection)
        .add_service(svc)
        .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
            let _ = stop.wait_for(|s| *s).await;
        })
        .await;
    follow_readiness.abort();
    Ok(served?)
}
