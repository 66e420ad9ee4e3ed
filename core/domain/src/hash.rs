//! The canonical request hash (plan §5.2, §9.1).
//!
//! `SHA-256("rvbox.v1/" + method + "\n" + deterministic protobuf encoding)`
//! of a validated, normalized request with transport metadata removed.
//! Determinism comes from three rules: prost writes fields in tag order;
//! every proto map is generated as a `BTreeMap`, so entries are written in
//! key order; and repeated fields with set semantics (profile flags) are
//! sorted and deduplicated by [`normalize_spec`] before encoding. Decoding
//! drops unknown fields, so a re-encoded message is canonical too.

use std::fmt;

use prost::Message;
use rvbox_proto::v1 as wire;
use sha2::{Digest, Sha256};

use crate::ids::ClientId;

/// A 32-byte SHA-256 request hash, stored as a fixed-size blob.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestHash(pub [u8; 32]);

impl RequestHash {
    /// Reads a hash from wire bytes, which must be exactly 32 long.
    #[must_use]
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        <[u8; 32]>::try_from(bytes).ok().map(Self)
    }

    /// The raw bytes.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lower-case hex text (for logs and `rvc`).
    #[must_use]
    pub fn to_hex(&self) -> String {
        use fmt::Write as _;
        self.0.iter().fold(String::with_capacity(64), |mut s, b| {
            let _ = write!(s, "{b:02x}");
            s
        })
    }
}

impl fmt::Display for RequestHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for RequestHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RequestHash({})", self.to_hex())
    }
}

fn digest(parts: &[&[u8]]) -> RequestHash {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    let out = h.finalize();
    let mut bytes = [0u8; 32];
    for (o, b) in bytes.iter_mut().zip(out.iter()) {
        *o = *b;
    }
    RequestHash(bytes)
}

/// Hashes an already validated and normalized request for `method` (the
/// RPC name, e.g. `"SignalCommand"`). The caller clears transport metadata
/// such as `request_id` first; the method is part of the identity, so the
/// same bytes under another method hash differently.
#[must_use]
pub fn request_hash<M: Message>(method: &str, request: &M) -> RequestHash {
    let body = request.encode_to_vec();
    digest(&[b"rvbox.v1/", method.as_bytes(), b"\n", &body])
}

/// Normalizes an `ExecutionSpec` for hashing and storage: profile flags are
/// sorted and deduplicated (they are a set); everything else is kept as
/// given. An unspecified shell stays unspecified (spec-mapping: the client
/// resolves its platform default at acceptance).
#[must_use]
pub fn normalize_spec(spec: &wire::ExecutionSpec) -> wire::ExecutionSpec {
    let mut out = spec.clone();
    out.profile_flags.sort_unstable();
    out.profile_flags.dedup();
    out
}

/// The immutable hash of one command: the target client plus the
/// normalized execution spec. It travels in `Dispatch.request_hash`, is
/// compared on every repeat dispatch and reconciliation row, and is kept in
/// tombstones.
#[must_use]
pub fn command_hash(client_id: &ClientId, spec: &wire::ExecutionSpec) -> RequestHash {
    let spec = normalize_spec(spec).encode_to_vec();
    let client = client_id.as_str().as_bytes();
    digest(&[
        b"rvbox.v1/command\n",
        &(client.len() as u64).to_be_bytes(),
        client,
        &spec,
    ])
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn spec(env: &[(&str, &str)], flags: Vec<i32>) -> wire::ExecutionSpec {
        wire::ExecutionSpec {
            source: Some(wire::execution_spec::Source::CommandText("echo hi".into())),
            shell_type: wire::ShellType::Bash as i32,
            cwd: "/srv".into(),
            env: env
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect::<BTreeMap<_, _>>(),
            profile_flags: flags,
        }
    }

    fn client(id: &str) -> ClientId {
        ClientId::parse("client_id", id).unwrap()
    }

    #[test]
    fn map_insertion_order_does_not_matter() {
        let a = spec(&[("A", "1"), ("B", "2"), ("C", "3")], vec![]);
        let b = spec(&[("C", "3"), ("A", "1"), ("B", "2")], vec![]);
        assert_eq!(
            command_hash(&client("h"), &a),
            command_hash(&client("h"), &b)
        );
    }

    #[test]
    fn flag_order_and_repeats_do_not_matter() {
        let cpu = wire::ProfileFlag::CpuLow as i32;
        let mem = wire::ProfileFlag::MemHigh as i32;
        let a = spec(&[], vec![mem, cpu, cpu]);
        let b = spec(&[], vec![cpu, mem]);
        assert_eq!(
            command_hash(&client("h"), &a),
            command_hash(&client("h"), &b)
        );
    }

    #[test]
    fn every_immutable_field_changes_the_hash() {
        let base = spec(&[("A", "1")], vec![]);
        let h = command_hash(&client("h"), &base);
        let mut variants = Vec::new();
        let mut v = base.clone();
        v.cwd = "/tmp".into();
        variants.push(v);
        let mut v = base.clone();
        v.env.insert("A".into(), "2".into());
        variants.push(v);
        let mut v = base.clone();
        v.shell_type = wire::ShellType::Sh as i32;
        variants.push(v);
        let mut v = base.clone();
        v.profile_flags.push(wire::ProfileFlag::Light as i32);
        variants.push(v);
        let mut v = base.clone();
        v.source = Some(wire::execution_spec::Source::CommandText("echo ho".into()));
        variants.push(v);
        for v in variants {
            assert_ne!(command_hash(&client("h"), &v), h, "{v:?}");
        }
        assert_ne!(command_hash(&client("other"), &base), h);
    }

    #[test]
    fn method_is_part_of_the_identity() {
        let s = spec(&[], vec![]);
        assert_ne!(request_hash("RunCommand", &s), request_hash("Other", &s));
        assert_eq!(
            request_hash("RunCommand", &s),
            request_hash("RunCommand", &s.clone())
        );
    }

    #[test]
    fn hash_is_pinned() {
        // Changing the encoding would silently turn every stored request
        // into a conflict; this value pins it.
        let h = command_hash(&client("web-1"), &spec(&[("A", "1")], vec![]));
        assert_eq!(
            h.to_hex(),
            "8836b9157b8aa5fb539a57c51446a32acb86cb07a0dda04a0825a78378fa5151"
        );
        assert_eq!(RequestHash::from_slice(h.as_bytes()), Some(h));
        assert_eq!(RequestHash::from_slice(&[0; 31]), None);
    }
}
