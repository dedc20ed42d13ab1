//! A real Prometheus (Debian's `prometheus`) scrapes a larder under real
//! pulls, with larder's alert rules loaded: every expression of the
//! Grafana dashboard returns data through Prometheus's HTTP API, and every
//! alert rule evaluates without error against larder's real series. The
//! dashboard's Cluster row is checked the same way against a real cluster:
//! two replicas that are peers, sharing a Garage bucket.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::metrics::admin_address;
use common::process::LoggedChild;
use common::{Admin, Cluster, Garage, ImageBuilder, KIB, Larder, Origin, free_port, http, skopeo, which};

/// Scrape and rule evaluation interval: short, so the test is quick.
const SCRAPE_INTERVAL: &str = "1s";
/// How long the test waits for a query to return data.
const QUERY_TIMEOUT: Duration = Duration::from_secs(60);

struct Prometheus {
    url: String,
    process: LoggedChild,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts Prometheus scraping `targets` (host:port of /metrics) as job
    /// "larder", with larder's alert rules.
    async fn start(targets: &[String]) -> Prometheus {
        let dir = tempfile::Builder::new().prefix("larder-prometheus-").tempdir().expect("temp dir");
        let rules = rules_file();
        let config = format!(
            "global:\n  scrape_interval: {SCRAPE_INTERVAL}\n  evaluation_interval: {SCRAPE_INTERVAL}\n\
             rule_files:\n  - {rules:?}\n\
             scrape_configs:\n  - job_name: larder\n    static_configs:\n      - targets: {targets:?}\n",
            rules = rules.display().to_string()
        );
        let config_path = dir.path().join("prometheus.yml");
        std::fs::write(&config_path, config).expect("write prometheus.yml");
        let port = free_port();
        let mut command = Command::new(which("prometheus"));
        command
            .arg(format!("--config.file={}", config_path.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .arg("--log.level=warn");
        let mut process = LoggedChild::spawn("prometheus", command, &dir.path().join("prometheus.log"));
        let url = format!("http://127.0.0.1:{port}");
        process.wait_ready(&format!("{url}/-/ready"), 200).await;
        Prometheus { url, process, _dir: dir }
    }

    async fn api(&self, path: &str, query: &[(&str, &str)]) -> serde_json::Value {
        let resp = http::client().get(format!("{}{path}", self.url)).query(query).send().await.expect("Prometheus API");
        let body = resp.bytes().await.expect("body");
        let value: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
        assert_eq!(value["status"], "success", "{path} {query:?}: {value}\n{}", self.process.log_tail(20));
        value["data"].clone()
    }

    /// An instant query's result vector, once it is non-empty.
    async fn query_until_data(&self, expr: &str) -> Vec<serde_json::Value> {
        let started = Instant::now();
        loop {
            let data = self.api("/api/v1/query", &[("query", expr)]).await;
            if let Some(result) = data["result"].as_array().filter(|r| !r.is_empty()) {
                return result.clone();
            }
            assert!(started.elapsed() < QUERY_TIMEOUT, "no data for {expr} within {QUERY_TIMEOUT:?}: {data}");
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
}

/// The dashboard row whose panels only a cluster (peers and a shared tier) fills.
const CLUSTER_ROW: &str = "Cluster";

/// Every `expr` of the dashboard's panels in the row titled `row` (or, with
/// `None`, in every other row), with the Grafana variables filled in. A
/// panel belongs to the last row above it, or to its collapsed row.
fn rules_file() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/larder/alerts/larder.rules.yaml")
}

/// How many alert rules the chart ships, so the test waits for every one
/// (and keeps doing so when a rule is added).
fn shipped_rule_count() -> usize {
    let text = std::fs::read_to_string(rules_file()).expect("read the rules file");
    text.lines().filter(|line| line.trim_start().starts_with("- alert:")).count()
}

fn dashboard_expressions(row: Option<&str>) -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("charts/larder/dashboards/larder.json");
    let dashboard: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read the dashboard")).expect("dashboard JSON");
    fn walk(panel: &serde_json::Value, out: &mut Vec<String>) {
        for target in panel["targets"].as_array().into_iter().flatten() {
            if let Some(expr) = target["expr"].as_str() {
                out.push(expr.to_owned());
            }
        }
        for sub in panel["panels"].as_array().into_iter().flatten() {
            walk(sub, out);
        }
    }
    let mut exprs = Vec::new();
    let mut current_row = "";
    for panel in dashboard["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            current_row = panel["title"].as_str().unwrap_or_default();
        }
        let wanted = match row {
            Some(title) => current_row == title,
            None => current_row != CLUSTER_ROW,
        };
        if wanted {
            walk(panel, &mut exprs);
        }
    }
    exprs
        .into_iter()
        .map(|e| e.replace("$__rate_interval", "1m").replace("$job", "larder").replace("$instance", ".*"))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn prometheus_scrapes_larder_and_every_dashboard_query_and_alert_rule_works() {
    let origin = Origin::start().await;
    ImageBuilder::oci().layers(&[256 * KIB, 256 * KIB, 128 * KIB]).push(&origin, "team/app", "v1").await;
    ImageBuilder::oci().layers(&[700 * KIB, 700 * KIB]).push(&origin, "team/big", "v1").await;
    // A small cache, so that the big image evicts: the eviction panel has data.
    // Its 700 KiB layers are above the default max_blob_size (512 KiB).
    let small = Larder::builder().upstream(&origin).max_size("2MiB").cache_line(r#"max_blob_size = "1MiB""#);
    let (builder, admin) = Admin::open(small);
    let larder = builder.start().await;
    let prometheus = Prometheus::start(&[format!("127.0.0.1:{}", admin.port)]).await;

    // Scraping has begun (Prometheus applies new targets within ~5 s), so
    // every counter's history starts before the traffic.
    let up = prometheus.query_until_data("up{job=\"larder\"} == 1").await;
    assert_eq!(up.len(), 1, "{up:?}");

    // Misses, then hits, then evictions, spread over a few scrapes.
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("cold pull");
    tokio::time::sleep(Duration::from_secs(2)).await;
    skopeo::pull(&larder.image_ref("team/app:v1"), false).await.expect("warm pull");
    skopeo::pull(&larder.image_ref("team/big:v1"), false).await.expect("pull past the cache size");
    prometheus.query_until_data("larder_cache_evictions_total > 0").await;

    let expressions = dashboard_expressions(None);
    assert!(expressions.len() >= 15, "the dashboard has its panels: {expressions:?}");
    for expr in &expressions {
        let result = prometheus.query_until_data(expr).await;
        assert!(!result.is_empty(), "{expr}");
    }
    // A figure checked against what was pulled: the blob hit ratio saw hits.
    let hit_ratio = prometheus
        .query_until_data(
            "sum(increase(larder_cache_requests_total{kind=\"blob\",result=~\"hit|coalesced\"}[5m])) \
             / sum(increase(larder_cache_requests_total{kind=\"blob\"}[5m])) > 0",
        )
        .await;
    let ratio: f64 = hit_ratio[0]["value"][1].as_str().expect("value").parse().expect("number");
    assert!(ratio > 0.0 && ratio < 1.0, "hits after misses: {ratio}");
    prometheus.query_until_data("larder_ready == 1").await;

    // Every alert rule evaluates cleanly on larder's real series.
    let shipped = shipped_rule_count();
    assert!(shipped >= 9, "the rules file has its alerts: {shipped}");
    let started = Instant::now();
    loop {
        let rules = prometheus.api("/api/v1/rules", &[]).await;
        let all: Vec<&serde_json::Value> = rules["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .flat_map(|g| g["rules"].as_array().expect("rules"))
            .collect();
        let evaluated =
            all.iter().filter(|r| r["health"] == "ok" && r["lastEvaluation"] != "0001-01-01T00:00:00Z").count();
        let broken: Vec<_> =
            all.iter().filter(|r| r["health"] == "err").map(|r| (&r["name"], &r["lastError"])).collect();
        assert!(broken.is_empty(), "alert rules failing on real series: {broken:?}");
        if all.len() == shipped && evaluated == all.len() {
            break;
        }
        assert!(started.elapsed() < QUERY_TIMEOUT, "rules not all evaluated: {rules}");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn every_cluster_panel_has_data_from_a_real_cluster() {
    let origin = Origin::start().await;
    let image = ImageBuilder::oci().layers(&[256 * KIB, 256 * KIB, 128 * KIB]).push(&origin, "team/app", "v1").await;
    let garage = Garage::builder().start().await;
    let cluster = Cluster::builder(&origin).replicas(2).shared(&garage, "dashboard").start().await;
    let targets: Vec<String> = cluster.replicas.iter().map(admin_address).collect();
    let prometheus = Prometheus::start(&targets).await;
    prometheus.query_until_data("count(up{job=\"larder\"} == 1) == 2").await;

    // A cold pull through the replica that does not own the first layer:
    // it asks the owner for it (peer requests out and in), and each replica
    // uploads what it verified to Garage.
    let layer = &image.blobs()[0].digest;
    let asker = cluster.other_than(cluster.owner_of(layer));
    skopeo::pull(&cluster.replicas[asker].image_ref("team/app:v1"), false).await.expect("pull through the cluster");
    prometheus.query_until_data("sum(larder_peer_requests_total{direction=\"out\"}) > 0").await;
    prometheus.query_until_data("sum(larder_peer_requests_total{direction=\"in\"}) > 0").await;
    prometheus.query_until_data("sum(larder_shared_uploads_total{result=\"uploaded\"}) > 0").await;

    let expressions = dashboard_expressions(Some(CLUSTER_ROW));
    assert!(expressions.len() >= 8, "the Cluster row has its panels: {expressions:?}");
    for expr in &expressions {
        let result = prometheus.query_until_data(expr).await;
        assert!(!result.is_empty(), "{expr}");
    }
    // Each replica counts both as up.
    let up = prometheus.query_until_data("larder_peers_up == 2").await;
    assert_eq!(up.len(), 2, "{up:?}");
}
