//! The canonical proto3 JSON form of the RVBox messages: lower camel case
//! field names, enum values by name, 64-bit integers as strings, bytes as
//! base64, `Timestamp` and `Duration` as RFC 3339 text, as every protobuf
//! JSON mapping writes them. The mapping is read from the descriptors
//! the stubs are generated from (prost-reflect), so it can never drift
//! from the wire contract.
//!
//! Written documents carry every field, defaults included, so a reader
//! finds the same keys whatever the values. Read documents refuse unknown
//! fields and name what is wrong.

use std::sync::OnceLock;

use prost::Message as _;
use prost_reflect::{DescriptorPool, DeserializeOptions, DynamicMessage, SerializeOptions};

/// The descriptors of `rvbox.v1` and its imports.
fn pool() -> Result<&'static DescriptorPool, String> {
    static POOL: OnceLock<Result<DescriptorPool, String>> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(crate::FILE_DESCRIPTOR_SET)
            .map_err(|e| format!("the embedded descriptors do not decode: {e}"))
    })
    .as_ref()
    .map_err(Clone::clone)
}

fn descriptor(full_name: &str) -> Result<prost_reflect::MessageDescriptor, String> {
    pool()?
        .get_message_by_name(full_name)
        .ok_or_else(|| format!("no message {full_name} in rvbox.v1"))
}

/// `message` (of protobuf type `full_name`, e.g. `rvbox.v1.RunCommandResponse`)
/// as a JSON value.
///
/// # Errors
/// An unknown type name, or bytes that do not decode as it (a caller's
/// mismatch of type and name).
pub fn to_value<M: prost::Message>(
    full_name: &str,
    message: &M,
) -> Result<serde_json::Value, String> {
    let dynamic =
        DynamicMessage::decode(descriptor(full_name)?, message.encode_to_vec().as_slice())
            .map_err(|e| format!("{full_name} does not decode: {e}"))?;
    let options = SerializeOptions::new().skip_default_fields(false);
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .map_err(|e| format!("{full_name} does not serialize: {e}"))
}

/// `message` as one line of JSON text.
///
/// # Errors
/// As [`to_value`].
pub fn to_string<M: prost::Message>(full_name: &str, message: &M) -> Result<String, String> {
    to_value(full_name, message).map(|v| v.to_string())
}

/// A JSON value read as a message of protobuf type `full_name`.
///
/// # Errors
/// A reason naming the field or value that is wrong: an unknown field, a
/// value of the wrong type, an unknown enum name, malformed base64 or
/// time.
pub fn from_value<M: prost::Message + Default>(
    full_name: &str,
    value: serde_json::Value,
) -> Result<M, String> {
    let options = DeserializeOptions::new().deny_unknown_fields(true);
    let dynamic = DynamicMessage::deserialize_with_options(descriptor(full_name)?, value, &options)
        .map_err(|e| e.to_string())?;
    M::decode(dynamic.encode_to_vec().as_slice()).map_err(|e| format!("{full_name}: {e}"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use rvbox_proto::v1 as wire;

    #[test]
    fn messages_go_to_canonical_json_and_back() {
        let r = wire::AppendStdinResponse {
            issue_uuid: "01a23540-72c4-7b01-9d0e-5f4f5d9c0a6e".into(),
            first_write_seq: 1,
            last_write_seq: 3,
            delivery: wire::StdinDelivery::Pending as i32,
        };
        let v = to_value("rvbox.v1.AppendStdinResponse", &r).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "issueUuid": "01a23540-72c4-7b01-9d0e-5f4f5d9c0a6e",
                "firstWriteSeq": "1",
                "lastWriteSeq": "3",
                "delivery": "STDIN_DELIVERY_PENDING",
            })
        );
        let back: wire::AppendStdinResponse =
            from_value("rvbox.v1.AppendStdinResponse", v).unwrap();
        assert_eq!(back, r);
        // defaults are written too: the same keys whatever the values
        let empty = to_value(
            "rvbox.v1.CloseStdinResponse",
            &wire::CloseStdinResponse::default(),
        )
        .unwrap();
        assert_eq!(empty.as_object().unwrap().len(), 3);
        let t = wire::ClientSummary {
            last_seen_time: Some(prost_types::Timestamp {
                seconds: 1_800_000_000,
                nanos: 0,
            }),
            ..Default::default()
        };
        let v = to_value("rvbox.v1.ClientSummary", &t).unwrap();
        assert_eq!(v["lastSeenTime"], "2027-01-15T08:00:00Z");
    }

    #[test]
    fn a_terminal_open_takes_its_profiles_by_name() {
        let r: wire::OpenPtySessionRequest = from_value(
            "rvbox.v1.OpenPtySessionRequest",
            serde_json::json!({
                "clientId": "web-1",
                "rows": 24,
                "cols": 80,
                "profileFlags": ["PROFILE_FLAG_MEM_LOW", "PROFILE_FLAG_CPU_HIGH"],
            }),
        )
        .unwrap();
        assert_eq!(
            r.profile_flags,
            vec![
                wire::ProfileFlag::MemLow as i32,
                wire::ProfileFlag::CpuHigh as i32
            ]
        );
        let v = to_value("rvbox.v1.OpenPtySessionRequest", &r).unwrap();
        assert_eq!(
            v["profileFlags"],
            serde_json::json!(["PROFILE_FLAG_MEM_LOW", "PROFILE_FLAG_CPU_HIGH"])
        );
    }

    #[test]
    fn a_bad_document_is_refused_with_what_is_wrong() {
        let e = from_value::<wire::CloseStdinRequest>(
            "rvbox.v1.CloseStdinRequest",
            serde_json::json!({"requestId": "x", "nope": 1}),
        )
        .unwrap_err();
        assert!(e.contains("nope"), "{e}");
        let e = from_value::<wire::AppendStdinRequest>(
            "rvbox.v1.AppendStdinRequest",
            serde_json::json!({"newline": "STDIN_NEWLINE_SIDEWAYS"}),
        )
        .unwrap_err();
        assert!(e.contains("STDIN_NEWLINE_SIDEWAYS"), "{e}");
        assert!(to_value("rvbox.v1.NoSuch", &wire::CloseStdinRequest::default()).is_err());
    }
}
