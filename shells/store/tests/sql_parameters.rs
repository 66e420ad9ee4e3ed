#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]
//! SQL is built only from parameters (plan §11.3, R-11.3-04): a scan of
//! every crate that issues SQL (`shells/store`, `shells/store-pg`,
//! `shells/client-store`, `shells/storage`; test modules left out).
//!
//! 1. Every SQL call site (`execute`, `execute_cached`, `query_row`,
//!    `prepare_cached`, `batch_execute`, ... with the argument count of
//!    the SQL-taking form) takes its SQL text from a string literal, a
//!    `concat!`/`include_str!`, a `const`, a checked `format!`, or a
//!    local binding (`let`, `for`, `if`/`match` arms) to one of those; a
//!    `&'static str` parameter, or a `&str` parameter of a function whose
//!    every call passes one of those (followed to its callers).
//! 2. Every `format!` whose text looks like SQL, and every `format!` a
//!    call site takes, interpolates only names from
//!    [`ALLOWED_INTERPOLATIONS`] (each checked to be a `const`), locals
//!    bound to constant text as above, or one of the few
//!    [`REVIEWED_INTERPOLATIONS`] (each with the reason it is safe).
//! 3. Nothing is leaked into a `&'static str` (`leak(`), which would let
//!    runtime text pass as static. That is what makes a `&'static str`
//!    parameter trustworthy: `store-pg`'s prepared-statement helpers
//!    (`prep::query`, `prep::execute`, ...) take their SQL as
//!    `&'static str`, so the compiler checks their callers.
//!
//! A failure names `file:line` and what was found.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The crates that issue SQL, relative to the workspace root.
const CRATES: [&str; 4] = [
    "shells/store/src",
    "shells/store-pg/src",
    "shells/client-store/src",
    "shells/storage/src",
];

/// Constants a SQL `format!` may interpolate: column lists, channel
/// names and tuning numbers, all compile-time text. Each must be declared
/// as a `const` in the scanned crates.
const ALLOWED_INTERPOLATIONS: &[&str] = &[
    "VIEW_COLUMNS",
    "RECORD_COLUMNS",
    "RUN_COLUMNS",
    "TARGET_COLUMNS",
    "CLIENT_COLUMNS",
    "COLUMNS",
    "REMOVED_COLUMNS",
    "SELECT",
    "TARGET_SELECT",
    "WRITER_CACHE_KIB",
    "IDLE_IN_TRANSACTION",
    "CLIENT_CHANNEL",
    "COMMAND_CHANNEL",
    "FLEET_CHANNEL",
    "HEARTBEAT_CHANNEL",
    "WRITER_FALLBACK_PAGES",
    "MAX_LISTED",
];

/// Interpolations that are not constants, each reviewed: (file, the
/// interpolated expression without spaces, why it cannot carry a value
/// from outside). An entry that no longer matches anything fails too.
const REVIEWED_INTERPOLATIONS: &[(&str, &str, &str)] = &[
    (
        "shells/store/src/recovery.rs",
        "table.replace('\"',\"\\\"\\\"\")",
        "a table name read from sqlite_schema of the store's own database, quoted as an identifier (PRAGMA takes no parameters)",
    ),
    (
        "shells/storage/src/db.rs",
        "opts.synchronous.name()",
        "the fixed name of a Synchronous enum variant (FULL or EXTRA); PRAGMA takes no parameters",
    ),
];

/// Functions that return a statement prepared from their SQL argument
/// (file, function): a binding to their result is a prepared statement
/// whose text the SQL call site inside them is checked for.
const STATEMENT_SOURCES: &[(&str, &str)] = &[("shells/store-pg/src/lib.rs", "stmt")];

/// Method name, and the fewest arguments of its SQL-taking form (the
/// statement forms, `stmt.execute(params)` or `stmt.query_row(params, f)`,
/// take one fewer and carry no SQL).
const SQL_CALLS: &[(&str, usize)] = &[
    ("prepare", 1),
    ("prepare_cached", 1),
    ("execute_batch", 1),
    ("batch_execute", 1),
    ("simple_query", 1),
    ("copy_in", 1),
    ("copy_out", 1),
    ("execute", 2),
    ("execute_cached", 2),
    ("query", 2),
    ("query_one", 2),
    ("query_opt", 2),
    ("query_raw", 2),
    ("execute_raw", 2),
    ("query_typed", 2),
    ("prepare_typed", 2),
    ("query_row", 3),
    ("query_row_cached", 3),
];

/// Upper-case words that make a `format!` text SQL.
const SQL_WORDS: &[&str] = &[
    "SELECT",
    "INSERT",
    "UPDATE",
    "DELETE",
    "PRAGMA",
    "CREATE",
    "DROP",
    "ALTER",
    "LISTEN",
    "NOTIFY",
    "VACUUM",
    "ATTACH",
    "REINDEX",
    "ANALYZE",
    "SAVEPOINT",
    "ROLLBACK",
    "BEGIN",
    "SET",
    "WHERE",
    "VALUES",
];

// ---------------------------------------------------------------- lexing

#[derive(Debug, Clone, PartialEq, Eq)]
enum Tok {
    Ident(String),
    Str(String),
    Num,
    Char(String),
    Lifetime(String),
    Punct(char),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    line: usize,
}

fn lex(text: &str) -> Vec<Token> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    let mut line = 1;
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    while i < c.len() {
        let ch = c[i];
        if ch == '\n' {
            line += 1;
            i += 1;
        } else if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            loop {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if at(i) == '\n' {
                        line += 1;
                    }
                    assert!(i < c.len(), "unterminated comment");
                    i += 1;
                }
            }
        } else if let Some((end, body)) = raw_string(&c, i) {
            out.push(Token {
                tok: Tok::Str(body.clone()),
                line,
            });
            line += body.matches('\n').count();
            i = end;
        } else if ch == '"' || ((ch == 'b' || ch == 'c') && at(i + 1) == '"') {
            let start_line = line;
            i += if ch == '"' { 1 } else { 2 };
            let mut body = String::new();
            while at(i) != '"' {
                assert!(i < c.len(), "unterminated string");
                if at(i) == '\\' {
                    body.push(at(i));
                    i += 1;
                }
                if at(i) == '\n' {
                    line += 1;
                }
                body.push(at(i));
                i += 1;
            }
            i += 1;
            out.push(Token {
                tok: Tok::Str(body),
                line: start_line,
            });
        } else if ch == '\'' {
            // a char literal ('x', '\n', '\u{..}') or a lifetime ('a)
            if at(i + 1) == '\\' {
                let start = i;
                i += 3;
                while at(i) != '\'' {
                    i += 1;
                }
                i += 1;
                out.push(Token {
                    tok: Tok::Char(c[start..i].iter().collect()),
                    line,
                });
            } else if at(i + 2) == '\'' {
                out.push(Token {
                    tok: Tok::Char(c[i..i + 3].iter().collect()),
                    line,
                });
                i += 3;
            } else {
                let start = i + 1;
                i += 1;
                while at(i).is_alphanumeric() || at(i) == '_' {
                    i += 1;
                }
                out.push(Token {
                    tok: Tok::Lifetime(c[start..i].iter().collect()),
                    line,
                });
            }
        } else if ch.is_alphabetic() || ch == '_' {
            let start = i;
            while at(i).is_alphanumeric() || at(i) == '_' {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(c[start..i].iter().collect()),
                line,
            });
        } else if ch.is_ascii_digit() {
            while at(i).is_alphanumeric()
                || at(i) == '_'
                || (at(i) == '.' && at(i + 1).is_ascii_digit())
            {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Num,
                line,
            });
        } else {
            out.push(Token {
                tok: Tok::Punct(ch),
                line,
            });
            i += 1;
        }
    }
    out
}

/// `r"..."`, `r#"..."#`, `br#"..."#`: the end index and the body.
fn raw_string(c: &[char], i: usize) -> Option<(usize, String)> {
    let mut j = i;
    if c.get(j) == Some(&'b') {
        j += 1;
    }
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let mut hashes = 0;
    while c.get(j) == Some(&'#') {
        hashes += 1;
        j += 1;
    }
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    let start = j;
    loop {
        if c.get(j) == Some(&'"') && (1..=hashes).all(|k| c.get(j + k) == Some(&'#')) {
            return Some((j + 1 + hashes, c[start..j].iter().collect()));
        }
        assert!(j < c.len(), "unterminated raw string");
        j += 1;
    }
}

// ------------------------------------------------------------ structure

fn is_punct(t: &Token, p: char) -> bool {
    t.tok == Tok::Punct(p)
}

fn ident(t: &Token) -> Option<&str> {
    match &t.tok {
        Tok::Ident(s) => Some(s),
        _ => None,
    }
}

/// The index of the bracket closing the one at `open`.
fn close_of(toks: &[Token], open: usize) -> usize {
    let (o, c) = match toks[open].tok {
        Tok::Punct('(') => ('(', ')'),
        Tok::Punct('[') => ('[', ']'),
        Tok::Punct('{') => ('{', '}'),
        ref t => panic!("{t:?} is not an opening bracket"),
    };
    let mut depth = 0usize;
    for (k, t) in toks.iter().enumerate().skip(open) {
        if is_punct(t, o) {
            depth += 1;
        } else if is_punct(t, c) {
            depth -= 1;
            if depth == 0 {
                return k;
            }
        }
    }
    panic!("unbalanced {o} at line {}", toks[open].line);
}

/// The top-level comma-separated ranges of the group `open..=close`.
fn args_of(toks: &[Token], open: usize, close: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = open + 1;
    let mut k = open + 1;
    while k < close {
        match toks[k].tok {
            Tok::Punct('(' | '[' | '{') => k = close_of(toks, k) + 1,
            // a turbofish `::<A, B>` holds commas of its own
            Tok::Punct(':') if is_punct(&toks[k + 1], ':') && is_punct(&toks[k + 2], '<') => {
                let mut depth = 0usize;
                k += 2;
                loop {
                    if is_punct(&toks[k], '<') {
                        depth += 1;
                    } else if is_punct(&toks[k], '>') {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    k += 1;
                }
                k += 1;
            }
            Tok::Punct(',') => {
                out.push((start, k));
                start = k + 1;
                k += 1;
            }
            _ => k += 1,
        }
    }
    if start < close {
        out.push((start, close));
    }
    out
}

/// Tokens with the `#[cfg(test)]` items removed.
fn without_tests(toks: Vec<Token>) -> Vec<Token> {
    let mut out = Vec::new();
    let mut k = 0;
    while k < toks.len() {
        let cfg_test = is_punct(&toks[k], '#')
            && toks.get(k + 1).is_some_and(|t| is_punct(t, '['))
            && toks.get(k + 2).and_then(ident) == Some("cfg")
            && toks.get(k + 3).is_some_and(|t| is_punct(t, '('))
            && toks.get(k + 4).and_then(ident) == Some("test")
            && toks.get(k + 5).is_some_and(|t| is_punct(t, ')'));
        if !cfg_test {
            out.push(toks[k].clone());
            k += 1;
            continue;
        }
        // skip the item: up to its `;` or through its `{ ... }`
        k += 7;
        loop {
            match toks[k].tok {
                Tok::Punct(';') => {
                    k += 1;
                    break;
                }
                Tok::Punct('{') => {
                    k = close_of(&toks, k) + 1;
                    break;
                }
                Tok::Punct('(' | '[') => k = close_of(&toks, k) + 1,
                _ => k += 1,
            }
        }
    }
    out
}

#[derive(Debug, Clone)]
struct Func {
    name: String,
    /// The parameter list `( ... )`, brackets included.
    params: (usize, usize),
    /// The body `{ ... }`, braces included.
    body: (usize, usize),
}

fn functions(toks: &[Token]) -> Vec<Func> {
    let mut out = Vec::new();
    for k in 0..toks.len() {
        if ident(&toks[k]) != Some("fn") {
            continue;
        }
        let Some(name) = toks.get(k + 1).and_then(ident) else {
            continue;
        };
        let Some(p_open) = (k + 2..toks.len()).find(|&j| is_punct(&toks[j], '(')) else {
            continue;
        };
        let p_close = close_of(toks, p_open);
        let mut j = p_close + 1;
        let body = loop {
            match toks.get(j).map(|t| &t.tok) {
                Some(Tok::Punct('{')) => break Some((j, close_of(toks, j))),
                Some(Tok::Punct(';')) | None => break None,
                Some(Tok::Punct('(' | '[')) => j = close_of(toks, j) + 1,
                _ => j += 1,
            }
        };
        if let Some(body) = body {
            out.push(Func {
                name: name.to_owned(),
                params: (p_open, p_close),
                body,
            });
        }
    }
    out
}

struct File {
    rel: String,
    toks: Vec<Token>,
    funcs: Vec<Func>,
}

impl File {
    fn at(&self, k: usize) -> String {
        format!("{}:{}", self.rel, self.toks[k].line)
    }

    /// The innermost function whose body holds `k`.
    fn enclosing(&self, k: usize) -> Option<&Func> {
        self.funcs
            .iter()
            .filter(|f| f.body.0 < k && k < f.body.1)
            .min_by_key(|f| f.body.1 - f.body.0)
    }

    fn text(&self, from: usize, to: usize) -> String {
        self.toks[from..to]
            .iter()
            .map(|t| match &t.tok {
                Tok::Ident(s) => s.clone(),
                Tok::Str(s) => format!("\"{s}\""),
                Tok::Num => "0".into(),
                Tok::Char(c) => c.clone(),
                Tok::Lifetime(l) => format!("'{l}"),
                Tok::Punct(p) => p.to_string(),
            })
            .collect()
    }
}

struct Scan {
    files: Vec<File>,
    /// Every `const NAME` declared in the scanned crates.
    consts: BTreeSet<String>,
    /// Fields declared `name: &'static str`.
    static_fields: BTreeSet<String>,
    reviewed_used: BTreeSet<usize>,
    failures: Vec<String>,
    /// SQL call sites and SQL `format!`s examined.
    sites: usize,
    formats: usize,
}

type Check = Result<(), String>;

impl Scan {
    fn load(root: &Path) -> Self {
        let mut files = Vec::new();
        for dir in CRATES {
            let mut stack = vec![root.join(dir)];
            let mut paths: Vec<PathBuf> = Vec::new();
            while let Some(d) = stack.pop() {
                for e in std::fs::read_dir(&d).unwrap() {
                    let p = e.unwrap().path();
                    if p.is_dir() {
                        stack.push(p);
                    } else if p.extension().is_some_and(|x| x == "rs") {
                        paths.push(p);
                    }
                }
            }
            paths.sort();
            for p in paths {
                let text = std::fs::read_to_string(&p).unwrap();
                let toks = without_tests(lex(&text));
                let funcs = functions(&toks);
                let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
                files.push(File { rel, toks, funcs });
            }
        }
        let mut consts = BTreeSet::new();
        let mut static_fields = BTreeSet::new();
        for f in &files {
            for (k, t) in f.toks.iter().enumerate() {
                if ident(t) == Some("const")
                    && let Some(name) = f.toks.get(k + 1).and_then(ident)
                    && f.toks.get(k + 2).is_some_and(|t| is_punct(t, ':'))
                {
                    consts.insert(name.to_owned());
                }
                // `name: &'static str` outside a parameter list
                if let Some(name) = ident(t)
                    && f.toks.get(k + 1).is_some_and(|t| is_punct(t, ':'))
                    && f.toks.get(k + 2).is_some_and(|t| is_punct(t, '&'))
                    && f.toks.get(k + 3).map(|t| &t.tok) == Some(&Tok::Lifetime("static".into()))
                    && f.toks.get(k + 4).and_then(ident) == Some("str")
                    && !f.funcs.iter().any(|g| g.params.0 < k && k < g.params.1)
                {
                    static_fields.insert(name.to_owned());
                }
            }
        }
        Self {
            files,
            consts,
            static_fields,
            reviewed_used: BTreeSet::new(),
            failures: Vec::new(),
            sites: 0,
            formats: 0,
        }
    }

    /// Checks that tokens `from..to` of file `fi` are constant SQL text.
    fn constant(&mut self, fi: usize, from: usize, to: usize, depth: u32) -> Check {
        if depth > 8 {
            return Err("too many bindings to follow".into());
        }
        let f = &self.files[fi];
        let (mut a, mut b) = (from, to);
        // `&x`, `x.as_str()`, `x?`
        while a < b && is_punct(&f.toks[a], '&') {
            a += 1;
        }
        loop {
            if b >= a + 4
                && is_punct(&f.toks[b - 4], '.')
                && matches!(ident(&f.toks[b - 3]), Some("as_str" | "as_ref"))
                && is_punct(&f.toks[b - 2], '(')
                && is_punct(&f.toks[b - 1], ')')
            {
                b -= 4;
            } else if b > a && is_punct(&f.toks[b - 1], '?') {
                b -= 1;
            } else {
                break;
            }
        }
        if a >= b {
            return Err("an empty expression".into());
        }
        let first = f.toks[a].tok.clone();
        let n = b - a;
        match first {
            Tok::Str(_) if n == 1 => Ok(()),
            Tok::Num if n == 1 => Ok(()),
            Tok::Punct('(') if close_of(&f.toks, a) == b - 1 => {
                self.constant(fi, a + 1, b - 1, depth)
            }
            Tok::Ident(ref m)
                if n >= 3
                    && is_punct(&f.toks[a + 1], '!')
                    && matches!(m.as_str(), "concat" | "include_str" | "format")
                    && close_of(&f.toks, a + 2) == b - 1 =>
            {
                if m == "format" {
                    self.format(fi, a + 2, depth)
                } else {
                    // the language allows only literals (and macros that
                    // expand to literals) here
                    Ok(())
                }
            }
            Tok::Ident(ref kw) if kw == "if" => self.branches_of_if(fi, a, b, depth),
            Tok::Ident(ref kw) if kw == "match" => self.arms_of_match(fi, a, b, depth),
            Tok::Ident(ref name) if n == 1 => self.binding(fi, a, name, depth),
            Tok::Ident(_)
                if n == 3 && is_punct(&f.toks[a + 1], '.') && ident(&f.toks[a + 2]).is_some() =>
            {
                let field = ident(&f.toks[a + 2]).unwrap_or_default().to_owned();
                if self.static_fields.contains(&field) {
                    Ok(())
                } else {
                    Err(format!("field `{field}` is not declared `&'static str`"))
                }
            }
            Tok::Punct('[') if close_of(&f.toks, a) == b - 1 => {
                for (x, y) in args_of(&f.toks, a, b - 1) {
                    self.constant(fi, x, y, depth)?;
                }
                Ok(())
            }
            _ => Err(format!("`{}` is not constant text", f.text(a, b))),
        }
    }

    /// `if COND { X } else if .. { Y } else { Z }`: every branch constant.
    fn branches_of_if(&mut self, fi: usize, a: usize, b: usize, depth: u32) -> Check {
        let mut k = a;
        loop {
            let toks = &self.files[fi].toks;
            // the condition ends at the first `{` at depth 0
            let mut j = k + 1;
            while !is_punct(&toks[j], '{') {
                if matches!(toks[j].tok, Tok::Punct('(' | '[')) {
                    j = close_of(toks, j);
                }
                j += 1;
            }
            let end = close_of(toks, j);
            self.constant(fi, j + 1, end, depth)?;
            let toks = &self.files[fi].toks;
            if end + 1 >= b {
                return Err("an `if` without `else` is not a value".into());
            }
            if ident(&toks[end + 1]) != Some("else") {
                return Err("unexpected tokens after an `if` branch".into());
            }
            if ident(&toks[end + 2]) == Some("if") {
                k = end + 2;
                continue;
            }
            let open = end + 2;
            let close = close_of(toks, open);
            if close + 1 != b {
                return Err("unexpected tokens after an `else` branch".into());
            }
            return self.constant(fi, open + 1, close, depth);
        }
    }

    /// `match X { P => E, ... }`: every arm constant.
    fn arms_of_match(&mut self, fi: usize, a: usize, b: usize, depth: u32) -> Check {
        let toks = &self.files[fi].toks;
        let open = (a..b).find(|&j| is_punct(&toks[j], '{')).unwrap();
        if close_of(toks, open) + 1 != b {
            return Err("unexpected tokens after a `match`".into());
        }
        let arms = args_of(toks, open, b - 1);
        for (x, y) in arms {
            let toks = &self.files[fi].toks;
            let arrow = (x..y)
                .find(|&j| is_punct(&toks[j], '=') && is_punct(&toks[j + 1], '>'))
                .ok_or("a match arm without `=>`")?;
            let (mut s, mut e) = (arrow + 2, y);
            if is_punct(&toks[s], '{') && close_of(toks, s) + 1 == e {
                s += 1;
                e -= 1;
            }
            self.constant(fi, s, e, depth)?;
        }
        Ok(())
    }

    /// A `format!` whose group opens at `open`: every interpolation
    /// allowed.
    fn format(&mut self, fi: usize, open: usize, depth: u32) -> Check {
        let toks = &self.files[fi].toks;
        let close = close_of(toks, open);
        let args = args_of(toks, open, close);
        let Some(&(fs, fe)) = args.first() else {
            return Err("format! without arguments".into());
        };
        let Tok::Str(text) = toks[fs].tok.clone() else {
            return Err("format! without a literal format string".into());
        };
        if fe != fs + 1 {
            return Err("format! with a computed format string".into());
        }
        // named arguments `name = expr`, then positional ones
        let mut named: BTreeMap<String, (usize, usize)> = BTreeMap::new();
        let mut positional = Vec::new();
        for &(x, y) in args.iter().skip(1) {
            if let Some(name) = ident(&toks[x])
                && y > x + 2
                && is_punct(&toks[x + 1], '=')
                && !is_punct(&toks[x + 2], '=')
            {
                named.insert(name.to_owned(), (x + 2, y));
            } else {
                positional.push((x, y));
            }
        }
        let mut next = 0usize;
        for hole in holes(&text) {
            let target = if hole.is_empty() {
                next += 1;
                positional.get(next - 1).copied().map(Err)
            } else if let Ok(i) = hole.parse::<usize>() {
                positional.get(i).copied().map(Err)
            } else if let Some(r) = named.get(&hole) {
                Some(Err(*r))
            } else {
                Some(Ok(hole.clone()))
            };
            match target {
                None => return Err(format!("format! hole {{{hole}}} has no argument")),
                Some(Ok(name)) => self.interpolated_name(fi, open, &name, depth)?,
                Some(Err((x, y))) => self.interpolated_expr(fi, x, y, depth)?,
            }
        }
        Ok(())
    }

    /// An inline `{name}`: an allowed constant, or a local bound to
    /// constant text.
    fn interpolated_name(&mut self, fi: usize, at: usize, name: &str, depth: u32) -> Check {
        if name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        {
            return if ALLOWED_INTERPOLATIONS.contains(&name) {
                Ok(())
            } else {
                Err(format!(
                    "{{{name}}} is not in ALLOWED_INTERPOLATIONS (add it only if it is a compile-time constant)"
                ))
            };
        }
        self.binding(fi, at, name, depth + 1)
            .map_err(|e| format!("{{{name}}}: {e}"))
    }

    fn interpolated_expr(&mut self, fi: usize, x: usize, y: usize, depth: u32) -> Check {
        let f = &self.files[fi];
        if y == x + 1
            && let Some(name) = ident(&f.toks[x])
        {
            let name = name.to_owned();
            return self.interpolated_name(fi, x, &name, depth);
        }
        // a path to a constant: `crate::module::NAME`
        let path = (x..y).all(|j| ident(&f.toks[j]).is_some() || is_punct(&f.toks[j], ':'));
        if path
            && y > x + 1
            && let Some(last) = ident(&f.toks[y - 1])
        {
            let last = last.to_owned();
            return self.interpolated_name(fi, x, &last, depth);
        }
        let text = f.text(x, y);
        if let Some(i) = REVIEWED_INTERPOLATIONS
            .iter()
            .position(|(file, expr, _)| *file == f.rel && *expr == text)
        {
            self.reviewed_used.insert(i);
            return Ok(());
        }
        Err(format!(
            "`{text}` is interpolated into SQL: pass it as a parameter (or review it into REVIEWED_INTERPOLATIONS)"
        ))
    }

    /// The binding of `name` as seen at token `at`.
    fn binding(&mut self, fi: usize, at: usize, name: &str, depth: u32) -> Check {
        if name
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        {
            return if self.consts.contains(name) {
                Ok(())
            } else {
                Err(format!("`{name}` is not a const of these crates"))
            };
        }
        let f = &self.files[fi];
        let Some(func) = f.enclosing(at).cloned() else {
            return Err(format!("`{name}` is not bound in a function"));
        };
        let toks = &f.toks;
        let stop = |t: &Token| matches!(t.tok, Tok::Punct(';' | '{' | '}'));
        // the nearest binding before `at` in the body
        let mut k = at;
        while k > func.body.0 + 1 {
            k -= 1;
            if ident(&toks[k]) != Some(name) {
                continue;
            }
            // `let [mut] name [: T] = EXPR;`
            let prev = ident(&toks[k - 1]);
            if prev == Some("let") || (prev == Some("mut") && ident(&toks[k - 2]) == Some("let")) {
                let eq = (k..toks.len()).find(|&j| is_assign(toks, j)).unwrap();
                let mut end = eq + 1;
                while !is_punct(&toks[end], ';') {
                    if matches!(toks[end].tok, Tok::Punct('(' | '[' | '{')) {
                        end = close_of(toks, end);
                    }
                    end += 1;
                }
                if let Some(callee) = ident(&toks[eq + 1])
                    && is_punct(&toks[eq + 2], '(')
                    && STATEMENT_SOURCES
                        .iter()
                        .any(|(file, func)| *file == f.rel && *func == callee)
                {
                    return Ok(());
                }
                return self.constant(fi, eq + 1, end, depth + 1);
            }
            // `for PATTERN in EXPR {` with `name` in the pattern
            let for_at = (k.saturating_sub(8)..k)
                .rev()
                .take_while(|&j| !stop(&toks[j]) && ident(&toks[j]) != Some("in"))
                .find(|&j| ident(&toks[j]) == Some("for"));
            let in_at = (k + 1..k + 8)
                .take_while(|&j| !stop(&toks[j]))
                .find(|&j| ident(&toks[j]) == Some("in"));
            if let (Some(_), Some(in_at)) = (for_at, in_at) {
                let mut end = in_at + 1;
                while !is_punct(&toks[end], '{') {
                    if matches!(toks[end].tok, Tok::Punct('(' | '[')) {
                        end = close_of(toks, end);
                    }
                    end += 1;
                }
                return self.constant(fi, in_at + 1, end, depth + 1);
            }
            // a closure parameter: `let c = |.., name: &str, ..|`
            if is_punct(&toks[k + 1], ':')
                && (is_punct(&toks[k - 1], '|') || is_punct(&toks[k - 1], ','))
                && let Some(bar) = (func.body.0..k)
                    .rev()
                    .take_while(|&j| !stop(&toks[j]))
                    .find(|&j| is_punct(&toks[j], '|'))
            {
                if is_static_str(toks, k + 2) {
                    return Ok(());
                }
                if !(is_punct(&toks[bar - 1], '=') && ident(&toks[bar - 3]) == Some("let")) {
                    return Err(format!("`{name}` is a parameter of an unnamed closure"));
                }
                let cname = ident(&toks[bar - 2]).unwrap_or_default().to_owned();
                let index = (bar..k).filter(|&j| is_punct(&toks[j], ',')).count();
                let calls: Vec<(usize, usize)> = (bar..func.body.1)
                    .filter(|&j| {
                        ident(&toks[j]) == Some(cname.as_str()) && is_punct(&toks[j + 1], '(')
                    })
                    .map(|j| (fi, j))
                    .collect();
                return self.callers_pass_constants(&calls, index, depth, &cname);
            }
        }
        // a parameter of the function
        let (p_open, p_close) = func.params;
        let params = args_of(toks, p_open, p_close);
        let mut index = 0usize;
        for &(x, y) in &params {
            let is_self = (x..y).any(|j| ident(&toks[j]) == Some("self"))
                && !(x..y).any(|j| is_punct(&toks[j], ':'));
            if is_self {
                continue;
            }
            if ident(&toks[x]) == Some(name) && is_punct(&toks[x + 1], ':') {
                if is_static_str(toks, x + 2) {
                    return Ok(());
                }
                let borrowed_str = is_punct(&toks[x + 2], '&')
                    && (ident(&toks[x + 3]) == Some("str")
                        || (matches!(toks[x + 3].tok, Tok::Lifetime(_))
                            && ident(&toks[x + 4]) == Some("str")));
                if !borrowed_str {
                    return Err(format!("parameter `{}` is not constant text", f.text(x, y)));
                }
                if SQL_CALLS.iter().any(|(c, _)| *c == func.name) {
                    // an implementation of a SQL call: every call of it
                    // is a call site this test checks
                    return Ok(());
                }
                let calls = self.calls_of(fi, &func.name);
                return self.callers_pass_constants(&calls, index, depth, &func.name);
            }
            index += 1;
        }
        Err(format!("`{name}` has no binding this test can follow"))
    }

    /// Every call `name(` (not its definition) in the crate of file `of`.
    fn calls_of(&self, of: usize, name: &str) -> Vec<(usize, usize)> {
        let krate = crate_of(&self.files[of].rel);
        let mut out = Vec::new();
        for (fi, f) in self.files.iter().enumerate() {
            if crate_of(&f.rel) != krate {
                continue;
            }
            for k in 1..f.toks.len().saturating_sub(1) {
                if ident(&f.toks[k]) == Some(name)
                    && is_punct(&f.toks[k + 1], '(')
                    && ident(&f.toks[k - 1]) != Some("fn")
                {
                    out.push((fi, k));
                }
            }
        }
        out
    }

    fn callers_pass_constants(
        &mut self,
        calls: &[(usize, usize)],
        index: usize,
        depth: u32,
        what: &str,
    ) -> Check {
        if calls.is_empty() {
            return Err(format!(
                "`{what}` takes SQL text but no call of it was found"
            ));
        }
        for &(fi, k) in calls {
            let toks = &self.files[fi].toks;
            let close = close_of(toks, k + 1);
            let args = args_of(toks, k + 1, close);
            let Some(&(x, y)) = args.get(index) else {
                return Err(format!(
                    "{}: a call of `{what}` without its SQL argument",
                    self.files[fi].at(k)
                ));
            };
            let at = self.files[fi].at(k);
            self.constant(fi, x, y, depth + 1)
                .map_err(|e| format!("{at}: `{what}` is given SQL text that {e}"))?;
        }
        Ok(())
    }

    fn run(&mut self) {
        for name in ALLOWED_INTERPOLATIONS {
            if !self.consts.contains(*name) {
                self.failures.push(format!(
                    "ALLOWED_INTERPOLATIONS names `{name}`, which is not a const of these crates"
                ));
            }
        }
        for (file, func) in STATEMENT_SOURCES {
            let found = self
                .files
                .iter()
                .any(|f| f.rel == *file && f.funcs.iter().any(|g| g.name == *func));
            if !found {
                self.failures.push(format!(
                    "STATEMENT_SOURCES names {file} fn {func}, which is gone"
                ));
            }
        }
        for fi in 0..self.files.len() {
            let n = self.files[fi].toks.len();
            for k in 0..n.saturating_sub(2) {
                let toks = &self.files[fi].toks;
                // 3. nothing leaked into a 'static str
                if ident(&toks[k]) == Some("leak") && is_punct(&toks[k + 1], '(') {
                    let at = self.files[fi].at(k);
                    self.failures.push(format!(
                        "{at}: `leak(` makes runtime text `'static`, which this test trusts as constant"
                    ));
                }
                // 1. SQL call sites
                if is_punct(&toks[k], '.')
                    && let Some(m) = ident(&toks[k + 1])
                    && let Some((_, min)) = SQL_CALLS.iter().find(|(c, _)| *c == m)
                    && is_punct(&toks[k + 2], '(')
                {
                    let m = m.to_owned();
                    let close = close_of(toks, k + 2);
                    let args = args_of(toks, k + 2, close);
                    if args.len() >= *min {
                        self.sites += 1;
                        let (x, y) = args[0];
                        if let Err(e) = self.constant(fi, x, y, 0) {
                            let at = self.files[fi].at(x);
                            self.failures
                                .push(format!("{at}: the SQL text of `.{m}(` : {e}"));
                        }
                    }
                }
                // 2. every SQL-looking format!
                let toks = &self.files[fi].toks;
                if ident(&toks[k]) == Some("format")
                    && is_punct(&toks[k + 1], '!')
                    && is_punct(&toks[k + 2], '(')
                    && let Some(Tok::Str(text)) = toks.get(k + 3).map(|t| t.tok.clone())
                    && looks_like_sql(&text)
                    && let Err(e) = {
                        self.formats += 1;
                        self.format(fi, k + 2, 0)
                    }
                {
                    let at = self.files[fi].at(k);
                    self.failures.push(format!("{at}: a SQL format!: {e}"));
                }
            }
        }
        for (i, (file, expr, _)) in REVIEWED_INTERPOLATIONS.iter().enumerate() {
            if !self.reviewed_used.contains(&i) {
                self.failures.push(format!(
                    "REVIEWED_INTERPOLATIONS lists `{expr}` in {file}, which no longer occurs: remove it"
                ));
            }
        }
    }
}

/// `& 'static str` at `k`.
fn is_static_str(toks: &[Token], k: usize) -> bool {
    is_punct(&toks[k], '&')
        && toks.get(k + 1).map(|t| &t.tok) == Some(&Tok::Lifetime("static".into()))
        && toks.get(k + 2).and_then(ident) == Some("str")
}

/// The crate directory a scanned file belongs to.
fn crate_of(rel: &str) -> &str {
    CRATES
        .iter()
        .find(|c| rel.starts_with(*c))
        .copied()
        .unwrap_or_default()
}

/// An assignment `=` at `j` (not `==`, `=>`, `<=`, `>=`, `!=`).
fn is_assign(toks: &[Token], j: usize) -> bool {
    is_punct(&toks[j], '=')
        && !toks
            .get(j + 1)
            .is_some_and(|t| is_punct(t, '=') || is_punct(t, '>'))
        && !toks
            .get(j.wrapping_sub(1))
            .is_some_and(|t| matches!(t.tok, Tok::Punct('=' | '!' | '<' | '>')))
}

/// The `{...}` holes of a format string (`{{` skipped), by name or index
/// (empty for the next positional one).
fn holes(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        if c[i] == '{' {
            if c.get(i + 1) == Some(&'{') {
                i += 2;
                continue;
            }
            let end = (i..c.len()).find(|&j| c[j] == '}').unwrap();
            let inner: String = c[i + 1..end].iter().collect();
            out.push(
                inner
                    .split(':')
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_owned(),
            );
            i = end + 1;
        } else {
            i += 1;
        }
    }
    out
}

fn looks_like_sql(text: &str) -> bool {
    text.split(|c: char| !c.is_ascii_alphabetic())
        .any(|w| SQL_WORDS.contains(&w))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn sql_text_is_built_only_from_literals_and_reviewed_constants() {
    let mut scan = Scan::load(&root());
    assert!(
        scan.files.len() > 40,
        "too few files scanned: {}",
        scan.files.len()
    );
    scan.run();
    eprintln!(
        "{} files, {} SQL call sites, {} SQL format!s",
        scan.files.len(),
        scan.sites,
        scan.formats
    );
    // the scan sees the SQL it is meant to see (a lexer that lost its
    // way would find none and pass)
    assert!(scan.sites > 350, "only {} SQL call sites found", scan.sites);
    assert!(
        scan.formats > 30,
        "only {} SQL format!s found",
        scan.formats
    );
    assert!(
        scan.failures.is_empty(),
        "SQL built from something other than constants:\n{}",
        scan.failures.join("\n")
    );
}

/// The scanner itself: each way a value could reach SQL text is found,
/// and each constant form passes.
#[test]
fn the_scan_finds_values_in_sql_and_passes_constants() {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("shells/store/src");
    std::fs::create_dir_all(&src).unwrap();
    for d in &CRATES[1..] {
        std::fs::create_dir_all(dir.path().join(d)).unwrap();
    }
    let file = |body: &str| {
        std::fs::write(src.join("lib.rs"), body).unwrap();
        let mut s = Scan::load(dir.path());
        s.run();
        s.failures
            .into_iter()
            .filter(|f| {
                !f.contains("ALLOWED_INTERPOLATIONS names")
                    && !f.contains("STATEMENT_SOURCES")
                    && !f.contains("REVIEWED_INTERPOLATIONS lists")
            })
            .collect::<Vec<_>>()
    };
    let good = r#"
        const VIEW_COLUMNS: &str = "a, b";
        const Q: &str = "SELECT 1";
        fn wrapper(c: &Connection, sql: &str) { c.execute_cached(sql, []); }
        fn statics(c: &Connection, sql: &'static str) { c.execute(sql, []); }
        fn ok(c: &Connection, lock: bool, id: &str) {
            c.execute("DELETE FROM t WHERE id = ?1", params![id]);
            c.prepare_cached(&format!("SELECT {VIEW_COLUMNS} FROM t WHERE id = ?1"));
            c.query_row_cached(Q, [], |r| r.get(0));
            let sql = if lock { "SELECT 1 FOR UPDATE" } else { "SELECT 1" };
            c.query_opt(sql, &[&id]);
            let idle = "SELECT id FROM t";
            c.execute_cached(&format!("DELETE FROM t WHERE id IN ({idle})"), []);
            for s in ["DELETE FROM a", "DELETE FROM b"] { c.execute(s, []); }
            wrapper(c, "UPDATE t SET x = 1");
            st.execute(params![id]);
            st.query_row(params![id], |r| r.get(0));
        }
    "#;
    assert_eq!(file(good), Vec::<String>::new());
    let bad = [
        (
            "fn f(c: &Connection, id: &str) { c.execute(&format!(\"DELETE FROM t WHERE id = '{id}'\"), []); }",
            "lib.rs:1",
        ),
        (
            "fn f(c: &Connection, id: &str) {\n let sql = format!(\"SELECT * FROM t WHERE id = '{}'\", id);\n c.query(sql.as_str(), &[]); }",
            "lib.rs:2",
        ),
        (
            "fn wrapper(c: &Connection, sql: &str) { c.execute_cached(sql, []); }\nfn f(c: &Connection, name: String) {\n wrapper(c, &name); }",
            "lib.rs:3",
        ),
        (
            "fn f(c: &Connection, t: &str) { c.execute_batch(&format!(\"DROP TABLE {NOT_ALLOWED}\")); }",
            "NOT_ALLOWED",
        ),
        (
            "fn f(c: &Connection, t: String) { let s: &'static str = t.leak(); c.execute(s, []); }",
            "leak",
        ),
        (
            "fn f(c: &Connection, x: &str) { let text = format!(\"WHERE a = {}\", x.trim()); }",
            "x.trim()",
        ),
    ];
    for (body, want) in bad {
        let failures = file(body);
        assert!(
            failures.iter().any(|f| f.contains(want)),
            "{body}\nshould fail naming {want}: {failures:?}"
        );
    }
}
