#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! Fails when the checked-in generated code differs from what the protos
//! produce now. Fix with `scripts/generate`.

#[test]
fn generated_code_is_fresh() {
    let root = rvbox_codegen::repo_root();
    let scratch = tempfile::tempdir().unwrap();
    let stale = rvbox_codegen::stale_files(&root, scratch.path()).unwrap();
    assert!(
        stale.is_empty(),
        "stale generated files (run scripts/generate): {stale:?}"
    );
}

#[test]
fn generation_is_deterministic() {
    let root = rvbox_codegen::repo_root();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    for dir in [a.path(), b.path()] {
        std::fs::create_dir_all(dir.join("m")).unwrap();
        std::fs::create_dir_all(dir.join("s")).unwrap();
        rvbox_codegen::generate_into(&root, &dir.join("m"), &dir.join("s")).unwrap();
    }
    for sub in ["m", "s"] {
        let x = std::fs::read(a.path().join(sub).join(rvbox_codegen::GENERATED_FILE)).unwrap();
        let y = std::fs::read(b.path().join(sub).join(rvbox_codegen::GENERATED_FILE)).unwrap();
        assert_eq!(x, y, "{sub} output differs between two runs");
    }
}
