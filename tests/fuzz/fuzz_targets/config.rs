//! `Config::parse` on arbitrary TOML, then `Upstreams::new` on what it
//! accepts (what `larder` does at start-up and on reload): no panic; an
//! accepted config satisfies the documented rules (at least one upstream,
//! at most one default, unique names and aliases, http(s) URLs without a
//! path, ordered watermarks); every name and alias finds its upstream;
//! secrets never show in `Debug`.
//!
//! The parser opens the files a config names (password_file, ca_file, TLS
//! and htpasswd paths). So that the fuzzer cannot wedge itself reading
//! /dev/zero or /proc/kcore, inputs naming anything under /dev, /proc or
//! /sys, or any file that is not a regular file or folder, are skipped.
#![no_main]

use std::path::Path;

use larder::config::{Config, CredentialSource, Credentials, Secret};
use larder::upstream::Upstreams;
use libfuzzer_sys::fuzz_target;

fn risky_path(s: &str) -> bool {
    if s.is_empty() || s.len() > 4096 || s.contains('\0') {
        return false;
    }
    let Ok(meta) = std::fs::metadata(s) else { return false };
    let real = std::fs::canonicalize(s).unwrap_or_else(|_| Path::new(s).to_path_buf());
    !(meta.is_file() || meta.is_dir()) || ["/dev", "/proc", "/sys"].iter().any(|p| real.starts_with(p))
}

fn names_risky_path(v: &toml::Value) -> bool {
    match v {
        toml::Value::String(s) => risky_path(s),
        toml::Value::Array(a) => a.iter().any(names_risky_path),
        toml::Value::Table(t) => t.values().any(names_risky_path),
        _ => false,
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    if let Ok(table) = text.parse::<toml::Table>() {
        if table.values().any(names_risky_path) {
            return;
        }
    }
    let Ok(config) = Config::parse(text, "fuzz.toml", None) else { return };

    let cache = &config.cache;
    assert!(0.0 < cache.low_watermark && cache.low_watermark < cache.high_watermark && cache.high_watermark <= 1.0);
    assert!(!config.upstreams.is_empty());
    assert!(config.upstreams.iter().filter(|u| u.default).count() <= 1);
    let mut keys = std::collections::HashSet::new();
    for u in &config.upstreams {
        for key in std::iter::once(&u.name).chain(&u.aliases) {
            assert!(keys.insert(key.as_str()), "{key:?} is used twice");
        }
        assert!(matches!(u.url.scheme_str(), Some("http" | "https")), "url {}", u.url);
        assert!(matches!(u.url.path(), "" | "/") && u.url.query().is_none(), "url {}", u.url);
        assert!(!u.authority().is_empty(), "url {}", u.url);
        let _ = u.tag_is_immutable("latest");
        match &u.credentials {
            Some(CredentialSource::Fixed(c)) => {
                let blank = Credentials { username: c.username.clone(), password: Secret::new("") };
                assert_eq!(format!("{c:?}"), format!("{blank:?}"), "the password shows in Debug");
            }
            Some(CredentialSource::File { loaded, .. }) => {
                assert_eq!(format!("{loaded:?}"), format!("{:?}", Secret::new("")), "the password shows in Debug");
            }
            Some(CredentialSource::Helper(_)) | None => {}
        }
        for realm in &u.trusted_realms {
            assert!(matches!(realm.scheme_str(), Some("http" | "https")), "trusted realm {realm}");
        }
    }

    let Ok(upstreams) = Upstreams::new(&config) else { return };
    for u in &config.upstreams {
        for key in std::iter::once(&u.name).chain(&u.aliases) {
            let found = upstreams.get(key).unwrap_or_else(|| panic!("{key:?} finds no upstream"));
            assert_eq!(found.name(), u.name);
        }
    }
    assert_eq!(upstreams.default_upstream().map(|u| u.name()), config.default_upstream().map(|u| u.name.as_str()));
});
