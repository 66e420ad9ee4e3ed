//! Target `config`: both daemons' configuration files, decoded and
//! validated from any text (`rvbox_config::load_server`, `load_client`)
//! on a fixed in-memory host (a Debian-like tree: `/usr/bin/{dash,bash}`,
//! `/bin -> usr/bin`, `sh -> dash`).
//!
//! Checks:
//!
//! - no panic, and the same answer twice;
//! - a refusal lists at least one error, and every error names a key: the
//!   syntax pseudo-key `toml`, a registry key, or the key as written in
//!   the file (an unknown one), never an empty name unless the file wrote
//!   an empty key; an error from the file points at a line of it;
//! - an accepted file's effective configuration is TOML that loads back
//!   to the same effective configuration (unless it carries a redacted
//!   secret).

use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use rvbox_config::{ConfigErrors, Daemon, FileKind, FileStat, HostProbe};

/// A fixed host.
#[derive(Debug)]
struct Host {
    nodes: BTreeMap<PathBuf, Result<FileStat, PathBuf>>,
}

impl Host {
    fn new() -> Self {
        let mut nodes = BTreeMap::new();
        let mut ino = 1;
        let mut add = |path: &str, kind: FileKind, mode: u32| {
            ino += 1;
            nodes.insert(
                PathBuf::from(path),
                Ok(FileStat {
                    kind,
                    mode,
                    uid: 0,
                    dev: 1,
                    ino,
                    size: 100,
                    mtime_ns: 1,
                }),
            );
        };
        for d in [
            "/", "/usr", "/usr/bin", "/var", "/var/lib", "/run", "/etc", "/home", "/tmp", "/srv",
        ] {
            add(d, FileKind::Dir, 0o755);
        }
        add("/usr/bin/dash", FileKind::Regular, 0o755);
        add("/usr/bin/bash", FileKind::Regular, 0o755);
        add("/etc/ca.pem", FileKind::Regular, 0o644);
        add("/run/rvbox.sock", FileKind::Socket, 0o600);
        nodes.insert(PathBuf::from("/bin"), Err(PathBuf::from("/usr/bin")));
        nodes.insert(
            PathBuf::from("/usr/bin/sh"),
            Err(PathBuf::from("/usr/bin/dash")),
        );
        Self { nodes }
    }

    fn resolve(&self, path: &Path, depth: u32) -> Result<PathBuf, String> {
        if depth > 40 {
            return Err("too many symlinks".into());
        }
        let mut out = PathBuf::from("/");
        for c in path.components() {
            match c {
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
                Component::ParentDir => {
                    out.pop();
                }
                Component::Normal(name) => {
                    let candidate = out.join(name);
                    match self.nodes.get(&candidate) {
                        Some(Err(target)) => out = self.resolve(target, depth + 1)?,
                        Some(Ok(_)) => out = candidate,
                        None => return Err("not found".into()),
                    }
                }
            }
        }
        Ok(out)
    }
}

impl HostProbe for Host {
    fn stat(&self, path: &Path) -> Result<Option<FileStat>, String> {
        let Ok(real) = self.resolve(path, 0) else {
            return Ok(None);
        };
        Ok(self.nodes.get(&real).and_then(|n| n.as_ref().ok()).copied())
    }

    fn canonicalize(&self, path: &Path) -> Result<PathBuf, String> {
        self.resolve(path, 0)
    }

    fn current_uid(&self) -> u32 {
        0
    }

    fn host_name(&self) -> Option<String> {
        Some("fuzzhost".into())
    }
}

fn check_errors(daemon: Daemon, text: &str, errors: &ConfigErrors) {
    assert!(!errors.is_empty(), "a refusal lists an error");
    let lines = text.lines().count().max(1) as u32 + 1;
    let empty_key_written = text.contains("\"\"") || text.contains("''");
    for e in &errors.errors {
        let registered = daemon.keys().iter().any(|k| k.path == e.key);
        assert!(
            registered || e.key == "toml" || !e.key.is_empty() || empty_key_written,
            "an error names its key: {e:?}"
        );
        if let Some(line) = e.line() {
            assert!(
                line >= 1 && line <= lines,
                "an error points at a line of the file: {e:?}"
            );
        }
        let rendered = e.render(Some("fuzz.toml"));
        assert!(
            rendered.contains(&e.key),
            "the rendered error names the key"
        );
    }
}

fn server(text: &str, host: &Host) {
    let first = rvbox_config::load_server("fuzz.toml", text, &[], host);
    let second = rvbox_config::load_server("fuzz.toml", text, &[], host);
    match (&first, &second) {
        (Err(a), Err(b)) => {
            assert_eq!(a, b, "the same errors twice");
            check_errors(Daemon::Server, text, a);
        }
        (Ok(a), Ok(b)) => {
            assert_eq!(a.summary(), b.summary(), "the same configuration twice");
            let summary = a.summary();
            if !summary.contains("<redacted>") {
                let back = rvbox_config::load_server("fuzz.toml", summary, &[], host)
                    .unwrap_or_else(|e| panic!("the summary loads back: {}", e.render("summary")));
                assert_eq!(back.summary(), summary, "the summary is a fixed point");
            }
        }
        _ => panic!("the same text is accepted once and refused once"),
    }
}

fn client(text: &str, host: &Host) {
    let first = rvbox_config::load_client("fuzz.toml", text, &[], host);
    let second = rvbox_config::load_client("fuzz.toml", text, &[], host);
    match (&first, &second) {
        (Err(a), Err(b)) => {
            assert_eq!(a, b, "the same errors twice");
            check_errors(Daemon::Client, text, a);
        }
        (Ok(a), Ok(b)) => {
            assert_eq!(a.summary(), b.summary(), "the same configuration twice");
            let summary = a.summary();
            if !summary.contains("<redacted>") {
                let back = rvbox_config::load_client("fuzz.toml", summary, &[], host)
                    .unwrap_or_else(|e| panic!("the summary loads back: {}", e.render("summary")));
                assert_eq!(back.summary(), summary, "the summary is a fixed point");
            }
        }
        _ => panic!("the same text is accepted once and refused once"),
    }
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    let host = Host::new();
    server(&text, &host);
    client(&text, &host);
}
