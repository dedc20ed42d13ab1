//! The user guides (README.md and docs/*.md), exercised: every fenced block
//! is run or checked by its kind, so a guide cannot show a config larder
//! refuses, a command it does not accept, or a path, port or value that
//! does not exist.
//!
//! * `toml` configs go through `larder check-config` (a fragment first gets
//!   a minimal `[[upstream]]`; files it names are created as placeholders),
//!   and every key they set, or show commented out, is in
//!   docs/configuration.md;
//! * `toml` blocks headed `# /etc/containerd/certs.d/<registry>/hosts.toml`
//!   must be what containerd reads, pointing at larder's port;
//! * `json` blocks are dockerd's daemon.json, pointing at larder's port;
//! * `yaml` blocks headed `# OpenTelemetry Collector` are a collector's
//!   config: an OTLP/HTTP receiver on the port larder's `otlp_endpoint`
//!   examples name, in a traces pipeline whose exporters are defined;
//! * other `yaml` blocks are Helm values: every key is in the chart's
//!   values.schema.json, and the chart renders with them (Helm's engine,
//!   through tests/docs/helm_render.py);
//! * `sh` blocks are split as a shell splits them, and each command is
//!   checked against what it names: `larder` is run with the same
//!   arguments where that is safe (and its flags are in its `--help`),
//!   `helm install --set` renders the chart, `kubectl` names Services and
//!   Secrets that render, `curl` names admin routes and parameters larder
//!   has, `skopeo`/`docker`/`curl` flags are in their `--help`, scripts and
//!   benchmarks exist, an S3 lifecycle file matches the guide's bucket;
//! * `console` blocks: their `$` lines are commands as above; their output
//!   is compared by the test a `<!-- checked-by: tests/NAME.rs -->` marker
//!   names, or marked `<!-- output-example: why -->`;
//! * the operating guide's admin commands (its curl block and its `larder
//!   status`/`prefetch`/`purge` lines) also run as written against a
//!   running larder in front of a real distribution registry;
//! * `promql` blocks name registered metrics and pass `promtool check rules`;
//! * anything else must be marked `<!-- not-tested: why -->` (or
//!   `checked-by`); those are counted and listed, and must stay few.
//!
//! Inline `larder …` code spans are checked against `larder --help`;
//! relative links and their anchors must resolve; the guides speak of
//! features, not issue numbers; the README stays a front door.

mod common;
#[path = "docs/markdown.rs"]
mod markdown;
#[path = "docs/shell.rs"]
mod shell;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use markdown::{Block, Doc, Marker};
use regex::Regex;

/// The README's length at most: two screens.
const README_MAX_LINES: usize = 250;
/// Blocks nothing exercises at all (diagrams): at most this many.
const MAX_NOT_TESTED: usize = 2;
/// A `larder` command line from a guide gets this long to end.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);
/// What a placeholder secret, token or key file holds.
const PLACEHOLDER: &str = "an-example-secret-of-some-length\n";
/// An address where nothing listens: where `larder` commands from a guide
/// look for an admin listener.
const NOWHERE: &str = "http://127.0.0.1:9";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn larder() -> &'static str {
    env!("CARGO_BIN_EXE_larder")
}

/// README.md and every docs/*.md, in that order.
fn guides() -> Vec<Doc> {
    let mut paths: Vec<String> = std::fs::read_dir(root().join("docs"))
        .expect("docs/")
        .map(|e| e.expect("an entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".md"))
        .map(|n| format!("docs/{n}"))
        .collect();
    paths.sort();
    std::iter::once("README.md".to_owned()).chain(paths).map(|p| Doc::read(root(), &p)).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Config,
    HostsToml,
    DaemonJson,
    HelmValues,
    CollectorConfig,
    Shell,
    Console,
    PromQl,
    Text,
}

fn kind(b: &Block) -> Kind {
    match b.lang.as_str() {
        "toml" if b.text.starts_with("# /etc/containerd/certs.d/") => Kind::HostsToml,
        "toml" => Kind::Config,
        "json" => Kind::DaemonJson,
        "yaml" if b.text.starts_with("# OpenTelemetry Collector") => Kind::CollectorConfig,
        "yaml" => Kind::HelmValues,
        "sh" => Kind::Shell,
        "console" => Kind::Console,
        "promql" => Kind::PromQl,
        "" | "text" => Kind::Text,
        other => panic!("{}: a `{other}` block, which this test does not know how to check: add a kind", b.at()),
    }
}

fn blocks_of(kind_wanted: Kind) -> Vec<Block> {
    guides().iter().flat_map(markdown::blocks).filter(|b| kind(b) == kind_wanted).collect()
}

// ---- every block has a kind ---------------------------------------------------------

#[test]
fn every_block_is_checked_by_its_kind_and_the_untested_ones_are_few_and_marked() {
    let mut per_kind: BTreeMap<Kind, usize> = BTreeMap::new();
    let mut not_tested = Vec::new();
    let mut output_examples = Vec::new();
    for doc in guides() {
        for b in markdown::blocks(&doc) {
            let k = kind(&b);
            *per_kind.entry(k).or_default() += 1;
            match (&b.marker, k) {
                (Some(Marker::NotTested(why)), Kind::Text) => {
                    assert!(!why.is_empty(), "{}: say why it is not tested", b.at());
                    not_tested.push(format!("{} ({why})", b.at()));
                }
                (Some(Marker::NotTested(_)), _) => panic!("{}: a {k:?} block can be tested: drop not-tested", b.at()),
                (Some(Marker::CheckedBy(test)), Kind::Text | Kind::Console) => {
                    let text = std::fs::read_to_string(root().join(test))
                        .unwrap_or_else(|e| panic!("{}: checked-by {test}: {e}", b.at()));
                    assert!(text.contains(&b.doc), "{}: {test} does not read {}", b.at(), b.doc);
                }
                (Some(Marker::OutputExample(why)), Kind::Console) => {
                    assert!(!why.is_empty(), "{}: say what the example shows", b.at());
                    output_examples.push(format!("{} ({why})", b.at()));
                }
                (None, Kind::Text | Kind::Console) => {
                    panic!("{}: a {k:?} block needs a not-tested, checked-by or output-example marker", b.at())
                }
                (Some(m), _) => panic!("{}: {m:?} does not fit a {k:?} block", b.at()),
                (None, _) => {}
            }
        }
    }
    println!("blocks per kind: {per_kind:?}");
    println!("not tested ({}): {not_tested:#?}", not_tested.len());
    println!("console output not compared ({}): {output_examples:#?}", output_examples.len());
    assert!(not_tested.len() <= MAX_NOT_TESTED, "too many untested blocks: {not_tested:#?}");
    assert!(per_kind.get(&Kind::Config).is_some_and(|n| *n > 10), "{per_kind:?}");
}

// ---- larder configs ---------------------------------------------------------------

/// The keys docs/configuration.md documents: the first column of its
/// `key | type | default | meaning` tables.
fn reference_keys() -> BTreeSet<String> {
    let doc = Doc::read(root(), "docs/configuration.md");
    let rows = markdown::table_rows(&doc.text, "key");
    let key = Regex::new(r"^`([a-z_]+(\.[a-z_]+|\[\])*)`$").unwrap();
    let mut keys = BTreeSet::new();
    for row in rows {
        assert_eq!(row.len(), 4, "docs/configuration.md: a row of key | type | default | meaning: {row:?}");
        let k = key.captures(&row[0]).unwrap_or_else(|| panic!("not one `dotted.key`: {:?}", row[0]))[1].to_owned();
        assert!(row[1..].iter().all(|c| !c.is_empty()), "docs/configuration.md: `{k}` has an empty cell: {row:?}");
        assert!(keys.insert(k.clone()), "docs/configuration.md lists `{k}` twice");
    }
    keys
}

/// The dotted key paths a config sets: `server.tls.cert`, `upstream.name`
/// (for every `[[upstream]]`), `upstream.urls[].credentials`. A table is
/// listed only when it is also a value of its own (`admin.tls`).
fn config_keys(text: &str) -> BTreeSet<String> {
    fn walk(prefix: &str, value: &toml::Value, top: bool, out: &mut BTreeSet<String>) {
        match value {
            toml::Value::Table(t) => {
                if !prefix.is_empty() {
                    out.insert(format!("{prefix}/"));
                }
                for (k, v) in t {
                    let path = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    walk(&path, v, prefix.is_empty(), out);
                }
            }
            toml::Value::Array(items) if top && items.iter().all(toml::Value::is_table) => {
                for item in items {
                    for (k, v) in item.as_table().unwrap() {
                        walk(&format!("{prefix}.{k}"), v, false, out);
                    }
                }
            }
            toml::Value::Array(items) => {
                out.insert(prefix.to_owned());
                for item in items.iter().filter(|i| i.is_table()) {
                    walk(&format!("{prefix}[]"), item, false, out);
                }
            }
            _ => {
                out.insert(prefix.to_owned());
            }
        }
    }
    let value: toml::Value = toml::from_str(text).unwrap_or_else(|e| panic!("not TOML: {e}\n{text}"));
    let mut out = BTreeSet::new();
    walk("", &value, true, &mut out);
    out
}

/// Keys shown commented out (`# peers = […]`), with the section they are in.
fn commented_keys(text: &str) -> BTreeSet<String> {
    let header = Regex::new(r"^\[\[?([a-z_.]+)\]\]?").unwrap();
    let commented = Regex::new(r"^#\s*([a-z_]+)\s*=").unwrap();
    let mut section = String::new();
    let mut out = BTreeSet::new();
    for line in text.lines().map(str::trim) {
        if let Some(c) = header.captures(line) {
            section = c[1].to_owned();
        } else if let Some(c) = commented.captures(line) {
            out.insert(if section.is_empty() { c[1].to_owned() } else { format!("{section}.{}", &c[1]) });
        }
    }
    out
}

/// Every key `text` sets or shows commented out is in the reference; a
/// table (`server.tls/`) is fine when the reference lists keys under it.
fn assert_keys_documented(at: &str, text: &str, reference: &BTreeSet<String>) {
    for key in config_keys(text).into_iter().chain(commented_keys(text)) {
        let documented = match key.strip_suffix('/') {
            Some(table) => reference.iter().any(|k| k == table || k.starts_with(&format!("{table}."))),
            None => reference.contains(&key),
        };
        assert!(documented, "{at}: `{key}` is not in docs/configuration.md");
    }
}

/// Keys whose value is a file larder reads at start-up.
const FILE_KEYS: &str = "password_file|secret_file|token_file|access_key_id_file|secret_access_key_file|ca_file|cert|key|client_ca|htpasswd";

/// Writes `text` as `larder.toml` into `dir` with a placeholder for every
/// file it names (absolute paths are moved under `dir`, as a pod's mounts
/// would be there) and returns the config's path.
fn with_placeholders(dir: &Path, text: &str) -> PathBuf {
    let file = Regex::new(&format!(r#"\b({FILE_KEYS})\s*=\s*"([^"]+)""#)).unwrap();
    let mut out = String::new();
    for line in text.lines() {
        let mut line = line.to_owned();
        if !line.trim_start().starts_with('#') {
            for c in file.captures_iter(&line.clone()) {
                let named = &c[2];
                let placed = dir.join(named.trim_start_matches('/'));
                std::fs::create_dir_all(placed.parent().unwrap()).unwrap();
                std::fs::write(&placed, PLACEHOLDER).unwrap();
                if named.starts_with('/') {
                    line = line.replace(&format!("\"{named}\""), &format!("{:?}", placed.display().to_string()));
                }
            }
        }
        out.push_str(&line);
        out.push('\n');
    }
    let config = dir.join("larder.toml");
    std::fs::write(&config, out).unwrap();
    config
}

/// The block as a complete config: a fragment without `[[upstream]]` gets
/// a minimal one. Returns the text and whether it was a fragment.
fn complete(text: &str) -> (String, bool) {
    if config_keys(text).iter().any(|k| k.starts_with("upstream.")) {
        (text.to_owned(), false)
    } else {
        (format!("{text}\n[[upstream]]\nname = \"docker.io\"\nurl = \"https://registry-1.docker.io\"\n"), true)
    }
}

fn check_config(config: &Path) -> Output {
    Command::new(larder())
        .args(["check-config", "--config"])
        .arg(config)
        .current_dir(config.parent().unwrap())
        .env("POD_IP", "10.0.0.7")
        .env("POD_NAMESPACE", "larder")
        .output()
        .expect("run larder check-config")
}

#[test]
fn config_blocks_pass_check_config_and_use_documented_keys() {
    let reference = reference_keys();
    let (mut complete_configs, mut fragments) = (0, 0);
    for b in blocks_of(Kind::Config) {
        assert_keys_documented(&b.at(), &b.text, &reference);
        let (text, fragment) = complete(&b.text);
        let dir = tempfile::tempdir().unwrap();
        let out = check_config(&with_placeholders(dir.path(), &text));
        assert!(
            out.status.success(),
            "{}: larder check-config refuses it:\n{}{}\n{text}",
            b.at(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if fragment { fragments += 1 } else { complete_configs += 1 }
    }
    println!("config blocks: {complete_configs} complete, {fragments} fragments, all accepted by check-config");
    assert!(complete_configs + fragments > 10);
}

#[test]
fn every_key_of_the_example_configs_is_in_the_reference() {
    let reference = reference_keys();
    assert!(reference.len() > 50, "{reference:?}");
    let mut files = Vec::new();
    for dir in ["config", "config/registries"] {
        for e in std::fs::read_dir(root().join(dir)).unwrap() {
            let path = e.unwrap().path();
            if path.extension().is_some_and(|x| x == "toml") {
                files.push(path);
            }
        }
    }
    files.sort();
    for path in &files {
        assert_keys_documented(&path.display().to_string(), &std::fs::read_to_string(path).unwrap(), &reference);
    }
    println!("{} example configs, {} documented keys", files.len(), reference.len());
}

// ---- what other programs read -------------------------------------------------------

/// larder's embedded default config: the ports and upstreams a newcomer gets.
struct Defaults {
    listen_port: u16,
    admin_port: u16,
    /// Upstream names and aliases.
    upstreams: BTreeSet<String>,
}

fn defaults() -> Defaults {
    let text = std::fs::read_to_string(root().join("config/default.toml")).unwrap();
    let config: toml::Value = toml::from_str(&text).unwrap();
    let port =
        |key: &str| -> u16 { config["server"][key].as_str().unwrap().rsplit_once(':').unwrap().1.parse().unwrap() };
    let mut upstreams = BTreeSet::new();
    for u in config["upstream"].as_array().unwrap() {
        upstreams.insert(u["name"].as_str().unwrap().to_owned());
        for a in u.get("aliases").and_then(toml::Value::as_array).into_iter().flatten() {
            upstreams.insert(a.as_str().unwrap().to_owned());
        }
    }
    Defaults { listen_port: port("listen"), admin_port: port("admin_listen"), upstreams }
}

fn port_of(url: &str) -> Option<u16> {
    url::Url::parse(url).ok()?.port_or_known_default()
}

#[test]
fn hosts_toml_blocks_are_what_containerd_reads_and_point_at_larder() {
    let d = defaults();
    let blocks = blocks_of(Kind::HostsToml);
    for b in &blocks {
        let registry = b.text.lines().next().unwrap().trim_start_matches("# /etc/containerd/certs.d/");
        let registry = registry.strip_suffix("/hosts.toml").unwrap_or_else(|| panic!("{}: the path", b.at()));
        assert!(d.upstreams.contains(registry), "{}: {registry} is no upstream of the default config", b.at());
        let hosts: toml::Table = toml::from_str(&b.text).unwrap_or_else(|e| panic!("{}: {e}", b.at()));
        assert!(hosts["server"].as_str().is_some_and(|s| s.starts_with("https://")), "{}: server", b.at());
        let host_tables = hosts["host"].as_table().unwrap_or_else(|| panic!("{}: no [host.\"…\"]", b.at()));
        for (url, host) in host_tables {
            assert_eq!(port_of(url), Some(d.listen_port), "{}: {url} is not larder's registry port", b.at());
            for (k, v) in host.as_table().unwrap() {
                // containerd's hosts.toml keys (docs/hosts.md in containerd).
                assert!(
                    ["capabilities", "skip_verify", "ca", "client", "header", "override_path"].contains(&k.as_str()),
                    "{}: containerd knows no {k:?}",
                    b.at()
                );
                if k == "capabilities" {
                    for c in v.as_array().unwrap() {
                        let c = c.as_str().unwrap();
                        assert!(["pull", "resolve"].contains(&c), "{}: capability {c:?} (larder is read-only)", b.at());
                    }
                }
            }
        }
    }
    assert!(!blocks.is_empty());
}

#[test]
fn collector_configs_receive_otlp_http_where_larder_sends_it() {
    let blocks = blocks_of(Kind::CollectorConfig);
    for b in &blocks {
        let config = yaml_to_json(&b.at(), &b.text);
        let http = &config["receivers"]["otlp"]["protocols"]["http"];
        let endpoint = http["endpoint"].as_str().unwrap_or_else(|| panic!("{}: no OTLP/HTTP receiver", b.at()));
        assert_eq!(port_of(&format!("http://{endpoint}")), Some(4318), "{}: OTLP/HTTP's port", b.at());
        let pipeline = &config["service"]["pipelines"]["traces"];
        let names = |key: &str| -> Vec<String> {
            pipeline[key].as_array().into_iter().flatten().filter_map(|v| v.as_str().map(str::to_owned)).collect()
        };
        assert!(names("receivers").contains(&"otlp".to_owned()), "{}: the traces pipeline takes OTLP", b.at());
        let exporters = names("exporters");
        assert!(!exporters.is_empty(), "{}: the traces pipeline exports", b.at());
        for e in exporters.iter().chain(names("processors").iter()) {
            let section = if exporters.contains(e) { "exporters" } else { "processors" };
            assert!(config[section].get(e).is_some(), "{}: {e} is used but not defined under {section}", b.at());
        }
    }
    // And larder's side: the operating guide's [tracing] example names that port.
    let guide = std::fs::read_to_string(root().join("docs/operating.md")).unwrap();
    assert!(guide.contains("otlp_endpoint = \"http://otel-collector.observability:4318\""));
    assert!(!blocks.is_empty());
}

#[test]
fn daemon_json_blocks_point_dockerd_at_larder() {
    let d = defaults();
    let blocks = blocks_of(Kind::DaemonJson);
    for b in &blocks {
        let json: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(&b.text).unwrap_or_else(|e| panic!("{}: {e}", b.at()));
        for (k, v) in &json {
            assert!(["registry-mirrors", "insecure-registries"].contains(&k.as_str()), "{}: {k}", b.at());
            if k == "registry-mirrors" {
                for mirror in v.as_array().unwrap() {
                    let mirror = mirror.as_str().unwrap();
                    assert_eq!(port_of(mirror), Some(d.listen_port), "{}: {mirror}", b.at());
                }
            }
        }
    }
    assert!(!blocks.is_empty());
}

// ---- larder's own command lines -----------------------------------------------------

/// `larder [SUB] --help`, once per subcommand.
fn help(sub: Option<&str>) -> String {
    static HELP: OnceLock<Mutex<HashMap<Option<String>, String>>> = OnceLock::new();
    let mut cache = HELP.get_or_init(Default::default).lock().unwrap();
    cache
        .entry(sub.map(str::to_owned))
        .or_insert_with(|| {
            let out = Command::new(larder()).args(sub).arg("--help").output().expect("larder --help");
            assert!(out.status.success(), "larder {sub:?} --help");
            String::from_utf8(out.stdout).unwrap()
        })
        .clone()
}

/// The subcommand of a `larder` command line (skipping global options and
/// their values), and the flags it uses. `[--repair]`-style optional
/// parts count as used.
fn subcommand_and_flags(words: &[String]) -> (Option<String>, Vec<String>) {
    let global_valued = ["--config", "--log-format"];
    let mut sub = None;
    let mut flags = Vec::new();
    let mut words = words.iter().skip(1).map(|w| w.trim_matches(|c| c == '[' || c == ']'));
    while let Some(w) = words.next() {
        if w.starts_with("--") {
            let flag = w.split_once('=').map_or(w, |(f, _)| f);
            flags.push(flag.to_owned());
            if sub.is_none() && global_valued.contains(&flag) && !w.contains('=') {
                words.next();
            }
        } else if sub.is_none() {
            sub = Some(w.to_owned());
        }
    }
    (sub, flags)
}

/// The subcommand exists and every flag is in its `--help`.
fn assert_in_help(at: &str, words: &[String]) {
    let (sub, flags) = subcommand_and_flags(words);
    if let Some(sub) = &sub {
        let commands = help(None);
        let listed = commands.lines().any(|l| l.split_whitespace().next() == Some(sub.as_str()));
        assert!(listed, "{at}: `larder {sub}` is not a larder command:\n{commands}");
    }
    let text = help(sub.as_deref());
    for flag in flags {
        assert!(
            text.contains(&format!("{flag} ")) || text.contains(&format!("{flag}\n")),
            "{at}: `{flag}` is not in `larder {} --help`",
            sub.as_deref().unwrap_or("")
        );
    }
}

/// Runs a guide's `larder` command line where it cannot touch anything:
/// in an empty folder, `--config` pointing at an absent file there and
/// the admin listener at an address where nothing listens; running the
/// proxy becomes `check-config`. clap must accept the line, and larder
/// must get as far as the config or the admin listener.
fn run_safely(at: &str, words: &[String]) {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("absent.toml").display().to_string();
    let mut args: Vec<String> = Vec::new();
    let mut words_iter = words.iter().skip(1);
    let mut has_config = false;
    while let Some(w) = words_iter.next() {
        args.push(w.clone());
        match w.as_str() {
            "--config" => {
                has_config = true;
                words_iter.next();
                args.push(absent.clone());
            }
            "--admin" => {
                words_iter.next();
                args.push(NOWHERE.to_owned());
            }
            "--token-file" => {
                words_iter.next();
                let token = dir.path().join("admin-token");
                std::fs::write(&token, PLACEHOLDER).unwrap();
                args.push(token.display().to_string());
            }
            _ => {}
        }
    }
    let (sub, _) = subcommand_and_flags(words);
    let operator = matches!(sub.as_deref(), Some("status" | "prefetch" | "purge"));
    if matches!(sub.as_deref(), None | Some("run")) {
        args.retain(|a| a != "run");
        args.push("check-config".to_owned());
    }
    let mut child = Command::new(larder())
        .args(&args)
        .current_dir(dir.path())
        .env("LARDER_ADMIN", NOWHERE)
        .env_remove("LARDER_ADMIN_TOKEN")
        .env_remove("LARDER_ADMIN_TOKEN_FILE")
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run larder");
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > COMMAND_TIMEOUT {
            child.kill().unwrap();
            panic!("{at}: `larder {}` did not end within {COMMAND_TIMEOUT:?}", args.join(" "));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let shown = format!("{at}: `larder {}` → {:?}\n{stderr}", args.join(" "), out.status.code());
    assert!(!stderr.contains("For more information, try '--help'"), "clap refused it: {shown}");
    if has_config {
        assert!(stderr.contains(&format!("{absent}: cannot read")), "it did not read --config: {shown}");
    } else if operator {
        assert!(out.status.code() == Some(1) && stderr.contains(NOWHERE), "it did not call the admin API: {shown}");
    } else {
        assert!(out.status.success(), "{shown}");
    }
}

/// `larder` commands of `sh` blocks and the `$` lines of `console` blocks.
fn fenced_larder_commands() -> Vec<(String, shell::Command)> {
    let mut out = Vec::new();
    for b in blocks_of(Kind::Shell) {
        out.extend(shell::parse(&b.text).into_iter().map(|c| (format!("{}:+{}", b.at(), c.line), c)));
    }
    for b in blocks_of(Kind::Console) {
        for (i, line) in b.text.lines().enumerate() {
            if let Some(command) = line.strip_prefix("$ ") {
                out.extend(shell::parse(command).into_iter().map(|c| (format!("{}:+{}", b.at(), i + 1), c)));
            }
        }
    }
    out.retain(|(_, c)| c.program() == Some("larder"));
    out
}

#[test]
fn larder_command_lines_are_accepted_by_larder() {
    let fenced = fenced_larder_commands();
    for (at, c) in &fenced {
        assert_in_help(at, &c.words);
        run_safely(at, &c.words);
    }
    let mut inline = 0;
    for doc in guides() {
        for span in markdown::code_spans(&doc).into_iter().filter(|s| s.starts_with("larder ")) {
            let words: Vec<String> = span.split_whitespace().map(str::to_owned).collect();
            assert_in_help(&format!("{}: `{span}`", doc.path), &words);
            inline += 1;
        }
    }
    println!("larder command lines: {} fenced, run; {inline} inline, checked against --help", fenced.len());
    assert!(fenced.len() >= 5 && inline >= 5);
}

/// A line of example output with its figures, sizes, durations and ports
/// reduced to their shape: `151.2 MiB in 12.4 s` and `70 KiB in 0.1 s`
/// read alike.
fn shape(line: &str) -> String {
    let unit = Regex::new(r"\d+(\.\d+)? ?(B|KiB|MiB|GiB|TiB|ms|s|m|h|d)\b").unwrap();
    let number = Regex::new(r"\d+(\.\d+)?").unwrap();
    let line = unit.replace_all(line, "N U");
    number.replace_all(&line, "N").split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The operating guide's admin commands, run as written against a running
/// larder whose `docker.io` and `ghcr.io` upstreams are a real
/// distribution registry holding the images the guide names: the curl
/// block (its URL and token file pointed at this larder, each curl made to
/// fail on an HTTP error) and the console block's `larder` lines, whose
/// output must have the example's shape.
#[tokio::test(flavor = "multi_thread")]
async fn the_operating_guides_admin_commands_work_against_a_running_larder() {
    let origin = common::Origin::start().await;
    for (repo, tag) in [("library/alpine", "3.20"), ("library/postgres", "16")] {
        common::ImageBuilder::oci().multi_arch().layers(&[64 * common::KIB]).push(&origin, repo, tag).await;
    }
    let upstreams = common::Larder::builder()
        .upstream(common::Upstream::new("docker.io", &origin.url()).default(true))
        .upstream(common::Upstream::new("ghcr.io", &origin.url()));
    let (builder, admin) = common::Admin::with_token(upstreams, "0123456789abcdef0123456789abcdef");
    let running = builder.start().await;
    let doc = Doc::read(root(), "docs/operating.md");
    let blocks = markdown::blocks(&doc);

    let curl = blocks.iter().find(|b| b.lang == "sh" && b.text.contains("curl ")).expect("the curl block");
    let script = curl
        .text
        .replace("http://127.0.0.1:9090", &admin.url())
        .replace("/run/secrets/larder-admin/token", &admin.token_file().display().to_string());
    let script = format!("set -eu\ncurl() {{ command curl -sS --fail-with-body \"$@\" && echo; }}\n{script}");
    // In a folder of its own: the export writes alpine.tar where it runs.
    let workdir = tempfile::tempdir().expect("a temp dir");
    let out = Command::new("bash").arg("-c").arg(&script).current_dir(workdir.path()).output().expect("bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}: {stdout}{}", curl.at(), String::from_utf8_lossy(&out.stderr));
    let answers: Vec<serde_json::Value> =
        stdout.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert!(answers.iter().any(|a| a["manifests"] == 1 && a["fetched"].as_u64() > Some(0)), "{stdout}");
    assert!(answers.iter().any(|a| a["event"] == "progress"), "streamed progress: {stdout}");
    assert!(answers.iter().any(|a| a["event"] == "done"), "{stdout}");
    assert_eq!(answers.iter().filter(|a| a.get("members").is_some()).count(), 2, "two purges: {stdout}");
    assert!(answers.iter().any(|a| a["images"] == 1 && a["manifests"] == 1), "the exported layout imported: {stdout}");

    let console = blocks.iter().find(|b| b.lang == "console").expect("the console block");
    let example = console.text.split("\n$ ").map(|c| c.trim_start_matches("$ ")).collect::<Vec<_>>();
    for shown in example {
        let (command, output) = shown.split_once('\n').unwrap();
        let command = command.replace("/etc/larder/larder.toml", &running.config_path().display().to_string());
        let words = shell::parse(&command).remove(0).words;
        let out = Command::new(larder())
            .args(&words[1..])
            .env("LARDER_ADMIN_TOKEN_FILE", admin.token_file())
            .env("LARDER_ADMIN", admin.url())
            .output()
            .unwrap();
        let actual = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{}: {command}: {actual}{}", console.at(), String::from_utf8_lossy(&out.stderr));
        let actual_shapes: Vec<String> = actual.lines().map(shape).collect();
        for line in output.lines().filter(|l| !l.trim().is_empty() && !l.starts_with(['⠙', '…'])) {
            let label = line.split_whitespace().next().unwrap();
            let same_label: Vec<&String> = actual_shapes.iter().filter(|a| a.starts_with(label)).collect();
            assert!(!same_label.is_empty(), "{}: `{command}` prints no {label:?} line:\n{actual}", console.at());
            if ["prefetching", "prefetched", "purged", "larder"].contains(&label) {
                assert!(same_label.contains(&&shape(line)), "{}: `{command}`: {line:?} is not\n{actual}", console.at());
            }
        }
    }
}

// ---- other programs' command lines --------------------------------------------------

fn which(program: &str) -> PathBuf {
    common::which(program)
}

/// `PROGRAM ARGS --help` (curl: `--help all`), once each.
fn tool_help(program: &str, args: &[&str]) -> String {
    static HELP: OnceLock<Mutex<HashMap<String, String>>> = OnceLock::new();
    let key = format!("{program} {}", args.join(" "));
    let mut cache = HELP.get_or_init(Default::default).lock().unwrap();
    cache
        .entry(key)
        .or_insert_with(|| {
            let help: &[&str] = if program == "curl" { &["--help", "all"] } else { &["--help"] };
            let out = Command::new(which(program)).args(args).args(help).output().expect("--help");
            String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
        })
        .clone()
}

fn assert_flags_in_help(at: &str, c: &shell::Command, sub: &[&str]) {
    let program = c.program().unwrap();
    let help = tool_help(program, sub);
    for flag in c.flags() {
        let shown = Regex::new(&format!(r"(^|[\s,]){}([\s,=\[]|$)", regex::escape(flag))).unwrap();
        assert!(shown.is_match(&help), "{at}: `{flag}` is not in `{program} {} --help`", sub.join(" "));
    }
}

/// What the guides' shell commands may name, gathered while checking.
#[derive(Default)]
struct ShellContext {
    /// Files a here-document wrote: name → body.
    written: HashMap<String, String>,
    /// The tag `charts/build-image.sh TAG` built.
    built_tag: Option<String>,
    /// Variables assigned in the block.
    assigned: BTreeSet<String>,
}

fn check_shell_command(at: &str, doc: &Doc, c: &shell::Command, cx: &mut ShellContext) {
    let d = defaults();
    for (name, value) in &c.assignments {
        cx.assigned.insert(name.clone());
        for inner in shell::substitutions(value) {
            for ic in shell::parse(&inner) {
                check_shell_command(at, doc, &ic, cx);
            }
        }
    }
    let Some(program) = c.program() else { return };
    match program {
        "larder" => {}           // run by larder_command_lines_are_accepted_by_larder
        "helm" | "kubectl" => {} // rendered by helm_values_and_commands_render_with_the_chart
        "cargo" => match c.words.get(1).map(String::as_str) {
            Some("run") => {
                assert_eq!(c.flags(), ["--release"], "{at}");
                let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
                assert_eq!(manifest.matches("[[bin]]").count(), 1, "{at}: cargo run needs one binary");
            }
            Some("bench") => {
                let name = c.option("--bench").unwrap_or_else(|| panic!("{at}: --bench NAME"));
                let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
                assert!(manifest.contains(&format!("[[bench]]\nname = \"{name}\"")), "{at}: no bench {name}");
                assert!(root().join(format!("benches/{name}.rs")).is_file(), "{at}: benches/{name}.rs");
            }
            other => panic!("{at}: cargo {other:?}: add a check"),
        },
        "python3" => {
            let script = &c.words[1];
            let text = std::fs::read_to_string(root().join(script)).unwrap_or_else(|e| panic!("{at}: {script}: {e}"));
            for flag in c.flags() {
                assert!(text.contains(&format!("\"{flag}\"")), "{at}: {script} has no {flag}");
            }
        }
        "skopeo" => {
            let sub = c.words[1].as_str();
            assert_flags_in_help(at, c, &[sub]);
            for image in c.words.iter().filter_map(|w| w.strip_prefix("docker://")) {
                let (authority, path) = image.split_once('/').unwrap();
                let port: u16 = authority.rsplit_once(':').unwrap().1.parse().unwrap();
                assert_eq!(port, d.listen_port, "{at}: {image} is not larder's registry port");
                let first = path.split('/').next().unwrap();
                let names_registry = first.contains('.') || first.contains(':') || first == "localhost";
                assert!(!names_registry || d.upstreams.contains(first), "{at}: {first} is no default upstream");
            }
        }
        "curl" => check_curl(at, c, &d, cx),
        "docker" => {
            assert_eq!(c.words[1], "run", "{at}");
            assert_flags_in_help(at, c, &["run"]);
            let script = std::fs::read_to_string(root().join("charts/build-image.sh")).unwrap();
            let dir = Regex::new(r#"dir = "(/[^"]+)""#).unwrap().captures(&script).unwrap()[1].to_owned();
            let volume = c.option("-v").unwrap_or_else(|| panic!("{at}: a cache volume"));
            assert_eq!(volume.split(':').nth(1), Some(dir.as_str()), "{at}: the image's cache is {dir}");
            let image = c.operands(&["-v", "--network", "-p"]).into_iter().nth(1).unwrap();
            let tag = cx.built_tag.as_deref().unwrap_or_else(|| panic!("{at}: build the image first"));
            assert_eq!(image, format!("larder:{tag}"), "{at}: charts/build-image.sh builds larder:TAG");
        }
        "cat" if c.heredoc.is_some() => {
            let (_, target) = c.redirects.iter().find(|(op, _)| op == ">").expect("cat > FILE <<EOF");
            cx.written.insert(target.clone(), c.heredoc.clone().unwrap());
        }
        "cat" => {
            for file in &c.words[1..] {
                let folder = Path::new(file).parent().unwrap().display().to_string();
                let templates = root().join("charts/larder/templates");
                let mounted = std::fs::read_dir(&templates)
                    .unwrap()
                    .any(|e| std::fs::read_to_string(e.unwrap().path()).unwrap().contains(&format!("{folder}/")));
                assert!(mounted, "{at}: {file}: the chart mounts nothing at {folder}");
            }
        }
        "base64" | "less" | "grep" => {} // plain filters in a pipeline
        "aws" => check_lifecycle(at, doc, c, cx),
        path if path.contains('/') => {
            use std::os::unix::fs::PermissionsExt;
            let meta = std::fs::metadata(root().join(path)).unwrap_or_else(|e| panic!("{at}: {path}: {e}"));
            assert!(meta.permissions().mode() & 0o111 != 0, "{at}: {path} is not executable");
            if path == "charts/build-image.sh" {
                cx.built_tag = Some(c.words.get(1).cloned().unwrap_or_else(|| "dev".to_owned()));
            }
        }
        other => panic!("{at}: `{other}`: this test does not know what to check of it; add a check"),
    }
}

/// A curl command names a larder port, and on the admin port a route,
/// method, parameters and headers larder has.
fn check_curl(at: &str, c: &shell::Command, d: &Defaults, cx: &ShellContext) {
    assert_flags_in_help(at, c, &[]);
    let url = c.words.iter().find(|w| w.starts_with("http")).unwrap_or_else(|| panic!("{at}: no URL"));
    let url = url::Url::parse(url).unwrap_or_else(|e| panic!("{at}: {url}: {e}"));
    let admin: String = std::fs::read_dir(root().join("src/server/admin"))
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    match url.port_or_known_default() {
        Some(p) if p == d.admin_port => {
            let path = url.path();
            assert!(admin.contains(&format!("\"{path}\"")), "{at}: the admin listener has no {path}");
            if matches!(path, "/prefetch" | "/purge" | "/export" | "/import") {
                assert_eq!(c.option("-X"), Some("POST"), "{at}: {path} is a POST");
            }
            for (k, _) in url.query_pairs() {
                assert!(admin.contains(&format!("params.get(\"{k}\")")), "{at}: {path} reads no `{k}`");
            }
            for header in c.options("-H") {
                let (name, value) = header.split_once(": ").unwrap();
                match name {
                    "Authorization" => {
                        let var = value.strip_prefix("Bearer $").unwrap_or_else(|| panic!("{at}: {header}"));
                        assert!(cx.assigned.contains(var), "{at}: ${var} is never set");
                    }
                    "Accept" => assert!(admin.contains(value), "{at}: the admin listener knows no {value}"),
                    other => panic!("{at}: header {other}: add a check"),
                }
            }
        }
        Some(p) => assert_eq!(p, d.listen_port, "{at}: {url} is not a larder port"),
        None => panic!("{at}: {url}"),
    }
}

/// `aws s3api put-bucket-lifecycle-configuration`: the rules file a
/// here-document wrote is S3's lifecycle shape, for the bucket and prefix
/// of the guide's `[shared] url`.
fn check_lifecycle(at: &str, doc: &Doc, c: &shell::Command, cx: &ShellContext) {
    assert_eq!(c.words[1..3], ["s3api", "put-bucket-lifecycle-configuration"], "{at}");
    let shared = markdown::blocks(doc)
        .into_iter()
        .filter(|b| kind(b) == Kind::Config)
        .find_map(|b| {
            toml::from_str::<toml::Value>(&b.text).ok()?.get("shared")?.get("url")?.as_str().map(str::to_owned)
        })
        .unwrap_or_else(|| panic!("{at}: the guide shows no [shared] url"));
    let (bucket, prefix) = shared.trim_start_matches("s3://").split_once('/').unwrap();
    assert_eq!(c.option("--bucket"), Some(bucket), "{at}: the bucket of [shared] url");
    let file = c.option("--lifecycle-configuration").unwrap().trim_start_matches("file://");
    let rules: serde_json::Value = serde_json::from_str(&cx.written[file]).unwrap_or_else(|e| panic!("{at}: {e}"));
    let rules = rules["Rules"].as_array().unwrap();
    assert_eq!(rules.len(), 2, "{at}: expiry and aborting incomplete uploads");
    for rule in rules {
        assert_eq!(rule["Status"], "Enabled", "{at}");
        assert_eq!(rule["Filter"]["Prefix"], format!("{prefix}/"), "{at}: the prefix of [shared] url");
        let days = rule["Expiration"]["Days"]
            .as_u64()
            .or(rule["AbortIncompleteMultipartUpload"]["DaysAfterInitiation"].as_u64());
        assert!(days.is_some_and(|d| d > 0), "{at}: {rule}");
    }
}

#[test]
fn shell_commands_name_what_exists() {
    let mut n = 0;
    for doc in guides() {
        for b in markdown::blocks(&doc).into_iter().filter(|b| kind(b) == Kind::Shell) {
            let mut cx = ShellContext::default();
            for c in shell::parse(&b.text) {
                check_shell_command(&format!("{}:+{}", b.at(), c.line), &doc, &c, &mut cx);
                n += 1;
            }
        }
        for b in markdown::blocks(&doc).into_iter().filter(|b| kind(b) == Kind::Console) {
            let mut cx = ShellContext::default();
            for line in b.text.lines().filter_map(|l| l.strip_prefix("$ ")) {
                for c in shell::parse(line) {
                    check_shell_command(&b.at(), &doc, &c, &mut cx);
                    n += 1;
                }
            }
        }
    }
    println!("shell commands checked: {n}");
}

// ---- Helm ---------------------------------------------------------------------------

/// `--set a.b=c,d=true` as nested values, typed as Helm types them.
fn set_values(sets: &[&str]) -> serde_json::Value {
    let mut values = serde_json::json!({});
    for set in sets {
        for pair in set.split(',') {
            let (path, raw) = pair.split_once('=').unwrap();
            let value = match raw {
                "true" => serde_json::json!(true),
                "false" => serde_json::json!(false),
                n if n.parse::<i64>().is_ok() => serde_json::json!(n.parse::<i64>().unwrap()),
                s => serde_json::json!(s),
            };
            let mut node = &mut values;
            let parts: Vec<&str> = path.split('.').collect();
            for part in &parts[..parts.len() - 1] {
                node = node.as_object_mut().unwrap().entry(*part).or_insert(serde_json::json!({}));
            }
            node[parts[parts.len() - 1]] = value;
        }
    }
    values
}

/// What `helm install RELEASE charts/larder -n NS -f FILE --set …` renders:
/// `-f` names a values block of the same guide (`files`), noted in `installed`.
fn helm_install(
    at: String,
    c: &shell::Command,
    files: &BTreeMap<String, (String, serde_json::Value)>,
    installed: &mut BTreeSet<String>,
) -> Render {
    assert!(matches!(c.words[1].as_str(), "install" | "template"), "{at}");
    for flag in c.flags() {
        let known = ["-n", "--namespace", "--create-namespace", "--set", "-f"];
        assert!(known.contains(&flag), "{at}: helm flag {flag}: add a check");
    }
    let mut values = serde_json::json!({});
    for file in c.options("-f") {
        let (_, from_file) = files.get(file).unwrap_or_else(|| panic!("{at}: the guide shows no `# {file}` values"));
        merge(&mut values, from_file);
        installed.insert(file.to_owned());
    }
    merge(&mut values, &set_values(&c.options("--set")));
    let operands = c.operands(&["-n", "--namespace", "--set", "-f"]);
    let (release, chart) = (operands[1], operands[2]);
    assert!(root().join(chart).join("Chart.yaml").is_file(), "{at}: no chart {chart}");
    assert_eq!(chart, "charts/larder", "{at}: the guides install larder's chart");
    let namespace = c.option("-n").or(c.option("--namespace")).unwrap_or("default");
    Render { at, release: release.to_owned(), namespace: namespace.to_owned(), values }
}

/// Merges `from` into `into`, as Helm merges values files and `--set`.
fn merge(into: &mut serde_json::Value, from: &serde_json::Value) {
    match (into, from) {
        (serde_json::Value::Object(into), serde_json::Value::Object(from)) => {
            for (k, v) in from {
                merge(into.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
        (into, from) => *into = from.clone(),
    }
}

struct Render {
    at: String,
    release: String,
    namespace: String,
    values: serde_json::Value,
}

fn render(renders: &[Render]) -> Vec<serde_json::Value> {
    let request = serde_json::json!({
        "chart": root().join("charts/larder"),
        "renders": renders.iter().map(|r| serde_json::json!({
            "label": r.at, "release": r.release, "namespace": r.namespace, "values": r.values,
        })).collect::<Vec<_>>(),
    });
    let mut child = Command::new(which("python3"))
        .arg(root().join("tests/docs/helm_render.py"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python3 tests/docs/helm_render.py");
    serde_json::to_writer(child.stdin.take().unwrap(), &request).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "helm_render.py: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

/// YAML to JSON with the same parser helm_render.py uses (PyYAML).
fn yaml_to_json(at: &str, yaml: &str) -> serde_json::Value {
    let mut child = Command::new(which("python3"))
        .args(["-c", "import json, sys, yaml; json.dump(yaml.safe_load(sys.stdin), sys.stdout)"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), yaml.as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{at}: not YAML: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn helm_values_and_commands_render_with_the_chart() {
    let mut renders = Vec::new();
    // kubectl commands, each with the index of the `helm install` before it.
    let mut kubectl = Vec::new();
    for doc in guides() {
        // Values blocks by the file name their first line gives
        // (`# hub-values.yaml`), for `helm install -f`; each renders on its
        // own unless a command installs it.
        let mut files: BTreeMap<String, (String, serde_json::Value)> = BTreeMap::new();
        let mut installed: BTreeSet<String> = BTreeSet::new();
        for b in markdown::blocks(&doc).into_iter().filter(|b| kind(b) == Kind::HelmValues) {
            let name = b.text.lines().next().and_then(|l| l.strip_prefix("# ")).filter(|n| n.ends_with(".yaml"));
            let name = name.map_or_else(|| b.at(), str::to_owned);
            files.insert(name, (b.at(), yaml_to_json(&b.at(), &b.text)));
        }
        let mut last_install = None;
        for b in markdown::blocks(&doc).into_iter().filter(|b| kind(b) == Kind::Shell) {
            for c in shell::parse(&b.text) {
                let at = format!("{}:+{}", b.at(), c.line);
                match c.program() {
                    Some("helm") => {
                        last_install = Some(renders.len());
                        renders.push(helm_install(at, &c, &files, &mut installed));
                    }
                    Some("kubectl") => {
                        let install = last_install.unwrap_or_else(|| panic!("{at}: no helm install before"));
                        kubectl.push((at, c, install));
                    }
                    _ => {}
                }
            }
        }
        for (name, (at, values)) in files {
            if !installed.contains(&name) {
                let (release, namespace) = ("larder".to_owned(), "larder".to_owned());
                renders.push(Render { at, release, namespace, values });
            }
        }
    }
    let results = render(&renders);
    for (r, result) in renders.iter().zip(&results) {
        assert_eq!(result["unknown"], serde_json::json!([]), "{}: keys not in values.schema.json", r.at);
        assert!(result["error"].is_null(), "{}: the chart does not render: {}", r.at, result["error"]);
    }
    for (at, c, install) in &kubectl {
        let r = &renders[*install];
        assert_eq!(c.option("-n"), Some(r.namespace.as_str()), "{at}: the release's namespace");
        let objects = results[*install]["objects"].as_array().unwrap();
        let find = |kind: &str, name: &str| {
            objects.iter().find(|o| o["kind"] == kind && o["name"] == name).unwrap_or_else(|| {
                panic!("{at}: the release of {} renders no {kind} {name}", r.at);
            })
        };
        match c.operands(&["-n", "-o"]).as_slice() {
            ["port-forward", target, ports] => {
                let service = find("Service", target.strip_prefix("svc/").unwrap());
                let remote: u64 = ports.split(':').nth(1).unwrap().parse().unwrap();
                assert!(service["ports"].as_array().unwrap().contains(&remote.into()), "{at}: port {remote}");
            }
            ["get", "secret", name] => {
                let key = c.option("-o").unwrap().trim_start_matches("jsonpath={.data.").trim_end_matches('}');
                let secret = find("Secret", name);
                assert!(secret["data_keys"].as_array().unwrap().contains(&key.into()), "{at}: no key {key}");
            }
            other => panic!("{at}: kubectl {other:?}: add a check"),
        }
    }
    println!("helm renders: {} (values blocks and helm commands); kubectl commands: {}", renders.len(), kubectl.len());
    assert!(renders.len() >= 4 && !kubectl.is_empty());
}

// ---- metrics ------------------------------------------------------------------------

/// Metric names registered in src/metrics.rs: each constructor's first
/// argument, a name followed by its help text.
fn registered_metrics() -> BTreeSet<String> {
    let text = std::fs::read_to_string(root().join("src/metrics.rs")).unwrap();
    let constructor = Regex::new(r#"\(\s*"([a-z_]+)",\s*""#).unwrap();
    constructor.captures_iter(&text).map(|c| format!("larder_{}", &c[1])).collect()
}

#[test]
fn the_metric_table_lists_exactly_the_registered_metrics() {
    let doc = Doc::read(root(), "docs/operating.md");
    let rows = markdown::table_rows(&doc.text, "metric");
    let name = Regex::new(r"`(larder_[a-z_]+)`").unwrap();
    let documented: BTreeSet<String> =
        rows.iter().flat_map(|r| name.captures_iter(&r[0]).map(|c| c[1].to_owned()).collect::<Vec<_>>()).collect();
    let registered = registered_metrics();
    assert!(registered.len() > 30, "{registered:?}");
    assert_eq!(documented, registered, "docs/operating.md's metric table against src/metrics.rs");
}

#[test]
fn promql_blocks_name_registered_metrics_and_parse() {
    let registered = registered_metrics();
    let metric = Regex::new(r"\blarder_[a-z_]+").unwrap();
    let blocks = blocks_of(Kind::PromQl);
    let mut queries = Vec::new();
    for b in &blocks {
        for query in b.text.split("\n\n") {
            let expr: Vec<&str> = query.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
            if expr.is_empty() {
                continue;
            }
            let expr = expr.join("\n");
            for m in metric.find_iter(&expr) {
                assert!(registered.contains(m.as_str()), "{}: {} is not a larder metric", b.at(), m.as_str());
            }
            queries.push((b.at(), expr));
        }
    }
    let dir = tempfile::tempdir().unwrap();
    let rules: String = queries
        .iter()
        .enumerate()
        .map(|(i, (_, expr))| {
            let indented = expr.lines().map(|l| format!("          {l}\n")).collect::<String>();
            format!("      - record: docs:query_{i}\n        expr: |\n{indented}")
        })
        .collect();
    let file = dir.path().join("queries.yaml");
    std::fs::write(&file, format!("groups:\n  - name: docs\n    rules:\n{rules}")).unwrap();
    let out = Command::new(which("promtool")).args(["check", "rules"]).arg(&file).output().unwrap();
    assert!(
        out.status.success(),
        "promtool refuses a query of {:?}:\n{}{}",
        queries.iter().map(|(at, _)| at).collect::<Vec<_>>(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!("PromQL queries: {}", queries.len());
    assert!(!queries.is_empty());
}

// ---- links and wording --------------------------------------------------------------

#[test]
fn relative_links_and_their_anchors_resolve() {
    let mut docs = guides();
    docs.push(Doc::read(root(), "benches/README.md"));
    let mut anchors: HashMap<PathBuf, Vec<String>> = HashMap::new();
    let mut n = 0;
    for doc in &docs {
        for link in markdown::links(doc) {
            if link.contains("://") || link.starts_with("mailto:") {
                continue;
            }
            let (path, anchor) = link.split_once('#').map_or((link.as_str(), None), |(p, a)| (p, Some(a)));
            let target = if path.is_empty() { PathBuf::from(&doc.path) } else { normalize(&doc.dir().join(path)) };
            assert!(root().join(&target).exists(), "{}: link to {link}: {} does not exist", doc.path, target.display());
            if let Some(anchor) = anchor {
                let offered = anchors
                    .entry(target.clone())
                    .or_insert_with(|| markdown::anchors(&Doc::read(root(), &target.display().to_string())));
                assert!(
                    offered.iter().any(|a| a == anchor),
                    "{}: link to {link}: no #{anchor} in {}",
                    doc.path,
                    target.display()
                );
            }
            n += 1;
        }
    }
    println!("relative links: {n}");
}

/// `a/../b` as `b`, without touching the file system.
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for part in path.components() {
        match part {
            std::path::Component::ParentDir => {
                assert!(out.pop(), "{} leaves the repository", path.display());
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

#[test]
fn guides_speak_of_features_not_issue_numbers() {
    let numbered = Regex::new(r"(?i)\b(issue|session)s?[ -]?#?\d+").unwrap();
    let link_target = Regex::new(r"\]\([^)]*\)").unwrap();
    for doc in guides() {
        let prose = link_target.replace_all(&markdown::prose(&doc), "]()").into_owned();
        let hits: Vec<&str> = numbered.find_iter(&prose).map(|m| m.as_str()).collect();
        assert!(hits.is_empty(), "{}: {hits:?}: say what changed, not which issue changed it", doc.path);
    }
}

#[test]
fn the_readme_is_a_front_door_with_the_two_set_up_commands_and_every_guide() {
    let readme = Doc::read(root(), "README.md");
    let lines = readme.text.lines().count();
    assert!(lines <= README_MAX_LINES, "README.md has {lines} lines: move detail into docs/");
    for command in ["```sh\ncargo run --release\n```", "```sh\ntests/run.sh\n```"] {
        assert!(readme.text.contains(command), "README.md shows {command}");
    }
    let linked: BTreeSet<String> = markdown::links(&readme).into_iter().collect();
    for doc in guides().iter().skip(1) {
        assert!(linked.contains(&doc.path), "README.md's guide table has no link to {}", doc.path);
        assert!(markdown::heading(doc.text.lines().next().unwrap_or("")).is_some(), "{} starts with a title", doc.path);
    }
    println!("README.md: {lines} lines");
}
