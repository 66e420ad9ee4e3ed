//! Code generation for the RVBox wire contract.
//!
//! This crate owns the one recipe that turns `protos/rvbox/v1/*.proto` into
//! the checked-in Rust code: prost messages in `core/proto/src/gen/` and the
//! tonic `Control` stubs in `shells/control-api/src/gen/`. It compiles the
//! protos with `protox` (no system `protoc`), and it never runs at build time
//! of any other crate: `scripts/generate` writes the files, and
//! [`stale_files`] (used by `rvbox-codegen check` and the `fresh` test)
//! proves they are current.

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The proto files of package `rvbox.v1`, relative to `protos/`.
pub const PROTO_FILES: [&str; 3] = [
    "rvbox/v1/common.proto",
    "rvbox/v1/agent.proto",
    "rvbox/v1/control.proto",
];

/// Name of the file prost/tonic write for package `rvbox.v1`.
pub const GENERATED_FILE: &str = "rvbox.v1.rs";

/// Output directory of the prost messages, relative to the repository root.
pub const MESSAGES_DIR: &str = "core/proto/src/gen";

/// Output directory of the tonic `Control` stubs, relative to the repository root.
pub const SERVICES_DIR: &str = "shells/control-api/src/gen";

/// Rust path of the generated messages, used by the service stubs.
const MESSAGES_RUST_PATH: &str = "::rvbox_proto::v1";
/// The encoded `FileDescriptorSet` of every proto and its imports, beside
/// the services (gRPC server reflection serves it).
pub const DESCRIPTOR_FILE: &str = "rvbox_descriptor.bin";

/// A failure of generation or of the freshness check.
#[derive(Debug)]
pub enum Error {
    /// The protos did not compile.
    Compile(Box<protox::Error>),
    /// Reading or writing a file failed.
    Io {
        /// What was being done.
        context: String,
        /// The underlying error.
        source: io::Error,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Compile(err) => write!(f, "compiling protos: {err}"),
            Self::Io { context, source } => write!(f, "{context}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Self::Compile(err) => Some(err.as_ref()),
            Self::Io { source, .. } => Some(source),
        }
    }
}

fn io_err(context: impl Into<String>) -> impl FnOnce(io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

/// The repository root, derived from this crate's location (`protos/codegen`).
#[must_use]
pub fn repo_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .and_then(Path::parent)
        .map_or_else(|| manifest.to_path_buf(), Path::to_path_buf)
}

/// Generates both outputs from `root/protos` into the two given directories,
/// which must exist. Output is deterministic: the same protos always give
/// byte-identical files.
///
/// # Errors
/// When the protos do not compile or a file cannot be written.
pub fn generate_into(root: &Path, messages_dir: &Path, services_dir: &Path) -> Result<(), Error> {
    let protos = root.join("protos");
    let fds = protox::compile(PROTO_FILES, [&protos]).map_err(|e| Error::Compile(Box::new(e)))?;
    let descriptor = services_dir.join(DESCRIPTOR_FILE);
    fs::write(&descriptor, prost::Message::encode_to_vec(&fds))
        .map_err(io_err(format!("writing {}", descriptor.display())))?;

    // Messages only: no services, maps as BTreeMap so iteration and
    // encoding order are deterministic (request hashes depend on it).
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(false)
        .btree_map(".")
        .out_dir(messages_dir)
        .compile_fds(fds.clone())
        .map_err(io_err("generating prost messages"))?;

    // The Control client and server only; every message is the one
    // generated above, referenced through rvbox-proto.
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .btree_map(".")
        .extern_path(".rvbox.v1", MESSAGES_RUST_PATH)
        .out_dir(services_dir)
        .compile_fds(fds)
        .map_err(io_err("generating tonic stubs"))?;
    Ok(())
}

/// Generates into the checked-in locations under `root`.
///
/// # Errors
/// As [`generate_into`].
pub fn generate(root: &Path) -> Result<Vec<PathBuf>, Error> {
    let messages = root.join(MESSAGES_DIR);
    let services = root.join(SERVICES_DIR);
    for dir in [&messages, &services] {
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    }
    generate_into(root, &messages, &services)?;
    Ok(vec![
        messages.join(GENERATED_FILE),
        services.join(GENERATED_FILE),
        services.join(DESCRIPTOR_FILE),
    ])
}

/// Regenerates into a temporary directory and returns every checked-in
/// file (relative to `root`) whose bytes differ or which is missing.
///
/// # Errors
/// When generation fails or the temporary directory cannot be used.
pub fn stale_files(root: &Path, scratch: &Path) -> Result<Vec<PathBuf>, Error> {
    let messages = scratch.join("messages");
    let services = scratch.join("services");
    for dir in [&messages, &services] {
        fs::create_dir_all(dir).map_err(io_err(format!("creating {}", dir.display())))?;
    }
    generate_into(root, &messages, &services)?;

    let mut stale = Vec::new();
    for (fresh_dir, checked_in, file) in [
        (&messages, MESSAGES_DIR, GENERATED_FILE),
        (&services, SERVICES_DIR, GENERATED_FILE),
        (&services, SERVICES_DIR, DESCRIPTOR_FILE),
    ] {
        let fresh_path = fresh_dir.join(file);
        let fresh =
            fs::read(&fresh_path).map_err(io_err(format!("reading {}", fresh_path.display())))?;
        let relative = Path::new(checked_in).join(file);
        match fs::read(root.join(&relative)) {
            Ok(current) if current == fresh => {}
            Ok(_) => stale.push(relative),
            Err(e) if e.kind() == io::ErrorKind::NotFound => stale.push(relative),
            Err(e) => return Err(io_err(format!("reading {}", relative.display()))(e)),
        }
    }
    Ok(stale)
}
