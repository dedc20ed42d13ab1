//! Which hosts belong to one operator (a "site"), for the two places
//! where larder extends trust past one host without being told to: a
//! token realm named by an upstream's challenge (it gets the upstream's
//! credentials), and a fallback URL of an upstream (it gets them too,
//! unless the config says otherwise).
//!
//! Two hosts are one site when they are the same host, or two DNS names
//! under the same registrable domain of the public suffix list (a suffix
//! the list does not know, such as `.internal` or `.test`, counts as one:
//! `auth.corp.internal` and `registry.corp.internal` share `corp.internal`)
//! — except where the registrable domain does not speak for who owns the
//! names ([`MULTI_TENANT_DOMAINS`]): another account's ECR
//! (`*.dkr.ecr.<region>.amazonaws.com`), another company's ACR
//! (`*.azurecr.io`), or another namespace's Service in a Kubernetes cluster
//! (`*.svc.cluster.local`, all under `cluster.local`). There only the same
//! host counts.
//!
//! IP literals and `localhost` are only ever the same site as themselves.

use std::net::IpAddr;

/// Registrable domains (and their subdomains) whose hosts belong to
/// different tenants, though the public suffix list groups them under one
/// registrable domain. A realm or fallback on another host there is
/// trusted only when the config names it (`trusted_realms`, or
/// `credentials = true` on a `urls` entry).
pub const MULTI_TENANT_DOMAINS: &[&str] = &[
    // Amazon ECR: <account>.dkr.ecr.<region>.amazonaws.com, and every
    // other AWS endpoint the list does not split.
    "amazonaws.com",
    "amazonaws.com.cn",
    // Azure Container Registry: <registry>.azurecr.io.
    "azurecr.io",
    "azurecr.cn",
    "azurecr.us",
    // JFrog Cloud: <company>.jfrog.io.
    "jfrog.io",
    // Alibaba Cloud ACR Enterprise: <instance>-registry.<region>.cr.aliyuncs.com.
    "aliyuncs.com",
    // Tencent Cloud TCR Enterprise: <instance>.tencentcloudcr.com.
    "tencentcloudcr.com",
    // Kubernetes' default cluster domain: <service>.<namespace>.svc.cluster.local,
    // one registrable domain for every namespace of the cluster.
    "cluster.local",
];

/// The lowercase host of a URL's authority, without IPv6 brackets.
pub fn host_of(uri: &http::Uri) -> String {
    uri.host().unwrap_or_default().trim_matches(['[', ']']).to_ascii_lowercase()
}

fn is_literal(host: &str) -> bool {
    host.parse::<IpAddr>().is_ok() || host == "localhost"
}

/// The registrable domain that makes a DNS name part of a site larger than
/// itself, if any: `None` for literals and multi-tenant domains.
fn shared_domain(host: &str) -> Option<&str> {
    if is_literal(host) {
        return None;
    }
    let domain = psl::domain_str(host)?;
    let multi_tenant = MULTI_TENANT_DOMAINS
        .iter()
        .any(|m| domain == *m || domain.strip_suffix(m).is_some_and(|rest| rest.ends_with('.')));
    (!multi_tenant).then_some(domain)
}

/// Whether two hosts (lowercase, no brackets) belong to one operator.
pub fn same_site(a: &str, b: &str) -> bool {
    a == b || shared_domain(a).is_some_and(|d| Some(d) == shared_domain(b))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registrable_domains_of_known_suffixes_are_one_site() {
        assert!(same_site("registry-1.docker.io", "auth.docker.io"));
        assert!(same_site("registry.gitlab.com", "gitlab.com"));
        assert!(same_site("us-docker.pkg.dev", "auth.pkg.dev"));
        assert!(!same_site("registry-1.docker.io", "docker.io.evil.example"));
        // The list's own private entries split their tenants already.
        assert!(!same_site("a.github.io", "b.github.io"));
    }

    #[test]
    fn multi_tenant_domains_are_one_host_each() {
        let ecr = "123456789012.dkr.ecr.us-east-1.amazonaws.com";
        assert!(same_site(ecr, ecr));
        assert!(!same_site(ecr, "210987654321.dkr.ecr.us-east-1.amazonaws.com"));
        assert!(!same_site("mine.azurecr.io", "theirs.azurecr.io"));
        assert!(!same_site("acme.jfrog.io", "evil.jfrog.io"));
        assert!(!same_site("registry.ns.svc.cluster.local", "evil.other.svc.cluster.local"));
        assert!(same_site("registry.ns.svc.cluster.local", "registry.ns.svc.cluster.local"));
        // A suffix the list does not know is one, as `.test` in the tests'
        // made-up registries: an operator's own private domain is one site.
        assert!(same_site("registry.corp.internal", "auth.corp.internal"));
        assert!(same_site("registry.hub.test", "auth.hub.test"));
        assert!(!same_site("registry.hub.test", "cdn.hubstatic.test"));
    }

    #[test]
    fn literals_are_only_themselves() {
        assert!(same_site("127.0.0.1", "127.0.0.1"));
        assert!(!same_site("127.0.0.1", "127.0.0.2"));
        assert!(!same_site("localhost", "127.0.0.1"));
        assert!(!same_site("10.0.0.1", "10.0.0.1.nip.io"));
    }
}
