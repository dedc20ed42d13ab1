#!/usr/bin/env bash
# Fuzzes larder's parsers: every cargo-fuzz target in tests/fuzz/, one after
# the other, each for SECONDS_PER_TARGET seconds (default 20).
#
#   tests/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# Installs cargo-fuzz if missing (from crates.io), builds all targets once,
# then runs each on a scratch copy of its seed corpus (tests/fuzz/corpus/<t>/
# is never written). Exits non-zero if any target crashes, times out or
# fails to build; a failing input is kept in tests/fuzz/artifacts/<t>/ and the
# command reproducing it is printed. The last line is `N passed, M failed`.
#
# Build: `--dev --sanitizer none` unless CARGO_FUZZ_FLAGS says otherwise.
# Still coverage-guided (cargo-fuzz's sancov instrumentation of every crate),
# panics still end the run with the input kept, and the dev profile keeps
# debug assertions and overflow checks on. What it drops: optimisation and
# AddressSanitizer. larder's library has one unsafe block (the cachestat(2)
# syscall, which no parser reaches) and the targets have none, so ASan could
# only catch a memory error inside a dependency's unsafe code (http, bytes,
# serde_json, toml, regex, ...), which those crates' own fuzzing covers. Measured from an empty target dir on 2
# shared cores: cargo-fuzz's default (release, codegen-units=1, ASan) took
# 1706 CPU-s (1066 s of wall time in the last full CI run), this build 500
# CPU-s (so about 5 min of wall time, scaled by CPU time). Its exec/s is 0.19x
# (config) to 0.45x of the default's: at load 1.3 a 10 s run still replays the
# seeds and runs 2,500 (config) to 259,000 (range) inputs. For long runs by hand with ASan and full
# speed, use cargo-fuzz's defaults: CARGO_FUZZ_FLAGS= tests/fuzz.sh 300
#
# Only stable Rust is needed: RUSTC_BOOTSTRAP=1 unlocks the -Z flags
# (-Zsanitizer=address, when asked for) cargo-fuzz passes to rustc.
#
# Environment:
#   CARGO_FUZZ_FLAGS  the `cargo fuzz build/run` options (default "--dev --sanitizer none";
#                     set but empty: cargo-fuzz's release build with AddressSanitizer)
#   FUZZ_TIMEOUT      seconds one input may take before it counts as a hang (default 30)
#   FUZZ_BUILD_ONLY   1: install cargo-fuzz and build the targets, run none
#                     (CI builds them in the background while the tests run)
#   FUZZ_WORK_DIR     keep the build log, each target's libFuzzer log (<t>.log)
#                     and the grown corpora (corpus/<t>/) here instead of in a
#                     temporary folder that is removed at the end
set -euo pipefail
cd "$(dirname "$0")/.."

seconds="${1:-20}"
shift $(($# > 0 ? 1 : 0))
if ! [[ "$seconds" =~ ^[0-9]+$ ]] || [ "$seconds" -eq 0 ]; then
  echo "usage: tests/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]" >&2
  exit 2
fi
fuzz_dir=tests/fuzz
if (($#)); then
  targets=("$@")
else
  targets=()
  for f in "$fuzz_dir"/fuzz_targets/*.rs; do
    targets+=("$(basename "$f" .rs)")
  done
fi
read -r -a flags <<<"${CARGO_FUZZ_FLAGS---dev --sanitizer none}"
export RUSTC_BOOTSTRAP=1

if ! cargo fuzz --version >/dev/null 2>&1; then
  started=$SECONDS
  echo "fuzz: installing cargo-fuzz"
  cargo install cargo-fuzz --locked --quiet
  echo "fuzz: cargo-fuzz installed in $((SECONDS - started))s"
fi

if [ -n "${FUZZ_WORK_DIR:-}" ]; then
  work="$FUZZ_WORK_DIR"
  mkdir -p "$work"
else
  work="$(mktemp -d "${TMPDIR:-/tmp}/larder-fuzz.XXXXXX")"
  trap 'rm -rf "$work"' EXIT
fi

started=$SECONDS
# One target named: build only it; otherwise all of them in one cargo run.
only=()
if ((${#targets[@]} == 1)); then
  only=("${targets[0]}")
fi
echo "fuzz: building ${only[0]:-all targets}"
if cargo fuzz build --fuzz-dir "$fuzz_dir" "${flags[@]}" "${only[@]}" >"$work/build.log" 2>&1; then
  echo "fuzz: built in $((SECONDS - started))s"
else
  # A target that does not build fails below; the others still run.
  echo "fuzz: build failed after $((SECONDS - started))s:"
  tail -n 40 "$work/build.log"
  [ "${FUZZ_BUILD_ONLY:-0}" != 1 ] || exit 1
fi
[ "${FUZZ_BUILD_ONLY:-0}" != 1 ] || exit 0

passed=0
failed=0
for t in "${targets[@]}"; do
  corpus="$work/corpus/$t"
  rm -rf "$corpus"
  mkdir -p "$corpus"
  if [ -d "$fuzz_dir/corpus/$t" ]; then
    cp -R "$fuzz_dir/corpus/$t/." "$corpus/"
  fi
  log="$work/$t.log"
  echo "fuzz: $t for ${seconds}s"
  if cargo fuzz run --fuzz-dir "$fuzz_dir" "${flags[@]}" "$t" "$corpus" -- \
    -max_total_time="$seconds" -timeout="${FUZZ_TIMEOUT:-30}" -print_final_stats=1 >"$log" 2>&1; then
    passed=$((passed + 1))
    # libFuzzer's last status line (#runs, cov:, ft:, corp:) and its totals.
    stats="$(grep -E '^#[0-9]+' "$log" | tail -n 1 | sed -E 's/^#([0-9]+)[[:space:]]+[A-Z]+[[:space:]]+/\1 runs: /')"
    echo "fuzz: $t passed: ${stats:-no stats}"
  else
    failed=$((failed + 1))
    echo "fuzz: $t FAILED:"
    # The panic message (or sanitizer report) and libFuzzer's verdict; the
    # whole output is in $log when FUZZ_WORK_DIR is set.
    {
      grep -m 1 -A 8 -E "panicked at|ERROR: AddressSanitizer" "$log" | grep -v -E "^stack backtrace:|^ +[0-9]+: |^ +at " || true
      grep -E "^SUMMARY: |ERROR: libFuzzer|^error(\[|:)" "$log" || true
    } | cut -c 1-2000 | sed 's/^/    /'
    grep -q -E "Test unit written to|panicked at|ERROR: libFuzzer" "$log" || tail -n 40 "$log" | sed 's/^/    /'
    artifacts="$(grep -oE 'Test unit written to [^ ]+' "$log" | sed 's/^Test unit written to //' || true)"
    for a in $artifacts; do
      echo "fuzz: $t: failing input kept in $a"
      echo "fuzz: reproduce with: RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir $fuzz_dir ${flags[*]} $t $a"
    done
  fi
done

echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
