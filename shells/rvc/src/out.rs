//! How rvc prints a result: text for a person (tables and records that
//! read at 80 columns) or, with `--output json`, one JSON document per
//! result on its own line: the service's answer in canonical proto3 JSON
//! (lower camel case, every field present), so a script reads the same
//! keys as the gRPC and JSON-RPC APIs give.

use std::io::Write as _;

use crate::exit::Failure;

/// The output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Format {
    /// Text for a person.
    #[default]
    Text,
    /// One JSON document per result, one per line.
    Json,
}

/// Writes `text` as it is, or in JSON mode `message` (of protobuf type
/// `rvbox.v1.<type_name>`) as one line.
pub(crate) fn emit<M: prost::Message>(
    format: Format,
    type_name: &str,
    message: &M,
    text: impl FnOnce() -> String,
) -> Result<(), Failure> {
    let line = match format {
        Format::Text => text(),
        Format::Json => {
            let mut doc = json(type_name, message)?;
            doc.push('\n');
            doc
        }
    };
    write_stdout(&line)
}

/// `message` as one line of canonical JSON.
pub(crate) fn json<M: prost::Message>(type_name: &str, message: &M) -> Result<String, Failure> {
    rvbox_control_api::json::to_string(&format!("rvbox.v1.{type_name}"), message)
        .map_err(|e| Failure::internal(format!("the answer has no JSON form: {e}")))
}

/// Writes to stdout; a closed pipe (`rvc ... | head`) ends rvc quietly.
pub(crate) fn write_stdout(text: &str) -> Result<(), Failure> {
    let mut o = std::io::stdout().lock();
    match o.write_all(text.as_bytes()).and_then(|()| o.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => std::process::exit(0),
        Err(e) => Err(Failure::internal(format!("writing to stdout: {e}"))),
    }
}
