//! Precedence (plan §4.3 item 3): compiled defaults < file < flags that were
//! explicitly given, for every registry key, in one place.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::decode::{Entry, FlagValue, RawDoc, Value, check_range, decode_flag};
use crate::error::{ConfigError, ConfigErrors, Origin};
use crate::probe::HostProbe;
use crate::registry::{Daemon, DefaultValue, KeyDef};

/// Every registry key of one daemon with its winning value and origin.
#[derive(Debug, Clone)]
pub(crate) struct Resolved {
    pub(crate) daemon: Daemon,
    pub(crate) entries: BTreeMap<&'static str, Entry>,
    /// Keys whose own value was refused; invariants involving them are
    /// skipped so one mistake gives one error.
    failed: BTreeSet<String>,
}

impl Resolved {
    /// Applies precedence: default, then file, then given flags.
    pub(crate) fn build(
        daemon: Daemon,
        doc: &RawDoc,
        flags: &[FlagValue],
        probe: &dyn HostProbe,
        errors: &mut ConfigErrors,
    ) -> Self {
        let mut entries = BTreeMap::new();
        for def in daemon.keys() {
            let entry = doc.entries.get(def.path).cloned().unwrap_or_else(|| Entry {
                value: default_value(def, probe),
                origin: Origin::Default,
            });
            entries.insert(def.path, entry);
        }
        for flag in flags {
            let Some(def) = daemon.keys().iter().find(|d| d.path == flag.key) else {
                errors.push(ConfigError::new(
                    flag.key.clone(),
                    Origin::Flag(format!("--{}", flag.key.replace(['.', '_'], "-"))),
                    "unknown key",
                ));
                continue;
            };
            let origin = Origin::Flag(format!("--{}", def.flag_name()));
            match decode_flag(def, &flag.values).and_then(|v| check_range(def, &v).map(|()| v)) {
                Ok(value) => {
                    entries.insert(def.path, Entry { value, origin });
                }
                Err(message) => errors.push(ConfigError::new(def.path, origin, message)),
            }
        }
        let failed = errors.errors.iter().map(|e| e.key.clone()).collect();
        Self {
            daemon,
            entries,
            failed,
        }
    }

    /// True when the key's own value was refused.
    pub(crate) fn failed(&self, key: &str) -> bool {
        self.failed.contains(key)
    }

    /// Records that a key's value was refused by a section rule.
    pub(crate) fn mark_failed(&mut self, key: &str) {
        self.failed.insert(key.to_owned());
    }

    fn get(&self, key: &str) -> Option<&Entry> {
        self.entries.get(key)
    }

    /// The origin of a key's value.
    pub(crate) fn origin(&self, key: &str) -> Origin {
        self.get(key).map_or(Origin::Default, |e| e.origin.clone())
    }

    /// A numeric value (milliseconds, bytes or count).
    pub(crate) fn num(&self, key: &str) -> u64 {
        match self.get(key).map(|e| &e.value) {
            Some(Value::Num(n)) => *n,
            _ => 0,
        }
    }

    /// A duration value.
    pub(crate) fn duration(&self, key: &str) -> Duration {
        Duration::from_millis(self.num(key))
    }

    /// A boolean value.
    pub(crate) fn flag(&self, key: &str) -> bool {
        matches!(self.get(key).map(|e| &e.value), Some(Value::Bool(true)))
    }

    /// A text value.
    pub(crate) fn text(&self, key: &str) -> String {
        match self.get(key).map(|e| &e.value) {
            Some(Value::Text(t)) => t.clone(),
            _ => String::new(),
        }
    }

    /// A list value.
    pub(crate) fn list(&self, key: &str) -> Vec<String> {
        match self.get(key).map(|e| &e.value) {
            Some(Value::List(l)) => l.clone(),
            _ => Vec::new(),
        }
    }

    /// Replaces a value by its normalized form (for the summary).
    pub(crate) fn normalize(&mut self, key: &'static str, value: Value) {
        if let Some(entry) = self.entries.get_mut(key) {
            entry.value = value;
        }
    }

    /// An error about `key`, located where its value came from.
    pub(crate) fn error(&self, key: &str, message: impl Into<String>) -> ConfigError {
        ConfigError::new(key, self.origin(key), message)
    }

    /// An error about an invariant between two keys, located at whichever
    /// of them the operator set (the first when both or neither were set).
    pub(crate) fn pair_error(
        &self,
        first: &str,
        second: &str,
        message: impl Into<String>,
    ) -> ConfigError {
        let (key, origin) = match (self.origin(first), self.origin(second)) {
            (Origin::Default, o @ (Origin::File { .. } | Origin::Flag(_))) => (second, o),
            (o, _) => (first, o),
        };
        ConfigError::new(key, origin, message)
    }
}

fn default_value(def: &KeyDef, probe: &dyn HostProbe) -> Value {
    match def.default {
        DefaultValue::Num(n) => Value::Num(n),
        DefaultValue::Bool(b) => Value::Bool(b),
        DefaultValue::Text(t) => Value::Text(t.to_owned()),
        DefaultValue::List(items) => Value::List(items.iter().map(|s| (*s).to_owned()).collect()),
        DefaultValue::HostName => Value::Text(probe.host_name().unwrap_or_default()),
    }
}
