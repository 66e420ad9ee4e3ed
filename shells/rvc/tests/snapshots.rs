//! What rvc prints, for each command, against a running server and
//! client: insta snapshots of stdout, stderr and the exit status, with
//! UUIDs, times, ports and temporary paths redacted.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use support::Stack;

/// One snapshot, redacted as every end-to-end snapshot is.
macro_rules! snap {
    ($s:expr, $name:expr, $out:expr) => {
        support::snapshot(&$s, $name, &$out)
    };
}

#[test]
fn rvc_output_of_every_command() {
    let s = Stack::new();
    let fg = s.rvc(&["run", "web-1", "echo out; echo err >&2; exit 5"]);
    snap!(s, "run_foreground", fg);

    let bg = s.rvc(&["run", "--background", "web-1", "echo later"]);
    snap!(s, "run_background", bg);
    let uuid = String::from_utf8_lossy(&bg.stdout).trim().to_owned();

    let follow = s.rvc(&["follow", &uuid]);
    snap!(s, "follow", follow);

    snap!(s, "stat_clients", s.rvc(&["stat"]));
    snap!(
        s,
        "stat_clients_label",
        s.rvc(&["stat", "--label", "zone=eu-*", "--target", "web-?"])
    );
    snap!(
        s,
        "stat_clients_label_none",
        s.rvc(&["stat", "--label", "role=db"])
    );
    snap!(
        s,
        "error_bad_selector",
        s.rvc(&["stat", "--label", "role=a b"])
    );
    let stat = s.rvc(&["stat", "web-1", &uuid]);
    snap!(s, "stat_command", stat);

    let long = s.rvc(&["run", "--background", "web-1", "exec sleep 60"]);
    let long_uuid = String::from_utf8_lossy(&long.stdout).trim().to_owned();
    s.wait_until("the command runs", || {
        String::from_utf8_lossy(&s.rvc(&["stat", "web-1", &long_uuid]).stdout)
            .contains("state     running")
    });
    // stdin of a running command
    let cat = s.rvc(&["run", "--background", "web-1", "cat"]);
    let cat_uuid = String::from_utf8_lossy(&cat.stdout).trim().to_owned();
    s.wait_until("cat runs", || {
        String::from_utf8_lossy(&s.rvc(&["stat", "web-1", &cat_uuid]).stdout)
            .contains("state     running")
    });
    snap!(s, "append", s.rvc(&["append", "web-1", &cat_uuid, "hello"]));
    snap!(
        s,
        "append_json",
        s.rvc(&["-o", "json", "append", "web-1", &cat_uuid, "again"])
    );
    snap!(
        s,
        "close_stdin",
        s.rvc(&["close-stdin", "web-1", &cat_uuid])
    );
    snap!(s, "follow_cat", s.rvc(&["follow", &cat_uuid]));
    let cat2 = s.rvc(&["run", "--background", "web-1", "cat"]);
    let cat2_uuid = String::from_utf8_lossy(&cat2.stdout).trim().to_owned();
    s.wait_until("the second cat runs", || {
        String::from_utf8_lossy(&s.rvc(&["stat", "web-1", &cat2_uuid]).stdout)
            .contains("state     running")
    });
    snap!(
        s,
        "close_stdin_json",
        s.rvc(&["-o", "json", "close-stdin", "web-1", &cat2_uuid])
    );
    let _ = s.rvc(&["follow", &cat2_uuid]);
    snap!(
        s,
        "error_append_ended",
        s.rvc(&["append", "web-1", &cat_uuid, "late"])
    );
    snap!(
        s,
        "error_append_ended_json",
        s.rvc(&["-o", "json", "append", "web-1", &cat_uuid, "late"])
    );

    let other = s.rvc(&["run", "--background", "web-1", "exec sleep 60"]);
    let other_uuid = String::from_utf8_lossy(&other.stdout).trim().to_owned();
    s.wait_until("the second sleep runs", || {
        String::from_utf8_lossy(&s.rvc(&["stat", "web-1", &other_uuid]).stdout)
            .contains("state     running")
    });
    snap!(
        s,
        "kill_json",
        s.rvc(&["-o", "json", "kill", "HUP", "web-1", &other_uuid])
    );
    snap!(s, "kill", s.rvc(&["kill", "KILL", "web-1", &long_uuid]));
    snap!(s, "follow_killed", s.rvc(&["follow", &long_uuid]));

    snap!(s, "list_client", s.rvc(&["list", "web-1"]));
    snap!(s, "stat_client", s.rvc(&["stat", "web-1"]));
    snap!(s, "list_page", s.rvc(&["list", "--per-page", "1"]));

    snap!(s, "client_show", s.rvc(&["client", "show", "web-1"]));

    // --output json: one document per result
    let bg = s.rvc(&["-o", "json", "run", "--background", "web-1", "echo json"]);
    snap!(s, "run_background_json", bg);
    let doc: serde_json::Value = serde_json::from_slice(&bg.stdout).unwrap();
    let json_uuid = doc["issueUuid"].as_str().unwrap().to_owned();
    // a command that has ended: the stream starts from its final status
    // (one still starting would make the first items depend on timing)
    s.wait_until("the json command ends", || {
        String::from_utf8_lossy(&s.rvc(&["stat", "web-1", &json_uuid]).stdout).contains("succeeded")
    });
    snap!(
        s,
        "follow_json",
        s.rvc(&["-o", "json", "follow", &json_uuid])
    );
    snap!(
        s,
        "stat_command_json",
        s.rvc(&["-o", "json", "stat", "web-1", &json_uuid])
    );
    snap!(s, "stat_clients_json", s.rvc(&["-o", "json", "stat"]));
    snap!(
        s,
        "stat_client_json",
        s.rvc(&["-o", "json", "stat", "web-1", "--per-page", "2"])
    );
    snap!(
        s,
        "list_page_json",
        s.rvc(&["-o", "json", "list", "--per-page", "1"])
    );
    snap!(
        s,
        "client_show_json",
        s.rvc(&["-o", "json", "client", "show", "web-1"])
    );
    snap!(
        s,
        "storage_incidents_none_json",
        s.rvc(&["-o", "json", "storage", "incidents"])
    );
    snap!(
        s,
        "error_unknown_command_json",
        s.rvc(&[
            "-o",
            "json",
            "stat",
            "web-1",
            "01a233bb-db10-7210-ae1b-edcc39797699"
        ])
    );
    snap!(
        s,
        "storage_incidents_none",
        s.rvc(&["storage", "incidents"])
    );

    // errors
    snap!(
        s,
        "error_takeover_without_claim",
        s.rvc(&[
            "client",
            "takeover",
            "web-1",
            "6f1c2a4e-8d3b-4f5a-9c7e-2b1d0e3f4a5b"
        ])
    );
    snap!(
        s,
        "error_acknowledge_unknown",
        s.rvc(&[
            "storage",
            "acknowledge",
            "01a233bb-db10-7210-ae1b-edcc39797697",
            "--note",
            "x"
        ])
    );
    snap!(
        s,
        "error_unknown_command",
        s.rvc(&["stat", "web-1", "01a233bb-db10-7210-ae1b-edcc39797699"])
    );
    snap!(s, "error_bad_uuid", s.rvc(&["follow", "not-a-uuid"]));
    snap!(
        s,
        "error_bad_signal",
        s.rvc(&["kill", "STOP", "web-1", &long_uuid])
    );
    snap!(
        s,
        "error_bad_env",
        s.rvc(&["run", "--env", "NOEQUALS", "web-1", "true"])
    );
    let id = "01a233bb-db10-7210-ae1b-edcc39797698";
    let _ = s.rvc(&["run", "--background", "--request-id", id, "web-1", "true"]);
    snap!(
        s,
        "error_request_conflict",
        s.rvc(&["run", "--background", "--request-id", id, "web-1", "false"])
    );
    // stored output by pages
    // (its own command, last, so no listing above shows it; the pause
    // orders the two streams, which are two pipes)
    let two = s.rvc(&["run", "web-1", "echo out; sleep 0.3; echo err >&2; exit 5"]);
    let fg_uuid = support::issue_of(&two);
    snap!(s, "output", s.rvc(&["output", "web-1", &fg_uuid]));
    snap!(
        s,
        "output_stderr_timestamped",
        s.rvc(&[
            "output",
            "--stream",
            "stderr",
            "--timestamped",
            "web-1",
            &fg_uuid
        ])
    );
    snap!(
        s,
        "output_page",
        s.rvc(&["output", "--max-bytes", "2", "web-1", &fg_uuid])
    );
    snap!(
        s,
        "output_follow",
        s.rvc(&[
            "output",
            "--follow",
            "--max-bytes",
            "2",
            "--timestamped",
            "web-1",
            &fg_uuid
        ])
    );
    snap!(
        s,
        "output_json",
        s.rvc(&["-o", "json", "output", "web-1", &fg_uuid])
    );

    let no_server = support::bin("rvc");
    let out = std::process::Command::new(no_server)
        .env("RVC_SOCKET", s.dir.path().join("nowhere.sock"))
        .args(["stat"])
        .output()
        .unwrap();
    snap!(s, "error_no_server", out);
    // several sockets (replicas), none of them there: said at once
    let out = std::process::Command::new(support::bin("rvc"))
        .env(
            "RVC_SOCKET",
            format!(
                "{},{}",
                s.dir.path().join("a.sock").display(),
                s.dir.path().join("b.sock").display()
            ),
        )
        .args(["stat"])
        .output()
        .unwrap();
    snap!(s, "error_no_replica", out);
}
