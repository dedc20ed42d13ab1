//! TOML and schema errors as a user should see them: where (line, column,
//! key) and what, never the value that was written there.

use regex::Regex;

/// A TOML or schema error as "line L, column C, key `K`: message", and
/// the line with its value blanked. Never the value itself: a typo such as
/// `pasword = "hunter2"` must not put the secret into a pod's log. toml's
/// own rendering quotes the whole line, and serde's messages quote the
/// value that had the wrong type (`invalid type: string "hunter2"`), so
/// both are rebuilt here.
pub(super) fn describe_parse_error(text: &str, e: &toml::de::Error) -> String {
    let message = blank_values(e.message().trim_end());
    let Some(span) = e.span() else { return message };
    let at = span.start.min(text.len());
    let line_start = text[..at].rfind('\n').map_or(0, |i| i + 1);
    let line_no = text[..at].matches('\n').count() + 1;
    let column = text[line_start..at].chars().count() + 1;
    let line = text[line_start..].lines().next().unwrap_or_default();
    let key = key_at(&text[..line_start], line).map(|k| format!(", key `{k}`")).unwrap_or_default();
    format!("line {line_no}, column {column}{key}: {message}\n  {line_no} | {}", blank_line(line))
}

/// Replaces what serde and toml quote of a value with `…`: strings, and
/// numbers, booleans and characters in backticks. Field names in
/// backticks (`unknown field `pasword``) stay.
fn blank_values(message: &str) -> String {
    static QUOTED: std::sync::LazyLock<Regex> = std::sync::LazyLock::new(|| {
        Regex::new(r#""(?:[^"\\]|\\.)*"|'[^']*'|((?:integer|floating point|boolean|character) )`[^`]*`"#)
            .expect("a valid pattern")
    });
    QUOTED
        .replace_all(message, |c: &regex::Captures<'_>| match c.get(1) {
            Some(kind) => format!("{}`…`", kind.as_str()),
            None => "\"…\"".to_owned(),
        })
        .into_owned()
}

/// A config line as it may be shown: a table header as it is, a
/// `key = value` line with the value blanked, anything else (a line inside
/// a multi-line value) blanked whole.
fn blank_line(line: &str) -> String {
    let trimmed = line.trim();
    if trimmed.starts_with('[') && !trimmed.contains('=') {
        return trimmed.to_owned();
    }
    match line.split_once('=') {
        Some((key, _)) => format!("{} = …", key.trim()),
        None => "…".to_owned(),
    }
}

/// The dotted key of `line`, given the text before it: its table (with
/// the index of an array of tables, `upstream[1]`) and the key it sets, or
/// the key of the multi-line value it continues.
fn key_at(before: &str, line: &str) -> Option<String> {
    let header = |l: &str| -> Option<(String, bool)> {
        let l = l.trim();
        let (inner, array) = match l.strip_prefix("[[") {
            Some(rest) => (rest.split("]]").next()?, true),
            None => (l.strip_prefix('[')?.split(']').next()?, false),
        };
        Some((inner.trim().to_owned(), array)).filter(|_| !l.contains('='))
    };
    let key_of = |l: &str| l.split_once('=').map(|(k, _)| k.trim().to_owned()).filter(|k| !k.is_empty());
    let mut table: Option<String> = None;
    let mut arrays: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    let mut last_key: Option<String> = None;
    for l in before.lines() {
        if let Some((name, array)) = header(l) {
            table = Some(match array {
                true => {
                    let n = arrays.entry(name.clone()).and_modify(|n| *n += 1).or_insert(0);
                    format!("{name}[{n}]")
                }
                false => name,
            });
            last_key = None;
        } else if let Some(k) = key_of(l) {
            last_key = Some(k);
        }
    }
    if let Some((name, _)) = header(line) {
        return Some(name);
    }
    let key = key_of(line).or(last_key)?;
    Some(match table {
        Some(t) => format!("{t}.{key}"),
        None => key,
    })
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;

    #[test]
    fn parse_errors_name_line_column_and_key_but_never_a_value() {
        let cases = [
            // A typo of a secret's key: serde's "unknown field".
            (
                "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\npasword = \"hunter2\"\n",
                4,
                "upstream[0].pasword",
            ),
            // The wrong type: serde quotes the value it got.
            ("[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nusername = 12345678\n", 4, "upstream[0].username"),
            ("[cache]\nmax_size = \"1GiB\"\n[server]\nlisten = [\"hunter2\"]\n", 4, "server.listen"),
            // Not TOML at all: an unquoted value.
            ("[[upstream]]\nname = \"q.io\"\npassword = hunter2\n", 3, "upstream[0].password"),
            (
                "[[upstream]]\nname = \"a.io\"\nurl = \"https://a.io\"\n[[upstream]]\nname = \"q.io\"\npassword = 'hunter2\n",
                6,
                "upstream[1].password",
            ),
        ];
        for (text, line, key) in cases {
            let e = parse(text).unwrap_err().to_string();
            assert!(e.starts_with(&format!("test.toml: line {line}, column ")), "{text}: {e}");
            assert!(e.contains(&format!("key `{key}`")), "{text}: {e}");
            assert!(!e.contains("hunter2") && !e.contains("12345678"), "{text}: {e}");
        }
        let e = parse("[[upstream]]\nname = \"q.io\"\npasword = \"hunter2\"\n").unwrap_err().to_string();
        assert!(e.contains("unknown field `pasword`"), "field names stay: {e}");
        assert!(e.ends_with("  3 | pasword = …"), "{e}");
    }
}
