//! Registry shapes: fakes of how real registries answer a pull
//! (shared/REGISTRIES.md), each a set of made-up HTTPS hosts on 127.0.0.1
//! ([`site::Site`], one port each, names pinned to 127.0.0.1 in
//! /etc/hosts) that record every request and the credentials it carried.
//!
//! | shape | hosts |
//! |---|---|
//! | [`hub::Hub`] | registry.hub.test, auth.hub.test, cdn.hubstatic.test |
//! | [`k8s::K8s`] | registry.k8s.test → artifact.pkg.test |
//! | [`scarf::Scarf`] | lscr.test, cr.l5d.test → ghcr.test |
//! | [`nvcr::Nvcr`] | nvcr.test, authn.nvidia.test |
//! | [`ecr::Ecr`] | ecr.test |
//! | [`foreign::Foreign`] | front.mirror.test → blobs.storage.test, realm on realm.collector.test |
//! | [`plain::Plain`] | plain.test |
//!
//! `.test` is not on the public suffix list, so the `psl` crate treats it
//! as one: `auth.hub.test` and `registry.hub.test` share the registrable
//! domain `hub.test`, while `cdn.hubstatic.test`, `ghcr.test` and
//! `authn.nvidia.test` are other domains, as on the real web.
#![allow(dead_code)]

pub mod ecr;
pub mod foreign;
pub mod hub;
pub mod k8s;
pub mod nvcr;
pub mod plain;
pub mod registry;
pub mod scarf;
pub mod site;

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use base64::Engine as _;

/// Every made-up host name the shapes use.
pub const HOSTS: [&str; 15] = [
    hub::REGISTRY,
    hub::AUTH,
    hub::CDN,
    k8s::FRONT,
    k8s::ARTIFACT,
    scarf::CHALLENGING_FRONT,
    scarf::REDIRECTING_FRONT,
    scarf::GHCR,
    nvcr::REGISTRY,
    nvcr::AUTHN,
    ecr::REGISTRY,
    plain::REGISTRY,
    foreign::FRONT,
    foreign::TARGET,
    foreign::REALM,
];

/// Pins [`HOSTS`] to 127.0.0.1 and returns a TLS setup whose certificate
/// covers them all.
pub fn setup() -> site::Tls {
    crate::hosts::pin_to_loopback(&HOSTS);
    site::Tls::for_names(&HOSTS)
}

/// `Basic base64(user:password)`.
pub fn basic(user: &str, password: &str) -> String {
    format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}")))
}

/// Writes an executable `docker-credential-<name>` shell script into
/// `dir`, which goes first on larder's `PATH`.
pub fn credential_helper(dir: &Path, name: &str, script: &str) -> PathBuf {
    let path = dir.join(format!("docker-credential-{name}"));
    std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).expect("write the credential helper");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod the credential helper");
    path
}

/// `dir` in front of this process's `PATH`: the `PATH` larder runs with.
pub fn path_with(dir: &Path) -> String {
    let current = std::env::var("PATH").unwrap_or_default();
    format!("{}:{current}", dir.display())
}

/// Replaces `path`'s content atomically (write a sibling, rename over it),
/// as a rotation does.
pub fn replace_file(path: &Path, content: &str) {
    let tmp = path.with_extension("rotating");
    std::fs::write(&tmp, content).expect("write the new version");
    std::fs::rename(&tmp, path).expect("rename it into place");
}

/// Waits (at most 10 s) until `path` exists.
pub async fn wait_for_file(path: &Path) {
    for _ in 0..1000 {
        if path.exists() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{} never appeared", path.display());
}
