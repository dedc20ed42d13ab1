//! `WWW-Authenticate` challenges (RFC 9110 §11.6.1) as registries send them:
//! `Bearer realm="…",service="…",scope="…"` or `Basic realm="…"`.

use http::HeaderMap;
use http::header::WWW_AUTHENTICATE;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Challenge {
    Bearer { realm: String, service: Option<String>, scope: Option<String> },
    Basic,
}

/// Longest challenge header parsed; longer ones are refused rather than scanned.
const MAX_CHALLENGE_LEN: usize = 4096;

impl Challenge {
    /// The first Bearer or Basic challenge among the response's headers.
    pub fn from_headers(headers: &HeaderMap) -> Option<Challenge> {
        headers.get_all(WWW_AUTHENTICATE).iter().filter_map(|v| v.to_str().ok()).find_map(Challenge::parse)
    }

    pub fn parse(header: &str) -> Option<Challenge> {
        if header.len() > MAX_CHALLENGE_LEN {
            return None;
        }
        let header = header.trim_start();
        let (scheme, rest) = header.split_once(|c: char| c.is_ascii_whitespace()).unwrap_or((header, ""));
        if scheme.eq_ignore_ascii_case("basic") {
            return Some(Challenge::Basic);
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return None;
        }
        let params = parse_params(rest)?;
        let get = |k: &str| params.iter().find(|(name, _)| name.eq_ignore_ascii_case(k)).map(|(_, v)| v.clone());
        let realm = get("realm").filter(|r| !r.is_empty())?;
        Some(Challenge::Bearer { realm, service: get("service"), scope: get("scope") })
    }
}

/// `name=value` pairs separated by commas; values are tokens or quoted
/// strings with backslash escapes. `None` on malformed input.
fn parse_params(s: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.peek().is_some_and(|c| c.is_ascii_whitespace() || *c == ',') {
            chars.next();
        }
        if chars.peek().is_none() {
            return Some(out);
        }
        let mut name = String::new();
        while let Some(&c) = chars.peek() {
            if c == '=' || c.is_ascii_whitespace() {
                break;
            }
            name.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            chars.next();
        }
        if chars.next() != Some('=') || name.is_empty() {
            return None;
        }
        while chars.peek().is_some_and(|c| c.is_ascii_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next()? {
                    '\\' => value.push(chars.next()?),
                    '"' => break,
                    c => value.push(c),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == ',' || c.is_ascii_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        out.push((name, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_hub_bearer() {
        let c = Challenge::parse(
            r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/alpine:pull""#,
        );
        assert_eq!(
            c,
            Some(Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/alpine:pull".into()),
            })
        );
    }

    #[test]
    fn tokens_spaces_and_escapes() {
        let c = Challenge::parse(r#"bearer realm=https://a/t , service = "x\"y""#).unwrap();
        assert_eq!(c, Challenge::Bearer { realm: "https://a/t".into(), service: Some("x\"y".into()), scope: None });
        assert_eq!(Challenge::parse(r#"Basic realm="Registry Realm""#), Some(Challenge::Basic));
    }

    #[test]
    fn malformed_challenges_are_refused() {
        for bad in [
            "Bearer",
            r#"Bearer service="x""#,
            r#"Bearer realm="unterminated"#,
            "Bearer =x",
            "Negotiate abc",
            r#"Bearer realm="""#,
        ] {
            assert_eq!(Challenge::parse(bad), None, "{bad}");
        }
        assert_eq!(Challenge::parse(&format!("Bearer realm=\"{}\"", "a".repeat(5000))), None);
    }
}
