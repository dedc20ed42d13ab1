#!/usr/bin/env bash
# Builds larder's container image: charts/build-image.sh [TAG]
#
#   1. compiles a static larder (glibc with crt-static, release profile) for
#      the host's target triple, into its own target dir so it never waits
#      on (or invalidates) the usual target/ builds;
#   2. checks the binary is static and runs;
#   3. assembles the build context the Dockerfile expects in a temp dir;
#   4. `docker build`s it against the daemon named by DOCKER_HOST (or the
#      default socket), tagged larder:TAG (default larder:dev).
#
# Environment:
#   DOCKER_HOST               the Docker daemon to build with
#   DOCKER_BUILDKIT           default: 1 if `docker buildx` is available, else
#                             0 (the legacy builder; the Dockerfile runs
#                             nothing, so both give the same image)
#   LARDER_IMAGE_TARGET_DIR   cargo target dir of the static build
#                             (default: <repo>/target/image)
#   LARDER_IMAGE_PROFILE      cargo profile of the binary (default: release;
#                             dev builds unoptimized in a fraction of the
#                             time, for tests of the image rather than of
#                             its speed)
#   LARDER_IMAGE_DEBUGINFO    1: keep the release profile's line tables
#                             (binary about 70 MB instead of about 17 MB;
#                             symbols, hence function names in backtraces,
#                             are kept either way)
#   CARGO, RUSTC              the toolchain (default: cargo and rustc on PATH)
#   SOURCE_DATE_EPOCH         if set, the image's `created` label
#
# Steps and their durations are printed to stderr; the last stdout line is
# the image reference.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tag="${1:-dev}"
image="larder:${tag}"
target_dir="${LARDER_IMAGE_TARGET_DIR:-$repo/target/image}"

say() { echo "build-image: $*" >&2; }
die() { say "error: $*"; exit 1; }
now() { date +%s.%N; }
took() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1fs", b - a }'; }

# Under `cargo test`, CARGO names the cargo that runs the tests: same toolchain.
cargo="${CARGO:-cargo}"
rustc="${RUSTC:-rustc}"
command -v "$cargo" >/dev/null || die "cargo is not on PATH"
command -v docker >/dev/null || die "docker (the CLI) is not on PATH"

# --- 1. static binary -------------------------------------------------------
# --target matters: with it, RUSTFLAGS apply only to the target's code, so
# build scripts and proc macros stay dynamic (they must, to run on the host).
triple="$("$rustc" -vV | sed -n 's/^host: //p')"
[ -n "$triple" ] || die "cannot read the host triple from rustc -vV"
case "$triple" in
  *-linux-gnu*) ;;
  *) die "host triple $triple: this script builds a static glibc binary (*-linux-gnu) only" ;;
esac
profile="${LARDER_IMAGE_PROFILE:-release}"
case "$profile" in
  release) profile_dir=release; profile_env=RELEASE ;;
  dev) profile_dir=debug; profile_env=DEV ;;
  *) die "LARDER_IMAGE_PROFILE=$profile: release or dev" ;;
esac
if [ "${LARDER_IMAGE_DEBUGINFO:-0}" != 1 ]; then
  # No debug info in the image (and less to compile); symbols stay.
  export "CARGO_PROFILE_${profile_env}_DEBUG=false" "CARGO_PROFILE_${profile_env}_STRIP=debuginfo"
fi
say "building a static larder for $triple ($profile profile) in $target_dir"
started="$(now)"
# A caller's CARGO_ENCODED_RUSTFLAGS would silently replace RUSTFLAGS.
unset CARGO_ENCODED_RUSTFLAGS
(
  cd "$repo"
  RUSTFLAGS="${RUSTFLAGS:+$RUSTFLAGS }-C target-feature=+crt-static" \
    "$cargo" build --profile "$profile" --locked --bin larder --target "$triple" --target-dir "$target_dir"
)
binary="$target_dir/$triple/$profile_dir/larder"
say "static binary built in $(took "$started"): $binary ($(du -h "$binary" | cut -f1))"

# --- 2. is it static, and does it run? -------------------------------------
# `ldd` prints "not a dynamic executable" or "statically linked" for a
# static binary, and "lib… => …" lines for a dynamic one.
if command -v ldd >/dev/null; then
  if ldd "$binary" 2>&1 | grep -q '=>'; then
    ldd "$binary" >&2 || true
    die "$binary is dynamically linked"
  fi
fi
if command -v file >/dev/null && file -L "$binary" | grep -q 'dynamically linked'; then
  die "$binary is dynamically linked: $(file -L "$binary")"
fi
version="$("$binary" --version)" || die "$binary does not run"
say "runs: $version"

# --- 3. build context --------------------------------------------------------
context="$(mktemp -d "${TMPDIR:-/tmp}/larder-image.XXXXXX")"
trap 'rm -rf "$context"' EXIT
root="$context/rootfs"
install -d -m 0755 "$root/usr/local/bin" "$root/etc/larder"
install -d -m 1777 "$root/tmp"
install -d -m 0755 "$context/cache"
install -m 0755 "$binary" "$root/usr/local/bin/larder"

cat >"$root/etc/passwd" <<'EOF'
root:x:0:0:root:/root:/sbin/nologin
larder:x:65532:65532:larder:/var/lib/larder:/sbin/nologin
EOF
cat >"$root/etc/group" <<'EOF'
root:x:0:
larder:x:65532:
EOF
# glibc's built-in files and dns modules (static binaries included); without
# this file glibc would ask DNS before /etc/hosts.
cat >"$root/etc/nsswitch.conf" <<'EOF'
passwd: files
group:  files
hosts:  files dns
EOF
chmod 0644 "$root/etc/passwd" "$root/etc/group" "$root/etc/nsswitch.conf"

# The embedded default config, with the cache in the image's volume dir.
config="$root/etc/larder/larder.toml"
sed 's|^dir = .*$|dir = "/var/lib/larder"|' "$repo/config/default.toml" >"$config"
chmod 0644 "$config"
grep -qx 'dir = "/var/lib/larder"' "$config" || die "config/default.toml has no \`dir = …\` line to point at /var/lib/larder"
"$binary" check-config --config "$config" >&2 || die "the image's config does not validate"

cp "$repo/Dockerfile" "$repo/.dockerignore" "$context/"

# --- 4. docker build ---------------------------------------------------------
if [ -z "${DOCKER_BUILDKIT:-}" ]; then
  if docker buildx version >/dev/null 2>&1; then DOCKER_BUILDKIT=1; else DOCKER_BUILDKIT=0; fi
fi
export DOCKER_BUILDKIT
pkg_version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$repo/Cargo.toml" | head -n 1)"
revision="$(git -C "$repo" rev-parse HEAD 2>/dev/null || echo unknown)"
if [ "$revision" != unknown ] && [ -n "$(git -C "$repo" status --porcelain 2>/dev/null)" ]; then
  revision="$revision-dirty"
fi
if [ -n "${SOURCE_DATE_EPOCH:-}" ]; then
  created="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
else
  created="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
fi

say "docker build -t $image (DOCKER_HOST=${DOCKER_HOST:-default}, DOCKER_BUILDKIT=$DOCKER_BUILDKIT)"
started="$(now)"
docker build \
  --tag "$image" \
  --build-arg "VERSION=${pkg_version:-unknown}" \
  --build-arg "REVISION=$revision" \
  --build-arg "CREATED=$created" \
  "$context" >&2
size="$(docker image inspect --format '{{.Size}}' "$image")"
say "image built in $(took "$started"): $image, $((size / 1024 / 1024)) MiB ($size bytes)"
echo "$image"
