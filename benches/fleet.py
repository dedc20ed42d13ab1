#!/usr/bin/env python3
"""Fleet benchmark: N node-mode larders behind one hub pull one new image at once.

Set-ups, all in front of the same origin (CNCF distribution, filesystem
storage, access log on), one cold herd per (set-up, N, repetition):

    direct   reference: N clients pull the image straight from the origin
    hub      1 hub larder; N node larders whose upstream has `via` = the hub
    cluster  3 hub replicas with [cluster] and [shared] on a 3-node Garage;
             node i's `via` is replica i % 3

Each node is a separate larder process (its own port and cache dir, a small
memory tier) with one client in front of it. At the start signal every
client fetches the manifest by tag and then every blob (3 at a time, as
containerd does), checking each digest; a node "has the image" when its
client verified the last blob. Every hub and node is fresh (new process,
empty cache) in each herd, so the hub fetches from the origin and the nodes
from the hub while they are all asking.

Reported per (set-up, N): time until all N had the image and until half
did, the hubs' CPU (from /proc/PID/stat) per byte delivered to the nodes and
as cores, the hubs' peak memory (VmHWM), every node's VmHWM, the origin's
blob requests and blob bytes per blob (from its access log: each blob must
come from the origin exactly once), and the same herd straight from the
origin in the same repetition as the reference.

    python3 benches/fleet.py [--ns 10,30,100] [--reps 3] [--setups direct,hub,cluster]

Needs docker-registry, skopeo (to push the image) and, for `cluster`,
Garage 2.x ($LARDER_TEST_GARAGE, else ~/.cache/larder-tests/garage-2.5.0-lmdb-o1/bin/garage).
Builds larder with `cargo build --release --locked` unless --larder-bin is
given. Everything listens on 127.0.0.1 only; every process it starts is
stopped when it ends (also on Ctrl-C). Not part of CI. See benches/README.md.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cluster  # noqa: E402  (Garage, hub replicas, metrics)
import herd  # noqa: E402  (image, origin, processes, access log)
from herd import CHILD_ENV, HOST, IMAGE_REPO, OCI_MANIFEST, TAG, Procs, free_port, tail  # noqa: E402

SETUPS = ("direct", "hub", "cluster")
SETUP_LABEL = {
    "direct": "direct from the origin (reference)",
    "hub": "1 hub + N nodes",
    "cluster": "3-replica hub (Garage) + N nodes",
}
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Blobs one client fetches at once (containerd's max_concurrent_downloads).
BLOBS_AT_ONCE = 3
# Socket timeout of a client's requests: a stalled node fails its pull.
CLIENT_SOCKET_TIMEOUT = 120.0
# How often the sampler reads every larder's VmRSS during a herd.
SAMPLE_INTERVAL = 0.25
READ_CHUNK = 1 << 20


def log(msg: str) -> None:
    print(f"[fleet {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------
# The client (run as `fleet.py --client`, one process per group of nodes)
# ----------------------------------------------------------------------------

def fetch_verified(port: int, path: str, digest: str, headers: dict[str, str]) -> tuple[bytes | None, int]:
    """GET path; checks the status and that the body hashes to digest. Keeps the body only if small."""
    conn = http.client.HTTPConnection(HOST, port, timeout=CLIENT_SOCKET_TIMEOUT)
    try:
        conn.request("GET", path, headers=headers)
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"GET {path}: {r.status} {r.read(300)!r}")
        h, n, keep = hashlib.sha256(), 0, []
        buf = bytearray(READ_CHUNK)
        mv = memoryview(buf)
        while True:
            k = r.readinto(mv)
            if not k:
                break
            h.update(mv[:k])
            n += k
            if n <= 1 << 20:
                keep.append(bytes(mv[:k]))
        got = "sha256:" + h.hexdigest()
        if digest and got != digest:
            raise RuntimeError(f"GET {path}: body is {got}, expected {digest}")
        return (b"".join(keep) if n <= 1 << 20 else None), n
    finally:
        conn.close()


def pull_one(port: int, manifest_digest: str, go: threading.Event) -> dict:
    go.wait()
    start = time.monotonic()
    res = {"port": port, "start": start, "end": None, "ok": False, "bytes": 0, "error": ""}
    try:
        body, n = fetch_verified(port, f"/v2/{IMAGE_REPO}/manifests/{TAG}", manifest_digest,
                                 {"Accept": OCI_MANIFEST})
        res["bytes"] += n
        m = json.loads(body)
        blobs = [m["config"]] + m["layers"]
        with ThreadPoolExecutor(max_workers=BLOBS_AT_ONCE) as ex:
            for _, n in ex.map(lambda d: fetch_verified(port, f"/v2/{IMAGE_REPO}/blobs/{d['digest']}",
                                                          d["digest"], {}), blobs):
                res["bytes"] += n
        res["ok"] = True
    except Exception as e:  # noqa: BLE001  (any failure is this node's failed pull, reported)
        res["error"] = f"{type(e).__name__}: {e}"[:500]
    res["end"] = time.monotonic()
    return res


def client_main() -> int:
    job = json.loads(sys.stdin.readline())
    go = threading.Event()
    results: list[dict | None] = [None] * len(job["ports"])

    def run(i: int) -> None:
        results[i] = pull_one(job["ports"][i], job["manifest_digest"], go)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(job["ports"]))]
    for t in threads:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()  # the start signal
    go.set()
    for t in threads:
        t.join()
    t = os.times()
    print(json.dumps({"results": results, "cpu": t.user + t.system}), flush=True)
    return 0


# ----------------------------------------------------------------------------
# /proc readings
# ----------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads), in seconds."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of stat(5)


def status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def machine_busy() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = v[3] + v[4]
    return sum(v) - idle, sum(v)


class RssSampler:
    """Peak of the summed VmRSS of a set of processes, sampled during a herd."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups, self.peak = groups, {k: 0 for k in groups}
        self.stop_ev = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        while not self.stop_ev.is_set():
            for k, pids in self.groups.items():
                self.peak[k] = max(self.peak[k], sum(status_kib(p, "VmRSS") for p in pids))
            self.stop_ev.wait(SAMPLE_INTERVAL)

    def __enter__(self) -> RssSampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop_ev.set()
        self.thread.join()


# ----------------------------------------------------------------------------
# Larders
# ----------------------------------------------------------------------------

def stop_many(procs: Procs, ps: list[subprocess.Popen]) -> None:
    """SIGTERM all at once, then wait (stopping 100 one by one would take 100 grace periods)."""
    for p in ps:
        if p.poll() is None:
            procs._signal_group(p, signal.SIGTERM)
    for p in ps:
        procs.stop(p, grace=10.0)


def start_nodes(procs: Procs, binary: Path, d: Path, origin_port: int, hubs: list[int], n: int,
                memory: str) -> list[tuple[subprocess.Popen, int]]:
    env = dict(CHILD_ENV, RUST_LOG="larder=warn")
    nodes = []
    for i in range(n):
        nd = d / f"node{i}"
        nd.mkdir(parents=True)
        port = free_port()
        (nd / "larder.toml").write_text(
            f'[server]\nlisten = "{HOST}:{port}"\n'
            f'[cache]\ndir = "{nd / "cache"}"\nmemory = "{memory}"\nmax_size = "1GiB"\n'
            f'[[upstream]]\nname = "origin.test"\nurl = "http://{HOST}:{origin_port}"\n'
            f'via = "http://{HOST}:{hubs[i % len(hubs)]}"\ndefault = true\n')
        with open(nd / "larder.log", "wb") as fl:
            p = procs.start([str(binary), "--config", str(nd / "larder.toml")], stdout=fl,
                            stderr=subprocess.STDOUT, env=env)
        nodes.append((p, port))
    for i, (p, port) in enumerate(nodes):
        herd.wait_ready(p, port, f"node {i}", d / f"node{i}" / "larder.log", timeout=60.0)
    return nodes


# ----------------------------------------------------------------------------
# One herd
# ----------------------------------------------------------------------------

def run_clients(procs: Procs, ports: list[int], manifest_digest: str, groups: int, timeout: float,
                script: Path) -> tuple[float, float, list[dict], float]:
    """Start the clients, release them at once; (t0, wall, per-node results, client CPU s)."""
    chunks = [ports[i::groups] for i in range(min(groups, len(ports)))]
    ps = []
    try:
        for c in chunks:
            p = subprocess.Popen([sys.executable, str(script), "--client"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=CHILD_ENV, start_new_session=True)
            with procs.lock:
                procs.live.append(p)
            p.stdin.write(json.dumps({"ports": c, "manifest_digest": manifest_digest}) + "\n")
            p.stdin.flush()
            ps.append(p)
        for p in ps:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a client process did not get ready")
        t0 = time.monotonic()
        for p in ps:
            p.stdin.write("go\n")
            p.stdin.flush()
        results, cpu = [], 0.0
        killer = threading.Timer(timeout, lambda: [procs._signal_group(p, signal.SIGKILL) for p in ps])
        killer.start()
        try:
            for p in ps:
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"a client process died or was killed after {timeout:.0f}s")
                out = json.loads(line)
                results += out["results"]
                cpu += out["cpu"]
        finally:
            killer.cancel()
        wall = max(r["end"] for r in results) - t0
        return t0, wall, results, cpu
    finally:
        for p in ps:
            procs.stop(p, grace=2.0)


def origin_blobs(access: herd.AccessLog, mark: int) -> dict:
    """Blob GET requests and bytes per digest since mark."""
    access.wait_quiet()
    per: dict[str, dict] = {}
    manifest_gets = 0
    for line in access.lines()[mark:]:
        m = herd.ACCESS_RE.match(line)
        if not m:
            continue
        method, uri, status, size = m.groups()
        if method != b"GET":
            continue
        if herd.BLOB_PATH_RE.match(uri):
            digest = uri.split(b"/blobs/")[1].split(b"?")[0].decode()
            e = per.setdefault(digest, {"gets": 0, "bytes": 0})
            e["gets"] += 1
            e["bytes"] += 0 if size == b"-" else int(size)
        elif herd.MANIFEST_PATH_RE.match(uri):
            manifest_gets += 1
    return {"per_blob": per, "manifest_gets": manifest_gets}


def herd_once(procs: Procs, args, binary: Path, setup: str, n: int, rep: int, scratch: Path, origin: dict,
              image: dict, garage: cluster.Garage | None, keys: Path | None) -> dict:
    d = scratch / f"{setup}-n{n}-r{rep}"
    hubs: list[cluster.Replica] = []
    nodes: list[tuple[subprocess.Popen, int]] = []
    try:
        if setup == "direct":
            ports = [origin["port"]] * n
            measured = {"origin": [origin["proc"].pid]}
        else:
            shared = None
            if setup == "cluster":
                shared = (f'[shared]\nurl = "s3://{cluster.GARAGE_BUCKET}/{d.name}"\n'
                          f'endpoint = "{garage.endpoint()}"\nregion = "{cluster.GARAGE_REGION}"\n'
                          f'access_key_id_file = "{keys / "id"}"\nsecret_access_key_file = "{keys / "secret"}"\n')
            hubs = cluster.start_replicas(procs, binary, d / "hub", origin["port"], 3 if setup == "cluster" else 1,
                                          setup == "cluster", shared)
            nodes = start_nodes(procs, binary, d / "nodes", origin["port"], [h.port for h in hubs], n,
                                args.node_memory)
            ports = [port for _, port in nodes]
            measured = {"hub": [h.proc.pid for h in hubs], "nodes": [p.pid for p, _ in nodes]}
        served_before = sum(cluster.metric_sum(h.metrics(), "larder_bytes_served_total") for h in hubs)
        mark = origin["access"].mark()
        cpu0 = {k: sum(cpu_seconds(p) for p in pids) for k, pids in measured.items()}
        busy0 = machine_busy()
        with RssSampler(measured) as sampler:
            t0, wall, results, client_cpu = run_clients(procs, ports, image["manifest_digest"], args.client_procs,
                                                        args.herd_timeout, Path(__file__).resolve())
        busy1 = machine_busy()
        cpu_at_done = {k: sum(cpu_seconds(p) for p in pids) - cpu0[k] for k, pids in measured.items()}
        settled = True
        if setup == "cluster":
            settled = cluster.uploads_settled(hubs)  # the shared tier's uploads belong to the hub's cost
        cpu = {k: sum(cpu_seconds(p) for p in pids) - cpu0[k] for k, pids in measured.items()}
        origin_seen = origin_blobs(origin["access"], mark)
        served = sum(cluster.metric_sum(h.metrics(), "larder_bytes_served_total") for h in hubs) - served_before
        hwm = {k: [status_kib(p, "VmHWM") for p in pids] for k, pids in measured.items()}
        done = sorted(r["end"] - t0 for r in results if r["ok"])
        failed = [r for r in results if not r["ok"]]
        for r in failed[:3]:
            log(f"    node on port {r['port']} failed: {r['error']}")
        out = {
            "setup": setup, "n": n, "rep": rep, "wall": wall,
            "p50": statistics.median(done) if done else None,
            "done_times": done, "failed": len(failed), "errors": [r["error"] for r in failed[:10]],
            "bytes_to_clients": sum(r["bytes"] for r in results),
            "cpu": cpu, "cpu_at_done": cpu_at_done, "client_cpu": client_cpu,
            "machine_busy_cores": (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1]) * os.cpu_count(),
            "hwm_kib": hwm, "peak_rss_sum_kib": sampler.peak, "hub_served_bytes": served,
            "origin": origin_seen, "uploads_settled": settled,
        }
        if failed:
            kept = args.out / "failed" / d.name
            kept.mkdir(parents=True, exist_ok=True)
            for f in list(d.glob("hub/*/larder.log")) + list(d.glob("nodes/*/larder.log")):
                shutil.copy(f, kept / f"{f.parent.parent.name}-{f.parent.name}.log")
        return out
    finally:
        stop_many(procs, [p for p, _ in nodes] + [h.proc for h in hubs if h.proc])
        shutil.rmtree(d, ignore_errors=True)


# ----------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------

def mr(xs: list[float], fmt: str) -> str:
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    m, lo, hi = statistics.median(xs), min(xs), max(xs)
    if fmt.format(lo) == fmt.format(hi):
        return fmt.format(m)
    return f"{fmt.format(m)} ({fmt.format(lo)}–{fmt.format(hi)})"


def report(results: list[dict], args, image: dict) -> str:
    gb = image["blob_bytes"] / 1e9
    lines = [
        f"image: {image['blobs']} blobs ({image['layers']} layers + config), {image['blob_bytes'] / 2**20:.1f} MiB; "
        f"nodes: cache.memory = {args.node_memory}; {BLOBS_AT_ONCE} blobs at once per client; "
        f"median (min–max) over {args.reps} reps",
        "",
        "| set-up | N | all N have it (s) | half have it (s) | ÷ direct, same rep | delivered GB/s | "
        "hub CPU s | hub CPU ms per GB delivered | hub cores | hub VmHWM MiB | node VmHWM MiB median / max | "
        "nodes' RSS sum peak MiB | origin blob GET requests (ranged parts) | origin bytes per blob (× size) | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for n in args.ns:
        for setup in args.setups:
            rs = [r for r in results if r["setup"] == setup and r["n"] == n]
            if not rs:
                continue
            ratio = []
            for r in rs:
                ref = [x for x in results if x["setup"] == "direct" and x["n"] == n and x["rep"] == r["rep"]]
                if ref and setup != "direct":
                    ratio.append(r["wall"] / ref[0]["wall"])
            who = "origin" if setup == "direct" else "hub"
            per_gb = [r["cpu"][who] / (n * gb) * 1000 for r in rs]
            cores = [r["cpu_at_done"][who] / r["wall"] for r in rs]
            hwm = [max(r["hwm_kib"][who]) / 1024 for r in rs]
            if setup == "direct":
                node_hwm, rss_sum = "–", "–"
            else:
                node_hwm = (f"{mr([statistics.median(r['hwm_kib']['nodes']) / 1024 for r in rs], '{:.1f}')} / "
                            f"{mr([max(r['hwm_kib']['nodes']) / 1024 for r in rs], '{:.1f}')}")
                rss_sum = mr([r["peak_rss_sum_kib"]["nodes"] / 1024 for r in rs], "{:.0f}")
            reqs = [sum(b["gets"] for b in r["origin"]["per_blob"].values()) for r in rs]
            per_blob = [b["bytes"] / image["sizes"].get(dg, 1) for r in rs for dg, b in r["origin"]["per_blob"].items()]
            missing = sum(image["blobs"] - len(r["origin"]["per_blob"]) for r in rs)
            pb = "–" if not per_blob else (f"{min(per_blob):.2f}–{max(per_blob):.2f}"
                                          + (f", {missing} never fetched" if missing else ""))
            lines.append(
                f"| {SETUP_LABEL[setup]} | {n} | {mr([r['wall'] for r in rs], '{:.2f}')} "
                f"| {mr([r['p50'] for r in rs], '{:.2f}')} | {mr(ratio, '{:.2f}')} "
                f"| {mr([n * gb / r['wall'] for r in rs], '{:.2f}')} "
                f"| {mr([r['cpu'][who] for r in rs], '{:.1f}')} | {mr(per_gb, '{:.0f}')} | {mr(cores, '{:.2f}')} "
                f"| {mr(hwm, '{:.1f}')} | {node_hwm} | {rss_sum} | {mr(reqs, '{:.0f}')} | {pb} "
                f"| {sum(r['failed'] for r in rs)}/{n * len(rs)} |")
    lines += ["", "Where the CPU went (seconds per herd, median): hub(s) or origin, all nodes together, "
              "the clients; and the machine's busy cores over the herd", "",
              "| set-up | N | hub / origin | nodes | clients | machine busy cores |", "|---|---:|---:|---:|---:|---:|"]
    for n in args.ns:
        for setup in args.setups:
            rs = [r for r in results if r["setup"] == setup and r["n"] == n]
            if not rs:
                continue
            who = "origin" if setup == "direct" else "hub"
            nodes = "–" if setup == "direct" else mr([r["cpu"]["nodes"] for r in rs], "{:.1f}")
            lines.append(f"| {SETUP_LABEL[setup]} | {n} | {mr([r['cpu'][who] for r in rs], '{:.1f}')} | {nodes} "
                         f"| {mr([r['client_cpu'] for r in rs], '{:.1f}')} "
                         f"| {mr([r['machine_busy_cores'] for r in rs], '{:.2f}')} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def push_image(scratch: Path, origin_port: int, layers: int, image_mib: float, seed: int) -> dict:
    layout = scratch / "oci"
    _, blobs, blob_bytes = herd.build_oci_layout(layout, layers, image_mib / layers, seed)
    push = subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:{TAG}",
                           f"docker://{HOST}:{origin_port}/{IMAGE_REPO}:{TAG}"],
                          capture_output=True, text=True, env=CHILD_ENV, timeout=600)
    if push.returncode != 0:
        raise RuntimeError(f"pushing the test image failed:\n{push.stderr}")
    sizes = {"sha256:" + f.name: f.stat().st_size for f in (layout / "blobs" / "sha256").iterdir()}
    shutil.rmtree(layout)
    return {"manifest_digest": herd.origin_manifest_digest(origin_port), "blobs": blobs, "layers": layers,
            "blob_bytes": blob_bytes, "sizes": sizes}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ns", default="10,30,100", help="node counts, comma-separated; default 10,30,100")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every (set-up, N); default 3")
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help=f"comma-separated subset of {','.join(SETUPS)}; default all (direct is the reference)")
    ap.add_argument("--image-mib", type=float, default=256.0, help="image size (layers' payload); default 256")
    ap.add_argument("--layers", type=int, default=8, help="layers, equal sizes; default 8 (32 MiB each)")
    ap.add_argument("--node-memory", default="8MiB", help="each node's cache.memory; default 8MiB")
    ap.add_argument("--client-procs", type=int, default=4,
                    help="client processes the N clients are spread over (threads inside); default 4")
    ap.add_argument("--larder-bin", type=Path, default=None, help="skip the release build, use this binary")
    ap.add_argument("--herd-timeout", type=float, default=900.0, help="seconds before a herd's clients are killed")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default: a new temp dir)")
    ap.add_argument("--seed", type=int, default=20261205)
    ap.add_argument("--report", type=Path, default=None,
                    help="print the tables of an earlier run's fleet.json (written after every herd) and exit")
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # internal: the client process
    args = ap.parse_args()
    if args.client:
        return args
    try:
        args.ns = [int(x) for x in args.ns.split(",") if x]
    except ValueError:
        ap.error("--ns takes integers, e.g. 10,30,100")
    args.setups = [s for s in args.setups.split(",") if s]
    if not args.ns or min(args.ns) < 1 or args.reps < 1 or args.layers < 1 or args.image_mib <= 0 \
            or args.client_procs < 1:
        ap.error("--ns, --reps, --layers, --image-mib and --client-procs must be positive")
    if not args.setups or any(s not in SETUPS for s in args.setups):
        ap.error(f"--setups takes a subset of {','.join(SETUPS)}")
    return args


def main() -> int:
    args = parse_args()
    if args.client:
        return client_main()
    if args.report:
        saved = json.loads(args.report.read_text())
        for k in ("ns", "setups", "reps", "node_memory"):
            setattr(args, k, saved["params"][k])
        args.reps = max(r["rep"] for r in saved["results"]) + 1
        print(f"{herd.machine_line(saved['machine'])}\n\n{report(saved['results'], args, saved['image'])}")
        return 0
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, herd._raise_exit)
    for tool in ("docker-registry", "skopeo"):
        if shutil.which(tool) is None:
            log(f"{tool} not found (apt-get install docker-registry skopeo)")
            return 2
    binary = args.larder_bin.resolve() if args.larder_bin else herd.build_larder()
    args.out = args.out or Path(tempfile.mkdtemp(prefix="larder-fleet-results-"))
    args.out.mkdir(parents=True, exist_ok=True)
    machine = herd.machine_info()
    log(herd.machine_line(machine))

    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-fleet-bench-"))
    results: list[dict] = []
    try:
        proc, port, access_log = herd.start_distribution(procs, scratch / "origin", "origin", None)
        origin = {"proc": proc, "port": port, "access": herd.AccessLog(access_log)}
        image = push_image(scratch, port, args.layers, args.image_mib, args.seed)
        log(f"image {IMAGE_REPO}:{TAG} = {image['manifest_digest']}, {image['blobs']} blobs, "
            f"{image['blob_bytes'] / 2**20:.1f} MiB")
        garage, keys = None, None
        if "cluster" in args.setups:
            garage = cluster.Garage(procs, scratch / "garage")
            garage.start()
            keys = scratch / "s3-keys"
            keys.mkdir()
            cluster.write_private(keys / "id", garage.key_id)
            cluster.write_private(keys / "secret", garage.secret)
        for rep in range(args.reps):
            for n in args.ns:
                order = args.setups[rep % len(args.setups):] + args.setups[: rep % len(args.setups)]
                for setup in order:
                    r = herd_once(procs, args, binary, setup, n, rep, scratch, origin, image, garage, keys)
                    results.append(r)
                    who = "origin" if setup == "direct" else "hub"
                    reqs = sum(b["gets"] for b in r["origin"]["per_blob"].values())
                    log(f"rep {rep + 1}/{args.reps} N={n:<4} {setup:<8} all {r['wall']:7.2f}s  "
                        f"half {r['p50'] or 0:6.2f}s  {who} CPU {r['cpu'][who]:6.1f}s  "
                        f"{who} HWM {max(r['hwm_kib'][who]) / 1024:6.1f} MiB  origin blob GETs {reqs}  "
                        f"machine {r['machine_busy_cores']:.2f} cores  failed {r['failed']}/{n}")
                    (args.out / "fleet.json").write_text(json.dumps(
                        {"benchmark": "fleet", "machine": machine, "image": image,
                         "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                         | {"larder_bin": str(binary)}, "results": results}, indent=1))
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)

    md = f"{herd.machine_line(machine)}\n\n{report(results, args, image)}\n"
    (args.out / "fleet.md").write_text(md)
    print(md)
    log(f"results: {args.out / 'fleet.json'} and {args.out / 'fleet.md'}")
    return 1 if any(r["failed"] for r in results) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; all processes and scratch dirs were cleaned up")
        sys.exit(130)
