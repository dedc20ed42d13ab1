//! Cluster mode under partitions, on real kernel networking: 3 larder
//! replicas, a 3-node Garage cluster (the shared tier) and the origin (the
//! fake upstream, counting requests), each in its own network namespace,
//! joined by veth pairs to a bridge in a switch namespace of its own; the
//! test's clients in one more. Nothing is bound in the machine's own
//! namespace; the lab is deleted at the end, also when the test fails.
//!
//! Each round pushes a new image (a 9 MiB layer, uploaded multipart, and
//! a small one) and pulls it through every replica at once, twice each,
//! while one fault is on: a replica partitioned from its peers, a Garage
//! node partitioned from everything, a replica's link slowed to 8 Mbit/s
//! (tbf), or the big layer's owner killed in the middle of its fill (the
//! origin's link slowed to 40 Mbit/s for that) and restarted. Then it
//! heals, and checks after every round, printed as a table:
//!
//! - every pull returned exactly the right bytes or failed cleanly (never
//!   a wrong byte that ends cleanly);
//! - upstream GETs per blob <= 1 + the number of partition sides that
//!   asked (a killed owner is a side of its own);
//! - no request hung past its deadline;
//! - after healing, every replica serves every tag pulled so far, and all
//!   agree on where each points;
//! - no multipart upload is left unfinished in the bucket.
//!
//! `CHAOS_ROUNDS` (default 4: each fault once) and `CHAOS_TIME_LIMIT`
//! (seconds, default 300; no round starts after it) size the run;
//! `tests/chaos.sh N` runs N rounds by hand. Needs root (`ip netns`, `nft`,
//! `tc`) and Garage (`LARDER_TEST_GARAGE`).

mod common;
mod fake;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::metrics::metric;
use common::netns::Lab;
use common::{Garage, Larder, MIB, Upstream};
use fake::client::{self, End};
use fake::{FakeUpstream, KIB, OCI_MANIFEST, REPO, UPSTREAM_NAME, blob_path, digest, image_manifest, random_bytes};

const REPLICAS: [&str; 3] = ["r0", "r1", "r2"];
const STORE: [&str; 3] = ["g0", "g1", "g2"];
/// Longest a pull's single request may take before it counts as hung.
const DEADLINE: Duration = Duration::from_secs(90);
/// Pulls through each replica per round, at once.
const PULLS_PER_REPLICA: usize = 2;

#[derive(Clone, Copy, Debug)]
enum Fault {
    PartitionReplica,
    PartitionStoreNode,
    SlowReplica,
    KillOwner,
}

impl Fault {
    fn of_round(round: usize) -> Fault {
        [Fault::PartitionReplica, Fault::PartitionStoreNode, Fault::SlowReplica, Fault::KillOwner][round % 4]
    }
}

/// How one pull ended.
#[derive(Debug, PartialEq, Eq)]
enum Pulled {
    Exact,
    /// Refused or cut off: the client can tell it failed.
    FailedCleanly(String),
    /// A body that ended cleanly with wrong bytes: never allowed.
    Wrong(String),
    /// A request that outlived [`DEADLINE`]: never allowed.
    Hung(String),
}

/// One round's line in the table.
struct Row {
    round: usize,
    fault: String,
    exact: usize,
    failed_cleanly: usize,
    wrong: usize,
    hung: usize,
    upstream_gets: usize,
    bound: usize,
    healed_ok: bool,
    agree: bool,
    unfinished_uploads: u64,
    seconds: f64,
}

impl Row {
    fn holds(&self) -> bool {
        self.wrong == 0
            && self.hung == 0
            && self.upstream_gets <= self.bound
            && self.healed_ok
            && self.agree
            && self.unfinished_uploads == 0
    }
}

fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| round | fault | pulls exact | failed cleanly | wrong bytes | hung | upstream GETs (big blob) | bound | after heal | tags agree | unfinished uploads | s |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} |",
            r.round,
            r.fault,
            r.exact,
            r.failed_cleanly,
            r.wrong,
            r.hung,
            r.upstream_gets,
            r.bound,
            if r.healed_ok { "all exact" } else { "FAILED" },
            if r.agree { "yes" } else { "NO" },
            r.unfinished_uploads,
            r.seconds
        );
    }
    out
}

/// An image for round `n`: its manifest and blobs.
struct Image {
    tag: String,
    manifest: bytes::Bytes,
    blobs: Vec<bytes::Bytes>,
}

impl Image {
    fn new(n: usize) -> Image {
        let seed = 10_000 + 10 * n as u64;
        let config = random_bytes(512, seed);
        let big = random_bytes(9 * MIB, seed + 1);
        let small = random_bytes(256 * KIB, seed + 2);
        let manifest = image_manifest(
            (&digest(&config), config.len()),
            &[(&digest(&big), big.len()), (&digest(&small), small.len())],
        );
        Image { tag: format!("round{n}"), manifest, blobs: vec![config, big, small] }
    }

    fn big(&self) -> String {
        digest(&self.blobs[1])
    }
}

fn address(larder: &Larder) -> SocketAddr {
    larder.host_port().parse().expect("larder's address")
}

/// Pulls `image` through `larder`: the manifest by tag, then every blob,
/// each request within [`DEADLINE`].
async fn pull(larder: SocketAddr, image: Arc<Image>) -> Pulled {
    let path = format!("/v2/{REPO}/manifests/{}", image.tag);
    let got = tokio::time::timeout(DEADLINE, client::try_get_with(larder, &path, &[("Accept", OCI_MANIFEST)])).await;
    let manifest = match got {
        Err(_) => return Pulled::Hung(format!("manifest from {larder}")),
        Ok(Err(e)) => return Pulled::FailedCleanly(format!("manifest: {e}")),
        Ok(Ok(r)) if r.status() != 200 => return Pulled::FailedCleanly(format!("manifest: {}", r.status())),
        Ok(Ok(r)) if r.end != End::Complete => return Pulled::FailedCleanly(format!("manifest: {:?}", r.end)),
        Ok(Ok(r)) => r.body,
    };
    if manifest != image.manifest {
        return Pulled::Wrong(format!("the manifest of {} from {larder}", image.tag));
    }
    for blob in &image.blobs {
        let d = digest(blob);
        let read = async {
            let response = client::try_open(larder, &blob_path(&d)).await?;
            if response.status() != 200 {
                return Ok::<_, String>(Err(format!("{} for {d}", response.status())));
            }
            Ok(Ok(response.compare_to_end(blob).await))
        };
        match tokio::time::timeout(DEADLINE, read).await {
            Err(_) => return Pulled::Hung(format!("{d} from {larder}")),
            Ok(Err(e)) | Ok(Ok(Err(e))) => return Pulled::FailedCleanly(e),
            Ok(Ok(Ok((_, End::Aborted(e), _)))) => return Pulled::FailedCleanly(format!("{d} aborted: {e}")),
            Ok(Ok(Ok((len, End::Complete, None)))) if len == blob.len() as u64 => {}
            Ok(Ok(Ok((len, End::Complete, difference)))) => {
                return Pulled::Wrong(format!("{d} from {larder}: {len} bytes, first difference at {difference:?}"));
            }
        }
    }
    Pulled::Exact
}

/// Waits (at most a minute) until no replica skips a peer.
async fn peers_back(replicas: &[Larder]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut down = 0.0;
        for r in replicas {
            down += metric(r, "larder_peers_down").await;
        }
        if down == 0.0 || tokio::time::Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits (at most a minute) until no replica has uploads pending.
async fn uploads_settled(replicas: &[Larder]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let mut pending = 0.0;
        for r in replicas {
            pending += metric(r, "larder_pending_uploads").await;
        }
        if pending == 0.0 || tokio::time::Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn chaos() {
    let rounds: usize = std::env::var("CHAOS_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let limit = Duration::from_secs(std::env::var("CHAOS_TIME_LIMIT").ok().and_then(|v| v.parse().ok()).unwrap_or(300));
    let lab = Arc::new(Lab::new(&lab_names()));
    let runtime = lab.runtime("client");
    let run = runtime.spawn(run(Arc::clone(&lab), rounds, limit));
    let outcome = runtime.block_on(run);
    drop(runtime);
    drop(lab);
    match outcome {
        Ok(rows) => {
            let printed = table(&rows);
            println!("{printed}");
            assert!(rows.iter().all(Row::holds), "an invariant broke:\n{printed}");
        }
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

async fn run(lab: Arc<Lab>, rounds: usize, limit: Duration) -> Vec<Row> {
    let started = Instant::now();
    let up = FakeUpstream::builder().start_on(lab.listener("origin", 5000));
    let origin = format!("http://{}:5000", lab.ip("origin"));
    let places = STORE.iter().map(|n| (lab.ns(n).to_owned(), lab.ip(n))).collect();
    let garage = Garage::builder().in_netns(places).start().await;

    let dir = tempfile::tempdir().expect("a temp dir");
    std::fs::write(dir.path().join("secret"), common::cluster::SECRET).expect("the cluster secret");
    let peers: Vec<String> = REPLICAS.iter().map(|r| format!("\"http://{}:5001\"", lab.ip(r))).collect();
    let upstream = Upstream::new(UPSTREAM_NAME, &origin)
        .default(true)
        .line(r#"connect_timeout = "2s""#)
        .line(r#"response_timeout = "5s""#)
        .line(r#"body_idle_timeout = "5s""#);
    let mut replicas = Vec::new();
    for name in REPLICAS {
        let ip = lab.ip(name);
        let cluster = format!(
            "[cluster]\nlisten = \"{ip}:5001\"\nself = \"http://{ip}:5001\"\npeers = [{}]\nsecret_file = {:?}\n",
            peers.join(", "),
            dir.path().join("secret").display().to_string()
        );
        let larder = Larder::builder()
            .in_netns(lab.ns(name), ip)
            .upstream(upstream.clone())
            .server_line(&format!("admin_listen = \"{ip}:9090\""))
            .append_toml(&cluster)
            .append_toml(&garage.shared_toml(dir.path(), "chaos"))
            .env("RUST_LOG", "larder=info")
            .start()
            .await;
        replicas.push(larder);
    }
    let ring = larder::cluster::ring::Ring::new(REPLICAS.iter().map(|r| format!("http://{}:5001", lab.ip(r))));
    let owner_of = |key: &str| {
        let owner = ring.owner(key).expect("an owner").clone();
        REPLICAS.iter().position(|r| format!("http://{}:5001", lab.ip(r)) == owner).expect("a replica")
    };

    let mut rows = Vec::new();
    let mut tags: Vec<Arc<Image>> = Vec::new();
    for round in 0..rounds {
        if started.elapsed() > limit {
            eprintln!("chaos: time limit reached after {round} rounds");
            break;
        }
        let round_started = Instant::now();
        let image = Arc::new(Image::new(round));
        for blob in &image.blobs {
            up.add_blob(blob.clone());
        }
        up.add_manifest(REPO, &image.tag, OCI_MANIFEST, image.manifest.clone());
        let fault = Fault::of_round(round);
        let target = round / 4 % 3;
        let (description, sides) = match fault {
            Fault::PartitionReplica => {
                let others: Vec<&str> = REPLICAS.iter().copied().filter(|r| *r != REPLICAS[target]).collect();
                lab.partition(REPLICAS[target], &others);
                (format!("{} cut off from its peers", REPLICAS[target]), 2)
            }
            Fault::PartitionStoreNode => {
                let others: Vec<&str> = names_except(&lab_names(), STORE[target]);
                lab.partition(STORE[target], &others);
                (format!("{} cut off from everything", STORE[target]), 1)
            }
            Fault::SlowReplica => {
                lab.slow(REPLICAS[target], "8mbit");
                (format!("{} link at 8 Mbit/s", REPLICAS[target]), 1)
            }
            Fault::KillOwner => {
                // The origin slowed, so the owner dies in the middle of its fill.
                lab.slow("origin", "40mbit");
                (format!("{} (owner of the big layer) killed mid-fill", REPLICAS[owner_of(&image.big())]), 2)
            }
        };

        // Every replica pulls, twice, at once.
        let mut pulls = Vec::new();
        for (i, r) in replicas.iter().enumerate() {
            for _ in 0..PULLS_PER_REPLICA {
                pulls.push((i, tokio::spawn(pull(address(r), Arc::clone(&image)))));
            }
        }
        let mut killed = None;
        if let Fault::KillOwner = fault {
            let owner = owner_of(&image.big());
            tokio::time::sleep(Duration::from_millis(800)).await;
            replicas[owner].stop();
            killed = Some(owner);
        }
        let mut outcomes = Vec::new();
        let mut failed_at = BTreeSet::new();
        for (i, p) in pulls {
            let outcome = p.await.expect("a pull task");
            if !matches!(outcome, Pulled::Exact) && killed != Some(i) {
                failed_at.insert(i);
            }
            outcomes.push(outcome);
        }
        // A pull that failed at a replica still running: what it logged.
        for &i in &failed_at {
            let log = replicas[i].log();
            let lines: Vec<&str> =
                log.lines().filter(|l| ["WARN", "ERROR", "panicked"].iter().any(|w| l.contains(w))).collect();
            let recent = &lines[lines.len().saturating_sub(40)..];
            eprintln!("chaos round {round}: {} warned:\n{}", REPLICAS[i], recent.join("\n"));
        }

        // Heal, and check the cluster is whole again. A replica skips a
        // peer it could not connect to for 10 s: the round is over once
        // no replica skips one, so the next round starts from a whole
        // cluster.
        lab.heal_all();
        if let Some(owner) = killed {
            replicas[owner].restart().await;
        }
        peers_back(&replicas).await;
        tags.push(Arc::clone(&image));
        let mut healed_ok = true;
        let mut agree = true;
        for image in &tags {
            let mut seen = BTreeSet::new();
            for r in &replicas {
                match pull(address(r), Arc::clone(image)).await {
                    Pulled::Exact => {}
                    other => {
                        eprintln!("chaos round {round}: after healing, {} from {}: {other:?}", image.tag, r.url());
                        healed_ok = false;
                    }
                }
                let m = client::get_with(
                    address(r),
                    &format!("/v2/{REPO}/manifests/{}", image.tag),
                    &[("Accept", OCI_MANIFEST)],
                )
                .await;
                seen.insert(m.header("docker-content-digest").unwrap_or_default().to_owned());
            }
            agree &= seen.len() == 1;
        }
        uploads_settled(&replicas).await;
        let unfinished_uploads = garage.incomplete_multipart_uploads().await;

        let big_gets: Vec<_> =
            up.log().into_iter().filter(|l| l.method == "GET" && l.path.ends_with(&image.big())).collect();
        if big_gets.len() > 1 {
            eprintln!("chaos round {round} ({description}): upstream GETs of the big layer: {big_gets:?}");
        }
        let count = |f: fn(&Pulled) -> bool| outcomes.iter().filter(|o| f(o)).count();
        for o in &outcomes {
            if !matches!(o, Pulled::Exact) {
                eprintln!("chaos round {round} ({description}): {o:?}");
            }
        }
        let row = Row {
            round,
            fault: description,
            exact: count(|o| matches!(o, Pulled::Exact)),
            failed_cleanly: count(|o| matches!(o, Pulled::FailedCleanly(_))),
            wrong: count(|o| matches!(o, Pulled::Wrong(_))),
            hung: count(|o| matches!(o, Pulled::Hung(_))),
            upstream_gets: up.blob_gets(&image.big()),
            bound: 1 + sides,
            healed_ok,
            agree,
            unfinished_uploads,
            seconds: round_started.elapsed().as_secs_f64(),
        };
        eprintln!("{}", table(std::slice::from_ref(&row)).lines().last().unwrap_or_default());
        rows.push(row);
    }
    rows
}

fn lab_names() -> Vec<&'static str> {
    let mut names: Vec<&str> = REPLICAS.to_vec();
    names.extend(STORE);
    names.extend(["origin", "client"]);
    names
}

fn names_except(names: &[&'static str], except: &str) -> Vec<&'static str> {
    names.iter().copied().filter(|n| *n != except).collect()
}
