//! Client labels and the selectors that match them.
//!
//! A client advertises `key = "value"` labels (`client.labels` in its
//! configuration, carried in the hello). Operators pick clients with a
//! selector such as `role=web,zone=eu-*`, and with a glob over client ids
//! (`web-*`). One rule for every surface: the configuration, the hello, the
//! control API and `rvc` all parse with these functions.
//!
//! Limits: at most [`MAX_LABELS`] labels; a key is 1 to
//! [`MAX_LABEL_KEY_BYTES`] ASCII letters, digits, `.`, `_`, `-` or `/`,
//! starting with a letter or a digit; a value is 0 to
//! [`MAX_LABEL_VALUE_BYTES`] ASCII letters, digits, `.`, `_`, `-`, `/`,
//! `:`, `@` or `+`. Values never hold the selector's own characters
//! (`,` `=` `!` `*` `?`), so a selector is never ambiguous.

use std::collections::BTreeMap;
use std::fmt;

use rvbox_proto::v1 as wire;

/// Most labels one client carries.
pub const MAX_LABELS: usize = 32;
/// Longest label key, in bytes.
pub const MAX_LABEL_KEY_BYTES: usize = 63;
/// Longest label value, in bytes.
pub const MAX_LABEL_VALUE_BYTES: usize = 128;
/// Longest selector or glob text, in bytes.
pub const MAX_SELECTOR_BYTES: usize = 1024;
/// Most terms in one selector.
pub const MAX_SELECTOR_TERMS: usize = 32;

/// A label or selector that breaks a rule; the text names the rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct LabelError(pub String);

fn err(text: impl Into<String>) -> LabelError {
    LabelError(text.into())
}

/// Checks one label key.
///
/// # Errors
/// A [`LabelError`] naming the rule the key breaks.
pub fn check_key(key: &str) -> Result<(), LabelError> {
    if key.is_empty() {
        return Err(err("a label key must not be empty"));
    }
    if key.len() > MAX_LABEL_KEY_BYTES {
        return Err(err(format!(
            "label key {key:?} is {} bytes, more than the limit of {MAX_LABEL_KEY_BYTES}",
            key.len()
        )));
    }
    if !key
        .as_bytes()
        .first()
        .is_some_and(u8::is_ascii_alphanumeric)
    {
        return Err(err(format!(
            "label key {key:?} must start with an ASCII letter or digit"
        )));
    }
    if let Some(c) = key
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')))
    {
        return Err(err(format!(
            "label key {key:?} holds {c:?}; keys use ASCII letters, digits, '.', '_', '-' and '/'"
        )));
    }
    Ok(())
}

fn value_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/' | ':' | '@' | '+')
}

/// Checks one label value.
///
/// # Errors
/// A [`LabelError`] naming the rule the value breaks.
pub fn check_value(key: &str, value: &str) -> Result<(), LabelError> {
    if value.len() > MAX_LABEL_VALUE_BYTES {
        return Err(err(format!(
            "the value of label {key:?} is {} bytes, more than the limit of {MAX_LABEL_VALUE_BYTES}",
            value.len()
        )));
    }
    if let Some(c) = value.chars().find(|c| !value_char(*c)) {
        return Err(err(format!(
            "the value of label {key:?} holds {c:?}; values use ASCII letters, digits and . _ - / : @ +"
        )));
    }
    Ok(())
}

/// A client's validated labels, ordered by key.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Labels(BTreeMap<String, String>);

impl Labels {
    /// Validates `key`/`value` pairs: each key once, every key and value
    /// within the rules, at most [`MAX_LABELS`].
    ///
    /// # Errors
    /// A [`LabelError`] for the first pair that breaks a rule.
    pub fn from_pairs<'a>(
        pairs: impl IntoIterator<Item = (&'a str, &'a str)>,
    ) -> Result<Self, LabelError> {
        let mut map = BTreeMap::new();
        for (k, v) in pairs {
            check_key(k)?;
            check_value(k, v)?;
            if map.insert(k.to_owned(), v.to_owned()).is_some() {
                return Err(err(format!("label {k:?} is given twice")));
            }
            if map.len() > MAX_LABELS {
                return Err(err(format!("more than {MAX_LABELS} labels")));
            }
        }
        Ok(Self(map))
    }

    /// Parses `key=value` items (flags, the configuration's normalized
    /// form).
    ///
    /// # Errors
    /// A [`LabelError`] for an item without `=` or a pair that breaks a
    /// rule.
    pub fn from_assignments<'a>(
        items: impl IntoIterator<Item = &'a str>,
    ) -> Result<Self, LabelError> {
        let mut pairs = Vec::new();
        for item in items {
            let (k, v) = item
                .split_once('=')
                .ok_or_else(|| err(format!("{item:?} is not key=value")))?;
            pairs.push((k, v));
        }
        Self::from_pairs(pairs)
    }

    /// Parses the normalized text a store keeps (`key=value,key=value`,
    /// the [`fmt::Display`] form); the empty text is no labels.
    ///
    /// # Errors
    /// As [`Labels::from_assignments`].
    pub fn parse_stored(text: &str) -> Result<Self, LabelError> {
        if text.is_empty() {
            return Ok(Self::default());
        }
        Self::from_assignments(text.split(','))
    }

    /// Validates the labels of a wire message (hello, stored row).
    ///
    /// # Errors
    /// As [`Labels::from_pairs`].
    pub fn from_wire(labels: &[wire::Label]) -> Result<Self, LabelError> {
        if labels.len() > MAX_LABELS {
            return Err(err(format!(
                "{} labels, more than the limit of {MAX_LABELS}",
                labels.len()
            )));
        }
        Self::from_pairs(labels.iter().map(|l| (l.key.as_str(), l.value.as_str())))
    }

    /// The labels as wire messages, ordered by key.
    #[must_use]
    pub fn to_wire(&self) -> Vec<wire::Label> {
        self.0
            .iter()
            .map(|(k, v)| wire::Label {
                key: k.clone(),
                value: v.clone(),
            })
            .collect()
    }

    /// The value of `key`, if the client has it.
    #[must_use]
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Number of labels.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True without labels.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// `key=value` items, ordered by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }
}

impl fmt::Display for Labels {
    /// `key=value,key=value`, ordered by key (the form `rvc` prints and
    /// the store keeps).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, (k, v)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{k}={v}")?;
        }
        Ok(())
    }
}

/// Matches `text` against a glob where `*` is any run of characters and
/// `?` is one character; everything else matches itself. Linear in the
/// lengths (the classic backtrack-to-last-star walk), so no input makes it
/// slow.
#[must_use]
pub fn glob_match(pattern: &str, text: &str) -> bool {
    let p = pattern.as_bytes();
    let t = text.as_bytes();
    let (mut pi, mut ti) = (0usize, 0usize);
    let mut star: Option<(usize, usize)> = None;
    while let Some(&tc) = t.get(ti) {
        match p.get(pi) {
            Some(b'*') => {
                star = Some((pi, ti));
                pi += 1;
            }
            Some(&c) if c == b'?' || c == tc => {
                pi += 1;
                ti += 1;
            }
            _ => match star {
                Some((sp, st)) => {
                    pi = sp + 1;
                    ti = st + 1;
                    star = Some((sp, st + 1));
                }
                None => return false,
            },
        }
    }
    p.get(pi..).unwrap_or_default().iter().all(|c| *c == b'*')
}

/// Checks a client-id glob: client-id characters plus `*` and `?`.
///
/// # Errors
/// A [`LabelError`] naming the rule the glob breaks.
pub fn check_client_glob(glob: &str) -> Result<(), LabelError> {
    if glob.is_empty() {
        return Err(err("the client-id glob must not be empty"));
    }
    if glob.len() > MAX_SELECTOR_BYTES {
        return Err(err(format!(
            "the client-id glob is {} bytes, more than the limit of {MAX_SELECTOR_BYTES}",
            glob.len()
        )));
    }
    if let Some(c) = glob
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_' | '*' | '?')))
    {
        return Err(err(format!(
            "the client-id glob {glob:?} holds {c:?}; it uses client-id characters, '*' and '?'"
        )));
    }
    Ok(())
}

/// One term of a [`Selector`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Term {
    /// `key=glob`: the client has the key and its value matches.
    Matches(String, String),
    /// `key!=glob`: the client lacks the key, or its value does not match.
    NotMatches(String, String),
    /// `key`: the client has the key.
    Has(String),
    /// `!key`: the client lacks the key.
    Lacks(String),
}

/// A label selector: comma-separated terms, all of which must hold
/// (`role=web,zone=eu-*,!canary`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    terms: Vec<Term>,
}

fn check_value_glob(key: &str, glob: &str) -> Result<(), LabelError> {
    if glob.len() > MAX_LABEL_VALUE_BYTES {
        return Err(err(format!(
            "the pattern for label {key:?} is {} bytes, more than the limit of {MAX_LABEL_VALUE_BYTES}",
            glob.len()
        )));
    }
    if let Some(c) = glob
        .chars()
        .find(|c| !(value_char(*c) || matches!(c, '*' | '?')))
    {
        return Err(err(format!(
            "the pattern for label {key:?} holds {c:?}; patterns use value characters, '*' and '?'"
        )));
    }
    Ok(())
}

impl Selector {
    /// Parses `role=web,zone=eu-*`. The empty text is the selector that
    /// matches every client.
    ///
    /// # Errors
    /// A [`LabelError`] naming the term that breaks a rule.
    pub fn parse(text: &str) -> Result<Self, LabelError> {
        if text.len() > MAX_SELECTOR_BYTES {
            return Err(err(format!(
                "the selector is {} bytes, more than the limit of {MAX_SELECTOR_BYTES}",
                text.len()
            )));
        }
        let mut terms = Vec::new();
        if text.is_empty() {
            return Ok(Self { terms });
        }
        for raw in text.split(',') {
            let item = raw.trim();
            if item.is_empty() {
                return Err(err(format!("the selector {text:?} has an empty term")));
            }
            let term = if let Some((k, v)) = item.split_once("!=") {
                check_key(k)?;
                check_value_glob(k, v)?;
                Term::NotMatches(k.to_owned(), v.to_owned())
            } else if let Some((k, v)) = item.split_once('=') {
                check_key(k)?;
                check_value_glob(k, v)?;
                Term::Matches(k.to_owned(), v.to_owned())
            } else if let Some(k) = item.strip_prefix('!') {
                check_key(k)?;
                Term::Lacks(k.to_owned())
            } else {
                check_key(item)?;
                Term::Has(item.to_owned())
            };
            terms.push(term);
            if terms.len() > MAX_SELECTOR_TERMS {
                return Err(err(format!(
                    "the selector has more than {MAX_SELECTOR_TERMS} terms"
                )));
            }
        }
        Ok(Self { terms })
    }

    /// True when every term holds for `labels`.
    #[must_use]
    pub fn matches(&self, labels: &Labels) -> bool {
        self.terms.iter().all(|t| match t {
            Term::Matches(k, g) => labels.get(k).is_some_and(|v| glob_match(g, v)),
            Term::NotMatches(k, g) => !labels.get(k).is_some_and(|v| glob_match(g, v)),
            Term::Has(k) => labels.get(k).is_some(),
            Term::Lacks(k) => labels.get(k).is_none(),
        })
    }

    /// True for the selector that matches everything.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.terms.is_empty()
    }

    /// The terms, in the order written.
    #[must_use]
    pub fn terms(&self) -> &[Term] {
        &self.terms
    }
}

impl fmt::Display for Selector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, t) in self.terms.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            match t {
                Term::Matches(k, g) => write!(f, "{k}={g}")?,
                Term::NotMatches(k, g) => write!(f, "{k}!={g}")?,
                Term::Has(k) => write!(f, "{k}")?,
                Term::Lacks(k) => write!(f, "!{k}")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_as_written() {
        for (p, t, want) in [
            ("web-*", "web-01", true),
            ("web-*", "db-01", false),
            ("*", "", true),
            ("", "", true),
            ("", "a", false),
            ("w?b", "web", true),
            ("w?b", "wb", false),
            ("*-eu-*", "web-eu-west", true),
            ("a*b*c", "aXbYc", true),
            ("a*b*c", "aXbY", false),
            ("eu-*", "eu-", true),
            ("**a", "bba", true),
        ] {
            assert_eq!(glob_match(p, t), want, "{p:?} vs {t:?}");
        }
        // no pathological slowness: a long text against many stars
        let text = "a".repeat(4096);
        assert!(!glob_match("*a*a*a*a*a*a*a*b", &text));
    }

    #[test]
    fn labels_are_validated() {
        let l = Labels::from_assignments(["zone=eu-west", "role=web"]).unwrap();
        assert_eq!(l.to_string(), "role=web,zone=eu-west");
        assert!(Labels::from_assignments(["role"]).is_err());
        assert!(Labels::from_assignments(["role=a", "role=b"]).is_err());
        assert!(Labels::from_assignments(["-x=1"]).is_err());
        assert!(Labels::from_assignments(["x=a b"]).is_err());
        assert!(Labels::from_assignments(["x=a*"]).is_err());
        let long = format!("k={}", "v".repeat(MAX_LABEL_VALUE_BYTES + 1));
        assert!(Labels::from_assignments([long.as_str()]).is_err());
        let many: Vec<String> = (0..=MAX_LABELS).map(|i| format!("k{i}=v")).collect();
        let e = Labels::from_assignments(many.iter().map(String::as_str)).unwrap_err();
        assert!(e.0.contains("more than 32 labels"), "{e}");
        assert!(Labels::from_assignments(["empty="]).is_ok());
        // ASCII only: no look-alike letters or digits, no invisible or
        // direction-changing characters, no control characters
        for bad in [
            "z\u{f6}ne=eu",
            "zone=e\u{fc}",
            "\u{440}ole=web",
            "role=w\u{435}b",
            "n=\u{ff11}",
            "role=we\u{200b}b",
            "role=web\u{202e}x",
            "role=web\n",
            "role=web\0",
            "ro\u{301}le=web",
        ] {
            assert!(Labels::from_assignments([bad]).is_err(), "{bad:?}");
        }
        assert!(check_key("r\u{f6}le").unwrap_err().0.contains("'\u{f6}'"));
    }

    #[test]
    fn selectors_match_every_term() {
        let web = Labels::from_assignments(["role=web", "zone=eu-west"]).unwrap();
        let db = Labels::from_assignments(["role=db", "zone=us-east", "canary=yes"]).unwrap();
        let s = Selector::parse("role=web,zone=eu-*").unwrap();
        assert!(s.matches(&web) && !s.matches(&db));
        let s = Selector::parse("!canary").unwrap();
        assert!(s.matches(&web) && !s.matches(&db));
        let s = Selector::parse("canary").unwrap();
        assert!(!s.matches(&web) && s.matches(&db));
        let s = Selector::parse("zone!=eu-*").unwrap();
        assert!(!s.matches(&web) && s.matches(&db));
        assert!(Selector::parse("").unwrap().matches(&web));
        assert_eq!(
            Selector::parse("role=web, !canary").unwrap().to_string(),
            "role=web,!canary"
        );
        for bad in ["role=web,,x", "=web", "role=a b", "ro le=x", "role=w,eb="] {
            if bad == "role=w,eb=" {
                // "eb=" is a valid term (empty value)
                assert!(Selector::parse(bad).is_ok());
                continue;
            }
            assert!(Selector::parse(bad).is_err(), "{bad}");
        }
    }
}
