#!/usr/bin/env python3
"""Cold pulls over a modelled internet link: through a fresh larder, or
straight from the origin ("direct"), over the same link model.

The origin is the real CNCF distribution (`docker-registry serve`); in
front of it runs the link shaper (`benches/shaper`, built as the `shaper`
example): a throughput cap per connection, a delay before each request's
first byte, optionally a cap on all connections together. Direct pulls go
through the shaper to the origin; larder's upstream is the shaper, and
clients reach larder on plain loopback (larder is the mirror next to the
cluster; the link is between it and the registry).

Rows (each repetition runs every row, direct and larder in rotating order,
a fresh larder with an empty cache each time):

  big     1 x 512 MiB layer, 25 MB/s per connection, 50 ms first byte:
          skopeo copy, wall time
  ranges  the same blob, containerd-style: its manifest, then 8 MiB ranges,
          8 at a time (`shaper ranges`), time to the last range
  small   8 x 8 MiB image, same link: skopeo copy
  loop    8 x 8 MiB image on plain loopback (no shaper)
  agg     8 x 8 MiB image, 50 MB/s for all connections together, 50 ms
          first byte, no per-connection cap
  herd    (once, through larder only) 30 concurrent skopeo pulls of a
          4 x 40 MiB image over the 25 MB/s link: fills per blob, ranged
          parts and the origin-side requests the shaper saw
  look    (through larder only, every repetition) what a look costs
          upstream, in bytes the shaper carried from the origin: a manifest
          GET and a config GET of an image with one 64 MiB layer (target:
          their own bytes + 1 MiB), and 3 manifest GETs of the 8 x 8 MiB
          image through a larder whose max_size (32 MiB) is smaller than
          the image (target: at most the image once)

    python3 benches/cold.py                     # --reps 5
    python3 benches/cold.py --reps 7 --rows big,small

Prints each row's seconds (median, min-max) and larder / direct per
repetition (median, min-max), and the shaper's own ceiling first. Loopback
only; everything started is stopped by its id, the scratch dir removed.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import herd  # noqa: E402
import load  # noqa: E402
from herd import CHILD_ENV, HOST, OCI_MANIFEST, Procs, sha256_hex  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
SHAPER = REPO_ROOT / "target" / "release" / "examples" / "shaper"
LARDER = REPO_ROOT / "target" / "release" / "larder"
ROWS = ("big", "ranges", "small", "loop", "agg")
TARGETS = {"big": 0.35, "ranges": 1.1, "small": 0.8, "loop": 1.05, "agg": 1.05}
TITLES = {
    "big": "1 x 512 MiB layer, 25 MB/s per conn, 50 ms first byte, skopeo",
    "ranges": "same blob, 8 parallel 8 MiB ranges (containerd-style), to the last range",
    "small": "8 x 8 MiB image, 25 MB/s per conn, 50 ms first byte, skopeo",
    "loop": "8 x 8 MiB image, plain loopback, skopeo",
    "agg": "8 x 8 MiB image, 50 MB/s aggregate, 50 ms first byte, skopeo",
}
LINK = ["--per-connection", "25MB", "--first-byte", "50ms"]
AGG = ["--aggregate", "50MB", "--first-byte", "50ms"]
HERD_CLIENTS = 30


class Urandom:
    """`n` random bytes as a file to read (tarfile reads a member's data from one)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def read(self, size: int = -1) -> bytes:
        size = self.left if size < 0 else min(size, self.left)
        self.left -= size
        return os.urandom(size)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def big_layout(root: Path, mib: int) -> None:
    """herd.build_oci_layout's image with one layer of `mib` MiB, built on
    disk in pieces (herd's builder holds each layer in memory, and Python's
    `randbytes` stops below 256 MiB)."""
    blobs = root / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    tar, gz = root / "layer.tar", root / "layer.tar.gz"
    with tarfile.open(tar, mode="w", format=tarfile.PAX_FORMAT) as tf:
        ti = tarfile.TarInfo("data/layer-0.bin")
        ti.size, ti.mtime, ti.mode = mib << 20, 0, 0o644
        tf.addfile(ti, Urandom(ti.size))
    diff_id = "sha256:" + sha256_file(tar)
    with open(tar, "rb") as src, gzip.GzipFile(gz, "wb", compresslevel=1, mtime=0) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    tar.unlink()
    layer_hex = sha256_file(gz)
    layer = {"mediaType": herd.OCI_LAYER_GZIP, "digest": "sha256:" + layer_hex, "size": gz.stat().st_size}
    gz.rename(blobs / layer_hex)

    def put(data: bytes) -> tuple[str, int]:
        (blobs / sha256_hex(data)).write_bytes(data)
        return "sha256:" + sha256_hex(data), len(data)

    config = {"architecture": "amd64", "os": "linux", "created": "2024-01-01T00:00:00Z",
              "config": {"Cmd": ["/bin/true"]}, "rootfs": {"type": "layers", "diff_ids": [diff_id]}}
    cfg_digest, cfg_size = put(json.dumps(config, separators=(",", ":")).encode())
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": herd.OCI_CONFIG, "digest": cfg_digest, "size": cfg_size},
                "layers": [layer]}
    m_digest, m_size = put(json.dumps(manifest, separators=(",", ":")).encode())
    index = {"schemaVersion": 2, "mediaType": herd.OCI_INDEX,
             "manifests": [{"mediaType": OCI_MANIFEST, "digest": m_digest, "size": m_size,
                            "annotations": {"org.opencontainers.image.ref.name": herd.TAG}}]}
    (root / "index.json").write_text(json.dumps(index))
    (root / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))


def push_image(scratch: Path, port: int, repo: str, layers: int, mib: float, seed: int) -> tuple[str, list]:
    """An image of `layers` gzip'd tar layers pushed with skopeo; its
    manifest digest and blob descriptors (config first)."""
    layout = scratch / f"oci-{seed}"
    if mib > 64:
        big_layout(layout, int(mib))
    else:
        herd.build_oci_layout(layout, layers, mib, seed)
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:{herd.TAG}",
                    f"docker://{HOST}:{port}/{repo}:{herd.TAG}"], check=True, capture_output=True, env=CHILD_ENV)
    shutil.rmtree(layout)
    st, body, _ = load.http_get(f"http://{HOST}:{port}/v2/{repo}/manifests/{herd.TAG}", {"Accept": OCI_MANIFEST})
    if st != 200:
        raise RuntimeError(f"origin: {repo}:{herd.TAG} -> {st}")
    m = json.loads(body)
    return "sha256:" + sha256_hex(body), [m["config"]] + m["layers"]


def start_shaper(procs: Procs, scratch: Path, name: str, origin_port: int, model: list[str]) -> tuple:
    port = herd.free_port()
    out = scratch / f"shaper-{name}.out"
    with open(out, "wb") as f:
        p = procs.start([str(SHAPER), "serve", "--listen", f"{HOST}:{port}", "--target", f"{HOST}:{origin_port}",
                         *model], stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while "listening" not in out.read_text():
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"shaper {name}: {out.read_text()}")
        time.sleep(0.05)
    return p, port, out


def skopeo_pull(procs: Procs, port: int, repo: str, work: Path, expect: str) -> float:
    t0 = time.monotonic()
    r = subprocess.run(["skopeo", "copy", "--src-tls-verify=false", f"docker://{HOST}:{port}/{repo}:{herd.TAG}",
                        f"dir:{work}"], capture_output=True, text=True, env=CHILD_ENV, timeout=600)
    wall = time.monotonic() - t0
    try:
        if r.returncode != 0:
            raise RuntimeError(f"skopeo from :{port}: {r.stderr[-500:]}")
        got = "sha256:" + sha256_hex((work / "manifest.json").read_bytes())
        if got != expect:
            raise RuntimeError(f"pulled manifest {got} != {expect}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return wall


def ranges_pull(port: int, repo: str, blob: dict) -> float:
    """containerd's multipart fetch: the manifest, then the blob in 8 MiB
    ranges, 8 at a time; seconds from the manifest request to the last
    range (the blob's SHA-256 is checked after the timing)."""
    t0 = time.monotonic()
    st, _, _ = load.http_get(f"http://{HOST}:{port}/v2/{repo}/manifests/{herd.TAG}", {"Accept": OCI_MANIFEST})
    if st != 200:
        raise RuntimeError(f"manifest from :{port}: {st}")
    manifest_s = time.monotonic() - t0
    r = subprocess.run([str(SHAPER), "ranges", "--url", f"http://{HOST}:{port}/v2/{repo}/blobs/{blob['digest']}",
                        "--size", str(blob["size"]), "--chunk", "8MiB", "--parallel", "8",
                        "--sha256", blob["digest"].removeprefix("sha256:")], capture_output=True, text=True,
                       timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"ranges from :{port}: {r.stdout[-300:]} {r.stderr[-500:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if not res.get("sha256_ok"):
        raise RuntimeError(f"ranges from :{port}: {res}")
    return manifest_s + res["seconds"]


def run_looks(procs: Procs, scratch: Path, origin_port: int, binary: Path, reps: int, small: tuple) -> dict:
    """What manifest-only clients cost upstream: bytes the shaper carried
    from the origin to a fresh larder (headers included) per case."""
    digest, blobs = push_image(scratch, origin_port, "bench/look", 1, 64, 4)
    st, manifest, _ = load.http_get(f"http://{HOST}:{origin_port}/v2/bench/look/manifests/{herd.TAG}",
                                    {"Accept": OCI_MANIFEST})
    config = blobs[0]
    look_own = len(manifest) + config["size"]
    small_image = sum(b["size"] for b in small[1])
    out: dict = {"look": [], "smallcache": [], "look_own_bytes": look_own, "small_image_bytes": small_image}
    for rep in range(reps):
        for case in ("look", "smallcache"):
            link = start_shaper(procs, scratch, f"{case}-{rep}", origin_port, LINK)
            d = scratch / f"larder-{case}-{rep}"
            extra = 'max_size = "32MiB"\nmax_blob_size = "16MiB"\n' if case == "smallcache" else ""
            server = load.start_larder(procs, binary, d, d / "cache", link[1], log=False, cache_extra=extra)
            try:
                repo = "bench/look" if case == "look" else "bench/small"
                for _ in range(1 if case == "look" else 3):
                    st, _, _ = load.http_get(f"http://{HOST}:{server.port}/v2/{repo}/manifests/{herd.TAG}",
                                             {"Accept": OCI_MANIFEST})
                    if st != 200:
                        raise RuntimeError(f"{case}: manifest {st}")
                if case == "look":
                    st, body, _ = load.http_get(f"http://{HOST}:{server.port}/v2/{repo}/blobs/{config['digest']}")
                    if st != 200 or "sha256:" + sha256_hex(body) != config["digest"]:
                        raise RuntimeError(f"look: config {st}")
                # Time for a download wrongly started by the look to show.
                time.sleep(2.0)
            finally:
                procs.stop(server.proc)
                shutil.rmtree(d, ignore_errors=True)
            seen = stop_shaper(procs, link[0], link[2])
            out[case].append(seen.get("bytes_down", -1))
            load.log(f"rep {rep + 1}/{reps} {case}: {seen}")
    return out


def metrics(server) -> dict[str, float]:
    st, body, _ = load.http_get(f"http://{HOST}:{server.admin}/metrics", timeout=10)
    out: dict[str, float] = {}
    for line in body.decode(errors="replace").splitlines():
        m = re.match(r"^(larder_fill\w*|larder_upstream_bytes_total)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def stop_shaper(procs: Procs, p, out: Path) -> dict:
    procs.stop(p)
    for line in reversed(out.read_text().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    return {}


def summary_int(xs: list[int]) -> str:
    return f"{statistics.median(xs):.0f} ({min(xs)}–{max(xs)})"


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.3f}–{max(xs):.3f})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default=",".join(ROWS) + ",herd,look", help="comma-separated rows to run")
    ap.add_argument("--larder-bin", type=Path, help="skip the build and use this binary (and the built shaper)")
    args = ap.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    if args.larder_bin is None:
        subprocess.run(["cargo", "build", "--release", "--locked", "--bin", "larder", "--example", "shaper"],
                       cwd=REPO_ROOT, check=True)
    binary = (args.larder_bin or LARDER).resolve()
    ceiling = subprocess.run([str(SHAPER), "ceiling", "--bytes", "256MiB"], capture_output=True, text=True,
                             check=True).stdout
    print(ceiling.strip())
    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-cold-"))
    times: dict[str, dict[str, list[float]]] = {r: {"direct": [], "larder": []} for r in ROWS if r in rows}
    herd_result = None
    looks = None
    try:
        origin = load.start_distribution(procs, scratch / "origin", "origin", None)
        big = small = None
        if {"big", "ranges"} & set(rows):
            load.log("pushing the 512 MiB image")
            big = push_image(scratch, origin.port, "bench/big", 1, 512, 1)
        if {"small", "loop", "agg", "look"} & set(rows):
            small = push_image(scratch, origin.port, "bench/small", 8, 8, 2)
        link = start_shaper(procs, scratch, "link", origin.port, LINK)
        agg = start_shaper(procs, scratch, "agg", origin.port, AGG)
        upstream_of = {"big": link[1], "ranges": link[1], "small": link[1], "loop": origin.port, "agg": agg[1]}
        for rep in range(args.reps):
            for row in times:
                for who in load.rotate(["direct", "larder"], rep):
                    server, port = None, upstream_of[row]
                    if who == "larder":
                        d = scratch / f"larder-{row}-{rep}"
                        server = load.start_larder(procs, binary, d, d / "cache", upstream_of[row], log=False)
                        port = server.port
                    try:
                        if row == "big":
                            t = skopeo_pull(procs, port, "bench/big", scratch / "pull", big[0])
                        elif row == "ranges":
                            t = ranges_pull(port, "bench/big", big[1][1])
                        else:
                            t = skopeo_pull(procs, port, "bench/small", scratch / "pull", small[0])
                    finally:
                        if server is not None:
                            procs.stop(server.proc)
                            shutil.rmtree(d, ignore_errors=True)
                    times[row][who].append(t)
                    load.log(f"rep {rep + 1}/{args.reps} {row} {who}: {t:.3f} s")
        stop_shaper(procs, *([link[0], link[2]]))
        stop_shaper(procs, agg[0], agg[2])
        if "herd" in rows:
            herd_result = run_herd(procs, scratch, origin.port, binary)
        if "look" in rows:
            looks = run_looks(procs, scratch, origin.port, binary, args.reps, small)
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)

    print(f"\ncold pulls over a modelled link, {args.reps} repetitions; seconds median (min–max)\n")
    print("| case | direct (s) | larder (s) | larder ÷ direct per rep | target |")
    print("|---|---|---|---|---|")
    for row, t in times.items():
        ratios = [a / b for a, b in zip(t["larder"], t["direct"])]
        print(f"| {TITLES[row]} | {summary(t['direct'])} | {summary(t['larder'])} | **{summary(ratios)}** "
              f"| ≤ {TARGETS[row]} |")
    if herd_result:
        print(f"\nherd: {json.dumps(herd_result, indent=1)}")
    if looks:
        own, image = looks["look_own_bytes"], looks["small_image_bytes"]
        print("\nlooks: bytes the origin sent to larder, median (min–max)\n")
        print("| case | bytes upstream | target |")
        print("|---|---|---|")
        look, small_cache = looks["look"], looks["smallcache"]
        print(f"| manifest + config GET, image with a 64 MiB layer | {summary_int(look)} "
              f"| ≤ {own} + 1 MiB = {own + (1 << 20)}: {'met' if max(look) <= own + (1 << 20) else '**missed**'} |")
        print(f"| 3 manifest GETs, cache (32 MiB) smaller than the image | {summary_int(small_cache)} "
              f"| ≤ {image} (the image once): {'met' if max(small_cache) <= image else '**missed**'} |")
    return 0


def run_herd(procs: Procs, scratch: Path, origin_port: int, binary: Path) -> dict:
    """30 concurrent cold skopeo pulls of a 4 x 40 MiB image through one
    fresh larder over the 25 MB/s link: what reached the origin."""
    digest, blobs = push_image(scratch, origin_port, "bench/herd", 4, 40, 3)
    link = start_shaper(procs, scratch, "herd", origin_port, LINK)
    d = scratch / "larder-herd"
    server = load.start_larder(procs, binary, d, d / "cache", link[1], log=False)
    t0 = time.monotonic()
    pulls = [procs.start(["skopeo", "copy", "--src-tls-verify=false",
                          f"docker://{HOST}:{server.port}/bench/herd:{herd.TAG}", f"dir:{scratch / f'herd-{i}'}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for i in range(HERD_CLIENTS)]
    failed = sum(1 for p in pulls if p.wait(timeout=900) != 0)
    wall = time.monotonic() - t0
    ok = sum(1 for i in range(HERD_CLIENTS)
             if (scratch / f"herd-{i}" / "manifest.json").is_file()
             and "sha256:" + sha256_hex((scratch / f"herd-{i}" / "manifest.json").read_bytes()) == digest)
    time.sleep(0.5)
    m = metrics(server)
    procs.stop(server.proc)
    seen = stop_shaper(procs, link[0], link[2])
    parts_per_blob = {b["digest"][7:19]: -(-b["size"] // (8 << 20)) if b["size"] >= 32 << 20 else 1 for b in blobs}
    return {
        "clients": HERD_CLIENTS, "failed": failed, "manifests_ok": ok, "wall_s": round(wall, 2),
        "blobs": len(blobs), "image_bytes": sum(b["size"] for b in blobs),
        "parts_per_blob_expected": parts_per_blob,
        "fills_total": {k: v for k, v in m.items() if k.startswith("larder_fills_total")},
        "fill_parts_total": sum(v for k, v in m.items() if k.startswith("larder_fill_parts_total")),
        "fill_part_resumes": sum(v for k, v in m.items() if k.startswith("larder_fill_part_resumes_total")),
        "upstream_bytes": sum(v for k, v in m.items() if k.startswith("larder_upstream_bytes_total")),
        "shaper_requests_to_origin": seen.get("requests"),
        "shaper_connections": seen.get("connections"),
    }


if __name__ == "__main__":
    sys.exit(main())
