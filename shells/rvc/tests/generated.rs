//! rvc's generated surface without a server: shell completions and the manual
//! page generated from its argument definitions, and help that reads at
//! 80 columns.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::process::{Command, Output};

fn rvc(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rvc"))
        .args(args)
        .env_remove("RVC_SOCKET")
        .env("COLUMNS", "80")
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

const SUBCOMMANDS: [&str; 10] = [
    "run",
    "output",
    "append",
    "close-stdin",
    "follow",
    "stat",
    "list",
    "kill",
    "completions",
    "man",
];

#[test]
fn completions_are_generated_for_bash_zsh_and_fish() {
    let bash = stdout(&rvc(&["completions", "bash"]));
    for sub in SUBCOMMANDS {
        assert!(bash.contains(sub), "bash completion lacks {sub}");
    }
    assert!(bash.contains("--background"), "flags are completed too");
    // the script is valid bash and registers a completion for rvc
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("rvc.bash");
    std::fs::write(&script, &bash).unwrap();
    let check = Command::new("bash")
        .arg("-c")
        .arg(format!("source {} && complete -p rvc", script.display()))
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{}",
        String::from_utf8_lossy(&check.stderr)
    );
    assert!(String::from_utf8_lossy(&check.stdout).contains("rvc"));

    let zsh = stdout(&rvc(&["completions", "zsh"]));
    assert!(
        zsh.starts_with("#compdef rvc"),
        "{}",
        &zsh[..zsh.len().min(80)]
    );
    let fish = stdout(&rvc(&["completions", "fish"]));
    assert!(fish.contains("complete -c rvc"), "fish completion");
    for sub in SUBCOMMANDS {
        assert!(zsh.contains(sub) && fish.contains(sub), "{sub}");
    }

    let refused = rvc(&["completions", "tcsh"]);
    assert_eq!(
        refused.status.code(),
        Some(2),
        "an unknown shell is a usage error"
    );
    assert!(String::from_utf8_lossy(&refused.stderr).contains("tcsh"));
}

#[test]
fn the_manual_page_is_roff_and_names_every_command() {
    let man = stdout(&rvc(&["man"]));
    assert!(man.starts_with(".ie") || man.contains(".TH rvc"), "roff");
    assert!(man.contains(".TH rvc"), "a title header");
    for sub in SUBCOMMANDS {
        // roff escapes a hyphen
        assert!(
            man.contains(&sub.replace('-', "\\-")),
            "the manual lacks {sub}"
        );
    }
}

#[test]
fn help_reads_at_80_columns() {
    let mut pages = vec![vec!["--help"]];
    for sub in SUBCOMMANDS {
        pages.push(vec![sub, "--help"]);
    }
    for sub in ["incidents", "repair", "acknowledge"] {
        pages.push(vec!["storage", sub, "--help"]);
    }
    for sub in ["show", "takeover"] {
        pages.push(vec!["client", sub, "--help"]);
    }
    for args in pages {
        let help = stdout(&rvc(&args));
        for line in help.lines() {
            assert!(
                line.chars().count() <= 80,
                "`rvc {}` has a line of {} columns: {line:?}",
                args.join(" "),
                line.chars().count()
            );
        }
    }
}

#[test]
fn no_color_turns_off_the_styling_on_a_terminal() {
    // `script` (util-linux) gives rvc a terminal, where help and usage
    // errors are styled; NO_COLOR turns that off
    let on_terminal = |env: &str, args: &str| -> String {
        let line = format!("env {env} {} {args}", env!("CARGO_BIN_EXE_rvc"));
        let out = Command::new("script")
            .args(["-qc", &line, "/dev/null"])
            .env_remove("NO_COLOR")
            .output()
            .expect("script(1) from util-linux");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(
        on_terminal("-u NO_COLOR", "--help").contains('\x1b'),
        "help is styled on a terminal"
    );
    for args in ["--help", "run --help", "no-such-command"] {
        let out = on_terminal("NO_COLOR=1", args);
        assert!(!out.is_empty(), "rvc {args} printed nothing");
        assert!(
            !out.contains('\x1b'),
            "rvc {args} styled despite NO_COLOR: {out:?}"
        );
    }
}
