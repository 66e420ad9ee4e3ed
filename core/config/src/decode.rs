//! Strict decoding of one TOML document against a daemon's key registry,
//! and of flag text with the same value parsers (plan §4.3 items 2-4).
//!
//! Decode-only values live here; the validated structs are built from them
//! in `server.rs` / `client.rs`.

use std::collections::BTreeMap;

use toml::Spanned;
use toml::de::{DeArray, DeTable, DeValue};

use crate::error::{ConfigError, ConfigErrors, Origin, file_origin};
use crate::profiles::ProfileName;
use crate::registry::{self, Daemon, IO_RULE_KEYS, KeyDef, Kind, Limit, PROFILE_KEYS, Zero};
use crate::units::{
    describe_bytes, format_duration, parse_byte_flag, parse_byte_string, parse_count_flag,
    parse_duration,
};

/// A decoded value, before validation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Value {
    /// Milliseconds, bytes or a count.
    Num(u64),
    /// A boolean.
    Bool(bool),
    /// Text (paths, addresses, choices).
    Text(String),
    /// A list of text.
    List(Vec<String>),
}

/// A decoded value and where it came from.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub(crate) value: Value,
    pub(crate) origin: Origin,
}

/// A `[profiles.NAME.io."MAJOR:MINOR"]` rule as written.
#[derive(Debug, Clone)]
pub(crate) struct RawIoRule {
    pub(crate) device: String,
    pub(crate) origin: Origin,
    pub(crate) values: BTreeMap<&'static str, Entry>,
}

/// A `[profiles.NAME]` table as written.
#[derive(Debug, Clone)]
pub(crate) struct RawProfile {
    pub(crate) name: ProfileName,
    pub(crate) origin: Origin,
    pub(crate) values: BTreeMap<&'static str, Entry>,
    pub(crate) io: Vec<RawIoRule>,
}

/// The decoded file: registry keys that were present, plus profiles.
#[derive(Debug, Clone, Default)]
pub(crate) struct RawDoc {
    pub(crate) entries: BTreeMap<&'static str, Entry>,
    pub(crate) profiles: Vec<RawProfile>,
}

/// One explicitly given command-line flag: the registry key it sets and its
/// text value(s). List keys take one element per occurrence; a single empty
/// value sets an empty list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlagValue {
    /// Dotted registry path, e.g. `storage.data_dir`.
    pub key: String,
    /// The text given on the command line, in order.
    pub values: Vec<String>,
}

impl FlagValue {
    /// A flag with one value.
    pub fn new(key: impl Into<String>, value: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            values: vec![value.into()],
        }
    }
}

/// Decodes the file text. Syntax errors stop decoding (after collecting all
/// of them); key and value errors are collected and decoding goes on.
pub(crate) fn decode_file(daemon: Daemon, text: &str, errors: &mut ConfigErrors) -> RawDoc {
    let mut doc = RawDoc::default();
    let (root, parse_errors) = DeTable::parse_recoverable(text);
    if !parse_errors.is_empty() {
        for e in parse_errors {
            errors.push(syntax_error(text, &e));
        }
        return doc;
    }
    let sections = registry::sections(daemon);
    for (key, value) in root.get_ref().iter() {
        let name = key.get_ref().as_ref();
        let origin = file_origin(text, &key.span());
        if daemon == Daemon::Client && name == "profiles" {
            decode_profiles(text, value, &mut doc, errors);
            continue;
        }
        if !sections.contains(&name) {
            let mut known: Vec<&str> = sections.clone();
            if daemon == Daemon::Client {
                known.push("profiles");
            }
            errors.push(ConfigError::new(
                name,
                origin,
                format!("unknown section (known sections: {})", known.join(", ")),
            ));
            continue;
        }
        let Some(table) = value.get_ref().as_table() else {
            errors.push(ConfigError::new(
                name,
                origin,
                format!(
                    "must be a table ([{name}]), found {}",
                    value.get_ref().type_str()
                ),
            ));
            continue;
        };
        for (k, v) in table.iter() {
            let path = format!("{name}.{}", k.get_ref());
            let origin = file_origin(text, &k.span());
            let Some(def) = registry::find(daemon, &path) else {
                let why = registry::removed(daemon, &path).unwrap_or("unknown key");
                errors.push(ConfigError::new(path, origin, why));
                continue;
            };
            match decode_value(def, v.get_ref())
                .and_then(|val| check_range(def, &val).map(|()| val))
            {
                Ok(value) => {
                    doc.entries.insert(def.path, Entry { value, origin });
                }
                Err(message) => {
                    errors.push(ConfigError::new(
                        def.path,
                        file_origin(text, &v.span()),
                        message,
                    ));
                }
            }
        }
    }
    doc
}

fn decode_profiles(
    text: &str,
    value: &Spanned<DeValue<'_>>,
    doc: &mut RawDoc,
    errors: &mut ConfigErrors,
) {
    let Some(table) = value.get_ref().as_table() else {
        errors.push(ConfigError::new(
            "profiles",
            file_origin(text, &value.span()),
            "must be a table of profiles ([profiles.NAME])",
        ));
        return;
    };
    for (k, v) in table.iter() {
        let name_text = k.get_ref().as_ref();
        let path = format!("profiles.{name_text}");
        let origin = file_origin(text, &k.span());
        let Some(name) = ProfileName::parse(name_text) else {
            let known: Vec<&str> = ProfileName::ALL.iter().map(|p| p.as_str()).collect();
            errors.push(ConfigError::new(
                path,
                origin,
                format!("unknown profile (known profiles: {})", known.join(", ")),
            ));
            continue;
        };
        let Some(ptable) = v.get_ref().as_table() else {
            errors.push(ConfigError::new(
                path,
                origin,
                "must be a table ([profiles.NAME])",
            ));
            continue;
        };
        let mut profile = RawProfile {
            name,
            origin,
            values: BTreeMap::new(),
            io: Vec::new(),
        };
        for (pk, pv) in ptable.iter() {
            let key_name = pk.get_ref().as_ref();
            let kpath = format!("{path}.{key_name}");
            let korigin = file_origin(text, &pk.span());
            if key_name == "io" {
                decode_io(text, &kpath, pv, &mut profile, errors);
                continue;
            }
            let Some(def) = PROFILE_KEYS.iter().find(|d| d.path == key_name) else {
                errors.push(ConfigError::new(kpath, korigin, "unknown key"));
                continue;
            };
            match decode_value(def, pv.get_ref())
                .and_then(|val| check_range(def, &val).map(|()| val))
            {
                Ok(value) => {
                    profile.values.insert(
                        def.path,
                        Entry {
                            value,
                            origin: korigin,
                        },
                    );
                }
                Err(message) => {
                    errors.push(ConfigError::new(
                        kpath,
                        file_origin(text, &pv.span()),
                        message,
                    ));
                }
            }
        }
        doc.profiles.push(profile);
    }
}

fn decode_io(
    text: &str,
    path: &str,
    value: &Spanned<DeValue<'_>>,
    profile: &mut RawProfile,
    errors: &mut ConfigErrors,
) {
    let Some(devices) = value.get_ref().as_table() else {
        errors.push(ConfigError::new(
            path,
            file_origin(text, &value.span()),
            "must be a table of device rules ([profiles.NAME.io.\"MAJOR:MINOR\"])",
        ));
        return;
    };
    for (dk, dv) in devices.iter() {
        let device = dk.get_ref().to_string();
        let dpath = format!("{path}.\"{device}\"");
        let origin = file_origin(text, &dk.span());
        let Some(rule_table) = dv.get_ref().as_table() else {
            errors.push(ConfigError::new(
                dpath,
                origin,
                "must be a table of io.max limits",
            ));
            continue;
        };
        let mut rule = RawIoRule {
            device,
            origin,
            values: BTreeMap::new(),
        };
        for (rk, rv) in rule_table.iter() {
            let rname = rk.get_ref().as_ref();
            let rpath = format!("{dpath}.{rname}");
            let rorigin = file_origin(text, &rk.span());
            let Some(def) = IO_RULE_KEYS.iter().find(|d| d.path == rname) else {
                errors.push(ConfigError::new(rpath, rorigin, "unknown key"));
                continue;
            };
            match decode_value(def, rv.get_ref())
                .and_then(|val| check_range(def, &val).map(|()| val))
            {
                Ok(v) => {
                    rule.values.insert(
                        def.path,
                        Entry {
                            value: v,
                            origin: rorigin,
                        },
                    );
                }
                Err(message) => {
                    errors.push(ConfigError::new(
                        rpath,
                        file_origin(text, &rv.span()),
                        message,
                    ));
                }
            }
        }
        profile.io.push(rule);
    }
}

/// Turns a TOML syntax error into a config error. A duplicate key is named
/// with its dotted path.
fn syntax_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let span = e.span().unwrap_or(0..0);
    let origin = file_origin(text, &span);
    let message = e.message().to_owned();
    if message.starts_with("duplicate key") {
        let key_text = text.get(span.clone()).unwrap_or("").trim();
        let path = duplicate_path(text, span.start, key_text);
        // a duplicate of an empty header (`[]`, itself a syntax error) has
        // no name to give: it is reported as the syntax error it is
        if !path.is_empty() {
            return ConfigError::new(
                path,
                origin,
                "duplicate key: a key or table may appear only once",
            );
        }
    }
    ConfigError::new("toml", origin, format!("syntax error: {message}"))
}

/// Best-effort dotted path of a duplicate key: the enclosing table header
/// (the last `[...]` line before it) joined with the key text.
fn duplicate_path(text: &str, offset: usize, key: &str) -> String {
    let before = text.get(..offset.min(text.len())).unwrap_or("");
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let this_line = text
        .get(line_start..)
        .unwrap_or("")
        .lines()
        .next()
        .unwrap_or("");
    if this_line.trim_start().starts_with('[') {
        return header_name(this_line).unwrap_or_else(|| key.to_owned());
    }
    let header = before
        .get(..line_start)
        .unwrap_or("")
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('['))
        .and_then(header_name);
    match header {
        Some(h) if !key.is_empty() => format!("{h}.{key}"),
        Some(h) => h,
        None => key.to_owned(),
    }
}

fn header_name(line: &str) -> Option<String> {
    let trimmed = line.trim().trim_start_matches('[');
    let end = trimmed.find(']')?;
    let name: String = trimmed
        .get(..end)?
        .split('.')
        .map(str::trim)
        .collect::<Vec<_>>()
        .join(".");
    Some(name)
}

/// Decodes one TOML value by the key's kind.
pub(crate) fn decode_value(def: &KeyDef, value: &DeValue<'_>) -> Result<Value, String> {
    match def.kind {
        Kind::Duration => match value {
            DeValue::String(s) => parse_duration(s).map(Value::Num),
            DeValue::Integer(_) | DeValue::Float(_) => Err(
                "durations are strings with a unit, e.g. \"10s\" or \"15m\"; bare numbers are not accepted"
                    .to_owned(),
            ),
            other => Err(format!("expected a duration string such as \"10s\", found {}", other.type_str())),
        },
        Kind::Bytes => match value {
            DeValue::Integer(i) => integer(i).map(Value::Num),
            DeValue::Float(_) => Err(
                "fractional sizes are not allowed; write an integer number of bytes or an IEC string such as \"64KiB\""
                    .to_owned(),
            ),
            DeValue::String(s) => parse_byte_string(s).map(Value::Num),
            other => Err(format!("expected a byte size (integer or \"64KiB\"), found {}", other.type_str())),
        },
        Kind::Count => match value {
            DeValue::Integer(i) => integer(i).map(Value::Num),
            DeValue::String(_) => Err(
                "expected an integer, found a string (strings are never converted to numbers)".to_owned(),
            ),
            other => Err(format!("expected an integer, found {}", other.type_str())),
        },
        Kind::Bool => match value {
            DeValue::Boolean(b) => Ok(Value::Bool(*b)),
            other => Err(format!("expected true or false, found {}", other.type_str())),
        },
        Kind::Choice(choices) => match value {
            DeValue::String(s) => choice(choices, s).map(Value::Text),
            other => Err(format!("expected one of {}, found {}", choices.join(", "), other.type_str())),
        },
        Kind::Text
        | Kind::Path
        | Kind::OptionalPath
        | Kind::SocketAddr
        | Kind::OptionalSocketAddr
        | Kind::ForeignPath => match value {
            DeValue::String(s) => Ok(Value::Text(s.to_string())),
            other => Err(format!("expected a string, found {}", other.type_str())),
        },
        Kind::Labels => match value {
            DeValue::Table(table) => {
                let mut items = BTreeMap::new();
                for (k, v) in table.iter() {
                    match v.get_ref() {
                        DeValue::String(s) => {
                            items.insert(k.get_ref().to_string(), s.to_string());
                        }
                        other => {
                            return Err(format!(
                                "label {:?} must be a string, found {}",
                                k.get_ref(),
                                other.type_str()
                            ));
                        }
                    }
                }
                Ok(Value::List(
                    items.into_iter().map(|(k, v)| format!("{k}={v}")).collect(),
                ))
            }
            other => Err(format!(
                "expected a table of labels such as {{ role = \"web\" }}, found {}",
                other.type_str()
            )),
        },
        Kind::PathList | Kind::UrlList | Kind::TextList => match value {
            DeValue::Array(items) => string_list(items),
            other => Err(format!("expected an array of strings, found {}", other.type_str())),
        },
    }
}

fn integer(i: &toml::de::DeInteger<'_>) -> Result<u64, String> {
    let text = i.as_str();
    if text.starts_with('-') {
        return Err("negative values are not allowed".to_owned());
    }
    u64::from_str_radix(text.trim_start_matches('+'), i.radix())
        .map_err(|_| "value is too large".to_owned())
}

fn string_list(items: &DeArray<'_>) -> Result<Value, String> {
    let mut out = Vec::new();
    for (index, item) in items.iter().enumerate() {
        match item.get_ref() {
            DeValue::String(s) => out.push(s.to_string()),
            other => {
                return Err(format!(
                    "element {index}: expected a string, found {}",
                    other.type_str()
                ));
            }
        }
    }
    Ok(Value::List(out))
}

fn choice(choices: &[&str], text: &str) -> Result<String, String> {
    if choices.contains(&text) {
        Ok(text.to_owned())
    } else {
        Err(format!(
            "unknown value {text:?}; expected one of: {}",
            choices.join(", ")
        ))
    }
}

/// Parses flag text for a key with the same value parsers as the file.
pub(crate) fn decode_flag(def: &KeyDef, values: &[String]) -> Result<Value, String> {
    if def.kind.is_list() {
        if values.len() == 1 && values.first().is_some_and(String::is_empty) {
            return Ok(Value::List(Vec::new()));
        }
        return Ok(Value::List(values.to_vec()));
    }
    let [text] = values else {
        return Err("give this flag exactly once".to_owned());
    };
    match def.kind {
        Kind::Duration => parse_duration(text).map(Value::Num),
        Kind::Bytes => parse_byte_flag(text).map(Value::Num),
        Kind::Count => parse_count_flag(text).map(Value::Num),
        Kind::Bool => match text.as_str() {
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            _ => Err(format!("expected true or false, got {text:?}")),
        },
        Kind::Choice(choices) => choice(choices, text).map(Value::Text),
        _ => Ok(Value::Text(text.clone())),
    }
}

/// Renders a numeric value of a key for messages.
pub(crate) fn describe_num(kind: Kind, n: u64) -> String {
    match kind {
        Kind::Duration => format_duration(n),
        Kind::Bytes => describe_bytes(n),
        _ => n.to_string(),
    }
}

/// Checks zero semantics, the minimum and the ceiling of a numeric value,
/// and the length bound of a list.
pub(crate) fn check_range(def: &KeyDef, value: &Value) -> Result<(), String> {
    match value {
        Value::Num(n) => {
            let n = *n;
            if n == 0 {
                return match def.zero {
                    Zero::Means(_) => Ok(()),
                    Zero::Refused => Err(
                        "0 is not allowed here (only keys documented with a zero meaning accept 0)"
                            .to_owned(),
                    ),
                };
            }
            if n < def.min {
                return Err(format!(
                    "must be at least {}",
                    describe_num(def.kind, def.min)
                ));
            }
            match def.limit {
                Limit::Ceiling(c) if n > c => Err(format!(
                    "{} exceeds the v1 ceiling of {} (a ceiling may be lowered, never raised)",
                    describe_num(def.kind, n),
                    describe_num(def.kind, c)
                )),
                Limit::Max(m) if n > m => Err(format!(
                    "{} exceeds the maximum of {}",
                    describe_num(def.kind, n),
                    describe_num(def.kind, m)
                )),
                _ => Ok(()),
            }
        }
        Value::List(items) => match def.limit.value() {
            Some(max) if u64::try_from(items.len()).unwrap_or(u64::MAX) > max => {
                Err(format!("lists at most {max} entries"))
            }
            _ => Ok(()),
        },
        _ => Ok(()),
    }
}
