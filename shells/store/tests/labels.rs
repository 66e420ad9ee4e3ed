#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Client labels: kept from the registration, shown on every client
//! record, and matched by the list filters (a selector on ListClients and
//! ListCommands, a client-id glob on ListClients), page by page.

mod support;

use rvbox_domain::error::Code;
use rvbox_proto::v1 as wire;
use rvbox_store::mutations::OpError;
use support::*;

fn register(s: &mut rvbox_store::Store, client: &str, n: u8, labels: &str) {
    let mut reg = registration(client, [n; 16], 0, [n; 16], None);
    reg.labels = labels.into();
    s.register_session(&reg, NOW).unwrap();
}

fn ids(list: &[wire::ClientSummary]) -> Vec<&str> {
    list.iter().map(|c| c.client_id.as_str()).collect()
}

#[test]
fn labels_are_kept_and_matched_by_every_list_filter() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    register(&mut s, "web-1", 1, "role=web,zone=eu-west");
    register(&mut s, "web-2", 2, "role=web,zone=us-east");
    register(&mut s, "db-1", 3, "canary=yes,role=db,zone=eu-west");
    register(&mut s, "bare", 4, "");
    for c in ["web-1", "web-2", "db-1", "bare"] {
        s.run_command(&run_request(&new_id(), c, "true"), NOW)
            .unwrap();
    }
    let r = s.reader().unwrap();
    let one = r.get_client("db-1", NOW).unwrap().client.unwrap();
    let text: Vec<String> = one
        .labels
        .iter()
        .map(|l| format!("{}={}", l.key, l.value))
        .collect();
    assert_eq!(text, ["canary=yes", "role=db", "zone=eu-west"]);

    let clients = |selector: &str, glob: &str| {
        r.list_clients(&wire::ListClientsRequest {
            selector: selector.into(),
            client_glob: glob.into(),
            ..Default::default()
        })
        .unwrap()
        .clients
    };
    assert_eq!(ids(&clients("", "")), ["bare", "db-1", "web-1", "web-2"]);
    assert_eq!(ids(&clients("role=web", "")), ["web-1", "web-2"]);
    assert_eq!(ids(&clients("zone=eu-*", "")), ["db-1", "web-1"]);
    assert_eq!(ids(&clients("zone=eu-*,!canary", "")), ["web-1"]);
    assert_eq!(ids(&clients("role!=web", "")), ["bare", "db-1"]);
    assert_eq!(ids(&clients("", "web-*")), ["web-1", "web-2"]);
    assert_eq!(ids(&clients("zone=eu-west", "web-?")), ["web-1"]);
    assert!(clients("role=cache", "").is_empty());

    // a filtered listing pages like an unfiltered one; the token is bound
    // to the filter
    let first = r
        .list_clients(&wire::ListClientsRequest {
            page_size: 1,
            selector: "zone=eu-*".into(),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(ids(&first.clients), ["db-1"]);
    let second = r
        .list_clients(&wire::ListClientsRequest {
            page_size: 1,
            selector: "zone=eu-*".into(),
            page_token: first.next_page_token.clone(),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(ids(&second.clients), ["web-1"]);
    assert!(
        second.next_page_token.is_empty(),
        "web-1 was the last match"
    );
    let changed = r.list_clients(&wire::ListClientsRequest {
        page_size: 1,
        selector: "role=web".into(),
        page_token: first.next_page_token,
        ..Default::default()
    });
    assert!(
        matches!(changed, Err(OpError::Refused(ref e)) if e.code() == Code::InvalidArgument),
        "{changed:?}"
    );

    // commands of the clients a selector picks
    let commands = |selector: &str| {
        let mut out: Vec<String> = r
            .list_commands(&wire::ListCommandsRequest {
                selector: selector.into(),
                ..Default::default()
            })
            .unwrap()
            .commands
            .into_iter()
            .map(|c| c.client_id)
            .collect();
        out.sort();
        out
    };
    assert_eq!(commands("role=web"), ["web-1", "web-2"]);
    assert_eq!(commands("canary"), ["db-1"]);
    assert_eq!(commands("").len(), 4);
    let paged = r
        .list_commands(&wire::ListCommandsRequest {
            selector: "zone=eu-west".into(),
            page_size: 1,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(paged.commands.len(), 1);
    let rest = r
        .list_commands(&wire::ListCommandsRequest {
            selector: "zone=eu-west".into(),
            page_size: 1,
            page_token: paged.next_page_token,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(rest.commands.len(), 1);
    assert_ne!(rest.commands[0].client_id, paged.commands[0].client_id);
    assert!(rest.next_page_token.is_empty());

    // bad filters are refused, naming the field
    for (req, field) in [
        (
            wire::ListClientsRequest {
                selector: "role=a b".into(),
                ..Default::default()
            },
            "selector",
        ),
        (
            wire::ListClientsRequest {
                client_glob: "web/*".into(),
                ..Default::default()
            },
            "client_glob",
        ),
    ] {
        match r.list_clients(&req) {
            Err(OpError::Refused(e)) => {
                assert_eq!(e.code(), Code::InvalidArgument);
                assert_eq!(e.field(), field);
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_new_registration_replaces_the_labels() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = open(dir.path());
    register(&mut s, "web-1", 1, "role=web");
    let mut reg = registration("web-1", [1; 16], 1, [9; 16], Some([1; 16]));
    reg.labels = "role=cache".into();
    s.register_session(&reg, NOW + 1).unwrap();
    let r = s.reader().unwrap();
    let c = r.get_client("web-1", NOW).unwrap().client.unwrap();
    assert_eq!(c.labels.len(), 1);
    assert_eq!(c.labels[0].value, "cache");
}
