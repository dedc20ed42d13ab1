#!/bin/bash
# Cold fetch of one blob through larder from an HTTPS (h2) origin that is
# RTT_MS away, for each larder binary given; shows the effect of the upstream
# HTTP/2 flow-control windows. Everything on 127.0.0.1; the delay comes from
# delay.py, a TCP proxy holding every chunk RTT_MS/2 in each direction.
#
#   benches/h2window/run.sh [larder-binary ...]     (default: target/release/larder)
#   RTT_MS=100 SIZE_MIB=64 REPS=3                   (environment, defaults shown)
#
# Needs docker-registry, openssl, curl, python3. Prints one line per fetch
# plus curl's own fetch through the same delay, as a reference.
set -euo pipefail
RTT_MS=${RTT_MS:-100}; SIZE_MIB=${SIZE_MIB:-64}; REPS=${REPS:-3}
HERE=$(cd "$(dirname "$0")" && pwd)
BINS=("$@"); [ ${#BINS[@]} -gt 0 ] || BINS=("$HERE/../../target/release/larder")
W=$(mktemp -d /tmp/larder-h2window.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$W"; }
trap cleanup EXIT
cd "$W"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_up() { for _ in $(seq 100); do curl -s -o /dev/null "$@" && return 0; sleep 0.1; done; echo "not up: $*" >&2; exit 1; }

# A private CA and a leaf for 127.0.0.1; larder trusts the CA through ca_file.
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ca.key -out ca.pem -days 1 \
  -subj /CN=h2window-ca 2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout key.pem -out leaf.csr \
  -subj /CN=127.0.0.1 2>/dev/null
printf 'subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n' > ext.cnf
openssl x509 -req -in leaf.csr -CA ca.pem -CAkey ca.key -CAcreateserial -out cert.pem -days 1 -extfile ext.cnf 2>/dev/null

ORIGIN=$(free_port)
cat > registry.yml <<Y
version: 0.1
log: {level: warn, accesslog: {disabled: true}}
storage: {filesystem: {rootdirectory: $W/storage}}
http: {addr: 127.0.0.1:$ORIGIN, tls: {certificate: $W/cert.pem, key: $W/key.pem}}
Y
docker-registry serve registry.yml > registry.log 2>&1 & PIDS+=($!)
wait_up --cacert ca.pem "https://127.0.0.1:$ORIGIN/v2/"

head -c $((SIZE_MIB << 20)) /dev/urandom > blob
DIGEST=sha256:$(sha256sum blob | cut -d' ' -f1)
LOC=$(curl -s -D - -o /dev/null --cacert ca.pem -X POST "https://127.0.0.1:$ORIGIN/v2/exp/blobs/uploads/" \
  | tr -d '\r' | awk 'tolower($1)=="location:"{print $2}')
case $LOC in http*) ;; *) LOC="https://127.0.0.1:$ORIGIN$LOC" ;; esac
curl -sf --cacert ca.pem -X PUT -H 'Content-Type: application/octet-stream' --data-binary @blob \
  "$LOC&digest=$DIGEST" -o /dev/null

FAR=$(free_port)
python3 "$HERE/delay.py" "$FAR" "$ORIGIN" "$(python3 -c "print($RTT_MS / 2000)")" & PIDS+=($!)
wait_up --cacert ca.pem "https://127.0.0.1:$FAR/v2/"
echo "RTT ${RTT_MS} ms, blob ${SIZE_MIB} MiB"
echo "curl over h2 through the delay: $(curl -s --http2 --cacert ca.pem -o /dev/null \
  -w '%{time_total} s (HTTP/%{http_version})' "https://127.0.0.1:$FAR/v2/exp/blobs/$DIGEST")"

for rep in $(seq "$REPS"); do
  for bin in "${BINS[@]}"; do
    rm -rf cache got
    PORT=$(free_port); ADMIN=$(free_port)
    cat > larder.toml <<T
[server]
listen = "127.0.0.1:$PORT"
admin_listen = "127.0.0.1:$ADMIN"
[cache]
dir = "$W/cache"
[[upstream]]
name = "far.test"
url = "https://127.0.0.1:$FAR"
ca_file = "$W/ca.pem"
default = true
T
    RUST_LOG=warn "$bin" --config larder.toml > larder.log 2>&1 & L=$!
    wait_up "http://127.0.0.1:$PORT/v2/"
    T=$(curl -s -o got -w '%{time_total}' "http://127.0.0.1:$PORT/v2/exp/blobs/$DIGEST")
    cmp -s got blob && ok=exact || ok="WRONG BYTES"
    echo "rep $rep $bin: $T s, $ok"
    kill $L; wait $L 2>/dev/null || true
  done
done
