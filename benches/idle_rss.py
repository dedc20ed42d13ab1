#!/usr/bin/env python3
"""Idle memory: a fresh larder on the embedded default config (no --config),
before its first request, and what its resident pages are.

Each binary is started --reps times, in an order rotated per repetition, in a
network namespace of its own (`unshare -rn`: the embedded default listens on
0.0.0.0, which here is only that namespace's loopback) with an empty
working directory (the default cache folder ./larder-data), and measured
--settle seconds later: VmRSS from /proc/PID/status, and from
/proc/PID/smaps the resident KiB of each kind of mapping (the binary's
text, its read-only data, its relocated and writable data, heap and
anonymous mappings, thread stacks, other files).

    python3 benches/idle_rss.py --reps 5 target/release/larder [/tmp/other-larder ...]

Prints median (min-max) per binary and row. See benches/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def breakdown(pid: int, binary: str) -> dict[str, int]:
    """Resident KiB by kind of mapping, from /proc/PID/smaps."""
    out: dict[str, int] = {}
    name, perms = "", ""
    real = os.path.realpath(binary)
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split()
        if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
            perms = head[1]
            name = head[5] if len(head) >= 6 else ""
            continue
        if head and head[0] == "Rss:":
            kib = int(head[1])
            if name == real:
                kind = {"r-xp": "binary .text", "r--p": "binary read-only (.rodata, .eh_frame, .data.rel.ro)",
                        "rw-p": "binary .data/.bss"}.get(perms, "binary other")
            elif name == "[heap]":
                kind = "heap (brk)"
            elif name.startswith("[stack"):
                kind = "main stack"
            elif name.startswith("/") and (".so" in name):
                kind = "shared libraries"
            elif name.startswith("/"):
                kind = "other files"
            elif name.startswith("["):
                kind = "kernel ([vdso], [vvar])"
            else:
                kind = "anonymous (malloc arenas, thread stacks)"
            out[kind] = out.get(kind, 0) + kib
    return out


def status(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"):
            fields[k] = int(v.split()[0])
    return fields


def measure(binary: Path, settle: float) -> dict[str, int]:
    work = Path(tempfile.mkdtemp(prefix="larder-idle-"))
    try:
        env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
        p = subprocess.Popen(["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0"', str(binary)],
                             cwd=work, stdout=subprocess.DEVNULL, stderr=open(work / "stderr.log", "wb"), env=env)
        try:
            time.sleep(settle)
            if p.poll() is not None:
                raise RuntimeError(f"larder exited {p.returncode}: {(work / 'stderr.log').read_text()[-500:]}")
            row = status(p.pid)
            row.update(breakdown(p.pid, str(binary)))
            return row
        finally:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+", type=Path)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between start and measurement")
    args = ap.parse_args()
    bins = [b.resolve() for b in args.binaries]
    rows: dict[Path, list[dict[str, int]]] = {b: [] for b in bins}
    for rep in range(args.reps):
        for b in bins[rep % len(bins):] + bins[:rep % len(bins)]:
            rows[b].append(measure(b, args.settle))
    for b, rs in rows.items():
        print(f"\n{b}: KiB, median (min-max) of {len(rs)} starts")
        keys = ["VmRSS", "RssAnon", "RssFile", "Threads"] + sorted({k for r in rs for k in r} - {"VmRSS", "RssAnon", "RssFile", "RssShmem", "Threads"})
        for k in keys:
            xs = [r.get(k, 0) for r in rs]
            print(f"  {k:<58} {statistics.median(xs):>7.0f} ({min(xs)}-{max(xs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
