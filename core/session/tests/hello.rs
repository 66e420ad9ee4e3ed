//! ClientHello validation and version negotiation (plan §6.2, R-6.2-01/02).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use common::{hello, identity};
use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_session::{HelloError, negotiate_minor, validate_hello};

fn minors() -> Vec<u32> {
    identity().supported_minors
}

#[test]
fn version_negotiation_picks_highest_shared_minor() {
    // client 0..=3, server 0..=2 -> 2
    let v = validate_hello(hello(), &minors()).unwrap();
    assert_eq!(v.negotiated_minor, 2);
    let mut h = hello();
    h.supported_minors = vec![1];
    assert_eq!(validate_hello(h, &minors()).unwrap().negotiated_minor, 1);
    assert_eq!(negotiate_minor(&[0, 2, 5, 7], &[1, 2, 3, 7]), Some(7));
    assert_eq!(negotiate_minor(&[0, 2], &[2, 9]), Some(2));
}

#[test]
fn version_negotiation_without_shared_minor_is_rejected() {
    let mut h = hello();
    h.supported_minors = vec![3, 4];
    let e = validate_hello(h, &minors()).unwrap_err();
    assert_eq!(
        e,
        HelloError::NoSharedMinor {
            client: vec![3, 4],
            server: vec![0, 1, 2]
        }
    );
    assert_eq!(e.code(), Code::VersionMismatch);
    assert_eq!(e.to_domain().field(), "client_hello.supported_minors");
}

#[test]
fn version_negotiation_major_2_is_rejected() {
    let mut h = hello();
    h.protocol_major = 2;
    // even with an otherwise broken hello, the version problem wins
    h.client_id = String::new();
    let e = validate_hello(h, &minors()).unwrap_err();
    assert_eq!(e, HelloError::UnsupportedMajor { got: 2 });
    assert_eq!(e.code(), Code::VersionMismatch);
    assert_eq!(e.field(), "client_hello.protocol_major");
    let mut h = hello();
    h.protocol_major = 0;
    assert!(matches!(
        validate_hello(h, &minors()),
        Err(HelloError::UnsupportedMajor { got: 0 })
    ));
}

/// A mutation of a valid hello.
type Mutation = Box<dyn FnOnce(&mut wire::ClientHello)>;

fn field_of(f: impl FnOnce(&mut wire::ClientHello)) -> &'static str {
    let mut h = hello();
    f(&mut h);
    let e = validate_hello(h, &minors()).unwrap_err();
    assert_eq!(e.to_domain().field(), e.field());
    e.field()
}

fn caps(h: &mut wire::ClientHello) -> &mut wire::Capabilities {
    h.capabilities.as_mut().unwrap()
}

#[test]
fn hello_field_bounds_name_the_field() {
    use wire::ShellCapability as S;
    let sh = |t: wire::ShellType, d: bool| S {
        shell_type: t as i32,
        platform_default: d,
    };
    let cases: Vec<(&str, Mutation)> = vec![
        (
            "client_hello.supported_minors",
            Box::new(|h| h.supported_minors.clear()),
        ),
        (
            "client_hello.supported_minors",
            Box::new(|h| h.supported_minors = vec![2, 1]),
        ),
        (
            "client_hello.supported_minors",
            Box::new(|h| h.supported_minors = vec![1, 1]),
        ),
        (
            "client_hello.supported_minors",
            Box::new(|h| h.supported_minors = (0..17).collect()),
        ),
        (
            "client_hello.client_id",
            Box::new(|h| h.client_id = "web 01".into()),
        ),
        (
            "client_hello.client_id",
            Box::new(|h| h.client_id = "h".repeat(129)),
        ),
        (
            "client_hello.client_instance_id",
            Box::new(|h| {
                h.client_instance_id = "01890a5d-ac96-774b-bcce-b302099a8057".into();
            }),
        ),
        (
            "client_hello.client_instance_id",
            Box::new(|h| {
                h.client_instance_id = common::INSTANCE_A.to_uppercase();
            }),
        ),
        (
            "client_hello.capabilities",
            Box::new(|h| h.capabilities = None),
        ),
        (
            "client_hello.capabilities.platform",
            Box::new(|h| caps(h).platform = None),
        ),
        (
            "client_hello.capabilities.platform.os",
            Box::new(|h| {
                caps(h).platform.as_mut().unwrap().os = "o".repeat(33);
            }),
        ),
        (
            "client_hello.capabilities.max_running",
            Box::new(|h| caps(h).max_running = 0),
        ),
        (
            "client_hello.capabilities.max_running",
            Box::new(|h| caps(h).max_running = 1025),
        ),
        (
            "client_hello.capabilities.max_queued",
            Box::new(|h| caps(h).max_queued = 10_001),
        ),
        (
            "client_hello.capabilities.shells",
            Box::new(|h| caps(h).shells.clear()),
        ),
        (
            "client_hello.capabilities.shells",
            Box::new(move |h| {
                caps(h).shells = vec![
                    sh(wire::ShellType::Sh, true),
                    sh(wire::ShellType::Bash, false),
                    sh(wire::ShellType::Cmd, false),
                    sh(wire::ShellType::Powershell, false),
                    sh(wire::ShellType::Sh, false),
                ];
            }),
        ),
        (
            "client_hello.capabilities.shells",
            Box::new(move |h| {
                caps(h).shells = vec![
                    sh(wire::ShellType::Sh, true),
                    sh(wire::ShellType::Sh, false),
                ];
            }),
        ),
        (
            "client_hello.capabilities.shells",
            Box::new(move |h| {
                caps(h).shells = vec![sh(wire::ShellType::Sh, false)];
            }),
        ),
        (
            "client_hello.capabilities.shells",
            Box::new(move |h| {
                caps(h).shells = vec![sh(wire::ShellType::Unspecified, true)];
            }),
        ),
        (
            "client_hello.capabilities.profiles",
            Box::new(|h| caps(h).profiles = (1..=11).collect()),
        ),
        (
            "client_hello.capabilities.profiles",
            Box::new(|h| caps(h).profiles = vec![3, 2]),
        ),
        (
            "client_hello.capabilities.profiles",
            Box::new(|h| caps(h).profiles = vec![0]),
        ),
        (
            "client_hello.capabilities.profiles",
            Box::new(|h| caps(h).profiles = vec![999]),
        ),
        (
            "client_hello.capabilities.software_version",
            Box::new(|h| {
                caps(h).software_version = "v".repeat(65);
            }),
        ),
        (
            "client_hello.capabilities.supervision_mode",
            Box::new(|h| caps(h).supervision_mode = 0),
        ),
        ("client_hello.cwd_policy", Box::new(|h| h.cwd_policy = None)),
        (
            "client_hello.cwd_policy.default_cwd",
            Box::new(|h| {
                h.cwd_policy.as_mut().unwrap().default_cwd = "srv".into();
            }),
        ),
        (
            "client_hello.cwd_policy.default_cwd",
            Box::new(|h| {
                h.cwd_policy.as_mut().unwrap().default_cwd = format!("/{}", "d".repeat(4096));
            }),
        ),
        (
            "client_hello.cwd_policy.allowed_roots",
            Box::new(|h| {
                h.cwd_policy.as_mut().unwrap().allowed_roots = vec!["/r".into(); 65];
            }),
        ),
        (
            "client_hello.cwd_policy.allowed_roots",
            Box::new(|h| {
                h.cwd_policy.as_mut().unwrap().allowed_roots = vec!["relative".into()];
            }),
        ),
        // labels: unsorted, a bad key, a bad value, too many
        ("client_hello.labels", Box::new(|h| h.labels.reverse())),
        (
            "client_hello.labels",
            Box::new(|h| h.labels[0].key = "-role".into()),
        ),
        (
            "client_hello.labels",
            Box::new(|h| h.labels[0].value = "a,b".into()),
        ),
        (
            "client_hello.labels",
            Box::new(|h| {
                h.labels = (0..33)
                    .map(|i| wire::Label {
                        key: format!("k{i:02}"),
                        value: "v".into(),
                    })
                    .collect();
            }),
        ),
    ];
    for (i, (want, f)) in cases.into_iter().enumerate() {
        assert_eq!(field_of(f), want, "case {i}");
    }
}

#[test]
fn hello_bounds_accept_the_edges() {
    let mut h = hello();
    let c = caps(&mut h);
    c.max_running = 1024;
    c.max_queued = 10_000;
    c.software_version = "v".repeat(64);
    c.profiles = (1..=10).collect();
    c.shells = [
        wire::ShellType::Sh,
        wire::ShellType::Bash,
        wire::ShellType::Cmd,
        wire::ShellType::Powershell,
    ]
    .into_iter()
    .enumerate()
    .map(|(i, t)| wire::ShellCapability {
        shell_type: t as i32,
        platform_default: i == 0,
    })
    .collect();
    h.supported_minors = (0..16).collect();
    h.cwd_policy.as_mut().unwrap().allowed_roots = vec!["/r".into(); 64];
    h.labels = (0..32)
        .map(|i| wire::Label {
            key: format!("k{i:02}{}", "k".repeat(60)),
            value: "v".repeat(128),
        })
        .collect();
    let v = validate_hello(h, &minors()).unwrap();
    assert_eq!(v.labels.len(), 32);
    assert_eq!(v.negotiated_minor, 2);
    assert_eq!(v.client_id.as_str(), "web-01");

    let mut h = hello();
    caps(&mut h).max_running = 1;
    caps(&mut h).max_queued = 0;
    caps(&mut h).profiles.clear();
    h.cwd_policy.as_mut().unwrap().allowed_roots.clear();
    assert!(validate_hello(h, &minors()).is_ok());
}
