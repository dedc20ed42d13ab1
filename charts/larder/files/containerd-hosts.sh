#!/bin/sh
# containerd-hosts.sh: points this node's containerd at larder.
#
# For every registry larder mirrors it writes <hosts dir>/<registry>/hosts.toml
# with larder as the first host (containerd tries hosts in file order and
# falls back to `server`, the registry itself). Before writing anything it
# reads the node's containerd configuration and FAILS (exit 1, reason in the
# log and in the kubelet's termination message) when containerd would not
# read the files: that is the "silently bypassed" case, where pulls succeed
# from the registries directly and nobody notices.
#
# The larder Helm chart runs it as an init container: in node mode inside the
# larder DaemonSet itself (so a node gets a hosts.toml only with a larder on
# it), in deployment mode in the node setup DaemonSet; and on uninstall in
# cleanup mode. POSIX sh plus busybox awk, sed, base64: it runs in `busybox`.
#
# Modes (LARDER_MODE):
#   setup    check containerd's config, write the files, remove the ones this
#            release wrote before for registries it no longer mirrors
#   check    only check containerd's config and print what was found
#   dump     print containerd's config (with its imports) as flattened keys
#   cleanup  remove everything this release wrote (restoring files it merged into)
#
# Inputs (environment; the chart sets them all):
#   LARDER_RELEASE            "<namespace>/<release>", written into markers
#   LARDER_HOSTS_DIR          containerd's hosts folder as the node sees it
#   LARDER_HOSTS_MOUNT        where that folder is mounted here (read-write)
#   LARDER_CONTAINERD_CONFIG  containerd's config file as the node sees it;
#                             empty: not checked (a warning says so)
#   LARDER_CONFIG_DIR         node folder holding it (and its imports) ...
#   LARDER_CONFIG_MOUNT       ... mounted here read-only
#   LARDER_UPSTREAMS          one "<registry> <server url>" per line
#   LARDER_MIRRORS            one mirror URL per line, tried in this order;
#                             {nodeIP} becomes HOST_IP ([HOST_IP] for IPv6)
#   HOST_IP                   this node's IP (the pod's status.hostIP)
#   LARDER_CAPABILITIES       TOML array items, e.g. "pull", "resolve"
#   LARDER_REFERRERS          add "referrers" to them: always | never | auto
#                             (when the node's containerd is 2.2 or later)
#   LARDER_NODE_ROOT          (auto) a folder here with the node's /usr and
#                             bin folders mounted read-only at their paths
#   LARDER_CONTAINERD_BIN_DIRS  (auto) node folders searched for containerd
#   LARDER_DIAL_TIMEOUT       dial_timeout per mirror ("" leaves it out)
#   LARDER_EXISTING           for a hosts.toml this release did not write:
#                             prepend | keep | replace | fail
#   LARDER_ALLOW_PATH_LIST    "true": accept a config_path list that containerd
#                             2.1+ would ignore (with a warning)
#   LARDER_MIRROR_CA          CA file (here) of larder's TLS certificate, or ""
#   LARDER_MIRROR_USERNAME_FILE, LARDER_MIRROR_PASSWORD_FILE
#                             larder client credentials (files here), or ""
#   LARDER_TERMINATION_LOG    file for the failure reason (default
#                             /dev/termination-log, written only if it exists)

set -eu

MODE=${LARDER_MODE:-setup}
RELEASE=${LARDER_RELEASE:?LARDER_RELEASE is required}
HOSTS_DIR=${LARDER_HOSTS_DIR:?LARDER_HOSTS_DIR is required}
HOSTS_MOUNT=${LARDER_HOSTS_MOUNT:?LARDER_HOSTS_MOUNT is required}
TERMINATION_LOG=${LARDER_TERMINATION_LOG:-/dev/termination-log}

FILE_MARKER="# larder-managed-file: $RELEASE"
BLOCK_START="# >>> larder-managed-block: $RELEASE"
BLOCK_END="# <<< larder-managed-block: $RELEASE"
# Names of the files this script owns inside a registry folder.
CA_NAME=larder-mirror-ca.crt
SAVED_NAME=hosts.toml.larder-saved

log() { printf 'larder-node-setup: %s\n' "$*" >&2; }

fail() {
	log "ERROR: $*"
	if [ -f "$TERMINATION_LOG" ]; then
		printf '%s\n' "$*" >"$TERMINATION_LOG" || true
	fi
	exit 1
}

# ---------------------------------------------------------------- TOML reading

# Prints every key of a TOML file as "<path>\t<value>", the path's parts
# joined by "|" (quotes removed: plugins|io.containerd.grpc.v1.cri|registry|config_path).
# Strings are unquoted (a newline in one printed as \n); each string item of
# an array is printed as "<path>[]\t<item>"; inline tables are flattened.
# Enough TOML for containerd's configuration files, not a validator.
toml_flatten() {
	awk '
	function skip_ws() { while (i <= n && index(" \t\r", substr(src, i, 1))) i++ }
	function skip_ws_nl() {
		for (;;) {
			skip_ws()
			c = substr(src, i, 1)
			if (c == "\n") { i++; continue }
			if (c == "#") { skip_line(); continue }
			return
		}
	}
	function skip_line() { while (i <= n && substr(src, i, 1) != "\n") i++ }
	function read_basic(   out, c) {  # after the opening quote
		out = ""
		while (i <= n) {
			c = substr(src, i, 1)
			if (c == "\\") {
				c = substr(src, i + 1, 1); i += 2
				if (c == "n") out = out "\n"; else if (c == "t") out = out "\t"
				else out = out c
				continue
			}
			i++
			if (c == "\"") return out
			out = out c
		}
		return out
	}
	function read_literal(   out, c) {
		out = ""
		while (i <= n) { c = substr(src, i, 1); i++; if (c == "\047") return out; out = out c }
		return out
	}
	function read_multi(q,   out, j) {  # after the opening triple quote
		j = index(substr(src, i), q q q)
		if (j == 0) { out = substr(src, i); i = n + 1; return out }
		out = substr(src, i, j - 1); i += j + 2
		sub(/^\n/, "", out)
		return out
	}
	# A key up to (not including) the terminator, parts joined by "|".
	function read_key(term,   out, part, c, nparts) {
		out = ""; part = ""; nparts = 0
		while (i <= n) {
			c = substr(src, i, 1)
			if (c == term || c == "\n") break
			if (c == " " || c == "\t") { i++; continue }
			if (c == "\"") { i++; part = part read_basic(); continue }
			if (c == "\047") { i++; part = part read_literal(); continue }
			if (c == ".") { out = (nparts ? out "|" : "") part; nparts++; part = ""; i++; continue }
			part = part c; i++
		}
		return (nparts ? out "|" : "") part
	}
	function emit(path, value) { gsub(/\n/, "\\n", value); printf "%s\t%s\n", path, value }
	function read_value(path,   c, v) {
		skip_ws()
		c = substr(src, i, 1)
		if (substr(src, i, 3) == "\"\"\"") { i += 3; emit(path, read_multi("\"")); return }
		if (substr(src, i, 3) == "\047\047\047") { i += 3; emit(path, read_multi("\047")); return }
		if (c == "\"") { i++; emit(path, read_basic()); return }
		if (c == "\047") { i++; emit(path, read_literal()); return }
		if (c == "[") { i++; read_array(path); return }
		if (c == "{") { i++; read_inline(path); return }
		v = ""
		while (i <= n) {
			c = substr(src, i, 1)
			if (c == "\n" || c == "#" || c == "," || c == "]" || c == "}") break
			v = v c; i++
		}
		sub(/[ \t\r]+$/, "", v)
		emit(path, v)
	}
	function read_array(path,   c) {
		for (;;) {
			skip_ws_nl()
			if (i > n) return
			c = substr(src, i, 1)
			if (c == "]") { i++; return }
			if (c == ",") { i++; continue }
			if (c == "\"" || c == "\047") read_value(path "[]")
			else if (c == "[") { i++; read_array(path "[][]") }
			else if (c == "{") { i++; read_inline(path "[]") }
			else read_value(path "[]")
		}
	}
	function read_inline(path,   c, k) {
		for (;;) {
			skip_ws_nl()
			if (i > n) return
			c = substr(src, i, 1)
			if (c == "}") { i++; return }
			if (c == ",") { i++; continue }
			k = read_key("=")
			i++
			read_value(path "|" k)
		}
	}
	{ sub(/\r$/, ""); src = src $0 "\n" }
	END {
		n = length(src); i = 1; table = ""
		while (i <= n) {
			skip_ws_nl()
			if (i > n) break
			c = substr(src, i, 1)
			if (c == "[") {
				i++
				if (substr(src, i, 1) == "[") i++
				table = read_key("]")
				skip_line()
				continue
			}
			k = read_key("=")
			if (substr(src, i, 1) != "=") { skip_line(); continue }
			i++
			read_value(table == "" ? k : table "|" k)
		}
	}
	' "$1"
}

# The last value of a flattened key (later files and lines win, as in containerd).
flat_get() { awk -F '\t' -v k="$2" '$1 == k { v = $2; found = 1 } END { if (found) print v }' "$1"; }
flat_items() { awk -F '\t' -v k="$2[]" '$1 == k { print $2 }' "$1"; }
flat_has_prefix() { awk -F '\t' -v p="$2" 'index($1, p) == 1 { found = 1 } END { exit !found }' "$1"; }

# ------------------------------------------------------- containerd's config

# Path here of a node path under LARDER_CONFIG_DIR; fails for one outside it.
config_here() {
	case "$1" in
	"$CONFIG_DIR"/*) printf '%s\n' "$CONFIG_MOUNT/${1#"$CONFIG_DIR"/}" ;;
	*) return 1 ;;
	esac
}

strip_slash() {
	s=$1
	while [ "${#s}" -gt 1 ] && [ "${s%/}" != "$s" ]; do s=${s%/}; done
	printf '%s\n' "$s"
}

# Reads containerd's configuration (and its imports) and fails unless
# containerd's CRI plugin reads hosts files from HOSTS_DIR.
check_containerd() {
	CONFIG=${LARDER_CONTAINERD_CONFIG:-}
	if [ -z "$CONFIG" ]; then
		log "WARNING: containerd's configuration is not checked (nodeSetup.verifyContainerdConfig=false): make sure its CRI registry config_path is $HOSTS_DIR, or pulls bypass larder"
		return 0
	fi
	CONFIG_DIR=$(strip_slash "${LARDER_CONFIG_DIR:?LARDER_CONFIG_DIR is required}")
	CONFIG_MOUNT=$(strip_slash "${LARDER_CONFIG_MOUNT:?LARDER_CONFIG_MOUNT is required}")
	main=$(config_here "$CONFIG") || fail "containerd config $CONFIG is outside the mounted folder $CONFIG_DIR (chart bug or nodeSetup.containerdConfig/containerdConfigDir mismatch)"
	[ -f "$main" ] || fail "no containerd config at $CONFIG on this node: is nodeSetup.distribution right (containerd, k3s, rke2, talos)? Set nodeSetup.containerdConfig to the file containerd runs with"

	flat=$WORK/containerd.flat
	toml_flatten "$main" >"$WORK/main.flat"
	version=$(flat_get "$WORK/main.flat" version)
	version=${version:-1}
	: >"$flat"
	add_config_file "$main" "$version" "$CONFIG"
	unreadable=""
	config_base=$(dirname "$CONFIG")
	flat_items "$WORK/main.flat" imports >"$WORK/imports"
	while IFS= read -r imp; do
		[ -n "$imp" ] || continue
		case "$imp" in /*) ;; *) imp="$config_base/$imp" ;; esac
		if ! here=$(config_here "$imp"); then
			unreadable="$unreadable $imp"
			continue
		fi
		found_import=0
		for f in $here; do # a glob, as containerd allows
			[ -f "$f" ] || continue
			found_import=1
			add_config_file "$f" "$version" "$imp"
		done
		[ "$found_import" = 1 ] || log "containerd import $imp: no such file on this node"
	done <"$WORK/imports"

	case "$version" in
	3) cri=io.containerd.cri.v1.images; registry="plugins|$cri|registry"; cri_plugin=io.containerd.cri.v1.images; containerd_major=2.x ;;
	2) cri=io.containerd.grpc.v1.cri; registry="plugins|$cri|registry"; cri_plugin=io.containerd.grpc.v1.cri; containerd_major="1.x (or 2.x reading a version 2 config)" ;;
	*) cri=cri; registry="plugins|cri|registry"; cri_plugin=cri; containerd_major="1.x (version 1 config)" ;;
	esac
	config_path=$(flat_get "$flat" "$registry|config_path")
	if flat_items "$flat" disabled_plugins | grep -qxF "$cri_plugin"; then
		fail "$CONFIG disables containerd's CRI plugin ($cri_plugin): kubelet does not pull through this containerd"
	fi
	has_mirrors=0
	if awk -F '\t' -v p="$registry|mirrors|" 'index($1, p) == 1 && $1 ~ /\|endpoint\[\]$/ { found = 1 } END { exit !found }' "$flat"; then
		has_mirrors=1
	fi
	local_pull=$(flat_get "$flat" "plugins|io.containerd.cri.v1.images|use_local_image_pull")
	discard=$(flat_get "$flat" "plugins|io.containerd.cri.v1.images|discard_unpacked_layers")
	if [ "$version" = 2 ] && [ -z "$discard" ] &&
		flat_has_prefix "$flat" "plugins|io.containerd.grpc.v1.cri|containerd|runtimes|"; then
		# containerd 2.x migrates a version 2 config at start-up: the
		# registry moves to io.containerd.cri.v1.images, and so does
		# containerd.discard_unpacked_layers, but only from a config with a
		# containerd.runtimes table (plugins/cri/images/plugin.go,
		# migrateConfig).
		discard=$(flat_get "$flat" "plugins|io.containerd.grpc.v1.cri|containerd|discard_unpacked_layers")
	fi

	if [ "$MODE" = dump ]; then
		cat "$flat"
		exit 0
	fi
	if [ "$MODE" = check ]; then
		printf 'config=%s\nversion=%s\nconfig_path=%s\nmirrors=%s\nuse_local_image_pull=%s\ndiscard_unpacked_layers=%s\nunreadable_imports=%s\n' \
			"$CONFIG" "$version" "$config_path" "$has_mirrors" "$local_pull" "$discard" "${unreadable# }"
	fi

	if [ -z "$config_path" ]; then
		if [ -n "$unreadable" ]; then
			fail "$CONFIG does not set config_path and imports files this pod cannot read:$unreadable. Set nodeSetup.containerdConfigDir to a folder holding them"
		fi
		if [ "$has_mirrors" = 1 ]; then
			fail "containerd ($CONFIG) configures registries with the deprecated [${registry}.mirrors] tables and no config_path, so it never reads hosts.toml: pulls would bypass larder. Replace the mirrors with config_path = \"$HOSTS_DIR\" (containerd refuses both at once) and restart containerd"
		fi
		case "$version" in
		3) snippet="[plugins.\"io.containerd.cri.v1.images\".registry] config_path = \"$HOSTS_DIR\"" ;;
		2) snippet="[plugins.\"io.containerd.grpc.v1.cri\".registry] config_path = \"$HOSTS_DIR\"" ;;
		*) snippet="[plugins.cri.registry] config_path = \"$HOSTS_DIR\"" ;;
		esac
		fail "containerd ($CONFIG, config version $version, containerd $containerd_major) has no registry config_path, so it never reads hosts.toml: pulls would bypass larder. Add $snippet and restart containerd"
	fi

	matched=0
	before=""
	old_ifs=$IFS
	IFS=:
	for p in $config_path; do
		p=$(strip_slash "$p")
		if [ "$p" = "$HOSTS_DIR" ]; then
			matched=1
			break
		fi
		before="$before $p"
	done
	IFS=$old_ifs
	[ "$matched" = 1 ] || fail "containerd ($CONFIG) reads hosts files from config_path = \"$config_path\", but the chart writes them to $HOSTS_DIR: pulls would bypass larder. Set nodeSetup.hostsDir to the folder containerd reads"

	case "$config_path" in
	*:*)
		# containerd 2.1 and later pull through the transfer service unless
		# use_local_image_pull is on (or discard_unpacked_layers turns it
		# on), and the transfer service reads config_path as ONE folder
		# (containerd issues 12415, 12808): hosts files in a list's folders
		# are ignored, silently. containerd 2.x reads a version 2 config
		# too (migrated at start-up, the same pull path), so only a
		# version 1 config (containerd 1.x only) is known to be safe.
		if [ "$version" != 1 ] && [ "$local_pull" != true ] && [ "$discard" != true ]; then
			if [ "$version" = 3 ]; then
				who="containerd 2.x ($CONFIG, config version 3)"
				allow_when="containerd 2.0"
			else
				who="containerd ($CONFIG, config version 2: containerd 1.x, or 2.x, which migrates it at start-up)"
				allow_when="containerd 1.x or 2.0 on every node"
			fi
			if [ "${LARDER_ALLOW_PATH_LIST:-false}" != true ]; then
				fail "$who has config_path = \"$config_path\", a list: containerd 2.1 and later pull through the transfer service, which reads the whole list as ONE folder and ignores hosts files in $HOSTS_DIR (containerd issues 12415, 12808), so pulls would bypass larder. Set config_path = \"$HOSTS_DIR\", or use_local_image_pull = true under [plugins.\"io.containerd.cri.v1.images\"], or (with $allow_when) nodeSetup.allowConfigPathList=true"
			fi
			log "WARNING: $who has config_path = \"$config_path\", a list, accepted because nodeSetup.allowConfigPathList=true: containerd 2.1 and later would IGNORE the hosts files written here (the transfer service reads the list as one folder) and pull from the registries directly"
		fi
		if [ -n "$before" ]; then
			log "WARNING: config_path lists${before} before $HOSTS_DIR: a registry folder there takes precedence over the one written here"
		fi
		;;
	esac
	log "containerd ($CONFIG, config version $version) reads hosts files from $HOSTS_DIR"
}

add_config_file() {
	toml_flatten "$1" >"$WORK/file.flat"
	v=$(flat_get "$WORK/file.flat" version)
	if [ -n "$v" ] && [ "$v" != "$2" ]; then
		log "WARNING: $3 is config version $v, $CONFIG is version $2: reading its keys as version $2"
	fi
	cat "$WORK/file.flat" >>"$flat"
}

# ---------------------------------------------------- containerd's version

# containerd 2.2 was the first to accept the `referrers` capability
# (core/remotes/docker/config/hosts.go); 1.6 to 2.1 answer it with
# "unknown capability referrers" and ignore the whole hosts.toml. So it is
# written only when every containerd binary found says 2.2 or later.
REFERRERS_SINCE=2002 # 2.2, as major * 1000 + minor

# "<major * 1000 + minor>" of `containerd --version`'s output
# ("containerd <package> <version> <revision>", e.g. "containerd
# github.com/containerd/containerd/v2 v2.2.0 1c4457e…" or Debian's
# "containerd github.com/containerd/containerd 1.6.20~ds1 …"), one less
# for an alpha, beta or rc of x.y.0 (2.2.0-beta.0 did not know
# referrers); nothing when it does not read as a version.
containerd_version_key() {
	printf '%s\n' "$1" | awk 'NR == 1 && $1 == "containerd" {
		v = $3; sub(/^v/, "", v)
		if (!match(v, /^[0-9]+\.[0-9]+/)) exit
		split(substr(v, 1, RLENGTH), p, ".")
		# Beyond 6 digits awk prints 1e+23, which sh cannot compare.
		if (length(p[1]) > 6 || length(p[2]) > 6) exit
		pre = (v ~ /^[0-9]+\.[0-9]+\.0-(alpha|beta|rc)/) ? 1 : 0
		print p[1] * 1000 + p[2] - pre
	}'
}

# Sets REFERRERS (1: list "referrers" in hosts.toml) from LARDER_REFERRERS;
# for auto, runs each containerd binary found as the node would (chrooted
# in LARDER_NODE_ROOT, where the node's /usr is mounted: its loader and
# libraries are found through the merged-/usr links made here).
detect_referrers() {
	REFERRERS=0
	case "${LARDER_REFERRERS:-never}" in
	always) REFERRERS=1; log "referrers capability: always (nodeSetup.referrers)"; return 0 ;;
	never) return 0 ;;
	auto) ;;
	*) fail "LARDER_REFERRERS=$LARDER_REFERRERS: expected auto, always or never" ;;
	esac
	root=${LARDER_NODE_ROOT:-}
	if [ -z "$root" ] || [ ! -d "$root/usr" ]; then
		log "referrers capability left out: the node's /usr is not mounted (LARDER_NODE_ROOT), so containerd's version is unknown"
		return 0
	fi
	for link in bin sbin lib lib64; do
		[ -e "$root/$link" ] || [ -L "$root/$link" ] || ln -s "usr/$link" "$root/$link" 2>/dev/null || true
	done
	lowest=""
	unknown=""
	for dir in ${LARDER_CONTAINERD_BIN_DIRS:-}; do
		bin="${dir%/}/containerd"
		[ -e "$root$bin" ] || [ -L "$root$bin" ] || continue
		# Its answer goes to a file of at most 4 KiB (a binary that writes
		# forever is stopped by SIGXFSZ, not this container's memory limit),
		# and it is killed at 10 s (one that ignores SIGTERM holds nothing up).
		if (ulimit -f 8 && exec timeout -s KILL 10 chroot "$root" "$bin" --version) >"$WORK/version" 2>&1; then
			ran=1
		else
			ran=0
		fi
		out=$(head -c 4096 "$WORK/version")
		if [ "$ran" = 0 ]; then
			log "$bin --version failed: $(printf '%s' "$out" | head -n 1)"
			unknown="$unknown $bin"
			continue
		fi
		key=$(containerd_version_key "$out")
		if [ -z "$key" ]; then
			log "$bin --version: $(printf '%s' "$out" | head -n 1): not a version"
			unknown="$unknown $bin"
			continue
		fi
		log "$bin --version: $(printf '%s' "$out" | head -n 1)"
		if [ -z "$lowest" ] || [ "$key" -lt "$lowest" ]; then
			lowest=$key
		fi
	done
	if [ -n "$unknown" ]; then
		log "referrers capability left out: containerd's version is unknown ($unknown)"
	elif [ -z "$lowest" ]; then
		log "referrers capability left out: no containerd binary in $(printf '%s' "${LARDER_CONTAINERD_BIN_DIRS:-}" | tr '\n' ' ')(nodeSetup.containerdBinDirs)"
	elif [ "$lowest" -ge "$REFERRERS_SINCE" ]; then
		REFERRERS=1
		log "referrers capability written: containerd $((lowest / 1000)).$((lowest % 1000)) accepts it (2.2 and later)"
	else
		log "referrers capability left out: containerd $((lowest / 1000)).$((lowest % 1000)) would refuse the whole hosts.toml with it (2.2 and later accept it)"
	fi
}

# ----------------------------------------------------------- hosts.toml files

toml_string() {  # a TOML basic string
	printf '"%s"' "$(printf '%s' "$1" | sed 's/\\/\\\\/g; s/"/\\"/g')"
}

# Our block: one [host] table per mirror, between the markers.
render_block() {  # $1: registry folder (node path)
	printf '%s\n' "$BLOCK_START"
	printf '%s\n' "$MIRROR_URLS" | while IFS= read -r url; do
		[ -n "$url" ] || continue
		key=$(toml_string "$url")
		printf '[host.%s]\n' "$key"
		caps=${LARDER_CAPABILITIES:-\"pull\", \"resolve\"}
		[ "$REFERRERS" != 1 ] || caps="$caps, \"referrers\""
		printf '  capabilities = [%s]\n' "$caps"
		if [ -n "${LARDER_DIAL_TIMEOUT:-}" ]; then
			printf '  dial_timeout = %s\n' "$(toml_string "$LARDER_DIAL_TIMEOUT")"
		fi
		case "$url" in
		https://*)
			if [ -n "${LARDER_MIRROR_CA:-}" ]; then
				printf '  ca = %s\n' "$(toml_string "$1/$CA_NAME")"
			fi
			;;
		esac
		if [ -n "$AUTH_HEADER" ]; then
			printf '  [host.%s.header]\n' "$key"
			printf '    Authorization = %s\n' "$(toml_string "$AUTH_HEADER")"
		fi
	done
	printf '%s\n' "$BLOCK_END"
}

# Inserts the block file $2 into TOML file $1 before its first table
# (after the top-level keys, which belong to `server`), or at the end.
# A blank line follows the block, so that strip_block restores the bytes.
insert_block() {
	awk -v blockfile="$2" '
	function emit_block(   line) {
		while ((getline line < blockfile) > 0) print line
		close(blockfile)
		print ""
		done = 1
	}
	# Tracks multi-line strings and arrays, so that a "[" starting a line
	# inside them is not mistaken for a table.
	function scan(s,   j, c, m) {
		m = length(s); j = 1
		while (j <= m) {
			c = substr(s, j, 1)
			if (ml != "") {
				if (substr(s, j, 3) == ml ml ml) { ml = ""; j += 3; continue }
				if (ml == "\"" && c == "\\") { j += 2; continue }
				j++; continue
			}
			if (c == "#") return
			if (substr(s, j, 3) == "\"\"\"" || substr(s, j, 3) == "\047\047\047") { ml = c; j += 3; continue }
			if (c == "\"") { j++; while (j <= m && substr(s, j, 1) != "\"") { if (substr(s, j, 1) == "\\") j++; j++ }; j++; continue }
			if (c == "\047") { j++; while (j <= m && substr(s, j, 1) != "\047") j++; j++; continue }
			if (c == "[" || c == "{") depth++
			if (c == "]" || c == "}") depth--
			j++
		}
	}
	{
		header = (ml == "" && depth <= 0 && $0 ~ /^[ \t]*\[/)
		if (header && !done) emit_block()
		print
		if (header) { depth = 0; next }
		scan($0)
	}
	END { if (!done) { if (NR > 0) print ""; emit_block() } }
	' "$1"
}

# Removes our block (and the blank line after it) from TOML file $1.
strip_block() {
	awk -v start="$BLOCK_START" -v end="$BLOCK_END" '
	$0 == start { skip = 1; next }
	skip && $0 == end { skip = 0; after = 1; next }
	skip { next }
	after { after = 0; if ($0 == "") next }
	{ print }
	' "$1"
}

is_our_file() { [ -f "$1" ] && [ "$(head -n 1 "$1")" = "$FILE_MARKER" ]; }
has_our_block() { [ -f "$1" ] && grep -qxF "$BLOCK_START" "$1"; }
# k3s and rke2 regenerate the folders of the registries in their
# registries.yaml whenever they start, marking their files like this.
is_distro_file() { [ -f "$1" ] && head -n 1 "$1" | grep -q '^# File generated by [A-Za-z0-9_-]*\. DO NOT EDIT\.'; }

# Writes $2 to $1 by an atomic rename (containerd never reads half a file).
put_file() {  # $1 target, $2 source, $3 mode
	tmp="$(dirname "$1")/.$(basename "$1").larder-tmp"
	cp "$2" "$tmp"
	chmod "$3" "$tmp"
	mv -f "$tmp" "$1"
}

# Puts $WORK/new in place as $2 (and larder's CA beside it) in folder $1.
install_files() {
	mkdir -p "$1"
	if [ -n "${LARDER_MIRROR_CA:-}" ]; then
		put_file "$1/$CA_NAME" "$LARDER_MIRROR_CA" 0644
	fi
	put_file "$2" "$WORK/new" "$3"
}

# Writes the hosts.toml of registry $1 (fallback server $2).
write_registry() {
	name=$1
	server=$2
	dir="$HOSTS_MOUNT/$name"
	node_dir="$HOSTS_DIR/$name"
	file="$dir/hosts.toml"
	# containerd >= 1.7 looks for "host_port_" before "host:port".
	alt=""
	case "$name" in *:*) alt="$HOSTS_MOUNT/${name%:*}_${name##*:}_/hosts.toml" ;; esac
	if [ -n "$alt" ] && [ -f "$alt" ] && ! is_our_file "$alt"; then
		file=$alt
		dir=$(dirname "$alt")
		node_dir="$HOSTS_DIR/$(basename "$dir")"
	fi
	render_block "$node_dir" >"$WORK/block"
	mode=0644
	base=""
	if [ -f "$file" ] && ! is_our_file "$file"; then
		if is_distro_file "$file"; then
			fail "$node_dir/hosts.toml is managed by the distribution ($(head -n 1 "$file" | sed 's/^# //')): it rewrites the file whenever it starts, so larder's entry would not last. Add larder's mirror to the registry's endpoints in registries.yaml, or leave $name out with nodeSetup.excludeUpstreams"
		fi
		mode=$(stat -c %a "$file")
		base=$file
	elif [ -f "$HOSTS_MOUNT/_default/hosts.toml" ] && ! is_our_file "$HOSTS_MOUNT/_default/hosts.toml"; then
		# Without a folder of its own this registry used _default; the folder
		# written here replaces it, so it starts from _default's content
		# (again on every run: _default may have changed).
		base="$HOSTS_MOUNT/_default/hosts.toml"
	fi
	[ -z "$AUTH_HEADER" ] || mode=0600

	if [ -n "$base" ]; then
		policy=${LARDER_EXISTING:-prepend}
		if [ "$base" = "$file" ]; then
			what="$node_dir/hosts.toml"
		else
			what="$HOSTS_DIR/_default/hosts.toml (used for $name until now)"
		fi
		strip_block "$base" >"$WORK/base"
		case "$policy" in
		prepend)
			insert_block "$WORK/base" "$WORK/block" >"$WORK/new"
			if [ "$base" != "$file" ]; then
				{
					printf '%s\n' "$FILE_MARKER"
					printf '# Written by larder (release %s): a copy of %s with larder first.\n' "$RELEASE" "$what"
					cat "$WORK/new"
				} >"$WORK/new2"
				mv "$WORK/new2" "$WORK/new"
			fi
			install_files "$dir" "$file" "$mode"
			log "$name: larder prepended to the hosts of $what"
			return 0
			;;
		keep)
			if [ "$base" = "$file" ] && has_our_block "$file"; then
				put_file "$file" "$WORK/base" "$mode"
				rm -f "$dir/$CA_NAME"
			elif [ "$base" != "$file" ] && is_our_file "$file"; then
				rm -f "$file" "$dir/$CA_NAME"
				rmdir "$dir" 2>/dev/null || true
			fi
			log "WARNING: $name: $what exists and nodeSetup.existingHosts=keep: left as it is, pulls from $name do NOT go through larder"
			return 0
			;;
		replace)
			if [ "$base" = "$file" ] && [ ! -f "$dir/$SAVED_NAME" ]; then
				cp -p "$WORK/base" "$dir/$SAVED_NAME"
				log "$name: $what saved as $SAVED_NAME (restored on uninstall)"
			fi
			;;
		fail)
			fail "$what exists and nodeSetup.existingHosts=fail: set existingHosts to prepend (larder first, the existing hosts after it), keep or replace, or leave $name out with nodeSetup.excludeUpstreams"
			;;
		*) fail "LARDER_EXISTING=$policy: expected prepend, keep, replace or fail" ;;
		esac
	fi

	{
		printf '%s\n' "$FILE_MARKER"
		printf '# Written by larder (release %s) so that containerd pulls %s through larder,\n' "$RELEASE" "$name"
		printf '# falling back to the registry itself. Rewritten when larder starts, removed on uninstall.\n'
		printf 'server = %s\n\n' "$(toml_string "$server")"
		cat "$WORK/block"
	} >"$WORK/new"
	install_files "$dir" "$file" "$mode"
	log "$name: wrote $node_dir/hosts.toml (mirrors: $(printf '%s' "$MIRROR_URLS" | tr '\n' ' ')then $server)"
}

# Removes what this release wrote for every registry folder not in $1
# (a newline-separated list of folder names); restores files it merged into.
prune() {
	keep_list=$1
	for dir in "$HOSTS_MOUNT"/*; do
		[ -d "$dir" ] || continue
		name=$(basename "$dir")
		if printf '%s\n' "$keep_list" | grep -qxF "$name"; then
			continue
		fi
		file="$dir/hosts.toml"
		changed=0
		if is_our_file "$file"; then
			rm -f "$file" "$dir/$CA_NAME"
			if [ -f "$dir/$SAVED_NAME" ]; then
				mv -f "$dir/$SAVED_NAME" "$file"
				log "$name: restored the hosts.toml saved before larder replaced it"
			fi
			changed=1
		elif has_our_block "$file"; then
			strip_block "$file" >"$WORK/stripped"
			put_file "$file" "$WORK/stripped" 0644
			rm -f "$dir/$CA_NAME"
			changed=1
		fi
		if [ "$changed" = 1 ]; then
			rmdir "$dir" 2>/dev/null || true
			log "$name: removed larder's entry ($HOSTS_DIR/$name)"
		fi
	done
}

# ------------------------------------------------------------------------ main

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

case "$MODE" in
setup | check | dump | cleanup) ;;
*) fail "LARDER_MODE=$MODE: expected setup, check, dump or cleanup" ;;
esac

if [ "$MODE" = cleanup ]; then
	[ -d "$HOSTS_MOUNT" ] || exit 0
	prune ""
	log "cleanup done"
	exit 0
fi

check_containerd
detect_referrers
[ "$MODE" = setup ] || exit 0

[ -d "$HOSTS_MOUNT" ] || fail "$HOSTS_MOUNT ($HOSTS_DIR on the node) is not mounted"

# Mirror URLs with this node's address.
node_ip=${HOST_IP:-}
case "$node_ip" in *:*) node_ip="[$node_ip]" ;; esac
MIRROR_URLS=""
for url in ${LARDER_MIRRORS:?LARDER_MIRRORS is required}; do
	case "$url" in
	*"{nodeIP}"*)
		[ -n "$node_ip" ] || fail "HOST_IP is empty: the mirror $url needs this node's IP"
		url=$(printf '%s' "$url" | sed "s|{nodeIP}|$node_ip|g")
		;;
	esac
	MIRROR_URLS="$MIRROR_URLS$url
"
done

AUTH_HEADER=""
if [ -n "${LARDER_MIRROR_USERNAME_FILE:-}" ]; then
	user=$(cat "$LARDER_MIRROR_USERNAME_FILE")
	password=$(cat "${LARDER_MIRROR_PASSWORD_FILE:?LARDER_MIRROR_PASSWORD_FILE is required with a username}")
	AUTH_HEADER="Basic $(printf '%s:%s' "$user" "$password" | base64 | tr -d '\n')"
fi

written=""
printf '%s\n' "${LARDER_UPSTREAMS:-}" >"$WORK/upstreams"
while read -r name server; do
	[ -n "$name" ] || continue
	write_registry "$name" "$server"
	written="$written$(basename "$(dirname "$file")")
"
done <"$WORK/upstreams"

prune "$written"
log "done: $(printf '%s' "$written" | grep -c .) registries go through larder on this node"
