#!/usr/bin/env python3
"""Cold paths, side by side: larder binaries against each other and against
the origin itself, over one real distribution origin.

Two measurements, each repeated with the order of the contestants rotated:

  pull  skopeo copy of an 8 x 8 MiB image (+ config) through a fresh larder
        (new process, empty cache), or straight from the origin ("direct");
        wall time, process start to exit, as in load.py's cold-pull row.
  blob  one 256 MiB blob with curl through a fresh larder, or direct:
        time to the last byte.

    python3 benches/cold_ab.py --reps 25 target/release/larder /tmp/other-larder

Prints each contestant's median (min-max) and, for each binary, its ratio to
direct per repetition. Loopback only; the machine's two cores are shared by
the origin, larder and the client, so run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import herd  # noqa: E402
import load  # noqa: E402
from herd import CHILD_ENV, HOST, OCI_MANIFEST, Procs, sha256_hex  # noqa: E402

BIG_BLOB = 256 << 20
BIG_REPO = "bench/big"
DIRECT = "direct"


def push_cold_image(scratch: Path, port: int) -> str:
    """The load benchmark's cold image (8 x 8 MiB gzip'd tar layers); its manifest digest."""
    herd.build_oci_layout(scratch / "cold-oci", 8, 8.0, 7)
    subprocess.run(["skopeo", "copy", "--dest-tls-verify=false", f"oci:{scratch / 'cold-oci'}:{load.TAG}",
                    f"docker://{HOST}:{port}/{load.COLD_REPO}:{load.TAG}"],
                   check=True, capture_output=True, env=CHILD_ENV)
    shutil.rmtree(scratch / "cold-oci")
    st, body, _ = load.http_get(f"http://{HOST}:{port}/v2/{load.COLD_REPO}/manifests/{load.TAG}",
                                {"Accept": OCI_MANIFEST})
    if st != 200:
        raise RuntimeError(f"origin: {load.COLD_REPO}:{load.TAG} -> {st}")
    return "sha256:" + sha256_hex(body)


def curl_blob(port: int, digest: str) -> float:
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code} %{size_download} %{time_total}",
                          f"http://{HOST}:{port}/v2/{BIG_REPO}/blobs/{digest}"],
                         capture_output=True, text=True, check=True).stdout.split()
    if out[0] != "200" or int(out[1]) != BIG_BLOB:
        raise RuntimeError(f"GET big blob: {out}")
    return float(out[2])


def report(name: str, times: dict[str, list[float]]) -> None:
    print(f"\n{name}: seconds, median (min-max) of {len(times[DIRECT])}")
    for who, ts in times.items():
        print(f"  {who:<40} {statistics.median(ts):.3f} ({min(ts):.3f}-{max(ts):.3f})")
    for who, ts in times.items():
        if who != DIRECT:
            rs = [a / b for a, b in zip(ts, times[DIRECT])]
            print(f"  {who:<40} / direct per rep: {statistics.median(rs):.3f} ({min(rs):.3f}-{max(rs):.3f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+", type=Path, help="larder binaries to compare")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", choices=("pull", "blob"), help="run one of the two measurements")
    args = ap.parse_args()
    bins = {str(b): b.resolve() for b in args.binaries}
    contestants = list(bins) + [DIRECT]
    procs = Procs()
    scratch = Path(tempfile.mkdtemp(prefix="larder-cold-ab-"))
    pulls: dict[str, list[float]] = {c: [] for c in contestants}
    blobs: dict[str, list[float]] = {c: [] for c in contestants}
    try:
        origin = load.start_distribution(procs, scratch / "origin", "origin", None)
        image = push_cold_image(scratch, origin.port) if args.only != "blob" else None
        big = load.push_blob(origin.port, BIG_REPO, os.urandom(BIG_BLOB)) if args.only != "pull" else None
        for rep in range(args.reps):
            for who in load.rotate(contestants, rep):
                for what, times in (("pull", pulls), ("blob", blobs)):
                    if args.only not in (None, what):
                        continue
                    larder, port = None, origin.port
                    if who != DIRECT:
                        d = scratch / f"larder-{rep}"
                        larder = load.start_larder(procs, bins[who], d, d / "cache", origin.port)
                        port = larder.port
                    try:
                        if what == "pull":
                            r = load.skopeo_pull(procs, port, scratch / "pull", image, 300)
                            if not r["ok"]:
                                raise RuntimeError(f"pull through {who}: {r['error']}")
                            times[who].append(r["wall_s"])
                        else:
                            times[who].append(curl_blob(port, big))
                    finally:
                        if larder is not None:
                            procs.stop(larder.proc)
                            shutil.rmtree(d, ignore_errors=True)
            load.log(f"rep {rep + 1}/{args.reps} done")
    finally:
        procs.stop_all()
        shutil.rmtree(scratch, ignore_errors=True)
    if args.only != "blob":
        report("cold pull, skopeo, 8 x 8 MiB", pulls)
    if args.only != "pull":
        report("cold 256 MiB blob, curl, time to last byte", blobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
