//! Traces in OpenTelemetry (`[tracing] otlp_endpoint`), checked on the
//! wire: a receiver of its own on 127.0.0.1 speaks OTLP/HTTP as a
//! collector does (`POST /v1/traces`, protobuf), decodes every export with
//! `opentelemetry-proto`, and the tests compare span names, kinds,
//! parentage and trace ids exactly; the fake upstream records the
//! `traceparent` larder sends it.
//!
//! W3C Trace Context: `traceparent` is `00-<trace id>-<parent id>-<flags>`,
//! flag `01` sampled. A request's server span continues a valid one (same
//! trace id, the client's span as parent, its sampled flag decides:
//! parent-based sampling); an invalid one starts a new trace.

mod common;
mod fake;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::metrics::{ADMIN_LISTEN, metric};
use common::{Cluster, Larder, Upstream, free_port};
use fake::{
    FakeUpstream, OCI_MANIFEST, PATIENCE, REPO, blob_path, digest, image_manifest, manifest_path, random_bytes,
};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;

const SERVER: i32 = 2;
const CLIENT: i32 = 3;
const INTERNAL: i32 = 1;
/// The name larder's fake upstream is configured under.
const UPSTREAM: &str = "fake.test";

/// One span as the receiver decoded it; ids in lowercase hex, `parent`
/// empty for a root span.
#[derive(Clone, Debug)]
struct Received {
    service: String,
    name: String,
    kind: i32,
    trace_id: String,
    span_id: String,
    parent: String,
    attributes: BTreeMap<String, String>,
}

impl Received {
    fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// `200` with an empty `ExportTraceServiceResponse`.
    Ok,
    /// This status, after decoding what came.
    Status(u16),
    /// Reads the export, then never answers.
    Hang,
}

/// An OTLP/HTTP trace receiver on 127.0.0.1.
struct Collector {
    addr: SocketAddr,
    spans: Arc<Mutex<Vec<Received>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Collector {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Collector {
    async fn start(answer: Answer) -> Collector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the receiver on 127.0.0.1");
        let addr = listener.local_addr().expect("its address");
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = Arc::clone(&spans);
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else { continue };
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let service = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let kept = Arc::clone(&kept);
                        async move { Ok::<_, Infallible>(receive(req, &kept, answer).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Collector { addr, spans, task }
    }

    /// The base endpoint, as `[tracing] otlp_endpoint` takes it.
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn spans(&self) -> Vec<Received> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until the spans received satisfy `done`; returns them all.
    async fn wait_for(&self, what: &str, done: impl Fn(&[Received]) -> bool) -> Vec<Received> {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            assert!(tokio::time::Instant::now() < deadline, "gave up waiting for {what}; received:\n{spans:#?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

async fn receive(
    req: hyper::Request<hyper::body::Incoming>,
    kept: &Mutex<Vec<Received>>,
    answer: Answer,
) -> hyper::Response<Full<Bytes>> {
    let path_ok = req.method() == hyper::Method::POST && req.uri().path() == "/v1/traces";
    let protobuf = req.headers().get("content-type").is_some_and(|v| v == "application/x-protobuf");
    let body = req.into_body().collect().await.map(|b| b.to_bytes()).unwrap_or_default();
    assert!(path_ok && protobuf, "larder POSTs protobuf to /v1/traces");
    let export = ExportTraceServiceRequest::decode(body).expect("an OTLP ExportTraceServiceRequest");
    let mut received = Vec::new();
    for resource in export.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| r.attributes.iter())
            .find(|kv| kv.key == "service.name")
            .map(|kv| text(kv.value.as_ref().and_then(|v| v.value.as_ref())))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                let attributes = span
                    .attributes
                    .iter()
                    .map(|kv| (kv.key.clone(), text(kv.value.as_ref().and_then(|v| v.value.as_ref()))))
                    .collect();
                received.push(Received {
                    service: service.clone(),
                    name: span.name,
                    kind: span.kind,
                    trace_id: hex::encode(span.trace_id),
                    span_id: hex::encode(span.span_id),
                    parent: hex::encode(span.parent_span_id),
                    attributes,
                });
            }
        }
    }
    kept.lock().unwrap().extend(received);
    match answer {
        Answer::Ok => hyper::Response::builder()
            .header("content-type", "application/x-protobuf")
            .body(Full::new(Bytes::new()))
            .unwrap(),
        Answer::Status(status) => hyper::Response::builder().status(status).body(Full::new(Bytes::new())).unwrap(),
        Answer::Hang => std::future::pending().await,
    }
}

fn text(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// The one span named `name` of `service` in `trace_id` satisfying `also`.
fn one<'a>(
    spans: &'a [Received],
    service: &str,
    trace_id: &str,
    name: &str,
    also: impl Fn(&Received) -> bool,
) -> &'a Received {
    let found: Vec<&Received> =
        spans.iter().filter(|s| s.service == service && s.trace_id == trace_id && s.name == name && also(s)).collect();
    assert_eq!(found.len(), 1, "one {name:?} span of {service} in trace {trace_id}; all spans:\n{spans:#?}");
    found[0]
}

fn has(spans: &[Received], service: &str, trace_id: &str, name: &str, also: impl Fn(&Received) -> bool) -> bool {
    spans.iter().any(|s| s.service == service && s.trace_id == trace_id && s.name == name && also(s))
}

/// A client's `traceparent`: a made-up trace and parent, sampled or not.
fn traceparent(trace_id: &str, parent: &str, sampled: bool) -> String {
    format!("00-{trace_id}-{parent}-{}", if sampled { "01" } else { "00" })
}

/// An image (config and one layer) at `test/app:v1`, its manifest's bytes
/// and the layer's digest.
fn image(seed: u64) -> (fake::FakeUpstreamBuilder, Bytes, String) {
    let config = random_bytes(512, seed);
    let layer = random_bytes(256 << 10, seed + 1);
    let manifest = image_manifest((&digest(&config), config.len()), &[(&digest(&layer), layer.len())]);
    let layer_digest = digest(&layer);
    let builder = FakeUpstream::builder().blob(config).blob(layer).manifest(REPO, "v1", OCI_MANIFEST, manifest.clone());
    (builder, manifest, layer_digest)
}

/// A larder in front of `upstream_url` exporting to `collector` as
/// `service`; `extra` adds `[tracing]` lines. Exports every 100 ms, and
/// gives up on one after 1 s, so tests wait little.
fn traced(upstream: Upstream, collector_url: &str, service: &str, extra: &str) -> common::LarderBuilder {
    Larder::builder()
        .upstream(upstream)
        .server_line(ADMIN_LISTEN)
        .append_toml(&format!("[tracing]\notlp_endpoint = {collector_url:?}\nservice_name = {service:?}\n{extra}"))
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "1000")
}

fn fake_upstream(up: &FakeUpstream) -> Upstream {
    // No fills ahead: the blob request below is the one that fills.
    Upstream::new(UPSTREAM, &up.url()).default(true).line("fill_ahead = false")
}

/// GET `path` with these extra headers; returns the status and `X-Request-Id`.
async fn get(larder: &Larder, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
    let request = common::http::manifest_get(&common::http::client(), &format!("{}{path}", larder.url()));
    let request = headers.iter().fold(request, |r, (k, v)| r.header(*k, *v));
    let resp = request.send().await.unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let status = resp.status().as_u16();
    let id = resp.headers().get("x-request-id").and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let _ = resp.bytes().await;
    (status, id)
}

/// The `traceparent` the fake upstream got with `method path` (the first such request).
fn sent_upstream(up: &FakeUpstream, method: &str, path: &str) -> Option<String> {
    up.log().into_iter().find(|r| r.method == method && r.path == path).and_then(|r| r.traceparent)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_trace_continues_through_the_cache_decision_the_fill_and_upstream() {
    let collector = Collector::start(Answer::Ok).await;
    let (builder, _, layer) = image(1);
    let up = builder.start().await;
    let larder = traced(fake_upstream(&up), &collector.url(), "larder", "").start().await;

    // A cold manifest: the client's trace, its span as parent.
    let (trace_m, client_m) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let (status, request_id) =
        get(&larder, &manifest_path("v1"), &[("traceparent", &traceparent(trace_m, client_m, true))]).await;
    assert_eq!(status, 200);
    let manifest_url = format!("{}{}", up.url(), manifest_path("v1"));
    let spans = collector
        .wait_for("the manifest request's spans", |s| {
            has(s, "larder", trace_m, "GET /v2/{name}/manifests/{reference}", |_| true)
                && has(s, "larder", trace_m, "GET", |c| c.attr("url.full") == Some(manifest_url.as_str()))
        })
        .await;
    let server = one(&spans, "larder", trace_m, "GET /v2/{name}/manifests/{reference}", |_| true);
    assert_eq!((server.kind, server.parent.as_str()), (SERVER, client_m), "continues the client's span");
    assert_eq!(server.attr("http.route"), Some("/v2/{name}/manifests/{reference}"));
    assert_eq!(server.attr("http.response.status_code"), Some("200"));
    assert_eq!(server.attr("larder.request_id"), Some(request_id.as_str()), "the X-Request-Id, to find the log line");
    assert_eq!(server.attr("larder.upstream"), Some(UPSTREAM));
    assert_eq!(server.attr("larder.repository"), Some(REPO));
    assert_eq!(server.attr("larder.cache"), Some("miss"));
    let cache = one(&spans, "larder", trace_m, "cache manifest", |_| true);
    assert_eq!(
        (cache.kind, cache.parent.as_str(), cache.attr("larder.cache")),
        (INTERNAL, server.span_id.as_str(), Some("miss"))
    );
    let fetch = one(&spans, "larder", trace_m, "GET", |c| c.attr("url.full") == Some(manifest_url.as_str()));
    assert_eq!(
        (fetch.kind, fetch.parent.as_str()),
        (CLIENT, cache.span_id.as_str()),
        "the upstream GET, under the decision"
    );
    assert_eq!(fetch.attr("http.response.status_code"), Some("200"));
    assert_eq!(
        sent_upstream(&up, "GET", &manifest_path("v1")),
        Some(traceparent(trace_m, &fetch.span_id, true)),
        "the origin is asked within the same trace, the upstream GET span as parent"
    );

    // A cold blob: its fill, in a task of its own, is still this trace's.
    let (trace_b, client_b) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let (status, _) = get(&larder, &blob_path(&layer), &[("traceparent", &traceparent(trace_b, client_b, true))]).await;
    assert_eq!(status, 200);
    let blob_url = format!("{}{}", up.url(), blob_path(&layer));
    let spans = collector
        .wait_for("the blob request's spans", |s| {
            has(s, "larder", trace_b, "fill", |_| true)
                && has(s, "larder", trace_b, "GET", |c| c.attr("url.full") == Some(blob_url.as_str()))
                && has(s, "larder", trace_b, "GET /v2/{name}/blobs/{digest}", |_| true)
        })
        .await;
    let server = one(&spans, "larder", trace_b, "GET /v2/{name}/blobs/{digest}", |_| true);
    assert_eq!((server.kind, server.parent.as_str(), server.attr("larder.cache")), (SERVER, client_b, Some("miss")));
    let cache = one(&spans, "larder", trace_b, "cache blob", |_| true);
    assert_eq!(cache.parent, server.span_id);
    let fill = one(&spans, "larder", trace_b, "fill", |_| true);
    assert_eq!((fill.kind, fill.parent.as_str()), (INTERNAL, cache.span_id.as_str()));
    assert_eq!(fill.attr("larder.digest"), Some(layer.as_str()));
    assert_eq!(fill.attr("larder.fill.size"), Some((256 << 10).to_string().as_str()));
    let get_blob = one(&spans, "larder", trace_b, "GET", |c| c.attr("url.full") == Some(blob_url.as_str()));
    assert_eq!((get_blob.kind, get_blob.parent.as_str()), (CLIENT, fill.span_id.as_str()));
    assert_eq!(sent_upstream(&up, "GET", &blob_path(&layer)), Some(traceparent(trace_b, &get_blob.span_id, true)));

    // Warm: the same manifest again is a hit, and two spans, no upstream.
    let trace_w = "11111111111111111111111111111111";
    let (status, _) =
        get(&larder, &manifest_path("v1"), &[("traceparent", &traceparent(trace_w, client_m, true))]).await;
    assert_eq!(status, 200);
    let spans =
        collector.wait_for("the warm request's spans", |s| has(s, "larder", trace_w, "cache manifest", |_| true)).await;
    let in_trace: Vec<&str> = spans.iter().filter(|s| s.trace_id == trace_w).map(|s| s.name.as_str()).collect();
    assert_eq!(in_trace.len(), 2, "{in_trace:?}");
    assert_eq!(one(&spans, "larder", trace_w, "cache manifest", |_| true).attr("larder.cache"), Some("hit"));
    assert_eq!(metric(&larder, r#"larder_trace_spans_total{result="failed"}"#).await, 0.0);
    assert_eq!(metric(&larder, r#"larder_trace_spans_total{result="dropped"}"#).await, 0.0);
    assert!(metric(&larder, r#"larder_trace_spans_total{result="exported"}"#).await >= 9.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_check_of_the_clients_credentials_is_in_its_trace_with_the_token_fetch() {
    let collector = Collector::start(Answer::Ok).await;
    let (builder, _, _) = image(7);
    let up = builder
        .token_response(r#"{"token":"t-alice","expires_in":300}"#)
        .accept_authorization("Bearer t-alice")
        .start()
        .await;
    let realm = format!("{}/token", up.url());
    up.set_challenge(Some(&format!(r#"Bearer realm="{realm}",service="fake""#)));
    let upstream = fake_upstream(&up).line("client_credentials = \"verify\"");
    // `/v2/` asks for credentials here: ready once it listens.
    let larder = traced(upstream, &collector.url(), "larder", "").ready_on_tcp().start().await;
    let alice = ("authorization", "Basic YWxpY2U6cHc="); // alice:pw

    // The first request with these credentials: checked with the upstream.
    let (trace, client) = ("22222222222222222222222222222222", "2222222222222222");
    let (status, _) =
        get(&larder, &manifest_path("v1"), &[alice, ("traceparent", &traceparent(trace, client, true))]).await;
    assert_eq!(status, 200);
    let manifest_url = format!("{}{}", up.url(), manifest_path("v1"));
    let spans = collector
        .wait_for("the checked request's spans", |s| {
            has(s, "larder", trace, "GET /v2/{name}/manifests/{reference}", |_| true)
                && has(s, "larder", trace, "verify credentials", |_| true)
                && has(s, "larder", trace, "GET", |c| c.attr("url.full") == Some(manifest_url.as_str()))
        })
        .await;
    let server = one(&spans, "larder", trace, "GET /v2/{name}/manifests/{reference}", |_| true);
    assert_eq!((server.parent.as_str(), server.attr("larder.upstream")), (client, Some(UPSTREAM)));
    let verify = one(&spans, "larder", trace, "verify credentials", |_| true);
    assert_eq!(
        (verify.kind, verify.parent.as_str(), verify.attr("larder.upstream"), verify.attr("larder.verdict")),
        (INTERNAL, server.span_id.as_str(), Some(UPSTREAM), Some("granted"))
    );
    let token = one(&spans, "larder", trace, "token", |t| t.parent == verify.span_id);
    assert_eq!(token.attr("larder.realm"), Some(realm.as_str()));
    let realm_get = one(&spans, "larder", trace, "GET", |c| c.parent == token.span_id);
    assert_eq!(
        (realm_get.kind, realm_get.attr("url.full"), realm_get.attr("http.response.status_code")),
        (CLIENT, Some(realm.as_str()), Some("200"))
    );
    let probes: Vec<(&str, Option<&str>)> = spans
        .iter()
        .filter(|c| c.parent == verify.span_id && c.name == "HEAD")
        .map(|c| (c.attr("url.full").unwrap_or_default(), c.attr("http.response.status_code")))
        .collect();
    assert_eq!(probes.len(), 2, "the check: HEAD (the challenge), the token, HEAD with the client's token: {probes:?}");
    assert!(probes.iter().all(|(url, _)| *url == manifest_url), "{probes:?}");
    assert!(
        probes.contains(&(manifest_url.as_str(), Some("401")))
            && probes.contains(&(manifest_url.as_str(), Some("200")))
    );
    let probe = one(&spans, "larder", trace, "HEAD", |c| {
        c.parent == verify.span_id && c.attr("http.response.status_code") == Some("200")
    });
    let probed = up.log().into_iter().find(|r| {
        r.method == "HEAD" && r.path == manifest_path("v1") && r.authorization.as_deref() == Some("Bearer t-alice")
    });
    assert_eq!(probed.and_then(|r| r.traceparent), Some(traceparent(trace, &probe.span_id, true)));
    // Then the cache's miss fills with the lent credentials, its own
    // requests (and token fetch) under the decision.
    let cache = one(&spans, "larder", trace, "cache manifest", |_| true);
    assert_eq!((cache.parent.as_str(), cache.attr("larder.cache")), (server.span_id.as_str(), Some("miss")));
    let fetch = one(&spans, "larder", trace, "GET", |c| {
        c.attr("url.full") == Some(manifest_url.as_str()) && c.attr("http.response.status_code") == Some("200")
    });
    assert_eq!(fetch.parent, cache.span_id);
    let under_cache = spans.iter().filter(|s| s.trace_id == trace && s.parent == cache.span_id).count();
    let tokens = spans.iter().filter(|s| s.trace_id == trace && s.name == "token").count();
    assert_eq!((under_cache, tokens), (3, 2), "GET 401, token, GET 200 under the decision; a token each");
    assert_eq!(spans.iter().filter(|s| s.trace_id == trace).count(), 11, "{spans:#?}");

    // Within the verdict's lifetime the same credentials are not checked again.
    let (trace, client) = ("33333333333333333333333333333333", "3333333333333333");
    let (status, _) =
        get(&larder, &manifest_path("v1"), &[alice, ("traceparent", &traceparent(trace, client, true))]).await;
    assert_eq!(status, 200);
    let spans =
        collector.wait_for("the second request's spans", |s| has(s, "larder", trace, "cache manifest", |_| true)).await;
    let in_trace: Vec<&str> = spans.iter().filter(|s| s.trace_id == trace).map(|s| s.name.as_str()).collect();
    assert_eq!(in_trace.len(), 2, "the request and its cache hit: {in_trace:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn through_a_via_hub_the_hub_spans_share_the_trace() {
    let collector = Collector::start(Answer::Ok).await;
    let (builder, _, _) = image(11);
    let up = builder.start().await;
    let hub = traced(fake_upstream(&up), &collector.url(), "hub", "").start().await;
    let node_upstream = fake_upstream(&up).line(&format!("via = {:?}", hub.url()));
    let node = traced(node_upstream, &collector.url(), "node", "").start().await;

    let (trace, client) = ("5b8aa5a2d2c872e8321cf37308d69df2", "051581bf3cb55c13");
    let (status, _) = get(&node, &manifest_path("v1"), &[("traceparent", &traceparent(trace, client, true))]).await;
    assert_eq!(status, 200);
    let origin_url = format!("{}{}", up.url(), manifest_path("v1"));
    let route = "GET /v2/{name}/manifests/{reference}";
    let spans = collector
        .wait_for("the node's and the hub's spans", |s| {
            has(s, "node", trace, route, |_| true)
                && has(s, "hub", trace, route, |_| true)
                && has(s, "hub", trace, "GET", |c| c.attr("url.full") == Some(origin_url.as_str()))
        })
        .await;
    let node_server = one(&spans, "node", trace, route, |_| true);
    assert_eq!(node_server.parent, client);
    let node_cache = one(&spans, "node", trace, "cache manifest", |_| true);
    assert_eq!(node_cache.parent, node_server.span_id);
    let to_hub = one(&spans, "node", trace, "GET", |_| true);
    assert_eq!((to_hub.kind, to_hub.parent.as_str()), (CLIENT, node_cache.span_id.as_str()));
    assert_eq!(to_hub.attr("server.port"), Some(hub.port().to_string().as_str()), "the node's upstream is the hub");
    let hub_server = one(&spans, "hub", trace, route, |_| true);
    assert_eq!(
        (hub_server.kind, hub_server.parent.as_str()),
        (SERVER, to_hub.span_id.as_str()),
        "the hub continues the node's span"
    );
    let hub_cache = one(&spans, "hub", trace, "cache manifest", |_| true);
    assert_eq!(hub_cache.parent, hub_server.span_id);
    let to_origin = one(&spans, "hub", trace, "GET", |c| c.attr("url.full") == Some(origin_url.as_str()));
    assert_eq!(to_origin.parent, hub_cache.span_id);
    assert_eq!(sent_upstream(&up, "GET", &manifest_path("v1")), Some(traceparent(trace, &to_origin.span_id, true)));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_owner_continues_the_trace_of_the_replica_that_asks_it() {
    let collector = Collector::start(Answer::Ok).await;
    let (builder, _, layer) = image(61);
    let up = builder.start().await;
    let cluster = Cluster::builder(fake_upstream(&up))
        .replicas(2)
        .append_toml(&format!("[tracing]\notlp_endpoint = {:?}\n", collector.url()))
        .each(|b| b.env("OTEL_BSP_SCHEDULE_DELAY", "100"))
        .start()
        .await;
    let owner = cluster.owner_of(&layer);
    let asker = &cluster.replicas[cluster.other_than(owner)];
    assert_eq!(get(asker, &manifest_path("v1"), &[]).await.0, 200);

    let (trace, client) = ("77777777777777777777777777777777", "8888888888888888");
    let (status, _) = get(asker, &blob_path(&layer), &[("traceparent", &traceparent(trace, client, true))]).await;
    assert_eq!(status, 200);
    let origin_url = format!("{}{}", up.url(), blob_path(&layer));
    let route = "GET /v2/{name}/blobs/{digest}";
    let spans = collector
        .wait_for("the asker's and the owner's spans", |s| {
            has(s, "larder", trace, route, |s| s.attr("larder.listener") == Some("peer"))
                && has(s, "larder", trace, "GET", |c| c.attr("url.full") == Some(origin_url.as_str()))
                && s.iter().filter(|s| s.trace_id == trace && s.name == "fill").count() == 2
        })
        .await;
    let asked = one(&spans, "larder", trace, route, |s| s.attr("larder.listener") == Some("registry"));
    assert_eq!(asked.parent, client);
    let cache = one(&spans, "larder", trace, "cache blob", |c| c.parent == asked.span_id);
    let fill = one(&spans, "larder", trace, "fill", |f| f.parent == cache.span_id);
    let ask = one(&spans, "larder", trace, "GET", |c| c.parent == fill.span_id);
    assert_eq!(ask.attr("larder.peer"), Some(cluster.peer_urls[owner].as_str()), "the asker's fill asks the owner");
    let served = one(&spans, "larder", trace, route, |s| s.attr("larder.listener") == Some("peer"));
    assert_eq!((served.kind, served.parent.as_str()), (SERVER, ask.span_id.as_str()), "the owner continues the ask");
    let owner_cache = one(&spans, "larder", trace, "cache blob", |c| c.parent == served.span_id);
    let owner_fill = one(&spans, "larder", trace, "fill", |f| f.parent == owner_cache.span_id);
    assert_eq!(owner_fill.attr("larder.fill.reason"), Some("peer"));
    let fetch = one(&spans, "larder", trace, "GET", |c| c.attr("url.full") == Some(origin_url.as_str()));
    assert_eq!(fetch.parent, owner_fill.span_id);
    assert_eq!(sent_upstream(&up, "GET", &blob_path(&layer)), Some(traceparent(trace, &fetch.span_id, true)));
}

#[tokio::test(flavor = "multi_thread")]
async fn sampling_is_parent_based_and_the_ratio_decides_new_traces() {
    let collector = Collector::start(Answer::Ok).await;
    let (builder, manifest, _) = image(21);
    let up = builder.start().await;
    let never = traced(fake_upstream(&up), &collector.url(), "ratio-0", "sampling_ratio = 0.0").start().await;
    let by_digest = manifest_path(&digest(&manifest));

    // Ratio 0, no traceparent: nothing recorded; the origin still gets a
    // traceparent, unsampled, so the decision travels on.
    let (status, _) = get(&never, &manifest_path("v1"), &[]).await;
    assert_eq!(status, 200);
    let sent = sent_upstream(&up, "GET", &manifest_path("v1")).expect("a traceparent upstream");
    assert!(sent.starts_with("00-") && sent.ends_with("-00") && sent.len() == 55, "unsampled: {sent}");
    // A sampled client trace is recorded whatever the ratio.
    let (trace, client) = ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb");
    let (status, _) = get(&never, &by_digest, &[("traceparent", &traceparent(trace, client, true))]).await;
    assert_eq!(status, 200);
    let spans =
        collector.wait_for("the sampled request", |s| has(s, "ratio-0", trace, "cache manifest", |_| true)).await;
    // Spans leave in the order they end: the unsampled request's would be here by now.
    let others: Vec<&Received> = spans.iter().filter(|s| s.trace_id != trace).collect();
    assert!(others.is_empty(), "ratio 0 records no new trace: {others:#?}");
    assert_eq!(one(&spans, "ratio-0", trace, "GET /v2/{name}/manifests/{reference}", |_| true).parent, client);

    // Ratio 1 (the default): an unsampled client trace stays unsampled,
    // and its decision goes upstream with its trace id.
    let always = traced(fake_upstream(&up), &collector.url(), "ratio-1", "").start().await;
    let (unsampled, sampled) = ("cccccccccccccccccccccccccccccccc", "dddddddddddddddddddddddddddddddd");
    let tag = manifest_path("v1");
    let (status, _) = get(&always, &tag, &[("traceparent", &traceparent(unsampled, client, false))]).await;
    assert_eq!(status, 200);
    let sent: Vec<String> = up.log().into_iter().filter(|r| r.path == tag).filter_map(|r| r.traceparent).collect();
    let last = sent.last().expect("the second larder's GET");
    assert!(last.starts_with(&format!("00-{unsampled}-")) && last.ends_with("-00"), "{last}");
    let (status, _) = get(&always, &by_digest, &[("traceparent", &traceparent(sampled, client, true))]).await;
    assert_eq!(status, 200);
    let spans = collector
        .wait_for("ratio 1's sampled request", |s| has(s, "ratio-1", sampled, "cache manifest", |_| true))
        .await;
    assert!(!spans.iter().any(|s| s.trace_id == unsampled), "the unsampled parent was not recorded");
    let (status, _) = get(&always, &by_digest, &[]).await;
    assert_eq!(status, 200);
    let spans = collector
        .wait_for("ratio 1's new trace", |s| {
            s.iter().any(|s| s.service == "ratio-1" && s.parent.is_empty() && s.kind == SERVER)
        })
        .await;
    let root = spans.iter().find(|s| s.service == "ratio-1" && s.parent.is_empty() && s.kind == SERVER).unwrap();
    assert_ne!(root.trace_id, "00000000000000000000000000000000");
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_traceparents_start_new_traces_and_are_answered_as_usual() {
    let collector = Collector::start(Answer::Ok).await;
    let (builder, manifest, _) = image(31);
    let up = builder.start().await;
    let larder = traced(fake_upstream(&up), &collector.url(), "larder", "").start().await;
    let by_digest = manifest_path(&digest(&manifest));
    assert_eq!(get(&larder, &by_digest, &[]).await.0, 200);

    let huge = format!("00-{}-{}-01", "a".repeat(32), "b".repeat(16 << 10));
    let valid = traceparent("0123456789abcdef0123456789abcdef", "0123456789abcdef", true);
    let cases: Vec<(&str, Vec<(&str, String)>)> = vec![
        ("malformed", vec![("traceparent", "not-a-traceparent".into())]),
        ("all-zero trace id", vec![("traceparent", traceparent(&"0".repeat(32), "0123456789abcdef", true))]),
        (
            "all-zero parent id",
            vec![("traceparent", traceparent("0123456789abcdef0123456789abcdef", &"0".repeat(16), true))],
        ),
        ("upper case", vec![("traceparent", traceparent(&"A".repeat(32), &"B".repeat(16), true))]),
        ("version ff", vec![("traceparent", valid.replacen("00-", "ff-", 1))]),
        ("16 KiB", vec![("traceparent", huge)]),
        ("two headers", vec![("traceparent", valid.clone()), ("traceparent", valid.clone())]),
        ("fifty headers", (0..50).map(|_| ("traceparent", valid.clone())).collect()),
    ];
    let mut ids = Vec::new();
    for (what, headers) in &cases {
        let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let (status, id) = get(&larder, &by_digest, &headers).await;
        assert_eq!(status, 200, "{what}");
        ids.push((*what, id));
    }
    let spans = collector
        .wait_for("a server span per hostile request", |s| {
            ids.iter()
                .all(|(_, id)| s.iter().any(|s| s.kind == SERVER && s.attr("larder.request_id") == Some(id.as_str())))
        })
        .await;
    for (what, id) in &ids {
        let server =
            spans.iter().find(|s| s.kind == SERVER && s.attr("larder.request_id") == Some(id.as_str())).unwrap();
        assert_eq!(server.parent, "", "{what}: a new trace, no remote parent");
        assert!(
            !["0".repeat(32), "a".repeat(32), "0123456789abcdef0123456789abcdef".into()].contains(&server.trace_id),
            "{what}"
        );
    }
    assert!(
        up.log().iter().all(|r| r.traceparent.as_deref().is_none_or(|t| t.len() == 55)),
        "only well-formed ids go upstream"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_collector_that_is_down_fails_or_hangs_costs_only_spans() {
    let (builder, manifest, _) = image(41);
    let up = builder.start().await;
    let by_digest = manifest_path(&digest(&manifest));
    const REQUESTS: usize = 50;

    // Down: nothing listens there.
    let down = format!("http://127.0.0.1:{}", free_port());
    let larder = traced(fake_upstream(&up), &down, "larder", "").start().await;
    for _ in 0..REQUESTS {
        assert_eq!(get(&larder, &by_digest, &[]).await.0, 200);
    }
    // Each warm request made two spans; the first, cold one more.
    wait_for_metric(&larder, r#"larder_trace_spans_total{result="failed"}"#, (2 * REQUESTS + 1) as f64).await;
    assert_eq!(metric(&larder, r#"larder_trace_spans_total{result="exported"}"#).await, 0.0);
    assert!(larder.log().contains("traces: export failed"), "said once in the log");
    assert_eq!(larder.log().matches("traces: export failed").count(), 1, "once per outage, not per batch");
    drop(larder);

    // Answers 500 (not retried; a 502, 503 or 504 would be, within the
    // export timeout): every span sent counts once as failed, none as
    // exported. (Spans made: two per warm request, three for the cold
    // first, one per `GET /v2/` the harness polled readiness with.)
    let made = 2 * REQUESTS + 1;
    let failing = Collector::start(Answer::Status(500)).await;
    let larder = traced(fake_upstream(&up), &failing.url(), "larder", "").start().await;
    for _ in 0..REQUESTS {
        assert_eq!(get(&larder, &by_digest, &[]).await.0, 200);
    }
    let distinct = |spans: &[Received]| {
        let mut ids: Vec<&str> = spans.iter().map(|s| s.span_id.as_str()).collect();
        ids.sort();
        ids.dedup();
        ids.len()
    };
    failing.wait_for("every request's spans, sent at least once", |s| distinct(s) > made).await;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let failed = metric(&larder, r#"larder_trace_spans_total{result="failed"}"#).await;
        let sent = failing.spans();
        if failed == distinct(&sent) as f64 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{failed} counted as failed, {} distinct spans sent",
            distinct(&sent)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&larder, r#"larder_trace_spans_total{result="exported"}"#).await, 0.0);
    drop(larder);

    // Hangs for the whole test (export timeout 10 min): requests go on,
    // the queue of 8 fills, and every span past it is dropped and counted.
    let hung = Collector::start(Answer::Hang).await;
    let larder = traced(fake_upstream(&up), &hung.url(), "larder", "")
        .env("OTEL_BSP_MAX_QUEUE_SIZE", "8")
        .env("OTEL_EXPORTER_OTLP_TIMEOUT", "600000")
        .start()
        .await;
    for _ in 0..REQUESTS {
        assert_eq!(get(&larder, &by_digest, &[]).await.0, 200);
    }
    let dropped = metric(&larder, r#"larder_trace_spans_total{result="dropped"}"#).await;
    // At most 8 wait in the queue and 8 are in the export that hangs.
    assert!(dropped >= (made - 16) as f64, "{dropped} of at least {made} spans dropped");
    assert_eq!(metric(&larder, r#"larder_trace_spans_total{result="exported"}"#).await, 0.0);
}

async fn wait_for_metric(larder: &Larder, series: &str, at_least: f64) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let value = metric(larder, series).await;
        if value >= at_least {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "{series} = {value}, waited for {at_least}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn without_tracing_nothing_is_exported_or_propagated_and_the_config_wins_over_the_environment() {
    let collector = Collector::start(Answer::Ok).await;
    let (builder, _, _) = image(51);
    let up = builder.start().await;
    let client_trace = traceparent("eeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee", "ffffffffffffffff", true);

    // Unset: no traceparent read or sent.
    let plain = Larder::builder().upstream(fake_upstream(&up)).start().await;
    assert_eq!(get(&plain, &manifest_path("v1"), &[("traceparent", &client_trace)]).await.0, 200);
    assert_eq!(sent_upstream(&up, "GET", &manifest_path("v1")), None, "nothing propagated with tracing off");
    drop(plain);

    // The environment names a collector and the config does not: it is used.
    let from_env = Larder::builder()
        .upstream(fake_upstream(&up))
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.url())
        .env("OTEL_SERVICE_NAME", "from-env")
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .start()
        .await;
    assert_eq!(get(&from_env, &manifest_path("v1"), &[]).await.0, 200);
    collector.wait_for("spans sent where the environment says", |s| s.iter().any(|s| s.service == "from-env")).await;
    drop(from_env);

    // Both: the config's collector gets the spans, the environment's none.
    let configured = Collector::start(Answer::Ok).await;
    let both = traced(fake_upstream(&up), &configured.url(), "from-config", "")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", &collector.url())
        .start()
        .await;
    let before = collector.spans().len();
    assert_eq!(get(&both, &manifest_path("v1"), &[]).await.0, 200);
    configured.wait_for("spans at the config's collector", |s| s.iter().any(|s| s.service == "from-config")).await;
    assert!(both.log().contains("tracing.otlp_endpoint"), "the log says which setting won");
    assert_eq!(collector.spans().len(), before, "none at the environment's");
}
