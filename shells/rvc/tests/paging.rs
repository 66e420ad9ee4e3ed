//! The paging keys of `[control]` are honoured: a list request without a
//! size gets `control.default_page_size` entries, one above
//! `control.max_page_size` is refused naming the key, and `GetOutput`
//! pages follow `control.default_output_page` and `control.max_output_page`.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use rvbox_control_api::v1::control_client::ControlClient;
use rvbox_proto::v1 as wire;
use support::Stack;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_and_output_pages_follow_the_configured_sizes() {
    let mut s = Stack::configured();
    let path = s.dir.path().join("server.toml");
    let toml = std::fs::read_to_string(&path).unwrap().replace(
        "[control]\n",
        "[control]\ndefault_page_size = 2\nmax_page_size = 3\ndefault_output_page = \"1KiB\"\nmax_output_page = \"2KiB\"\n",
    );
    std::fs::write(&path, toml).unwrap();
    s.start_server();
    s.start_client();
    for _ in 0..4 {
        let out = s.rvc(&["run", "web-1", "head -c 3000 /dev/zero | tr '\\0' a"]);
        assert!(out.status.success(), "{out:?}");
    }
    let mut c = ControlClient::new(support::control_channel(s.socket()).await);

    // no size: the configured default
    let page = c
        .list_commands(wire::ListCommandsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.commands.len(), 2, "{page:?}");
    assert!(!page.next_page_token.is_empty());
    // up to the configured maximum
    let page = c
        .list_commands(wire::ListCommandsRequest {
            page_size: 3,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(page.commands.len(), 3);
    // above it: refused, naming the key
    let e = c
        .list_commands(wire::ListCommandsRequest {
            page_size: 4,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("control.max_page_size"), "{e:?}");
    let e = c
        .list_clients(wire::ListClientsRequest {
            page_size: 4,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");

    // output pages
    let issue = page.commands[0].issue_uuid.clone();
    let out = c
        .get_output(wire::GetOutputRequest {
            issue_uuid: issue.clone(),
            streams: vec![wire::OutputStream::Stdout as i32],
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let bytes: usize = out
        .items
        .iter()
        .filter_map(|i| match &i.item {
            Some(wire::output_item::Item::Data(d)) => Some(d.data.len()),
            _ => None,
        })
        .sum();
    assert!(
        bytes > 0 && bytes <= 1024,
        "a default page of {bytes} bytes"
    );
    let e = c
        .get_output(wire::GetOutputRequest {
            issue_uuid: issue,
            streams: vec![wire::OutputStream::Stdout as i32],
            max_bytes: 4096,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument);
    assert!(e.message().contains("control.max_output_page"), "{e:?}");
}
