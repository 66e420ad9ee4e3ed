//! The effective configuration summary (plan §4.3 item 9): every key of the
//! registry in registry order, normalized (canonical units and paths),
//! redacted, as TOML that decodes back to the same configuration.

use crate::decode::Value;
use crate::profiles::ProfilesConfig;
use crate::registry::{Daemon, Kind};
use crate::resolve::Resolved;
use crate::units::{format_bytes, format_duration};

/// Quotes text as a TOML basic string.
pub(crate) fn quote(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => out.push_str(&format!("\\u{:04X}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn render_value(kind: Kind, value: &Value) -> String {
    match value {
        Value::List(items) if kind == Kind::Labels => {
            let parts: Vec<String> = items
                .iter()
                .map(|item| {
                    let (k, v) = item.split_once('=').unwrap_or((item.as_str(), ""));
                    format!("{} = {}", quote(k), quote(v))
                })
                .collect();
            if parts.is_empty() {
                "{}".to_owned()
            } else {
                format!("{{ {} }}", parts.join(", "))
            }
        }
        Value::Num(n) => match kind {
            Kind::Duration => quote(&format_duration(*n)),
            Kind::Bytes => format_bytes(*n),
            _ => n.to_string(),
        },
        Value::Bool(b) => b.to_string(),
        Value::Text(t) => quote(t),
        Value::List(items) => {
            let parts: Vec<String> = items.iter().map(|s| quote(s)).collect();
            format!("[{}]", parts.join(", "))
        }
    }
}

pub(crate) fn render(
    daemon: Daemon,
    source: &str,
    r: &Resolved,
    profiles: Option<&ProfilesConfig>,
    warnings: &[String],
) -> String {
    let mut out = String::new();
    out.push_str(&format!("# {} effective configuration\n", daemon.binary()));
    out.push_str(&format!("# source: {source}\n"));
    for w in warnings {
        out.push_str(&format!("# WARNING: {w}\n"));
    }
    let mut section = "";
    for def in daemon.keys() {
        if def.section() != section {
            section = def.section();
            out.push_str(&format!("\n[{section}]\n"));
        }
        let value = if def.redact {
            quote("<redacted>")
        } else {
            r.entries
                .get(def.path)
                .map_or_else(String::new, |e| render_value(def.kind, &e.value))
        };
        out.push_str(&format!("{} = {value}\n", def.name()));
    }
    if let Some(profiles) = profiles {
        for p in profiles.all() {
            out.push_str(&format!("\n[profiles.{}]\n", p.name));
            out.push_str(&format!("enabled = {}\n", p.enabled));
            let required: Vec<String> = p.required.iter().map(|c| quote(c.as_str())).collect();
            out.push_str(&format!("required_controls = [{}]\n", required.join(", ")));
            if let Some(cpu) = p.cpu_max {
                out.push_str(&format!("cpu_quota_us = {}\n", cpu.quota_us));
                out.push_str(&format!("cpu_period_us = {}\n", cpu.period_us));
            }
            if let Some(w) = p.cpu_weight {
                out.push_str(&format!("cpu_weight = {w}\n"));
            }
            if let Some(m) = p.memory_max {
                out.push_str(&format!("memory_max = {}\n", format_bytes(m)));
            }
            if let Some(m) = p.memory_high {
                out.push_str(&format!("memory_high = {}\n", format_bytes(m)));
            }
            if let Some(n) = p.pids_max {
                out.push_str(&format!("pids_max = {n}\n"));
            }
            for rule in &p.io {
                out.push_str(&format!(
                    "\n[profiles.{}.io.\"{}\"]\n",
                    p.name,
                    rule.device()
                ));
                for (name, value, bytes) in [
                    ("read_bps", rule.read_bps, true),
                    ("write_bps", rule.write_bps, true),
                    ("read_iops", rule.read_iops, false),
                    ("write_iops", rule.write_iops, false),
                ] {
                    if let Some(v) = value {
                        let text = if bytes {
                            format_bytes(v)
                        } else {
                            v.to_string()
                        };
                        out.push_str(&format!("{name} = {text}\n"));
                    }
                }
            }
        }
    }
    out
}
