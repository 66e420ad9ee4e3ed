//! Backup and restore end to end (docs/operations.md, "Backup and
//! restore"): `rvbox-server backup` runs against the live server while a
//! command streams output, `rvbox-server restore` puts it in a new data
//! directory, and a server started there (the original data directory
//! moved away) serves every command and, for the streaming one, exactly a
//! prefix of what the process wrote that holds at least everything
//! acknowledged before the backup began and stops before what it wrote
//! after. A page token of the original server still works (the token key
//! is part of the backup). The command-line refusals: a non-empty target,
//! a directory that is not a backup.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::process::{Command, Output};

use rvbox_testkit::{Stack, bin, issue_of, text};

fn server_tool(args: &[&str], dirs: &[&Path]) -> Output {
    let mut c = Command::new(bin("rvbox-server"));
    c.args(args);
    for d in dirs {
        c.arg(d);
    }
    c.output().unwrap()
}

/// Standard base64 with padding (what the JSON mapping uses for bytes).
fn base64(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => u32::from(c - b'A'),
        b'a'..=b'z' => u32::from(c - b'a') + 26,
        b'0'..=b'9' => u32::from(c - b'0') + 52,
        b'+' => 62,
        b'/' => 63,
        _ => panic!("not base64: {c}"),
    };
    let clean: Vec<u8> = s.bytes().filter(|c| *c != b'=').collect();
    let mut out = Vec::new();
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, c) in chunk.iter().enumerate() {
            n |= val(*c) << (18 - 6 * i);
        }
        let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
        out.extend_from_slice(&bytes[..chunk.len() - 1]);
    }
    out
}

/// Every output byte the server serves for `id` (both streams, in event
/// order), read page by page through `rvc -o json output`; a gap marker
/// fails the test. The flag says whether the log is complete (the
/// command ended and its last event was read).
fn served(s: &Stack, id: &str) -> (Vec<u8>, bool) {
    let (parts, complete) = served_with_gaps(s, id);
    let mut all = Vec::new();
    for part in parts {
        match part {
            Part::Data(d) => all.extend(d),
            Part::Gap(item) => panic!("a gap or marker in {id}: {item}"),
        }
    }
    (all, complete)
}

/// What a page item holds: output bytes, or a gap (a truncation or
/// marker item, as JSON).
enum Part {
    Data(Vec<u8>),
    Gap(serde_json::Value),
}

/// Every page item the server serves for `id`, in order; see [`served`].
fn served_with_gaps(s: &Stack, id: &str) -> (Vec<Part>, bool) {
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let mut args = vec![
            "-o",
            "json",
            "output",
            "web-1",
            id,
            "--max-bytes",
            "4194304",
        ];
        if !token.is_empty() {
            args.extend(["--page", token.as_str()]);
        }
        let out = s.rvc(&args);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        let page: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let items = page["items"].as_array().cloned().unwrap_or_default();
        for item in &items {
            match item.get("data") {
                Some(data) => all.push(Part::Data(base64(
                    data["data"].as_str().unwrap_or_default(),
                ))),
                None => all.push(Part::Gap(item.clone())),
            }
        }
        let next = page["nextPageToken"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        if next.is_empty() {
            return (all, true);
        }
        if items.is_empty() {
            return (all, false);
        }
        token = next;
    }
}

/// Points the stack's server configuration at `data_dir` instead of its
/// own data directory.
fn point_at(s: &Stack, data_dir: &Path) {
    let config = s.dir.path().join("server.toml");
    let data = s.dir.path().join("data");
    let toml = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        toml.replace(
            &format!("data_dir = \"{}\"", data.display()),
            &format!("data_dir = \"{}\"", data_dir.display()),
        ),
    )
    .unwrap();
}

/// The commands `rvc list web-1` shows: (uuid, command text, lifecycle).
fn listed(s: &Stack) -> Vec<(String, String, String)> {
    let out = s.rvc(&["-o", "json", "list", "web-1", "--per-page", "1000"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    v["commands"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            (
                c["issueUuid"].as_str().unwrap().to_owned(),
                c["spec"]["commandText"].as_str().unwrap().to_owned(),
                c["lifecycle"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

fn lifecycle_of(s: &Stack, id: &str) -> String {
    listed(s)
        .into_iter()
        .find(|c| c.0 == id)
        .map(|c| c.2)
        .unwrap_or_default()
}

/// Lines with changing content (so the segments, sealed at 4 KiB, are many), written
/// in bursts for a few seconds, and a copy of everything the process
/// wrote in the work directory (the oracle).
const STREAM: &str = "i=0; while [ $i -lt 6000 ]; do printf 'line %05d %08d %s\\n' $i $((i * 7919 % 99991)) $((i * i % 65521)); i=$((i + 1)); if [ $((i % 40)) -eq 0 ]; then sleep 0.05; fi; done | tee stream.out";

#[test]
fn a_backup_taken_while_a_command_streams_restores_everything_acknowledged_before_it() {
    let mut s = Stack::configured();
    let config = s.dir.path().join("server.toml");
    let toml = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        toml.replace("[storage]\n", "[storage]\nsegment_seal_size = \"4KiB\"\n"),
    )
    .unwrap();
    s.start_server();
    s.start_client();

    let mixed = s.rvc(&["run", "web-1", "echo one; echo two >&2; echo three; exit 3"]);
    assert_eq!(mixed.status.code(), Some(3), "{}", text(&mixed.stderr));
    let mixed = issue_of(&mixed);
    let seq = s.rvc(&["run", "web-1", "seq 1 5000"]);
    assert_eq!(seq.status.code(), Some(0), "{}", text(&seq.stderr));
    let seq = issue_of(&seq);
    // a page token the original server minted
    let first = s.rvc(&["output", "--max-bytes", "10", "web-1", &seq]);
    let token = text(&first.stderr)
        .lines()
        .find_map(|l| l.split_once(" --page ").map(|(_, t)| t.trim().to_owned()))
        .unwrap_or_else(|| panic!("no next page: {}", text(&first.stderr)));

    let bg = s.rvc(&["run", "--background", "web-1", STREAM]);
    assert_eq!(bg.status.code(), Some(0), "{}", text(&bg.stderr));
    let stream = issue_of(&bg);
    s.wait_until("the stream's output is stored", || {
        served(&s, &stream).0.len() > 40_000
    });

    // the backup, against the live server, while the command writes
    let before = served(&s, &stream).0;
    let backup_dir = s.dir.path().join("backup");
    let out = server_tool(
        &["backup", "--config"],
        &[&config, Path::new("--to"), &backup_dir],
    );
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    assert_eq!(
        lifecycle_of(&s, &stream),
        "LIFECYCLE_RUNNING",
        "the command must still stream after the backup"
    );
    // the same target again: refused
    let again = server_tool(
        &["backup", "--data-dir"],
        &[&s.dir.path().join("data"), Path::new("--to"), &backup_dir],
    );
    assert_eq!(again.status.code(), Some(8), "{}", text(&again.stderr));

    // what the process really wrote, and what the original server serves
    s.wait_until_for(
        "the stream ends",
        std::time::Duration::from_secs(60),
        || lifecycle_of(&s, &stream) == "LIFECYCLE_SUCCEEDED",
    );
    let wrote = std::fs::read(s.work().join("stream.out")).unwrap();
    let (full, complete) = served(&s, &stream);
    assert!(complete);
    assert_eq!(full, wrote, "the original server lost output");
    let originals: Vec<(String, Vec<u8>)> = [&mixed, &seq]
        .iter()
        .map(|id| ((*id).clone(), served(&s, id).0))
        .collect();
    assert_eq!(
        originals[1].1,
        (1..=5000)
            .map(|i| format!("{i}\n"))
            .collect::<String>()
            .into_bytes()
    );

    // restore: refused from a directory that is no backup, then done
    let restored = s.dir.path().join("restored");
    let no_backup = server_tool(
        &["restore", "--from"],
        &[&s.work(), Path::new("--data-dir"), &restored],
    );
    assert_eq!(
        no_backup.status.code(),
        Some(7),
        "{}",
        text(&no_backup.stderr)
    );
    let out = server_tool(
        &["restore", "--from"],
        &[&backup_dir, Path::new("--data-dir"), &restored],
    );
    let said = text(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{said}{}", text(&out.stderr));
    assert!(
        said.contains("0 uncommitted tails cut, 0 damaged; integrity check passed"),
        "{said}"
    );
    assert!(said.contains(", 0 damaged, 0 counter mismatches"), "{said}");
    assert!(said.contains("no open storage incidents"), "{said}");
    let into_full = server_tool(
        &["restore", "--from"],
        &[&backup_dir, Path::new("--data-dir"), &restored],
    );
    assert_eq!(
        into_full.status.code(),
        Some(8),
        "{}",
        text(&into_full.stderr)
    );

    // a server on the restored directory alone
    assert_eq!(s.stop_client(), Some(0), "{}", s.logs());
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());
    let data = s.dir.path().join("data");
    std::fs::rename(&data, s.dir.path().join("data.original")).unwrap();
    point_at(&s, &restored);
    s.start_server(); // ready: migrations, recovery and the integrity check passed

    let commands = listed(&s);
    assert_eq!(commands.len(), 3, "{commands:?}");
    for (id, bytes) in &originals {
        assert_eq!(&served(&s, id).0, bytes, "{id}");
    }
    let (restored_stream, complete) = served(&s, &stream);
    assert!(!complete, "the backup holds the stream as running");
    assert_eq!(lifecycle_of(&s, &stream), "LIFECYCLE_RUNNING");
    assert!(
        restored_stream.starts_with(&before),
        "output acknowledged before the backup is missing: {} of {} bytes",
        restored_stream.len(),
        before.len()
    );
    assert!(
        wrote.starts_with(&restored_stream),
        "the restored output is not what the command wrote"
    );
    assert!(
        restored_stream.len() < wrote.len(),
        "output written after the backup cannot be in it"
    );
    // the original server's page token is honoured
    let page = s.rvc(&["output", "web-1", &seq, "--page", &token]);
    assert_eq!(page.status.code(), Some(0), "{}", text(&page.stderr));
    assert!(text(&page.stdout).ends_with("4999\n5000\n"));
    let incidents = s.rvc(&["-o", "json", "storage", "incidents"]);
    let v: serde_json::Value = serde_json::from_slice(&incidents.stdout).unwrap();
    assert!(v["incidents"].as_array().is_none_or(Vec::is_empty), "{v}");
}

/// A command writing a numbered line every 20 ms for about 16 s, and a
/// copy of everything it wrote in the work directory (the oracle).
const SLOW: &str = "i=0; while [ $i -lt 800 ]; do printf 'slow %05d %s\\n' $i $((i * 7919 % 99991)); i=$((i + 1)); sleep 0.02; done | tee slow.out";

/// A client that had output acknowledged after the backup meets the
/// restored server, which lacks it: it is let in, not refused at every
/// connection. The range it had acknowledged is served as an explicit
/// storage-loss gap between the bytes before and after it, an incident
/// with data loss says so, and the command goes on and ends on the
/// restored server with every byte it wrote after the range.
#[test]
fn a_client_ahead_of_a_restored_server_goes_on_with_the_lost_range_recorded() {
    let mut s = Stack::configured();
    let config = s.dir.path().join("server.toml");
    s.start_server();
    s.start_client();

    let bg = s.rvc(&["run", "--background", "web-1", SLOW]);
    assert_eq!(bg.status.code(), Some(0), "{}", text(&bg.stderr));
    let slow = issue_of(&bg);
    s.wait_until("some output is stored", || {
        served(&s, &slow).0.len() > 2_000
    });
    let backup_dir = s.dir.path().join("backup");
    let out = server_tool(
        &["backup", "--config"],
        &[&config, Path::new("--to"), &backup_dir],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let at_backup = served(&s, &slow).0.len();
    let restored = s.dir.path().join("restored");
    let out = server_tool(
        &["restore", "--from"],
        &[&backup_dir, Path::new("--data-dir"), &restored],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    // more output acknowledged by the original server after the backup
    s.wait_until("output after the backup is stored", || {
        served(&s, &slow).0.len() > at_backup + 3_000
    });

    // the original server goes, a server on the restored copy comes; the
    // client and its command stay
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());
    point_at(&s, &restored);
    s.start_server();
    s.wait_until_for(
        "the command ends on the restored server",
        std::time::Duration::from_secs(90),
        || lifecycle_of(&s, &slow) == "LIFECYCLE_SUCCEEDED",
    );

    let wrote = std::fs::read(s.work().join("slow.out")).unwrap();
    let (parts, complete) = served_with_gaps(&s, &slow);
    assert!(complete);
    let mut before = Vec::new();
    let mut after = Vec::new();
    let mut gaps = Vec::new();
    for part in parts {
        match part {
            Part::Data(d) if gaps.is_empty() => before.extend(d),
            Part::Data(d) => after.extend(d),
            Part::Gap(item) => gaps.push(item),
        }
    }
    assert_eq!(gaps.len(), 1, "one gap: {gaps:?}");
    let gap = &gaps[0]["retention"];
    assert_eq!(gap["source"], "TRUNCATION_SOURCE_STORAGE_LOSS", "{gap}");
    assert!(gap.get("incidentId").is_some(), "{gap}");
    assert!(
        before.len() >= 2_000 && wrote.starts_with(&before),
        "the restored prefix: {} bytes",
        before.len()
    );
    assert!(
        !after.is_empty() && wrote.ends_with(&after),
        "the output after the gap is the end of what the command wrote"
    );
    assert!(
        before.len() + after.len() < wrote.len(),
        "the gap stands for bytes"
    );
    let incidents = s.rvc(&["-o", "json", "storage", "incidents"]);
    let v: serde_json::Value = serde_json::from_slice(&incidents.stdout).unwrap();
    let list = v["incidents"].as_array().cloned().unwrap_or_default();
    assert!(
        list.iter()
            .any(|i| i["dataLoss"] == true && i["scopeKey"] == slow.as_str()),
        "{v}"
    );
    // exactly one such incident: the client was let in at once
    assert_eq!(list.len(), 1, "{v}");
    let logs = s.logs();
    assert!(
        !logs.contains("reconciliation snapshot refused"),
        "the client was refused: {logs}"
    );
}
