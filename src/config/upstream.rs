//! `[[upstream]]`: each registry larder pulls from, where it is, whose
//! credentials go where, and its timeouts and tag rules.

use std::fmt;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Duration;

use regex::Regex;
use serde::Deserialize;

use super::cache::CacheConfig;
use super::credentials::{CredentialSource, RawCredentials};
use super::{Config, ConfigError, Validator, valid_host};
use crate::policy::{RepoGlob, RepoPolicy};

/// Largest `max_concurrency` accepted (tokio's semaphore has a limit, and
/// more open requests than this to one registry is a mistake).
pub const MAX_MAX_CONCURRENCY: usize = 65_536;
/// Default number of open upstream requests per upstream.
pub const DEFAULT_MAX_CONCURRENCY: usize = 32;
/// Default number of ranged GETs one fill of a large blob keeps open at once.
pub const DEFAULT_FILL_CONNECTIONS: usize = 4;
/// Largest `fill_connections` accepted: more connections to one registry
/// for one blob than this is abuse, not speed.
pub const MAX_FILL_CONNECTIONS: usize = 16;
/// Default time allowed to establish an upstream connection (TCP + TLS).
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Default wait for upstream response headers. containerd gives up on a
/// mirror after 30 s without headers, so larder must answer well before.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(20);
/// Default longest pause between two chunks of an upstream body.
pub const DEFAULT_BODY_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Most URLs one upstream may list in `urls` (a primary and its fallbacks):
/// each is tried in turn while the ones before it fail.
pub const MAX_UPSTREAM_URLS: usize = 8;
/// Names that mean Docker Hub, where one-component repositories live under
/// `library/`.
const DOCKER_HUB_NAMES: [&str; 3] = ["docker.io", "index.docker.io", "registry-1.docker.io"];
/// Smallest `max_bandwidth` accepted, in bytes per second: below it a
/// fill's chunk waits longer than a client or a registry waits on a quiet
/// connection.
pub const MIN_MAX_BANDWIDTH: u64 = 64 << 10;
/// Longest upstream timeout accepted (connect, response headers, body
/// idle). A client connection sees no byte while larder waits on upstream,
/// and the connection watchdog closes connections idle for longer than its
/// own limit: upstream waits must end first, so the client gets a 504
/// instead of a cut connection (checked against the watchdog at compile time).
pub const MAX_UPSTREAM_TIMEOUT: Duration = Duration::from_secs(100);
/// Default `client_credentials_ttl`: how long a (client credentials,
/// repository) pair upstream accepted is trusted without asking again.
pub const DEFAULT_CLIENT_CREDENTIALS_TTL: Duration = Duration::from_secs(300);
/// Longest `client_credentials_ttl` accepted: a revoked pull secret keeps
/// working through larder for at most this long.
pub const MAX_CLIENT_CREDENTIALS_TTL: Duration = Duration::from_secs(24 * 3600);

/// `client_credentials`: what larder does with the Basic credentials a
/// client sends for this upstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientCredentialsMode {
    /// Ignored (the default): larder's own grants decide, as before.
    Ignore,
    /// Every request needs credentials the upstream itself accepts for
    /// pulling the repository (`crate::upstream::verify`), cached or not.
    Verify {
        /// How long a verified pair is trusted (`client_credentials_ttl`).
        ttl: Duration,
    },
}

#[derive(Debug, Clone)]
pub struct UpstreamConfig {
    /// Lookup key for `?ns=` and the `/v2/<name>/…` path prefix.
    pub name: String,
    pub aliases: Vec<String>,
    /// Scheme and authority of the registry; larder only ever dials this
    /// (and `fallback_urls`), plus the token realms and redirect targets
    /// they name under the rules in `crate::upstream`.
    pub url: http::Uri,
    /// Further URLs from `urls = [primary, fallback…]`, tried in order when
    /// the ones before fail to connect or answer 5xx. They are the
    /// upstream's own origins (dialled whatever their address), but only
    /// those marked so get its credentials.
    pub fallback_urls: Vec<FallbackUrl>,
    /// Another larder (a cluster's hub) this upstream's requests go to
    /// instead, with `?ns=<name>`: node → hub → registry, one upstream
    /// fetch for the whole cluster. `url` is then never dialed.
    pub via: Option<http::Uri>,
    pub default: bool,
    /// Docker Hub keeps one-component names under `library/`.
    pub library_namespace: bool,
    /// Where the upstream's credentials come from; `None`: anonymous.
    pub credentials: Option<CredentialSource>,
    /// Token realms on other domains that may receive the upstream's
    /// credentials (`trusted_realms`): scheme, host and port must match, and
    /// the path too unless the entry has none.
    pub trusted_realms: Vec<http::Uri>,
    /// Networks that redirect targets and token realms of this upstream
    /// may be in although they are loopback, link-local, private or
    /// otherwise not public (`trusted_networks`); see `crate::upstream::dial`.
    pub trusted_networks: Vec<ipnet::IpNet>,
    /// `allow` and `deny`: which repositories of this upstream larder
    /// serves at all (checked before any cache read or dial).
    pub policy: RepoPolicy,
    /// This upstream's share of the cache (`max_size`): its content is
    /// evicted, least recently used first, to stay under it.
    pub max_size: Option<u64>,
    /// Bytes per second all this upstream's fills may read together
    /// (`max_bandwidth`), client fills first; `None`: unlimited.
    pub max_bandwidth: Option<u64>,
    pub tag_ttl: Option<Duration>,
    pub immutable_tags: Vec<Regex>,
    /// Open upstream requests allowed at once; further requests wait in order.
    pub max_concurrency: NonZeroUsize,
    /// Ranged GETs one fill of a blob of at least `cache.parallel_fill_min`
    /// keeps open at once (1: one stream, as for smaller blobs).
    pub fill_connections: NonZeroUsize,
    /// Whether a client's first request for a layer of an image starts
    /// the fills of its other layers that are not cached, ahead of the
    /// client asking for them.
    pub fill_ahead: bool,
    pub ca_file: Option<PathBuf>,
    pub connect_timeout: Duration,
    pub response_timeout: Duration,
    pub body_idle_timeout: Duration,
    /// `client_credentials` and `client_credentials_ttl`.
    pub client_credentials: ClientCredentialsMode,
}

/// A fallback of `urls`, and whether it gets the upstream's credentials:
/// by default only when it is on the site of the first URL
/// ([`crate::site`]); `{ url = "…", credentials = true }` sends them to
/// another site, `false` keeps them from one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackUrl {
    pub url: http::Uri,
    pub credentials: bool,
}

#[cfg_attr(test, derive(schemars::JsonSchema))]
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    name: String,
    url: Option<String>,
    urls: Option<Vec<RawUrl>>,
    via: Option<String>,
    #[serde(default)]
    default: bool,
    #[serde(default)]
    aliases: Vec<String>,
    library_namespace: Option<bool>,
    username: Option<String>,
    password: Option<String>,
    password_file: Option<String>,
    password_env: Option<String>,
    credential_helper: Option<String>,
    #[serde(default)]
    trusted_realms: Vec<String>,
    #[serde(default)]
    trusted_networks: Vec<String>,
    #[serde(default)]
    allow: Vec<String>,
    #[serde(default)]
    deny: Vec<String>,
    max_size: Option<String>,
    max_bandwidth: Option<String>,
    tag_ttl: Option<String>,
    #[serde(default)]
    immutable_tags: Vec<String>,
    max_concurrency: Option<usize>,
    fill_connections: Option<usize>,
    fill_ahead: Option<bool>,
    ca_file: Option<String>,
    connect_timeout: Option<String>,
    response_timeout: Option<String>,
    body_idle_timeout: Option<String>,
    client_credentials: Option<String>,
    client_credentials_ttl: Option<String>,
}

/// One entry of `urls`: `"https://host"`, or
/// `{ url = "https://host", credentials = true|false }`.
#[cfg_attr(test, derive(schemars::JsonSchema))]
struct RawUrl {
    url: String,
    credentials: Option<bool>,
}

impl<'de> Deserialize<'de> for RawUrl {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<RawUrl, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Table {
            url: String,
            credentials: Option<bool>,
        }
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = RawUrl;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a URL, or a table { url = \"…\", credentials = true|false }")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RawUrl, E> {
                Ok(RawUrl { url: v.to_owned(), credentials: None })
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<RawUrl, A::Error> {
                let t = Table::deserialize(serde::de::value::MapAccessDeserializer::new(map))?;
                Ok(RawUrl { url: t.url, credentials: t.credentials })
            }
        }
        d.deserialize_any(Visitor)
    }
}

impl ClientCredentialsMode {
    /// Whether clients' credentials are checked with the upstream.
    pub fn verifies(&self) -> bool {
        matches!(self, ClientCredentialsMode::Verify { .. })
    }
}

impl UpstreamConfig {
    pub fn tag_ttl(&self, cache: &CacheConfig) -> Duration {
        self.tag_ttl.unwrap_or(cache.tag_ttl)
    }

    /// Whether a tag matches one of the `immutable_tags` patterns.
    pub fn tag_is_immutable(&self, tag: &str) -> bool {
        self.immutable_tags.iter().any(|r| r.is_match(tag))
    }

    /// The host (and port) larder dials for this upstream.
    pub fn authority(&self) -> &str {
        self.url.authority().map(|a| a.as_str()).unwrap_or_default()
    }
}

impl Config {
    /// Where an upstream's credentials go across sites, or where a
    /// fallback on another site pulls without them (see [`Config::warnings`]).
    pub(super) fn fallback_warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for (i, u) in self.upstreams.iter().enumerate() {
            if u.credentials.is_none() {
                continue;
            }
            let primary = crate::site::host_of(&u.url);
            for (j, f) in u.fallback_urls.iter().enumerate() {
                let host = crate::site::host_of(&f.url);
                if crate::site::same_site(&primary, &host) {
                    continue;
                }
                let key = format!("upstream[{i}].urls[{}]", j + 1);
                warnings.push(match f.credentials {
                    true => format!(
                        "`{key}`: upstream {:?} sends its credentials to {host:?} as well as to {primary:?}, \
                         another site (credentials = true)",
                        u.name
                    ),
                    false => format!(
                        "`{key}`: {host:?} is not on the site of {primary:?}, so pulls through it are anonymous; \
                         write {{ url = \"{}\", credentials = true }} to send upstream {:?}'s credentials there",
                        f.url.to_string().trim_end_matches('/'),
                        u.name
                    ),
                });
            }
        }
        warnings
    }
}

/// The fallbacks of `urls`, each with its `credentials` setting if it has one.
type Fallbacks = Vec<(http::Uri, Option<bool>)>;

impl Validator<'_> {
    /// Every `[[upstream]]`, and the rules across them: names and aliases
    /// used once, at most one default.
    pub(super) fn upstreams(&self, raw: Vec<RawUpstream>) -> Result<Vec<UpstreamConfig>, ConfigError> {
        if raw.is_empty() {
            return Err(self.err("upstream", "at least one [[upstream]] is required"));
        }
        let upstreams = raw.into_iter().enumerate().map(|(i, u)| self.upstream(i, u)).collect::<Result<Vec<_>, _>>()?;
        let mut seen = std::collections::HashSet::new();
        for (i, u) in upstreams.iter().enumerate() {
            for key in std::iter::once(&u.name).chain(&u.aliases) {
                if !seen.insert(key.clone()) {
                    return Err(self.err(format!("upstream[{i}]"), format!("name or alias {key:?} is used twice")));
                }
            }
        }
        if upstreams.iter().filter(|u| u.default).count() > 1 {
            return Err(self.err("upstream.default", "only one upstream can be `default = true`"));
        }
        Ok(upstreams)
    }

    /// An upstream timeout: more than zero (zero fails every request) and
    /// at most [`MAX_UPSTREAM_TIMEOUT`].
    fn upstream_timeout(&self, key: &str, v: Option<&str>, default: Duration) -> Result<Duration, ConfigError> {
        let d = self.duration(key, v, default)?;
        if d.is_zero() || d > MAX_UPSTREAM_TIMEOUT {
            return Err(self.err(
                key,
                format!(
                    "must be more than 0s and at most {}s (clients are cut off by the connection idle limit \
                     beyond that)",
                    MAX_UPSTREAM_TIMEOUT.as_secs()
                ),
            ));
        }
        Ok(d)
    }

    fn upstream(&self, i: usize, u: RawUpstream) -> Result<UpstreamConfig, ConfigError> {
        let key = |k: &str| format!("upstream[{i}].{k}");
        for (k, host) in std::iter::once(("name", &u.name)).chain(u.aliases.iter().map(|a| ("aliases", a))) {
            if !valid_host(host) {
                return Err(self.err(key(k), format!("{host:?} is not a registry host name like \"ghcr.io\"")));
            }
        }
        let (url, fallbacks) = self.upstream_urls(&key, u.url.as_deref(), u.urls.as_deref())?;
        let via = match u.via.as_deref() {
            None => None,
            Some(text) => {
                let (via, more) = self.upstream_urls(&|_| key("via"), Some(text), None)?;
                debug_assert!(more.is_empty());
                if !fallbacks.is_empty() {
                    return Err(self.err(key("via"), "`via` sends every request to one larder: drop `urls`"));
                }
                // The hub is this upstream's only origin: credentials here
                // would go to the hub (over cleartext HTTP, as the chart
                // wires it) whenever it answers 401. The hub's own upstream
                // holds the registry credentials.
                let credential_keys = [
                    ("username", u.username.is_some()),
                    ("password", u.password.is_some()),
                    ("password_file", u.password_file.is_some()),
                    ("password_env", u.password_env.is_some()),
                    ("credential_helper", u.credential_helper.is_some()),
                ];
                if let Some((set, _)) = credential_keys.iter().find(|(_, set)| *set) {
                    return Err(self.err(
                        key("via"),
                        format!(
                            "an upstream with `via` sends every request to the hub larder, so it cannot have \
                             credentials: drop `{}` here and set the registry's credentials on the hub's \
                             upstream {:?}",
                            key(set),
                            u.name
                        ),
                    ));
                }
                Some(via)
            }
        };
        let is_docker_hub = |h: &str| DOCKER_HUB_NAMES.contains(&h);
        let host = url.host().unwrap_or_default().to_ascii_lowercase();
        // Docker Hub by its name or an alias as much as by its URL: users
        // point `docker.io` at mirror.gcr.io or a corporate Hub mirror.
        let library_namespace = u
            .library_namespace
            .unwrap_or(is_docker_hub(&host) || is_docker_hub(&u.name) || u.aliases.iter().any(|a| is_docker_hub(a)));
        let raw_credentials = RawCredentials {
            username: u.username,
            password: u.password,
            password_file: u.password_file,
            password_env: u.password_env,
            credential_helper: u.credential_helper,
        };
        let credentials = self.credentials(&key, &raw_credentials)?;
        let primary_host = crate::site::host_of(&url);
        let fallback_urls = fallbacks
            .into_iter()
            .map(|(url, credentials)| {
                let same_site = crate::site::same_site(&primary_host, &crate::site::host_of(&url));
                FallbackUrl { credentials: credentials.unwrap_or(same_site), url }
            })
            .collect();
        let trusted_networks = u
            .trusted_networks
            .iter()
            .enumerate()
            .map(|(j, n)| {
                n.parse::<ipnet::IpNet>().map(|n| n.trunc()).map_err(|_| {
                    self.err(
                        format!("upstream[{i}].trusted_networks[{j}]"),
                        format!("{n:?} is not a network like \"10.20.0.0/16\" or \"fd12:3456::/48\""),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let globs = |k: &str, list: &[String]| {
            list.iter()
                .enumerate()
                .map(|(j, g)| RepoGlob::parse(g).map_err(|e| self.err(format!("upstream[{i}].{k}[{j}]"), e)))
                .collect::<Result<Vec<_>, _>>()
        };
        let policy = RepoPolicy { allow: globs("allow", &u.allow)?, deny: globs("deny", &u.deny)? };
        let trusted_realms = u
            .trusted_realms
            .iter()
            .enumerate()
            .map(|(j, r)| self.trusted_realm(&format!("upstream[{i}].trusted_realms[{j}]"), r, &url))
            .collect::<Result<Vec<_>, _>>()?;

        let immutable_tags = u
            .immutable_tags
            .iter()
            .enumerate()
            .map(|(j, p)| {
                Regex::new(p).map_err(|e| self.err(format!("upstream[{i}].immutable_tags[{j}]"), e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        let max_concurrency = NonZeroUsize::new(u.max_concurrency.unwrap_or(DEFAULT_MAX_CONCURRENCY))
            .filter(|n| n.get() <= MAX_MAX_CONCURRENCY)
            .ok_or_else(|| self.err(key("max_concurrency"), format!("must be between 1 and {MAX_MAX_CONCURRENCY}")))?;
        let max_size = match u.max_size.as_deref() {
            None => None,
            Some(v) => Some(self.size(&key("max_size"), Some(v), 0)?),
        };
        if let Some(m) = max_size.filter(|m| *m < super::MIN_MAX_SIZE) {
            let (m, min) = (super::units::Size(m), super::units::Size(super::MIN_MAX_SIZE));
            return Err(self.err(key("max_size"), format!("{m} is less than the minimum, {min}")));
        }
        let max_bandwidth = match u.max_bandwidth.as_deref() {
            None => None,
            // "50MiB" or "50MiB/s": bytes per second either way.
            Some(v) => Some(self.size(&key("max_bandwidth"), Some(v.strip_suffix("/s").unwrap_or(v)), 0)?),
        };
        if max_bandwidth.is_some_and(|b| b < MIN_MAX_BANDWIDTH) {
            return Err(self.err(key("max_bandwidth"), "must be at least 64KiB (bytes per second)"));
        }
        let fill_connections = NonZeroUsize::new(u.fill_connections.unwrap_or(DEFAULT_FILL_CONNECTIONS))
            .filter(|n| n.get() <= MAX_FILL_CONNECTIONS)
            .ok_or_else(|| {
                self.err(key("fill_connections"), format!("must be between 1 and {MAX_FILL_CONNECTIONS}"))
            })?;
        let ca_file = u.ca_file.as_deref().map(|f| self.path(f));
        if let Some(ca) = &ca_file {
            if !self.skip(&key("ca_file"), || format!("{} was not opened", ca.display())) && !ca.is_file() {
                return Err(self.err(key("ca_file"), format!("{} is not a readable file", ca.display())));
            }
        }
        let client_credentials = self.client_credentials(
            &key,
            u.client_credentials.as_deref(),
            u.client_credentials_ttl.as_deref(),
            via.is_some(),
        )?;
        Ok(UpstreamConfig {
            name: u.name,
            aliases: u.aliases,
            url,
            fallback_urls,
            via,
            default: u.default,
            library_namespace,
            credentials,
            trusted_realms,
            trusted_networks,
            policy,
            max_size,
            max_bandwidth,
            tag_ttl: u
                .tag_ttl
                .as_deref()
                .map(|t| self.duration(&key("tag_ttl"), Some(t), Duration::ZERO))
                .transpose()?,
            immutable_tags,
            max_concurrency,
            fill_connections,
            fill_ahead: u.fill_ahead.unwrap_or(true),
            ca_file,
            client_credentials,
            connect_timeout: self.upstream_timeout(
                &key("connect_timeout"),
                u.connect_timeout.as_deref(),
                DEFAULT_CONNECT_TIMEOUT,
            )?,
            response_timeout: self.upstream_timeout(
                &key("response_timeout"),
                u.response_timeout.as_deref(),
                DEFAULT_RESPONSE_TIMEOUT,
            )?,
            body_idle_timeout: self.upstream_timeout(
                &key("body_idle_timeout"),
                u.body_idle_timeout.as_deref(),
                DEFAULT_BODY_IDLE_TIMEOUT,
            )?,
        })
    }

    /// `client_credentials = "verify" | "ignore"` and its ttl. An upstream
    /// with `via` cannot verify: it never dials the registry, and a
    /// client's credentials never go to the hub.
    fn client_credentials(
        &self,
        key: &dyn Fn(&str) -> String,
        mode: Option<&str>,
        ttl: Option<&str>,
        via: bool,
    ) -> Result<ClientCredentialsMode, ConfigError> {
        match mode.unwrap_or("ignore") {
            "ignore" => {
                if ttl.is_some() {
                    return Err(
                        self.err(key("client_credentials_ttl"), "applies only with client_credentials = \"verify\"")
                    );
                }
                Ok(ClientCredentialsMode::Ignore)
            }
            "verify" => {
                if via {
                    return Err(self.err(
                        key("client_credentials"),
                        "an upstream with `via` never asks the registry itself, and a client's credentials never go \
                         to the hub: set client_credentials = \"verify\" on the larder that clients reach and that \
                         dials the registry",
                    ));
                }
                let k = key("client_credentials_ttl");
                let ttl = self.duration(&k, ttl, DEFAULT_CLIENT_CREDENTIALS_TTL)?;
                if ttl.is_zero() || ttl > MAX_CLIENT_CREDENTIALS_TTL {
                    return Err(self.err(
                        k,
                        format!("must be more than 0s and at most {}h", MAX_CLIENT_CREDENTIALS_TTL.as_secs() / 3600),
                    ));
                }
                Ok(ClientCredentialsMode::Verify { ttl })
            }
            other => Err(self.err(key("client_credentials"), format!("{other:?} is not \"verify\" or \"ignore\""))),
        }
    }

    /// `url`, or `urls = [primary, fallback…]`: exactly one of the two.
    /// The primary, and each fallback with its `credentials` setting.
    fn upstream_urls(
        &self,
        key: &dyn Fn(&str) -> String,
        url: Option<&str>,
        urls: Option<&[RawUrl]>,
    ) -> Result<(http::Uri, Fallbacks), ConfigError> {
        let (k, list): (String, Vec<(&str, Option<bool>)>) = match (url, urls) {
            (Some(u), None) => (key("url"), vec![(u, None)]),
            (None, Some(list)) => (key("urls"), list.iter().map(|u| (u.url.as_str(), u.credentials)).collect()),
            (None, None) => return Err(self.err(key("url"), "required (or `urls` for a primary and fallbacks)")),
            (Some(_), Some(_)) => return Err(self.err(key("urls"), "set either `url` or `urls`, not both")),
        };
        if list.is_empty() || list.len() > MAX_UPSTREAM_URLS {
            return Err(self.err(k, format!("must list between 1 and {MAX_UPSTREAM_URLS} URLs")));
        }
        let mut parsed: Vec<(http::Uri, Option<bool>)> = Vec::with_capacity(list.len());
        for (text, credentials) in list {
            let uri: http::Uri = text.parse().map_err(|e| self.err(&k, format!("{text:?} is not a URL: {e}")))?;
            let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
            let path_ok = matches!(uri.path(), "" | "/") && uri.query().is_none();
            let userinfo = uri.authority().is_some_and(|a| a.as_str().contains('@'));
            if !scheme_ok || uri.authority().is_none() || !path_ok || userinfo {
                return Err(self.err(&k, format!("{text:?} must be http(s)://host[:port] with no path")));
            }
            if parsed.iter().any(|(p, _)| p.scheme() == uri.scheme() && p.authority() == uri.authority()) {
                return Err(self.err(&k, format!("{text:?} is listed twice")));
            }
            parsed.push((uri, credentials));
        }
        let (primary, credentials) = parsed.remove(0);
        if credentials.is_some() {
            return Err(self.err(
                format!("{k}[0].credentials"),
                "the first URL is the registry itself and always gets the upstream's credentials; \
                 `credentials` chooses for the fallbacks after it",
            ));
        }
        Ok((primary, parsed))
    }

    /// One `trusted_realms` entry: an absolute http(s) URL, https unless
    /// the upstream itself is http, without userinfo or query.
    fn trusted_realm(&self, key: &str, text: &str, upstream: &http::Uri) -> Result<http::Uri, ConfigError> {
        let uri: http::Uri = text.parse().map_err(|e| self.err(key, format!("{text:?} is not a URL: {e}")))?;
        let Some(authority) = uri.authority() else {
            return Err(self.err(key, format!("{text:?} must be a URL like \"https://auth.example.com/token\"")));
        };
        if authority.as_str().contains('@') || uri.query().is_some() || authority.host().is_empty() {
            return Err(self.err(key, format!("{text:?} must be scheme://host[:port][/path], without user or query")));
        }
        match (uri.scheme_str(), upstream.scheme_str()) {
            (Some("https"), _) | (Some("http"), Some("http")) => Ok(uri),
            (Some("http"), _) => {
                Err(self.err(key, format!("{text:?} must be https: credentials never travel in clear text")))
            }
            _ => Err(self.err(key, format!("{text:?} is not an http(s) URL"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn upstream_timeouts_must_end_before_the_client_idle_limit() {
        for key in ["connect_timeout", "response_timeout", "body_idle_timeout"] {
            for value in ["0s", "101s", "10m"] {
                let text = format!("{MINIMAL}{key} = \"{value}\"\n");
                let e = parse(&text).unwrap_err().to_string();
                assert!(e.contains(&format!("`upstream[0].{key}`")), "{key} = {value}: {e}");
            }
            assert!(parse(&format!("{MINIMAL}{key} = \"100s\"\n")).is_ok());
        }
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.cache.max_blob_size, c.cache.max_size / 4, "a quarter of max_size by default");
    }

    #[test]
    fn max_bandwidth_is_bytes_per_second_with_or_without_a_per_second_suffix() {
        assert_eq!(parse(MINIMAL).unwrap().upstreams[0].max_bandwidth, None, "unlimited by default");
        for value in ["50MiB", "50MiB/s", "52428800B", "52428800B/s"] {
            let c = parse(&format!("{MINIMAL}max_bandwidth = \"{value}\"\n")).unwrap();
            assert_eq!(c.upstreams[0].max_bandwidth, Some(50 << 20), "{value}");
        }
        for value in ["fast", "1KiB", "0", "52428800"] {
            let e = parse(&format!("{MINIMAL}max_bandwidth = \"{value}\"\n")).unwrap_err().to_string();
            assert!(e.contains("`upstream[0].max_bandwidth`"), "{value}: {e}");
        }
    }

    #[test]
    fn duplicate_names_and_defaults_are_refused() {
        let twice = format!("{MINIMAL}{MINIMAL}");
        assert!(parse(&twice).unwrap_err().to_string().contains("used twice"));
        let two_defaults =
            format!("{MINIMAL}\n[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\ndefault = true\n");
        assert!(parse(&two_defaults).unwrap_err().to_string().contains("only one upstream"));
        assert!(parse("").unwrap_err().to_string().contains("at least one"));
    }

    #[test]
    fn docker_io_by_name_or_alias_defaults_to_the_library_namespace() {
        let upstream = |extra: &str| {
            let c = parse(&format!("[[upstream]]\n{extra}\n")).unwrap();
            c.upstreams[0].library_namespace
        };
        assert!(upstream("name = \"docker.io\"\nurl = \"https://mirror.gcr.io\""));
        assert!(upstream("name = \"hub.corp.example\"\naliases = [\"docker.io\"]\nurl = \"https://hub.corp.example\""));
        assert!(upstream("name = \"hub.corp.example\"\nurl = \"https://registry-1.docker.io\""));
        assert!(!upstream("name = \"docker.io\"\nurl = \"https://mirror.gcr.io\"\nlibrary_namespace = false"));
        assert!(!upstream("name = \"ghcr.io\"\nurl = \"https://ghcr.io\""));
    }

    #[test]
    fn trusted_realms_credential_helper_and_urls() {
        let c = parse(
            "[[upstream]]\nname = \"nvcr.io\"\nurl = \"https://nvcr.io\"\n\
             trusted_realms = [\"https://authn.nvidia.com/token\"]\n\
             [[upstream]]\nname = \"ecr.example\"\nurls = [\"https://a.example\", \"https://b.example:8443\"]\n\
             credential_helper = \"ecr-login\"\n",
        )
        .unwrap();
        assert_eq!(c.upstreams[0].trusted_realms[0].to_string(), "https://authn.nvidia.com/token");
        let ecr = &c.upstreams[1];
        assert!(matches!(&ecr.credentials, Some(CredentialSource::Helper(n)) if n == "ecr-login"));
        assert_eq!(ecr.url.to_string(), "https://a.example/");
        assert_eq!(
            ecr.fallback_urls.iter().map(|u| (u.url.to_string(), u.credentials)).collect::<Vec<_>>(),
            [("https://b.example:8443/".to_owned(), false)]
        );

        let cases = [
            (
                "url = \"https://q.io\"\ntrusted_realms = [\"http://auth.q.io/token\"]",
                "upstream[0].trusted_realms[0]",
                "https",
            ),
            ("url = \"https://q.io\"\ntrusted_realms = [\"auth.q.io/token\"]", "upstream[0].trusted_realms[0]", "URL"),
            (
                "url = \"https://q.io\"\ntrusted_realms = [\"https://u@auth.q.io/token\"]",
                "upstream[0].trusted_realms[0]",
                "without user",
            ),
            ("url = \"https://q.io\"\ncredential_helper = \"../evil\"", "upstream[0].credential_helper", "helper name"),
            (
                "url = \"https://q.io\"\ncredential_helper = \"x\"\nusername = \"u\"\npassword = \"p\"",
                "upstream[0].credential_helper",
                "not both",
            ),
            ("url = \"https://q.io\"\nurls = [\"https://q.io\"]", "upstream[0].urls", "not both"),
            ("urls = []", "upstream[0].urls", "between 1 and"),
            ("urls = [\"https://q.io\", \"https://q.io\"]", "upstream[0].urls", "twice"),
            ("urls = [\"https://q.io/v2\"]", "upstream[0].urls", "no path"),
            ("username = \"u\"", "upstream[0].url", "required"),
        ];
        for (lines, key, words) in cases {
            let e = parse(&format!("[[upstream]]\nname = \"q.io\"\n{lines}\n")).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) && e.contains(words), "{lines}: {e}");
        }
        // An http upstream may name http realms.
        let c = parse("[[upstream]]\nname = \"q.io\"\nurl = \"http://q.io\"\ntrusted_realms = [\"http://a.q.io\"]\n");
        assert!(c.is_ok(), "{c:?}");
    }

    #[test]
    fn credentials_go_to_fallbacks_on_the_first_urls_site_unless_told() {
        let c = parse(
            "[[upstream]]\nname = \"docker.io\"\nusername = \"u\"\npassword = \"p\"\nurls = [\"https://registry-1.docker.io\", \
             \"https://registry-2.docker.io\", \"https://mirror.gcr.io\", \
             { url = \"https://hub.example\", credentials = true }, { url = \"https://index.docker.io\", credentials = false }]\n",
        )
        .unwrap();
        let sent: Vec<(String, bool)> =
            c.upstreams[0].fallback_urls.iter().map(|f| (f.url.host().unwrap().to_owned(), f.credentials)).collect();
        let expected = [
            ("registry-2.docker.io", true),
            ("mirror.gcr.io", false),
            ("hub.example", true),
            ("index.docker.io", false),
        ];
        assert_eq!(sent, expected.map(|(h, c)| (h.to_owned(), c)));
        let warnings = c.warnings();
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        assert!(warnings[0].starts_with("`upstream[0].urls[2]`: \"mirror.gcr.io\" is not on the site"), "{warnings:?}");
        assert!(warnings[0].contains("{ url = \"https://mirror.gcr.io\", credentials = true }"), "{warnings:?}");
        assert!(
            warnings[1]
                .starts_with("`upstream[0].urls[3]`: upstream \"docker.io\" sends its credentials to \"hub.example\"")
        );
        // Without credentials there is nothing to warn about.
        let anonymous = parse("[[upstream]]\nname = \"q.io\"\nurls = [\"https://q.io\", \"https://mirror.example\"]\n");
        assert!(anonymous.unwrap().warnings().is_empty());
        let e = parse("[[upstream]]\nname = \"q.io\"\nurls = [{ url = \"https://q.io\", credentials = false }]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`upstream[0].urls[0].credentials`"), "{e}");
        let e = parse(
            "[[upstream]]\nname = \"q.io\"\nurls = [\"https://q.io\", { url = \"https://m.q.io\", creds = true }]\n",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("unknown field `creds`"), "{e}");
    }

    #[test]
    fn via_refuses_credentials_naming_both_keys() {
        for (line, key) in [
            ("username = \"u\"\npassword = \"p\"", "username"),
            ("credential_helper = \"ecr-login\"", "credential_helper"),
            ("password_env = \"HOME\"", "password_env"),
        ] {
            let text = format!(
                "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nvia = \"http://larder-hub:5000\"\n{line}\n"
            );
            let e = parse(&text).unwrap_err().to_string();
            assert!(e.contains("`upstream[0].via`") && e.contains(&format!("`upstream[0].{key}`")), "{e}");
        }
        assert!(parse("[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\nvia = \"http://hub:5000\"\n").is_ok());
    }

    #[test]
    fn allow_and_deny_are_globs_named_by_their_key() {
        let c = parse("[[upstream]]\nname = \"docker.io\"\nurl = \"https://registry-1.docker.io\"\nallow = [\"library/*\", \"bitnami/**\"]\ndeny = [\"library/ubuntu\"]\n").unwrap();
        let policy = &c.upstreams[0].policy;
        assert!(policy.check(&"library/nginx".parse().unwrap()).is_ok());
        assert!(policy.check(&"library/ubuntu".parse().unwrap()).is_err());
        for (line, key) in
            [("allow = [\"ok\", \"Bad\"]", "upstream[0].allow[1]"), ("deny = [\"a//b\"]", "upstream[0].deny[0]")]
        {
            let e = parse(&format!("[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\n{line}\n"))
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("`{key}`")), "{e}");
        }
    }

    #[test]
    fn client_credentials_verify_with_a_ttl_and_never_through_a_hub() {
        let up = |lines: &str| format!("[[upstream]]\nname = \"ghcr.io\"\nurl = \"https://ghcr.io\"\n{lines}\n");
        let c = parse(&up("")).unwrap();
        assert_eq!(c.upstreams[0].client_credentials, ClientCredentialsMode::Ignore);
        let c = parse(&up("client_credentials = \"verify\"")).unwrap();
        assert_eq!(
            c.upstreams[0].client_credentials,
            ClientCredentialsMode::Verify { ttl: DEFAULT_CLIENT_CREDENTIALS_TTL }
        );
        let c = parse(&up("client_credentials = \"verify\"\nclient_credentials_ttl = \"90s\"")).unwrap();
        assert_eq!(c.upstreams[0].client_credentials, ClientCredentialsMode::Verify { ttl: Duration::from_secs(90) });
        let cases = [
            ("client_credentials = \"check\"", "upstream[0].client_credentials", "is not \"verify\""),
            ("client_credentials_ttl = \"1m\"", "upstream[0].client_credentials_ttl", "only with"),
            (
                "client_credentials = \"verify\"\nclient_credentials_ttl = \"0s\"",
                "upstream[0].client_credentials_ttl",
                "more than 0s",
            ),
            (
                "client_credentials = \"verify\"\nclient_credentials_ttl = \"25h\"",
                "upstream[0].client_credentials_ttl",
                "at most 24h",
            ),
            ("client_credentials = \"verify\"\nvia = \"http://hub:5000\"", "upstream[0].client_credentials", "hub"),
        ];
        for (lines, key, words) in cases {
            let e = parse(&up(lines)).unwrap_err().to_string();
            assert!(e.contains(&format!("`{key}`")) && e.contains(words), "{lines}: {e}");
        }
    }

    #[test]
    fn client_credentials_verify_and_an_htpasswd_cannot_share_the_authorization_header() {
        let dir = tempfile::tempdir().unwrap();
        let htpasswd = dir.path().join("htpasswd");
        std::fs::write(&htpasswd, "").unwrap();
        let text = format!(
            "[server.auth]\nhtpasswd = {:?}\n[[upstream]]\nname = \"ghcr.io\"\nurl = \"https://ghcr.io\"\nclient_credentials = \"verify\"\n",
            htpasswd.display().to_string()
        );
        let e = parse(&text).unwrap_err().to_string();
        assert!(e.contains("`upstream[0].client_credentials`") && e.contains("htpasswd"), "{e}");
    }

    #[test]
    fn trusted_networks_are_networks() {
        let c = parse(
            "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\ntrusted_networks = [\"10.20.0.0/16\", \"fd12::1/48\"]\n",
        )
        .unwrap();
        let nets: Vec<String> = c.upstreams[0].trusted_networks.iter().map(|n| n.to_string()).collect();
        assert_eq!(nets, ["10.20.0.0/16", "fd12::/48"]);
        let e = parse("[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\ntrusted_networks = [\"10.20.0.0\"]\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`upstream[0].trusted_networks[0]`"), "{e}");
    }

    #[test]
    fn immutable_tags_and_per_upstream_ttl() {
        let text = "[[upstream]]\nname = \"q.io\"\nurl = \"https://q.io\"\ntag_ttl = \"1s\"\nimmutable_tags = ['^v?\\d+\\.\\d+\\.\\d+$']\n";
        let c = parse(text).unwrap();
        let u = &c.upstreams[0];
        assert_eq!(u.tag_ttl(&c.cache), Duration::from_secs(1));
        assert!(u.tag_is_immutable("v1.2.3"));
        assert!(!u.tag_is_immutable("latest"));
    }
}
