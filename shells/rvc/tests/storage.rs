//! Storage incidents end to end: segment files of a stopped server are
//! damaged on disk, the restarted server records incidents, and the
//! operator lists, repairs and acknowledges them with rvc over the real
//! control socket.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod support;

use std::path::PathBuf;

use support::{Stack, issue_of, text};

/// The segment files of a command, by its UUID.
fn segments_of(s: &Stack, issue: &str) -> Vec<PathBuf> {
    let hex = issue.replace('-', "");
    let mut files: Vec<PathBuf> = std::fs::read_dir(s.dir.path().join("data/segments"))
        .unwrap()
        .map(|d| d.unwrap().path())
        .filter(|d| d.is_dir())
        .flat_map(|d| std::fs::read_dir(d).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&hex) && n.ends_with(".seg"))
        })
        .collect();
    files.sort();
    files
}

/// The id of the one incident whose details name `scope` (the line
/// under its row).
fn incident_for(listing: &str, scope: &str) -> String {
    let lines: Vec<&str> = listing.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        if line.starts_with("  ") && line.contains(scope) && i > 0 {
            return lines[i - 1].split_whitespace().next().unwrap().to_owned();
        }
    }
    panic!("no incident names {scope}:\n{listing}");
}

#[test]
fn a_damaged_segment_is_listed_refused_a_repair_and_acknowledged_and_a_torn_tail_is_repaired() {
    let mut s = Stack::new();
    let run = |s: &Stack, what: &str| {
        let out = s.rvc(&["run", "web-1", &format!("seq 1 2000; echo {what}")]);
        assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
        issue_of(&out)
    };
    let damaged = run(&s, "damaged");
    let torn = run(&s, "torn");
    s.stop_client();
    assert_eq!(s.stop_server(), Some(0), "{}", s.logs());

    // a byte flipped inside the committed records of one command
    let files = segments_of(&s, &damaged);
    assert!(!files.is_empty(), "no segment file for {damaged}");
    let mut bytes = std::fs::read(&files[0]).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    std::fs::write(&files[0], &bytes).unwrap();
    // bytes beyond the committed end of the other's last segment
    let files = segments_of(&s, &torn);
    let last = files.last().unwrap();
    let mut f = std::fs::OpenOptions::new().append(true).open(last).unwrap();
    std::io::Write::write_all(&mut f, &[0x5a; 300]).unwrap();
    drop(f);

    s.start_server();
    // both commands ended, so their segments were verified at seal: a
    // start does not read them again, the background scrub does, in its
    // first slices after ready
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let all = text(&s.rvc(&["storage", "incidents", "--all"]).stdout);
        if all.contains("checksum_mismatch") && all.contains("uncommitted_tail") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the scrub did not find both:\n{all}\n{}",
            s.logs()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let open = s.rvc(&["storage", "incidents"]);
    assert_eq!(open.status.code(), Some(0), "{}", text(&open.stderr));
    let listing = text(&open.stdout);
    assert!(listing.starts_with("INCIDENT"), "{listing}");
    assert!(listing.contains("checksum_mismatch"), "{listing}");
    assert!(listing.contains("data lost"), "{listing}");
    for line in listing.lines() {
        assert!(line.chars().count() <= 80, "{line:?}");
        assert_eq!(line, line.trim_end(), "no trailing blanks");
    }
    support::snapshot(&s, "storage_incidents", &open);
    support::snapshot(
        &s,
        "storage_incidents_json",
        &s.rvc(&["-o", "json", "storage", "incidents"]),
    );
    let bad = incident_for(&listing, &damaged);
    // the torn tail was cut by the scrub: repaired already, so not open
    assert!(!listing.contains("uncommitted_tail"), "{listing}");
    let all = text(&s.rvc(&["storage", "incidents", "--all"]).stdout);
    assert!(all.contains("uncommitted_tail"), "{all}");
    assert!(all.contains("repaired"), "{all}");

    // lost data is never repaired silently: the refusal names what to do
    let refused = s.rvc(&["storage", "repair", &bad]);
    assert_eq!(
        refused.status.code(),
        Some(18),
        "REQUIRES_ACKNOWLEDGEMENT: {}",
        text(&refused.stderr)
    );
    assert!(
        text(&refused.stderr).contains("REQUIRES_ACKNOWLEDGEMENT"),
        "{}",
        text(&refused.stderr)
    );

    // the acknowledgement with its note, replayed with the same
    // request_id: one effect, the same answer
    let id = "01938f7a-0000-7000-8000-000000000001";
    let ack = |s: &Stack| {
        s.rvc(&[
            "storage",
            "acknowledge",
            &bad,
            "--note",
            "restored from backup",
            "--request-id",
            id,
        ])
    };
    support::snapshot(&s, "storage_repair_refused", &refused);
    let first = ack(&s);
    assert_eq!(first.status.code(), Some(0), "{}", text(&first.stderr));
    support::snapshot(&s, "storage_acknowledge", &first);
    support::snapshot(
        &s,
        "storage_acknowledge_json",
        &s.rvc(&[
            "-o",
            "json",
            "storage",
            "acknowledge",
            &bad,
            "--note",
            "restored from backup",
            "--request-id",
            id,
        ]),
    );
    let answer = text(&first.stdout);
    assert!(answer.contains("acknowledged"), "{answer}");
    assert!(answer.contains("note: restored from backup"), "{answer}");
    let again = ack(&s);
    assert_eq!(again.status.code(), Some(0), "{}", text(&again.stderr));
    assert_eq!(text(&again.stdout), answer, "a replay answers the same");
    // a changed request under the same id is refused and does nothing
    let changed = s.rvc(&[
        "storage",
        "acknowledge",
        &bad,
        "--note",
        "another note",
        "--request-id",
        id,
    ]);
    assert_eq!(changed.status.code(), Some(13), "{}", text(&changed.stderr));

    let open = text(&s.rvc(&["storage", "incidents"]).stdout);
    assert_eq!(open.lines().count(), 1, "nothing is open any more: {open}");
    let all = text(&s.rvc(&["storage", "incidents", "--all"]).stdout);
    assert!(all.contains("acknowledged"), "{all}");
    assert!(all.contains("restored from backup"), "{all}");

    // the damaged command's scope serves again: its output reads, with the
    // loss said
    let out = s.rvc(&["follow", &damaged]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("STORAGE_LOSS"),
        "the loss is said: {}",
        text(&out.stderr)
    );
    // the command whose torn tail was cut lost nothing
    let out = s.rvc(&["follow", &torn]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    let want: String = (1..=2000).map(|n| format!("{n}\n")).collect::<String>() + "torn\n";
    assert!(
        text(&out.stdout) == want,
        "the torn command's output is whole"
    );
}
