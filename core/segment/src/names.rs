//! Canonical segment file names (plan §5.1, §5.3, R-5.3-03): built only from
//! a UUID and an ordinal, never from unvalidated input, and parsed back only
//! when exactly canonical, so no path separator, dot-dot or alias can appear.

/// Largest per-command segment ordinal that fits the 8-digit name.
pub const MAX_SEGMENT_ORDINAL: u32 = 99_999_999;
/// Largest audit segment ordinal that fits the 16-digit name.
pub const MAX_AUDIT_ORDINAL: u64 = 9_999_999_999_999_999;

const SEGMENT_DIGITS: usize = 8;
const AUDIT_DIGITS: usize = 16;
const SUFFIX: &str = ".seg";
const AUDIT_PREFIX: &str = "audit-";
const HEX: &[u8; 16] = b"0123456789abcdef";

/// How many fan-out directories hold command segment files.
pub const SEGMENT_DIRS: usize = 256;

/// The fan-out directory of a command's segment files: the first byte of
/// the SHA-256 of its UUID as two lowercase hex digits, so the files of
/// any set of UUIDs (operators choose them) spread evenly over
/// [`SEGMENT_DIRS`] directories and no directory grows with the whole
/// store.
#[must_use]
pub fn segment_dir_name(issue_uuid: &[u8; 16]) -> String {
    segment_dir_of_index(usize::from(crate::sha256(issue_uuid)[0]))
}

/// The name of fan-out directory `index` (`00` to `ff`; `index` is taken
/// modulo [`SEGMENT_DIRS`]).
#[must_use]
pub fn segment_dir_of_index(index: usize) -> String {
    let b = index % SEGMENT_DIRS;
    let hi = HEX.get(b >> 4).copied().unwrap_or(b'0');
    let lo = HEX.get(b & 0x0f).copied().unwrap_or(b'0');
    [char::from(hi), char::from(lo)].iter().collect()
}

/// `<32 lowercase hex of the uuid>-<ordinal, 8 digits>.seg`, e.g.
/// `0189abcd...8057-00000001.seg`. `None` when the ordinal does not fit
/// eight digits (above [`MAX_SEGMENT_ORDINAL`]).
pub fn segment_file_name(issue_uuid: &[u8; 16], ordinal: u32) -> Option<String> {
    if ordinal > MAX_SEGMENT_ORDINAL {
        return None;
    }
    let mut name = String::with_capacity(32 + 1 + SEGMENT_DIGITS + SUFFIX.len());
    for b in issue_uuid {
        for nibble in [b >> 4, b & 0x0f] {
            let c = HEX.get(usize::from(nibble)).copied().unwrap_or(b'0');
            name.push(char::from(c));
        }
    }
    name.push('-');
    name.push_str(&format!("{ordinal:08}"));
    name.push_str(SUFFIX);
    Some(name)
}

/// Inverse of [`segment_file_name`]: accepts only the exact canonical form.
pub fn parse_segment_file_name(name: &str) -> Option<([u8; 16], u32)> {
    let stem = name.strip_suffix(SUFFIX)?;
    let (hex, digits) = stem.split_once('-')?;
    if hex.len() != 32 || digits.len() != SEGMENT_DIGITS {
        return None;
    }
    let mut uuid = [0u8; 16];
    let hex = hex.as_bytes();
    for (i, out) in uuid.iter_mut().enumerate() {
        let hi = hex_value(*hex.get(i.checked_mul(2)?)?)?;
        let lo = hex_value(*hex.get(i.checked_mul(2)?.checked_add(1)?)?)?;
        *out = (hi << 4) | lo;
    }
    let ordinal = u32::try_from(parse_digits(digits)?).ok()?;
    Some((uuid, ordinal))
}

/// `audit-<ordinal, 16 digits>.seg`. `None` above [`MAX_AUDIT_ORDINAL`].
pub fn audit_file_name(ordinal: u64) -> Option<String> {
    if ordinal > MAX_AUDIT_ORDINAL {
        return None;
    }
    Some(format!("{AUDIT_PREFIX}{ordinal:016}{SUFFIX}"))
}

/// Inverse of [`audit_file_name`]: accepts only the exact canonical form.
pub fn parse_audit_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(AUDIT_PREFIX)?.strip_suffix(SUFFIX)?;
    if digits.len() != AUDIT_DIGITS {
        return None;
    }
    parse_digits(digits)
}

fn hex_value(c: u8) -> Option<u8> {
    match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    }
}

/// ASCII decimal digits only (no sign, no whitespace, no `_`).
fn parse_digits(s: &str) -> Option<u64> {
    s.bytes().try_fold(0u64, |acc, c| {
        if !c.is_ascii_digit() {
            return None;
        }
        acc.checked_mul(10)?.checked_add(u64::from(c - b'0'))
    })
}
