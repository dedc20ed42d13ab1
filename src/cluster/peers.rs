//! The peer set: who the replicas are, which of them are down for a
//! while, and for a key the live peers in owner-first order.
//!
//! Members come from `[cluster] peers` (a static list) or `peers_dns` (a
//! name, e.g. a Kubernetes headless Service, resolved again every
//! [`DNS_REFRESH_INTERVAL`]). This replica is always a member, also before
//! DNS lists it (a headless Service lists only ready pods). A peer that
//! cannot be connected to is marked down for [`PEER_DOWN_FOR`] and skipped, so the
//! next peer in its keys' rankings stands in for it; this replica is never
//! skipped, so the candidate list always ends in someone who can fetch.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::time::Instant;

use super::ring::Ring;
pub use crate::config::PeerUrl;
use crate::config::{ClusterConfig, PeerSource};
use crate::metrics::metrics;

/// How long a peer that failed a request is skipped. Long enough that a
/// dead owner costs one failed attempt per few seconds, not one per
/// request; short enough that a restarted replica gets its keys back soon.
pub const PEER_DOWN_FOR: Duration = Duration::from_secs(10);
/// How often `peers_dns` is resolved again (and the up/down gauges are
/// refreshed). A new replica starts receiving its keys at most this late.
pub const DNS_REFRESH_INTERVAL: Duration = Duration::from_secs(5);

/// Sets `flag` to `now`; whether it just turned true (to warn once per change).
fn became_true(flag: &AtomicBool, now: bool) -> bool {
    !flag.swap(now, Ordering::Relaxed) && now
}

/// Resolves `host:port` to addresses; tokio's `lookup_host` in production.
pub type Resolve = Arc<dyn Fn(String) -> BoxFuture<'static, io::Result<Vec<SocketAddr>>> + Send + Sync>;

fn system_resolver() -> Resolve {
    Arc::new(|name: String| Box::pin(async move { Ok(tokio::net::lookup_host(name).await?.collect()) }))
}

/// The peer set; see the module docs. Cheap to share behind an `Arc`.
pub struct Peers {
    me: PeerUrl,
    /// `host:port` to resolve, for `peers_dns`.
    dns: Option<String>,
    resolve: Resolve,
    // std locks, held only for a clone or an insert, never across `.await`.
    ring: RwLock<Arc<Ring<PeerUrl>>>,
    /// Peers skipped until the given time.
    down: Mutex<HashMap<PeerUrl, Instant>>,
    /// Whether the last answer of `peers_dns` lacked this replica (warned once per change).
    me_missing: AtomicBool,
    /// Whether the last answer of `peers_dns` mixed IP families (warned once per change).
    mixed_families: AtomicBool,
    /// True once the member set is known: at once for a static list,
    /// after the first lookup of `peers_dns` (successful or not).
    settled: tokio::sync::watch::Sender<bool>,
}

impl Peers {
    /// The peer set from `[cluster]`. With `peers_dns` it holds only this
    /// replica until [`Peers::refresh`] (or the task of [`Peers::spawn`])
    /// has resolved the name.
    pub fn new(config: &ClusterConfig) -> Arc<Peers> {
        Peers::with_resolver(config, system_resolver())
    }

    /// As [`Peers::new`], resolving `peers_dns` with `resolve`.
    pub fn with_resolver(config: &ClusterConfig, resolve: Resolve) -> Arc<Peers> {
        let me = config.self_url.clone();
        let (initial, dns) = match &config.peers {
            PeerSource::Static(list) => (list.clone(), None),
            PeerSource::Dns { name } => (Vec::new(), Some(name.clone())),
        };
        let peers = Arc::new(Peers {
            ring: RwLock::new(Arc::new(Ring::new(std::iter::once(me.clone()).chain(initial)))),
            me,
            dns,
            resolve,
            down: Mutex::default(),
            me_missing: AtomicBool::new(false),
            mixed_families: AtomicBool::new(false),
            settled: tokio::sync::watch::channel(matches!(config.peers, PeerSource::Static(_))).0,
        });
        peers.update_gauges();
        peers
    }

    /// This replica's URL.
    pub fn me(&self) -> &PeerUrl {
        &self.me
    }

    pub fn is_me(&self, peer: &PeerUrl) -> bool {
        *peer == self.me
    }

    fn ring(&self) -> Arc<Ring<PeerUrl>> {
        Arc::clone(&self.ring.read().unwrap_or_else(|p| p.into_inner()))
    }

    fn down_map(&self) -> std::sync::MutexGuard<'_, HashMap<PeerUrl, Instant>> {
        self.down.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every member, this replica included, sorted.
    pub fn members(&self) -> Vec<PeerUrl> {
        self.ring().members().cloned().collect()
    }

    /// The live peers for `key` (a digest, or `upstream/repo:tag`), owner
    /// first, then the fallbacks in order. Never empty: this replica is
    /// always live. Ask them in order; when the one asked is this replica,
    /// fetch here.
    pub fn candidates(&self, key: &str) -> Vec<PeerUrl> {
        let ranked: Vec<PeerUrl> = self.ring().ranked(key).into_iter().cloned().collect();
        let now = Instant::now();
        let down = self.down_map();
        ranked.into_iter().filter(|p| *p == self.me || down.get(p).is_none_or(|until| *until <= now)).collect()
    }

    /// The live owner of `key`: the first of [`Peers::candidates`].
    pub fn owner(&self, key: &str) -> PeerUrl {
        self.candidates(key).into_iter().next().unwrap_or_else(|| self.me.clone())
    }

    /// Skips `peer` for [`PEER_DOWN_FOR`] (no TCP or TLS connection could
    /// be made; a slow answer, an error status or a broken body does not
    /// count, see [`super::client::PeerError`]). This replica is never
    /// marked down.
    pub fn mark_down(&self, peer: &PeerUrl) {
        if self.is_me(peer) {
            return;
        }
        let now = Instant::now();
        let was_up = {
            let mut down = self.down_map();
            let was_up = down.get(peer).is_none_or(|until| *until <= now);
            down.insert(peer.clone(), now + PEER_DOWN_FOR);
            was_up
        };
        if was_up {
            metrics().peers_marked_down.inc();
            tracing::warn!(%peer, skip_for = ?PEER_DOWN_FOR, "peer marked down");
        }
        self.update_gauges();
    }

    /// Whether `peer` is currently skipped.
    pub fn is_down(&self, peer: &PeerUrl) -> bool {
        self.down_map().get(peer).is_some_and(|until| *until > Instant::now())
    }

    /// The addresses of `addrs` in the IP family of `cluster.self` (when it
    /// is an address): a name that resolves to both IPv4 and IPv6 would
    /// otherwise list every replica twice, and each replica would rank
    /// the other family's copies as owners nobody else agrees on.
    fn same_family_as_me(&self, name: &str, addrs: Vec<SocketAddr>) -> Vec<SocketAddr> {
        let host = self.me.authority().rsplit_once(':').map_or(self.me.authority(), |(h, _)| h);
        let Ok(ip) = host.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() else {
            return addrs;
        };
        let (kept, dropped): (Vec<SocketAddr>, Vec<SocketAddr>) =
            addrs.into_iter().partition(|a| a.is_ipv4() == ip.is_ipv4());
        if became_true(&self.mixed_families, !dropped.is_empty()) {
            tracing::warn!(name = %name, ?dropped, me = %self.me, "peers_dns answered both IPv4 and IPv6 \
                addresses; keeping the family of cluster.self");
        }
        kept
    }

    /// Resolves `peers_dns` once and makes the result (plus this replica)
    /// the member set. A failed lookup keeps the previous set: a DNS hiccup
    /// must not make this replica think it is alone.
    pub async fn refresh(&self) {
        if let Some(name) = &self.dns {
            match (self.resolve)(name.clone()).await {
                Ok(addrs) => {
                    let https = self.me.is_https();
                    let addrs = self.same_family_as_me(name, addrs);
                    let found: Vec<PeerUrl> = addrs.into_iter().map(|a| PeerUrl::from_addr(https, a)).collect();
                    let listed = found.contains(&self.me);
                    if became_true(&self.me_missing, !listed) {
                        tracing::warn!(name = %name, me = %self.me, "cluster.self is not in the answer of \
                            peers_dns: other replicas may not count this one, and disagree with it about owners");
                    }
                    self.set_members(std::iter::once(self.me.clone()).chain(found).collect());
                }
                Err(e) => tracing::warn!(name = %name, error = %e, "resolving peers_dns failed; keeping the peer set"),
            }
        }
        self.settled.send_replace(true);
        self.expire_down_marks();
        self.update_gauges();
    }

    /// Waits until the member set is known (see [`Peers::settled`]'s field):
    /// before that, a `peers_dns` replica counts only itself and would
    /// take every key for its own.
    pub async fn settled(&self) {
        let mut rx = self.settled.subscribe();
        let _ = rx.wait_for(|s| *s).await;
    }

    /// Whether this replica owns `key` now (it is the first live candidate).
    pub fn owns(&self, key: &str) -> bool {
        self.is_me(&self.owner(key))
    }

    fn set_members(&self, members: Vec<PeerUrl>) {
        let ring = Arc::new(Ring::new(members));
        let before = self.members();
        let after: Vec<PeerUrl> = ring.members().cloned().collect();
        if before != after {
            let added: Vec<&PeerUrl> = after.iter().filter(|p| !before.contains(p)).collect();
            let removed: Vec<&PeerUrl> = before.iter().filter(|p| !after.contains(p)).collect();
            tracing::info!(?added, ?removed, members = after.len(), "peer set changed");
            *self.ring.write().unwrap_or_else(|p| p.into_inner()) = ring;
        }
    }

    fn expire_down_marks(&self) {
        let now = Instant::now();
        self.down_map().retain(|_, until| *until > now);
    }

    fn update_gauges(&self) {
        let members = self.members();
        let down = members.iter().filter(|p| self.is_down(p)).count();
        metrics().peers_up.set((members.len() - down) as i64);
        metrics().peers_down.set(down as i64);
    }

    /// Re-resolves `peers_dns` (first at once, then every
    /// [`DNS_REFRESH_INTERVAL`]) and refreshes the gauges, until `shutdown`.
    pub fn spawn(self: &Arc<Self>, mut shutdown: crate::shutdown::Shutdown) -> tokio::task::JoinHandle<()> {
        let peers = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                peers.refresh().await;
                tokio::select! {
                    _ = shutdown.changed() => return,
                    () = tokio::time::sleep(DNS_REFRESH_INTERVAL) => {}
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Secret;

    fn url(s: &str) -> PeerUrl {
        PeerUrl::parse(s).unwrap()
    }

    fn config(me: &str, peers: PeerSource) -> ClusterConfig {
        ClusterConfig {
            listen: "127.0.0.1:5001".parse().unwrap(),
            self_url: url(me),
            peers,
            secret: Secret::new("0123456789abcdef0123"),
            ca_file: None,
            tls_name: None,
        }
    }

    fn three() -> ClusterConfig {
        let list = ["http://10.0.0.1:5001", "http://10.0.0.2:5001", "http://10.0.0.3:5001"].map(url).to_vec();
        config("http://10.0.0.1:5001", PeerSource::Static(list))
    }

    #[test]
    fn peer_urls_are_normalized() {
        assert_eq!(url("http://10.0.0.1:5001/").as_str(), "http://10.0.0.1:5001");
        assert_eq!(url("HTTP://Larder-0.Larder:5001").as_str(), "http://larder-0.larder:5001");
        assert_eq!(url("https://larder").as_str(), "https://larder:443");
        assert_eq!(url("http://[::1]:5001").as_str(), "http://[::1]:5001");
        assert_eq!(url("http://[::1]:5001").authority(), "[::1]:5001");
        assert_eq!(PeerUrl::from_addr(false, "[::1]:5001".parse().unwrap()), url("http://[::1]:5001"));
        assert!(url("https://a:1").is_https());
        for bad in ["ftp://a:1", "http://a:1/path", "http://u:p@a:1", "http://a:1?x=1", "a:1", "http://:5"] {
            assert!(PeerUrl::parse(bad).is_err(), "{bad} should be refused");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_peer_marked_down_is_skipped_for_a_while() {
        let peers = Peers::new(&three());
        let key = (0..1000)
            .map(|i| format!("sha256:{i:064x}"))
            .find(|k| peers.owner(k).as_str() == "http://10.0.0.2:5001")
            .expect("some key is owned by peer 2");
        let before = peers.candidates(&key);
        assert_eq!(before.len(), 3);

        peers.mark_down(&before[0]);
        let during = peers.candidates(&key);
        assert_eq!(during, before[1..].to_vec(), "the next candidate stands in");
        assert!(peers.is_down(&before[0]));

        tokio::time::advance(PEER_DOWN_FOR + Duration::from_millis(1)).await;
        assert_eq!(peers.candidates(&key), before, "back after PEER_DOWN_FOR");
    }

    #[test]
    fn this_replica_is_never_skipped() {
        let peers = Peers::new(&three());
        for p in peers.members() {
            peers.mark_down(&p);
        }
        for i in 0..50 {
            let key = format!("k{i}");
            assert_eq!(peers.candidates(&key), vec![url("http://10.0.0.1:5001")]);
            assert!(peers.is_me(&peers.owner(&key)));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn dns_members_follow_the_name_and_survive_lookup_failures() {
        let answer: Arc<Mutex<io::Result<Vec<SocketAddr>>>> =
            Arc::new(Mutex::new(Ok(vec!["10.0.0.1:5001".parse().unwrap(), "10.0.0.2:5001".parse().unwrap()])));
        let served = Arc::clone(&answer);
        let resolve: Resolve = Arc::new(move |name: String| {
            assert_eq!(name, "larder-headless.larder.svc:5001");
            let result = match &*served.lock().unwrap() {
                Ok(addrs) => Ok(addrs.clone()),
                Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
            };
            Box::pin(async move { result })
        });
        let cfg = config("http://10.0.0.3:5001", PeerSource::Dns { name: "larder-headless.larder.svc:5001".into() });
        let peers = Peers::with_resolver(&cfg, resolve);
        assert_eq!(peers.members(), vec![url("http://10.0.0.3:5001")], "only itself before the first lookup");

        let (_tx, shutdown) = tokio::sync::watch::channel(());
        let task = peers.spawn(shutdown);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let expected = ["http://10.0.0.1:5001", "http://10.0.0.2:5001", "http://10.0.0.3:5001"].map(url).to_vec();
        assert_eq!(peers.members(), expected, "resolved peers plus itself");

        *answer.lock().unwrap() = Err(io::Error::other("SERVFAIL"));
        tokio::time::sleep(DNS_REFRESH_INTERVAL * 2).await;
        assert_eq!(peers.members(), expected, "a failed lookup keeps the set");

        *answer.lock().unwrap() = Ok(vec!["10.0.0.2:5001".parse().unwrap(), "10.0.0.4:5001".parse().unwrap()]);
        tokio::time::sleep(DNS_REFRESH_INTERVAL + Duration::from_millis(1)).await;
        let expected = ["http://10.0.0.2:5001", "http://10.0.0.3:5001", "http://10.0.0.4:5001"].map(url).to_vec();
        assert_eq!(peers.members(), expected, "scaled: one gone, one new");
        task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn peers_dns_keeps_the_family_of_self_and_a_static_list_is_settled_at_once() {
        // A dual-stack Service: every replica twice, IPv4 and IPv6.
        let resolve: Resolve = Arc::new(|_| {
            let addrs = ["10.0.0.1:5001", "[fd00::1]:5001", "10.0.0.2:5001", "[fd00::2]:5001"];
            Box::pin(async move { Ok(addrs.iter().map(|a| a.parse().unwrap()).collect()) })
        });
        let cfg = config("http://10.0.0.2:5001", PeerSource::Dns { name: "larder-headless:5001".into() });
        let peers = Peers::with_resolver(&cfg, resolve);
        let settled = tokio::spawn({
            let peers = Arc::clone(&peers);
            async move { peers.settled().await }
        });
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert!(!settled.is_finished(), "not settled before the first lookup");
        peers.refresh().await;
        settled.await.unwrap();
        let expected = ["http://10.0.0.1:5001", "http://10.0.0.2:5001"].map(url).to_vec();
        assert_eq!(peers.members(), expected, "the IPv6 copies would be owners nobody agrees on");

        // An IPv6 self keeps the IPv6 addresses.
        let v6 = config("http://[fd00::1]:5001", PeerSource::Dns { name: "larder-headless:5001".into() });
        let resolve: Resolve = Arc::new(|_| {
            let addrs = ["10.0.0.1:5001", "[fd00::1]:5001", "[fd00::2]:5001"];
            Box::pin(async move { Ok(addrs.iter().map(|a| a.parse().unwrap()).collect()) })
        });
        let peers = Peers::with_resolver(&v6, resolve);
        peers.refresh().await;
        assert_eq!(peers.members(), ["http://[fd00::1]:5001", "http://[fd00::2]:5001"].map(url).to_vec());

        // A static list needs no lookup.
        tokio::time::timeout(Duration::from_secs(1), Peers::new(&three()).settled()).await.expect("settled at once");
    }

    #[tokio::test]
    async fn the_system_resolver_finds_loopback() {
        let cfg = config("http://127.0.0.1:5001", PeerSource::Dns { name: "localhost:5001".into() });
        let peers = Peers::new(&cfg);
        peers.refresh().await;
        assert!(peers.members().contains(&url("http://127.0.0.1:5001")), "{:?}", peers.members());
    }
}
