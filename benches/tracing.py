#!/usr/bin/env python3
"""What traces cost: server CPU per warm manifest GET by digest, side by side,
for

  before        a larder binary built without tracing (--before: the commit
                before it, e.g. built from `git archive`), as shipped;
  unset         this larder, no [tracing] (the default): must cost the same;
  sampled-0     this larder exporting, sampling_ratio = 0.0 (spans made,
                none recorded);
  sampled-1     this larder exporting every span (sampling_ratio = 1.0) to
                a receiver in this script that answers 200.

Each is a fresh process over its own warm cache (filled once from a CNCF
distribution origin), all with the request log as shipped. Every repetition
runs `wrk -t2 -c16` on the manifest for --duration seconds against each, the
order rotated per repetition; CPU is larder's utime + stime from /proc over
the run. Reported: median (min–max) of µs per request and of the ratio to
`before` computed per repetition, req/s, and for the exporting larders what
larder_trace_spans_total says (exported, failed, dropped).

    python3 benches/tracing.py --before /tmp/larder-before [--after target/release/larder]
                               [--reps 7] [--duration 5]

Everything listens on 127.0.0.1 only. Needs docker-registry and wrk.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402  (servers, wrk, CPU accounting)
from herd import HOST, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, Procs, free_port  # noqa: E402

REPO = "bench/tracing"
SERVERS = ["before", "unset", "sampled-0", "sampled-1"]


class Sink(http.server.ThreadingHTTPServer):
    """A collector that takes every export (POST /v1/traces) and answers 200."""

    daemon_threads = True

    def __init__(self) -> None:
        self.exports = 0
        self.bytes = 0

        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("Content-Length", "0"))
                self.rfile.read(n)
                sink.exports += 1
                sink.bytes += n
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args) -> None:
                pass

        super().__init__((HOST, 0), Handler)

    def url(self) -> str:
        return f"http://{HOST}:{self.server_address[1]}"


def push_image(port: int) -> str:
    config = json.dumps({"architecture": "amd64", "os": "linux"}).encode()
    layer = os.urandom(64 << 10)
    cfg, lay = load.push_blob(port, REPO, config), load.push_blob(port, REPO, layer)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg, "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": lay, "size": len(layer)}],
    }, separators=(",", ":")).encode()
    st, _, body = load.http_send("PUT", f"http://{HOST}:{port}/v2/{REPO}/manifests/v1", manifest,
                                 {"Content-Type": OCI_MANIFEST})
    if st != 201:
        raise RuntimeError(f"manifest PUT: {st} {body[:200]!r}")
    return "sha256:" + load.sha256_hex(manifest)


def start(procs: Procs, name: str, binary: Path, d: Path, origin: int, tracing: str) -> load.Server:
    d.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in load.CHILD_ENV.items() if k != "RUST_LOG" and not k.startswith("OTEL_")}
    port, admin = free_port(), free_port()
    (d / "larder.toml").write_text(
        "[server]\n"
        f'listen = "{HOST}:{port}"\n'
        f'admin_listen = "{HOST}:{admin}"\n'
        "[cache]\n"
        f'dir = "{d / "cache"}"\n'
        'tag_ttl = "1h"\n'
        "[[upstream]]\n"
        'name = "origin.test"\n'
        f'url = "http://{HOST}:{origin}"\n'
        "default = true\n"
        "fill_ahead = false\n"
        + tracing
    )
    logf = d / "larder.log"
    with open(logf, "ab") as fl:
        p = procs.start([str(binary), "--config", str(d / "larder.toml")], stdout=fl, stderr=fl, env=env)
    load.wait_http(p, f"http://{HOST}:{port}/v2/", name, logf)
    load.wait_http(p, f"http://{HOST}:{admin}/healthz", f"{name} admin", logf)
    return load.Server(name, p, port, logf, admin)


def spans(s: load.Server) -> dict:
    st, body, _ = load.http_get(f"http://{HOST}:{s.admin}/metrics", timeout=10)
    out = {}
    for m in re.finditer(r'^larder_trace_spans_total\{result="(\w+)"\} (\S+)$', body.decode(), re.M):
        out[m.group(1)] = float(m.group(2))
    return out


def med(xs: list[float], fmt: str) -> str:
    if not xs:
        return "–"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", type=Path, required=True, help="larder built from the commit before tracing")
    ap.add_argument("--after", type=Path, default=Path("target/release/larder"))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    wrk = shutil.which("wrk")
    if not wrk or not shutil.which("docker-registry"):
        print("needs wrk and docker-registry (apt-get install wrk docker-registry)", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="larder-tracing-bench-"))
    out = args.out or scratch
    out.mkdir(parents=True, exist_ok=True)
    lua = scratch / "report.lua"
    lua.write_text(load.WRK_LUA)
    procs = Procs()
    sink = Sink()
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    try:
        origin = load.start_distribution(procs, scratch / "origin", "origin", None)
        digest = push_image(origin.port)
        path = f"/v2/{REPO}/manifests/{digest}"
        tracing = {
            "before": "",
            "unset": "",
            "sampled-0": f'[tracing]\notlp_endpoint = "{sink.url()}"\nsampling_ratio = 0.0\n',
            "sampled-1": f'[tracing]\notlp_endpoint = "{sink.url()}"\nsampling_ratio = 1.0\n',
        }
        binary = {"before": args.before, "unset": args.after, "sampled-0": args.after, "sampled-1": args.after}
        servers = {}
        for name in SERVERS:
            servers[name] = start(procs, name, binary[name], scratch / name, origin.port, tracing[name])
            st, body, _ = load.http_get(servers[name].url(path), {"Accept": OCI_MANIFEST})
            if st != 200 or "sha256:" + load.sha256_hex(body) != digest:
                raise RuntimeError(f"warm-up of {name}: {st}")
        runs: dict[str, list[dict]] = {n: [] for n in SERVERS}
        for rep in range(args.reps):
            for name in load.rotate(SERVERS, rep):
                before = spans(servers[name])
                r = load.run_wrk(wrk, lua, servers[name], path, 16, args.duration, {"Accept": OCI_MANIFEST}, 100)
                time.sleep(6 if name.startswith("sampled") else 0.5)  # the batch export after the run
                after = spans(servers[name])
                r["spans"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                os.truncate(servers[name].logfile, 0)
                runs[name].append(r)
                print(f"rep {rep + 1} {name}: {r.get('server_cpu_us_per_req') or 0:.2f} µs/req, "
                      f"{r.get('rps') or 0:.0f} req/s {r['spans'] or ''} {'' if r['ok'] else r['error']}",
                      file=sys.stderr)
        lines = [
            f"Warm manifest GET by digest, wrk -t2 -c16 -d{args.duration}s, {args.reps} repetitions "
            f"(load {load.loadavg()} at the end); median (min–max).",
            "",
            "| larder | server CPU µs/request | ÷ before (per rep) | req/s | spans exported / failed / dropped per request |",
            "|---|---:|---:|---:|---:|",
        ]
        base = runs["before"]
        for name in SERVERS:
            ok = [r for r in runs[name] if r["ok"]]
            cpu = [r["server_cpu_us_per_req"] for r in ok]
            ratio = [r["server_cpu_us_per_req"] / b["server_cpu_us_per_req"]
                     for r, b in zip(runs[name], base) if r["ok"] and b["ok"]]
            per = lambda k: [r["spans"].get(k, 0) / r["requests"] for r in ok if r.get("requests")]  # noqa: E731
            span_cell = "–" if name in ("before", "unset") else " / ".join(
                med(per(k), "{:.2f}") for k in ("exported", "failed", "dropped"))
            lines.append(f"| {name} | {med(cpu, '{:.2f}')} | {med(ratio, '{:.3f}')} | "
                         f"{med([r['rps'] for r in ok], '{:.0f}')} | {span_cell} |")
        failed = {n: [r["error"] for r in runs[n] if not r["ok"]] for n in SERVERS}
        if any(failed.values()):
            lines += ["", f"failed runs: {failed}"]
        lines += ["", f"receiver: {sink.exports} exports, {sink.bytes} bytes"]
        report = "\n".join(lines)
        print(report)
        (out / "tracing.md").write_text(report + "\n")
        (out / "tracing.json").write_text(json.dumps(runs, indent=1, default=str))
        print(f"results in {out}", file=sys.stderr)
        return 0
    finally:
        procs.stop_all()
        sink.shutdown()


if __name__ == "__main__":
    sys.exit(main())
