//! Sizes and durations as a config writes them, exactly the forms
//! docs/configuration.md lists: a whole number and one unit, no space.
//!
//! - sizes: `B`, `KiB`, `MiB`, `GiB`, `TiB` (powers of 1024) and `KB`,
//!   `MB`, `GB`, `TB` (powers of 1000), spelled as here;
//! - durations: `ms`, `s`, `m`, `h`, `d`.
//!
//! A lone `K`, `M`, `G` or `T` has no single meaning (`df -h` reads `50G`
//! as 50 GiB, Kubernetes as 50 GB, 7 % apart), so larder takes neither and
//! says both. Anything else a reader could mean one way (`50 GiB`, `50Gi`,
//! `50gib`, `1.5GiB`, `7 days`, `1h30m`, `1.5h`) is refused with the
//! spelling larder reads, so a config never means something else than it
//! seems to. Sizes are shown back as `50 GiB (53687091200 bytes)`.

use std::fmt;
use std::time::Duration;

/// The size units, as written, with their factors: binary first.
const SIZE_UNITS: [(&str, u64); 9] = [
    ("TiB", 1 << 40),
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("TB", 1_000_000_000_000),
    ("GB", 1_000_000_000),
    ("MB", 1_000_000),
    ("KB", 1_000),
    ("B", 1),
];

/// The duration units, as written, largest first.
const DURATION_UNITS: [(&str, u64); 5] = [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000), ("ms", 1)];

/// Listed in messages.
pub const SIZE_UNITS_TEXT: &str = "B, KiB, MiB, GiB, TiB (powers of 1024), KB, MB, GB, TB (powers of 1000)";
pub const DURATION_UNITS_TEXT: &str = "ms, s, m, h, d";

/// Longest run of digits a duration is read with (at most 115 days in
/// `ms`, 27 million years in `d`), and half the longest number read
/// leniently for a suggestion. A size's digits are not bounded: what does
/// not fit in a u64, or does not once multiplied, is "too large".
const MAX_DIGITS: usize = 10;

/// `"50GiB"` → 53687091200. The error says what to write instead.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let how = format!("a whole number and a unit, no space, like \"256MiB\" or \"50GiB\" ({SIZE_UNITS_TEXT})");
    let (digits, unit) = split_number(s);
    if let Some(factor) = exact_unit(&SIZE_UNITS, unit).filter(|_| !digits.is_empty()) {
        let n: u64 = digits.parse().map_err(|_| format!("{s:?} is too large"))?;
        return n.checked_mul(factor).ok_or_else(|| format!("{s:?} is too large"));
    }
    let Some((number, unit)) = lenient(s) else { return Err(format!("{s:?} is not a size: write {how}")) };
    let canonical = |factor: u64, binary: bool| {
        let bytes = number * factor as f64;
        (bytes.fract() == 0.0 && bytes < u64::MAX as f64).then(|| spelled_size(bytes as u64, binary))
    };
    let suggestion = match unit.to_ascii_lowercase().as_str() {
        "" if number.fract() == 0.0 => {
            return Err(format!("{s:?} has no unit: write \"{s}B\" for bytes, or {how}"));
        }
        // Ambiguous: say both.
        letter @ ("k" | "m" | "g" | "t") => {
            let i = ["k", "m", "g", "t"].iter().position(|l| *l == letter).unwrap_or(0);
            let (binary, decimal) = (1u64 << (10 * (i + 1)), 1000u64.pow(i as u32 + 1));
            return match (canonical(binary, true), canonical(decimal, false)) {
                (Some(b), Some(d)) => Err(format!(
                    "{s:?} is ambiguous: write \"{b}\" ({} bytes) or \"{d}\" ({} bytes)",
                    parse_size(&b).unwrap_or(0),
                    parse_size(&d).unwrap_or(0)
                )),
                _ => Err(format!("{s:?} is too large")),
            };
        }
        u => SIZE_UNITS
            .iter()
            .find(|(name, _)| {
                let name = name.to_ascii_lowercase();
                // Kubernetes' `Gi` is GiB.
                u == name || (name.ends_with("ib") && u == name.trim_end_matches('b'))
            })
            .and_then(|(name, factor)| canonical(*factor, name.ends_with("iB") || *name == "B")),
    };
    match suggestion {
        Some(written) if written != s => Err(format!("{s:?}: write \"{written}\" ({how})")),
        _ => Err(format!("{s:?} is not a size: write {how}")),
    }
}

/// `"5m"` → 300 s. The error says what to write instead.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let how = format!("a whole number and one unit, like \"30s\", \"5m\" or \"7d\" ({DURATION_UNITS_TEXT})");
    let (digits, unit) = split_number(s);
    if let Some(factor) = exact_unit(&DURATION_UNITS, unit).filter(|_| valid_digits(digits)) {
        let n: u64 = digits.parse().map_err(|_| format!("{s:?} is far too long for a duration"))?;
        return n.checked_mul(factor).map(Duration::from_millis).ok_or_else(|| format!("{s:?} is far too long"));
    }
    // `1h30m`, `1m 30s`, `1.5h`, `7 days`: read leniently only to say
    // what to write.
    let mut total_ms = 0f64;
    let mut rest = s.trim();
    let mut parts = 0;
    while !rest.is_empty() && parts < 8 {
        let Some((number, unit, after)) = lenient_part(rest) else { break };
        let factor = match unit {
            "ms" | "msec" | "millisecond" | "milliseconds" => 1,
            "s" | "sec" | "secs" | "second" | "seconds" => 1_000,
            "m" | "min" | "mins" | "minute" | "minutes" => 60_000,
            "h" | "hr" | "hrs" | "hour" | "hours" => 3_600_000,
            "d" | "day" | "days" => 86_400_000,
            _ => break,
        };
        total_ms += number * factor as f64;
        rest = after.trim_start();
        parts += 1;
    }
    if rest.is_empty() && parts > 0 && total_ms.fract() == 0.0 && total_ms < 1e15 {
        let written = spelled_duration(Duration::from_millis(total_ms as u64));
        if written != s {
            return Err(format!("{s:?}: write \"{written}\" ({how})"));
        }
    }
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?} has no unit: write {how}"));
    }
    Err(format!("{s:?} is not a duration: write {how}"))
}

/// Digits, then the rest.
fn split_number(s: &str) -> (&str, &str) {
    let end = s.bytes().position(|b| !b.is_ascii_digit()).unwrap_or(s.len());
    s.split_at(end)
}

fn valid_digits(digits: &str) -> bool {
    !digits.is_empty() && digits.len() <= MAX_DIGITS
}

fn exact_unit(units: &[(&str, u64)], unit: &str) -> Option<u64> {
    units.iter().find(|(name, _)| *name == unit).map(|(_, f)| *f)
}

/// A number (maybe with a fraction), maybe a space, and letters, as the
/// whole of `s`.
fn lenient(s: &str) -> Option<(f64, &str)> {
    let (number, unit, rest) = lenient_part(s.trim())?;
    rest.trim().is_empty().then_some((number, unit))
}

/// One `<number>[ ]<letters>` at the start of `s`, and what follows.
fn lenient_part(s: &str) -> Option<(f64, &str, &str)> {
    let end = s.bytes().position(|b| !(b.is_ascii_digit() || b == b'.')).unwrap_or(s.len());
    let (number, rest) = s.split_at(end);
    if number.is_empty() || number.len() > 2 * MAX_DIGITS {
        return None;
    }
    let number: f64 = number.parse().ok()?;
    let rest = rest.trim_start();
    let letters = rest.bytes().position(|b| !b.is_ascii_alphabetic()).unwrap_or(rest.len());
    let (unit, after) = rest.split_at(letters);
    Some((number, unit, after))
}

/// `bytes` in the largest unit of its family (binary or decimal) that
/// holds it whole: `53687091200` → `50GiB`.
fn spelled_size(bytes: u64, binary: bool) -> String {
    let unit = SIZE_UNITS
        .iter()
        .filter(|(name, _)| *name == "B" || name.ends_with("iB") == binary)
        .find(|(_, factor)| bytes >= *factor && bytes % factor == 0);
    match unit {
        Some((name, factor)) => format!("{}{name}", bytes / factor),
        None => format!("{bytes}B"),
    }
}

/// `d` in the largest unit that holds it whole, as a config writes it:
/// `300 s` → `5m`, `0` → `0s`.
pub fn spelled_duration(d: Duration) -> String {
    let ms = d.as_millis() as u64;
    if ms == 0 {
        return "0s".to_owned();
    }
    let (name, factor) = DURATION_UNITS.iter().find(|(_, f)| ms % f == 0).copied().unwrap_or(("ms", 1));
    format!("{}{name}", ms / factor)
}

/// A size as an operator reads it: `50 GiB (53687091200 bytes)`; below
/// 1 KiB, `512 bytes`. Whole in a binary unit, else whole in a decimal
/// one, else to one decimal in a binary unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.0;
        if n < 1024 {
            return write!(f, "{n} bytes");
        }
        // The unit that holds it whole in the fewest of them.
        let whole = SIZE_UNITS
            .iter()
            .filter(|(name, factor)| *name != "B" && n % factor == 0)
            .min_by_key(|(_, factor)| n / factor);
        match whole {
            Some((name, factor)) => write!(f, "{} {name} ({n} bytes)", n / factor),
            None => {
                let (name, factor) =
                    SIZE_UNITS[..4].iter().find(|(_, factor)| n >= *factor).copied().unwrap_or(("KiB", 1024));
                write!(f, "{:.1} {name} ({n} bytes)", n as f64 / factor as f64)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_forms_are_read_exactly() {
        for (text, bytes) in [
            ("256MiB", 256u64 << 20),
            ("50GiB", 50 << 30),
            ("12800MiB", 12_800 << 20),
            ("1TiB", 1 << 40),
            ("4KiB", 4096),
            ("512B", 512),
            ("50GB", 50_000_000_000),
            ("2TB", 2_000_000_000_000),
            ("10MB", 10_000_000),
            ("1KB", 1000),
            ("0B", 0),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for (text, ms) in [("500ms", 500u64), ("30s", 30_000), ("5m", 300_000), ("2h", 7_200_000), ("7d", 604_800_000)]
        {
            assert_eq!(parse_duration(text), Ok(Duration::from_millis(ms)), "{text}");
        }
        assert_eq!(parse_duration("0s"), Ok(Duration::ZERO));
    }

    /// A byte count is a whole number and a unit however many digits it
    /// has: the chart writes a fraction of a Kubernetes quantity in bytes
    /// ("15.5Gi" is "16642998272B"). Past u64, "too large", not "not a size".
    #[test]
    fn long_byte_counts_are_sizes_and_only_overflow_is_too_large() {
        for (text, bytes) in [
            ("16642998272B", 16_642_998_272u64),
            ("53687091200B", 50 << 30),
            ("12345678901B", 12_345_678_901),
            ("18446744073709551615B", u64::MAX),
            ("0000000000050GiB", 50 << 30),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for text in ["18446744073709551616B", "99999999999TiB", "16777216TiB", "123456789012345678901234567890B"] {
            let e = parse_size(text).unwrap_err();
            assert_eq!(e, format!("{text:?} is too large"), "{text}");
        }
    }

    #[test]
    fn a_lone_g_is_refused_with_both_meanings() {
        assert_eq!(
            parse_size("50G").unwrap_err(),
            "\"50G\" is ambiguous: write \"50GiB\" (53687091200 bytes) or \"50GB\" (50000000000 bytes)"
        );
        assert!(parse_size("1T").unwrap_err().contains("\"1TiB\" (1099511627776 bytes) or \"1TB\""));
        assert!(parse_size("256m").unwrap_err().contains("\"256MiB\""));
    }

    #[test]
    fn near_misses_are_refused_with_the_spelling_larder_reads() {
        let says = |text: &str, written: &str| {
            let e = parse_size(text).unwrap_err();
            assert!(e.starts_with(&format!("{text:?}: write \"{written}\"")), "{text}: {e}");
        };
        says("50 GiB", "50GiB");
        says("50Gi", "50GiB");
        says("50gib", "50GiB");
        says("1.5GiB", "1536MiB");
        says("2.5GB", "2500MB");
        let e = parse_size("1024").unwrap_err();
        assert!(e.starts_with("\"1024\" has no unit: write \"1024B\""), "{e}");
        let e = parse_size("lots").unwrap_err();
        assert!(e.starts_with("\"lots\" is not a size: write a whole number and a unit"), "{e}");
        assert!(parse_size("20000000TiB").unwrap_err().contains("too large"));

        let says = |text: &str, written: &str| {
            let e = parse_duration(text).unwrap_err();
            assert!(e.starts_with(&format!("{text:?}: write \"{written}\"")), "{text}: {e}");
        };
        says("7 days", "7d");
        says("5 minutes", "5m");
        says("1.5h", "90m");
        says("1h30m", "90m");
        says("1m 30s", "90s");
        says("0.5s", "500ms");
        says("2 h", "2h");
        let e = parse_duration("300").unwrap_err();
        assert!(e.starts_with("\"300\" has no unit"), "{e}");
        for text in ["soon", "101y", "", "5 fortnights", "18446744073709551615s 500ms 500ms"] {
            let e = parse_duration(text).unwrap_err();
            assert!(e.contains("is not a duration") || e.contains("too long"), "{text}: {e}");
        }
    }

    #[test]
    fn sizes_are_shown_with_their_bytes() {
        assert_eq!(Size(50 << 30).to_string(), "50 GiB (53687091200 bytes)");
        assert_eq!(Size(50_000_000_000).to_string(), "50 GB (50000000000 bytes)");
        assert_eq!(Size(1 << 20).to_string(), "1 MiB (1048576 bytes)");
        assert_eq!(Size(1_500_000_001).to_string(), "1.4 GiB (1500000001 bytes)");
        assert_eq!(Size(512).to_string(), "512 bytes");
        assert_eq!(spelled_duration(Duration::from_secs(300)), "5m");
        assert_eq!(spelled_duration(Duration::from_secs(7 * 86_400)), "7d");
        assert_eq!(spelled_duration(Duration::from_millis(1500)), "1500ms");
    }
}
