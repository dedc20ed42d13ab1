#!/usr/bin/env python3
"""What `client_credentials = "verify"` costs a warm request.

Two larders over their own warm caches, in front of one origin (CNCF
distribution with htpasswd: a registry that asks for Basic credentials),
measured side by side in one run with the same requests (every request
carries the client's Basic credentials, which the plain larder ignores):

  * plain:  larder with the origin's credentials of its own, no checks;
  * verify: `client_credentials = "verify"`, no credentials of its own
            (its fills used the verified client's).

For a manifest GET by digest and a 1 MiB blob GET (wrk, 16 connections;
the blob also with 1), each repetition rotating which larder goes first:
requests per second and larder's CPU per request (utime + stime); the
ratio verify ÷ plain per repetition, median and min–max. And the proof
that a verified pair costs no round trip: the origin's access log and
larder's `larder_upstream_requests_total` and
`larder_client_verifications_total` must not move during the measured
runs (a run where they do is reported as failed).

    python3 benches/verify.py [--reps 5] [--duration 5] [--larder-bin PATH] [--out DIR]

Needs docker-registry, wrk and the Python package bcrypt (the origin's
htpasswd). Everything listens on 127.0.0.1 only. See benches/README.md.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import herd  # noqa: E402
import load  # noqa: E402
from herd import CHILD_ENV, HOST, OCI_CONFIG, OCI_LAYER_GZIP, OCI_MANIFEST, Procs, sha256_hex  # noqa: E402
from load import Server, fmt_s, http_get, http_send, log, retry_port, rotate, run_wrk, summary, wait_http  # noqa: E402

REPO = "team-a/app"
TAG = "v1"
PUSHER = ("pusher", "pusher-pw")
CLIENT = ("alice", "alice:S3cret:pw")  # a colon in the password, as tokens have
BLOB = 1 << 20
POINTS = (("manifest", 16), ("blob 1 MiB", 16), ("blob 1 MiB", 1))
SERVERS = ("plain", "verify")


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def start_origin(procs: Procs, d: Path) -> Server:
    """distribution with htpasswd auth and its access log on (each request it
    serves is a line: how the runs prove they sent nothing upstream)."""
    import bcrypt

    d.mkdir(parents=True, exist_ok=True)
    lines = [f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(5)).decode()}" for u, p in (PUSHER, CLIENT)]
    (d / "htpasswd").write_text("\n".join(lines) + "\n")

    def start(port: int) -> Server:
        (d / "config.yml").write_text(
            "version: 0.1\nlog:\n  level: warn\n"
            f"storage:\n  filesystem:\n    rootdirectory: {d / 'storage'}\n"
            f"http:\n  addr: {HOST}:{port}\n"
            f"auth:\n  htpasswd:\n    realm: origin\n    path: {d / 'htpasswd'}\n"
        )
        logf = d / "registry.log"
        with open(logf, "ab") as fl:
            p = procs.start(["docker-registry", "serve", str(d / "config.yml")], stdout=fl, stderr=subprocess.STDOUT)
        wait_http(p, f"http://{HOST}:{port}/v2/", "origin", logf)
        return Server("origin", p, port, logf)

    return retry_port(start)


def origin_requests(origin: Server) -> int:
    """Requests in the origin's access log so far."""
    text = origin.logfile.read_text(errors="replace")
    return sum(1 for line in text.splitlines() if re.search(r'"(GET|HEAD) /v2/', line))


def settled_requests(origin: Server) -> int:
    """The origin's request count once its log stopped growing for 0.5 s
    (distribution writes a line after answering, a moment later)."""
    last = origin_requests(origin)
    while True:
        time.sleep(0.5)
        now = origin_requests(origin)
        if now == last:
            return now
        last = now


def push(origin: Server, seed: int) -> dict:
    auth = {"Authorization": basic(*PUSHER)}
    rng = random.Random(seed)

    def blob(data: bytes) -> str:
        digest = "sha256:" + sha256_hex(data)
        st, hdrs, body = http_send("POST", origin.url(f"/v2/{REPO}/blobs/uploads/"), b"", auth)
        if st != 202:
            raise RuntimeError(f"upload start: {st} {body[:200]!r}")
        url = urllib.parse.urljoin(origin.url("/"), hdrs.get("Location") or hdrs.get("location"))
        url += ("&" if "?" in url else "?") + "digest=" + urllib.parse.quote(digest)
        st, _, body = http_send("PUT", url, data, {**auth, "Content-Type": "application/octet-stream"})
        if st != 201:
            raise RuntimeError(f"upload of {digest}: {st} {body[:200]!r}")
        return digest

    layer = rng.randbytes(BLOB)
    layer_digest = blob(layer)
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers",
                         "diff_ids": [layer_digest]}}).encode()
    config_digest = blob(config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config)},
        "layers": [{"mediaType": OCI_LAYER_GZIP, "digest": layer_digest, "size": BLOB}],
    }).encode()
    st, _, body = http_send("PUT", origin.url(f"/v2/{REPO}/manifests/{TAG}"), manifest,
                            {**auth, "Content-Type": OCI_MANIFEST})
    if st != 201:
        raise RuntimeError(f"manifest PUT: {st} {body[:200]!r}")
    return {"manifest": "sha256:" + sha256_hex(manifest), "manifest_size": len(manifest), "blob": layer_digest}


def start_larder(procs: Procs, binary: Path, d: Path, origin: Server, verify: bool) -> Server:
    d.mkdir(parents=True, exist_ok=True)
    (d / "password").write_text(CLIENT[1])
    upstream = ('client_credentials = "verify"\n' if verify
                else f'username = "{CLIENT[0]}"\npassword_file = "{d / "password"}"\n')
    env = {k: v for k, v in CHILD_ENV.items() if k != "RUST_LOG"}

    def start(port: int) -> Server:
        admin = herd.free_port()
        (d / "larder.toml").write_text(
            f'[server]\nlisten = "{HOST}:{port}"\nadmin_listen = "{HOST}:{admin}"\n'
            f'[cache]\ndir = "{d / "cache"}"\ntag_ttl = "1h"\n'
            f'[[upstream]]\nname = "origin.test"\nurl = "http://{HOST}:{origin.port}"\ndefault = true\n'
            + upstream
        )
        logf = d / "larder.log"
        with open(logf, "ab") as fl:
            p = procs.start([str(binary), "--config", str(d / "larder.toml")], stdout=fl,
                            stderr=subprocess.STDOUT, env=env)
        wait_http(p, f"http://{HOST}:{admin}/healthz", "larder admin", logf)
        return Server("verify" if verify else "plain", p, port, logf, admin)

    return retry_port(start)


def counters(s: Server) -> dict:
    """larder's upstream requests and client checks so far."""
    st, body, _ = http_get(f"http://{HOST}:{s.admin}/metrics", timeout=10)
    out = {"upstream_requests": 0.0, "client_verifications": 0.0}
    for line in body.decode(errors="replace").splitlines():
        m = re.match(r"^larder_(upstream_requests|client_verifications)_total\{[^}]*\}\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] += float(m.group(2))
    return out


def paths(image: dict) -> dict:
    return {"manifest": (f"/v2/{REPO}/manifests/{image['manifest']}", image["manifest_size"]),
            "blob 1 MiB": (f"/v2/{REPO}/blobs/{image['blob']}", BLOB)}


def warm(s: Server, image: dict, headers: dict) -> None:
    for path, _ in paths(image).values():
        st, body, _ = http_get(s.url(path), headers)
        if st != 200:
            raise RuntimeError(f"warm-up of {s.name} {path}: {st} {body[:200]!r}")


def report(runs: list, reps: int) -> str:
    out = ["| request | conns | plain req/s | verify req/s | req/s verify ÷ plain | plain CPU µs/req | "
           "verify CPU µs/req | CPU/req verify ÷ plain |",
           "|---|---|---|---|---|---|---|---|"]
    for kind, conns in POINTS:
        pick = {s: [r for r in runs if (r["kind"], r["conns"], r["server"]) == (kind, conns, s) and r["ok"]]
                for s in SERVERS}
        ratios, cpu_ratios = [], []
        for rep in range(reps):
            by = {s: next((r for r in pick[s] if r["rep"] == rep), None) for s in SERVERS}
            if by["plain"] and by["verify"]:
                ratios.append(by["verify"]["rps"] / by["plain"]["rps"])
                cpu_ratios.append(by["verify"]["server_cpu_us_per_req"] / by["plain"]["server_cpu_us_per_req"])
        rps = {s: summary([r["rps"] for r in pick[s]]) for s in SERVERS}
        cpu = {s: summary([r["server_cpu_us_per_req"] for r in pick[s]]) for s in SERVERS}
        out.append(f"| {kind} | {conns} | {fmt_s(rps['plain'])} | {fmt_s(rps['verify'])} | "
                   f"{fmt_s(summary(ratios), '{:.3f}')} | {fmt_s(cpu['plain'], '{:.1f}')} | "
                   f"{fmt_s(cpu['verify'], '{:.1f}')} | {fmt_s(summary(cpu_ratios), '{:.3f}')} |")
    failed = [r for r in runs if not r["ok"]]
    out.append("")
    out.append(f"{len(runs) - len(failed)} runs ok, {len(failed)} failed"
               + "".join(f"\n  {r['server']} {r['kind']} c{r['conns']} rep {r['rep']}: {r['error']}" for r in failed))
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--duration", type=int, default=5, help="seconds per wrk run")
    p.add_argument("--larder-bin", type=Path, help="a larder binary (default: cargo build --release)")
    p.add_argument("--out", type=Path, help="folder for results.json and report.md")
    p.add_argument("--seed", type=int, default=33)
    args = p.parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, herd._raise_exit)
    for tool in ("docker-registry", "wrk"):
        if load.find_tool(tool) is None:
            log(f"{tool} not found: {load.INSTALL_HINT[tool]}")
            return 2
    try:
        import bcrypt  # noqa: F401
    except ImportError:
        log("the Python package bcrypt is missing: python3 -m pip install bcrypt")
        return 2
    binary = args.larder_bin.resolve() if args.larder_bin else herd.build_larder()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="larder-verify-results-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-verify-"))
    lua = scratch / "report.lua"
    lua.write_text(load.WRK_LUA)
    headers = {"Authorization": basic(*CLIENT), "Accept": OCI_MANIFEST}
    runs: list[dict] = []
    try:
        origin = start_origin(procs, scratch / "origin")
        image = push(origin, args.seed)
        log(f"origin on {HOST}:{origin.port}; {REPO}@{image['manifest']}")
        servers = {s: start_larder(procs, binary, scratch / s, origin, s == "verify") for s in SERVERS}
        for s in servers.values():
            warm(s, image, headers)
        log(f"warm: {', '.join(f'{s.name} on {HOST}:{s.port}' for s in servers.values())}")
        for rep in range(args.reps):
            for kind, conns in POINTS:
                path, size = paths(image)[kind]
                for name in rotate(SERVERS, rep):
                    s = servers[name]
                    before, up0 = counters(s), settled_requests(origin)
                    r = run_wrk(str(load.find_tool("wrk")), lua, s, path, conns, args.duration, headers, size)
                    after, up1 = counters(s), settled_requests(origin)
                    moved = {k: after[k] - before[k] for k in after if after[k] != before[k]}
                    if up1 != up0 or moved:
                        r["ok"] = False
                        r["error"] = f"upstream moved during a warm run: origin +{up1 - up0}, larder {moved}"
                    runs.append({"rep": rep, "kind": kind, "conns": conns, "server": name, **r})
                    log(f"  rep {rep + 1} {kind:<10} c{conns:<2} {name:<6} "
                        + (f"{r['rps']:9.0f} req/s  {r['server_cpu_us_per_req']:6.1f} µs CPU/req" if r["ok"]
                           else f"FAILED {r['error']}"))
    finally:
        for p_ in list(procs.live):
            procs.stop(p_)
    text = report(runs, args.reps) + f"\nload average at the end: {load.loadavg()}"
    (out_dir / "results.json").write_text(json.dumps(runs, indent=1, default=str))
    (out_dir / "report.md").write_text(text + "\n")
    print(text)
    log(f"results in {out_dir}")
    return 0 if all(r["ok"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
