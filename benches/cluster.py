#!/usr/bin/env python3
"""Cluster benchmark: one herd of concurrent cold skopeo pulls, two set-ups.

    single   1 larder replica, no cluster mode, every pull goes to it;
    islands  3 larder replicas, no cluster mode (today's default for a
             StatefulSet), pull i going to replica i % 3;
    cluster  3 larder replicas with [cluster] (each other's peers) and a
             [shared] tier on a real 3-node Garage cluster
             (replication_factor = 3), pull i going to replica i % 3.

All sit in front of the same origin (distribution, filesystem storage).
Each repetition starts cold: fresh larder processes, empty cache dirs and,
for the cluster, a fresh key prefix in the Garage bucket. Per set-up it
reports the origin GETs (blobs, manifests; from the origin's access log),
the herd's wall time, median (min–max) over the repetitions, and the bytes
through each replica from its /metrics: served (to clients and peers),
received from upstream, from peers, from and to the shared tier.

    python3 benches/cluster.py [--reps 3] [--n 30] [--layers 6] [--layer-mib 4]

Needs docker-registry, skopeo and Garage 2.x ($LARDER_TEST_GARAGE, else
~/.cache/larder-tests/garage-2.5.0-lmdb-o1/bin/garage, as tests/run.sh installs it).
Builds larder with `cargo build --release --locked` unless --larder-bin is
given. Everything listens on 127.0.0.1 only; every process it starts is
stopped when it ends. See benches/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import herd  # noqa: E402  (the image, origin, process and pull helpers)
from herd import CHILD_ENV, HOST, HTTP, IMAGE_REPO, TAG, Procs, free_port, log, tail  # noqa: E402

GARAGE_VERSION = "2.5.0"
GARAGE_FOLDER = "garage-2.5.0-lmdb-o1"  # as tests/run.sh installs it
GARAGE_REGION = "garage"
GARAGE_BUCKET = "larder-bench"
GARAGE_READY_TIMEOUT = 60.0
REPLICAS = 3
# How long to wait for the replicas to finish uploading to the shared tier
# after a herd (only so the upload byte counts are complete; not timed).
UPLOAD_SETTLE_TIMEOUT = 120.0
SETUPS = ("single", "islands", "cluster")
SETUP_LABEL = {
    "single": "1 replica, no cluster mode",
    "islands": "3 replicas, no cluster mode",
    "cluster": "3 replicas, cluster + 3-node Garage",
}
METRIC_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def garage_binary() -> Path:
    env = os.environ.get("LARDER_TEST_GARAGE")
    if env:
        return Path(env)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    installed = cache / f"larder-tests/{GARAGE_FOLDER}/bin/garage"
    if installed.is_file():
        return installed
    found = shutil.which("garage")
    if found:
        return Path(found)
    raise RuntimeError(f"Garage not found: set LARDER_TEST_GARAGE or run tests/run.sh (installs {installed})")


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# ----------------------------------------------------------------------------
# Garage: 3 nodes on 127.0.0.1, as tests/common/garage.rs sets them up.
# ----------------------------------------------------------------------------

class Garage:
    def __init__(self, procs: Procs, root: Path) -> None:
        self.procs, self.root, self.bin = procs, root, garage_binary()
        self.key_id = "GK" + secrets.token_hex(12)
        self.secret = secrets.token_hex(32)
        rpc_secret = secrets.token_hex(32)
        self.nodes = []
        for i in range(3):
            d = root / f"node{i}"
            (d / "meta").mkdir(parents=True)
            (d / "data").mkdir()
            s3, rpc, admin = free_port(), free_port(), free_port()
            cfg = d / "garage.toml"
            write_private(cfg, (
                f'metadata_dir = "{d / "meta"}"\ndata_dir = "{d / "data"}"\n'
                'db_engine = "lmdb"\nmetadata_fsync = false\ndata_fsync = false\nreplication_factor = 3\n'
                f'rpc_bind_addr = "{HOST}:{rpc}"\nrpc_public_addr = "{HOST}:{rpc}"\nrpc_secret = "{rpc_secret}"\n'
                f'\n[s3_api]\ns3_region = "{GARAGE_REGION}"\napi_bind_addr = "{HOST}:{s3}"\n'
                f'\n[admin]\napi_bind_addr = "{HOST}:{admin}"\n'
            ))
            self.nodes.append({"cfg": cfg, "s3": s3, "admin": admin, "log": d / "garage.log", "id": ""})

    def endpoint(self) -> str:
        return f"http://{HOST}:{self.nodes[0]['s3']}"

    def cli(self, i: int, *args: str) -> str:
        deadline = time.monotonic() + GARAGE_READY_TIMEOUT
        while True:
            r = subprocess.run([str(self.bin), "-c", str(self.nodes[i]["cfg"]), *args], capture_output=True,
                               text=True, env=dict(CHILD_ENV, NO_COLOR="1"), timeout=30)
            if r.returncode == 0:
                return r.stdout
            if time.monotonic() > deadline:
                raise RuntimeError(f"`garage {' '.join(args)}` kept failing: {r.stderr}\n{tail(self.nodes[i]['log'])}")
            time.sleep(0.1)

    def start(self) -> None:
        started = time.monotonic()
        for n in self.nodes:
            with open(n["log"], "wb") as f:
                self.procs.start([str(self.bin), "-c", str(n["cfg"]), "server"], stdout=f, stderr=subprocess.STDOUT,
                                 env=dict(CHILD_ENV, RUST_LOG="garage=warn", NO_COLOR="1"))
        for i, n in enumerate(self.nodes):
            n["id"] = self.cli(i, "node", "id", "-q").strip()
        for n in self.nodes[1:]:
            self.cli(0, "node", "connect", n["id"])
        for i, n in enumerate(self.nodes):
            self.cli(0, "layout", "assign", "-z", f"z{i + 1}", "-c", "1G", n["id"].split("@")[0])
        self.cli(0, "layout", "apply", "--version", "1")
        self.cli(0, "bucket", "create", GARAGE_BUCKET)
        self.cli(0, "key", "import", "--yes", "-n", "larder", self.key_id, self.secret)
        self.cli(0, "bucket", "allow", "--read", "--write", "--owner", GARAGE_BUCKET, "--key", "larder")
        for n in self.nodes:
            url = f"http://{HOST}:{n['admin']}/health"
            deadline = time.monotonic() + GARAGE_READY_TIMEOUT
            while herd.http_status(url) != 200:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"garage node not healthy: {url}\n{tail(n['log'])}")
                time.sleep(0.1)
        log(f"garage: 3-node cluster ready in {time.monotonic() - started:.1f}s, S3 on {self.endpoint()}")


# ----------------------------------------------------------------------------
# larder replicas
# ----------------------------------------------------------------------------

class Replica:
    def __init__(self, d: Path, port: int, admin: int, peer: int | None) -> None:
        self.dir, self.port, self.admin, self.peer = d, port, admin, peer
        self.proc: subprocess.Popen | None = None

    def metrics(self) -> dict[str, float]:
        with HTTP.open(urllib.request.Request(f"http://{HOST}:{self.admin}/metrics"), timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            m = METRIC_RE.match(line)
            if m and not line.startswith("#"):
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
        return out


def metric_sum(ms: dict[str, float], name: str, label: str = "") -> float:
    return sum(v for k, v in ms.items() if (k == name or k.startswith(name + "{")) and label in k)


def start_replicas(procs: Procs, binary: Path, d: Path, origin_port: int, n: int, cluster: bool,
                   shared: str | None) -> list[Replica]:
    replicas = [Replica(d / f"replica{i}", free_port(), free_port(), free_port() if cluster else None)
                for i in range(n)]
    d.mkdir(parents=True, exist_ok=True)
    secret_file = d / "cluster-secret"
    write_private(secret_file, secrets.token_hex(16))
    peers = ", ".join(f'"http://{HOST}:{r.peer}"' for r in replicas if r.peer)
    env = dict(CHILD_ENV, RUST_LOG="larder=warn")
    for r in replicas:
        r.dir.mkdir(parents=True)
        cfg = (
            f'[server]\nlisten = "{HOST}:{r.port}"\nadmin_listen = "{HOST}:{r.admin}"\n'
            f'[cache]\ndir = "{r.dir / "cache"}"\n'
            f'[[upstream]]\nname = "origin.test"\nurl = "http://{HOST}:{origin_port}"\ndefault = true\n'
        )
        if r.peer is not None:
            cfg += (f'[cluster]\nlisten = "{HOST}:{r.peer}"\nself = "http://{HOST}:{r.peer}"\n'
                    f'peers = [{peers}]\nsecret_file = "{secret_file}"\n')
        if shared is not None:
            cfg += shared
        (r.dir / "larder.toml").write_text(cfg)
        logf = r.dir / "larder.log"
        with open(logf, "wb") as fl:
            r.proc = procs.start([str(binary), "--config", str(r.dir / "larder.toml")], stdout=fl,
                                 stderr=subprocess.STDOUT, env=env)
    for r in replicas:
        herd.wait_ready(r.proc, r.port, f"larder {r.dir.name}", r.dir / "larder.log")
    return replicas


def uploads_settled(replicas: list[Replica]) -> bool:
    deadline = time.monotonic() + UPLOAD_SETTLE_TIMEOUT
    while time.monotonic() < deadline:
        if sum(metric_sum(r.metrics(), "larder_pending_uploads") for r in replicas) == 0:
            return True
        time.sleep(0.2)
    return False


def run_spread_herd(procs: Procs, replicas: list[Replica], n: int, work: Path, expect: str,
                    timeout: float) -> tuple[float, int]:
    """n concurrent `skopeo copy`, pull i from replica i % len(replicas); (wall seconds, failed pulls)."""
    work.mkdir(parents=True)
    popens, logs = [], []
    t0 = time.monotonic()
    try:
        for i in range(n):
            r = replicas[i % len(replicas)]
            logs.append(work / f"client-{i}.log")
            with open(logs[-1], "wb") as lf:
                popens.append(procs.start(
                    ["skopeo", "copy", "--src-tls-verify=false", f"docker://{HOST}:{r.port}/{IMAGE_REPO}:{TAG}",
                     f"dir:{work / f'client-{i}'}"], stdout=lf, stderr=subprocess.STDOUT))
        deadline = t0 + timeout
        for p in popens:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        wall = time.monotonic() - t0
    finally:
        for p in popens:
            procs.stop(p, grace=2.0)
    failed = 0
    for i, p in enumerate(popens):
        ok = p.returncode == 0
        if ok:
            got = "sha256:" + herd.sha256_hex((work / f"client-{i}" / "manifest.json").read_bytes())
            ok = got == expect
        if not ok:
            failed += 1
            if failed <= 3:
                log(f"    pull {i} failed (rc {p.returncode}): {tail(logs[i], 3)}")
    shutil.rmtree(work, ignore_errors=True)
    return wall, failed


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------

def med(xs: list[float], fmt: str = "{:g}") -> str:
    if not xs:
        return "–"
    m, lo, hi = statistics.median(xs), min(xs), max(xs)
    return fmt.format(m) if lo == hi else f"{fmt.format(m)} ({fmt.format(lo)}–{fmt.format(hi)})"


def report(results: list[dict], args, image: herd.Image) -> str:
    mib = "{:.1f}".format
    lines = [
        f"image: {args.layers} layers × {args.layer_mib:g} MiB + config = {image.blobs} blobs, "
        f"{image.blob_bytes / 2**20:.1f} MiB; {args.n} concurrent cold skopeo pulls per herd; "
        f"{args.reps} reps per set-up; median (min–max)",
        "",
        "| set-up | wall (s) | origin blob GETs | origin manifest GETs | origin blob MiB | failed pulls |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for setup in SETUPS:
        rs = [r for r in results if r["setup"] == setup]
        if not rs:
            continue
        lines.append(
            f"| {SETUP_LABEL[setup]} | {med([r['wall'] for r in rs], '{:.2f}')} "
            f"| {med([r['origin']['blob_gets'] for r in rs])} | {med([r['origin']['manifest_gets'] for r in rs])} "
            f"| {med([r['origin']['blob_get_bytes'] / 2**20 for r in rs], '{:.1f}')} "
            f"| {sum(r['failed'] for r in rs)}/{args.n * len(rs)} |")
    lines += ["", "MiB through each replica per herd (median over reps): served = to clients and peers; "
              "upstream, peers, shared = received from; shared up = uploaded", "",
              "| set-up | replica | served | from upstream | from peers | from shared | shared up |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for setup in SETUPS:
        rs = [r for r in results if r["setup"] == setup]
        if not rs:
            continue
        for i in range(len(rs[0]["replicas"])):
            col = {k: [r["replicas"][i][k] / 2**20 for r in rs] for k in rs[0]["replicas"][i]}
            lines.append(f"| {SETUP_LABEL[setup]} | {i} | {mib(statistics.median(col['served']))} "
                         f"| {mib(statistics.median(col['upstream']))} | {mib(statistics.median(col['peers']))} "
                         f"| {mib(statistics.median(col['shared_down']))} | {mib(statistics.median(col['shared_up']))} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per set-up; default 3")
    ap.add_argument("--n", type=int, default=30, help="concurrent pulls per herd; default 30")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--layer-mib", type=float, default=4.0)
    ap.add_argument("--larder-bin", type=Path, default=None, help="skip the release build, use this binary")
    ap.add_argument("--herd-timeout", type=float, default=300.0, help="seconds before a herd's pulls are killed")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default: a new temp dir)")
    ap.add_argument("--seed", type=int, default=20240601)
    args = ap.parse_args()
    if args.reps < 1 or args.n < 1 or args.layers < 1 or args.layer_mib <= 0:
        ap.error("--reps, --n, --layers and --layer-mib must be positive")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, herd._raise_exit)
    for tool in ("docker-registry", "skopeo"):
        if shutil.which(tool) is None:
            log(f"{tool} not found")
            return 2
    binary = args.larder_bin.resolve() if args.larder_bin else herd.build_larder()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="larder-cluster-results-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = herd.machine_info()
    log(herd.machine_line(machine))

    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-cluster-bench-"))
    results: list[dict] = []
    try:
        _, origin_port, origin_log = herd.start_distribution(procs, scratch / "origin", "origin", None)
        access = herd.AccessLog(origin_log)
        ours, blobs, blob_bytes = herd.build_oci_layout(scratch / "oci", args.layers, args.layer_mib, args.seed)
        push = subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{scratch / 'oci'}:{TAG}",
                               f"docker://{HOST}:{origin_port}/{IMAGE_REPO}:{TAG}"],
                              capture_output=True, text=True, env=CHILD_ENV, timeout=300)
        if push.returncode != 0:
            raise RuntimeError(f"pushing the test image failed:\n{push.stderr}")
        image = herd.Image(scratch / "oci", herd.origin_manifest_digest(origin_port), blobs, blob_bytes)
        log(f"image {IMAGE_REPO}:{TAG} = {image.manifest_digest}, {blobs} blobs, {blob_bytes / 2**20:.1f} MiB")

        garage = Garage(procs, scratch / "garage")
        garage.start()
        keys = scratch / "s3-keys"
        keys.mkdir()
        write_private(keys / "id", garage.key_id)
        write_private(keys / "secret", garage.secret)

        for rep in range(args.reps):
            # Rotate the order so slow drifts in machine load do not always hit the same set-up.
            order = SETUPS[rep % len(SETUPS):] + SETUPS[: rep % len(SETUPS)]
            for setup in order:
                d = scratch / f"{setup}-r{rep}"
                shared = None
                if setup == "cluster":
                    shared = (f'[shared]\nurl = "s3://{GARAGE_BUCKET}/rep{rep}"\nendpoint = "{garage.endpoint()}"\n'
                              f'region = "{GARAGE_REGION}"\naccess_key_id_file = "{keys / "id"}"\n'
                              f'secret_access_key_file = "{keys / "secret"}"\n')
                n = 1 if setup == "single" else REPLICAS
                replicas = start_replicas(procs, binary, d, origin_port, n, setup == "cluster", shared)
                try:
                    mark = access.mark()
                    wall, failed = run_spread_herd(procs, replicas, args.n, d / "pulls", image.manifest_digest,
                                                   args.herd_timeout)
                    origin = access.count_since(mark)
                    if shared is not None and not uploads_settled(replicas):
                        log(f"warning: uploads still pending after {UPLOAD_SETTLE_TIMEOUT:.0f}s")
                    per_replica = []
                    for r in replicas:
                        ms = r.metrics()
                        per_replica.append({
                            "served": metric_sum(ms, "larder_bytes_served_total"),
                            "upstream": metric_sum(ms, "larder_upstream_bytes_total"),
                            "peers": metric_sum(ms, "larder_peer_bytes_total"),
                            "shared_down": metric_sum(ms, "larder_shared_bytes_total", 'direction="download"'),
                            "shared_up": metric_sum(ms, "larder_shared_bytes_total", 'direction="upload"'),
                        })
                finally:
                    for r in replicas:
                        procs.stop(r.proc)
                results.append({"setup": setup, "rep": rep, "wall": wall, "failed": failed, "origin": origin,
                                "replicas": per_replica})
                log(f"rep {rep + 1}/{args.reps} {setup:<8} wall {wall:6.2f}s  origin blob GETs "
                    f"{origin['blob_gets']}  manifest GETs {origin['manifest_gets']}  failed {failed}/{args.n}")
                if failed:
                    kept = out_dir / "failed" / d.name
                    kept.mkdir(parents=True, exist_ok=True)
                    for f in d.glob("*/larder.log"):
                        shutil.copy(f, kept / f"{f.parent.name}.log")
                shutil.rmtree(d, ignore_errors=True)
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)

    md = f"{herd.machine_line(machine)}\n\n{report(results, args, image)}\n"
    (out_dir / "cluster.json").write_text(json.dumps({"benchmark": "cluster", "machine": machine,
                                                      "params": vars(args) | {"larder_bin": str(binary),
                                                                              "out": str(out_dir)},
                                                      "results": results, "markdown": md}, indent=2))
    (out_dir / "cluster.md").write_text(md)
    print(md)
    log(f"results: {out_dir / 'cluster.json'} and {out_dir / 'cluster.md'}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; all processes and scratch dirs were cleaned up")
        sys.exit(130)
