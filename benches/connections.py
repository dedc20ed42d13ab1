#!/usr/bin/env python3
"""Connection-scale benchmark: a hub larder holding 10,000 keep-alive client
connections (most idle, 200 active), as a mirror for a thousand nodes does.

Per repetition, on one warm larder (release build, logging as shipped: one
line per request):

  1. baseline: wrk, 200 connections, warm manifest GET by digest, for
     --duration seconds: requests/s and larder's CPU time per request;
  2. this process opens --idle more connections (10,000 − 200 by default),
     each sends one request and then stays open and silent;
  3. the same wrk run again beside them; larder's RSS sampled throughout;
  4. every idle connection sends a second request: each must still be open
     and answer 200 (larder closes a connection only after 120 s of
     silence, longer than one repetition).

Reported: the rate with the idle crowd ÷ the baseline rate per repetition,
peak RSS, errors (wrk's, idle connections lost or refused). Median and
min–max over --reps. The open-files limit is raised here, for this process
and the children it starts, not in the product (larder raises its own).

    python3 benches/connections.py [--reps 5] [--duration 10] [--idle 9800]

Everything listens on and dials 127.0.0.1 only. See benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import selectors
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import herd  # noqa: E402
import load  # noqa: E402
from herd import HOST, OCI_CONFIG, OCI_MANIFEST, Procs, sha256_hex  # noqa: E402

REPO = "bench/conns"
TAG = "v1"
ACTIVE = 200
IDLE_DEFAULT = 10_000 - ACTIVE
# What the idle connections ask: small, and every answer ends with its body.
IDLE_PATH = "/v2/"
# Larder closes a connection after 120 s without a byte; a repetition
# (two wrk runs and the idle round trips) must stay well below that.
MAX_DURATION = 30
# Targets of the issue (scale and speed, round 2).
TARGET_RSS_MIB = 100.0
TARGET_RATE_RATIO = 0.8


def push_manifest(port: int) -> str:
    """A one-layer image whose manifest is the warm object under load."""
    layer = load.push_blob(port, REPO, b"larder connection benchmark layer\n")
    config = json.dumps({"architecture": "amd64", "os": "linux",
                         "rootfs": {"type": "layers", "diff_ids": [layer]}}, separators=(",", ":")).encode()
    cfg = load.push_blob(port, REPO, config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg, "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer, "size": 34}],
    }, separators=(",", ":")).encode()
    st, _, body = load.http_send("PUT", f"http://{HOST}:{port}/v2/{REPO}/manifests/{TAG}", manifest,
                                 {"Content-Type": OCI_MANIFEST})
    if st != 201:
        raise RuntimeError(f"manifest PUT: {st} {body[:200]!r}")
    return "sha256:" + sha256_hex(manifest)


class IdleCrowd:
    """`n` client connections, each having made one request, then silent."""

    def __init__(self, port: int, n: int):
        self.port, self.n = port, n
        self.socks: list[socket.socket] = []
        self.request = f"GET {IDLE_PATH} HTTP/1.1\r\nHost: {HOST}:{port}\r\n\r\n".encode()

    def open(self) -> int:
        """Connects all and completes one request on each; returns failures."""
        for _ in range(self.n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            s.connect_ex((HOST, self.port))
            self.socks.append(s)
        return self.round_trip(connect=True)

    def round_trip(self, connect: bool = False) -> int:
        """One request on every connection, all at once; failures counted."""
        sel = selectors.DefaultSelector()
        state: dict[socket.socket, bytearray] = {}
        for s in self.socks:
            sel.register(s, selectors.EVENT_WRITE)
        failed = 0
        deadline = time.monotonic() + 60
        pending = len(self.socks)
        while pending and time.monotonic() < deadline:
            for key, ev in sel.select(timeout=1.0):
                s = key.fileobj
                try:
                    if ev & selectors.EVENT_WRITE:
                        if connect and s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                            raise OSError("connect failed")
                        s.send(self.request)  # small: fits the socket buffer at once
                        state[s] = bytearray()
                        sel.modify(s, selectors.EVENT_READ)
                        continue
                    chunk = s.recv(4096)
                    if not chunk:
                        raise OSError("closed by larder")
                    buf = state[s]
                    buf += chunk
                    head, sep, body = bytes(buf).partition(b"\r\n\r\n")
                    if not sep:
                        continue
                    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    if len(body) < length:
                        continue
                    if not head.startswith(b"HTTP/1.1 200"):
                        raise OSError(head.split(b"\r\n", 1)[0].decode(errors="replace"))
                except OSError:
                    failed += 1
                sel.unregister(s)
                pending -= 1
        failed += pending  # no answer within the deadline
        sel.close()
        return failed

    def close(self) -> None:
        for s in self.socks:
            s.close()
        self.socks.clear()


class RssSampler(threading.Thread):
    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak_kib, self.stop_flag = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop_flag.is_set():
            self.peak_kib = max(self.peak_kib, load.proc_status_kib(self.pid, "VmRSS") or 0)
            time.sleep(0.05)

    def stop(self) -> int:
        self.stop_flag.set()
        self.join()
        return self.peak_kib


def summary(xs: list[float]) -> str:
    if not xs:
        return "n/a"
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}–{max(xs):.3g})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--duration", type=int, default=10, help=f"seconds per wrk run (at most {MAX_DURATION})")
    ap.add_argument("--idle", type=int, default=IDLE_DEFAULT, help="idle connections beside the 200 active")
    ap.add_argument("--larder-bin", type=Path, help="a release build (default: cargo build --release)")
    ap.add_argument("--out", type=Path, help="where to write results.json")
    args = ap.parse_args()
    if not 1 <= args.duration <= MAX_DURATION:
        ap.error(f"--duration must be 1..{MAX_DURATION}")
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, herd._raise_exit)

    # The load side needs a descriptor per connection; raise the limit here.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.idle + ACTIVE + 1024
    if hard < need:
        herd.log(f"the hard open-files limit is {hard}, {need} are needed: raise it (ulimit -Hn) and rerun")
        return 2
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    wrk = load.find_tool("wrk")
    if wrk is None:
        herd.log("wrk is missing: apt-get install -y wrk")
        return 2
    binary = args.larder_bin.resolve() if args.larder_bin else herd.build_larder()
    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-conns-"))
    lua = scratch / "report.lua"
    lua.write_text(load.WRK_LUA)
    reps: list[dict] = []
    try:
        origin = load.start_distribution(procs, scratch / "origin", "origin", None)
        digest = push_manifest(origin.port)
        lar = load.start_larder(procs, binary, scratch / "larder", scratch / "larder" / "cache", origin.port,
                                max_connections=args.idle + ACTIVE + 256)
        path = f"/v2/{REPO}/manifests/{digest}"
        st, _, _ = load.http_get(lar.url(path), {"Accept": OCI_MANIFEST})
        if st != 200:
            raise RuntimeError(f"warming {path}: {st}")
        idle_rss_kib = load.proc_status_kib(lar.proc.pid, "VmRSS")
        herd.log(f"larder warm, idle RSS {idle_rss_kib / 1024:.1f} MiB; {args.reps} reps of "
                 f"{ACTIVE} active (+ {args.idle} idle) connections, {args.duration} s each")
        for rep in range(args.reps):
            r: dict = {"rep": rep}
            runs = ("base", "crowd") if rep % 2 == 0 else ("crowd", "base")
            for which in runs:
                crowd = IdleCrowd(lar.port, args.idle) if which == "crowd" else None
                sampler = RssSampler(lar.proc.pid)
                sampler.start()
                if crowd:
                    t0 = time.monotonic()
                    r["open_failures"] = crowd.open()
                    r["open_s"] = time.monotonic() - t0
                    r["rss_with_crowd_mib"] = (load.proc_status_kib(lar.proc.pid, "VmRSS") or 0) / 1024
                w = load.run_wrk(wrk, lua, lar, path, ACTIVE, args.duration, {"Accept": OCI_MANIFEST}, 100)
                if crowd:
                    r["still_open_failures"] = crowd.round_trip()
                    crowd.close()
                r[which] = {k: w.get(k) for k in ("ok", "error", "rps", "server_cpu_us_per_req", "lat_p99_us")}
                r[which]["peak_rss_mib"] = sampler.stop() / 1024
                time.sleep(1)
            r["ratio"] = r["crowd"]["rps"] / r["base"]["rps"] if r["base"].get("rps") else None
            herd.log(f"rep {rep}: {ACTIVE} conns {r['base']['rps']:.0f} req/s, with {args.idle} idle "
                     f"{r['crowd']['rps']:.0f} req/s (×{r['ratio']:.3f}), peak RSS {r['crowd']['peak_rss_mib']:.1f} MiB, "
                     f"idle failures {r['open_failures']}+{r['still_open_failures']}, "
                     f"wrk errors: {r['base']['error'] or 'none'} / {r['crowd']['error'] or 'none'}")
            reps.append(r)
    finally:
        procs.stop_all()

    ratios = [r["ratio"] for r in reps if r["ratio"]]
    rss = [r["crowd"]["peak_rss_mib"] for r in reps]
    errors = sum(r["open_failures"] + r["still_open_failures"] for r in reps)
    wrk_bad = sum(1 for r in reps for k in ("base", "crowd") if not r[k]["ok"])
    print(f"\n{ACTIVE + args.idle} connections ({ACTIVE} active), {len(reps)} reps, median (min–max):")
    print(f"  rate with the idle crowd ÷ {ACTIVE}-connection rate: {summary(ratios)} (target ≥ {TARGET_RATE_RATIO})")
    print(f"  {ACTIVE}-connection rate: {summary([r['base']['rps'] for r in reps])} req/s; "
          f"with the crowd: {summary([r['crowd']['rps'] for r in reps])} req/s")
    print(f"  larder CPU per request: {summary([r['base']['server_cpu_us_per_req'] for r in reps])} µs; "
          f"with the crowd: {summary([r['crowd']['server_cpu_us_per_req'] for r in reps])} µs")
    print(f"  peak RSS with the crowd: {summary(rss)} MiB (target ≤ {TARGET_RSS_MIB}); idle RSS before: "
          f"{idle_rss_kib / 1024:.1f} MiB")
    print(f"  idle connections refused or lost: {errors}; wrk runs with errors: {wrk_bad}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "connections.json").write_text(json.dumps({"reps": reps, "idle_rss_kib": idle_rss_kib}, indent=1))
    return 0 if errors == 0 and wrk_bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
