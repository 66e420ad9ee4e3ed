#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Registry-generated flags through clap, and the real host probe.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use rvbox_config::registry::{CLIENT_KEYS, SERVER_KEYS};
use rvbox_config::{Daemon, FlagValue, HostProbe, ShellKind, load_client, load_server};
use rvbox_daemon_common::{
    LoadError, MAX_CONFIG_FILE_BYTES, RealHost, daemon_command, given_flags, read_config_file,
};

fn flags(daemon: Daemon, args: &[&str]) -> Vec<FlagValue> {
    let mut argv = vec![daemon.binary()];
    argv.extend_from_slice(args);
    let matches = daemon_command(daemon, "test")
        .try_get_matches_from(argv)
        .unwrap();
    given_flags(&matches, daemon)
}

#[test]
fn every_registry_key_has_exactly_one_flag() {
    for (daemon, keys) in [(Daemon::Server, SERVER_KEYS), (Daemon::Client, CLIENT_KEYS)] {
        let cmd = daemon_command(daemon, "test");
        cmd.clone().debug_assert();
        for def in keys {
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_id() == def.path)
                .unwrap();
            assert_eq!(arg.get_long(), Some(def.flag_name().as_str()));
        }
    }
}

#[test]
fn only_given_flags_are_collected() {
    // default only / file only: no flags at all.
    assert!(flags(Daemon::Server, &[]).is_empty());
    assert!(flags(Daemon::Server, &["--config", "/x.toml"]).is_empty());
    // flag only.
    assert_eq!(
        flags(Daemon::Server, &["--queue-ttl", "30m"]),
        vec![FlagValue::new("queue.ttl", "30m")]
    );
    // repeated list flags keep their order.
    assert_eq!(
        flags(
            Daemon::Client,
            &[
                "--client-server-urls",
                "wss://a/x",
                "--client-server-urls",
                "wss://b/x"
            ]
        ),
        vec![FlagValue {
            key: "client.server_urls".into(),
            values: vec!["wss://a/x".into(), "wss://b/x".into()]
        }]
    );
}

#[test]
fn precedence_through_the_command_line() {
    let host = RealHost;
    let file = "[queue]\nttl = \"20m\"\nmax_total = 5000\n[storage]\ndata_dir = \"/nonexistent/rvbox-test\"\n";
    let load = |args: &[&str]| load_server("f", file, &flags(Daemon::Server, args), &host).unwrap();
    // file value kept when its flag is omitted (another flag given).
    let s = load(&["--queue-max-total", "6000"]);
    assert_eq!(s.queue.ttl, Some(std::time::Duration::from_secs(20 * 60)));
    assert_eq!(s.queue.max_total, 6000);
    // file + flag: flag wins.
    let s = load(&["--queue-ttl", "1h"]);
    assert_eq!(s.queue.ttl, Some(std::time::Duration::from_secs(3600)));
    // default when neither file nor flag sets it.
    assert_eq!(s.queue.max_per_client, 1000);
    // negative values are flag values, refused by the shared parser.
    let errors = load_server(
        "f",
        file,
        &flags(Daemon::Server, &["--queue-ttl", "-5m"]),
        &host,
    )
    .unwrap_err();
    assert!(errors.errors[0].message.contains("negative"));
}

#[test]
fn real_host_path_override_cannot_change_the_shell() {
    // A directory an attacker controls, with a fake `sh` in it, as a
    // command's `PATH=/evil` would point at. Resolution takes no
    // environment; only the configured absolute path counts.
    let evil = tempfile::tempdir().unwrap();
    let fake = evil.path().join("sh");
    std::fs::write(&fake, "#!/bin/true\n").unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let c = load_client("c", "[client]\nclient_id = \"t\"\n", &[], &RealHost).unwrap();
    let sh = c.shells.executable_for(ShellKind::Sh).unwrap();
    assert_eq!(sh.executable(), std::fs::canonicalize("/bin/sh").unwrap());
    assert!(!sh.executable().starts_with(evil.path()));
    sh.revalidate(&RealHost).unwrap();
    // A bare name is refused: there is no PATH search to hijack.
    let errors = load_client(
        "c",
        "[client]\nclient_id = \"t\"\n[shells]\nsh = \"sh\"\n",
        &[],
        &RealHost,
    )
    .unwrap_err();
    assert!(
        errors.errors[0]
            .message
            .contains("never looked up through PATH")
    );
}

#[test]
fn real_host_detects_a_replaced_shell() {
    let dir = tempfile::tempdir().unwrap();
    let shell = dir.path().join("mysh");
    std::fs::copy("/bin/sh", &shell).unwrap();
    std::fs::set_permissions(&shell, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let text = format!(
        "[client]\nclient_id = \"t\"\n[shells]\nbash = \"\"\nsh = \"{}\"\n",
        shell.display()
    );
    let c = load_client("c", &text, &[], &RealHost).unwrap();
    let resolved = c.shells.executable_for(ShellKind::Sh).unwrap();
    resolved.revalidate(&RealHost).unwrap();
    std::fs::remove_file(&shell).unwrap();
    std::fs::write(&shell, "#!/bin/sh\necho replaced\n").unwrap();
    std::fs::set_permissions(&shell, std::fs::Permissions::from_mode(0o755)).unwrap();
    assert!(resolved.revalidate(&RealHost).is_err());
}

#[test]
fn real_host_facts() {
    let host = RealHost;
    assert!(
        host.stat(Path::new("/definitely/not/here"))
            .unwrap()
            .is_none()
    );
    let root = host.stat(Path::new("/")).unwrap().unwrap();
    assert_eq!(root.kind, rvbox_config::FileKind::Dir);
    assert!(host.host_name().is_some());
    let _ = host.current_uid();
}

#[test]
fn config_files_are_read_once_bounded_and_utf8() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.toml");
    assert!(matches!(
        read_config_file(&missing),
        Err(LoadError::Read { .. })
    ));
    let big = dir.path().join("big.toml");
    std::fs::write(
        &big,
        vec![b'#'; usize::try_from(MAX_CONFIG_FILE_BYTES).unwrap() + 1],
    )
    .unwrap();
    let err = read_config_file(&big).unwrap_err();
    assert!(err.to_string().contains("larger than"));
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, b"\xff\xfe").unwrap();
    let err = read_config_file(&bad).unwrap_err();
    assert!(err.to_string().starts_with(&format!("{}: ", bad.display())));
    assert!(err.to_string().contains("UTF-8"));
}

#[test]
fn the_manual_page_is_section_8_and_documents_every_flag() {
    for daemon in [Daemon::Server, Daemon::Client] {
        let mut page = Vec::new();
        rvbox_daemon_common::write_man_page(daemon_command(daemon, "test"), &mut page).unwrap();
        let page = String::from_utf8(page).unwrap();
        assert!(
            page.starts_with(&format!(
                ".ie \\n(.g .ds Aq \\(aq\n.el .ds Aq '\n.TH {} 8 ",
                daemon.binary()
            )),
            "{}",
            page.lines().take(5).collect::<Vec<_>>().join("\n")
        );
        // roff escapes each '-' of a flag
        for flag in ["config", "check\\-config"] {
            assert!(page.contains(&format!("\\-\\-{flag}")), "--{flag} missing");
        }
        for def in daemon.keys() {
            let flag = def.flag_name().replace('-', "\\-");
            assert!(
                page.contains(&format!("\\-\\-{flag}")),
                "--{} missing",
                def.flag_name()
            );
        }
    }
}
