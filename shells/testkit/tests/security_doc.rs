#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! docs/security.md cites its evidence as `path.rs` followed by test
//! names; each cited test must exist in the file it is cited from, so the
//! review cannot point at a test that was renamed or removed.

use std::path::Path;

/// The backticked spans of `text`, in order.
fn spans(text: &str) -> Vec<&str> {
    text.split('`').skip(1).step_by(2).collect()
}

/// A test function's name: lower case, digits and at least three
/// underscores (shorter snake-case words in the text are field or key
/// names, not tests).
fn is_test_name(s: &str) -> bool {
    s.chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        && s.matches('_').count() >= 3
}

#[test]
fn every_test_the_security_review_cites_exists_where_it_says() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/security.md")).unwrap();
    let mut cited = 0usize;
    let mut missing = Vec::new();
    // only the evidence: each "**Tests.**" paragraph group up to the next
    // bold lead or section
    for part in doc.split("**Tests.**").skip(1) {
        let end = ["\n**", "\n## "]
            .iter()
            .filter_map(|m| part.find(m))
            .min()
            .unwrap_or(part.len());
        let mut file: Option<String> = None;
        for span in spans(&part[..end]) {
            if span.ends_with(".rs") {
                file = Some(span.to_owned());
            } else if is_test_name(span) {
                let f = file
                    .as_ref()
                    .unwrap_or_else(|| panic!("`{span}` is cited before any file"));
                let source = std::fs::read_to_string(root.join(f))
                    .unwrap_or_else(|e| panic!("docs/security.md cites {f}: {e}"));
                cited += 1;
                if !source.contains(&format!("fn {span}(")) {
                    missing.push(format!("{f}: {span}"));
                }
            }
        }
    }
    assert!(
        cited > 50,
        "only {cited} tests cited: is the format still `file`, `test`?"
    );
    assert!(
        missing.is_empty(),
        "docs/security.md cites tests that do not exist:\n{}",
        missing.join("\n")
    );
}
