//! Which addresses larder dials on an upstream's behalf when the upstream
//! (not the operator) named the host: redirect targets and token realms
//! (DESIGN.md, "Upstream client", rule 5).
//!
//! A registry, its CDN or a compromised front can answer
//! `307 Location: http://169.254.169.254/latest/meta-data/…`; followed, that
//! hands the node's cloud credentials to whoever reads the answer. So an
//! address that is not public — loopback, link-local, a cloud metadata
//! address, private (RFC 1918, ULA, CGNAT), unspecified, multicast or
//! reserved — is refused, unless:
//!
//! - one of the upstream's own origins (`url`, `urls`: named by the
//!   operator) has an address of that class itself (a private registry
//!   redirecting to its private storage); never for metadata addresses;
//! - or it is inside the upstream's `trusted_networks`.
//!
//! An IPv6 address that carries an IPv4 address (mapped, translated,
//! compatible, NAT64, 6to4, Teredo, ISATAP: [`super::embedded`]) is judged
//! by the IPv4 address it carries, since that is where a packet to it ends
//! up: `http://[2002:a9fe:a9fe::1]/` is a metadata address.
//!
//! The check runs on the addresses larder actually dials: a literal before
//! it connects, and a name through [`GuardedResolver`], which resolves it
//! once and hands the connector only addresses it checked, so a DNS answer
//! that changes between a check and the connect (rebinding) cannot slip
//! another address in. A name with any refused address is refused whole.

use std::future::Future;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::Uri;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::connect::dns::Name;
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;

use super::embedded::{Form, embedded};

/// How long the classes of the upstream's own origins' addresses are
/// remembered before their names are resolved again.
const OWN_CLASSES_TTL: Duration = Duration::from_secs(60);

/// What kind of network an address is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AddressClass {
    Public,
    Loopback,
    LinkLocal,
    /// A cloud instance-metadata endpoint (AWS, ECS, EKS, Alibaba): never
    /// allowed by the class of the upstream's own address.
    Metadata,
    /// RFC 1918, IPv6 unique-local (and the old site-local), CGNAT.
    Private,
    Unspecified,
    Multicast,
    /// 240.0.0.0/4, broadcast, and the IETF's own blocks.
    Reserved,
}

/// Cloud metadata endpoints.
const METADATA: [IpAddr; 6] = [
    IpAddr::V4(Ipv4Addr::new(169, 254, 169, 254)),
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 2)),
    IpAddr::V4(Ipv4Addr::new(169, 254, 170, 23)),
    IpAddr::V4(Ipv4Addr::new(100, 100, 100, 200)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254)),
    IpAddr::V6(Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x23)),
];

impl AddressClass {
    pub fn of(ip: IpAddr) -> AddressClass {
        if METADATA.contains(&ip) {
            return AddressClass::Metadata;
        }
        match ip {
            IpAddr::V4(v4) => Self::of_v4(v4),
            IpAddr::V6(v6) => Self::of_v6(v6),
        }
    }

    fn of_v4(ip: Ipv4Addr) -> AddressClass {
        let [a, b, c, _] = ip.octets();
        match () {
            _ if a == 0 => AddressClass::Unspecified,
            _ if ip.is_loopback() => AddressClass::Loopback,
            _ if ip.is_link_local() => AddressClass::LinkLocal,
            // 100.64.0.0/10: carrier-grade NAT, and cloud VPC internals.
            _ if ip.is_private() || (a == 100 && (64..128).contains(&b)) => AddressClass::Private,
            // 198.18.0.0/15 (benchmarking) and 192.0.0.0/24 (IETF).
            _ if (a == 198 && (b == 18 || b == 19)) || (a == 192 && b == 0 && c == 0) => AddressClass::Private,
            _ if ip.is_multicast() => AddressClass::Multicast,
            _ if a >= 240 => AddressClass::Reserved,
            _ => AddressClass::Public,
        }
    }

    /// An IPv6 address that carries an IPv4 one ([`super::embedded`]) is
    /// judged by what it carries: a packet to it ends up there. Where it
    /// carries more than one (Teredo's server and client, the layouts of a
    /// NAT64 local-use address), by the strictest of them.
    fn of_v6(ip: Ipv6Addr) -> AddressClass {
        let Some(embedded) = embedded(ip) else {
            return Self::of_v6_prefix(ip);
        };
        let carried = embedded.addresses.iter().map(|v4| Self::of(IpAddr::V4(*v4))).min_by_key(|c| c.strictness());
        match (embedded.form, carried.unwrap_or(AddressClass::Public)) {
            (_, class) if class != AddressClass::Public => class,
            // Deprecated (RFC 4291) and routed nowhere.
            (Form::Compatible, _) => AddressClass::Reserved,
            // Any prefix may carry an ISATAP interface identifier: the
            // prefix routes it, the IPv4 address only matters inside the site.
            (Form::Isatap, _) => Self::of_v6_prefix(ip),
            (_, public) => public,
        }
    }

    /// The class of an IPv6 address by its own prefix.
    fn of_v6_prefix(ip: Ipv6Addr) -> AddressClass {
        match ip.segments()[0] {
            _ if ip.is_unspecified() => AddressClass::Unspecified,
            _ if ip.is_loopback() => AddressClass::Loopback,
            x if x & 0xffc0 == 0xfe80 => AddressClass::LinkLocal,
            // fc00::/7 unique-local; fec0::/10 the old site-local.
            x if x & 0xfe00 == 0xfc00 || x & 0xffc0 == 0xfec0 => AddressClass::Private,
            x if x & 0xff00 == 0xff00 => AddressClass::Multicast,
            // Global unicast is 2000::/3; the rest (::/8 beyond the forms
            // above, 100::/64 discard-only, unassigned space) is not public.
            x if x & 0xe000 != 0x2000 => AddressClass::Reserved,
            _ => AddressClass::Public,
        }
    }

    /// Which class wins when an address carries several: metadata first,
    /// public last.
    fn strictness(self) -> u8 {
        match self {
            AddressClass::Metadata => 0,
            AddressClass::Loopback => 1,
            AddressClass::LinkLocal => 2,
            AddressClass::Unspecified => 3,
            AddressClass::Multicast => 4,
            AddressClass::Reserved => 5,
            AddressClass::Private => 6,
            AddressClass::Public => 7,
        }
    }

    /// The `reason` label of `larder_upstream_redirects_refused_total`.
    pub fn label(self) -> &'static str {
        match self {
            AddressClass::Public => "public",
            AddressClass::Loopback => "loopback",
            AddressClass::LinkLocal => "link_local",
            AddressClass::Metadata => "metadata",
            AddressClass::Private => "private",
            AddressClass::Unspecified => "unspecified",
            AddressClass::Multicast => "multicast",
            AddressClass::Reserved => "reserved",
        }
    }
}

/// A dial larder refused. The error the resolver or connector returns, found
/// again in hyper's error chain by [`refusal_in`].
#[derive(Debug, thiserror::Error)]
#[error(
    "{host} has the {} address {address}{}, which larder does not dial for an upstream's redirects or token realms \
     (allow it with `trusted_networks`)",
    class.label(),
    carrying(*address)
)]
pub struct Refused {
    pub host: String,
    pub address: IpAddr,
    pub class: AddressClass,
}

/// What an IPv6 address carries, for the refusal's message
/// (` (6to4, carrying 169.254.169.254)`); nothing for any other address.
fn carrying(address: IpAddr) -> String {
    let IpAddr::V6(v6) = address else { return String::new() };
    let Some(embedded) = embedded(v6) else { return String::new() };
    let carried: Vec<String> = embedded.addresses.iter().map(|a| a.to_string()).collect();
    format!(" ({}, carrying {})", embedded.form.name(), carried.join(" and "))
}

/// The refusal behind a failed request, if that is why it failed.
pub fn refusal_in<'a>(e: &'a (dyn std::error::Error + 'static)) -> Option<&'a Refused> {
    let mut current = Some(e);
    while let Some(e) = current {
        if let Some(r) = e.downcast_ref::<Refused>() {
            return Some(r);
        }
        current = e.source();
    }
    None
}

/// The rule for one upstream.
pub struct DialPolicy {
    /// Hosts of the upstream's own origins (`url`, `urls`).
    own_hosts: Vec<String>,
    trusted: Vec<ipnet::IpNet>,
    /// Classes of the own origins' addresses, and when they were resolved.
    /// A std Mutex: never held across `.await`.
    own_classes: Mutex<Option<(Instant, Arc<Vec<AddressClass>>)>>,
}

impl DialPolicy {
    pub fn new(own: &[&Uri], trusted: &[ipnet::IpNet]) -> DialPolicy {
        DialPolicy {
            own_hosts: own.iter().map(|u| crate::site::host_of(u)).collect(),
            trusted: trusted.to_vec(),
            own_classes: Mutex::new(None),
        }
    }

    /// Whether larder may dial `address` (of `host`) for a redirect or a realm.
    pub async fn check(&self, host: &str, address: IpAddr) -> Result<(), Refused> {
        let class = AddressClass::of(address);
        if class == AddressClass::Public || self.trusted.iter().any(|n| n.contains(&address)) {
            return Ok(());
        }
        if class != AddressClass::Metadata && self.own_classes().await.contains(&class) {
            return Ok(());
        }
        Err(Refused { host: host.to_owned(), address, class })
    }

    /// The classes of the own origins' addresses (resolved again after
    /// [`OWN_CLASSES_TTL`]; a name that does not resolve adds nothing).
    async fn own_classes(&self) -> Arc<Vec<AddressClass>> {
        if let Some((at, classes)) = &*self.own_classes.lock().unwrap_or_else(|p| p.into_inner()) {
            if at.elapsed() < OWN_CLASSES_TTL {
                return Arc::clone(classes);
            }
        }
        let mut classes = Vec::new();
        for host in &self.own_hosts {
            let addresses: Vec<IpAddr> = match host.parse::<IpAddr>() {
                Ok(ip) => vec![ip],
                Err(_) => match tokio::net::lookup_host((host.as_str(), 0)).await {
                    Ok(found) => found.map(|a| a.ip()).collect(),
                    Err(e) => {
                        tracing::debug!(host, error = %e, "cannot resolve an upstream's own host");
                        Vec::new()
                    }
                },
            };
            classes.extend(addresses.into_iter().map(AddressClass::of));
        }
        classes.sort_by_key(|c| c.label());
        classes.dedup();
        let classes = Arc::new(classes);
        *self.own_classes.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), Arc::clone(&classes)));
        classes
    }
}

/// Resolves names for the guarded connector: every address found is
/// checked, and only checked addresses reach the connector.
#[derive(Clone)]
pub struct GuardedResolver {
    policy: Arc<DialPolicy>,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = Result<T, BoxError>> + Send>>;

impl tower_service::Service<Name> for GuardedResolver {
    type Response = std::vec::IntoIter<SocketAddr>;
    type Error = BoxError;
    type Future = BoxFuture<Self::Response>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, name: Name) -> Self::Future {
        let policy = Arc::clone(&self.policy);
        Box::pin(async move {
            let host = name.as_str().to_owned();
            let found: Vec<SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            for address in &found {
                policy.check(&host, address.ip()).await?;
            }
            Ok(found.into_iter())
        })
    }
}

/// The connector for hosts an upstream named: literals are checked here,
/// names by [`GuardedResolver`].
#[derive(Clone)]
pub struct GuardedConnector {
    inner: HttpConnector<GuardedResolver>,
    policy: Arc<DialPolicy>,
}

impl GuardedConnector {
    /// `configure` sets the connector's options (timeouts, nodelay) as for
    /// the upstream's own origins.
    pub fn new(policy: Arc<DialPolicy>, configure: impl FnOnce(&mut HttpConnector<GuardedResolver>)) -> Self {
        let mut inner = HttpConnector::new_with_resolver(GuardedResolver { policy: Arc::clone(&policy) });
        configure(&mut inner);
        GuardedConnector { inner, policy }
    }
}

impl tower_service::Service<Uri> for GuardedConnector {
    type Response = TokioIo<TcpStream>;
    type Error = BoxError;
    type Future = BoxFuture<Self::Response>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (policy, mut inner) = (Arc::clone(&self.policy), self.inner.clone());
        Box::pin(async move {
            let host = crate::site::host_of(&uri);
            if let Ok(literal) = host.parse::<IpAddr>() {
                policy.check(&host, literal).await?;
            }
            Ok(inner.call(uri).await?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(s: &str) -> AddressClass {
        AddressClass::of(s.parse().unwrap())
    }

    #[test]
    fn addresses_are_classified_as_the_rules_name_them() {
        use AddressClass::*;
        let cases = [
            ("169.254.169.254", Metadata),
            ("fd00:ec2::254", Metadata),
            ("::ffff:169.254.169.254", Metadata),
            ("64:ff9b::a9fe:a9fe", Metadata),
            ("100.100.100.200", Metadata),
            ("169.254.1.1", LinkLocal),
            ("fe80::1", LinkLocal),
            ("127.0.0.1", Loopback),
            ("127.9.9.9", Loopback),
            ("::1", Loopback),
            ("::ffff:127.0.0.1", Loopback),
            ("10.1.2.3", Private),
            ("172.16.0.1", Private),
            ("172.31.255.255", Private),
            ("192.168.1.1", Private),
            ("100.64.0.1", Private),
            ("fd12:3456::1", Private),
            ("0.0.0.0", Unspecified),
            ("::", Unspecified),
            ("224.0.0.1", Multicast),
            ("ff02::1", Multicast),
            ("255.255.255.255", Reserved),
            ("240.0.0.1", Reserved),
            ("8.8.8.8", Public),
            ("172.32.0.1", Public),
            ("100.128.0.1", Public),
            ("203.0.113.7", Public),
            ("2606:4700::1111", Public),
            ("2001:db8::1", Public),
            // Not global unicast (outside 2000::/3) and no form below.
            ("64:ff9b:2::1", Reserved),
            ("100::1", Reserved),
        ];
        for (address, want) in cases {
            assert_eq!(class(address), want, "{address}");
        }
    }

    #[test]
    fn ipv6_forms_that_carry_an_ipv4_address_are_judged_by_it() {
        use AddressClass::*;
        let cases = [
            // Mapped and translated (SIIT).
            ("::ffff:a9fe:a9fe", Metadata),
            ("::FFFF:169.254.169.254", Metadata),
            ("::ffff:0:a9fe:a9fe", Metadata),
            ("::ffff:0:127.0.0.1", Loopback),
            ("::ffff:8.8.8.8", Public),
            ("::ffff:0:8.8.8.8", Public),
            // Compatible: by what it carries, and never public (deprecated).
            ("::a9fe:a9fe", Metadata),
            ("::169.254.169.254", Metadata),
            ("::10.0.0.1", Private),
            ("::8.8.8.8", Reserved),
            // NAT64, well-known prefix.
            ("64:ff9b::7f00:1", Loopback),
            ("64:ff9b::808:808", Public),
            // NAT64 local-use, at each RFC 6052 layout.
            ("64:ff9b:1::a9fe:a9fe", Metadata),
            ("64:ff9b:1:a9fe:a9:fe00::", Metadata),
            ("64:ff9b:1:a9:fe:a9fe::", Metadata),
            ("64:ff9b:1:0:a9:fea9:fe00:0", Metadata),
            ("64:ff9b:1::a00:1", Private),
            ("64:ff9b:1::808:808", Public),
            // 127.0.0.1 in the /48 layout, 8.8.8.8 where the /96 layout reads.
            ("64:ff9b:1:7f00:1:0:808:808", Loopback),
            // 6to4.
            ("2002:a9fe:a9fe::1", Metadata),
            ("2002:A9FE:A9FE::1", Metadata),
            ("2002:7f00:1::1", Loopback),
            ("2002:c0a8:101::1", Private),
            ("2002:808:808::1", Public),
            // Teredo: the client (last 32 bits, inverted) and the server.
            ("2001:0:cb00:7107::5601:5601", Metadata),
            ("2001:0:a9fe:a9fe:8000:ffff:34ff:8ef8", Metadata),
            ("2001:0:cb00:7107::80ff:fffe", Loopback),
            ("2001:0:a00:1::34ff:8ef7", Private),
            ("2001:0:cb00:7107::34ff:8ef7", Public),
            // ISATAP interface identifiers in a public prefix.
            ("2001:db8::5efe:a9fe:a9fe", Metadata),
            ("2001:db8::200:5efe:7f00:1", Loopback),
            ("2606:4700::5efe:808:808", Public),
            ("fe80::5efe:808:808", LinkLocal),
        ];
        for (address, want) in cases {
            assert_eq!(class(address), want, "{address}");
        }
    }

    #[test]
    fn a_refusal_names_the_address_an_ipv6_form_carries() {
        let refused = Refused {
            host: "sixto4.test".into(),
            address: "2002:a9fe:a9fe::1".parse().unwrap(),
            class: AddressClass::Metadata,
        };
        let message = refused.to_string();
        assert!(message.contains("metadata address 2002:a9fe:a9fe::1 (6to4, carrying 169.254.169.254)"), "{message}");
    }

    fn policy(own: &str, trusted: &[&str]) -> DialPolicy {
        let own: Uri = own.parse().unwrap();
        let trusted: Vec<ipnet::IpNet> = trusted.iter().map(|t| t.parse().unwrap()).collect();
        DialPolicy::new(&[&own], &trusted)
    }

    async fn allowed(p: &DialPolicy, address: &str) -> bool {
        p.check("target.example", address.parse().unwrap()).await.is_ok()
    }

    #[tokio::test]
    async fn a_public_upstream_may_redirect_only_to_public_addresses() {
        let p = policy("https://203.0.113.7", &[]);
        assert!(allowed(&p, "203.0.113.8").await);
        for refused in ["169.254.169.254", "127.0.0.1", "10.0.0.1", "fd00:ec2::254", "::1", "0.0.0.0"] {
            assert!(!allowed(&p, refused).await, "{refused}");
        }
        let e = p.check("metadata.test", "169.254.169.254".parse().unwrap()).await.unwrap_err();
        assert_eq!(e.class.label(), "metadata");
        assert!(e.to_string().contains("trusted_networks"), "{e}");
    }

    #[tokio::test]
    async fn a_private_upstream_may_redirect_within_its_class_but_never_to_metadata() {
        let p = policy("http://10.0.0.5:5000", &[]);
        assert!(allowed(&p, "10.9.9.9").await, "private storage of a private registry");
        assert!(allowed(&p, "192.168.0.7").await, "the same class");
        assert!(!allowed(&p, "127.0.0.1").await, "another class");
        assert!(!allowed(&p, "169.254.169.254").await, "metadata never by class");
        let loopback = policy("http://127.0.0.1:5000", &[]);
        assert!(allowed(&loopback, "127.0.0.2").await);
        assert!(!allowed(&loopback, "169.254.169.254").await);
    }

    #[tokio::test]
    async fn trusted_networks_allow_what_they_name() {
        let p = policy("https://203.0.113.7", &["10.20.0.0/16", "169.254.169.254/32"]);
        assert!(allowed(&p, "10.20.1.1").await);
        assert!(!allowed(&p, "10.21.1.1").await);
        assert!(allowed(&p, "169.254.169.254").await, "named explicitly");
    }

    #[tokio::test]
    async fn the_resolver_hands_on_only_checked_addresses() {
        use tower_service::Service as _;
        let mut guarded = GuardedResolver { policy: Arc::new(policy("https://203.0.113.7", &[])) };
        let e = guarded.call("localhost".parse().unwrap()).await.unwrap_err();
        let refused = refusal_in(e.as_ref()).expect("a refusal");
        assert_eq!(refused.class, AddressClass::Loopback);
        let mut open = GuardedResolver { policy: Arc::new(policy("http://127.0.0.1:5000", &[])) };
        let found: Vec<SocketAddr> = open.call("localhost".parse().unwrap()).await.unwrap().collect();
        assert!(!found.is_empty() && found.iter().all(|a| a.ip().is_loopback()), "{found:?}");
    }
}
