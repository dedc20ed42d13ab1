#!/usr/bin/env python3
"""Warm manifests, side by side: server CPU per warm manifest GET of one or
more larder binaries (request lines on, as shipped, and `log.level = "warn"`)
against nginx serving the same bytes from a file, in one run.

Every repetition runs each contestant once (`wrk -t2 -c16` on the manifest by
digest, keep-alive, loopback), in an order rotated per repetition; CPU is
utime + stime of the server's process (nginx: master and workers) from
/proc over the wrk run, divided by the completed requests. Prints median
(min-max) per contestant and, per larder, nginx's CPU per request divided by
larder's in the same repetition (issue 35's ratio: >= 1.0 with request lines
on, >= 1.3 with `warn`).

    python3 benches/manifest_ab.py --reps 7 target/release/larder [/tmp/other-larder ...]

`--strace` instead attaches `strace -c -f` to each larder for one short wrk
run and prints syscalls per request (exact counts; strace slows the server,
so no CPU figure then). `--perf OUT` records `perf record -g` of each larder
during a wrk run into OUT.<n>.data and prints `perf report`'s top entries.
`--heaptrack` runs each larder under heaptrack twice, once for 1,000 and once
for 6,000 keep-alive GETs of the manifest from one client, and prints the
difference in allocation calls per request (exact: start-up cancels out).
Loopback only. See benches/README.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import load  # noqa: E402
from herd import CHILD_ENV, HOST, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, Procs, sha256_hex  # noqa: E402

REPO = "bench/manifest"
NGINX = "nginx"


def push_small_image(port: int) -> tuple[str, bytes]:
    """A config, one 4 KiB layer and their manifest; (digest, manifest bytes)."""
    layer = bytes(range(256)) * 16
    ld = load.push_blob(port, REPO, layer)
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": [ld]}},
                        separators=(",", ":")).encode()
    cd = load.push_blob(port, REPO, config)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": {"mediaType": OCI_CONFIG, "digest": cd, "size": len(config)},
                           "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": ld, "size": len(layer)}]},
                          separators=(",", ":")).encode()
    st, _, body = load.http_send("PUT", f"http://{HOST}:{port}/v2/{REPO}/manifests/v1", manifest,
                                 {"Content-Type": OCI_MANIFEST})
    if st != 201:
        raise RuntimeError(f"manifest PUT: {st} {body[:200]!r}")
    return "sha256:" + sha256_hex(manifest), manifest


def strace_counts(server: load.Server, wrk: str, lua: Path, path: str, scratch: Path) -> tuple[int, dict]:
    """Completed requests and {syscall: calls} while strace -c -f is attached."""
    out = scratch / f"strace-{server.port}.txt"
    st = subprocess.Popen(["strace", "-c", "-f", "-q", "-o", str(out), "-p", str(server.proc.pid)])
    time.sleep(1.0)
    r = load.run_wrk(wrk, lua, server, path, 16, 3, {"Accept": OCI_MANIFEST}, 100)
    time.sleep(0.3)
    st.send_signal(2)
    st.wait(timeout=30)
    calls = {}
    for line in out.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0][0].isdigit() and parts[-1] not in ("total",):
            try:
                calls[parts[-1]] = int(parts[3])
            except ValueError:
                pass
    return r.get("requests") or 0, calls


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+", type=Path, help="larder binaries to compare")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    ap.add_argument("--strace", action="store_true", help="count syscalls per request instead")
    ap.add_argument("--heaptrack", action="store_true", help="count allocations per request instead")
    ap.add_argument("--perf", type=Path, help="record perf profiles (OUT.<n>.data) instead")
    args = ap.parse_args()
    wrk, nginx = shutil.which("wrk"), shutil.which("nginx") or "/usr/sbin/nginx"
    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-manifest-ab-"))
    lua = scratch / "report.lua"
    lua.write_text(load.WRK_LUA)
    cpu: dict[str, list[float]] = {}
    try:
        origin = load.start_distribution(procs, scratch / "origin", "origin", None)
        digest, manifest = push_small_image(origin.port)
        path = f"/v2/{REPO}/manifests/{digest}"
        docroot = scratch / "www"
        (docroot / path.lstrip("/")).parent.mkdir(parents=True)
        (docroot / path.lstrip("/")).write_bytes(manifest)
        if args.heaptrack:
            for i, b in enumerate(args.binaries):
                for logged in (True, False):
                    counts = []
                    for n in (1000, 6000):
                        d = scratch / f"heaptrack-{i}-{int(logged)}-{n}"
                        d.mkdir(parents=True)
                        wrapper = d / "larder"
                        wrapper.write_text(f'#!/bin/sh\nexec heaptrack -o {d / "ht"} {b.resolve()} "$@"\n')
                        wrapper.chmod(0o755)
                        s = load.start_larder(procs, wrapper, d, d / "cache", origin.port, log=logged)
                        conn = http.client.HTTPConnection(HOST, s.port)
                        for _ in range(n):
                            conn.request("GET", path, headers={"Accept": OCI_MANIFEST})
                            r = conn.getresponse()
                            if r.status != 200 or r.read() != manifest:
                                raise RuntimeError("heaptrack run: bad response")
                        conn.close()
                        # Only larder gets SIGTERM: heaptrack's own processes must
                        # live to write the data out, then the wrapper exits.
                        for pid in subprocess.run(["pgrep", "-g", str(os.getpgid(s.proc.pid))],
                                                  capture_output=True, text=True).stdout.split():
                            try:
                                if os.path.realpath(f"/proc/{pid}/exe") == str(b.resolve()):
                                    os.kill(int(pid), signal.SIGTERM)
                            except OSError:
                                pass
                        s.proc.wait(timeout=120)
                        procs.stop(s.proc)
                        data = next(d.glob("ht*"))
                        out = subprocess.run(["heaptrack_print", "-f", str(data), "-s", "0", "-a", "0", "-p", "0",
                                              "-T", "0", "-l", "0", "-n", "0"], capture_output=True, text=True).stdout
                        m = re.search(r"calls to allocation functions: (\d+)", out)
                        counts.append(int(m.group(1)))
                    print(f"{b} ({'request lines' if logged else 'warn'}): "
                          f"{(counts[1] - counts[0]) / 5000:.2f} allocations per request")
            return 0
        servers: dict[str, load.Server] = {}
        for i, b in enumerate(args.binaries):
            for logged in (True, False):
                name = f"{b} ({'request lines' if logged else 'warn'})"
                d = scratch / f"larder-{i}-{int(logged)}"
                # load.run_point checks by these names that a larder with request
                # lines wrote a line per request and a quiet one none.
                s = load.start_larder(procs, b.resolve(), d, d / "cache", origin.port, log=logged,
                                      name="larder" if logged else load.QUIET)
                st, body, _ = load.http_get(s.url(path), {"Accept": OCI_MANIFEST})
                if st != 200 or body != manifest:
                    raise RuntimeError(f"warm-up of {name}: {st}")
                servers[name] = s
        if args.perf:
            for i, (name, s) in enumerate(servers.items()):
                data = Path(f"{args.perf}.{i}.data")
                rec = subprocess.Popen(["perf", "record", "-F", "999", "-g", "-o", str(data), "-p", str(s.proc.pid)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
                r = load.run_wrk(wrk, lua, s, path, 16, args.duration, {"Accept": OCI_MANIFEST}, 100)
                rec.send_signal(2)
                rec.wait(timeout=60)
                top = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--percent-limit", "0.7",
                                      "--stdio", "-g", "none", "--sort", "sym"], capture_output=True, text=True).stdout
                print(f"== {name}: {r.get('requests')} requests, {data}")
                print("\n".join(l for l in top.splitlines() if l.strip() and not l.startswith("#")))
            return 0
        if args.strace:
            for name, s in servers.items():
                n, calls = strace_counts(s, wrk, lua, path, scratch)
                total = sum(calls.values())
                top = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v / n >= 0.005)
                print(f"{name}: {n} requests, {total / n:.2f} syscalls per request: {top}")
            return 0
        servers[NGINX] = load.start_nginx(procs, nginx, scratch / "nginx", docroot)
        st, body, _ = load.http_get(servers[NGINX].url(path))
        if st != 200 or body != manifest:
            raise RuntimeError(f"nginx: {st}")
        cpu = {name: [] for name in servers}
        for rep in range(args.reps):
            for name in load.rotate(list(servers), rep):
                r = load.run_point(wrk, lua, servers[name], path, 16, args.duration, {"Accept": OCI_MANIFEST},
                                   len(manifest))
                if not r["ok"]:
                    raise RuntimeError(f"{name}: {r['error']}")
                cpu[name].append(r["server_cpu_us_per_req"])
            load.log(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{n} {v[-1]:.2f}" for n, v in cpu.items()))
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"\nserver CPU per warm manifest GET, µs, median (min-max) of {args.reps}")
    for name, xs in cpu.items():
        print(f"  {name:<60} {statistics.median(xs):6.2f} ({min(xs):.2f}-{max(xs):.2f})")
    print("nginx ÷ larder per repetition")
    for name, xs in cpu.items():
        if name != NGINX:
            rs = [n / x for n, x in zip(cpu[NGINX], xs)]
            print(f"  {name:<60} {statistics.median(rs):5.3f} ({min(rs):.3f}-{max(rs):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
