//! Where a mutating admin request comes from: refused when it looks like a
//! browser's cross-site request or a DNS-rebinding one, whatever token it
//! carries.
//!
//! - A page in a browser on the admin listener's host can send
//!   `POST http://127.0.0.1:9090/purge` (a form, or `fetch` with
//!   `mode: "no-cors"`). Browsers mark every such request: `Origin` on
//!   every cross-origin (and same-origin) POST, `Sec-Fetch-Site` on every
//!   request of current browsers. larder's CLI, curl, scripts and the
//!   kubelet send neither, so a mutating request carrying `Origin` (any
//!   value, `null` included) or a `Sec-Fetch-Site` other than `none` (typed
//!   by the user) or `same-origin` is refused.
//! - DNS rebinding: a page at `attacker.example` whose name then resolves
//!   to 127.0.0.1 talks to the admin listener as its own origin, with
//!   `Host: attacker.example`. The host of a mutating request (its `Host`
//!   header and, for HTTP/2 or an absolute URI, the URI's authority; the
//!   port is ignored) must be a loopback address, `localhost`, the
//!   listener's own bound address (unless it is a wildcard), or match
//!   `[admin] allowed_hosts`: names the attacker cannot own.
//!
//! Both rules hold for requests with a valid token too. The token alone
//! already stops a browser or a rebinding page, which cannot know it; the
//! rules are the second lock the issue asks for, cost nothing to the CLI,
//! curl or a script (none sends `Origin`, and each sends the host it was
//! given), and keep a token that leaked into a browser (a header-injecting
//! extension, a saved curl command pasted into a page) from being usable
//! from a web page. The one thing they ask of operators is to list, in
//! `allowed_hosts`, the names they call the admin API by (the chart lists
//! its admin Service's names).

use std::net::IpAddr;

use http::header::{HOST, ORIGIN};
use http::{HeaderMap, Uri};

use crate::config::AdminHost;

/// The request header browsers set to say how the page and target relate.
pub const SEC_FETCH_SITE: &str = "sec-fetch-site";

/// Why a request's provenance was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Suspect {
    /// It carried `Origin` or a cross-site `Sec-Fetch-Site`: a web page sent it.
    CrossSite,
    /// Its host (shown, shortened) is not one the admin listener answers to.
    Host(String),
}

/// The hosts a mutating admin request may name.
#[derive(Clone, Debug, Default)]
pub struct AllowedHosts {
    /// The listener's bound address, unless it is a wildcard.
    bound: Option<IpAddr>,
    configured: Vec<AdminHost>,
}

impl AllowedHosts {
    pub fn new(bound: IpAddr, configured: &[AdminHost]) -> AllowedHosts {
        let bound = Some(bound.to_canonical()).filter(|ip| !ip.is_unspecified());
        AllowedHosts { bound, configured: configured.to_vec() }
    }

    /// Whether a request with these headers and URI may mutate.
    pub fn check(&self, headers: &HeaderMap, uri: &Uri) -> Result<(), Suspect> {
        if headers.contains_key(ORIGIN) {
            return Err(Suspect::CrossSite);
        }
        for site in headers.get_all(SEC_FETCH_SITE) {
            if !matches!(site.to_str().map(str::trim), Ok("none" | "same-origin")) {
                return Err(Suspect::CrossSite);
            }
        }
        let mut named = 0;
        for host in headers.get_all(HOST).iter().map(|v| v.to_str().unwrap_or("\u{fffd}")) {
            named += 1;
            self.check_host(host)?;
        }
        if let Some(authority) = uri.authority() {
            named += 1;
            self.check_host(authority.as_str())?;
        }
        if named == 0 {
            // HTTP/1.0 without Host: no browser sends that, but neither does
            // any client of ours; refused like a wrong host.
            return Err(Suspect::Host(String::new()));
        }
        Ok(())
    }

    /// `host[:port]` or `[v6]:port`, checked against the allowed hosts.
    fn check_host(&self, authority: &str) -> Result<(), Suspect> {
        let suspect = || Suspect::Host(authority.chars().take(100).collect());
        let parsed: http::uri::Authority = authority.parse().map_err(|_| suspect())?;
        // Userinfo (`user@host`) has no place in a Host header.
        if parsed.as_str().contains('@') {
            return Err(suspect());
        }
        let host = parsed.host().trim_start_matches('[').trim_end_matches(']');
        let host = host.strip_suffix('.').unwrap_or(host).to_ascii_lowercase();
        if let Ok(ip) = host.parse::<IpAddr>() {
            let ip = ip.to_canonical();
            let allowed = ip.is_loopback()
                || self.bound == Some(ip)
                || self.configured.iter().any(|h| matches!(h, AdminHost::Ip(a) if *a == ip));
            return if allowed { Ok(()) } else { Err(suspect()) };
        }
        let allowed = host == "localhost"
            || self.configured.iter().any(|h| match h {
                AdminHost::Name(name) => *name == host,
                AdminHost::Subdomains(domain) => {
                    host.strip_suffix(domain.as_str()).is_some_and(|prefix| prefix.len() > 1 && prefix.ends_with('.'))
                }
                AdminHost::Ip(_) => false,
            });
        if allowed { Ok(()) } else { Err(suspect()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(headers: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in headers {
            h.append(http::HeaderName::from_bytes(name.as_bytes()).unwrap(), value.parse().unwrap());
        }
        h
    }

    fn hosts(bound: &str, configured: &[AdminHost]) -> AllowedHosts {
        AllowedHosts::new(bound.parse().unwrap(), configured)
    }

    fn path() -> Uri {
        "/purge?upstream=docker.io".parse().unwrap()
    }

    #[test]
    fn a_browsers_marks_are_refused_whatever_the_host() {
        let allowed = hosts("127.0.0.1", &[]);
        let host = ("host", "127.0.0.1:9090");
        for marks in [
            vec![("origin", "https://evil.example")],
            vec![("origin", "null")],
            vec![("origin", "http://127.0.0.1:9090")],
            vec![("sec-fetch-site", "cross-site")],
            vec![("sec-fetch-site", "same-site")],
            vec![("sec-fetch-site", "none"), ("sec-fetch-site", "cross-site")],
        ] {
            let mut headers = marks.clone();
            headers.push(host);
            assert_eq!(allowed.check(&request(&headers), &path()), Err(Suspect::CrossSite), "{marks:?}");
        }
        for fine in ["none", "same-origin"] {
            assert_eq!(allowed.check(&request(&[host, ("sec-fetch-site", fine)]), &path()), Ok(()), "{fine}");
        }
    }

    #[test]
    fn only_loopback_localhost_the_bound_address_and_configured_names_are_hosts() {
        let configured = [
            AdminHost::Name("larder-admin.larder.svc".into()),
            AdminHost::Subdomains("larder-headless.larder.svc".into()),
            AdminHost::Ip("fd00::5".parse().unwrap()),
        ];
        let allowed = hosts("10.0.0.7", &configured);
        for fine in [
            "127.0.0.1:9090",
            "127.0.0.1",
            "127.9.9.9:1",
            "[::1]:9090",
            "[::ffff:127.0.0.1]:9090",
            "localhost:9090",
            "LOCALHOST",
            "localhost.:9090",
            "10.0.0.7:9090",
            "larder-admin.larder.svc:9090",
            "Larder-Admin.larder.svc",
            "larder-0.larder-headless.larder.svc:9090",
            "[fd00::5]:9090",
        ] {
            assert_eq!(allowed.check(&request(&[("host", fine)]), &path()), Ok(()), "{fine}");
        }
        for refused in [
            "attacker.example:9090",
            "localhost.attacker.example",
            "127.0.0.1.attacker.example",
            "larder-headless.larder.svc",
            "evil-larder-headless.larder.svc",
            "larder-admin.larder.svc.attacker.example",
            "10.0.0.8:9090",
            "[fd00::6]:9090",
            "2130706433",
            "user@127.0.0.1",
            "",
            "bad host",
        ] {
            assert!(
                matches!(allowed.check(&request(&[("host", refused)]), &path()), Err(Suspect::Host(_))),
                "{refused}"
            );
        }
        assert!(matches!(allowed.check(&HeaderMap::new(), &path()), Err(Suspect::Host(_))), "no host at all");
        let two = request(&[("host", "127.0.0.1"), ("host", "attacker.example")]);
        assert!(matches!(allowed.check(&two, &path()), Err(Suspect::Host(_))), "every Host must be allowed");
    }

    #[test]
    fn the_uri_authority_counts_too_and_a_wildcard_bind_adds_nothing() {
        let wildcard = hosts("0.0.0.0", &[]);
        let absolute: Uri = "http://attacker.example:9090/purge".parse().unwrap();
        let host = request(&[("host", "127.0.0.1:9090")]);
        assert!(matches!(wildcard.check(&host, &absolute), Err(Suspect::Host(_))));
        let h2: Uri = "https://127.0.0.1:9090/purge".parse().unwrap();
        assert_eq!(wildcard.check(&HeaderMap::new(), &h2), Ok(()), "HTTP/2: the :authority");
        assert!(matches!(wildcard.check(&request(&[("host", "0.0.0.0:9090")]), &path()), Err(Suspect::Host(_))));
        assert!(matches!(hosts("::", &[]).check(&request(&[("host", "[::]:9090")]), &path()), Err(Suspect::Host(_))));
    }
}
