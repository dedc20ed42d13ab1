#!/usr/bin/env bash
# larder's whole test suite, runnable on a fresh Debian machine:
#   1. installs the real peers the integration tests use, if missing
#      (distribution as the origin registry, skopeo, containerd, dockerd,
#      Prometheus and promtool, headless Chromium for the status page,
#      `script` for a pseudo-terminal, and Garage for the shared tier);
#      nothing is started through systemd: each test starts its own;
#   2. checks formatting and lints;
#   3. runs every unit and integration test, then the Helm chart's tests
#      (rendering, and the node setup script against a real containerd).
set -euo pipefail
cd "$(dirname "$0")/.."

# Garage, the distributed object store the shared-tier tests run (3 nodes
# on loopback). Built from crates.io once into a cache folder that later
# runs reuse; the harness finds it there. Only what the tests use is built
# (the LMDB metadata engine; no metrics, SQLite or K2V) at opt-level 1:
# 21 CPU-minutes, and the tests' small objects do not need a faster Garage.
# It builds in the background while the packages install and larder's
# tests compile (a fresh machine's run did these one after the other, on
# one of its two cores on average); the tests wait for it.
GARAGE_VERSION=2.5.0
GARAGE_ROOT="${XDG_CACHE_HOME:-$HOME/.cache}/larder-tests/garage-$GARAGE_VERSION-lmdb-o1"
export LARDER_TEST_GARAGE="$GARAGE_ROOT/bin/garage"
garage_build=""
if [ ! -x "$LARDER_TEST_GARAGE" ]; then
  mkdir -p "$(dirname "$GARAGE_ROOT")"
  echo "tests/run.sh: building Garage $GARAGE_VERSION into $GARAGE_ROOT in the background (once; log: $GARAGE_ROOT.log)"
  CARGO_PROFILE_RELEASE_OPT_LEVEL=1 CARGO_PROFILE_RELEASE_DEBUG=0 \
    cargo install garage --version "$GARAGE_VERSION" --locked --root "$GARAGE_ROOT" \
    --no-default-features --features bundled-libs,lmdb >"$GARAGE_ROOT.log" 2>&1 &
  garage_build=$!
fi

need=()
command -v docker-registry >/dev/null || need+=(docker-registry)
command -v skopeo >/dev/null || need+=(skopeo)
command -v containerd >/dev/null || need+=(containerd)
command -v dockerd >/dev/null || need+=(docker.io)
# tests/private_images_clients.rs pulls with podman --creds.
command -v podman >/dev/null || need+=(podman)
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v chromium >/dev/null || need+=(chromium)
command -v script >/dev/null || need+=(bsdutils)
# The chart's node setup script runs under busybox in its tests, and is linted.
command -v busybox >/dev/null || need+=(busybox)
command -v shellcheck >/dev/null || need+=(shellcheck)
# The chart tests make a peer-TLS test certificate with the openssl CLI.
command -v openssl >/dev/null || need+=(openssl)
# The load and connection benchmarks' smoke run (below): nginx as the
# reference server, wrk as the load generator.
command -v nginx >/dev/null || need+=(nginx)
command -v wrk >/dev/null || need+=(wrk)
command -v curl >/dev/null || need+=(curl)
# Tests that run in network namespaces of their own (tests/ssrf.rs,
# tests/chaos.rs):
# `unshare` and `mount` (util-linux, mount), `ip` (iproute2).
command -v unshare >/dev/null || need+=(util-linux)
# charts/test_nodesetup.py drops SYS_CHROOT with setpriv (util-linux).
command -v setpriv >/dev/null || need+=(util-linux)
command -v mount >/dev/null || need+=(mount)
command -v ip >/dev/null || need+=(iproute2)
# The cluster chaos test (tests/chaos.rs) partitions its namespaces with nft.
command -v nft >/dev/null || need+=(nftables)
if ((${#need[@]})); then
  echo "tests/run.sh: installing ${need[*]}"
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

# The Helm chart is rendered, linted and validated with Helm's own engine
# (bundled in helm-python-sdk) and the Kubernetes schemas; grpcio calls
# containerd's CRI PullImage in the node setup test; bcrypt writes the
# htpasswd of benches/verify.py's origin.
python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore \
  helm-python-sdk kubernetes-validate pyyaml grpcio bcrypt

cargo fmt --all -- --check
cargo clippy --all-targets --locked -- -D warnings
cargo test --all-targets --locked --no-run "$@"
if [ -n "$garage_build" ]; then
  if ! wait "$garage_build"; then
    tail -n 50 "$GARAGE_ROOT.log"
    echo "tests/run.sh: building Garage failed (log: $GARAGE_ROOT.log)"
    exit 1
  fi
  echo "tests/run.sh: Garage $GARAGE_VERSION built"
fi
cargo test --all-targets --locked "$@"
LARDER_BIN=target/debug/larder python3 charts/test_chart.py
# Alerts (promtool check/test rules), the admin token Secret, the sidecar
# library and its example parent chart.
LARDER_BIN=target/debug/larder python3 charts/test_operator_chart.py
LARDER_BIN=target/debug/larder python3 charts/test_nodesetup.py
# The issue-13 benchmark scripts once each at toy scale with the debug
# build (benches/scale.rs runs at 10^4 blobs under `cargo test` above), so
# they cannot rot; the figures of this run mean nothing.
bench_out="$(mktemp -d)"
python3 benches/load.py --reps 1 --duration 1 --no-latency --larder-bin target/debug/larder --out "$bench_out/load"
python3 benches/connections.py --reps 1 --duration 1 --idle 300 --larder-bin target/debug/larder --out "$bench_out/connections"
python3 benches/verify.py --reps 1 --duration 1 --larder-bin target/debug/larder --out "$bench_out/verify"
rm -rf "$bench_out"
