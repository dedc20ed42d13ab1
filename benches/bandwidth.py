#!/usr/bin/env python3
"""An upstream's `max_bandwidth`, measured as exact byte counts over time.

A fresh larder (empty cache) with `[[upstream]] max_bandwidth = <--rate>`
downloads from the real CNCF distribution origin on loopback, which alone
serves far faster than the cap. While it does, larder's own counter of
bytes read from upstream (`larder_upstream_bytes_total`, exact) is sampled
every 50 ms from /metrics. Cases, each repetition a fresh larder:

  one    one client GETs a 48 MiB layer (one fill, parallel ranged parts
         over 4 connections): the cap holds for all of a fill's parts
  ahead  a client resolves an image of 4 x 12 MiB layers and GETs them one
         at a time (as skopeo does): the first starts the other three
         ahead of it. The cap holds for all of them together, and the
         client's own layer comes first: its first layer takes about what
         12 MiB alone takes at the cap

For each: the bytes read, the seconds from the client's first request to
the last byte read upstream, their ratio (the average rate), and the most
bytes read in any window of at most 1 s (between the start of one sample's
request and the end of a later one's), against what the bucket allows in
1 s: rate x 1 s + its depth (max(rate / 10, 256 KiB)) + one read per
connection (each connection reads a chunk, up to hyper's 400 KiB buffer,
before it pays for it; 4 connections here: a fill's parts, or a client's
layer and three ahead). For `ahead`, the client's first layer's seconds
against 12 MiB / rate.

    python3 benches/bandwidth.py                    # --reps 3 --rate 8MiB
    python3 benches/bandwidth.py --reps 5 --rate 16MiB --larder-bin target/release/larder

Loopback only; everything started is stopped by its id, the scratch dir
removed.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import herd  # noqa: E402
import load  # noqa: E402
from herd import CHILD_ENV, HOST, OCI_MANIFEST, Procs, sha256_hex  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
LARDER = REPO_ROOT / "target" / "release" / "larder"
MIB = 1 << 20
CHUNK = 256 << 10
# Most a connection reads before it pays (hyper's largest read buffer).
READ_MAX = 400 << 10
CONNECTIONS = 4
SAMPLE_EVERY = 0.05
UPSTREAM_BYTES = re.compile(r'^larder_upstream_bytes_total\{upstream="origin.test"\}\s+([0-9.eE+-]+)$', re.M)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)(KiB|MiB|GiB)?", text)
    if not m:
        raise SystemExit(f"--rate {text!r}: write e.g. 8MiB")
    return int(m.group(1)) * {None: 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[m.group(2)]


def push(scratch: Path, port: int, repo: str, layers: int, mib: float, seed: int) -> list[dict]:
    """An image pushed with skopeo; its layer descriptors."""
    layout = scratch / f"oci-{seed}"
    herd.build_oci_layout(layout, layers, mib, seed)
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{layout}:{herd.TAG}",
                    f"docker://{HOST}:{port}/{repo}:{herd.TAG}"], check=True, capture_output=True, env=CHILD_ENV)
    shutil.rmtree(layout)
    st, body, _ = load.http_get(f"http://{HOST}:{port}/v2/{repo}/manifests/{herd.TAG}", {"Accept": OCI_MANIFEST})
    if st != 200:
        raise RuntimeError(f"origin: {repo} -> {st}")
    return json.loads(body)["layers"]


class Sampler(threading.Thread):
    """`larder_upstream_bytes_total` every SAMPLE_EVERY seconds: (monotonic
    time before the request, after the answer, bytes)."""

    def __init__(self, admin_port: int) -> None:
        super().__init__(daemon=True)
        self.url = f"http://{HOST}:{admin_port}/metrics"
        self.samples: list[tuple[float, float, int]] = []
        self.done = threading.Event()

    def read(self) -> int:
        _, body, _ = load.http_get(self.url, timeout=10)
        m = UPSTREAM_BYTES.search(body.decode(errors="replace"))
        return int(float(m.group(1))) if m else 0

    def run(self) -> None:
        while not self.done.is_set():
            t = time.monotonic()
            value = self.read()
            self.samples.append((t, time.monotonic(), value))
            self.done.wait(max(0.0, SAMPLE_EVERY - (time.monotonic() - t)))

    def stop(self) -> list[tuple[float, float, int]]:
        self.done.set()
        self.join()
        t = time.monotonic()
        value = self.read()
        self.samples.append((t, time.monotonic(), value))
        return self.samples


def get_blob(port: int, repo: str, layer: dict) -> float:
    t0 = time.monotonic()
    st, body, _ = load.http_get(f"http://{HOST}:{port}/v2/{repo}/blobs/{layer['digest']}", timeout=600)
    took = time.monotonic() - t0
    if st != 200 or "sha256:" + sha256_hex(body) != layer["digest"]:
        raise RuntimeError(f"GET {layer['digest']}: {st}, {len(body)} bytes")
    return took


def measure(samples: list[tuple[float, float, int]], t0: float, total: int) -> dict:
    """Seconds from t0 to the first sample that saw `total`, and the most
    bytes between two samples surely at most 1 s apart (from the start of
    the first one's request to the end of the second one's answer)."""
    end = next((after for _, after, b in samples if b >= total), samples[-1][1])
    window = 0
    for i, (before_i, _, bytes_i) in enumerate(samples):
        for _, after_j, bytes_j in samples[i + 1:]:
            if after_j - before_i > 1.0:
                break
            window = max(window, bytes_j - bytes_i)
    return {"bytes": samples[-1][2], "seconds": end - t0, "max_bytes_in_1s": window}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", default="8MiB", help="max_bandwidth, bytes per second (e.g. 8MiB)")
    ap.add_argument("--larder-bin", type=Path, help="skip the build and use this binary")
    args = ap.parse_args()
    rate = parse_size(args.rate)
    if args.larder_bin is None:
        subprocess.run(["cargo", "build", "--release", "--locked", "--bin", "larder"], cwd=REPO_ROOT, check=True)
    binary = (args.larder_bin or LARDER).resolve()
    depth = max(rate // 10, CHUNK)
    allowed_1s = rate + depth + CONNECTIONS * READ_MAX
    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-bandwidth-"))
    rows: dict[str, list[dict]] = {"one": [], "ahead": []}
    try:
        origin = load.start_distribution(procs, scratch / "origin", "origin", None)
        big = push(scratch, origin.port, "bench/one", 1, 48, 1)
        image = push(scratch, origin.port, "bench/ahead", 4, 12, 2)
        for rep in range(args.reps):
            for case in load.rotate(rows, rep):
                d = scratch / f"larder-{case}-{rep}"
                server = load.start_larder(procs, binary, d, d / "cache", origin.port, log=False,
                                           upstream_extra=f'max_bandwidth = "{rate}"\n')
                try:
                    sampler = Sampler(server.admin)
                    sampler.start()
                    t0 = time.monotonic()
                    if case == "one":
                        get_blob(server.port, "bench/one", big[0])
                        total = big[0]["size"]
                        first = None
                    else:
                        st, _, _ = load.http_get(f"http://{HOST}:{server.port}/v2/bench/ahead/manifests/{herd.TAG}",
                                                 {"Accept": OCI_MANIFEST})
                        if st != 200:
                            raise RuntimeError(f"manifest: {st}")
                        first = get_blob(server.port, "bench/ahead", image[0])
                        for layer in image[1:]:
                            get_blob(server.port, "bench/ahead", layer)
                        total = sum(layer["size"] for layer in image)
                    time.sleep(0.3)
                    row = measure(sampler.stop(), t0, total)
                    row["first_layer_s"] = first
                    if row["bytes"] != total:
                        raise RuntimeError(f"{case}: larder read {row['bytes']} bytes upstream, the image has {total}")
                    rows[case].append(row)
                    load.log(f"rep {rep + 1}/{args.reps} {case}: {json.dumps(row)}")
                finally:
                    procs.stop(server.proc)
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)

    def summary(xs: list[float], fmt: str = "{:.2f}") -> str:
        return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"

    print(f"\nmax_bandwidth = {rate} bytes/s ({rate / MIB:.1f} MiB/s), {args.reps} repetitions, median (min–max); "
          f"the bucket allows {allowed_1s} bytes in 1 s\n")
    print("| case | bytes | seconds | average MiB/s | most bytes in 1 s | ≤ allowed |")
    print("|---|---|---|---|---|---|")
    for case, rs in rows.items():
        avg = [r["bytes"] / r["seconds"] / MIB for r in rs]
        most = [r["max_bytes_in_1s"] for r in rs]
        print(f"| {case} | {rs[0]['bytes']} | {summary([r['seconds'] for r in rs])} | {summary(avg)} "
              f"| {summary(most, '{:.0f}')} | {'yes' if max(most) <= allowed_1s else '**no**'} |")
    firsts = [r["first_layer_s"] for r in rows["ahead"]]
    alone = image[0]["size"] / rate
    print(f"\nahead: the client's first layer took {summary(firsts)} s; {image[0]['size']} bytes alone at the cap "
          f"take {alone:.2f} s (minus what the bucket holds at the start)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
