//! An in-memory host for configuration tests.
#![allow(dead_code, unreachable_pub)]

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Component, Path, PathBuf};

use rvbox_config::{FileKind, FileStat, HostProbe};

#[derive(Debug, Clone)]
pub enum Node {
    File {
        kind: FileKind,
        mode: u32,
        uid: u32,
        size: u64,
        mtime_ns: i128,
        ino: u64,
    },
    Link(PathBuf),
}

#[derive(Debug)]
pub struct FakeHost {
    pub nodes: RefCell<BTreeMap<PathBuf, Node>>,
    pub uid: u32,
    pub host_name: Option<String>,
    pub next_ino: RefCell<u64>,
}

impl FakeHost {
    pub fn empty() -> Self {
        let host = Self {
            nodes: RefCell::new(BTreeMap::new()),
            uid: 1000,
            host_name: Some("testhost".to_owned()),
            next_ino: RefCell::new(1),
        };
        host.dir("/", 0o755, 0);
        host
    }

    /// A typical Debian-like host: /bin -> usr/bin, sh -> dash, bash.
    pub fn standard() -> Self {
        let host = Self::empty();
        for d in [
            "/usr", "/usr/bin", "/var", "/var/lib", "/run", "/etc", "/home", "/tmp", "/srv",
        ] {
            host.dir(d, 0o755, 0);
        }
        host.link("/bin", "/usr/bin");
        host.file("/usr/bin/dash", 0o755, 0);
        host.link("/usr/bin/sh", "/usr/bin/dash");
        host.file("/usr/bin/bash", 0o755, 0);
        host
    }

    fn ino(&self) -> u64 {
        let mut n = self.next_ino.borrow_mut();
        *n += 1;
        *n
    }

    pub fn dir(&self, path: &str, mode: u32, uid: u32) {
        let ino = self.ino();
        self.nodes.borrow_mut().insert(
            PathBuf::from(path),
            Node::File {
                kind: FileKind::Dir,
                mode,
                uid,
                size: 4096,
                mtime_ns: 0,
                ino,
            },
        );
    }

    pub fn file(&self, path: &str, mode: u32, uid: u32) {
        let ino = self.ino();
        self.nodes.borrow_mut().insert(
            PathBuf::from(path),
            Node::File {
                kind: FileKind::Regular,
                mode,
                uid,
                size: 100,
                mtime_ns: 1,
                ino,
            },
        );
    }

    pub fn socket(&self, path: &str) {
        let ino = self.ino();
        self.nodes.borrow_mut().insert(
            PathBuf::from(path),
            Node::File {
                kind: FileKind::Socket,
                mode: 0o600,
                uid: 1000,
                size: 0,
                mtime_ns: 0,
                ino,
            },
        );
    }

    pub fn link(&self, path: &str, target: &str) {
        self.nodes
            .borrow_mut()
            .insert(PathBuf::from(path), Node::Link(PathBuf::from(target)));
    }

    /// Simulates replacing a file's content (new size and mtime).
    pub fn touch(&self, path: &str) {
        if let Some(Node::File { size, mtime_ns, .. }) =
            self.nodes.borrow_mut().get_mut(Path::new(path))
        {
            *size += 1;
            *mtime_ns += 1;
        }
    }

    fn resolve(&self, path: &Path, depth: u32) -> Result<PathBuf, String> {
        if depth > 40 {
            return Err("too many symlinks".to_owned());
        }
        let mut out = PathBuf::from("/");
        let mut comps: Vec<Component<'_>> = path.components().collect();
        comps.reverse();
        while let Some(c) = comps.pop() {
            match c {
                Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
                Component::ParentDir => {
                    out.pop();
                }
                Component::Normal(name) => {
                    let candidate = out.join(name);
                    let node = self.nodes.borrow().get(&candidate).cloned();
                    match node {
                        Some(Node::Link(target)) => {
                            let target = if target.is_absolute() {
                                target
                            } else {
                                out.join(target)
                            };
                            out = self.resolve(&target, depth + 1)?;
                        }
                        Some(Node::File { .. }) => out = candidate,
                        None => return Err("not found".to_owned()),
                    }
                }
            }
        }
        Ok(out)
    }
}

impl HostProbe for FakeHost {
    fn stat(&self, path: &Path) -> Result<Option<FileStat>, String> {
        let Ok(real) = self.resolve(path, 0) else {
            return Ok(None);
        };
        match self.nodes.borrow().get(&real) {
            Some(Node::File {
                kind,
                mode,
                uid,
                size,
                mtime_ns,
                ino,
            }) => Ok(Some(FileStat {
                kind: *kind,
                mode: *mode,
                uid: *uid,
                dev: 1,
                ino: *ino,
                size: *size,
                mtime_ns: *mtime_ns,
            })),
            Some(Node::Link(_)) => Err("dangling".to_owned()),
            None if real == Path::new("/") => Ok(None),
            None => Ok(None),
        }
    }

    fn canonicalize(&self, path: &Path) -> Result<PathBuf, String> {
        self.resolve(path, 0)
    }

    fn current_uid(&self) -> u32 {
        self.uid
    }

    fn host_name(&self) -> Option<String> {
        self.host_name.clone()
    }
}

pub fn server(text: &str) -> Result<rvbox_config::ServerConfig, rvbox_config::ConfigErrors> {
    rvbox_config::load_server("test.toml", text, &[], &FakeHost::standard())
}

pub fn client(text: &str) -> Result<rvbox_config::ClientConfig, rvbox_config::ConfigErrors> {
    rvbox_config::load_client("test.toml", text, &[], &FakeHost::standard())
}

/// The errors of a server config that must fail.
pub fn server_err(text: &str) -> rvbox_config::ConfigErrors {
    match server(text) {
        Ok(_) => panic!("server config unexpectedly valid:\n{text}"),
        Err(e) => e,
    }
}

/// The errors of a client config that must fail.
pub fn client_err(text: &str) -> rvbox_config::ConfigErrors {
    match client(text) {
        Ok(_) => panic!("client config unexpectedly valid:\n{text}"),
        Err(e) => e,
    }
}

/// The workspace root (two levels above this crate).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}
