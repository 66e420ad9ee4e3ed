//! Configuration errors: every one names the key and where its value came
//! from (file line and column, a flag, or the compiled default).

use std::fmt;

/// Where a configuration value (or an error about it) comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// The compiled default.
    Default,
    /// The configuration file, at a 1-based line and column.
    File {
        /// 1-based line.
        line: u32,
        /// 1-based column (in characters).
        column: u32,
    },
    /// A command-line flag, e.g. `--storage-data-dir`.
    Flag(String),
}

/// One configuration error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.render(None))]
pub struct ConfigError {
    /// Dotted key path, e.g. `storage.data_dir`; `toml` for syntax errors.
    pub key: String,
    /// Where the offending value came from.
    pub origin: Origin,
    /// What is wrong, in operator terms.
    pub message: String,
}

impl ConfigError {
    /// Creates an error.
    pub fn new(key: impl Into<String>, origin: Origin, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            origin,
            message: message.into(),
        }
    }

    /// Renders the error as one line. With a source name, file errors read
    /// `source:line:col: key: message`, other errors `source: key: message`
    /// (flag errors add the flag: `source: --flag: key: message`).
    pub fn render(&self, source: Option<&str>) -> String {
        let prefix = match (&self.origin, source) {
            (Origin::File { line, column }, Some(src)) => format!("{src}:{line}:{column}: "),
            (Origin::File { line, column }, None) => format!("{line}:{column}: "),
            (Origin::Flag(flag), Some(src)) => format!("{src}: {flag}: "),
            (Origin::Flag(flag), None) => format!("{flag}: "),
            (Origin::Default, Some(src)) => format!("{src}: "),
            (Origin::Default, None) => String::new(),
        };
        format!("{prefix}{}: {}", self.key, self.message)
    }

    /// The 1-based line of a file error.
    pub fn line(&self) -> Option<u32> {
        match self.origin {
            Origin::File { line, .. } => Some(line),
            _ => None,
        }
    }
}

/// Every error found in one configuration (validation never stops at the
/// first one).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConfigErrors {
    /// The errors, in the order found (file order first, then invariants).
    pub errors: Vec<ConfigError>,
}

impl ConfigErrors {
    /// True when nothing went wrong.
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// Adds one error.
    pub fn push(&mut self, error: ConfigError) {
        self.errors.push(error);
    }

    /// True when some error is about `key`.
    pub fn mentions(&self, key: &str) -> bool {
        self.errors.iter().any(|e| e.key == key)
    }

    /// Renders every error, one per line, prefixed with `source`.
    pub fn render(&self, source: &str) -> String {
        let mut out = String::new();
        for error in &self.errors {
            out.push_str(&error.render(Some(source)));
            out.push('\n');
        }
        out
    }
}

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, error) in self.errors.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// Maps a byte offset in `text` to a 1-based line and column (columns count
/// characters). Offsets past the end clamp to the end.
pub(crate) fn line_col(text: &str, offset: usize) -> (u32, u32) {
    let mut end = offset.min(text.len());
    while end > 0 && !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = text.get(..end).unwrap_or("");
    let line = before.bytes().filter(|b| *b == b'\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before.get(line_start..).map_or(0, |s| s.chars().count()) + 1;
    (
        u32::try_from(line).unwrap_or(u32::MAX),
        u32::try_from(column).unwrap_or(u32::MAX),
    )
}

/// The file origin of a byte span.
pub(crate) fn file_origin(text: &str, span: &std::ops::Range<usize>) -> Origin {
    let (line, column) = line_col(text, span.start);
    Origin::File { line, column }
}
