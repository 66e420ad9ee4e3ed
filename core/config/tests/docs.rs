#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
// These tests read (and, when asked, regenerate) the repository's
// documentation files; core/ production code never touches files.
#![allow(clippy::disallowed_methods)]
//! The annotated examples and the reference documentation against the key
//! registry (plan §4.3: both examples parse to the compiled defaults).

mod support;

use std::collections::BTreeSet;

use rvbox_config::registry::{
    CLIENT_KEYS, DefaultValue, IO_RULE_KEYS, KeyDef, Kind, Limit, PROFILE_KEYS, SERVER_KEYS, Zero,
};
use rvbox_config::units::{format_bytes, format_duration};
use rvbox_config::{Daemon, load_client, load_server};
use support::{FakeHost, workspace_root};

fn read(rel: &str) -> String {
    std::fs::read_to_string(workspace_root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// `section.key` of every `key = value` line (also `# key = value` when
/// `commented` is set), tracking `[section]` headers.
fn keys_in_example(text: &str, commented: bool) -> BTreeSet<String> {
    let mut section = String::new();
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let mut l = line.trim();
        if commented && let Some(rest) = l.strip_prefix("# ") {
            l = rest;
        }
        if let Some(rest) = l.strip_prefix('[') {
            section = rest.trim_end_matches(']').to_owned();
            continue;
        }
        if let Some((key, _)) = l.split_once(" = ")
            && !key.starts_with('#')
            && !section.starts_with("profiles")
        {
            out.insert(format!("{section}.{key}"));
        }
    }
    out
}

#[test]
fn server_example_parses_to_the_compiled_defaults() {
    let host = FakeHost::standard();
    let text = read("docs/examples/server.toml");
    let from_example = load_server("x", &text, &[], &host).unwrap_or_else(|e| panic!("{e}"));
    let defaults = load_server("x", "", &[], &host).unwrap();
    assert_eq!(from_example, defaults);
    let expected: BTreeSet<String> = SERVER_KEYS.iter().map(|k| k.path.to_owned()).collect();
    assert_eq!(
        keys_in_example(&text, false),
        expected,
        "every server key is set in the example"
    );
}

#[test]
fn client_example_parses_to_the_compiled_defaults() {
    let host = FakeHost::standard();
    let text = read("docs/examples/client.toml");
    let from_example = load_client("x", &text, &[], &host).unwrap_or_else(|e| panic!("{e}"));
    let defaults = load_client("x", "", &[], &host).unwrap();
    assert_eq!(from_example, defaults);
    let expected: BTreeSet<String> = CLIENT_KEYS.iter().map(|k| k.path.to_owned()).collect();
    // client_id defaults to the host name, so the example shows it commented.
    assert_eq!(
        keys_in_example(&text, true),
        expected,
        "every client key is in the example"
    );
    for key in PROFILE_KEYS.iter().chain(IO_RULE_KEYS) {
        assert!(
            text.contains(&format!("# {} = ", key.path)),
            "profile key {} is shown",
            key.path
        );
    }
}

#[test]
fn reference_documents_every_key_and_flag() {
    let doc = read("docs/configuration.md");
    for key in SERVER_KEYS.iter().chain(CLIENT_KEYS) {
        assert!(
            doc.contains(&format!("`{}`", key.path)),
            "docs/configuration.md lacks `{}`",
            key.path
        );
        assert!(
            doc.contains(&format!("`--{}`", key.flag_name())),
            "docs lack flag --{}",
            key.flag_name()
        );
    }
    for key in PROFILE_KEYS.iter().chain(IO_RULE_KEYS) {
        assert!(
            doc.contains(&format!("`{}`", key.path)),
            "docs lack profile key `{}`",
            key.path
        );
    }
    for phrase in ["plaintext", "unauthenticated", "runtime_dir"] {
        assert!(doc.contains(phrase), "docs must mention {phrase}");
    }
}

// ---- generation of the examples and the reference tables ----

fn default_text(def: &KeyDef) -> String {
    match def.default {
        DefaultValue::Num(n) => match def.kind {
            Kind::Duration => format!("\"{}\"", format_duration(n)),
            Kind::Bytes => format_bytes(n),
            _ => n.to_string(),
        },
        DefaultValue::Bool(b) => b.to_string(),
        DefaultValue::Text(t) => format!("\"{t}\""),
        DefaultValue::List(_) if def.kind == Kind::Labels => "{}".to_owned(),
        DefaultValue::List(items) => {
            let parts: Vec<String> = items.iter().map(|s| format!("\"{s}\"")).collect();
            format!("[{}]", parts.join(", "))
        }
        DefaultValue::HostName => "the host name".to_owned(),
    }
}

fn num(def: &KeyDef, n: u64) -> String {
    match def.kind {
        Kind::Duration => format_duration(n),
        Kind::Bytes => format_bytes(n).replace('"', ""),
        _ => n.to_string(),
    }
}

fn limit_text(def: &KeyDef) -> String {
    let mut parts = Vec::new();
    if def.kind.is_numeric() && def.min > 1 {
        parts.push(format!("at least {}", num(def, def.min)));
    }
    match def.limit {
        Limit::Ceiling(c) => parts.push(format!(
            "v1 ceiling {} (may be lowered, never raised)",
            num(def, c)
        )),
        Limit::Max(m) if def.kind.is_list() => parts.push(format!("at most {m} entries")),
        Limit::Max(m) => parts.push(format!("at most {}", num(def, m))),
        Limit::None => {}
    }
    if def.kind.is_numeric() {
        parts.push(match def.zero {
            Zero::Means(m) => format!("0 means {m}"),
            Zero::Refused => "0 is refused".to_owned(),
        });
    }
    parts.join("; ")
}

/// Wraps text into `# ` comment lines of at most 78 characters.
fn wrap(text: &str) -> String {
    let mut out = String::new();
    let mut line = String::from("#");
    for word in text.split_whitespace() {
        if line.len() + 1 + word.len() > 78 && line.len() > 1 {
            out.push_str(&line);
            out.push('\n');
            line = String::from("#");
        }
        line.push(' ');
        line.push_str(word);
    }
    out.push_str(&line);
    out.push('\n');
    out
}

fn example(daemon: Daemon, header: &str) -> String {
    let mut out = header.to_owned();
    let mut section = "";
    for def in daemon.keys() {
        if def.section() != section {
            section = def.section();
            out.push_str(&format!("\n[{section}]\n"));
        }
        out.push('\n');
        out.push_str(&wrap(def.doc));
        let limit = limit_text(def);
        let mut meta = format!("# Default: {}.", default_text(def));
        if !limit.is_empty() {
            meta.push_str(&format!(" Limit: {limit}."));
        }
        meta.push_str(&format!(" Flag: --{}.", def.flag_name()));
        out.push_str(&wrap(meta.trim_start_matches("# ")));
        if def.default == DefaultValue::HostName {
            out.push_str(&format!("# {} = \"host.example.com\"\n", def.name()));
        } else {
            out.push_str(&format!("{} = {}\n", def.name(), default_text(def)));
        }
    }
    out
}

fn table(daemon: Daemon) -> String {
    let mut out = String::new();
    let mut section = "";
    for def in daemon.keys() {
        if def.section() != section {
            section = def.section();
            out.push_str(&format!(
                "\n### `[{section}]`\n\n| Key | Type | Default | Limit and zero | Flag |\n| --- | --- | --- | --- | --- |\n"
            ));
        }
        out.push_str(&format!(
            "| `{}` | {} | `{}` | {} | `--{}` |\n",
            def.path,
            def.kind.describe(),
            default_text(def).replace('|', "\\|"),
            limit_text(def),
            def.flag_name()
        ));
    }
    out.push('\n');
    section = "";
    for def in daemon.keys() {
        if def.section() != section {
            section = def.section();
            out.push_str(&format!("\n`[{section}]` keys:\n\n"));
        }
        out.push_str(&format!("- `{}`: {}\n", def.path, def.doc));
    }
    out
}

/// Environment variable that makes `generated_docs_are_fresh` rewrite the
/// generated files instead of failing (review the diff before committing).
const REGENERATE: &str = "RVBOX_REGENERATE_DOCS";

/// Replaces the text between `<!-- BEGIN GENERATED {name} -->` and
/// `<!-- END GENERATED {name} -->`.
fn splice(doc: &str, name: &str, body: &str) -> String {
    let begin = format!("<!-- BEGIN GENERATED {name} -->\n");
    let end = format!("<!-- END GENERATED {name} -->");
    let b = doc
        .find(&begin)
        .unwrap_or_else(|| panic!("docs/configuration.md lacks {begin:?}"))
        + begin.len();
    let e = doc
        .find(&end)
        .unwrap_or_else(|| panic!("docs/configuration.md lacks {end:?}"));
    format!("{}{}\n{}", &doc[..b], body.trim_matches('\n'), &doc[e..])
}

/// The examples and the key tables of docs/configuration.md are generated
/// from the registry; this fails when they drift (a key added, a default or
/// a doc line changed) and names the files to regenerate.
#[test]
fn generated_docs_are_fresh() {
    let server_header = read("core/config/tests/data/server-header.toml");
    let client_header = read("core/config/tests/data/client-header.toml");
    let client_tail = read("core/config/tests/data/client-profiles.toml");
    let reference = read("docs/configuration.md");
    let reference = splice(&reference, "server-keys", &table(Daemon::Server));
    let reference = splice(&reference, "client-keys", &table(Daemon::Client));
    let wanted = [
        (
            "docs/examples/server.toml",
            example(Daemon::Server, &server_header),
        ),
        (
            "docs/examples/client.toml",
            example(Daemon::Client, &client_header) + &client_tail,
        ),
        ("docs/configuration.md", reference),
    ];
    let regenerate = std::env::var_os(REGENERATE).is_some();
    let mut stale = Vec::new();
    for (rel, text) in wanted {
        if read(rel) != text {
            if regenerate {
                std::fs::write(workspace_root().join(rel), text).unwrap();
            } else {
                stale.push(rel);
            }
        }
    }
    assert!(
        stale.is_empty(),
        "generated documentation is stale: {stale:?}; run `{REGENERATE}=1 cargo test -p rvbox-config --test docs` and review the diff"
    );
}
