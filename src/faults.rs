//! Faults injected into larder's own I/O on the fill path, for the tests:
//! a failing disk or a panic where no real one can be arranged on demand.
//! Only a debug build (the binary the integration tests run) reads
//! `LARDER_INJECT_FAULTS`; in a release build every check is an inlined
//! `Ok(())` and the variable is ignored.
//!
//! The variable is a comma-separated list of rules
//! `point:action[:skip[:times]]`:
//! - `point`: where (see [`Point`]): `temp_write`, `temp_read`,
//!   `blob_read`, `commit`, `fill`;
//! - `action`: an errno name (`EIO`, `ENOSPC`, `EROFS`), returned there as
//!   that I/O error, or `panic`;
//! - `skip`: calls at that point that pass first (default 0);
//! - `times`: calls that fail after them (default: every later one).
//!
//! `temp_read:EIO:0:1` fails the first hash read-back of a ranged fill
//! and no other; `temp_write:ENOSPC:3` lets three temp-file writes through
//! and fails every one after.

/// A place on the fill path where a fault can be injected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Point {
    /// A write of a fill's temp file (in order, or a ranged part's).
    TempWrite,
    /// The hash read-back of bytes ranged parts wrote to the temp file.
    TempRead,
    /// A read of a blob file (committed or filling) for a response body.
    BlobRead,
    /// The fsync and rename of a verified fill.
    Commit,
    /// A fill that has its temp file, before it copies a source's body.
    Fill,
}

/// Passes, or fails as the rules for `point` say: an I/O error, or a panic.
#[cfg(not(debug_assertions))]
#[inline(always)]
pub fn check(_point: Point) -> std::io::Result<()> {
    Ok(())
}

/// Passes, or fails as the rules for `point` say: an I/O error, or a panic.
#[cfg(debug_assertions)]
pub fn check(point: Point) -> std::io::Result<()> {
    armed::check(point)
}

#[cfg(debug_assertions)]
mod armed {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::Point;

    /// The environment variable the rules are read from.
    const VARIABLE: &str = "LARDER_INJECT_FAULTS";

    enum Action {
        Errno(i32),
        Panic,
    }

    struct Rule {
        point: Point,
        action: Action,
        skip: u64,
        times: Option<u64>,
        calls: AtomicU64,
    }

    fn point(name: &str) -> Option<Point> {
        Some(match name {
            "temp_write" => Point::TempWrite,
            "temp_read" => Point::TempRead,
            "blob_read" => Point::BlobRead,
            "commit" => Point::Commit,
            "fill" => Point::Fill,
            _ => return None,
        })
    }

    fn action(name: &str) -> Option<Action> {
        Some(match name {
            "panic" => Action::Panic,
            "EIO" => Action::Errno(libc::EIO),
            "ENOSPC" => Action::Errno(libc::ENOSPC),
            "EROFS" => Action::Errno(libc::EROFS),
            _ => return None,
        })
    }

    fn parse(spec: &str) -> Result<Vec<Rule>, String> {
        spec.split(',')
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(|rule| {
                let bad = || format!("{VARIABLE}: cannot read the rule {rule:?}");
                let mut fields = rule.split(':');
                let point = fields.next().and_then(point).ok_or_else(bad)?;
                let action = fields.next().and_then(action).ok_or_else(bad)?;
                let skip = fields.next().map_or(Ok(0), str::parse).map_err(|_| bad())?;
                let times = fields.next().map(str::parse).transpose().map_err(|_| bad())?;
                if fields.next().is_some() {
                    return Err(bad());
                }
                Ok(Rule { point, action, skip, times, calls: AtomicU64::new(0) })
            })
            .collect()
    }

    fn rules() -> &'static [Rule] {
        static RULES: OnceLock<Vec<Rule>> = OnceLock::new();
        RULES.get_or_init(|| {
            let Ok(spec) = std::env::var(VARIABLE) else { return Vec::new() };
            match parse(&spec) {
                Ok(rules) => {
                    tracing::warn!(rules = spec, "fault injection armed (a debug build's test hook)");
                    rules
                }
                Err(e) => panic!("{e}"),
            }
        })
    }

    pub fn check(point: Point) -> std::io::Result<()> {
        for rule in rules().iter().filter(|r| r.point == point) {
            let call = rule.calls.fetch_add(1, Ordering::Relaxed);
            let failing = call >= rule.skip && rule.times.is_none_or(|t| call - rule.skip < t);
            if !failing {
                continue;
            }
            match rule.action {
                Action::Errno(errno) => {
                    tracing::warn!(?point, call, errno, "injected I/O error");
                    return Err(std::io::Error::from_raw_os_error(errno));
                }
                Action::Panic => panic!("injected panic at {point:?} (call {call})"),
            }
        }
        Ok(())
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn rules_name_a_point_an_action_and_which_calls_fail() {
            let rules = parse("temp_read:EIO:0:1, temp_write:ENOSPC:3,fill:panic").unwrap();
            assert_eq!(rules.len(), 3);
            assert_eq!((rules[0].point, rules[0].skip, rules[0].times), (Point::TempRead, 0, Some(1)));
            assert!(matches!(rules[1].action, Action::Errno(libc::ENOSPC)));
            assert_eq!((rules[1].skip, rules[1].times), (3, None));
            assert!(matches!(rules[2].action, Action::Panic));
            assert!(parse("temp_read").is_err(), "an action is needed");
            assert!(parse("disk:EIO").is_err(), "an unknown point");
            assert!(parse("temp_read:EIO:x").is_err());
            assert!(parse("temp_read:EIO:0:1:2").is_err());
        }
    }
}
