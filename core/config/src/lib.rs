//! RVBox configuration model for both daemons (plan §4.3).
//!
//! Owns: the one key registry per daemon, strict decoding of one TOML
//! document (unknown and duplicate keys refused with key path and line),
//! duration and byte-size parsing in integer arithmetic, v1 ceilings,
//! precedence (compiled defaults < file < explicitly given flags), every
//! cross-field invariant, path, shell and resource-profile validation, and
//! the redacted, normalized effective-configuration summary. Other crates
//! receive only the immutable validated structs ([`ServerConfig`],
//! [`ClientConfig`] and their sections).
//!
//! Must never: read a file, the environment or a clock. The file text and
//! the flags come in as values, and host facts (stat, canonicalize, uid,
//! host name) come through the [`HostProbe`] trait.

mod client;
mod common;
mod decode;
mod error;
mod paths;
mod probe;
mod profiles;
pub mod registry;
mod render;
mod resolve;
mod server;
mod shells;
pub mod units;

pub use client::{
    ClientConfig, ClientFlowConfig, ClientIdentityConfig, ClientSessionConfig,
    ClientTerminalsConfig, ExecConfig, ReconnectConfig, SpoolConfig, check_client_id,
    check_server_url, load_client,
};
pub use common::{LogFormat, LogLevel, ObservabilityConfig};
pub use decode::FlagValue;
pub use error::{ConfigError, ConfigErrors, Origin};
pub use paths::normalize_absolute;
pub use probe::{FileIdentity, FileKind, FileStat, HostProbe};
pub use profiles::{
    Control, CpuMax, Dimension, IoRule, ProfileName, ProfileRequestError, ProfilesConfig,
    ResourceProfile, check_profile_combination, parse_device_key,
};
pub use registry::{Daemon, KeyDef, Kind};
pub use server::{
    AgentConfig, AuditConfig, ClientIdentity, ControlConfig, JsonRpcConfig, PostgresConfig,
    ProtocolLimits, QueueConfig, ServerConfig, ServerFlowConfig, ServerSessionConfig,
    SqliteSynchronous, StorageConfig, StoreBackend, TerminalsConfig, check_conninfo, load_server,
};
pub use shells::{
    ResolvedShell, ShellChanged, ShellKind, ShellsConfig, check_windows_path, resolve_shell,
};
