#!/usr/bin/env bash
# tests/chaos.sh [N]: the chaos test (tests/chaos.rs) for N rounds (default
# 20) instead of the 4 the suite runs: 3 larder replicas, a 3-node Garage
# cluster and the origin in network namespaces of their own, one fault per
# round (a replica cut off from its peers, a Garage node cut off, a slow
# replica link, the owner killed mid-fill), the invariants checked after
# every round and printed as a table. Needs root and Garage (built by
# tests/run.sh into ~/.cache/larder-tests). About 20 s per round here.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-20}"
export LARDER_TEST_GARAGE="${LARDER_TEST_GARAGE:-${XDG_CACHE_HOME:-$HOME/.cache}/larder-tests/garage-2.5.0-lmdb-o1/bin/garage}"
export CHAOS_ROUNDS="$rounds"
export CHAOS_TIME_LIMIT="${CHAOS_TIME_LIMIT:-$((rounds * 120))}"
cargo test --test chaos -- --nocapture
