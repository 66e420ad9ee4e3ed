//! Duration and byte-size text: the one parser used for TOML values and for
//! command-line flags, and the canonical rendering used by the summary.
//!
//! Integer arithmetic only (plan §4.3 item 4): no floating point, every
//! multiplication and addition is checked.

use rvbox_domain::limits::{GIB, KIB, MIB};

/// One hour in milliseconds.
const HOUR_MS: u64 = 60 * 60 * 1000;
/// One day in milliseconds.
const DAY_MS: u64 = 24 * HOUR_MS;

/// Duration units, largest first, with their size in milliseconds.
const DURATION_UNITS: [(&str, u64); 5] = [
    ("d", DAY_MS),
    ("h", HOUR_MS),
    ("m", 60_000),
    ("s", 1_000),
    ("ms", 1),
];

/// One TiB.
const TIB: u64 = 1024 * GIB;

/// IEC byte units, largest first.
const BYTE_UNITS: [(&str, u64); 5] = [
    ("TiB", TIB),
    ("GiB", GIB),
    ("MiB", MIB),
    ("KiB", KIB),
    ("B", 1),
];

/// Parses a duration string such as `"10s"`, `"15m"`, `"250ms"` or
/// `"1h30m"` into milliseconds.
///
/// Refused: empty text, a bare number, a sign, a fraction, an unknown unit,
/// units out of order or repeated, and values that overflow `u64`
/// milliseconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    const HINT: &str =
        "write a number with a unit, e.g. \"10s\", \"15m\", \"250ms\" (units: ms, s, m, h, d)";
    if text.is_empty() {
        return Err(format!("empty duration; {HINT}"));
    }
    if text.starts_with('-') {
        return Err("negative durations are not allowed".to_owned());
    }
    if text.starts_with('+') {
        return Err(format!("a sign is not allowed; {HINT}"));
    }
    if text.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("missing unit; {HINT}"));
    }
    let mut rest = text;
    let mut total: u64 = 0;
    // Index into DURATION_UNITS of the last unit used: units must get smaller.
    let mut last_unit: Option<usize> = None;
    while !rest.is_empty() {
        let digits_len = rest.bytes().take_while(u8::is_ascii_digit).count();
        let (digits, after) = rest.split_at(digits_len);
        if digits.is_empty() {
            return Err(format!("invalid duration {text:?}; {HINT}"));
        }
        if after.starts_with('.') || after.starts_with(',') {
            return Err("fractional durations are not allowed; use a smaller unit, e.g. \"1500ms\" instead of \"1.5s\"".to_string());
        }
        let unit_len = after.bytes().take_while(u8::is_ascii_alphabetic).count();
        let (unit, tail) = after.split_at(unit_len);
        if unit.is_empty() {
            return Err(format!("invalid duration {text:?}; {HINT}"));
        }
        let Some(index) = DURATION_UNITS.iter().position(|(name, _)| *name == unit) else {
            return Err(format!("unknown duration unit {unit:?}; {HINT}"));
        };
        if last_unit.is_some_and(|last| index <= last) {
            return Err(format!(
                "invalid duration {text:?}: units must appear once each, largest first (e.g. \"1h30m\")"
            ));
        }
        last_unit = Some(index);
        let scale = DURATION_UNITS.get(index).map_or(1, |(_, ms)| *ms);
        let number: u64 = digits
            .parse()
            .map_err(|_| format!("duration {text:?} is too large"))?;
        total = number
            .checked_mul(scale)
            .and_then(|part| total.checked_add(part))
            .ok_or_else(|| format!("duration {text:?} is too large"))?;
        rest = tail;
    }
    Ok(total)
}

/// Renders milliseconds in the canonical compound form (`"0s"`, `"2ms"`,
/// `"15m"`, `"1h30m"`, `"30d"`). `parse_duration` reads it back exactly.
pub fn format_duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".to_owned();
    }
    let mut out = String::new();
    let mut rest = ms;
    for (name, scale) in DURATION_UNITS {
        let count = rest / scale;
        if count > 0 {
            out.push_str(&count.to_string());
            out.push_str(name);
            rest %= scale;
        }
    }
    out
}

/// Parses a byte-size string with an IEC unit (`"64KiB"`, `"10MiB"`,
/// `"4GiB"`, `"1TiB"`, `"512B"`). A plain byte count is written as a TOML
/// integer, never as a string of digits (no string-to-number coercion).
pub fn parse_byte_string(text: &str) -> Result<u64, String> {
    const HINT: &str = "write an integer number of bytes or a string with an IEC unit, e.g. \"64KiB\", \"10MiB\", \"4GiB\"";
    if text.is_empty() {
        return Err(format!("empty size; {HINT}"));
    }
    if text.starts_with('-') {
        return Err("negative sizes are not allowed".to_owned());
    }
    let digits_len = text.bytes().take_while(u8::is_ascii_digit).count();
    let (digits, unit) = text.split_at(digits_len);
    if digits.is_empty() {
        return Err(format!("invalid size {text:?}; {HINT}"));
    }
    if unit.is_empty() {
        return Err(format!(
            "a size string needs a unit; write a plain byte count as a TOML integer ({HINT})"
        ));
    }
    if unit.starts_with('.') || unit.starts_with(',') {
        return Err(format!("fractional sizes are not allowed; {HINT}"));
    }
    let Some((_, scale)) = BYTE_UNITS.iter().find(|(name, _)| *name == unit) else {
        let decimal = matches!(
            unit,
            "k" | "K" | "KB" | "kB" | "M" | "MB" | "G" | "GB" | "T" | "TB"
        );
        return Err(if decimal {
            format!("unit {unit:?} is ambiguous; use IEC units (B, KiB, MiB, GiB, TiB)")
        } else {
            format!("unknown size unit {unit:?}; {HINT}")
        });
    };
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("size {text:?} is too large"))?;
    number
        .checked_mul(*scale)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

/// Parses a byte size given as command-line text: plain digits are bytes,
/// anything else goes through [`parse_byte_string`].
pub fn parse_byte_flag(text: &str) -> Result<u64, String> {
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        return text
            .parse()
            .map_err(|_| format!("size {text:?} is too large"));
    }
    parse_byte_string(text)
}

/// Parses a count given as command-line text (plain decimal digits).
pub fn parse_count_flag(text: &str) -> Result<u64, String> {
    if text.starts_with('-') {
        return Err("negative counts are not allowed".to_owned());
    }
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("expected a non-negative integer, got {text:?}"));
    }
    text.parse()
        .map_err(|_| format!("count {text:?} is too large"))
}

/// Renders a byte size in its canonical form: the largest IEC unit that
/// divides it exactly (`"10MiB"`), or a plain integer when none does.
pub fn format_bytes(bytes: u64) -> String {
    if bytes == 0 {
        return "0".to_owned();
    }
    for (name, scale) in BYTE_UNITS {
        if scale > 1 && bytes.is_multiple_of(scale) {
            return format!("\"{}{name}\"", bytes / scale);
        }
    }
    bytes.to_string()
}

/// Renders a byte size for messages: like [`format_bytes`] without quotes.
pub fn describe_bytes(bytes: u64) -> String {
    format_bytes(bytes).replace('"', "")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_round_trip() {
        for ms in [0, 1, 2, 999, 1_000, 60_000, 90 * 60_000, DAY_MS * 30, 1_001] {
            assert_eq!(parse_duration(&format_duration(ms)), Ok(ms));
        }
        assert_eq!(parse_duration("1h30m"), Ok(90 * 60_000));
        assert_eq!(format_duration(90 * 60_000), "1h30m");
    }

    #[test]
    fn bytes_round_trip() {
        assert_eq!(format_bytes(10 * MIB), "\"10MiB\"");
        assert_eq!(format_bytes(1000), "1000");
        assert_eq!(parse_byte_string("64KiB"), Ok(64 * KIB));
        assert!(parse_byte_string("16777216TiB").is_err());
    }
}
