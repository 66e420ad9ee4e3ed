//! A real RVBox on loopback for end-to-end tests: the built
//! `rvbox-server`, `rvbox` and `rvc` binaries, each in a private
//! directory, talking over a real WebSocket and a real Unix socket.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    dead_code,
    unreachable_pub
)]

#[path = "../../../server/benches/support/agent_client.rs"]
pub mod agent_client;

use std::path::PathBuf;
use std::process::Output;

pub use rvbox_testkit::*;

/// An insta snapshot of what rvc printed (status, stdout, stderr) under
/// `tests/snapshots/NAME.snap`, with UUIDs, times, the stack's directory
/// and tokens redacted.
pub fn snapshot(s: &Stack, name: &str, out: &Output) {
    let rendered = format!(
        "status: {}\n--- stdout\n{}--- stderr\n{}",
        out.status
            .code()
            .map_or_else(|| "signal".into(), |c| c.to_string()),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let dir = s.dir.path().display().to_string();
    let escaped: String = dir
        .chars()
        .flat_map(|c| {
            let special = "\\.+*?()|[]{}^$#&-~".contains(c);
            special
                .then_some('\\')
                .into_iter()
                .chain(std::iter::once(c))
        })
        .collect();
    let mut settings = insta::Settings::clone_current();
    settings.set_snapshot_path("../snapshots");
    settings.set_prepend_module_to_snapshot(false);
    settings.add_filter(
        r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
        "[uuid]",
    );
    settings.add_filter(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z", "[time]");
    settings.add_filter(&escaped, "[dir]");
    settings.add_filter(r"--page [A-Za-z0-9_-]+", "--page [token]");
    settings.add_filter(
        r#""(requestHash|nextPageToken)":"[^"]+""#,
        "\"$1\":\"[redacted]\"",
    );
    settings.add_filter(
        r#""(lastSeenTime|generation)":"?[^",}]+"?"#,
        "\"$1\":[redacted]",
    );
    // the host's kernel release differs between machines
    settings.add_filter(r#""osRelease":"[^"]*""#, "\"osRelease\":\"[release]\"");
    settings.add_filter(r"generation  \d+", "generation  [n]");
    settings.add_filter(r"revision \d+", "revision [n]");
    settings.add_filter(
        r"lost \d+ committed bytes \(\d+ events\)",
        "lost [n] committed bytes ([n] events)",
    );
    settings.bind(|| insta::assert_snapshot!(name.to_owned(), rendered));
}

/// A gRPC channel to the server's control socket.
pub async fn control_channel(socket: PathBuf) -> tonic::transport::Channel {
    tonic::transport::Endpoint::try_from("http://rvbox.invalid")
        .unwrap()
        .connect_with_connector(tower::service_fn(move |_| {
            let socket = socket.clone();
            async move {
                let s = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap()
}
