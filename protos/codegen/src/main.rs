//! `rvbox-codegen`: writes or checks the generated Rust code of the RVBox
//! protos. `generate` writes the checked-in files; `check` regenerates into
//! a temporary directory and exits non-zero naming each stale file.

use std::process::ExitCode;

const USAGE: &str = "usage: rvbox-codegen <generate|check>";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let root = rvbox_codegen::repo_root();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["generate"] => match rvbox_codegen::generate(&root) {
            Ok(written) => {
                for path in written {
                    println!(
                        "wrote {}",
                        path.strip_prefix(&root).unwrap_or(&path).display()
                    );
                }
                ExitCode::SUCCESS
            }
            Err(err) => {
                eprintln!("rvbox-codegen generate: {err}");
                ExitCode::FAILURE
            }
        },
        ["check"] => {
            let scratch = match tempdir() {
                Ok(dir) => dir,
                Err(err) => {
                    eprintln!("rvbox-codegen check: {err}");
                    return ExitCode::FAILURE;
                }
            };
            let result = rvbox_codegen::stale_files(&root, &scratch);
            // Best effort: a leftover scratch directory in the OS temp dir is harmless.
            let _ = std::fs::remove_dir_all(&scratch);
            match result {
                Ok(stale) if stale.is_empty() => {
                    println!("generated code is fresh");
                    ExitCode::SUCCESS
                }
                Ok(stale) => {
                    for path in stale {
                        eprintln!("stale: {}", path.display());
                    }
                    eprintln!("run scripts/generate and commit the result");
                    ExitCode::FAILURE
                }
                Err(err) => {
                    eprintln!("rvbox-codegen check: {err}");
                    ExitCode::FAILURE
                }
            }
        }
        _ => {
            eprintln!("{USAGE}");
            ExitCode::from(2)
        }
    }
}

/// A fresh private scratch directory under the OS temp dir (the binary has
/// no tempfile dependency; the name carries the PID and a timestamp).
fn tempdir() -> std::io::Result<std::path::PathBuf> {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let dir = std::env::temp_dir().join(format!("rvbox-codegen-{}-{nanos}", std::process::id()));
    std::fs::create_dir(&dir)?;
    Ok(dir)
}
