#!/usr/bin/env python3
"""Tests of the chart's node setup: the rendered containerd-hosts.sh script
against prepared node file systems, and against a real containerd.

Needs: busybox, shellcheck, containerd + ctr (1.6 here), docker-registry,
skopeo, util-linux (unshare, mount, setpriv), python3 -m pip install
helm-python-sdk kubernetes-validate pyyaml grpcio; and a larder binary
($LARDER_BIN, default target/debug/larder). Runs as root (a private
containerd, /etc/hosts pins a made-up registry name to 127.0.0.1, and the
script's chroot into the node's /usr, bind-mounted in a mount namespace of
its own as the container runtime would mount it).

Everything is taken from the chart as Helm renders it: the script is the
ConfigMap's containerd-hosts.sh, and it runs with the environment and
mounts of the rendered init container (hostPath and other volumes mapped to
temporary folders standing for the node), under busybox's sh, awk and sed,
as in the busybox image the chart uses.

  * fake nodes: containerd 1.6 (its own `containerd config default`) and
    2.x configs with and without config_path, the deprecated mirrors, a
    config_path list in version 2 and 3 configs (the transfer service
    case), imports, a disabled CRI
    plugin, k3s, rke2 and Talos layouts, an existing hosts.toml (prepend,
    keep, replace, fail), _default, pruning, IPv6, TLS + credentials, the
    uninstall cleanup hook, the host-network listen address; exit status,
    files written (parsed with tomllib) and the failure messages;
  * the script's TOML reader against tomllib on real configuration files;
  * the `referrers` capability (nodeSetup.referrers: auto): the node's own
    `containerd --version`, run chrooted in its /usr, for the real
    containerd 1.6 binary and binaries printing what 1.7.0, 2.1.0, 2.2.0,
    2.2.0-beta.0 and 2.3.0 release builds print; unknown versions, two
    binaries, no SYS_CHROOT; always / never; the exact hosts.toml text;
  * shellcheck on the script;
  * a real containerd 1.6 (private instance, CRI plugin on) pointed at a
    real larder (the rendered larder.toml) through hosts files the script
    wrote, with a node-IP-style address (127.0.0.1): pulls with `ctr` and
    with the CRI (PullImage over containerd's socket), through larder;
    then with `referrers` in the file (containerd 1.6 drops the whole file:
    "unknown capability referrers"), then with larder down (connection
    refused: containerd falls back to
    the registry), and with larder's address dropping connections, which
    shows what containerd 1.6 does with dial_timeout (it ignores it).

Prints one line per check and, last, "N passed, M failed".
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import platform
import shutil
import shlex
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import traceback
from pathlib import Path

import test_chart as tc
from test_chart import check

RELEASE = f"{tc.NAMESPACE}/larder"
NODE_IP = "10.0.0.5"
HUB = {"name": "docker.io", "url": "https://registry-1.docker.io"}
UPSTREAMS = [
    {"name": "docker.io", "url": "https://registry-1.docker.io", "default": True},
    {"name": "ghcr.io", "url": "https://ghcr.io"},
    {"name": "quay.io", "url": "https://quay.io"},
]
NAMES = [u["name"] for u in UPSTREAMS]

# containerd 2.x's own defaults for the CRI image plugin (docs/cri/config.md).
V3_DEFAULT = """version = 3
root = '/var/lib/containerd'
state = '/run/containerd'

[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'overlayfs'
    disable_snapshot_annotations = true
    discard_unpacked_layers = false
    max_concurrent_downloads = 3
    image_pull_progress_timeout = '5m0s'

    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = 'registry.k8s.io/pause:3.10'

    [plugins.'io.containerd.cri.v1.images'.registry]
      config_path = ''

  [plugins.'io.containerd.grpc.v1.cri']
    disable_tcp_service = true
    stream_server_address = '127.0.0.1'
"""

# An existing hosts.toml: a corporate mirror with its CA, a client
# certificate (a multi-line array whose lines start with "[") and a header.
CORPORATE = """server = "https://registry-1.docker.io"
# Corporate mirror first, then Docker Hub.
[host."https://mirror.corp.example"]
  capabilities = ["pull", "resolve"]
  ca = "corp-ca.crt"
  client = [
    ["client.cert", "client.key"],
  ]
  [host."https://mirror.corp.example".header]
    X-Team = "platform"
"""

BUSYBOX_BIN: Path | None = None
CONTAINERD_DEFAULT: str = ""


# ------------------------------------------------------------------ helpers


def busybox_bin() -> Path | None:
    """A folder of busybox applet links: the script's PATH, as in the image."""
    busybox = shutil.which("busybox")
    if not busybox:
        return None
    d = Path(tempfile.mkdtemp(prefix="larder-busybox-"))
    applets = subprocess.run([busybox, "--list"], capture_output=True, text=True, check=True).stdout.split()
    for a in applets:
        (d / a).symlink_to(busybox)
    return d


def containerd_default_config() -> str:
    """containerd 1.6's own default config (`containerd config default`)."""
    p = subprocess.run(["containerd", "config", "default"], capture_output=True, text=True, timeout=30)
    return p.stdout if p.returncode == 0 else ""


def with_config_path(default: str, path: str) -> str:
    assert 'config_path = ""' in default
    return default.replace('config_path = ""', f'config_path = "{path}"', 1)


def render(label: str, values: dict) -> tc.Rendered | None:
    """Renders (test_chart.py validates the objects of every mode)."""
    return tc.render(label, values, validate=False)


def node_values(**node_setup) -> dict:
    return {"mode": "node", "upstreams": UPSTREAMS, "nodeSetup": {"enabled": True, **node_setup}}


class Node:
    """A node's file system under a temporary folder."""

    def __init__(self, root: Path | None = None):
        self._tmp = None
        if root is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="larder-node-")
            root = Path(self._tmp.name)
        self.root = root

    def path(self, node_path: str) -> Path:
        return self.root / node_path.lstrip("/")

    def write(self, node_path: str, text: str) -> Path:
        p = self.path(node_path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
        return p

    def read(self, node_path: str) -> str:
        return self.path(node_path).read_text()

    def exists(self, node_path: str) -> bool:
        return self.path(node_path).exists()

    def files(self, node_dir: str) -> dict[str, str]:
        base = self.path(node_dir)
        if not base.is_dir():
            return {}
        return {str(f.relative_to(base)): f.read_text() for f in sorted(base.rglob("*")) if f.is_file()}

    def cleanup(self) -> None:
        if self._tmp:
            self._tmp.cleanup()


class Run:
    def __init__(self, rc: int, out: str, err: str, message: str):
        self.rc, self.out, self.err, self.message = rc, out, err, message

    def __repr__(self) -> str:
        return f"rc={self.rc} message={self.message!r} stderr={self.err[-1500:]!r}"


def pod_spec(r: tc.Rendered, kind: str, name: str) -> dict:
    return r.get(kind, name)["spec"]["template"]["spec"]


def init_container(spec: dict, name: str) -> dict:
    return next(c for c in spec.get("initContainers", []) if c["name"] == name)


def run_container(
    r: tc.Rendered,
    spec: dict,
    container: dict,
    node: Node,
    host_ip: str = NODE_IP,
    secrets: dict[str, dict[str, str]] | None = None,
    env_override: dict[str, str] | None = None,
    volume_dirs: dict[str, Path] | None = None,
    prefix: list[str] | None = None,
) -> Run:
    """Runs a rendered container's command under busybox with its rendered
    environment; its volumes are mapped to folders: hostPath volumes into
    the node, ConfigMaps from the rendering, Secrets from `secrets`
    ({secret name: {key: content}}), emptyDirs to fresh folders."""
    assert BUSYBOX_BIN is not None
    with tempfile.TemporaryDirectory(prefix="larder-pod-") as pod:
        pod_dir = Path(pod)
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts: list[tuple[str, Path]] = []
        for m in container.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "hostPath" in v:
                target = node.path(v["hostPath"]["path"])
                if v["hostPath"].get("type") == "DirectoryOrCreate":
                    target.mkdir(parents=True, exist_ok=True)
            else:
                target = (volume_dirs or {}).get(m["name"]) or pod_dir / "volumes" / m["name"]
                target.mkdir(parents=True, exist_ok=True)
                if "configMap" in v:
                    data = r.get("ConfigMap", v["configMap"]["name"])["data"]
                    items = v["configMap"].get("items") or [{"key": k, "path": k} for k in data]
                    for it in items:
                        (target / it["path"]).write_text(data[it["key"]])
                elif "secret" in v:
                    data = (secrets or {})[v["secret"]["secretName"]]
                    for it in v["secret"]["items"]:
                        (target / it["path"]).write_text(data[it["key"]])
            mounts.append((m["mountPath"], target))
        mounts.sort(key=lambda m: -len(m[0]))
        # A mount inside another one (the node's /usr inside the node-root
        # emptyDir) is bind-mounted there, read-only, in a mount namespace
        # of the script's own (gone when it exits), as the runtime mounts
        # it, so that a chroot into the outer one sees it.
        pod_targets = {t for _, t in mounts if str(t).startswith(str(pod_dir))}
        nested, binds = [], []
        for mount_path, target in mounts:
            outer = next(((mp, t) for mp, t in mounts if mount_path.startswith(mp + "/") and t in pod_targets), None)
            if outer:
                inside = outer[1] / mount_path[len(outer[0]) + 1 :]
                inside.mkdir(parents=True, exist_ok=True)
                if target.is_dir():
                    binds.append((target, inside))
                nested.append((mount_path, inside))
            else:
                nested.append((mount_path, target))
        mounts = nested
        if binds:
            mount = shutil.which("mount") or "/usr/bin/mount"
            script = "".join(
                f"{mount} --rbind {shlex.quote(str(src))} {shlex.quote(str(dst))} && "
                f"{mount} -o remount,bind,ro {shlex.quote(str(dst))} && "
                for src, dst in binds
            )
            unshare = shutil.which("unshare") or "/usr/bin/unshare"
            prefix = [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", script + 'exec "$@"', "sh", *(prefix or [])]

        def here(path: str) -> str:
            for mount_path, target in mounts:
                if path == mount_path or path.startswith(mount_path + "/"):
                    return str(target) + path[len(mount_path) :]
            return path

        env = {"PATH": str(BUSYBOX_BIN)}
        for e in container.get("env", []):
            if "value" in e:
                env[e["name"]] = e["value"]
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "status.hostIP":
                env[e["name"]] = host_ip
        for key in ("LARDER_HOSTS_MOUNT", "LARDER_CONFIG_MOUNT", "LARDER_MIRROR_CA", "LARDER_NODE_ROOT"):
            if key in env:
                env[key] = here(env[key])
        for key in ("LARDER_MIRROR_USERNAME_FILE", "LARDER_MIRROR_PASSWORD_FILE"):
            if key in env:
                env[key] = here(env[key])
        env["TMPDIR"] = here("/tmp")
        termination = pod_dir / "termination-log"
        termination.write_text("")
        env["LARDER_TERMINATION_LOG"] = str(termination)
        env.update(env_override or {})

        cmd = container["command"]
        assert cmd[0] == "/bin/sh", cmd
        args = [here(a) if a.startswith("/") else a for a in cmd[1:]]
        if args and args[0] == "-c":
            # An inline script: map the paths it names.
            text = args[1]
            for mount_path, target in mounts:
                text = text.replace(mount_path + "/", str(target) + "/")
            args = ["-c", text]
        command = [*(prefix or []), str(BUSYBOX_BIN / "sh"), *args]
        p = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
        return Run(p.returncode, p.stdout, p.stderr, termination.read_text().strip())


def setup_run(r: tc.Rendered, node: Node, **kw) -> Run:
    """The node-mode larder DaemonSet's containerd-hosts init container,
    or the deployment mode's node setup DaemonSet's."""
    try:
        spec = pod_spec(r, "DaemonSet", "larder")
    except KeyError:
        spec = pod_spec(r, "DaemonSet", "larder-node-setup")
    return run_container(r, spec, init_container(spec, "containerd-hosts"), node, **kw)


def hosts_of(text: str) -> list[str]:
    """The [host."..."] entries of a hosts.toml, in file order (containerd's order)."""
    order = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("[host.") and not s.endswith(".header]"):
            key = tomllib.loads(s + "\n")["host"]
            (name,) = key.keys()
            if name not in order:
                order.append(name)
    return order


def parses(text: str) -> dict | None:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return None


# ------------------------------------------------------ containerd's config


def check_containerd_configs() -> None:
    """What the script accepts and refuses, by containerd version and config."""
    r = render("nodeSetup node mode", node_values())
    if not r:
        return
    hosts_dir = "/etc/containerd/certs.d"
    config = "/etc/containerd/config.toml"

    def case(label: str, files: dict[str, str], expect_ok: bool, needles: tuple[str, ...] = (), rr=None) -> Node:
        node = Node()
        for path, text in files.items():
            node.write(path, text)
        run = setup_run(rr or r, node)
        written = node.files(hosts_dir)
        if expect_ok:
            check(f"[containerd] {label}: accepted, exit 0", run.rc == 0, run)
            check(
                f"[containerd] {label}: a hosts.toml per upstream",
                sorted(k for k in written if k.endswith("hosts.toml")) == sorted(f"{n}/hosts.toml" for n in NAMES),
                sorted(written),
            )
        else:
            check(f"[containerd] {label}: refused, exit 1", run.rc == 1, run)
            check(f"[containerd] {label}: no hosts file written", not written, sorted(written))
            check(
                f"[containerd] {label}: the reason is the termination message",
                run.message and all(n in run.message for n in needles) and run.message in run.err,
                run,
            )
        return node

    d16 = CONTAINERD_DEFAULT
    check("[containerd] `containerd config default` (1.6) available", d16, "containerd config default failed")
    if d16:
        node = case("1.6 default config, config_path set", {config: with_config_path(d16, hosts_dir)}, True)
        docker = tomllib.loads(node.read(f"{hosts_dir}/docker.io/hosts.toml"))
        check(
            "[containerd] docker.io/hosts.toml: server, larder on the node's IP first, pull+resolve, dial_timeout",
            docker
            == {
                "server": "https://registry-1.docker.io",
                "host": {f"http://{NODE_IP}:5000": {"capabilities": ["pull", "resolve"], "dial_timeout": "1s"}},
            },
            docker,
        )
        check(
            "[containerd] the file starts with this release's marker",
            node.read(f"{hosts_dir}/docker.io/hosts.toml").startswith(f"# larder-managed-file: {RELEASE}\n"),
        )
        mode = stat.S_IMODE(node.path(f"{hosts_dir}/docker.io/hosts.toml").stat().st_mode)
        check("[containerd] hosts.toml mode 0644", mode == 0o644, oct(mode))
        node.cleanup()
        case(
            "1.6 default config as shipped (config_path empty)",
            {config: d16},
            False,
            (
                "no registry config_path",
                '[plugins."io.containerd.grpc.v1.cri".registry] config_path = "/etc/containerd/certs.d"',
            ),
        ).cleanup()
        mirrors = d16.replace(
            '[plugins."io.containerd.grpc.v1.cri".registry.mirrors]',
            '[plugins."io.containerd.grpc.v1.cri".registry.mirrors]\n'
            '        [plugins."io.containerd.grpc.v1.cri".registry.mirrors."docker.io"]\n'
            '          endpoint = ["https://mirror.gcr.io"]',
        )
        case(
            "1.6 with the deprecated registry.mirrors (GKE-style)", {config: mirrors}, False, ("deprecated",)
        ).cleanup()
        case(
            "1.6 with config_path in another folder",
            {config: with_config_path(d16, "/etc/docker/certs.d")},
            False,
            ('config_path = "/etc/docker/certs.d"', "nodeSetup"),
        ).cleanup()
        # A version 2 config with a list: containerd 1.x reads the list in
        # order, but containerd 2.x migrates a version 2 config at start-up
        # and from 2.1 pulls through the transfer service, which reads the
        # list as one folder. The file does not say which containerd runs.
        v2_list = with_config_path(d16, "/etc/containerd/certs.d:/etc/docker/certs.d")
        case(
            "version 2 config (1.6 default) with a config_path list: refused (2.1+ would ignore the files)",
            {config: v2_list},
            False,
            ("config version 2", "transfer service", "12415", "nodeSetup.allowConfigPathList=true"),
        ).cleanup()
        case(
            "version 2 config with a list, discard_unpacked_layers = true (migrated: local pull)",
            {config: v2_list.replace("discard_unpacked_layers = false", "discard_unpacked_layers = true", 1)},
            True,
        ).cleanup()
        case(
            "version 2 config with a list, use_local_image_pull = true in the 2.x table",
            {config: v2_list + "\n[plugins.'io.containerd.cri.v1.images']\n  use_local_image_pull = true\n"},
            True,
        ).cleanup()
        # Without a containerd.runtimes table containerd 2.x migrates the
        # registry but not discard_unpacked_layers: the transfer service.
        case(
            "version 2 config with a list and discard_unpacked_layers but no runtimes table: refused",
            {
                config: 'version = 2\n[plugins."io.containerd.grpc.v1.cri".containerd]\n  discard_unpacked_layers = true\n'
                '[plugins."io.containerd.grpc.v1.cri".registry]\n'
                '  config_path = "/etc/containerd/certs.d:/etc/docker/certs.d"\n'
            },
            False,
            ("config version 2", "transfer service"),
        ).cleanup()
        case(
            "1.6 with the CRI plugin disabled",
            {
                config: with_config_path(d16, hosts_dir).replace(
                    "disabled_plugins = []", 'disabled_plugins = ["io.containerd.grpc.v1.cri"]'
                )
            },
            False,
            ("disables containerd's CRI plugin",),
        ).cleanup()
        case(
            "1.6 with config_path set in an imported file",
            {
                config: d16.replace("imports = []", 'imports = ["/etc/containerd/conf.d/*.toml"]'),
                "/etc/containerd/conf.d/10-registry.toml": (
                    f'version = 2\n[plugins."io.containerd.grpc.v1.cri".registry]\n  config_path = "{hosts_dir}"\n'
                ),
            },
            True,
        ).cleanup()

    case(
        "version 1 config (containerd 1.x), [plugins.cri.registry]",
        {config: f'[plugins.cri.registry]\n  config_path = "{hosts_dir}"\n'},
        True,
    ).cleanup()
    case(
        "2.x default config (config_path '')",
        {config: V3_DEFAULT},
        False,
        ('[plugins."io.containerd.cri.v1.images".registry] config_path = "/etc/containerd/certs.d"',),
    ).cleanup()
    v3 = V3_DEFAULT.replace("config_path = ''", f"config_path = '{hosts_dir}'")
    case("2.x with config_path under io.containerd.cri.v1.images", {config: v3}, True).cleanup()
    case(
        "2.x (version 3) with config_path only under the 1.x key",
        {config: V3_DEFAULT + f'\n[plugins."io.containerd.grpc.v1.cri".registry]\n  config_path = "{hosts_dir}"\n'},
        False,
        ("no registry config_path",),
    ).cleanup()
    eks = V3_DEFAULT.replace("config_path = ''", "config_path = '/etc/containerd/certs.d:/etc/docker/certs.d'")
    case(
        "2.x, config_path list, transfer service (2.1+)", {config: eks}, False, ("transfer service", "12415")
    ).cleanup()
    case(
        "2.x, config_path list, discard_unpacked_layers = true (EKS: local pull)",
        {config: eks.replace("discard_unpacked_layers = false", "discard_unpacked_layers = true")},
        True,
    ).cleanup()
    case(
        "2.x, config_path list, use_local_image_pull = true",
        {
            config: eks.replace(
                "max_concurrent_downloads = 3", "max_concurrent_downloads = 3\n    use_local_image_pull = true"
            )
        },
        True,
    ).cleanup()
    r_allow = render("nodeSetup allowConfigPathList", node_values(allowConfigPathList=True))
    if r_allow:
        case("2.x, config_path list, allowConfigPathList (containerd 2.0)", {config: eks}, True, rr=r_allow).cleanup()
        if d16:
            node = Node()
            node.write(config, with_config_path(d16, "/etc/containerd/certs.d:/etc/docker/certs.d"))
            run = setup_run(r_allow, node)
            check(
                "[containerd] version 2 config with a list, allowConfigPathList: accepted with a loud warning",
                run.rc == 0 and "WARNING" in run.err and "would IGNORE the hosts files" in run.err,
                run,
            )
            node.cleanup()
        node = Node()
        node.write(config, v3)
        run = setup_run(r_allow, node)
        check(
            "[containerd] allowConfigPathList with a single config_path: no list warning",
            run.rc == 0 and "would IGNORE" not in run.err,
            run,
        )
        node.cleanup()
    case(
        "no containerd config on the node",
        {},
        False,
        ("no containerd config at /etc/containerd/config.toml", "distribution"),
    ).cleanup()

    # Inline tables and dotted keys are TOML too.
    case(
        "2.x with the registry as an inline table",
        {
            config: f"version = 3\n[plugins.'io.containerd.cri.v1.images']\n  registry = {{ config_path = '{hosts_dir}' }}\n"
        },
        True,
    ).cleanup()

    # verifyContainerdConfig=false: no config mounted, a warning.
    r_noverify = render("nodeSetup without verification", node_values(verifyContainerdConfig=False))
    if r_noverify:
        spec = pod_spec(r_noverify, "DaemonSet", "larder")
        c = init_container(spec, "containerd-hosts")
        check(
            "[containerd] verifyContainerdConfig=false: containerd's folder not mounted",
            all(m["name"] != "containerd-config" for m in c["volumeMounts"])
            and all(v["name"] != "containerd-config" for v in spec["volumes"]),
        )
        node = Node()
        run = setup_run(r_noverify, node)
        check(
            "[containerd] verifyContainerdConfig=false: writes, with a warning",
            run.rc == 0 and "not checked" in run.err,
            run,
        )
        node.cleanup()


def check_distributions() -> None:
    """k3s, rke2 and Talos layouts."""
    k3s_dir = "/var/lib/rancher/k3s/agent/etc/containerd"
    k3s_config = (
        "# File generated by k3s. DO NOT EDIT. Use config.toml.tmpl instead.\nversion = 3\n"
        f"root = \"/var/lib/rancher/k3s/agent/containerd\"\n\n[plugins.'io.containerd.cri.v1.images'.registry]\n"
        f'  config_path = "{k3s_dir}/certs.d"\n'
    )
    r = render("nodeSetup k3s", node_values(distribution="k3s"))
    if r:
        c = init_container(pod_spec(r, "DaemonSet", "larder"), "containerd-hosts")
        env = {e["name"]: e.get("value") for e in c["env"]}
        check(
            "[k3s] preset folders",
            env.get("LARDER_HOSTS_DIR") == f"{k3s_dir}/certs.d"
            and env.get("LARDER_CONTAINERD_CONFIG") == f"{k3s_dir}/config.toml"
            and env.get("LARDER_CONFIG_DIR") == k3s_dir,
            env,
        )
        node = Node()
        node.write(f"{k3s_dir}/config.toml", k3s_config)
        run = setup_run(r, node)
        check("[k3s] accepted", run.rc == 0, run)
        check(
            "[k3s] files in k3s's certs.d",
            sorted(node.files(f"{k3s_dir}/certs.d")) == sorted(f"{n}/hosts.toml" for n in NAMES),
            node.files(f"{k3s_dir}/certs.d"),
        )
        node.cleanup()

        # A registry from registries.yaml: k3s rewrites its folder at every start.
        node = Node()
        node.write(f"{k3s_dir}/config.toml", k3s_config)
        managed = (
            '# File generated by k3s. DO NOT EDIT.\nserver = "https://registry-1.docker.io/v2"\n'
            'capabilities = ["pull", "resolve"]\n'
        )
        node.write(f"{k3s_dir}/certs.d/docker.io/hosts.toml", managed)
        run = setup_run(r, node)
        check(
            "[k3s] a registries.yaml registry: refused, naming registries.yaml and excludeUpstreams",
            run.rc == 1 and "registries.yaml" in run.message and "excludeUpstreams" in run.message,
            run,
        )
        check("[k3s] k3s's file untouched", node.read(f"{k3s_dir}/certs.d/docker.io/hosts.toml") == managed)
        r2 = render(
            "nodeSetup k3s excluding docker.io", node_values(distribution="k3s", excludeUpstreams=["docker.io"])
        )
        if r2:
            run = setup_run(r2, node)
            files = node.files(f"{k3s_dir}/certs.d")
            check("[k3s] excludeUpstreams docker.io: accepted", run.rc == 0, run)
            check(
                "[k3s] excludeUpstreams docker.io: k3s's file untouched, the others written",
                files.get("docker.io/hosts.toml") == managed and "ghcr.io/hosts.toml" in files,
                sorted(files),
            )
        node.cleanup()

    rke2_dir = "/var/lib/rancher/rke2/agent/etc/containerd"
    r = render("nodeSetup rke2", node_values(distribution="rke2"))
    if r:
        node = Node()
        node.write(f"{rke2_dir}/config.toml", k3s_config.replace("k3s", "rke2"))
        run = setup_run(r, node)
        check("[rke2] accepted", run.rc == 0, run)
        check(
            "[rke2] files in rke2's certs.d",
            sorted(node.files(f"{rke2_dir}/certs.d")) == sorted(f"{n}/hosts.toml" for n in NAMES),
        )
        node.cleanup()

    r = render("nodeSetup talos", node_values(distribution="talos"))
    if r:
        c = init_container(pod_spec(r, "DaemonSet", "larder"), "containerd-hosts")
        env = {e["name"]: e.get("value") for e in c["env"]}
        check(
            "[talos] preset folders",
            env.get("LARDER_HOSTS_DIR") == "/etc/cri/conf.d/hosts" and env.get("LARDER_CONFIG_DIR") == "/etc/cri",
            env,
        )
        node = Node()
        node.write("/etc/cri/containerd.toml", 'version = 3\nimports = ["/etc/cri/conf.d/cri.toml"]\n')
        node.write(
            "/etc/cri/conf.d/cri.toml",
            "version = 3\n\n[plugins]\n  [plugins.'io.containerd.cri.v1.images']\n"
            "    [plugins.'io.containerd.cri.v1.images'.registry]\n      config_path = '/etc/cri/conf.d/hosts'\n",
        )
        # Talos writes machine.registries.mirrors like this.
        talos_file = "[host]\n  [host.'https://mirror.gcr.io']\n    capabilities = ['pull', 'resolve']\n"
        node.write("/etc/cri/conf.d/hosts/docker.io/hosts.toml", talos_file)
        run = setup_run(r, node)
        check("[talos] accepted (config_path in the imported cri.toml)", run.rc == 0, run)
        text = node.read("/etc/cri/conf.d/hosts/docker.io/hosts.toml")
        check(
            "[talos] larder prepended to Talos's docker.io mirrors, valid TOML",
            parses(text) is not None and hosts_of(text) == [f"http://{NODE_IP}:5000", "https://mirror.gcr.io"],
            text,
        )
        node.cleanup()


# ---------------------------------------------------------- existing files


def check_existing_files() -> None:
    """Merging into files this release did not write, pruning, cleanup."""
    hosts_dir = "/etc/containerd/certs.d"
    config = "/etc/containerd/config.toml"
    v3 = V3_DEFAULT.replace("config_path = ''", f"config_path = '{hosts_dir}'")
    docker = f"{hosts_dir}/docker.io/hosts.toml"
    ours = f"http://{NODE_IP}:5000"

    def fresh_node() -> Node:
        node = Node()
        node.write(config, v3)
        node.write(docker, CORPORATE)
        node.write(f"{hosts_dir}/docker.io/corp-ca.crt", "corporate CA\n")
        return node

    r = render("nodeSetup prepend", node_values())
    if not r:
        return
    node = fresh_node()
    run = setup_run(r, node)
    text = node.read(docker)
    check("[existing] prepend: exit 0", run.rc == 0, run)
    check("[existing] prepend: still valid TOML", parses(text) is not None, text)
    check(
        "[existing] prepend: larder first, then the corporate mirror",
        hosts_of(text) == [ours, "https://mirror.corp.example"],
        text,
    )
    parsed = parses(text) or {}
    corp = parsed.get("host", {}).get("https://mirror.corp.example", {})
    check(
        "[existing] prepend: the corporate entry, its CA, client pair and header kept",
        corp
        == {
            "capabilities": ["pull", "resolve"],
            "ca": "corp-ca.crt",
            "client": [["client.cert", "client.key"]],
            "header": {"X-Team": "platform"},
        }
        and parsed.get("server") == "https://registry-1.docker.io",
        parsed,
    )
    check(
        "[existing] prepend: the corporate CA file untouched",
        node.read(f"{hosts_dir}/docker.io/corp-ca.crt") == "corporate CA\n",
    )
    run = setup_run(r, node)
    check(
        "[existing] prepend again (pod restart): the same file, one larder block",
        run.rc == 0 and node.read(docker) == text,
        node.read(docker),
    )

    # The uninstall hook's cleanup restores the original bytes.
    rc = render("cleanup hook", node_values())
    if rc:
        spec = pod_spec(rc, "DaemonSet", "larder-node-cleanup")
        hook = rc.get("DaemonSet", "larder-node-cleanup")["metadata"]["annotations"]
        check("[existing] cleanup DaemonSet is a post-delete hook", hook.get("helm.sh/hook") == "post-delete", hook)
        run = run_container(rc, spec, init_container(spec, "cleanup"), node)
        check("[existing] cleanup: exit 0", run.rc == 0, run)
        check(
            "[existing] cleanup: the corporate hosts.toml restored byte for byte",
            node.read(docker) == CORPORATE,
            node.read(docker),
        )
        left = node.files(hosts_dir)
        check(
            "[existing] cleanup: larder's own files and folders removed",
            sorted(left) == ["docker.io/corp-ca.crt", "docker.io/hosts.toml"]
            and not node.exists(f"{hosts_dir}/ghcr.io"),
            sorted(left),
        )
    node.cleanup()

    r_keep = render("nodeSetup keep", node_values(existingHosts="keep"))
    if r_keep:
        node = fresh_node()
        run = setup_run(r_keep, node)
        check(
            "[existing] keep: exit 0, the file untouched, a warning that docker.io bypasses larder",
            run.rc == 0 and node.read(docker) == CORPORATE and "do NOT go through larder" in run.err,
            run,
        )
        check("[existing] keep: the other registries written", node.exists(f"{hosts_dir}/ghcr.io/hosts.toml"))
        node.cleanup()

    r_replace = render("nodeSetup replace", node_values(existingHosts="replace"))
    if r_replace:
        node = fresh_node()
        run = setup_run(r_replace, node)
        text = node.read(docker)
        check(
            "[existing] replace: larder's file, the original saved",
            run.rc == 0
            and hosts_of(text) == [ours]
            and node.read(f"{hosts_dir}/docker.io/hosts.toml.larder-saved") == CORPORATE,
            run,
        )
        spec = pod_spec(
            render("cleanup hook replace", node_values(existingHosts="replace")), "DaemonSet", "larder-node-cleanup"
        )
        run = run_container(r_replace, spec, init_container(spec, "cleanup"), node)
        check(
            "[existing] replace, then cleanup: the original back",
            run.rc == 0
            and node.read(docker) == CORPORATE
            and not node.exists(f"{hosts_dir}/docker.io/hosts.toml.larder-saved"),
            run,
        )
        node.cleanup()

    r_fail = render("nodeSetup fail", node_values(existingHosts="fail"))
    if r_fail:
        node = fresh_node()
        run = setup_run(r_fail, node)
        check(
            "[existing] fail: exit 1, the file untouched",
            run.rc == 1 and node.read(docker) == CORPORATE and "existingHosts" in run.message,
            run,
        )
        node.cleanup()

    # _default: containerd used it for every registry without a folder.
    node = Node()
    node.write(config, v3)
    default = '[host."https://catchall.corp.example"]\n  capabilities = ["pull", "resolve"]\n'
    node.write(f"{hosts_dir}/_default/hosts.toml", default)
    run = setup_run(r, node)
    text = node.read(f"{hosts_dir}/ghcr.io/hosts.toml")
    check(
        "[existing] _default: a new registry folder starts from it, larder first",
        run.rc == 0 and hosts_of(text) == [ours, "https://catchall.corp.example"] and parses(text) is not None,
        text,
    )
    check("[existing] _default itself untouched", node.read(f"{hosts_dir}/_default/hosts.toml") == default)
    run = setup_run(r, node)
    check(
        "[existing] _default, second run (pod restart): the same file",
        run.rc == 0 and node.read(f"{hosts_dir}/ghcr.io/hosts.toml") == text,
        node.read(f"{hosts_dir}/ghcr.io/hosts.toml"),
    )
    if r_keep:
        run = setup_run(r_keep, node)
        check(
            "[existing] _default, then existingHosts=keep: larder's folder removed, _default applies again",
            run.rc == 0 and not node.exists(f"{hosts_dir}/ghcr.io") and node.read(f"{hosts_dir}/_default/hosts.toml") == default,
            (run, node.files(hosts_dir)),
        )
    node.cleanup()

    # Pruning: a registry no longer mirrored loses what this release wrote.
    node = fresh_node()
    run = setup_run(r, node)
    check("[prune] first run", run.rc == 0 and node.exists(f"{hosts_dir}/quay.io/hosts.toml"), run)
    node.write(f"{hosts_dir}/foreign.io/hosts.toml", 'server = "https://foreign.io"\n')
    r2 = render("nodeSetup excluding quay.io and docker.io", node_values(excludeUpstreams=["quay.io", "docker.io"]))
    if r2:
        run = setup_run(r2, node)
        check("[prune] second run: exit 0", run.rc == 0, run)
        check(
            "[prune] quay.io: larder's file and folder removed",
            not node.exists(f"{hosts_dir}/quay.io"),
            node.files(hosts_dir),
        )
        check(
            "[prune] docker.io: larder's block removed, the corporate file as it was",
            node.read(docker) == CORPORATE,
            node.read(docker),
        )
        check("[prune] ghcr.io kept", hosts_of(node.read(f"{hosts_dir}/ghcr.io/hosts.toml")) == [ours])
        check(
            "[prune] a file nobody marked is left alone",
            node.read(f"{hosts_dir}/foreign.io/hosts.toml") == 'server = "https://foreign.io"\n',
        )
    node.cleanup()

    # Another release's files are not ours to touch.
    node = fresh_node()
    setup_run(r, node)
    other = node.read(f"{hosts_dir}/ghcr.io/hosts.toml").replace("cache/larder", "other/larder")
    node.write(f"{hosts_dir}/ghcr.io/hosts.toml", other)
    spec = pod_spec(render("cleanup hook 2", node_values()), "DaemonSet", "larder-node-cleanup")
    run = run_container(r, spec, init_container(spec, "cleanup"), node)
    check(
        "[prune] cleanup leaves another release's file alone",
        run.rc == 0 and node.read(f"{hosts_dir}/ghcr.io/hosts.toml") == other,
        run,
    )
    node.cleanup()


def check_mirror_addresses() -> None:
    hosts_dir = "/etc/containerd/certs.d"
    config = "/etc/containerd/config.toml"
    v3 = V3_DEFAULT.replace("config_path = ''", f"config_path = '{hosts_dir}'")

    def hosts_after(r: tc.Rendered, host_ip: str = NODE_IP, **kw) -> tuple[Run, str, Node]:
        node = Node()
        node.write(config, v3)
        run = setup_run(r, node, host_ip=host_ip, **kw)
        text = node.read(f"{hosts_dir}/ghcr.io/hosts.toml") if node.exists(f"{hosts_dir}/ghcr.io/hosts.toml") else ""
        return run, text, node

    r = render("nodeSetup node mode IPv6", node_values())
    if r:
        run, text, node = hosts_after(r, host_ip="fd00::5")
        check(
            "[address] IPv6 node: http://[fd00::5]:5000",
            run.rc == 0 and hosts_of(text) == ["http://[fd00::5]:5000"],
            (run, text),
        )
        node.cleanup()

    r = render("node.hostIP", {**node_values(), "node": {"hostIP": "169.254.20.11", "hostPort": 5001}})
    if r:
        run, text, node = hosts_after(r)
        check("[address] node.hostIP: that address, every node", hosts_of(text) == ["http://169.254.20.11:5001"], text)
        node.cleanup()

    r = render(
        "node fallback mirror",
        {
            **node_values(),
            "node": {"fallbackMirror": True},
            "service": {"clusterIP": "10.96.0.50", "trafficDistribution": "PreferClose"},
        },
    )
    if r:
        run, text, node = hosts_after(r)
        check(
            "[address] node.fallbackMirror: the node's larder, then the Service, then the registry",
            hosts_of(text) == [f"http://{NODE_IP}:5000", "http://10.96.0.50:5000"]
            and (parses(text) or {}).get("server") == "https://ghcr.io",
            text,
        )
        node.cleanup()

    r = render(
        "deployment nodeSetup clusterIP",
        {"upstreams": UPSTREAMS, "nodeSetup": {"enabled": True}, "service": {"clusterIP": "10.96.0.50"}},
    )
    if r:
        run, text, node = hosts_after(r)
        check(
            "[address] deployment mode: the Service's clusterIP",
            run.rc == 0 and hosts_of(text) == ["http://10.96.0.50:5000"],
            (run, text),
        )
        node.cleanup()

    r = render(
        "deployment nodeSetup NodePort",
        {"upstreams": UPSTREAMS, "nodeSetup": {"enabled": True}, "service": {"type": "NodePort", "nodePort": 30500}},
    )
    if r:
        run, text, node = hosts_after(r)
        check(
            "[address] deployment mode, NodePort: the node's IP and the nodePort",
            hosts_of(text) == [f"http://{NODE_IP}:30500"],
            text,
        )
        node.cleanup()

    r = render(
        "TLS and client auth",
        {
            **node_values(mirrorCredentials={"existingSecret": "node-pull"}),
            "config": {
                "tls": {"enabled": True, "existingSecret": "larder-tls"},
                "auth": {"enabled": True, "existingSecret": "larder-htpasswd"},
            },
        },
    )
    if r:
        secrets = {
            "larder-tls": {
                "tls.crt": "CERT\n",
                "tls.key": "KEY\n",
                "ca.crt": "-----BEGIN CERTIFICATE-----\nlarder CA\n",
            },
            "node-pull": {"username": "kubelet", "password": "s3cret\n"},
        }
        run, text, node = hosts_after(r, secrets=secrets)
        parsed = parses(text) or {}
        entry = parsed.get("host", {}).get(f"https://{NODE_IP}:5000", {})
        check("[address] TLS: https mirror", run.rc == 0 and hosts_of(text) == [f"https://{NODE_IP}:5000"], (run, text))
        check(
            "[address] TLS: ca = the CA copied next to hosts.toml (node path)",
            entry.get("ca") == f"{hosts_dir}/ghcr.io/larder-mirror-ca.crt"
            and node.read(f"{hosts_dir}/ghcr.io/larder-mirror-ca.crt") == secrets["larder-tls"]["ca.crt"],
            entry,
        )
        check(
            "[address] auth: Authorization header with the node credentials",
            entry.get("header") == {"Authorization": "Basic " + base64.b64encode(b"kubelet:s3cret").decode()},
            entry,
        )
        mode = stat.S_IMODE(node.path(f"{hosts_dir}/ghcr.io/hosts.toml").stat().st_mode)
        check("[address] auth: hosts.toml readable by root only (0600)", mode == 0o600, oct(mode))
        node.cleanup()


def check_node_pools() -> None:
    """Grants render as [[server.auth.grant]]; each node pool gets its own
    node setup DaemonSet writing its own credentials into hosts.toml, and
    the default DaemonSet skips the pools' nodes."""
    hosts_dir = "/etc/containerd/certs.d"
    config = "/etc/containerd/config.toml"
    v3 = V3_DEFAULT.replace("config_path = ''", f"config_path = '{hosts_dir}'")
    grants = [
        {"who": ["team-a"], "upstreams": ["ghcr.io"], "repositories": ["team-a/**"]},
        {"who": ["team-b"], "repositories": ["team-b/**"]},
        {"who": ["team-a", "team-b", "kubelet"], "upstreams": ["docker.io"]},
    ]
    pools = [
        {"name": "team-a", "nodeSelector": {"example.com/tenant": "a"}, "mirrorCredentials": {"existingSecret": "team-a-pull"}},
        {
            "name": "team-b",
            "nodeSelector": {"example.com/tenant": "b"},
            "mirrorCredentials": {"existingSecret": "team-b-pull", "usernameKey": "user", "passwordKey": "token"},
        },
    ]
    values = {
        "upstreams": UPSTREAMS,
        "service": {"type": "NodePort", "nodePort": 30500},
        "config": {"auth": {"enabled": True, "existingSecret": "larder-htpasswd", "grants": grants}},
        "nodeSetup": {"enabled": True, "mirrorCredentials": {"existingSecret": "node-pull"}, "nodePools": pools},
    }
    r = tc.render("node pools", values)  # validated with kubernetes-validate
    if not r:
        return
    toml = r.toml()
    check(
        "[pools] grants rendered as [[server.auth.grant]], keys left out stay out",
        toml["server"]["auth"].get("grant") == grants,
        toml["server"]["auth"],
    )
    tc.check_config("node pools", r.toml_text())

    sets = {d["metadata"]["name"]: d for d in r.of_kind("DaemonSet") if "-node-setup" in d["metadata"]["name"]}
    names = ["larder-node-setup", "larder-node-setup-team-a", "larder-node-setup-team-b"]
    check("[pools] one node setup DaemonSet per pool beside the default", sorted(sets) == names, sorted(sets))
    if sorted(sets) != names:
        return
    selectors = [tuple(sorted(d["spec"]["selector"]["matchLabels"].items())) for d in sets.values()]
    check("[pools] the DaemonSets' selectors are distinct", len(set(selectors)) == 3, selectors)
    for d in sets.values():
        labels = d["spec"]["template"]["metadata"]["labels"]
        check(
            f"[pools] {d['metadata']['name']}: its pods carry its selector",
            d["spec"]["selector"]["matchLabels"].items() <= labels.items(),
            labels,
        )
    a = pod_spec(r, "DaemonSet", "larder-node-setup-team-a")
    check(
        "[pools] team-a: on the pool's nodes (and nodeSetup.nodeSelector's)",
        a.get("nodeSelector") == {"example.com/tenant": "a", "kubernetes.io/os": "linux"},
        a.get("nodeSelector"),
    )
    default = pod_spec(r, "DaemonSet", "larder-node-setup")
    terms = default["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    excluded = [
        {"key": "example.com/tenant", "operator": "NotIn", "values": ["a"]},
        {"key": "example.com/tenant", "operator": "NotIn", "values": ["b"]},
    ]
    check(
        "[pools] default: every term excludes both pools and keeps nodeSetup.affinity's expressions",
        terms
        and all(t["matchExpressions"][-2:] == excluded and len(t["matchExpressions"]) > 2 for t in terms),
        terms,
    )

    secrets = {
        "node-pull": {"username": "kubelet", "password": "k-secret\n"},
        "team-a-pull": {"username": "team-a", "password": "a-secret\n"},
        "team-b-pull": {"user": "team-b", "token": "b-secret"},
    }
    for name, user in (("larder-node-setup", b"kubelet:k-secret"), ("larder-node-setup-team-a", b"team-a:a-secret"), ("larder-node-setup-team-b", b"team-b:b-secret")):
        node = Node()
        node.write(config, v3)
        spec = pod_spec(r, "DaemonSet", name)
        run = run_container(r, spec, init_container(spec, "containerd-hosts"), node, secrets=secrets)
        path = f"{hosts_dir}/ghcr.io/hosts.toml"
        text = node.read(path) if node.exists(path) else ""
        entry = (parses(text) or {}).get("host", {}).get(next(iter(hosts_of(text)), ""), {})
        check(
            f"[pools] {name}: hosts.toml sends its own credentials",
            run.rc == 0 and entry.get("header") == {"Authorization": "Basic " + base64.b64encode(user).decode()},
            (run, entry),
        )
        node.cleanup()

    no_pools = {**values, "nodeSetup": {"enabled": True, "mirrorCredentials": {"existingSecret": "node-pull"}}}
    refused = {
        "grants without config.auth": ({**no_pools, "config": {"auth": {"grants": grants}}}, "config.auth.grants need"),
        "pools without config.auth": ({**values, "config": {}}, "which larder checks only with config.auth"),
        "pools in node mode": ({**values, "mode": "node"}, "need mode: deployment"),
        "a pool name used twice": (
            {**values, "nodeSetup": {**values["nodeSetup"], "nodePools": [pools[0], pools[0]]}},
            "used twice",
        ),
        "a pool selected by two labels": (
            {**values, "nodeSetup": {**values["nodeSetup"], "nodePools": [{**pools[0], "nodeSelector": {"a": "1", "b": "2"}}]}},
            "nodeSelector",
        ),
        "a pool without a Secret": (
            {**values, "nodeSetup": {**values["nodeSetup"], "nodePools": [{**pools[0], "mirrorCredentials": {}}]}},
            "existingSecret",
        ),
    }
    for label, (bad, why) in refused.items():
        error = tc.render_error(bad) or ""
        check(f"[pools] refused: {label}", why in error, error)


def check_listen_address() -> None:
    """node.hostNetwork: the init container writes the node's IP into larder.toml."""
    r = render("hostNetwork listen address", {"mode": "node", "node": {"hostNetwork": True}})
    if not r:
        return
    spec = pod_spec(r, "DaemonSet", "larder")
    c = init_container(spec, "listen-address")
    larder = tc.container(r.get("DaemonSet", "larder")["spec"]["template"])
    check(
        "[hostNetwork] larder reads the written larder.toml",
        larder["args"][:2] == ["--config", "/run/larder/config/larder.toml"]
        and any(m["mountPath"] == "/run/larder/config" for m in larder["volumeMounts"]),
        larder["args"],
    )
    for host_ip, expect in ((NODE_IP, f"{NODE_IP}:5000"), ("fd00::5", "[fd00::5]:5000")):
        with tempfile.TemporaryDirectory() as out:
            node = Node()
            run = run_container(r, spec, c, node, host_ip=host_ip, volume_dirs={"runtime-config": Path(out)})
            text = Path(out, "larder.toml").read_text() if Path(out, "larder.toml").exists() else ""
            conf = parses(text) or {}
            check(
                f"[hostNetwork] HOST_IP {host_ip}: listen {expect}, admin on 127.0.0.1",
                run.rc == 0
                and conf.get("server", {}).get("listen") == expect
                and conf["server"].get("admin_listen") == "127.0.0.1:9090",
                (run, conf.get("server")),
            )
            rest = [line for line in text.splitlines() if not line.startswith("listen = ")]
            check(
                f"[hostNetwork] HOST_IP {host_ip}: nothing else changed",
                rest == [line for line in r.toml_text().splitlines() if not line.startswith("listen = ")],
            )
            if expect.startswith("10."):
                tc.check_config("hostNetwork runtime larder.toml", text)
            node.cleanup()


def flattened(data: dict, prefix: tuple[str, ...] = ()) -> dict[str, list[str]]:
    """tomllib's reading of a file, in the form the script's `dump` prints."""
    out: dict[str, list[str]] = {}
    for k, v in data.items():
        path = (*prefix, k)
        if isinstance(v, dict):
            for key, values in flattened(v, path).items():
                out.setdefault(key, []).extend(values)
        elif isinstance(v, list):
            for item in v:
                if isinstance(item, str):
                    out.setdefault("|".join(path) + "[]", []).append(item)
        else:
            value = v if isinstance(v, str) else str(v).lower() if isinstance(v, bool) else str(v)
            out.setdefault("|".join(path), []).append(value.replace("\n", "\\n"))
    return out


def check_toml_reader() -> None:
    """The script's TOML reader (dump mode) against tomllib."""
    r = render("dump", node_values())
    if not r:
        return
    configs = {
        "containerd 1.6 default": CONTAINERD_DEFAULT,
        "containerd 2.x default": V3_DEFAULT,
        "tricky": (
            "version = 2\nimports = [\n  \"/a.toml\", # first\n  '/b.toml',\n]\n"
            '[plugins."io.containerd.grpc.v1.cri".registry] # a comment with "quotes" and [brackets]\n'
            '  config_path = "/etc/containerd/certs.d" # trailing\n'
            '  "quoted.key" = \'literal "with" quotes\'\n'
            '  escaped = "tab\\there \\"q\\""\n'
            '  multi = """\nline one\nline two"""\n'
            '  [plugins."io.containerd.grpc.v1.cri".registry.headers]\n    X-Many = ["a", "b"]\n'
            "[plugins.'io.containerd.cri.v1.images']\n  registry = { config_path = '/x', mirrors = {} }\n"
            "  discard_unpacked_layers = true\n  n = 3\n  f = 1.5\n"
        ),
    }
    spec = pod_spec(r, "DaemonSet", "larder")
    c = init_container(spec, "containerd-hosts")
    for label, text in configs.items():
        if not text:
            continue
        node = Node()
        node.write("/etc/containerd/config.toml", text)
        run = run_container(r, spec, c, node, env_override={"LARDER_MODE": "dump"})
        got: dict[str, list[str]] = {}
        for line in run.out.splitlines():
            k, _, v = line.partition("\t")
            got.setdefault(k, []).append(v)
        expected = flattened(tomllib.loads(text))
        wrong = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v}
        extra = sorted(k for k in got if k not in expected)
        check(
            f"[toml] {label}: every key and value as tomllib reads them ({len(expected)} keys)",
            run.rc == 0 and not wrong and not extra,
            (run.err[-300:], wrong, extra),
        )
        node.cleanup()


def check_cleanup_wait() -> None:
    """The uninstall's wait Pod, with nslookup and wget stubbed: it waits
    until every cleanup pod behind the headless Service answers."""
    r = render("cleanup wait", {**node_values(cleanupTimeoutSeconds=10)})
    if not r:
        return
    wait = r.get("Pod", "larder-node-cleanup-wait")["spec"]["containers"][0]["command"]
    with tempfile.TemporaryDirectory(prefix="larder-wait-") as tmp:
        bin_dir = Path(tmp, "bin")
        bin_dir.mkdir()
        for applet in BUSYBOX_BIN.iterdir():
            if applet.name not in ("nslookup", "wget", "sleep"):
                (bin_dir / applet.name).symlink_to(applet.resolve())
        # busybox nslookup's output for a headless Service with two pods.
        (bin_dir / "nslookup").write_text(
            "#!/bin/sh\necho 'Server:\t\t10.96.0.10'\necho 'Address:\t10.96.0.10:53'\necho\n"
            "echo \"Name:\t$1\"\necho 'Address: 10.244.1.7'\necho \"Name:\t$1\"\necho 'Address: fd00:10:244::8'\n"
        )
        (bin_dir / "wget").write_text('#!/bin/sh\nfor a; do url=$a; done\ngrep -qxF "$url" "$READY"\n')
        (bin_dir / "sleep").write_text("#!/bin/sh\nexec busybox sleep 0.1\n")
        for f in ("nslookup", "wget", "sleep"):
            (bin_dir / f).chmod(0o755)
        ready = Path(tmp, "ready")
        env = {"PATH": f"{bin_dir}:/usr/bin", "READY": str(ready)}
        ready.write_text("http://10.244.1.7:8080/\nhttp://[fd00:10:244::8]:8080/\n")
        p = subprocess.run([str(bin_dir / "sh"), "-c", wait[2]], env=env, capture_output=True, text=True, timeout=60)
        check(
            "[cleanup wait] both cleanup pods (IPv4 and IPv6) answer: exit 0",
            p.returncode == 0 and "2 of 2 done" in p.stdout,
            (p.returncode, p.stdout[-300:], p.stderr[-300:]),
        )
        ready.write_text("http://10.244.1.7:8080/\n")
        start = time.monotonic()
        p = subprocess.run([str(bin_dir / "sh"), "-c", wait[2]], env=env, capture_output=True, text=True, timeout=60)
        check(
            "[cleanup wait] one pod never answers: exit 1 after cleanupTimeoutSeconds, naming the remedy",
            p.returncode == 1
            and "1 of 2 done" in p.stdout
            and "timed out" in p.stdout
            and 9 <= time.monotonic() - start < 30,
            (p.returncode, p.stdout[-300:], time.monotonic() - start),
        )


def check_shellcheck() -> None:
    script = tc.CHART / "files" / "containerd-hosts.sh"
    sc = shutil.which("shellcheck")
    if not check("[shellcheck] installed", sc, "apt-get install shellcheck"):
        return
    p = subprocess.run([sc, "-s", "sh", str(script)], capture_output=True, text=True)
    check("[shellcheck] containerd-hosts.sh: no findings", p.returncode == 0, p.stdout[-2000:])
    r = render("script in the ConfigMap", node_values())
    if r:
        check(
            "[shellcheck] the ConfigMap holds files/containerd-hosts.sh byte for byte",
            r.get("ConfigMap", "larder-node-setup")["data"]["containerd-hosts.sh"] == script.read_text(),
        )


# -------------------------------------------------------- real containerd

REGISTRY = "registry.larder.test"


def pin_registry_name() -> bool:
    """/etc/hosts: the made-up registry name on 127.0.0.1 (a fallback to it
    can never leave the machine), as tests/clients/hosts.rs does."""
    hosts = Path("/etc/hosts")
    text = hosts.read_text() if hosts.exists() else ""
    if any(line.split()[:1] == ["127.0.0.1"] and REGISTRY in line.split() for line in text.splitlines()):
        return True
    try:
        with hosts.open("a") as f:
            f.write(f"127.0.0.1 {REGISTRY}  # larder tests: keep registry fallbacks on loopback\n")
        return True
    except OSError:
        return False


def wait_for(what: str, probe, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if probe():
                return True
        except OSError:
            pass
        time.sleep(0.1)
    return False


class Origin:
    """The CNCF distribution registry (docker-registry) on 127.0.0.1."""

    def __init__(self, tmp: Path):
        self.port = tc.free_port()
        self.dir = tmp / "origin"
        (self.dir / "data").mkdir(parents=True)
        cfg = self.dir / "config.yml"
        cfg.write_text(
            f"version: 0.1\nlog:\n  level: info\nstorage:\n  filesystem:\n    rootdirectory: {self.dir / 'data'}\n"
            f"http:\n  addr: 127.0.0.1:{self.port}\n"
        )
        self.log = self.dir / "log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=out, stderr=out)
        ok = wait_for("origin", lambda: tc.http_status(f"http://127.0.0.1:{self.port}/v2/") == 200)
        assert ok, self.log.read_text()[-2000:]

    def blob_gets(self) -> int:
        return sum(1 for line in self.log.read_text().splitlines() if '"GET /v2/' in line and "/blobs/sha256:" in line)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def push_image(origin: Origin, tmp: Path, repo: str, seed: int) -> str:
    """A one-layer OCI image for this machine's platform, pushed with skopeo;
    returns its manifest digest."""
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    layout = tmp / f"layout-{seed}"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        payload = os.urandom(96 * 1024 + seed)
        info = tarfile.TarInfo(f"data-{seed}.bin")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    layer = blob(gzip.compress(raw.getvalue()))
    config = blob(
        json.dumps(
            {
                "architecture": arch,
                "os": "linux",
                "config": {},
                "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(raw.getvalue()).hexdigest()]},
            }
        ).encode()
    )
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **config},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **layer}],
        }
    ).encode()
    m = blob(manifest)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(
        json.dumps(
            {
                "schemaVersion": 2,
                "manifests": [
                    {
                        "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        **m,
                        "annotations": {"org.opencontainers.image.ref.name": "v1"},
                    }
                ],
            }
        )
    )
    p = subprocess.run(
        [
            "skopeo",
            "copy",
            "--dest-tls-verify=false",
            f"oci:{layout}:v1",
            f"docker://127.0.0.1:{origin.port}/{repo}:v1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    return m["digest"]


class Larder:
    """larder with the chart's larder.toml, listeners on 127.0.0.1."""

    def __init__(self, tmp: Path, toml_text: str, port: int, args: list[str]):
        conf = tomllib.loads(toml_text)
        self.admin = f"127.0.0.1:{tc.free_port()}"
        text = toml_text
        for key, value in (("listen", f"127.0.0.1:{port}"), ("admin_listen", self.admin)):
            text = text.replace(f"{key} = {json.dumps(conf['server'][key])}", f"{key} = {json.dumps(value)}")
        text = text.replace('dir = "/var/lib/larder"', f"dir = {json.dumps(str(tmp / 'larder-cache'))}")
        text = tc._rewrite_admin_token(conf, text, tmp)
        self.config = tmp / "larder.toml"
        self.config.write_text(text)
        self.log = tmp / "larder.log"
        argv = [str(tc.LARDER)] + [str(self.config) if a.endswith("larder.toml") else a for a in args]
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out)
        ok = wait_for("larder", lambda: tc.http_status(f"http://{self.admin}/healthz") == 200)
        assert ok, self.log.read_text()[-2000:]

    def metric(self, name: str, labels: str = "") -> float:
        with tc._direct.open(f"http://{self.admin}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (line[len(name)] in "{ ") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=40)


class Containerd:
    """A private containerd (CRI plugin on, native snapshotter) reading its
    config from `config` (written by the caller)."""

    def __init__(self, base: Path, config: Path):
        self.base = base
        self.socket = base / "containerd.sock"
        self.log = base / "containerd.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                ["containerd", "--config", str(config)], stdout=out, stderr=out, stdin=subprocess.DEVNULL
            )
        ok = wait_for(
            "containerd",
            lambda: (
                subprocess.run(["ctr", "--address", str(self.socket), "version"], capture_output=True).returncode == 0
            ),
        )
        assert ok, self.log.read_text()[-3000:]

    @staticmethod
    def config_text(base: Path, hosts_dir: Path) -> str:
        return (
            f'version = 2\nroot = "{base}/root"\nstate = "{base}/state"\n'
            f'[grpc]\n  address = "{base}/containerd.sock"\n[ttrpc]\n  address = "{base}/containerd-ttrpc.sock"\n'
            f'[plugins."io.containerd.internal.v1.opt"]\n  path = "{base}/opt"\n'
            f'[plugins."io.containerd.grpc.v1.cri"]\n  disable_tcp_service = true\n  stream_server_address = "127.0.0.1"\n'
            f'  [plugins."io.containerd.grpc.v1.cri".containerd]\n    snapshotter = "native"\n'
            f'  [plugins."io.containerd.grpc.v1.cri".cni]\n    bin_dir = "{base}/cni/bin"\n    conf_dir = "{base}/cni/conf"\n'
            f'  [plugins."io.containerd.grpc.v1.cri".registry]\n    config_path = "{hosts_dir}"\n'
        )

    def ctr_pull(self, ref: str, hosts_dir: Path) -> tuple[int, str, float]:
        start = time.monotonic()
        p = subprocess.run(
            [
                "ctr",
                "--address",
                str(self.socket),
                "images",
                "pull",
                "--snapshotter",
                "native",
                "--hosts-dir",
                str(hosts_dir),
                ref,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        return p.returncode, p.stdout + p.stderr, time.monotonic() - start

    def cri_pull(self, ref: str) -> tuple[bool, str]:
        """CRI ImageService.PullImage, as kubelet calls it (the request and
        response are encoded by hand: PullImageRequest{image: ImageSpec{image: ref}})."""
        import grpc

        def field(number: int, payload: bytes) -> bytes:
            return bytes([number << 3 | 2]) + varint(len(payload)) + payload

        def varint(n: int) -> bytes:
            out = b""
            while True:
                low, n = n & 0x7F, n >> 7
                if not n:
                    return out + bytes([low])
                out += bytes([low | 0x80])

        request = field(1, field(1, ref.encode()))
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            call = channel.unary_unary("/runtime.v1.ImageService/PullImage")
            try:
                response = call(request, timeout=120)
            except grpc.RpcError as e:
                return False, f"{e.code()}: {e.details()}"
        # PullImageResponse{image_ref = 1}
        return True, response[2:].decode(errors="replace")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class BlackHole:
    """A listening socket whose accept queue is full: connecting to its port
    hangs (the kernel drops the SYNs), like a mirror address whose packets
    a firewall drops."""

    def __init__(self, port: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(0)
        self.held = []
        for _ in range(2):
            c = socket.socket()
            c.settimeout(0.5)
            try:
                c.connect(("127.0.0.1", port))
            except OSError:
                pass
            self.held.append(c)
        probe = socket.socket()
        probe.settimeout(1)
        try:
            probe.connect(("127.0.0.1", port))
            self.works = False
        except OSError:
            self.works = True
        finally:
            probe.close()

    def close(self) -> None:
        for c in self.held:
            c.close()
        self.sock.close()


# What `containerd --version` prints: App.Name, version.Package,
# version.Version, version.Revision (cmd/containerd/command/main.go), the
# release Makefile setting Version from `git describe` and Revision to the
# tag's commit.
CONTAINERD_VERSIONS = {
    "1.7": "containerd github.com/containerd/containerd v1.7.0 1fbd70374134b891f97ce19c70b6e50c7b9f4e0d",
    "2.1": "containerd github.com/containerd/containerd/v2 v2.1.0 061792f0ecf3684fb30a3a0eb006799b8c6638a7",
    "2.2": "containerd github.com/containerd/containerd/v2 v2.2.0 1c4457e00facac03ce1d75f7b6777a7a851e5c41",
    "2.3": "containerd github.com/containerd/containerd/v2 v2.3.0 2976f38ccbfcda5ef1364d63d60b0a304e4bf94a",
}


def merged_usr(path: str) -> str:
    """A path as a merged-/usr node has it (/lib64/x is /usr/lib64/x)."""
    for top in ("/lib64", "/lib", "/bin", "/sbin"):
        if path == top or path.startswith(top + "/"):
            return "/usr" + path
    return path


def copy_into_node(node: Node, host_path: str, seen: set[str]) -> None:
    """Copies a file of this (merged-/usr) machine to the same path in the
    node, symlinks as symlinks (absolute ones too: they resolve in the chroot)."""
    path = merged_usr(os.path.normpath(host_path))
    if path in seen:
        return
    seen.add(path)
    dest = node.path(path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.islink(path):
        target = os.readlink(path)
        dest.symlink_to(target)
        copy_into_node(node, target if target.startswith("/") else os.path.join(os.path.dirname(path), target), seen)
    else:
        shutil.copy2(path, dest)


def install_program(node: Node, host_binary: str, node_path: str) -> None:
    """A dynamically linked program of this machine at `node_path`, with
    its loader and libraries where the node's loader looks for them."""
    dest = node.path(node_path)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(host_binary, dest)
    seen: set[str] = set()
    ldd = subprocess.run(["ldd", host_binary], capture_output=True, text=True).stdout
    for line in ldd.splitlines():
        for word in line.split():
            if word.startswith("/"):
                copy_into_node(node, word, seen)


def install_fake_containerd(node: Node, node_path: str, prints: str) -> None:
    """A `containerd` that prints `prints` for --version (or is the script
    `prints`, when it starts with #!): a shell script, run by the node's
    own /bin/sh (busybox, with its libraries)."""
    if not node.exists("/usr/bin/sh"):
        install_program(node, shutil.which("busybox") or "/bin/busybox", "/usr/bin/busybox")
        node.path("/usr/bin/sh").symlink_to("busybox")
    text = prints if prints.startswith("#!") else f"#!/bin/sh\nprintf '%s\\n' '{prints}'\n"
    p = node.write(node_path, text)
    p.chmod(0o755)


def check_referrers() -> None:
    """nodeSetup.referrers: auto writes `referrers` into hosts.toml only
    when the node's own containerd says 2.2 or later."""
    hosts_dir = "/etc/containerd/certs.d"
    config = "/etc/containerd/config.toml"
    v3 = V3_DEFAULT.replace("config_path = ''", f"config_path = '{hosts_dir}'")
    r = render("nodeSetup referrers auto", node_values())
    if not r:
        return
    spec = pod_spec(r, "DaemonSet", "larder")
    init = init_container(spec, "containerd-hosts")
    env = {e["name"]: e.get("value") for e in init["env"]}
    check(
        "[referrers] auto by default: the bin folders to search, the node root",
        env.get("LARDER_REFERRERS") == "auto"
        and env.get("LARDER_NODE_ROOT") == "/host/node"
        and env.get("LARDER_CONTAINERD_BIN_DIRS") == "/usr/local/sbin\n/usr/local/bin\n/usr/sbin\n/usr/bin",
        env,
    )
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in init["volumeMounts"]}
    check(
        "[referrers] the node's /usr mounted read-only inside an emptyDir root",
        volumes.get("node-root", {}).get("emptyDir") is not None
        and mounts.get("/host/node", {}).get("name") == "node-root"
        and volumes[mounts["/host/node/usr"]["name"]]["hostPath"] == {"path": "/usr", "type": "Directory"}
        and mounts["/host/node/usr"].get("readOnly") is True,
        (mounts, volumes),
    )
    check(
        "[referrers] SYS_CHROOT only, to run the node's binary chrooted",
        init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_CHROOT"]},
        init["securityContext"],
    )

    def run(label: str, binaries: dict[str, str | None], rr=None, **kw) -> tuple[Run, list[str] | None, str]:
        """Runs the setup on a fresh 2.x node whose containerd binaries are
        `binaries` ({node path: what --version prints, or None for the
        real containerd of this machine}); returns docker.io's capabilities."""
        node = Node()
        try:
            node.write(config, v3)
            for path, prints in binaries.items():
                if prints is None:
                    install_program(node, shutil.which("containerd") or "/usr/bin/containerd", path)
                else:
                    install_fake_containerd(node, path, prints)
            result = setup_run(rr or r, node, **kw)
            text = node.read(f"{hosts_dir}/docker.io/hosts.toml") if node.exists(f"{hosts_dir}/docker.io/hosts.toml") else ""
            host = (parses(text) or {}).get("host", {}).get(f"http://{NODE_IP}:5000", {})
            check(f"[referrers] {label}: exit 0", result.rc == 0, result)
            return result, host.get("capabilities"), text
        finally:
            node.cleanup()

    with_referrers = ["pull", "resolve", "referrers"]
    without = ["pull", "resolve"]
    if shutil.which("containerd"):
        real = subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout.strip()
        run_, caps, text = run("the real containerd 1.6", {"/usr/bin/containerd": None})
        check(
            f"[referrers] the real containerd ({real}): pull and resolve only",
            caps == without and f"/usr/bin/containerd --version: {real}" in run_.err and "containerd 1.6 would refuse" in run_.err,
            (caps, run_),
        )
        check(
            "[referrers] containerd 1.6: the hosts.toml text, exactly",
            text.endswith(
                f'server = "https://registry-1.docker.io"\n\n# >>> larder-managed-block: {RELEASE}\n'
                f'[host."http://{NODE_IP}:5000"]\n  capabilities = ["pull", "resolve"]\n  dial_timeout = "1s"\n'
                f"# <<< larder-managed-block: {RELEASE}\n"
            ),
            text,
        )
    else:
        check("[referrers] containerd installed (the real 1.6 binary)", False, "no containerd on PATH")
    for version, expected in (("1.7", without), ("2.1", without), ("2.2", with_referrers), ("2.3", with_referrers)):
        run_, caps, text = run(f"containerd {version}", {"/usr/bin/containerd": CONTAINERD_VERSIONS[version]})
        check(f"[referrers] containerd {version}: capabilities {expected}", caps == expected, (caps, run_))
        if version == "2.2":
            check(
                "[referrers] containerd 2.2: the hosts.toml text, exactly",
                text.endswith(
                    f'[host."http://{NODE_IP}:5000"]\n  capabilities = ["pull", "resolve", "referrers"]\n'
                    f'  dial_timeout = "1s"\n# <<< larder-managed-block: {RELEASE}\n'
                ),
                text,
            )
            check("[referrers] containerd 2.2: the reason is logged", "containerd 2.2 accepts it" in run_.err, run_)
    # k3s and distribution packages print their own version strings.
    run_, caps, _ = run("containerd.io 2.3", {"/usr/local/bin/containerd": "containerd containerd.io 2.3.1 b4f6c0e"})
    check("[referrers] Docker's containerd.io package (2.3.1, in /usr/local/bin): written", caps == with_referrers, run_)
    beta = "containerd github.com/containerd/containerd/v2 v2.2.0-beta.0 5bcf77a55038ad658c57fdecc48af54935a0d42f"
    run_, caps, _ = run("2.2.0-beta.0", {"/usr/bin/containerd": beta})
    check("[referrers] 2.2.0-beta.0 (before referrers existed): left out", caps == without, (caps, run_))
    # Unknown: nothing found, an answer that is no version, two binaries disagreeing.
    run_, caps, _ = run("no containerd binary", {})
    check(
        "[referrers] no containerd binary on the node: left out, and said so",
        caps == without and "no containerd binary in" in run_.err,
        (caps, run_),
    )
    run_, caps, _ = run("garbage version", {"/usr/bin/containerd": "not containerd at all"})
    check("[referrers] --version that is not a version: left out", caps == without and "unknown" in run_.err, (caps, run_))
    # Hostile or broken binaries: the node setup still finishes, with the
    # capability left out. A version too large for sh's arithmetic; one
    # that ignores SIGTERM and never exits; one that writes forever (in a
    # container with little memory: here 64 MiB of address space). Each
    # runs in a PID namespace of its own, as in a container, so that
    # nothing outlives its run.
    huge = "containerd github.com/containerd/containerd/v2 v99999999999999999999.1 x"
    run_, caps, _ = run("a version sh cannot count", {"/usr/bin/containerd": huge})
    check("[referrers] a version too large to compare: left out", caps == without and "unknown" in run_.err, (caps, run_))
    unshare = shutil.which("unshare") or "/usr/bin/unshare"
    prlimit = shutil.which("prlimit") or "/usr/bin/prlimit"
    own_pids = [unshare, "--pid", "--fork", "--kill-child", "--"]
    hostile = {
        # The control: a well-behaved 2.3 under the same limits.
        "prints its version": f"echo '{CONTAINERD_VERSIONS['2.3']}'",
        "ignores SIGTERM and hangs": "trap '' TERM\nwhile :; do /usr/bin/busybox sleep 1; done",
        "writes forever": "while :; do echo 'containerd x v2.3.0 aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'; done",
    }
    for label, body in hostile.items():
        started = time.monotonic()
        try:
            run_, caps, _ = run(
                label,
                {"/usr/bin/containerd": f"#!/bin/sh\n{body}\n"},
                prefix=[*own_pids, prlimit, f"--as={64 << 20}", "--"],
            )
        except subprocess.TimeoutExpired as e:
            check(f"[referrers] a containerd that {label}: the node setup finishes", False, f"still running after {e.timeout}s")
            continue
        took = time.monotonic() - started
        expected = with_referrers if label == "prints its version" else without
        check(
            f"[referrers] a containerd that {label}: the node setup finishes ({took:.0f}s), capabilities {expected}",
            caps == expected and len(run_.err) < 20_000,
            (caps, run_.rc, run_.err[-3000:]),
        )
    run_, caps, _ = run(
        "2.3 and 1.7 both installed",
        {"/usr/local/bin/containerd": CONTAINERD_VERSIONS["2.3"], "/usr/bin/containerd": CONTAINERD_VERSIONS["1.7"]},
    )
    check("[referrers] two binaries (2.3 and 1.7): the older one decides, left out", caps == without, (caps, run_))
    # Without SYS_CHROOT (a runtime or policy that drops it) the binary
    # cannot run: unknown, left out.
    setpriv = shutil.which("setpriv")
    if setpriv:
        run_, caps, _ = run(
            "2.3 without SYS_CHROOT",
            {"/usr/bin/containerd": CONTAINERD_VERSIONS["2.3"]},
            prefix=[setpriv, "--bounding-set=-sys_chroot", "--"],
        )
        check(
            "[referrers] 2.3 but no SYS_CHROOT: cannot run it, left out",
            caps == without and "--version failed" in run_.err,
            (caps, run_),
        )
    else:
        check("[referrers] setpriv installed (util-linux)", False, "no setpriv")

    # Overrides: no detection, no mounts, no capability.
    for value, expected in (("always", with_referrers), ("never", without)):
        rr = render(f"nodeSetup referrers {value}", node_values(referrers=value))
        if not rr:
            continue
        spec = pod_spec(rr, "DaemonSet", "larder")
        init = init_container(spec, "containerd-hosts")
        check(
            f"[referrers] {value}: no node root, no SYS_CHROOT",
            "node-root" not in {v["name"] for v in spec["volumes"]}
            and not any(m["mountPath"].startswith("/host/node") for m in init["volumeMounts"])
            and init["securityContext"]["capabilities"] == {"drop": ["ALL"]},
            init,
        )
        binary = CONTAINERD_VERSIONS["2.3"] if value == "never" else CONTAINERD_VERSIONS["1.7"]
        run_, caps, _ = run(f"referrers {value}", {"/usr/bin/containerd": binary}, rr=rr)
        check(f"[referrers] nodeSetup.referrers={value}: capabilities {expected}", caps == expected, (caps, run_))
    rr = render("nodeSetup k3s bin dir", node_values(distribution="k3s"))
    if rr:
        spec = pod_spec(rr, "DaemonSet", "larder")
        init = init_container(spec, "containerd-hosts")
        env = {e["name"]: e.get("value") for e in init["env"]}
        vols = {v["name"]: v for v in spec["volumes"]}
        k3s_bin = "/var/lib/rancher/k3s/data/current/bin"
        mount = next((m for m in init["volumeMounts"] if m["mountPath"] == "/host/node" + k3s_bin), {})
        check(
            "[referrers] k3s: its data bin folder searched and mounted read-only (with /usr)",
            env.get("LARDER_CONTAINERD_BIN_DIRS") == k3s_bin
            and vols.get(mount.get("name"), {}).get("hostPath") == {"path": k3s_bin, "type": "Directory"}
            and mount.get("readOnly") is True
            and any(m["mountPath"] == "/host/node/usr" for m in init["volumeMounts"]),
            (env, init["volumeMounts"]),
        )


def check_docs_containerd_config() -> None:
    """The containerd 2.1-2.3 config docs/kubernetes.md shows: TOML, its
    keys where containerd reads them, and accepted by the node setup."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "kubernetes.md").read_text()
    header = "# /etc/containerd/config.toml\n"
    start = text.find("<!-- checked-by: charts/test_nodesetup.py -->\n```text\n" + header)
    if not check("[docs] docs/kubernetes.md shows a containerd config checked here", start >= 0):
        return
    body = text[start:].split("```text\n", 1)[1].split("```", 1)[0]
    config = tomllib.loads(body)
    plugins = config.get("plugins", {})
    check(
        "[docs] the config: version 3, config_path under io.containerd.cri.v1.images, the transfer service's settings",
        config.get("version") == 3
        and plugins.get("io.containerd.cri.v1.images", {}).get("registry") == {"config_path": "/etc/containerd/certs.d"}
        and plugins.get("io.containerd.transfer.v1.local")
        == {"max_concurrent_downloads": 3, "concurrent_layer_fetch_buffer": 8 << 20},
        config,
    )
    r = render("docs containerd config", node_values())
    if not r:
        return
    node = Node()
    try:
        node.write("/etc/containerd/config.toml", body)
        run = setup_run(r, node)
        check(
            "[docs] the node setup accepts it and writes every upstream's hosts.toml",
            run.rc == 0
            and sorted(k for k in node.files("/etc/containerd/certs.d") if k.endswith("hosts.toml"))
            == sorted(f"{n}/hosts.toml" for n in NAMES),
            run,
        )
    finally:
        node.cleanup()


def check_real_containerd() -> None:
    """containerd 1.6 pulls through larder via the script's hosts files."""
    for tool in ("containerd", "ctr", "docker-registry", "skopeo"):
        if not check(f"[real] {tool} installed", shutil.which(tool), tool):
            return
    if not check("[real] larder binary", tc.LARDER is not None):
        return
    if not check(f"[real] {REGISTRY} pinned to 127.0.0.1 in /etc/hosts", pin_registry_name()):
        return
    version = subprocess.run(["containerd", "--version"], capture_output=True, text=True).stdout.strip()
    print(f"     ({version})")
    cleanup: list = []
    tmp = Path(tempfile.mkdtemp(prefix="larder-real-"))
    try:
        origin = Origin(tmp)
        cleanup.append(origin.stop)
        for i, repo in enumerate(("team/app-ctr", "team/app-cri", "team/app-down", "team/app-fresh", "team/app-referrers")):
            push_image(origin, tmp, repo, i)

        larder_port = tc.free_port()
        base = tmp / "containerd"
        base.mkdir()
        hosts_dir = tmp / "node" / "etc" / "containerd" / "certs.d"
        config = tmp / "node" / "etc" / "containerd" / "config.toml"
        config.parent.mkdir(parents=True)
        config.write_text(Containerd.config_text(base, hosts_dir))

        values = {
            "mode": "node",
            "upstreams": [{"name": REGISTRY, "url": f"http://127.0.0.1:{origin.port}"}],
            "node": {"hostPort": larder_port},
            "nodeSetup": {"enabled": True, "certsDir": str(hosts_dir), "containerdConfig": str(config)},
        }
        r = render("real containerd", values)
        if not r:
            return
        # The node is this machine: its folders are the real ones.
        run = setup_run(r, Node(Path("/")), host_ip="127.0.0.1")
        if not check("[real] the script accepts the private containerd's config", run.rc == 0, run):
            return
        hosts_file = hosts_dir / REGISTRY / "hosts.toml"
        hosts = tomllib.loads(hosts_file.read_text())
        print("     hosts.toml written:\n       " + hosts_file.read_text().replace("\n", "\n       "))
        check(
            "[real] hosts.toml: the registry as server, larder at 127.0.0.1:<hostPort> with dial_timeout",
            hosts["server"] == f"http://127.0.0.1:{origin.port}"
            and hosts["host"]
            == {f"http://127.0.0.1:{larder_port}": {"capabilities": ["pull", "resolve"], "dial_timeout": "1s"}},
            hosts,
        )

        larder = Larder(
            tmp, r.toml_text(), larder_port, tc.container(r.get("DaemonSet", "larder")["spec"]["template"])["args"]
        )
        cleanup.append(larder.stop)
        containerd = Containerd(base, config)
        cleanup.append(containerd.stop)

        def served() -> float:
            return larder.metric("larder_requests_total", 'route="blob"')

        before = served()
        rc, out, took = containerd.ctr_pull(f"{REGISTRY}/team/app-ctr:v1", hosts_dir)
        check("[real] ctr pull through larder: ok", rc == 0, out[-2000:])
        check(
            "[real] ctr pull: larder served the blobs (so containerd 1.6 parsed the hosts.toml, dial_timeout and all)",
            served() - before >= 2,
            (served(), before, larder.log.read_text()[-1500:]),
        )
        check(
            f"[real] ctr pull: larder fetched from upstream {REGISTRY} by ?ns=",
            larder.metric("larder_upstream_requests_total", f'upstream="{REGISTRY}"') > 0,
        )

        before = served()
        ok, detail = containerd.cri_pull(f"{REGISTRY}/team/app-cri:v1")
        check(
            "[real] CRI PullImage (the kubelet's call) through larder: ok",
            ok,
            (detail, containerd.log.read_text()[-2000:]),
        )
        check(
            "[real] CRI PullImage: larder served the blobs (the CRI plugin read config_path)",
            served() - before >= 2,
            (served(), before),
        )

        # What the referrers detection prevents: containerd 1.6 given a
        # hosts.toml with `referrers` refuses the capability, drops the
        # whole file and pulls from the registry itself, silently.
        always = render(
            "real containerd, referrers always",
            {**values, "nodeSetup": {**values["nodeSetup"], "referrers": "always"}},
        )
        if always:
            run = setup_run(always, Node(Path("/")), host_ip="127.0.0.1")
            hosts = tomllib.loads(hosts_file.read_text())
            check(
                "[real] referrers=always writes the capability",
                run.rc == 0
                and hosts["host"][f"http://127.0.0.1:{larder_port}"]["capabilities"] == ["pull", "resolve", "referrers"],
                (run, hosts),
            )
            before = served()
            ok, detail = containerd.cri_pull(f"{REGISTRY}/team/app-referrers:v1")
            # Without the file, not even its `server` is used: containerd
            # goes to https://<the image's registry> itself (here a made-up
            # name pinned to 127.0.0.1, where nothing answers on 443; on a
            # real node, the registry: the pull works, around larder).
            check(
                "[real] containerd 1.6 with referrers in hosts.toml: the whole file is ignored, "
                f"the pull goes to https://{REGISTRY} itself",
                not ok and f'"https://{REGISTRY}/v2/team/app-referrers/manifests/v1"' in detail,
                detail,
            )
            check("[real] ... and larder is asked nothing", served() == before, (served(), before))
            log = containerd.log.read_text()
            check(
                '[real] ... and containerd 1.6 logs why: "unknown capability referrers"',
                "unknown capability referrers" in log,
                log[-2000:],
            )
            print("     " + next((line for line in log.splitlines() if "unknown capability referrers" in line), "")[:300])
            # The chart's default (auto) detects 1.6 on this machine and takes it out again.
            run = setup_run(r, Node(Path("/")), host_ip="127.0.0.1")
            hosts = tomllib.loads(hosts_file.read_text())
            check(
                "[real] referrers=auto on this machine (containerd 1.6): pull and resolve again",
                run.rc == 0
                and hosts["host"][f"http://127.0.0.1:{larder_port}"]["capabilities"] == ["pull", "resolve"]
                and "containerd 1.6 would refuse" in run.err,
                run,
            )

        # The mirror down: nothing listens on its port any more.
        larder.stop()
        gets = origin.blob_gets()
        rc, out, took = containerd.ctr_pull(f"{REGISTRY}/team/app-down:v1", hosts_dir)
        check("[real] larder down (connection refused): ctr pull falls back to the registry: ok", rc == 0, out[-2000:])
        check(
            "[real] larder down: the registry served the blobs itself",
            origin.blob_gets() - gets >= 2,
            (gets, origin.blob_gets()),
        )
        print(f"     larder down (refused): the pull took {took:.1f}s")
        ok, detail = containerd.cri_pull(f"{REGISTRY}/team/app-ctr:v1")
        check("[real] larder down: CRI PullImage still succeeds (fallback)", ok, detail)

        # The mirror's address drops packets: containerd 1.6 does not know
        # dial_timeout (hosts.toml gained it in 2.1) and waits for its own
        # 30 s connect timeout on every request before trying the next host.
        # Pulling an image whose content is already here costs one request
        # (resolving the tag), so one such wait.
        hole = BlackHole(larder_port)
        cleanup.append(hole.close)
        if check("[real] black hole: connecting to larder's port hangs", hole.works):
            rc, out, took = containerd.ctr_pull(f"{REGISTRY}/team/app-ctr:v1", hosts_dir)
            print(f"     larder's address dropping packets: resolving a tag took {took:.1f}s ({version})")
            check("[real] black hole: ctr pull still succeeds through the registry", rc == 0, out[-2000:])
            check(
                "[real] black hole: containerd 1.6 ignores dial_timeout = 1s (it waits for its own 30 s dial timeout)",
                took > 25,
                f"{took:.1f}s",
            )
            # A fresh one-layer image: every request (tag, manifest, config,
            # layer) waits out the dead host first. Timed, not asserted.
            rc, out, took = containerd.ctr_pull(f"{REGISTRY}/team/app-fresh:v1", hosts_dir)
            print(f"     larder's address dropping packets: a fresh one-layer pull took {took:.1f}s ({version})")
            check("[real] black hole: a fresh pull still succeeds through the registry", rc == 0, out[-2000:])
    finally:
        for stop in reversed(cleanup):
            try:
                stop()
            except Exception as e:  # noqa: BLE001
                print(f"     cleanup: {e}")
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> int:
    global BUSYBOX_BIN, CONTAINERD_DEFAULT
    start = time.monotonic()
    tc.quiet_helm()
    tc.LARDER = tc.larder_bin()
    BUSYBOX_BIN = busybox_bin()
    if not check("busybox installed (the script runs under busybox's sh and awk)", BUSYBOX_BIN):
        print(f"{tc.passed} passed, {tc.failed} failed")
        return 1
    CONTAINERD_DEFAULT = containerd_default_config() if shutil.which("containerd") else ""
    for scenario in (
        check_shellcheck,
        check_toml_reader,
        check_containerd_configs,
        check_distributions,
        check_existing_files,
        check_mirror_addresses,
        check_listen_address,
        check_node_pools,
        check_referrers,
        check_docs_containerd_config,
        check_cleanup_wait,
        check_real_containerd,
    ):
        try:
            scenario()
        except Exception as e:  # noqa: BLE001
            frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
            where = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
            check(f"{scenario.__name__} completes", False, f"{type(e).__name__}: {e} (line {where.lineno})")
    shutil.rmtree(BUSYBOX_BIN, ignore_errors=True)
    print(f"({time.monotonic() - start:.1f}s)")
    print(f"{tc.passed} passed, {tc.failed} failed")
    return 1 if tc.failed else 0


if __name__ == "__main__":
    sys.exit(main())
