#!/usr/bin/env python3
"""Load benchmark: larder's warm serving speed and memory next to nginx and
CNCF distribution in proxy mode, plus a cold pull against a direct pull.

In one run, side by side, every measurement repeated --reps times (the order
of the servers rotates between repetitions), median and min–max reported:

  1. warm blob GET throughput (wrk, 1 and 16 connections, 1 MiB and 10 MiB
     blobs): larder, distribution proxy, nginx (sendfile, same bytes);
  2. warm manifest GET by digest and by tag (wrk, 16 connections): larder vs
     distribution proxy (nginx as a static-file reference), and larder's
     latency percentiles at 70 % of its measured maximum rate (oha);
  3. larder's idle RSS after warm-up, and its peak RSS during 64 concurrent
     downloads of a 100 MiB blob (distribution's proxy for reference);
  4. cold pull wall time of an 8 × 8 MiB image with skopeo through a fresh
     larder vs directly from the origin;
  5. the issue-13 rows: server CPU per request (utime + stime) and
     throughput against nginx for the manifest and the 10 MiB blob, and the
     cost of larder's request log (larder as shipped, one line per request,
     beside the same binary with the log off).

    python3 benches/load.py [--reps 5] [--duration 5] [--out DIR]

Everything listens on 127.0.0.1 only. See benches/README.md.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import pwd
import random
import resource
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import herd  # noqa: E402  (the herd benchmark's process, image and machine helpers)
from herd import (  # noqa: E402
    CHILD_ENV,
    HOST,
    HTTP,
    OCI_CONFIG,
    OCI_LAYER_GZIP,
    OCI_MANIFEST,
    Procs,
    free_port,
    http_status,
    sha256_hex,
    tail,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024

LOAD_REPO = "bench/load"  # blobs of exactly 1, 10 and 100 MiB + a small manifest
COLD_REPO = "bench/cold"  # 8 × 8 MiB gzip'd tar layers (herd.py's generator)
TAG = "v1"
BLOB_SIZES = {"1MiB": 1 * MIB, "10MiB": 10 * MIB, "100MiB": 100 * MIB}
WRK_BLOBS = ("1MiB", "10MiB")
WRK_CONNS = (1, 16)
MANIFEST_CONNS = 16
BIG_DOWNLOADS = 64
OHA_RATE_SHARE = 0.70

SERVERS = ("larder", "distribution", "nginx")
# larder with its request log turned off, beside larder as shipped, on the
# points whose logging cost the issue-13 targets ask for.
QUIET = "larder-quiet"
QUIET_BLOBS = ("10MiB",)
# larder with `server.sendfile = "always"`: as shipped (`auto`), larder keeps
# sendfile for clients on other hosts, and every client here is on loopback.
SENDFILE = "larder-sendfile"
LABEL = {
    "larder": "larder",
    QUIET: "larder, request log off",
    SENDFILE: "larder, sendfile always",
    "distribution": "distribution proxy",
    "nginx": "nginx (sendfile)",
    "direct": "direct from origin",
}

# The issue-7 targets.
TARGET_BLOB_VS_NGINX = 0.8
TARGET_BLOB_VS_DIST = 2.0
TARGET_MANIFEST_VS_DIST = 50.0
TARGET_P99_MS = 5.0
TARGET_COLD_RATIO = 1.1
TARGET_IDLE_RSS_MIB = 20.0
TARGET_PEAK_RSS_MIB = 128.0

# The issue-13 targets (scale and speed, round 2).
TARGET13_MANIFEST_CPU = 1.5  # nginx CPU per manifest GET ÷ larder's (log on)
TARGET13_BLOB_CPU = 1.0  # nginx CPU per 10 MiB GET ÷ larder's
TARGET13_MANIFEST_RATE = 1.5  # larder req/s ÷ nginx
TARGET13_BLOB_RATE = 1.2  # larder MB/s ÷ nginx
TARGET13_COLD_RATIO = 1.05
TARGET13_LOG_RATE = 0.95  # larder req/s with the request log ÷ without (≤ 5 % cost)
# A request line is about 200–300 bytes: a larder run "with the log on"
# must have written at least this much per completed request.
MIN_LOG_BYTES_PER_REQUEST = 100

WRK_LUA = r"""
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%d,"bytes":%d,"duration_us":%d,"err_connect":%d,"err_read":%d,' ..
    '"err_write":%d,"err_status":%d,"err_timeout":%d,"lat_mean_us":%.1f,"lat_p50_us":%d,' ..
    '"lat_p99_us":%d,"lat_max_us":%d}\n',
    summary.requests, summary.bytes, summary.duration, e.connect, e.read, e.write, e.status,
    e.timeout, latency.mean, latency:percentile(50), latency:percentile(99), latency.max))
end
"""


def log(msg: str) -> None:
    print(f"[load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rotate(items, rep: int) -> list:
    items = list(items)
    k = rep % len(items)
    return items[k:] + items[:k]


def summary(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def fmt_s(s: dict | None, fmt: str = "{:.0f}") -> str:
    if not s:
        return "–"
    return f"{fmt.format(s['median'])} ({fmt.format(s['min'])}–{fmt.format(s['max'])})"


# ----------------------------------------------------------------------------
# Tools
# ----------------------------------------------------------------------------

INSTALL_HINT = {
    "docker-registry": "apt-get install -y docker-registry",
    "skopeo": "apt-get install -y skopeo",
    "nginx": "apt-get install -y nginx",
    "wrk": "apt-get install -y wrk",
    "curl": "apt-get install -y curl",
    "oha": "cargo install oha --locked",
    "cargo": "install a Rust toolchain (https://rustup.rs)",
}


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin", str(Path.home() / ".cargo" / "bin")):
        p = Path(d) / name
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def oha_json_flag(oha: str) -> list[str]:
    """oha ≥ 1.9 has `--output-format json`; older ones `--json`."""
    try:
        h = subprocess.run([oha, "--help"], capture_output=True, text=True, env=CHILD_ENV, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        h = ""
    if "--output-format" in h:
        return ["--output-format", "json"]
    return ["--json"]


# ----------------------------------------------------------------------------
# Plain HTTP helpers (127.0.0.1 only, no proxy variables)
# ----------------------------------------------------------------------------

def http_get(url: str, headers: dict | None = None, timeout: float = 120.0) -> tuple[int, bytes, dict]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with HTTP.open(req, timeout=timeout) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, e.read(), dict(e.headers)


def http_send(method: str, url: str, data: bytes | None, headers: dict) -> tuple[int, dict, bytes]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with HTTP.open(req, timeout=300) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def push_blob(port: int, repo: str, data: bytes) -> str:
    """POST + monolithic PUT (distribution's upload API): exact bytes, no conversion."""
    digest = "sha256:" + sha256_hex(data)
    st, hdrs, body = http_send("POST", f"http://{HOST}:{port}/v2/{repo}/blobs/uploads/", b"", {})
    if st != 202:
        raise RuntimeError(f"upload start for {repo}: {st} {body[:300]!r}")
    loc = hdrs.get("Location") or hdrs.get("location")
    url = urllib.parse.urljoin(f"http://{HOST}:{port}/", loc)
    if urllib.parse.urlsplit(url).hostname != HOST:
        raise RuntimeError(f"upload location {url} is not on {HOST}")
    url += ("&" if "?" in url else "?") + "digest=" + urllib.parse.quote(digest)
    st, _, body = http_send("PUT", url, data, {"Content-Type": "application/octet-stream",
                                                "Content-Length": str(len(data))})
    if st != 201:
        raise RuntimeError(f"upload of {digest} ({len(data)} bytes): {st} {body[:300]!r}")
    return digest


def push_load_image(port: int, seed: int) -> dict:
    """bench/load:v1: layers of exactly 1, 10 and 100 MiB of random bytes (sent
    and served as opaque blobs; nothing here unpacks them) and a small config."""
    rng = random.Random(seed)
    blobs, layers = {}, []
    for name, size in BLOB_SIZES.items():
        data = rng.randbytes(size)
        d = push_blob(port, LOAD_REPO, data)
        blobs[name] = {"digest": d, "size": size}
        layers.append({"mediaType": OCI_LAYER_GZIP, "digest": d, "size": size})
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": [l["digest"] for l in layers]}},
                        separators=(",", ":")).encode()
    cfg_digest = push_blob(port, LOAD_REPO, config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest, "size": len(config)},
        "layers": layers,
    }, separators=(",", ":")).encode()
    m_digest = "sha256:" + sha256_hex(manifest)
    st, _, body = http_send("PUT", f"http://{HOST}:{port}/v2/{LOAD_REPO}/manifests/{TAG}", manifest,
                            {"Content-Type": OCI_MANIFEST})
    if st != 201:
        raise RuntimeError(f"manifest PUT: {st} {body[:300]!r}")
    st, got, _ = http_get(f"http://{HOST}:{port}/v2/{LOAD_REPO}/manifests/{TAG}", {"Accept": OCI_MANIFEST})
    if st != 200 or got != manifest:
        raise RuntimeError(f"origin does not serve the pushed manifest bytes back ({st})")
    return {"blobs": blobs, "manifest": {"digest": m_digest, "size": len(manifest), "bytes": manifest}}


# ----------------------------------------------------------------------------
# Servers
# ----------------------------------------------------------------------------

def retry_port(start):
    """Runs start(port) with a fresh free port, retrying on a port race."""
    last = None
    for _ in range(3):
        try:
            return start(free_port())
        except PortInUse as e:
            last = e
    raise RuntimeError(f"no free port after 3 tries: {last}")


class PortInUse(Exception):
    pass


def wait_http(p: subprocess.Popen, url: str, what: str, logfile: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            text = tail(logfile, 40)
            if "in use" in text.lower():
                raise PortInUse(text)
            raise RuntimeError(f"{what} exited with {p.returncode} before answering {url}:\n{text}")
        if http_status(url) is not None:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer {url} within {timeout:.0f}s:\n{tail(logfile)}")


class Server:
    def __init__(self, name: str, proc: subprocess.Popen, port: int, logfile: Path, admin: int | None = None):
        self.name, self.proc, self.port, self.logfile, self.admin = name, proc, port, logfile, admin

    def url(self, path: str) -> str:
        return f"http://{HOST}:{self.port}{path}"


def start_distribution(procs: Procs, d: Path, what: str, remote_port: int | None) -> Server:
    """distribution 2.8 with filesystem storage; access log off (larder and
    nginx log no requests here either); the proxy peer gets Debian's
    `blobdescriptor: inmemory` cache."""
    d.mkdir(parents=True, exist_ok=True)

    def start(port: int) -> Server:
        cfg = (
            "version: 0.1\n"
            "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
            "storage:\n"
            f"  filesystem:\n    rootdirectory: {d / 'storage'}\n"
            + ("  cache:\n    blobdescriptor: inmemory\n" if remote_port is not None else "")
            + f"http:\n  addr: {HOST}:{port}\n"
        )
        if remote_port is not None:
            cfg += f"proxy:\n  remoteurl: http://{HOST}:{remote_port}\n"
        (d / "config.yml").write_text(cfg)
        logf = d / "registry.log"
        with open(logf, "ab") as fl:
            p = procs.start(["docker-registry", "serve", str(d / "config.yml")], stdout=fl, stderr=subprocess.STDOUT)
        try:
            wait_http(p, f"http://{HOST}:{port}/v2/", what, logf)
        except BaseException:
            procs.stop(p)
            raise
        return Server(what, p, port, logf)

    return retry_port(start)


def start_larder(procs: Procs, binary: Path, d: Path, cache_dir: Path, origin_port: int, log: bool = True,
                 max_connections: int | None = None, name: str = "larder", sendfile: str | None = None,
                 cache_extra: str = "", upstream_extra: str = "") -> Server:
    """A larder over `cache_dir`, its stderr appended to `d/larder.log`.

    `log=True` is larder as shipped: the config has no `[log]` section, so
    the default filter (`warn,larder=info`: one line per request) applies.
    `log=False` sets `[log] level = "warn"` (no request lines). `RUST_LOG`
    is removed from larder's environment either way, so the caller's
    environment cannot silently turn the request lines on or off.
    `cache_extra` and `upstream_extra` are TOML lines added to `[cache]`
    and to the upstream's table."""
    d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in CHILD_ENV.items() if k != "RUST_LOG"}

    def start(port: int) -> Server:
        admin = free_port()
        (d / "larder.toml").write_text(
            "[server]\n"
            f'listen = "{HOST}:{port}"\n'
            f'admin_listen = "{HOST}:{admin}"\n'
            + (f"max_connections = {max_connections}\n" if max_connections else "")
            + (f'sendfile = "{sendfile}"\n' if sendfile else "")
            + ("" if log else '[log]\nlevel = "warn"\n')
            + "[cache]\n"
            f'dir = "{cache_dir}"\n'
            'tag_ttl = "1h"\n'
            + cache_extra
            + "[[upstream]]\n"
            'name = "origin.test"\n'
            f'url = "http://{HOST}:{origin_port}"\n'
            "default = true\n"
            + upstream_extra
        )
        logf = d / "larder.log"
        with open(logf, "ab") as fl:
            p = procs.start([str(binary), "--config", str(d / "larder.toml")], stdout=fl,
                            stderr=subprocess.STDOUT, env=env)
        try:
            wait_http(p, f"http://{HOST}:{port}/v2/", "larder", logf)
            wait_http(p, f"http://{HOST}:{admin}/healthz", "larder admin", logf)
        except BaseException:
            procs.stop(p)
            raise
        return Server(name, p, port, logf, admin)

    return retry_port(start)


def start_nginx(procs: Procs, nginx: str, d: Path, docroot: Path) -> Server:
    """nginx from the Debian package with its own prefix, config, pid and logs."""
    d.mkdir(parents=True, exist_ok=True)
    user = ""
    if os.geteuid() == 0:
        # Workers drop to nobody: make the docroot readable for them.
        try:
            pwd.getpwnam("nobody")
            group = "nogroup"
            try:
                grp.getgrnam(group)
            except KeyError:
                group = "nobody"
            user = f"user nobody {group};\n"
        except KeyError:
            user = "user root;\n"
        p = docroot
        while True:
            os.chmod(p, os.stat(p).st_mode | 0o055 if p.is_dir() else os.stat(p).st_mode | 0o044)
            if p == d.parent or p.parent == p:
                break
            p = p.parent
        for f in docroot.rglob("*"):
            os.chmod(f, 0o755 if f.is_dir() else 0o644)

    def start(port: int) -> Server:
        conf = d / "nginx.conf"
        conf.write_text(
            f"{user}"
            "worker_processes auto;\n"
            f"pid {d / 'nginx.pid'};\n"
            f"error_log {d / 'error.log'} warn;\n"
            "daemon off;\n"
            "events { worker_connections 4096; }\n"
            "http {\n"
            "  access_log off;\n"
            "  sendfile on;\n"
            "  tcp_nopush on;\n"
            "  keepalive_requests 10000000;\n"  # like larder and distribution: no periodic reconnects
            "  default_type application/octet-stream;\n"
            f"  client_body_temp_path {d / 'client_body'};\n"
            f"  proxy_temp_path {d / 'proxy'};\n"
            f"  fastcgi_temp_path {d / 'fastcgi'};\n"
            f"  uwsgi_temp_path {d / 'uwsgi'};\n"
            f"  scgi_temp_path {d / 'scgi'};\n"
            "  server {\n"
            f"    listen {HOST}:{port};\n"
            f"    root {docroot};\n"
            "  }\n"
            "}\n"
        )
        logf = d / "stderr.log"
        with open(logf, "ab") as fl:
            p = procs.start([nginx, "-p", str(d), "-c", str(conf), "-e", str(d / "error.log")],
                            stdout=fl, stderr=subprocess.STDOUT)
        try:
            wait_http(p, f"http://{HOST}:{port}/", "nginx", logf)
        except BaseException:
            procs.stop(p)
            if "in use" in tail(d / "error.log", 20).lower():
                raise PortInUse(tail(d / "error.log", 5))
            raise
        return Server("nginx", p, port, logf)

    return retry_port(start)


# ----------------------------------------------------------------------------
# Process memory
# ----------------------------------------------------------------------------

def proc_status_kib(pid: int, field: str) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    kids = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                kids += [int(x) for x in (task / "children").read_text().split()]
            except (OSError, ValueError):
                pass
    except OSError:
        pass
    return kids


def cpu_seconds(s: Server) -> float:
    """User + system CPU of the server (all threads; nginx: master + workers)."""
    pids = [s.proc.pid] + (_children(s.proc.pid) if s.name == "nginx" else [])
    total = 0
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError):
            pass
    return total / CLK_TCK


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def larder_metrics(s: Server) -> dict:
    """Sums of a few counters from larder's /metrics."""
    out = {"upstream_requests": 0, "log_lines_dropped": 0, "bytes_served": {}, "cache_requests": {}}
    try:
        st, body, _ = http_get(f"http://{HOST}:{s.admin}/metrics", timeout=10)
    except OSError:
        return out
    if st != 200:
        return out
    for line in body.decode(errors="replace").splitlines():
        m = re.match(r"^(larder_\w+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "larder_upstream_requests_total":
            out["upstream_requests"] += value
        elif name == "larder_log_lines_dropped_total":
            out["log_lines_dropped"] += value
        elif name == "larder_bytes_served_total":
            out["bytes_served"][labels] = value
        elif name == "larder_cache_requests_total":
            out["cache_requests"][labels] = value
    return out


# ----------------------------------------------------------------------------
# Load generators
# ----------------------------------------------------------------------------

def run_wrk(wrk: str, lua: Path, server: Server, path: str, conns: int, duration: int, headers: dict | None,
            min_body: int) -> dict:
    # wrk refuses fewer connections than threads: -c1 runs with -t1.
    threads = min(2, conns)
    argv = [wrk, f"-t{threads}", f"-c{conns}", f"-d{duration}s", "--timeout", "10s", "-s", str(lua)]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    argv.append(server.url(path))
    srv0, cli0 = cpu_seconds(server), children_cpu()
    r = subprocess.run(argv, capture_output=True, text=True, env=CHILD_ENV, timeout=duration + 60)
    srv_cpu, cli_cpu = cpu_seconds(server) - srv0, children_cpu() - cli0
    res: dict = {"argv": argv[1:], "rc": r.returncode, "server_cpu_s": srv_cpu, "client_cpu_s": cli_cpu}
    m = re.search(r"^WRKJSON (\{.*\})$", r.stdout, re.M)
    if r.returncode != 0 or not m:
        res["ok"] = False
        res["error"] = f"wrk exit {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}"
        return res
    w = json.loads(m.group(1))
    res.update(w)
    secs = w["duration_us"] / 1e6
    res["rps"] = w["requests"] / secs if secs else 0.0
    res["mbps"] = w["bytes"] / secs / 1e6 if secs else 0.0
    errs = w["err_connect"] + w["err_read"] + w["err_write"] + w["err_status"] + w["err_timeout"]
    per_req = w["bytes"] / w["requests"] if w["requests"] else 0
    res["bytes_per_request"] = per_req
    res["server_cpu_ms_per_gb"] = srv_cpu * 1e3 / (w["bytes"] / 1e9) if w["bytes"] else None
    res["server_cpu_us_per_req"] = srv_cpu * 1e6 / w["requests"] if w["requests"] else None
    res["client_cpu_us_per_req"] = cli_cpu * 1e6 / w["requests"] if w["requests"] else None
    res["total_cpu_us_per_req"] = (srv_cpu + cli_cpu) * 1e6 / w["requests"] if w["requests"] else None
    res["server_cores"] = srv_cpu / secs if secs else None
    res["client_cores"] = cli_cpu / secs if secs else None
    problems = []
    if w["requests"] == 0:
        problems.append("no completed requests")
    if errs:
        problems.append(f"{errs} errors (connect {w['err_connect']}, read {w['err_read']}, write {w['err_write']}, "
                        f"non-2xx/3xx {w['err_status']}, timeout {w['err_timeout']})")
    # wrk's byte count includes the partial responses in flight at the end,
    # so only a lower bound is meaningful: error bodies would be far smaller.
    if w["requests"] and per_req < min_body:
        problems.append(f"{per_req:.0f} bytes per response, expected a body of {min_body} + headers")
    res["ok"] = not problems
    res["error"] = "; ".join(problems)
    return res


def run_point(wrk: str, lua: Path, server: Server, path: str, conns: int, duration: int, headers: dict | None,
              min_body: int) -> dict:
    """`run_wrk`, and for a larder also what its request log did meanwhile:
    the bytes its log file grew by (read after the log thread has written
    what was queued) and the lines it dropped (its metric). larder as
    shipped must have logged a line per request, the quiet one none; a run
    where that does not hold is a failed run. The log file is emptied after
    each run (a manifest run writes about 100 MB)."""
    if not server.name.startswith("larder"):
        return run_wrk(wrk, lua, server, path, conns, duration, headers, min_body)
    dropped0 = larder_metrics(server)["log_lines_dropped"]
    size0 = server.logfile.stat().st_size
    r = run_wrk(wrk, lua, server, path, conns, duration, headers, min_body)
    time.sleep(0.5)
    r["log_bytes"] = server.logfile.stat().st_size - size0
    r["log_lines_dropped"] = larder_metrics(server)["log_lines_dropped"] - dropped0
    os.truncate(server.logfile, 0)
    done = r.get("requests") or 0
    r["log_bytes_per_request"] = r["log_bytes"] / done if done else None
    if r["ok"] and server.name == "larder" and (r["log_bytes"] + 250 * r["log_lines_dropped"]
                                                < MIN_LOG_BYTES_PER_REQUEST * done):
        r["ok"] = False
        r["error"] = (f"the request log is meant to be on, but larder logged {r['log_bytes']} bytes "
                      f"({r['log_lines_dropped']:g} lines dropped) for {done} requests")
    if r["ok"] and server.name == QUIET and r["log_bytes"] > 100 * 1024:
        r["ok"] = False
        r["error"] = f"the request log is meant to be off, but larder logged {r['log_bytes']} bytes"
    return r


def run_oha(oha: str, json_flag: list[str], server: Server, path: str, rate: float, duration: int, conns: int,
            headers: dict) -> dict:
    url = server.url(path)
    argv = [oha, "-z", f"{duration}s", "-q", f"{rate:.0f}", "-c", str(conns), "--latency-correction",
            "--no-tui", *json_flag]
    for k, v in headers.items():
        argv += ["-H", f"{k}: {v}"]
    argv.append(url)
    srv0, cli0 = cpu_seconds(server), children_cpu()
    r = subprocess.run(argv, capture_output=True, text=True, env=CHILD_ENV, timeout=duration + 60)
    srv_cpu, cli_cpu = cpu_seconds(server) - srv0, children_cpu() - cli0
    res: dict = {"argv": argv[1:], "rc": r.returncode, "target_rps": rate,
                 "server_cores": srv_cpu / duration, "client_cores": cli_cpu / duration}
    try:
        j = json.loads(r.stdout)
    except json.JSONDecodeError:
        res["ok"] = False
        res["error"] = f"oha exit {r.returncode}: {(r.stderr or r.stdout).strip()[-400:]}"
        return res
    s, pct = j.get("summary", {}), j.get("latencyPercentiles", {})
    codes = j.get("statusCodeDistribution", {})
    # Requests still in flight when -z ends are reported as errors; they are not.
    errors = {k: v for k, v in j.get("errorDistribution", {}).items() if k != "aborted due to deadline"}
    res.update({
        "success_rate": s.get("successRate"),
        "achieved_rps": s.get("requestsPerSec"),
        "total_s": s.get("total"),
        "p50_ms": pct["p50"] * 1e3 if pct.get("p50") is not None else None,
        "p90_ms": pct["p90"] * 1e3 if pct.get("p90") is not None else None,
        "p99_ms": pct["p99"] * 1e3 if pct.get("p99") is not None else None,
        "p99_9_ms": pct["p99.9"] * 1e3 if pct.get("p99.9") is not None else None,
        "slowest_ms": s["slowest"] * 1e3 if s.get("slowest") is not None else None,
        "status_codes": codes,
        "errors": errors,
        "aborted_at_deadline": j.get("errorDistribution", {}).get("aborted due to deadline", 0),
    })
    bad = {k: v for k, v in codes.items() if not str(k).startswith("2")}
    problems = []
    if bad:
        problems.append(f"non-2xx responses {bad}")
    if errors:
        problems.append(f"errors {errors}")
    if res["p99_ms"] is None:
        problems.append("no latency percentiles in oha's output")
    res["ok"] = not problems
    res["error"] = "; ".join(problems)
    return res


def big_downloads(procs: Procs, curl: str, server: Server, path: str, size: int, n: int,
                  work: Path, timeout: float) -> dict:
    """n concurrent curl processes each GET the blob and discard it; VmRSS is
    sampled meanwhile and VmHWM (peak since the process started) read after."""
    work.mkdir(parents=True, exist_ok=True)
    pid = server.proc.pid
    samples: list[int] = []
    stop = threading.Event()

    def sampler() -> None:
        while not stop.is_set():
            v = proc_status_kib(pid, "VmRSS")
            if v is not None:
                samples.append(v)
            stop.wait(0.02)

    hwm_before = proc_status_kib(pid, "VmHWM")
    t = threading.Thread(target=sampler, daemon=True)
    t.start()
    popens, outs = [], []
    t0 = time.monotonic()
    try:
        for i in range(n):
            out = work / f"curl-{i}.out"
            outs.append(out)
            with open(out, "wb") as fo:
                popens.append(procs.start(
                    [curl, "-sS", "--noproxy", "*", "-o", "/dev/null", "-w", "%{http_code} %{size_download}",
                     "--max-time", str(int(timeout)), server.url(path)],
                    stdout=fo, stderr=subprocess.STDOUT))
        ends = [exit_time(p, t0 + timeout + 10 - time.monotonic()) for p in popens]
        wall = (max(ends) if None not in ends else time.monotonic()) - t0
    finally:
        for p in popens:
            procs.stop(p, grace=1.0)
        stop.set()
        t.join()
    failed = []
    for i, (p, out) in enumerate(zip(popens, outs)):
        text = out.read_text(errors="replace").strip() if out.exists() else ""
        if p.returncode != 0 or text != f"200 {size}":
            failed.append({"client": i, "rc": p.returncode, "output": text[-300:]})
    shutil.rmtree(work, ignore_errors=True)
    return {
        "wall_s": wall,
        "aggregate_mbps": n * size / wall / 1e6 if wall else None,
        "hwm_before_kib": hwm_before,
        "hwm_kib": proc_status_kib(pid, "VmHWM"),
        "rss_max_sampled_kib": max(samples) if samples else None,
        "rss_after_kib": proc_status_kib(pid, "VmRSS"),
        "samples": len(samples),
        "failed": failed,
        "ok": not failed and server.proc.poll() is None,
    }


def exit_time(p: subprocess.Popen, timeout: float) -> float | None:
    """When `p` exited (time.monotonic()), or None if it is still running
    after `timeout` s. A thread blocks in waitpid: `Popen.wait(timeout=…)`
    polls with sleeps of up to 50 ms, which rounded every wall time up to
    the next step of about 50 ms (a 0.32 s pull read as 0.32 or 0.37 s)."""
    done: list[float] = []

    def waiter() -> None:
        p.wait()
        done.append(time.monotonic())

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    t.join(max(0.0, timeout))
    return done[0] if done else None


def skopeo_pull(procs: Procs, port: int, work: Path, expect: str, timeout: float) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    logf = work.parent / (work.name + ".log")
    t0 = time.monotonic()
    with open(logf, "wb") as lf:
        p = procs.start(["skopeo", "copy", "--src-tls-verify=false", f"docker://{HOST}:{port}/{COLD_REPO}:{TAG}",
                         f"dir:{work}"], stdout=lf, stderr=subprocess.STDOUT)
    end = exit_time(p, timeout)
    wall = (end if end is not None else time.monotonic()) - t0
    procs.stop(p, grace=1.0)
    res = {"wall_s": wall, "rc": p.returncode, "ok": False, "error": ""}
    if p.returncode != 0:
        res["error"] = f"skopeo exit {p.returncode}: {tail(logf, 5)}"
    else:
        try:
            got = "sha256:" + sha256_hex((work / "manifest.json").read_bytes())
        except OSError as e:
            got = f"(unreadable: {e})"
        res["ok"] = got == expect
        if not res["ok"]:
            res["error"] = f"manifest.json digest {got} != {expect}"
    shutil.rmtree(work, ignore_errors=True)
    logf.unlink(missing_ok=True)
    return res


# ----------------------------------------------------------------------------
# Warm-up: every measured URL once, bytes checked against the digest
# ----------------------------------------------------------------------------

def measured_paths(image: dict) -> list[tuple[str, str, dict]]:
    """(path, expected sha256 digest, headers) for every URL the run measures."""
    m = image["manifest"]["digest"]
    acc = {"Accept": OCI_MANIFEST}
    paths = [(f"/v2/{LOAD_REPO}/manifests/{m}", m, acc), (f"/v2/{LOAD_REPO}/manifests/{TAG}", m, acc)]
    for name in BLOB_SIZES:
        d = image["blobs"][name]["digest"]
        paths.append((f"/v2/{LOAD_REPO}/blobs/{d}", d, {}))
    return paths


def warm(server: Server, image: dict, skip_tag: bool = False) -> None:
    for path, digest, headers in measured_paths(image):
        if skip_tag and "/manifests/sha256:" not in path and "/manifests/" in path:
            continue
        st, body, _ = http_get(server.url(path), headers, timeout=300)
        got = "sha256:" + sha256_hex(body)
        if st != 200 or got != digest:
            raise RuntimeError(f"warm-up of {server.name} {path}: status {st}, sha256 {got}, expected {digest}")


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------

def machine_info(tools: dict) -> dict:
    m = herd.machine_info()
    m["nginx"] = herd.cmd_out([tools["nginx"], "-v"])
    m["wrk"] = " ".join(herd.cmd_out([tools["wrk"], "-v"]).split()[:2])
    m["oha"] = herd.cmd_out([tools["oha"], "--version"]) if tools.get("oha") else "oha not used (--no-latency)"
    m["curl"] = " ".join(herd.cmd_out([tools["curl"], "--version"]).split()[:2])
    m["mem_total_mib"] = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                m["mem_total_mib"] = int(line.split()[1]) // 1024
    except OSError:
        pass
    return m


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def machine_line(m: dict) -> str:
    return (f"machine: nproc={m['nproc']}, CPU {m['cpu']}, {m['mem_total_mib']} MiB RAM, kernel {m['kernel']}; "
            f"{m['docker_registry']}; {m['nginx']}; {m['wrk']}; {m['oha']}; {m['curl']}; {m['skopeo']}; "
            f"larder {m['larder_commit']} ({m['rustc']})")


def verdict(ok: bool | None) -> str:
    if ok is None:
        return "**no data**"
    return "met" if ok else "**missed**"


def per_rep_ratio(larder_rs: list, peer_ok: list, key: str, reps: int) -> dict | None:
    """larder's `key` ÷ the peer's, per repetition (runs seconds apart),
    summarized; reps where either run failed are left out."""
    ratios = []
    for rep in range(reps):
        a = [r for r in peer_ok if r["rep"] == rep]
        lr = [r for r in larder_rs if r["rep"] == rep and r["ok"]]
        if a and lr and a[0][key]:
            ratios.append(lr[0][key] / a[0][key])
    return summary(ratios)


def rep_ratios(runs: list, num: dict, den: dict, key: str, reps: int) -> dict | None:
    """num's `key` ÷ den's `key`, per repetition, over the runs that match
    each selection (e.g. {"server": "nginx", "ref": "digest"}) and succeeded;
    reps where either failed are left out."""
    def pick(sel: dict, rep: int):
        rs = [r for r in runs if r["rep"] == rep and r["ok"] and all(r.get(k) == v for k, v in sel.items())]
        return rs[0].get(key) if rs else None

    ratios = []
    for rep in range(reps):
        a, b = pick(num, rep), pick(den, rep)
        if a is not None and b:
            ratios.append(a / b)
    return summary(ratios)


def issue13_rows(runs: dict, reps: int) -> list[tuple[str, bool | None, dict | None]]:
    """The issue-13 rows that this benchmark measures: server CPU per request
    and throughput against nginx, the cold pull, and the request log's cost."""
    man, blob = runs["manifest"], runs["blob"]
    digest = {"ref": "digest"}

    def row(name, s, threshold=None, cmp=None, fmt="{:.2f}"):
        if threshold is None:
            return f"| {name} | {fmt_s(s, fmt)} | – | context |", None, s
        if not s:
            return f"| {name} | – | {threshold} | {verdict(None)} |", False, s
        ok = cmp(s["median"])
        return f"| {name} | {fmt_s(s, fmt)} | {threshold} | {verdict(ok)} |", ok, s

    def b10(conns, srv):
        return {"blob": "10MiB", "conns": conns, "server": srv}

    rows = [
        row(f"warm manifest by digest, {MANIFEST_CONNS} conns: server CPU per request, nginx ÷ larder",
            rep_ratios(man, {**digest, "server": "nginx"}, {**digest, "server": "larder"},
                       "server_cpu_us_per_req", reps),
            f"≥ {TARGET13_MANIFEST_CPU}", lambda v: v >= TARGET13_MANIFEST_CPU),
        row("  the same against larder with its request log off",
            rep_ratios(man, {**digest, "server": "nginx"}, {**digest, "server": QUIET},
                       "server_cpu_us_per_req", reps)),
    ]
    for conns in sorted(WRK_CONNS, reverse=True):
        for srv in ("larder", SENDFILE):
            rows.append(row(f"warm 10 MiB blob, {conns} conn{'s' if conns > 1 else ''}: server CPU per request, "
                            f"nginx ÷ {LABEL[srv]}",
                            rep_ratios(blob, b10(conns, "nginx"), b10(conns, srv), "server_cpu_us_per_req", reps),
                            f"≥ {TARGET13_BLOB_CPU}", lambda v: v >= TARGET13_BLOB_CPU))
        rows.append(row("  the same, server + wrk CPU per request: nginx ÷ larder",
                        rep_ratios(blob, b10(conns, "nginx"), b10(conns, "larder"), "total_cpu_us_per_req", reps)))
        rows.append(row(f"  the same, server + wrk CPU per request: nginx ÷ {LABEL[SENDFILE]}",
                        rep_ratios(blob, b10(conns, "nginx"), b10(conns, SENDFILE), "total_cpu_us_per_req", reps)))
    rows.append(row(f"warm manifest by digest, {MANIFEST_CONNS} conns: req/s, larder ÷ nginx",
                    rep_ratios(man, {**digest, "server": "larder"}, {**digest, "server": "nginx"}, "rps", reps),
                    f"≥ {TARGET13_MANIFEST_RATE}", lambda v: v >= TARGET13_MANIFEST_RATE))
    for conns in sorted(WRK_CONNS, reverse=True):
        for srv in ("larder", SENDFILE):
            rows.append(row(f"warm 10 MiB blob, {conns} conn{'s' if conns > 1 else ''}: MB/s, {LABEL[srv]} ÷ nginx",
                            rep_ratios(blob, b10(conns, srv), b10(conns, "nginx"), "mbps", reps),
                            f"≥ {TARGET13_BLOB_RATE}", lambda v: v >= TARGET13_BLOB_RATE))
    rows.append(row("cold pull (skopeo, 9 blobs): larder ÷ direct",
                    rep_ratios(runs["cold"], {"mode": "larder"}, {"mode": "direct"}, "wall_s", reps),
                    f"≤ {TARGET13_COLD_RATIO}", lambda v: v <= TARGET13_COLD_RATIO))
    rows.append(row("request log's cost: manifest by digest req/s, log on ÷ log off",
                    rep_ratios(man, {**digest, "server": "larder"}, {**digest, "server": QUIET}, "rps", reps),
                    f"≥ {TARGET13_LOG_RATE}", lambda v: v >= TARGET13_LOG_RATE))
    rows.append(row("  the same: server CPU per request, log off ÷ log on",
                    rep_ratios(man, {**digest, "server": QUIET}, {**digest, "server": "larder"},
                               "server_cpu_us_per_req", reps)))
    for conns in sorted(WRK_CONNS, reverse=True):
        rows.append(row(f"  10 MiB blob, {conns} conn{'s' if conns > 1 else ''}: MB/s, log on ÷ log off",
                        rep_ratios(blob, b10(conns, "larder"), b10(conns, QUIET), "mbps", reps)))
    return rows


def issue13_context(runs: dict) -> list[str]:
    """Absolute figures behind the issue-13 ratios (not targets)."""
    def med(rs, key):
        s = summary([r.get(key) for r in rs if r["ok"]])
        return s

    out = ["| server | manifest by digest: CPU µs per request | req/s | 10 MiB blob, 16 conns: CPU ms per "
           "request | wrk's CPU ms per request | MB/s | log bytes per request (manifest) | log lines dropped |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for srv in ("nginx", "larder", QUIET, SENDFILE):
        m = [r for r in runs["manifest"] if r["server"] == srv and r["ref"] == "digest"]
        b = [r for r in runs["blob"] if r["server"] == srv and r["blob"] == "10MiB" and r["conns"] == max(WRK_CONNS)]
        cpu_ms = summary([r["server_cpu_us_per_req"] / 1e3 for r in b if r["ok"] and r.get("server_cpu_us_per_req")])
        wrk_ms = summary([r["client_cpu_us_per_req"] / 1e3 for r in b if r["ok"] and r.get("client_cpu_us_per_req")])
        logged = med(m, "log_bytes_per_request") if srv != "nginx" else None
        dropped = sum(r.get("log_lines_dropped") or 0 for r in m + b)
        out.append(f"| {LABEL[srv]} | {fmt_s(med(m, 'server_cpu_us_per_req'), '{:.1f}')} | "
                   f"{fmt_s(med(m, 'rps'))} | {fmt_s(cpu_ms, '{:.2f}')} | {fmt_s(wrk_ms, '{:.2f}')} | "
                   f"{fmt_s(med(b, 'mbps'))} | "
                   f"{fmt_s(logged) if srv != 'nginx' else '–'} | {f'{dropped:g}' if srv != 'nginx' else '–'} |")
    out += ["", "server CPU = utime + stime from `/proc/<pid>/stat` before and after each wrk run (nginx: "
            "master and workers summed; larder: all threads, the log writer's included). wrk's CPU = the "
            "load generator's own utime + stime: on loopback the reader of a sendfile'd response pays for "
            "work the sender skipped, so server + wrk is the whole cost of a response.", ""]
    return out


def build_report(doc: dict) -> str:
    runs, args = doc["runs"], doc["params"]
    out = [machine_line(doc["machine"]), "",
           f"load average (1/5/15 min) at start {doc['loadavg_start']}, at end {doc['loadavg_end']}; "
           f"{args['reps']} reps, wrk/oha {args['duration']} s per point; median (min–max) over reps; "
           f"order of servers rotated per rep", ""]
    bad_lines = []

    # 1. blobs
    out += ["### 1. Warm blob GET throughput (wrk)", "",
            "| blob | conns | server | req/s | MB/s | larder ÷ this server | server CPU ms per GB "
            "| wrk CPU (cores) | errors |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    blob_summary = {}
    for blob in WRK_BLOBS:
        for conns in WRK_CONNS:
            for srv in SERVERS + (QUIET, SENDFILE):
                rs = [r for r in runs["blob"] if r["blob"] == blob and r["conns"] == conns and r["server"] == srv]
                if not rs:
                    continue
                ok_rs = [r for r in rs if r["ok"]]
                rps = summary([r["rps"] for r in ok_rs])
                mbps = summary([r["mbps"] for r in ok_rs])
                larder_rs = [r for r in runs["blob"] if r["blob"] == blob and r["conns"] == conns
                             and r["server"] == "larder"]
                ratio = None if srv == "larder" else per_rep_ratio(larder_rs, ok_rs, "mbps", args["reps"])
                cpu_gb = summary([r["server_cpu_ms_per_gb"] for r in ok_rs])
                cli = summary([r["client_cores"] for r in ok_rs])
                blob_summary[f"{blob}/c{conns}/{srv}"] = {"rps": rps, "mbps": mbps, "larder_ratio": ratio,
                                                          "server_cpu_ms_per_gb": cpu_gb, "client_cores": cli,
                                                          "failed_runs": len(rs) - len(ok_rs)}
                failed = len(rs) - len(ok_rs)
                if failed:
                    bad_lines += [f"- blob {blob} c{conns} {LABEL[srv]} rep {r['rep']}: {r['error']}"
                                  for r in rs if not r["ok"]]
                out.append(f"| {blob.replace('MiB', ' MiB')} | {conns} | {LABEL[srv]} | {fmt_s(rps)} | "
                           f"{fmt_s(mbps)} | {'–' if srv == 'larder' else fmt_s(ratio, '{:.2f}')} | "
                           f"{fmt_s(cpu_gb)} | {fmt_s(cli, '{:.2f}')} | "
                           f"{f'**{failed}/{len(rs)} runs**' if failed else '0'} |")
    out += ["", "MB = 10^6 bytes received by wrk (headers and the partial responses in flight at the end "
            "included). `-c1` runs with `-t1` (wrk needs threads ≤ connections), `-c16` with `-t2`. "
            "server CPU = user + system time of the server's processes during the run per GB sent; "
            "wrk CPU = the load generator's own CPU time ÷ run time (1.00 = one core busy).", ""]

    # 2. manifests
    out += ["### 2. Warm manifest GET (wrk, 16 connections, `Accept: " + OCI_MANIFEST + "`)", "",
            "| request | server | req/s | larder ÷ this server | server CPU µs per request | wrk CPU (cores) | errors |",
            "|---|---|---:|---:|---:|---:|---:|"]
    man_summary = {}
    for ref in ("digest", "tag"):
        for srv in SERVERS + (QUIET,):
            rs = [r for r in runs["manifest"] if r["ref"] == ref and r["server"] == srv]
            if not rs:
                continue
            ok_rs = [r for r in rs if r["ok"]]
            rps = summary([r["rps"] for r in ok_rs])
            larder_rs = [r for r in runs["manifest"] if r["ref"] == ref and r["server"] == "larder"]
            ratio = None if srv == "larder" else per_rep_ratio(larder_rs, ok_rs, "rps", args["reps"])
            cpu_req = summary([r["server_cpu_us_per_req"] for r in ok_rs])
            cli = summary([r["client_cores"] for r in ok_rs])
            man_summary[f"{ref}/{srv}"] = {"rps": rps, "larder_ratio": ratio, "server_cpu_us_per_req": cpu_req,
                                           "client_cores": cli, "failed_runs": len(rs) - len(ok_rs)}
            failed = len(rs) - len(ok_rs)
            if failed:
                bad_lines += [f"- manifest by {ref} {LABEL[srv]} rep {r['rep']}: {r['error']}" for r in rs if not r["ok"]]
            label = LABEL[srv] + (" (static file, reference)" if srv == "nginx" else "")
            out.append(f"| by {ref} | {label} | {fmt_s(rps)} | "
                       f"{'–' if srv == 'larder' else fmt_s(ratio, '{:.1f}')} | "
                       f"{fmt_s(cpu_req, '{:.1f}')} | {fmt_s(cli, '{:.2f}')} | "
                       f"{f'**{failed}/{len(rs)} runs**' if failed else '0'} |")
    out += ["", f"Latency of manifest GET by digest at a fixed rate of {OHA_RATE_SHARE:.0%} of larder's wrk "
            "req/s in the same rep (oha, 16 connections, keep-alive, `--latency-correction`); nginx at the same "
            "rate shows what the machine and the load generator add by themselves:", "",
            "| server | target req/s | achieved req/s | p50 ms | p90 ms | p99 ms | p99.9 ms | slowest ms "
            "| server cores | oha cores | failed runs |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    oha_by = {}
    for srv in ("larder", "nginx"):
        rs = [r for r in runs["oha"] if r.get("server") == srv]
        ok_rs = [r for r in rs if r["ok"]]
        o = {k: summary([r.get(k) for r in ok_rs]) for k in
             ("target_rps", "achieved_rps", "p50_ms", "p90_ms", "p99_ms", "p99_9_ms", "slowest_ms",
              "server_cores", "client_cores")}
        o["failed_runs"] = len(rs) - len(ok_rs)
        oha_by[srv] = o
        out.append(f"| {LABEL[srv]} | {fmt_s(o['target_rps'])} | {fmt_s(o['achieved_rps'])} "
                   f"| {fmt_s(o['p50_ms'], '{:.2f}')} | {fmt_s(o['p90_ms'], '{:.2f}')} | {fmt_s(o['p99_ms'], '{:.2f}')} "
                   f"| {fmt_s(o['p99_9_ms'], '{:.2f}')} | {fmt_s(o['slowest_ms'], '{:.1f}')} "
                   f"| {fmt_s(o['server_cores'], '{:.2f}')} | {fmt_s(o['client_cores'], '{:.2f}')} "
                   f"| {o['failed_runs']}/{len(rs)} |")
        bad_lines += [f"- oha {LABEL[srv]} rep {r['rep']}: {r['error']}" for r in rs if not r["ok"]]
    out.append("")
    oha_s = oha_by["larder"]

    # 3. memory
    out += [f"### 3. Memory: idle after warm-up, and during {BIG_DOWNLOADS} concurrent downloads of the 100 MiB blob",
            "", "| server | idle VmRSS MiB | peak VmHWM MiB | max sampled VmRSS MiB | downloads wall s "
            "| aggregate MB/s | failed downloads |", "|---|---:|---:|---:|---:|---:|---:|"]
    mem_summary = {}
    for srv in ("larder", "distribution"):
        rs = [r for r in runs["memory"] if r["server"] == srv]
        ok_rs = [r for r in rs if r["ok"]]
        s = {
            "idle_rss_mib": summary([r["idle_rss_kib"] / 1024 for r in rs if r.get("idle_rss_kib")]),
            "peak_hwm_mib": summary([r["hwm_kib"] / 1024 for r in ok_rs if r.get("hwm_kib")]),
            "rss_max_sampled_mib": summary([r["rss_max_sampled_kib"] / 1024 for r in ok_rs
                                            if r.get("rss_max_sampled_kib")]),
            "wall_s": summary([r["wall_s"] for r in ok_rs]),
            "aggregate_mbps": summary([r["aggregate_mbps"] for r in ok_rs]),
            "failed_downloads": sum(len(r["failed"]) for r in rs),
            "downloads": BIG_DOWNLOADS * len(rs),
        }
        mem_summary[srv] = s
        fd = f"{s['failed_downloads']}/{s['downloads']}"
        out.append(f"| {LABEL[srv]} | {fmt_s(s['idle_rss_mib'], '{:.1f}')} | {fmt_s(s['peak_hwm_mib'], '{:.1f}')} | "
                   f"{fmt_s(s['rss_max_sampled_mib'], '{:.1f}')} | {fmt_s(s['wall_s'], '{:.1f}')} | "
                   f"{fmt_s(s['aggregate_mbps'])} | {f'**{fd}**' if s['failed_downloads'] else fd} |")
        bad_lines += [f"- 100 MiB downloads {LABEL[srv]} rep {r['rep']}: {len(r['failed'])} failed, first "
                      f"{r['failed'][0] if r['failed'] else 'server exited'}" for r in rs if not r["ok"]]
    out += ["", "A fresh process per rep (same warm cache dir): warm-up GETs every measured URL once, 1 s idle, "
            "VmRSS read; then the downloads (curl, body discarded); VmHWM = peak RSS since the process started.", ""]

    # 4. cold pull
    out += ["### 4. Cold pull: skopeo copy of 8 × 8 MiB layers (+ config)", "",
            "| path | wall s | larder ÷ direct | failed pulls |", "|---|---:|---:|---:|"]
    cold_ratios = []
    for rep in range(args["reps"]):
        lr = [r for r in runs["cold"] if r["rep"] == rep and r["mode"] == "larder" and r["ok"]]
        dr = [r for r in runs["cold"] if r["rep"] == rep and r["mode"] == "direct" and r["ok"]]
        if lr and dr:
            cold_ratios.append(lr[0]["wall_s"] / dr[0]["wall_s"])
    cold_summary = {"ratio": summary(cold_ratios)}
    for mode in ("direct", "larder"):
        rs = [r for r in runs["cold"] if r["mode"] == mode]
        ok_rs = [r for r in rs if r["ok"]]
        cold_summary[mode] = summary([r["wall_s"] for r in ok_rs])
        failed = len(rs) - len(ok_rs)
        out.append(f"| {LABEL[mode]}{' (fresh process, empty cache)' if mode == 'larder' else ''} | "
                   f"{fmt_s(cold_summary[mode], '{:.2f}')} | "
                   f"{fmt_s(cold_summary['ratio'], '{:.2f}') if mode == 'larder' else '–'} | "
                   f"{f'**{failed}/{len(rs)}**' if failed else f'0/{len(rs)}'} |")
        bad_lines += [f"- cold pull {mode} rep {r['rep']}: {r['error']}" for r in rs if not r["ok"]]
    out.append("")

    # Targets
    def tgt(name, s, threshold, cmp, fmt):
        if not s:
            return f"| {name} | – | {threshold} | {verdict(None)} |", None
        ok = cmp(s["median"])
        return f"| {name} | {fmt_s(s, fmt)} | {threshold} | {verdict(ok)} |", ok

    rows = [
        tgt("warm 10 MiB blob, 16 conns: larder ÷ nginx", blob_summary["10MiB/c16/nginx"]["larder_ratio"],
            f"≥ {TARGET_BLOB_VS_NGINX}", lambda v: v >= TARGET_BLOB_VS_NGINX, "{:.2f}"),
        tgt("warm 10 MiB blob, 1 conn: larder ÷ nginx", blob_summary["10MiB/c1/nginx"]["larder_ratio"],
            f"≥ {TARGET_BLOB_VS_NGINX}", lambda v: v >= TARGET_BLOB_VS_NGINX, "{:.2f}"),
        tgt("warm 10 MiB blob, 16 conns: larder ÷ distribution proxy",
            blob_summary["10MiB/c16/distribution"]["larder_ratio"],
            f"≥ {TARGET_BLOB_VS_DIST:g}", lambda v: v >= TARGET_BLOB_VS_DIST, "{:.2f}"),
        tgt("warm 10 MiB blob, 1 conn: larder ÷ distribution proxy",
            blob_summary["10MiB/c1/distribution"]["larder_ratio"],
            f"≥ {TARGET_BLOB_VS_DIST:g}", lambda v: v >= TARGET_BLOB_VS_DIST, "{:.2f}"),
        tgt("warm manifest by digest: larder ÷ distribution proxy", man_summary["digest/distribution"]["larder_ratio"],
            f"≥ {TARGET_MANIFEST_VS_DIST:g}", lambda v: v >= TARGET_MANIFEST_VS_DIST, "{:.1f}"),
        tgt("warm manifest by tag: larder ÷ distribution proxy", man_summary["tag/distribution"]["larder_ratio"],
            f"≥ {TARGET_MANIFEST_VS_DIST:g}", lambda v: v >= TARGET_MANIFEST_VS_DIST, "{:.1f}"),
        tgt(f"manifest by digest p99 at {OHA_RATE_SHARE:.0%} of max (ms)", oha_s["p99_ms"], f"< {TARGET_P99_MS:g}",
            lambda v: v < TARGET_P99_MS, "{:.2f}"),
        tgt("cold pull: larder ÷ direct", cold_summary["ratio"], f"≤ {TARGET_COLD_RATIO}",
            lambda v: v <= TARGET_COLD_RATIO, "{:.2f}"),
        tgt("larder idle RSS (MiB)", mem_summary["larder"]["idle_rss_mib"], f"≤ {TARGET_IDLE_RSS_MIB:g}",
            lambda v: v <= TARGET_IDLE_RSS_MIB, "{:.1f}"),
        tgt(f"larder peak RSS, {BIG_DOWNLOADS} × 100 MiB downloads (MiB)", mem_summary["larder"]["peak_hwm_mib"],
            f"≤ {TARGET_PEAK_RSS_MIB:g}", lambda v: v <= TARGET_PEAK_RSS_MIB, "{:.1f}"),
    ]
    out += ["### Issue-7 targets (judged on the median)", "", "| target | measured median (min–max) | threshold | verdict |",
            "|---|---:|---:|---|"] + [r[0] for r in rows]
    met = sum(1 for r in rows if r[1])
    out += ["", f"{met} of {len(rows)} targets met in this run."]
    rows13 = issue13_rows(runs, args["reps"])
    out += ["", "### Issue-13 targets (judged on the median of the per-rep ratios)", "",
            "larder as shipped logs one line per request (to its log file here); `larder, request log off` is "
            "the same binary with `[log] level = \"warn\"`.", "",
            "| target | measured median (min–max) | threshold | verdict |", "|---|---:|---:|---|"]
    out += [r[0] for r in rows13]
    met13 = sum(1 for r in rows13 if r[1])
    judged13 = sum(1 for r in rows13 if r[1] is not None)
    out += ["", f"{met13} of {judged13} issue-13 targets met in this run (rows without a threshold are context).", ""]
    out += issue13_context(runs)
    # Context for reading the verdicts (not targets).
    notes = []
    for conns in WRK_CONNS:
        lc = blob_summary[f"10MiB/c{conns}/larder"]["server_cpu_ms_per_gb"]
        nc = blob_summary[f"10MiB/c{conns}/nginx"]["server_cpu_ms_per_gb"]
        dc = blob_summary[f"10MiB/c{conns}/distribution"]["server_cpu_ms_per_gb"]
        if lc and nc and dc and nc["median"] and dc["median"]:
            notes.append(f"- 10 MiB blob, {conns} conn{'s' if conns > 1 else ''}: larder spent "
                         f"{lc['median']:.0f} ms of CPU per GB sent, nginx {nc['median']:.0f}, distribution "
                         f"{dc['median']:.0f} (larder ÷ nginx {lc['median'] / nc['median']:.1f}×, "
                         f"÷ distribution {lc['median'] / dc['median']:.2f}×). Throughput ratios only show CPU "
                         "efficiency when the server, not the machine or wrk, is the bottleneck.")
    if oha_by["larder"]["p99_ms"] and oha_by["nginx"]["p99_ms"]:
        notes.append(f"- p99 at the same fixed rate: larder {oha_by['larder']['p99_ms']['median']:.2f} ms, "
                     f"nginx {oha_by['nginx']['p99_ms']['median']:.2f} ms; when nginx's p99 is over the target too, "
                     "the tail comes from the machine and the load generator, not from the server.")
    if notes:
        out += ["", "Context (not targets):", ""] + notes
    if doc.get("larder_upstream_requests_during_warm_phases"):
        out += ["", f"**note:** larder sent {doc['larder_upstream_requests_during_warm_phases']:g} upstream "
                "request(s) during the warm measurements (expected 0; see the JSON)."]
    if bad_lines:
        out += ["", "Failed runs (excluded from the figures above):", ""] + bad_lines[:30]
    doc["summary"] = {"blob": blob_summary, "manifest": man_summary, "oha": oha_by, "memory": mem_summary,
                      "cold": cold_summary,
                      "targets": [{"row": r[0], "met": r[1]} for r in rows],
                      "targets13": [{"row": r[0], "met": r[1], "summary": r[2]} for r in rows13]}
    return "\n".join(out) + "\n"


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="repetitions of every measurement; default 5")
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk / oha point; default 5")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default: a new temp dir)")
    ap.add_argument("--tmp", type=Path, default=None, help="parent for the scratch dir (default: $TMPDIR or /tmp)")
    ap.add_argument("--larder-bin", type=Path, default=None,
                    help="use this larder binary instead of building (default: cargo build --release --locked)")
    ap.add_argument("--seed", type=int, default=20240607, help="seed for the blob bytes")
    ap.add_argument("--no-latency", action="store_true",
                    help="skip the fixed-rate latency points (oha), e.g. where oha is not installed")
    a = ap.parse_args()
    if a.reps < 1 or a.duration < 1:
        ap.error("--reps and --duration must be positive")
    return a


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, herd._raise_exit)

    needed = (["docker-registry", "skopeo", "nginx", "wrk", "curl"] + ([] if args.no_latency else ["oha"])
              + ([] if args.larder_bin else ["cargo"]))
    tools = {t: find_tool(t) for t in needed}
    missing = [t for t, p in tools.items() if p is None]
    if missing:
        log("missing tool(s): " + ", ".join(missing) + ". Install with:")
        apt = [t for t in missing if INSTALL_HINT[t].startswith("apt-get")]
        if apt:
            print("  apt-get update && apt-get install -y " + " ".join(INSTALL_HINT[t].split()[-1] for t in apt),
                  file=sys.stderr)
        for t in missing:
            if not INSTALL_HINT[t].startswith("apt-get"):
                print(f"  {INSTALL_HINT[t]}", file=sys.stderr)
        return 2
    oha_flag = [] if args.no_latency else oha_json_flag(tools["oha"])

    binary = args.larder_bin.resolve() if args.larder_bin else herd.build_larder(tools["cargo"])
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="larder-load-results-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info(tools)
    log(machine_line(machine))
    la_start = loadavg()
    log(f"load average {la_start}")

    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-load-", dir=args.tmp))
    runs: dict[str, list] = {"blob": [], "manifest": [], "oha": [], "memory": [], "cold": []}
    larder_upstream_warm = 0.0
    lua = scratch / "report.lua"
    lua.write_text(WRK_LUA)
    t_start = time.monotonic()
    try:
        origin = start_distribution(procs, scratch / "origin", "origin", None)
        log(f"origin (docker-registry) on {HOST}:{origin.port}")

        log("pushing bench/load:v1 (blobs of exactly 1, 10, 100 MiB of random bytes)")
        image = push_load_image(origin.port, args.seed)
        mdig = image["manifest"]["digest"]
        log(f"{LOAD_REPO}:{TAG} = {mdig} ({image['manifest']['size']} bytes)")

        log("pushing bench/cold:v1 (8 × 8 MiB gzip'd tar layers, skopeo)")
        cold_digest, cold_blobs, cold_bytes = herd.build_oci_layout(scratch / "cold-oci", 8, 8.0, args.seed + 1)
        push = subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{scratch / 'cold-oci'}:{TAG}",
                               f"docker://{HOST}:{origin.port}/{COLD_REPO}:{TAG}"],
                              capture_output=True, text=True, env=CHILD_ENV, timeout=300)
        if push.returncode != 0:
            raise RuntimeError(f"pushing {COLD_REPO} failed:\n{push.stdout}\n{push.stderr}")
        st, body, _ = http_get(f"http://{HOST}:{origin.port}/v2/{COLD_REPO}/manifests/{TAG}", {"Accept": OCI_MANIFEST})
        if st != 200:
            raise RuntimeError(f"origin: {COLD_REPO}:{TAG} → {st}")
        cold_digest = "sha256:" + sha256_hex(body)
        shutil.rmtree(scratch / "cold-oci", ignore_errors=True)

        # nginx serves the same bytes under the same URL path shape.
        docroot = scratch / "nginx-root"
        for name, b in image["blobs"].items():
            st, data, _ = http_get(f"http://{HOST}:{origin.port}/v2/{LOAD_REPO}/blobs/{b['digest']}", timeout=300)
            if st != 200 or "sha256:" + sha256_hex(data) != b["digest"]:
                raise RuntimeError(f"origin serves blob {name} wrong ({st})")
            f = docroot / "v2" / LOAD_REPO / "blobs" / b["digest"]
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_bytes(data)
        mf = docroot / "v2" / LOAD_REPO / "manifests" / mdig
        mf.parent.mkdir(parents=True, exist_ok=True)
        mf.write_bytes(image["manifest"]["bytes"])
        nginx = start_nginx(procs, tools["nginx"], scratch / "nginx", docroot)
        warm(nginx, image, skip_tag=True)
        log(f"nginx on {HOST}:{nginx.port}")

        # First fill of larder's cache and of the distribution proxy's storage.
        larder_cache = scratch / "larder-cache"
        dist_dir = scratch / "dist-proxy"
        log("first fill of larder and of the distribution proxy through the origin")
        lar = start_larder(procs, binary, scratch / "larder", larder_cache, origin.port)
        warm(lar, image)
        procs.stop(lar.proc)
        quiet_cache = scratch / "larder-quiet-cache"
        lar = start_larder(procs, binary, scratch / QUIET, quiet_cache, origin.port, log=False, name=QUIET)
        warm(lar, image)
        procs.stop(lar.proc)
        sendfile_cache = scratch / "larder-sendfile-cache"
        lar = start_larder(procs, binary, scratch / SENDFILE, sendfile_cache, origin.port, name=SENDFILE,
                           sendfile="always")
        warm(lar, image)
        procs.stop(lar.proc)
        dist = start_distribution(procs, dist_dir, "distribution proxy", origin.port)
        warm(dist, image)
        procs.stop(dist.proc)

        for rep in range(args.reps):
            log(f"=== rep {rep + 1}/{args.reps} (elapsed {time.monotonic() - t_start:.0f}s, "
                f"load {loadavg()})")
            servers: dict[str, Server] = {"nginx": nginx}
            # 3. memory: a fresh process per rep over the warm cache.
            for srv in rotate(("larder", "distribution"), rep):
                if srv == "larder":
                    s = start_larder(procs, binary, scratch / "larder", larder_cache, origin.port)
                else:
                    s = start_distribution(procs, dist_dir, "distribution proxy", origin.port)
                servers[srv] = s
                warm(s, image)
                time.sleep(1.0)
                idle = proc_status_kib(s.proc.pid, "VmRSS")
                big = big_downloads(procs, tools["curl"], s, f"/v2/{LOAD_REPO}/blobs/{image['blobs']['100MiB']['digest']}",
                                    BLOB_SIZES["100MiB"], BIG_DOWNLOADS, scratch / "curl", timeout=600)
                runs["memory"].append({"rep": rep, "server": srv, "idle_rss_kib": idle,
                                       "idle_hwm_kib": big["hwm_before_kib"], **big})
                log(f"  memory {LABEL[srv]:<20} idle {idle / 1024 if idle else 0:6.1f} MiB  peak "
                    f"{(big['hwm_kib'] or 0) / 1024:6.1f} MiB  {BIG_DOWNLOADS}×100 MiB in {big['wall_s']:.1f}s  "
                    f"failed {len(big['failed'])}")
            servers[QUIET] = start_larder(procs, binary, scratch / QUIET, quiet_cache, origin.port, log=False,
                                          name=QUIET)
            warm(servers[QUIET], image)
            servers[SENDFILE] = start_larder(procs, binary, scratch / SENDFILE, sendfile_cache, origin.port,
                                             name=SENDFILE, sendfile="always")
            warm(servers[SENDFILE], image)
            before = larder_metrics(servers["larder"])

            # 1. warm blob throughput
            for blob in WRK_BLOBS:
                b = image["blobs"][blob]
                path = f"/v2/{LOAD_REPO}/blobs/{b['digest']}"
                for conns in WRK_CONNS:
                    for srv in rotate(SERVERS + ((QUIET, SENDFILE) if blob in QUIET_BLOBS else ()), rep):
                        r = run_point(tools["wrk"], lua, servers[srv], path, conns, args.duration, None,
                                      b["size"])
                        runs["blob"].append({"rep": rep, "server": srv, "blob": blob, "conns": conns, **r})
                        log(f"  blob {blob:>5} c{conns:<2} {LABEL[srv]:<20} "
                            + (f"{r['rps']:9.1f} req/s {r['mbps']:8.1f} MB/s" if r["ok"] else f"FAILED {r['error']}"))

            # 2. manifests
            msize = image["manifest"]["size"]
            acc = {"Accept": OCI_MANIFEST}
            larder_digest_rps = None
            for ref in ("digest", "tag"):
                path = f"/v2/{LOAD_REPO}/manifests/{mdig if ref == 'digest' else TAG}"
                for srv in rotate(SERVERS + (QUIET,) if ref == "digest" else ("larder", "distribution"), rep):
                    r = run_point(tools["wrk"], lua, servers[srv], path, MANIFEST_CONNS, args.duration, acc,
                                  msize)
                    runs["manifest"].append({"rep": rep, "server": srv, "ref": ref, **r})
                    if srv == "larder" and ref == "digest" and r["ok"]:
                        larder_digest_rps = r["rps"]
                    log(f"  manifest by {ref:<6} {LABEL[srv]:<20} "
                        + (f"{r['rps']:9.0f} req/s" if r["ok"] else f"FAILED {r['error']}"))
            # Latency at 70 % of larder's max; nginx at the same rate shows what
            # the machine and the load generator alone add.
            for srv in rotate(("larder", "nginx"), rep) if not args.no_latency else ():
                if not larder_digest_rps:
                    runs["oha"].append({"rep": rep, "server": srv, "ok": False,
                                        "error": "no larder manifest rate measured in this rep"})
                    continue
                rate = OHA_RATE_SHARE * larder_digest_rps
                r = run_oha(tools["oha"], oha_flag, servers[srv], f"/v2/{LOAD_REPO}/manifests/{mdig}",
                            rate, args.duration, MANIFEST_CONNS, acc)
                runs["oha"].append({"rep": rep, "server": srv, **r})
                log(f"  oha by digest {LABEL[srv]:<20} at {rate:.0f} req/s: "
                    + (f"achieved {r['achieved_rps']:.0f}, p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms"
                       if r["ok"] else f"FAILED {r['error']}"))

            after = larder_metrics(servers["larder"])
            up = after["upstream_requests"] - before["upstream_requests"]
            larder_upstream_warm += up
            runs.setdefault("larder_metrics", []).append({"rep": rep, "before": before, "after": after,
                                                          "upstream_requests_during_warm_phases": up,
                                                          "hwm_end_of_rep_kib": proc_status_kib(
                                                              servers["larder"].proc.pid, "VmHWM")})
            for srv in ("larder", QUIET, SENDFILE, "distribution"):
                if servers[srv].proc.poll() is not None:
                    log(f"warning: {srv} exited with {servers[srv].proc.returncode} during rep {rep + 1}")
                procs.stop(servers[srv].proc)

            # 4. cold pull: fresh larder with an empty cache vs straight from the origin.
            for mode in rotate(("larder", "direct"), rep):
                if mode == "larder":
                    cdir = scratch / f"cold-larder-{rep}"
                    s = start_larder(procs, binary, cdir, cdir / "cache", origin.port)
                    try:
                        r = skopeo_pull(procs, s.port, scratch / f"pull-{mode}-{rep}", cold_digest, 300)
                    finally:
                        procs.stop(s.proc)
                        shutil.rmtree(cdir, ignore_errors=True)
                else:
                    r = skopeo_pull(procs, origin.port, scratch / f"pull-{mode}-{rep}", cold_digest, 300)
                runs["cold"].append({"rep": rep, "mode": mode, **r})
                log(f"  cold pull {LABEL[mode]:<20} {r['wall_s']:6.2f}s " + ("ok" if r["ok"] else f"FAILED {r['error']}"))
        if origin.proc.poll() is not None:
            log(f"warning: the origin exited with {origin.proc.returncode}")
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)

    image_doc = {
        "load": {"repo": LOAD_REPO, "tag": TAG, "manifest_digest": image["manifest"]["digest"],
                 "manifest_size": image["manifest"]["size"],
                 "blobs": image["blobs"]},
        "cold": {"repo": COLD_REPO, "tag": TAG, "manifest_digest": cold_digest, "blobs": cold_blobs,
                 "blob_bytes": cold_bytes},
    }
    doc = {
        "benchmark": "load",
        "machine": machine,
        "loadavg_start": la_start,
        "loadavg_end": loadavg(),
        "elapsed_s": time.monotonic() - t_start,
        "params": {"reps": args.reps, "duration": args.duration, "seed": args.seed,
                   "wrk_blob_conns": list(WRK_CONNS), "manifest_conns": MANIFEST_CONNS,
                   "big_downloads": BIG_DOWNLOADS, "oha_rate_share": OHA_RATE_SHARE, "oha_flags": oha_flag},
        "image": image_doc,
        "larder_upstream_requests_during_warm_phases": larder_upstream_warm,
        "runs": runs,
    }
    md = build_report(doc)
    doc["markdown"] = md
    (out_dir / "load.json").write_text(json.dumps(doc, indent=2, default=str))
    (out_dir / "load.md").write_text(md)
    print(md)
    log(f"results: {out_dir / 'load.json'} and {out_dir / 'load.md'} ({doc['elapsed_s']:.0f}s)")
    larder_failed = (any(not r["ok"] for k in ("blob", "manifest", "oha", "memory") for r in runs[k]
                         if r["server"] in ("larder", QUIET, SENDFILE))
                     or any(not r["ok"] for r in runs["cold"]))
    return 1 if larder_failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; all processes and scratch dirs were cleaned up")
        sys.exit(130)
