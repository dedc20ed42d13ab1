#!/usr/bin/env python3
"""Herd benchmark: N concurrent cold pulls of one image through a pull-through proxy.

Compares larder with CNCF distribution in proxy mode, both in front of the same
origin (distribution, filesystem storage), plus a direct pull from the origin as
a reference. For every (proxy, N) it reports the wall time of the whole herd and
the blob traffic the herd caused at the origin (counted from the origin's access
log). Every repetition of a proxied herd starts from a fresh cache directory and
a freshly started proxy process.

    python3 benches/herd.py [--reps 5] [--ns 1,8,32] [--layers 6] [--layer-mib 4]

Everything listens on 127.0.0.1 only. See benches/README.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"  # the only address anything here ever listens on or dials
IMAGE_REPO = "bench/app"
TAG = "v1"
MODES = ("direct", "larder", "distribution")
MODE_LABEL = {
    "direct": "direct (no proxy)",
    "larder": "larder",
    "distribution": "distribution proxy",
}

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"

# Apache combined format: host ident user [time] "METHOD URI PROTO" status bytes "ref" "ua"
ACCESS_RE = re.compile(rb'^\S+ \S+ \S+ \[[^\]]*\] "(\S+) (\S+)[^"]*" (\d{3}) (\d+|-)')
BLOB_PATH_RE = re.compile(rb"^/v2/.+/blobs/sha256:[0-9a-f]{64}(\?.*)?$")
MANIFEST_PATH_RE = re.compile(rb"^/v2/.+/manifests/[^/]+$")

# No proxy variables reach our own HTTP calls or any child process.
PROXY_ENV = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
CHILD_ENV = {k: v for k, v in os.environ.items() if k.lower() not in PROXY_ENV}
HTTP = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def log(msg: str) -> None:
    print(f"[herd {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 20) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


# ----------------------------------------------------------------------------
# Processes: each in its own session (process group), stopped by its group id.
# ----------------------------------------------------------------------------

class Procs:
    """Every process this script starts; stop_all() is called from `finally`."""

    def __init__(self) -> None:
        self.live: list[subprocess.Popen] = []
        self.lock = threading.Lock()

    def start(self, argv: list[str], *, stdout, stderr, env=None, cwd=None) -> subprocess.Popen:
        p = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=env if env is not None else CHILD_ENV,
            cwd=cwd,
            start_new_session=True,
        )
        with self.lock:
            self.live.append(p)
        return p

    @staticmethod
    def _signal_group(p: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(p.pid, sig)  # the group id is the pid (start_new_session)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, p: subprocess.Popen, grace: float = 5.0) -> None:
        if p.poll() is None:
            self._signal_group(p, signal.SIGTERM)
            try:
                p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(p, signal.SIGKILL)
                p.wait()
        # Once the leader has been reaped its pid may be reused: never signal it then.
        with self.lock:
            if p in self.live:
                self.live.remove(p)

    def stop_all(self) -> None:
        with self.lock:
            live = list(self.live)
        for p in live:
            if p.poll() is None:
                self._signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in live:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in live:
            if p.poll() is None:
                self._signal_group(p, signal.SIGKILL)
            try:
                p.wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
        with self.lock:
            self.live.clear()


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with HTTP.open(urllib.request.Request(url), timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except (urllib.error.URLError, OSError):
        return None


def wait_ready(p: subprocess.Popen, port: int, what: str, logfile: Path, timeout: float = 30.0) -> None:
    url = f"http://{HOST}:{port}/v2/"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if p.poll() is not None:
            raise RuntimeError(f"{what} exited with {p.returncode} before answering {url}:\n{tail(logfile)}")
        if http_status(url) == 200:
            return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer 200 on {url} within {timeout:.0f}s:\n{tail(logfile)}")


# ----------------------------------------------------------------------------
# Test image: an OCI image layout built here, pushed to the origin with skopeo.
# ----------------------------------------------------------------------------

@dataclass
class Image:
    layout: Path
    manifest_digest: str  # as the origin serves it (checked against ours)
    blobs: int  # config + layers
    blob_bytes: int  # sum of config + layer sizes


def build_oci_layout(root: Path, layers: int, layer_mib: float, seed: int) -> tuple[str, int, int]:
    rng = random.Random(seed)
    blobs_dir = root / "blobs" / "sha256"
    blobs_dir.mkdir(parents=True)

    def put(data: bytes) -> tuple[str, int]:
        hexd = sha256_hex(data)
        (blobs_dir / hexd).write_bytes(data)
        return "sha256:" + hexd, len(data)

    payload = int(layer_mib * 1024 * 1024)
    layer_descs, diff_ids = [], []
    for i in range(layers):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            ti = tarfile.TarInfo(f"data/layer-{i}.bin")
            ti.size, ti.mtime, ti.mode = payload, 0, 0o644
            tf.addfile(ti, io.BytesIO(rng.randbytes(payload)))
        tar = buf.getvalue()
        diff_ids.append("sha256:" + sha256_hex(tar))
        digest, size = put(gzip.compress(tar, compresslevel=1, mtime=0))
        layer_descs.append({"mediaType": OCI_LAYER_GZIP, "digest": digest, "size": size})

    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "2024-01-01T00:00:00Z",
        "config": {"Cmd": ["/bin/true"]},
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created": "2024-01-01T00:00:00Z", "created_by": f"herd layer {i}"} for i in range(layers)],
    }
    cfg_digest, cfg_size = put(json.dumps(config, separators=(",", ":")).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": cfg_digest, "size": cfg_size},
        "layers": layer_descs,
    }
    mbytes = json.dumps(manifest, separators=(",", ":")).encode()
    m_digest, m_size = put(mbytes)
    index = {
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": [{
            "mediaType": OCI_MANIFEST,
            "digest": m_digest,
            "size": m_size,
            "annotations": {"org.opencontainers.image.ref.name": TAG},
        }],
    }
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    total = cfg_size + sum(d["size"] for d in layer_descs)
    return m_digest, 1 + layers, total


def origin_manifest_digest(port: int) -> str:
    req = urllib.request.Request(
        f"http://{HOST}:{port}/v2/{IMAGE_REPO}/manifests/{TAG}",
        headers={"Accept": OCI_MANIFEST},
    )
    with HTTP.open(req, timeout=10) as r:
        body = r.read()
    return "sha256:" + sha256_hex(body)


# ----------------------------------------------------------------------------
# Origin access log
# ----------------------------------------------------------------------------

class AccessLog:
    def __init__(self, path: Path) -> None:
        self.path = path

    def wait_quiet(self, quiet: float = 0.3, timeout: float = 15.0) -> None:
        """Poll until the log has not grown for `quiet` seconds."""
        last, since = -1, time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            size = self.path.stat().st_size
            now = time.monotonic()
            if size != last:
                last, since = size, now
            elif now - since >= quiet:
                return
            time.sleep(0.05)
        log(f"warning: origin access log still growing after {timeout:.0f}s; counting anyway")

    def lines(self) -> list[bytes]:
        data = self.path.read_bytes()
        return data.split(b"\n")[: data.count(b"\n")]  # complete lines only

    def mark(self) -> int:
        self.wait_quiet()
        return len(self.lines())

    def count_since(self, mark: int) -> dict:
        self.wait_quiet()
        stats = {
            "requests": 0, "blob_gets": 0, "blob_get_bytes": 0, "blob_gets_non_2xx": 0,
            "blob_heads": 0, "manifest_gets": 0, "manifest_heads": 0, "v2_pings": 0, "by_status": {},
        }
        for line in self.lines()[mark:]:
            m = ACCESS_RE.match(line)
            if not m:
                continue  # not an access-log line
            method, uri, status, size = m.groups()
            stats["requests"] += 1
            st = status.decode()
            stats["by_status"][st] = stats["by_status"].get(st, 0) + 1
            if uri == b"/v2/" or uri.startswith(b"/v2/?"):
                stats["v2_pings"] += 1
            elif BLOB_PATH_RE.match(uri):
                if method == b"GET":
                    stats["blob_gets"] += 1
                    stats["blob_get_bytes"] += 0 if size == b"-" else int(size)
                    if not st.startswith("2"):
                        stats["blob_gets_non_2xx"] += 1
                elif method == b"HEAD":
                    stats["blob_heads"] += 1
            elif MANIFEST_PATH_RE.match(uri):
                if method == b"GET":
                    stats["manifest_gets"] += 1
                elif method == b"HEAD":
                    stats["manifest_heads"] += 1
        return stats


# ----------------------------------------------------------------------------
# Servers
# ----------------------------------------------------------------------------

def distribution_config(root: Path, port: int, remote_port: int | None) -> str:
    cfg = (
        "version: 0.1\n"
        "log:\n  level: warn\n"
        "storage:\n"
        f"  filesystem:\n    rootdirectory: {root}\n"
        f"http:\n  addr: {HOST}:{port}\n"
    )
    if remote_port is not None:
        cfg += f"proxy:\n  remoteurl: http://{HOST}:{remote_port}\n"
    return cfg


def start_distribution(procs: Procs, d: Path, what: str, remote_port: int | None) -> tuple[subprocess.Popen, int, Path]:
    """Returns (process, port, stdout path). stdout carries the access log."""
    d.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        port = free_port()
        cfg = d / "config.yml"
        cfg.write_text(distribution_config(d / "storage", port, remote_port))
        out, err = d / "access.log", d / "stderr.log"
        with open(out, "wb") as fo, open(err, "wb") as fe:
            p = procs.start(["docker-registry", "serve", str(cfg)], stdout=fo, stderr=fe)
        try:
            wait_ready(p, port, what, err)
            return p, port, out
        except RuntimeError:
            procs.stop(p)
            if attempt == 2 or "address already in use" not in tail(err, 50):
                raise
    raise AssertionError("unreachable")


def start_larder(procs: Procs, binary: Path, d: Path, origin_port: int) -> tuple[subprocess.Popen, int]:
    d.mkdir(parents=True, exist_ok=True)
    env = dict(CHILD_ENV, RUST_LOG="larder=warn")
    for attempt in range(3):
        port = free_port()
        cfg = d / "larder.toml"
        cfg.write_text(
            "[server]\n"
            f'listen = "{HOST}:{port}"\n'
            "[cache]\n"
            f'dir = "{d / "cache"}"\n'
            "[[upstream]]\n"
            'name = "origin.test"\n'
            f'url = "http://{HOST}:{origin_port}"\n'
            "default = true\n"
        )
        logf = d / "larder.log"
        with open(logf, "wb") as fl:
            p = procs.start([str(binary), "--config", str(cfg)], stdout=fl, stderr=subprocess.STDOUT, env=env)
        try:
            wait_ready(p, port, "larder", logf)
            return p, port
        except RuntimeError:
            procs.stop(p)
            if attempt == 2 or "in use" not in tail(logf, 50).lower():
                raise
    raise AssertionError("unreachable")


# ----------------------------------------------------------------------------
# The herd
# ----------------------------------------------------------------------------

@dataclass
class Pull:
    client: int
    rc: int | None = None
    seconds: float | None = None
    ok: bool = False
    error: str = ""


def run_herd(procs: Procs, port: int, n: int, work: Path, expect_digest: str, timeout: float) -> tuple[float, list[Pull]]:
    work.mkdir(parents=True)
    pulls = [Pull(i) for i in range(n)]
    popens: list[subprocess.Popen] = []
    starts: list[float] = []
    ends: list[float | None] = [None] * n
    src = f"docker://{HOST}:{port}/{IMAGE_REPO}:{TAG}"
    logs = [work / f"client-{i}.log" for i in range(n)]

    def waiter(i: int) -> None:
        popens[i].wait()
        ends[i] = time.monotonic()

    threads = []
    t0 = time.monotonic()
    try:
        for i in range(n):
            with open(logs[i], "wb") as lf:
                starts.append(time.monotonic())
                popens.append(procs.start(
                    ["skopeo", "copy", "--src-tls-verify=false", src, f"dir:{work / f'client-{i}'}"],
                    stdout=lf, stderr=subprocess.STDOUT,
                ))
            t = threading.Thread(target=waiter, args=(i,), daemon=True)
            t.start()
            threads.append(t)
        deadline = t0 + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    finally:
        for p in popens:
            procs.stop(p, grace=2.0)
    finished = [e for e in ends if e is not None]
    wall = (max(finished) if len(finished) == n else time.monotonic()) - t0

    for i, pl in enumerate(pulls):
        p = popens[i]
        pl.rc = p.returncode
        if ends[i] is None:
            pl.error = f"timed out after {timeout:.0f}s"
        else:
            pl.seconds = ends[i] - starts[i]
            if p.returncode != 0:
                pl.error = f"skopeo exit {p.returncode}: " + tail(logs[i], 6)
            else:
                mf = work / f"client-{i}" / "manifest.json"
                try:
                    got = "sha256:" + sha256_hex(mf.read_bytes())
                except OSError as e:
                    got = f"(unreadable: {e})"
                if got == expect_digest:
                    pl.ok = True
                else:
                    pl.error = f"manifest.json digest {got} != origin {expect_digest}"
    shutil.rmtree(work, ignore_errors=True)
    return wall, pulls


# ----------------------------------------------------------------------------
# Reporting
# ----------------------------------------------------------------------------

def cmd_out(argv: list[str], cwd: Path | None = None) -> str:
    try:
        r = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=CHILD_ENV, timeout=30)
        return (r.stdout or r.stderr).strip().splitlines()[0] if (r.stdout or r.stderr).strip() else "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine_info() -> dict:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    commit = cmd_out(["git", "rev-parse", "--short=12", "HEAD"], REPO_ROOT)
    dirty = cmd_out(["git", "status", "--porcelain", "--untracked-files=no"], REPO_ROOT)
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "kernel": platform.release(),
        "docker_registry": cmd_out(["docker-registry", "--version"]),
        "skopeo": cmd_out(["skopeo", "--version"]),
        "larder_commit": commit + ("+uncommitted-changes" if dirty not in ("", "?") else ""),
        "rustc": cmd_out(["rustc", "--version"]),
        "python": platform.python_version(),
    }


def machine_line(m: dict) -> str:
    return (f"machine: nproc={m['nproc']}, CPU {m['cpu']}, kernel {m['kernel']}; "
            f"{m['docker_registry']}; {m['skopeo']}; larder {m['larder_commit']} ({m['rustc']})")


def med_range(xs: list[float], fmt: str) -> tuple[str, str]:
    if not xs:
        return "–", "–"
    return fmt.format(statistics.median(xs)), f"{fmt.format(min(xs))}–{fmt.format(max(xs))}"


def summarize(results: list[dict], ns: list[int], image: Image) -> list[dict]:
    rows = []
    for mode in MODES:
        for n in ns:
            rs = [r for r in results if r["mode"] == mode and r["n"] == n]
            if not rs:
                continue
            walls = [r["wall_seconds"] for r in rs]
            gets = [r["origin"]["blob_gets"] for r in rs]
            byts = [r["origin"]["blob_get_bytes"] for r in rs]
            reqs = [r["origin"]["requests"] for r in rs]
            failed = sum(r["failed"] for r in rs)
            rows.append({
                "mode": mode, "n": n, "reps": len(rs),
                "wall_seconds": {"median": statistics.median(walls), "min": min(walls), "max": max(walls)},
                "origin_blob_gets": {"median": statistics.median(gets), "min": min(gets), "max": max(gets)},
                "origin_blob_bytes": {"median": statistics.median(byts), "min": min(byts), "max": max(byts)},
                "origin_requests": {"median": statistics.median(reqs), "min": min(reqs), "max": max(reqs)},
                "origin_blob_bytes_per_image": statistics.median(byts) / image.blob_bytes,
                "pulls": n * len(rs),
                "failed_pulls": failed,
            })
    return rows


def markdown_table(rows: list[dict], image: Image) -> str:
    mib = 1024 * 1024
    out = [
        "| proxy | N | wall median (s) | wall min–max (s) | origin blob GETs median (min–max) "
        "| origin blob MiB median (min–max) | × image | origin requests (all) median | failed pulls |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        w, g, b = r["wall_seconds"], r["origin_blob_gets"], r["origin_blob_bytes"]
        gets = f"{g['median']:g} ({g['min']:g}–{g['max']:g})"
        mibs = f"{b['median'] / mib:.1f} ({b['min'] / mib:.1f}–{b['max'] / mib:.1f})"
        failed = f"{r['failed_pulls']}/{r['pulls']}"
        if r["failed_pulls"]:
            failed = f"**{failed}**"
        out.append(
            f"| {MODE_LABEL[r['mode']]} | {r['n']} | {w['median']:.2f} | {w['min']:.2f}–{w['max']:.2f} "
            f"| {gets} | {mibs} | {r['origin_blob_bytes_per_image']:.2f} "
            f"| {r['origin_requests']['median']:g} | {failed} |"
        )
    return "\n".join(out)


# ----------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="repetitions per (proxy, N); default 5")
    ap.add_argument("--ns", default="1,8,32", help="herd sizes, comma-separated; default 1,8,32")
    ap.add_argument("--layers", type=int, default=6, help="layers in the test image; default 6")
    ap.add_argument("--layer-mib", type=float, default=4.0, help="size of each layer in MiB; default 4")
    ap.add_argument("--modes", default=",".join(MODES), help=f"subset of {','.join(MODES)}")
    ap.add_argument("--out", type=Path, default=None, help="results directory (default: a new temp dir)")
    ap.add_argument("--tmp", type=Path, default=None, help="parent for the scratch dir (default: $TMPDIR or /tmp)")
    ap.add_argument("--larder-bin", type=Path, default=None,
                    help="use this larder binary instead of building (default: cargo build --release --locked)")
    ap.add_argument("--herd-timeout", type=float, default=300.0, help="seconds before a herd's pulls are killed")
    ap.add_argument("--seed", type=int, default=20240601, help="seed for the layer bytes")
    a = ap.parse_args()
    a.ns = [int(x) for x in a.ns.split(",") if x.strip()]
    a.modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    if a.reps < 1 or not a.ns or any(n < 1 for n in a.ns) or a.layers < 1 or a.layer_mib <= 0:
        ap.error("--reps, --ns, --layers and --layer-mib must be positive")
    bad = [m for m in a.modes if m not in MODES]
    if bad:
        ap.error(f"unknown mode(s) {bad}; choose from {MODES}")
    return a


def build_larder(cargo: str = "cargo") -> Path:
    log("building larder: cargo build --release --locked")
    r = subprocess.run([cargo, "build", "--release", "--locked"], cwd=REPO_ROOT, env=CHILD_ENV)
    if r.returncode != 0:
        raise RuntimeError(f"cargo build failed with {r.returncode}")
    binary = REPO_ROOT / "target" / "release" / "larder"
    if not binary.is_file():
        raise RuntimeError(f"{binary} missing after the build")
    return binary


def _raise_exit(signum, _frame):
    raise SystemExit(128 + signum)


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with SIGINT ignored
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_exit)
    for tool in ("docker-registry", "skopeo"):
        if shutil.which(tool) is None:
            log(f"{tool} not found (apt-get install docker-registry skopeo)")
            return 2

    binary = args.larder_bin.resolve() if args.larder_bin else build_larder()
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="larder-herd-results-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    log(machine_line(machine))

    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-herd-", dir=args.tmp))
    results: list[dict] = []
    failures: list[dict] = []
    try:
        # Origin: one distribution instance for the whole run.
        origin, origin_port, origin_log_path = start_distribution(procs, scratch / "origin", "origin", None)
        access = AccessLog(origin_log_path)
        log(f"origin (docker-registry) on {HOST}:{origin_port}")

        log(f"building the test image: {args.layers} layers × {args.layer_mib:g} MiB of random bytes")
        ours, blobs, blob_bytes = build_oci_layout(scratch / "oci", args.layers, args.layer_mib, args.seed)
        push = subprocess.run(
            ["skopeo", "copy", "--dest-tls-verify=false", f"oci:{scratch / 'oci'}:{TAG}",
             f"docker://{HOST}:{origin_port}/{IMAGE_REPO}:{TAG}"],
            capture_output=True, text=True, env=CHILD_ENV, timeout=300,
        )
        if push.returncode != 0:
            raise RuntimeError(f"pushing the test image failed:\n{push.stdout}\n{push.stderr}")
        digest = origin_manifest_digest(origin_port)
        if digest != ours:
            log(f"note: origin serves manifest {digest}, the layout had {ours}; verifying against the origin's")
        image = Image(scratch / "oci", digest, blobs, blob_bytes)
        log(f"image {IMAGE_REPO}:{TAG} = {digest}, {blobs} blobs, {blob_bytes / 2**20:.1f} MiB")

        total = args.reps * len(args.ns) * len(args.modes)
        done = 0
        for rep in range(args.reps):
            # Rotate the order of modes per repetition so slow drifts in machine
            # load do not always hit the same proxy.
            order = args.modes[rep % len(args.modes):] + args.modes[: rep % len(args.modes)]
            for n in args.ns:
                for mode in order:
                    done += 1
                    herd_dir = scratch / f"{mode}-n{n}-r{rep}"
                    proxy = None
                    try:
                        if mode == "direct":
                            port = origin_port
                        elif mode == "larder":
                            proxy, port = start_larder(procs, binary, herd_dir / "larder", origin_port)
                        else:
                            proxy, port, _ = start_distribution(procs, herd_dir / "dist", "distribution proxy", origin_port)
                        mark = access.mark()
                        wall, pulls = run_herd(procs, port, n, herd_dir / "pulls", image.manifest_digest,
                                               args.herd_timeout)
                        origin_stats = access.count_since(mark)
                        if proxy is not None and proxy.poll() is not None:
                            log(f"warning: {mode} exited with {proxy.returncode} during the herd")
                    finally:
                        if proxy is not None:
                            procs.stop(proxy)
                    failed = [p for p in pulls if not p.ok]
                    for p in failed:
                        failures.append({"mode": mode, "n": n, "rep": rep, "client": p.client,
                                         "rc": p.rc, "error": p.error})
                    results.append({
                        "mode": mode, "n": n, "rep": rep,
                        "wall_seconds": wall,
                        "pull_seconds": [p.seconds for p in pulls],
                        "failed": len(failed),
                        "origin": origin_stats,
                    })
                    if failed and proxy is not None:
                        # Keep the proxy's own logs of a herd with failed pulls.
                        kept = out_dir / "failed-herds" / herd_dir.name
                        kept.mkdir(parents=True, exist_ok=True)
                        for f in herd_dir.glob("*/*.log"):
                            shutil.copy(f, kept / f.name)
                        results[-1]["proxy_logs"] = str(kept)
                    shutil.rmtree(herd_dir, ignore_errors=True)
                    log(f"[{done}/{total}] rep {rep + 1}/{args.reps} {mode:<12} N={n:<3} wall {wall:6.2f}s  "
                        f"origin blob GETs {origin_stats['blob_gets']:>3}  "
                        f"{origin_stats['blob_get_bytes'] / 2**20:7.1f} MiB  failed {len(failed)}/{n}")
                    for p in failed[:3]:
                        log(f"    client {p.client} failed: {p.error.splitlines()[-1]}")
        if origin.poll() is not None:
            log(f"warning: the origin exited with {origin.returncode}")
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)

    rows = summarize(results, args.ns, image)
    table = markdown_table(rows, image)
    header = (f"image: {args.layers} layers × {args.layer_mib:g} MiB random (gzip'd tar) + config = "
              f"{image.blobs} blobs, {image.blob_bytes / 2**20:.1f} MiB; {args.reps} reps per row; "
              f"cold proxy (fresh process + empty cache) per rep")
    md = f"{machine_line(machine)}\n\n{header}\n\n{table}\n"
    if failures:
        md += f"\n{len(failures)} failed pull(s); first errors:\n\n"
        for f in failures[:10]:
            md += f"- {f['mode']} N={f['n']} rep {f['rep']} client {f['client']}: {f['error'].splitlines()[-1] if f['error'] else '?'}\n"
    doc = {
        "benchmark": "herd",
        "machine": machine,
        "params": {"reps": args.reps, "ns": args.ns, "layers": args.layers, "layer_mib": args.layer_mib,
                   "modes": args.modes, "seed": args.seed, "herd_timeout": args.herd_timeout},
        "image": {"repo": IMAGE_REPO, "tag": TAG, "manifest_digest": image.manifest_digest,
                  "blobs": image.blobs, "blob_bytes": image.blob_bytes},
        "summary": rows,
        "herds": results,
        "failures": failures,
        "markdown": md,
    }
    (out_dir / "herd.json").write_text(json.dumps(doc, indent=2))
    (out_dir / "herd.md").write_text(md)
    print(md)
    log(f"results: {out_dir / 'herd.json'} and {out_dir / 'herd.md'}")
    # A failed pull through larder (or straight from the origin) fails the
    # run; the reference proxy's failures are a finding, reported above.
    return 1 if any(f["mode"] != "distribution" for f in failures) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        log("interrupted; all processes and scratch dirs were cleaned up")
        sys.exit(130)
