#!/usr/bin/env python3
"""Tests for the larder Helm chart in charts/larder.

Needs: python3 -m pip install helm-python-sdk kubernetes-validate pyyaml
(helm-python-sdk bundles Helm's Go SDK v4: no helm binary, no cluster, no
network), and the openssl CLI (a test certificate for peer TLS).

What it does:
  * lints the chart (strict) with default and node-mode values;
  * renders it in several configurations (default; node mode with
    hostNetwork; node mode with an emptyDir cache; ServiceMonitor + PDB +
    nodeSetup + Grafana dashboard; credentials and a private CA; persistence
    disabled; preStop sleep; …) and validates every rendered object against
    the Kubernetes 1.30 schemas (kubernetes-validate, strict). Kinds without
    a built-in schema (the ServiceMonitor CRD) are only checked for
    apiVersion, kind and metadata;
  * checks the properties that matter: security contexts, probes on the
    admin port, ports, the cache volume (PVC, emptyDir or hostPath), that
    terminationGracePeriodSeconds exceeds server.shutdown_grace, that the
    Secret and CA mounts are where larder.toml says, selectors;
  * extracts larder.toml from each rendered ConfigMap and runs
    `larder check-config` on it. The binary is $LARDER_BIN, default
    target/debug/larder; when that default is missing it is built with
    `cargo build`. check-config reads `password_file` and checks that
    `ca_file` is a file, and those paths (/run/secrets/larder/...,
    /run/larder/ca/...) only exist inside the pod: the test creates them
    under a temporary folder and rewrites the paths in the extracted TOML to
    point there (it also checks that check-config refuses the unrewritten
    TOML, so the rewrite is what makes it pass);
  * starts larder once with the default rendering's larder.toml and the
    container's exact args (listeners moved to free 127.0.0.1 ports, cache
    to a temporary folder): /healthz, /readyz, /metrics and /v2/ answer 200,
    logs are JSON, SIGTERM ends it with status 0;
  * runs the rendered node setup script against temporary folders and reads
    back the hosts.toml files it writes;
  * cluster mode (issue 11): cluster.enabled renders `[cluster]` with the
    peers' headless Service (the peer port in no client-facing Service),
    a generated cluster Secret (kept across upgrades: rendered again with
    `lookup` answering the Secret) or an existing one, `[shared]` with its
    keys from a Secret or the environment, the peer NetworkPolicy (who may
    reach which port, evaluated from the rendered policies), and node
    mirrors going through a hub (`via`); larder accepts every such
    larder.toml, and runs the cluster one: its peer port refuses a request
    without the secret and takes the mounted one. With config.tls, peers
    talk TLS: `https://` self, `tls_name` the peers' Service name, the TLS
    Secret's ca.crt mounted as `ca_file`; larder runs that config with a
    real certificate naming Services only (made with the openssl CLI), and
    its peer port speaks TLS verified under tls_name;
  * checks that invalid values are refused at render time;
  * checks dashboards/larder.json parses and uses only metrics listed in the
    metric table of docs/operating.md, and that every value in values.yaml is
    in the chart README's values table.

Runs in about two seconds.

Prints one line per check and, last, "N passed, M failed"; the exit status
is 1 when anything failed.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
import urllib.error
import urllib.request
from pathlib import Path

import helm_python
import kubernetes_validate
import yaml

CHARTS = Path(__file__).resolve().parent
CHART = CHARTS / "larder"
ROOT = CHARTS.parent
KUBE_VERSION = "1.30"
NAMESPACE = "cache"
# Kinds from CRDs: no schema in kubernetes-validate, structure-checked only.
CRD_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}

passed = 0
failed = 0


def check(name: str, cond: object, detail: object = "") -> bool:
    global passed, failed
    if cond:
        passed += 1
        print(f"ok   {name}")
        return True
    failed += 1
    print(f"FAIL {name}" + (f": {detail}" if detail != "" else ""))
    return False


# ---------------------------------------------------------------- rendering


class Rendered:
    """One rendering of the chart: objects by (kind, name), plus NOTES."""

    def __init__(self, label: str, manifests: dict[str, str]):
        self.label = label
        self.notes = ""
        self.objects: list[dict] = []
        for path, text in sorted(manifests.items()):
            if path.endswith("NOTES.txt"):
                self.notes = text
                continue
            for doc in yaml.safe_load_all(text):
                if doc is not None:
                    doc["__template"] = path
                    self.objects.append(doc)

    def kinds(self) -> list[str]:
        return sorted(f"{o['kind']}/{o['metadata']['name']}" for o in self.objects)

    def get(self, kind: str, name: str) -> dict:
        for o in self.objects:
            if o["kind"] == kind and o["metadata"]["name"] == name:
                return o
        raise KeyError(f"{self.label}: no {kind}/{name} in {self.kinds()}")

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def toml_text(self, fullname: str = "larder") -> str:
        return self.get("ConfigMap", fullname)["data"]["larder.toml"]

    def toml(self, fullname: str = "larder") -> dict:
        return tomllib.loads(self.toml_text(fullname))


_chart = None


def chart() -> helm_python.Chart:
    global _chart
    if _chart is None:
        _chart = helm_python.Chart.load(str(CHART))
    return _chart


def render(label: str, values: dict, name: str = "larder", validate: bool = True) -> Rendered | None:
    try:
        manifests = chart().render(values, name=name, namespace=NAMESPACE, is_install=True)
    except helm_python.HelmError as e:
        check(f"[{label}] renders", False, e)
        return None
    r = Rendered(label, manifests)
    check(f"[{label}] renders ({len(r.objects)} objects)", r.objects)
    if validate:
        validate_all(r)
    return r


def render_error(values: dict) -> str | None:
    """The render error message, or None when the values render."""
    try:
        chart().render(values, name="larder", namespace=NAMESPACE, is_install=True)
    except helm_python.HelmError as e:
        return str(e)
    return None


def validate_all(r: Rendered) -> None:
    seen = set()
    for o in r.objects:
        obj = {k: v for k, v in o.items() if k != "__template"}
        kind, api = obj.get("kind"), obj.get("apiVersion")
        name = (obj.get("metadata") or {}).get("name")
        ident = f"{kind}/{name}"
        check(f"[{r.label}] {ident}: unique", ident not in seen)
        seen.add(ident)
        check(
            f"[{r.label}] {ident}: namespace {NAMESPACE}",
            obj["metadata"].get("namespace") == NAMESPACE,
            obj["metadata"].get("namespace"),
        )
        if (api, kind) in CRD_KINDS:
            ok = bool(api and kind and name and isinstance(obj.get("spec"), dict))
            check(f"[{r.label}] {ident}: CRD object has apiVersion, kind, metadata, spec", ok)
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            check(f"[{r.label}] {ident}: valid Kubernetes {KUBE_VERSION} {api} {kind}", True)
        except kubernetes_validate.SchemaNotFoundError as e:
            check(f"[{r.label}] {ident}: has a schema", False, e.message)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            check(f"[{r.label}] {ident}: valid Kubernetes {KUBE_VERSION}", False, f"{path}: {e.message}")


# ------------------------------------------------------------ larder binary


def larder_bin() -> Path | None:
    env = os.environ.get("LARDER_BIN")
    if env:
        p = Path(env)
        return p if p.is_file() else None
    p = ROOT / "target" / "debug" / "larder"
    if not p.is_file():
        print("larder binary missing: cargo build", flush=True)
        subprocess.run(["cargo", "build", "--quiet"], cwd=ROOT, check=False)
    return p if p.is_file() else None


LARDER: Path | None = None


# The pod's environment for `${POD_IP}` in `[cluster] self`.
POD_ENV = {"POD_IP": "10.0.0.7"}


def check_config(label: str, toml_text: str, expect_ok: bool = True, env: dict[str, str] | None = None) -> None:
    """Runs `larder check-config` on toml_text, with the pod's environment
    (POD_ENV, or `env`) added to this process's.

    The in-pod paths of password_file, ca_file and the other secret files
    are recreated under a temporary folder (dummy contents) and the TOML is
    rewritten to point there, because check-config reads the secret files
    and requires the CA file to exist. With expect_ok=False the TOML is
    checked as rendered and must be refused.
    """
    if LARDER is None:
        check(f"[{label}] larder check-config", False, "no larder binary")
        return
    with tempfile.TemporaryDirectory(prefix="larder-chart-") as tmp:
        text = toml_text
        if expect_ok:
            parsed = tomllib.loads(toml_text)
            tables = parsed.get("upstream", []) + [
                parsed.get("server", {}).get("tls", {}),
                parsed.get("server", {}).get("auth", {}),
            ]
            files = (
                ("password_file", "s3cret\n"),
                ("ca_file", "-----BEGIN CERTIFICATE-----\n"),
                ("cert", "-----BEGIN CERTIFICATE-----\n"),
                ("key", "-----BEGIN PRIVATE KEY-----\n"),
                ("htpasswd", "user:$2y$05$abcdefghijklmnopqrstuv\n"),
            )
            for u in tables:
                for key, content in files:
                    if key in u:
                        text = _recreate_file(text, u[key], content, Path(tmp))
            text = _rewrite_admin_token(parsed, text, Path(tmp))
            text = _rewrite_cluster_files(parsed, text, Path(tmp))
        cfg = Path(tmp) / "larder.toml"
        cfg.write_text(text)
        p = subprocess.run(
            [str(LARDER), "check-config", "--config", str(cfg)],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, **(POD_ENV if env is None else env)},
        )
        out = (p.stdout + p.stderr).strip()
        if expect_ok:
            check(f"[{label}] larder check-config accepts larder.toml", p.returncode == 0, out)
        else:
            check(f"[{label}] larder check-config refuses larder.toml as rendered", p.returncode == 2, out)


def _rewrite_admin_token(parsed: dict, text: str, tmp: Path) -> str:
    """Recreates `[admin] token_file` (a Secret mount in the pod) under tmp
    with a token in it, and points the TOML there."""
    in_pod = parsed.get("admin", {}).get("token_file")
    if not in_pod:
        return text
    outside = tmp / in_pod.lstrip("/")
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_text("chart-test-admin-token-0123456789\n")
    return text.replace(json.dumps(in_pod), json.dumps(str(outside)))


def _recreate_file(text: str, in_pod: str, content: str, tmp: Path) -> str:
    """Writes `content` at the in-pod path `in_pod` under tmp and points the
    TOML (every place it names that path) there."""
    outside = tmp / in_pod.lstrip("/")
    outside.parent.mkdir(parents=True, exist_ok=True)
    outside.write_text(content)
    quoted = json.dumps(in_pod)
    assert quoted in text, quoted
    return text.replace(quoted, json.dumps(str(outside)))


def _rewrite_cluster_files(parsed: dict, text: str, tmp: Path) -> str:
    """Recreates the Secret mounts `[cluster] secret_file` (and `ca_file`)
    and `[shared]`'s key files name (a Kubernetes Secret's file ends in no newline) under
    tmp, and points the TOML there."""
    if "cluster" in parsed:
        text = _recreate_file(text, parsed["cluster"]["secret_file"], "chart-test-cluster-secret-0123456789", tmp)
        ca = parsed["cluster"].get("ca_file")
        # Unless the caller wrote a real CA there already (and rewrote the path).
        if ca and json.dumps(ca) in text:
            text = _recreate_file(text, ca, "-----BEGIN CERTIFICATE-----\n", tmp)
    shared = parsed.get("shared", {})
    for key, content in (("access_key_id_file", "GKchart0test0key"), ("secret_access_key_file", "chart-test-s3")):
        if key in shared:
            text = _recreate_file(text, shared[key], content, tmp)
    return text


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Straight to 127.0.0.1, whatever http_proxy says.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str, headers: dict[str, str] | None = None) -> int | str:
    try:
        with _direct.open(urllib.request.Request(url, headers=headers or {}), timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, http.client.HTTPException) as e:
        # HTTPException: not HTTP at all (e.g. a TLS alert from a TLS port).
        return f"{type(e).__name__}: {e}"


def wait_healthy(proc: subprocess.Popen, admin: str, timeout: float = 20.0) -> int | str:
    """Polls larder's `/healthz` on `admin` until it answers 200, the process
    exits or `timeout` passes; returns the last status (or error)."""
    deadline = time.monotonic() + timeout
    status: int | str = "not started"
    while time.monotonic() < deadline and proc.poll() is None:
        status = http_status(f"http://{admin}/healthz")
        if status == 200:
            break
        time.sleep(0.05)
    return status


def wait_healthy_tls(proc: subprocess.Popen, port: int, ca: Path, name: str, timeout: float = 20.0) -> int | str:
    """wait_healthy for an admin port that speaks TLS: `/healthz` over
    https, the certificate verified under `name` with `ca`."""
    deadline = time.monotonic() + timeout
    status: int | str = "not started"
    while time.monotonic() < deadline and proc.poll() is None:
        status = _tls_status(port, ca, name, "/healthz", {})
        if status == 200:
            break
        time.sleep(0.05)
    return status


def run_larder(label: str, toml_text: str, args: list[str]) -> None:
    """Starts larder as the pod would (the container's args), on the rendered
    larder.toml with the listeners moved to free 127.0.0.1 ports and the
    cache to a temporary folder; checks the probe endpoints, /metrics and
    the registry API answer and the logs are JSON, then that SIGTERM ends
    it with status 0 within shutdown_grace. With `[cluster]`, the peer
    listener moves too (POD_IP is 127.0.0.1), and it must refuse a request
    without the cluster secret and take one with the secret file's content."""
    if LARDER is None:
        check(f"[{label}] larder runs", False, "no larder binary")
        return
    with tempfile.TemporaryDirectory(prefix="larder-chart-run-") as tmp:
        conf = tomllib.loads(toml_text)
        addr, admin, peer = (f"127.0.0.1:{free_port()}" for _ in range(3))
        text = toml_text
        for key, value in (("listen", addr), ("admin_listen", admin)):
            text = text.replace(f"{key} = {json.dumps(conf['server'][key])}", f"{key} = {json.dumps(value)}")
        if "cluster" in conf:
            text = text.replace(f"listen = {json.dumps(conf['cluster']['listen'])}", f"listen = {json.dumps(peer)}")
        text = text.replace('dir = "/var/lib/larder"', f"dir = {json.dumps(str(Path(tmp) / 'cache'))}")
        text = _rewrite_admin_token(conf, text, Path(tmp))
        text = _rewrite_cluster_files(conf, text, Path(tmp))
        cfg, log = Path(tmp) / "larder.toml", Path(tmp) / "larder.log"
        cfg.write_text(text)
        argv = [str(LARDER)] + [str(cfg) if a == "/etc/larder/larder.toml" else a for a in args]
        with open(log, "w") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=log_file, env={**os.environ, "POD_IP": "127.0.0.1"})
        try:
            status = wait_healthy(proc, admin)
            if not check(
                f"[{label}] larder starts with the pod's args", status == 200, (status, log.read_text()[-500:])
            ):
                return
            for url in (f"http://{admin}/readyz", f"http://{admin}/metrics", f"http://{addr}/v2/"):
                status = http_status(url)
                port = "admin" if admin in url else "registry"
                check(f"[{label}] GET /{url.split('/', 3)[3]} on the {port} port: 200", status == 200, status)
            if "cluster" in conf:
                secret = {"larder-cluster-secret": "chart-test-cluster-secret-0123456789"}
                status = http_status(f"http://{peer}/v2/docker.io/library/alpine/manifests/3?ns=docker.io")
                check(
                    f"[{label}] the peer port refuses a request without the cluster secret: 401", status == 401, status
                )
                status = http_status(f"http://{peer}/v2/?ns=docker.io", secret)
                check(
                    f"[{label}] ... and takes the secret file's content (404: /v2/ is no peer path)",
                    status == 404,
                    status,
                )
            proc.send_signal(signal.SIGTERM)
            grace = duration_seconds(conf["server"]["shutdown_grace"])
            try:
                rc: int | str = proc.wait(timeout=grace + 5)
            except subprocess.TimeoutExpired:
                rc = "still running"
            check(f"[{label}] SIGTERM: larder exits 0", rc == 0, rc)
            lines = [line for line in log.read_text().splitlines() if line.strip()]
            try:
                json_ok = bool(lines) and all(isinstance(json.loads(line), dict) for line in lines)
            except ValueError:
                json_ok = False
            check(f"[{label}] logs are JSON lines (--log-format json)", json_ok, lines[:3])
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# ------------------------------------------------------------------ helpers


def duration_seconds(s: str) -> float:
    m = re.fullmatch(r"(\d+)(ms|s|m|h|d)", s)
    assert m, s
    return int(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def workload(r: Rendered) -> dict:
    objs = r.of_kind("StatefulSet") + [
        d for d in r.of_kind("DaemonSet") if not d["metadata"]["name"].endswith(("-node-setup", "-node-cleanup"))
    ]
    assert len(objs) == 1, r.kinds()
    return objs[0]


def container(pod: dict, name: str = "larder") -> dict:
    return next(c for c in pod["spec"]["containers"] if c["name"] == name)


def named_port(c: dict, port: object) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c["ports"] if p["name"] == port)


def volume(pod: dict, name: str) -> dict:
    return next(v for v in pod["spec"]["volumes"] if v["name"] == name)


def mount(c: dict, path: str) -> dict | None:
    return next((m for m in c.get("volumeMounts", []) if m["mountPath"] == path), None)


def subset(small: dict, big: dict) -> bool:
    return all(big.get(k) == v for k, v in small.items())


# ------------------------------------------------------------------- checks


def check_mirror_pod(r: Rendered, node: bool, fullname: str = "larder") -> None:
    """Properties every larder pod must have, in either mode."""
    L = r.label
    w = workload(r)
    pod = w["spec"]["template"]
    spec = pod["spec"]
    c = container(pod)
    psc, csc = spec["securityContext"], c["securityContext"]
    check(
        f"[{L}] pod runAsNonRoot, 65532:65532",
        subset({"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532}, psc),
        psc,
    )
    check(f"[{L}] pod fsGroup 65532", psc.get("fsGroup") == 65532, psc)
    check(f"[{L}] pod seccomp RuntimeDefault", psc.get("seccompProfile") == {"type": "RuntimeDefault"}, psc)
    check(
        f"[{L}] container securityContext locked down",
        subset(
            {
                "runAsNonRoot": True,
                "runAsUser": 65532,
                "runAsGroup": 65532,
                "readOnlyRootFilesystem": True,
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            csc,
        ),
        csc,
    )
    check(f"[{L}] no API token mounted", spec.get("automountServiceAccountToken") is False)
    rewrite = next((i for i in spec.get("initContainers", []) if i["name"] == "listen-address"), None)
    # With it, the node's IP is written into a copy of larder.toml at start.
    config_file = "/run/larder/config/larder.toml" if rewrite else "/etc/larder/larder.toml"
    check(
        f"[{L}] args",
        c["args"] == ["--config", config_file, "--log-format", "json"],
        c["args"],
    )
    check(
        f"[{L}] Linux nodes only",
        spec.get("nodeSelector", {}).get("kubernetes.io/os") == "linux",
        spec.get("nodeSelector"),
    )
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    check(f"[{L}] RUST_LOG from logLevel", env.get("RUST_LOG") == "larder=info", env)
    ports = {p["name"]: p for p in c["ports"]}
    check(f"[{L}] admin port 9090", ports.get("admin", {}).get("containerPort") == 9090, ports)
    admin_tls = r.toml(fullname).get("admin", {}).get("tls") == "server"
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        g = c.get(probe, {}).get("httpGet", {})
        check(
            f"[{L}] {probe} GET {path} on 9090",
            g.get("path") == path and named_port(c, g.get("port")) == 9090,
            g,
        )
        # The admin port speaks TLS exactly when larder.toml says so: the probe's scheme follows.
        want = "HTTPS" if admin_tls else "HTTP"
        check(f"[{L}] {probe} scheme {want} (admin TLS: {admin_tls})", g.get("scheme", "HTTP") == want, g)
    res = c["resources"]
    check(
        f"[{L}] resources 100m/320Mi requests, 512Mi limit",
        res.get("requests") == {"cpu": "100m", "memory": "320Mi"} and res.get("limits", {}).get("memory") == "512Mi",
        res,
    )
    loopback_admin = (
        node
        and spec.get("hostNetwork")
        and r.toml(fullname)["server"]["admin_listen"].startswith("127.0.0.1:")
        and not (rewrite and "s|^admin_listen" in rewrite["command"][2])
    )
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        host = c[probe]["httpGet"].get("host")
        if loopback_admin:
            check(f"[{L}] {probe} on 127.0.0.1 (admin on the node's loopback)", host == "127.0.0.1", host)
        else:
            check(f"[{L}] {probe} on the pod's IP", host is None, host)

    conf = r.toml(fullname)
    grace = duration_seconds(conf["server"]["shutdown_grace"])
    tgps = spec["terminationGracePeriodSeconds"]
    pre = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
    check(
        f"[{L}] terminationGracePeriodSeconds ({tgps}) > preStop ({pre}) + shutdown_grace ({grace})",
        tgps > pre + grace,
    )
    listen_port = int(conf["server"]["listen"].rsplit(":", 1)[1])
    admin_port = int(conf["server"]["admin_listen"].rsplit(":", 1)[1])
    check(
        f"[{L}] server.listen port = registry containerPort",
        listen_port == ports["registry"]["containerPort"],
        conf["server"],
    )
    check(
        f"[{L}] server.admin_listen port = admin containerPort",
        admin_port == ports["admin"]["containerPort"],
        conf["server"],
    )
    check(f"[{L}] cache.dir /var/lib/larder", conf["cache"]["dir"] == "/var/lib/larder")
    check(
        f"[{L}] cache volume mounted at /var/lib/larder",
        mount(c, "/var/lib/larder") and mount(c, "/var/lib/larder")["name"] == "cache",
    )
    cm = mount(c, "/etc/larder")
    check(
        f"[{L}] config mounted read-only at /etc/larder",
        cm and cm.get("readOnly") is True and volume(pod, cm["name"])["configMap"]["name"] == fullname,
    )
    check(
        f"[{L}] /tmp is an emptyDir (read-only root)",
        mount(c, "/tmp") and "emptyDir" in volume(pod, mount(c, "/tmp")["name"]),
    )
    digest = hashlib.sha256(r.toml_text(fullname).rstrip("\n").encode()).hexdigest()
    check(
        f"[{L}] checksum/config annotation = sha256(larder.toml)",
        pod["metadata"]["annotations"].get("checksum/config") == digest,
    )

    sel = w["spec"]["selector"]["matchLabels"]
    check(f"[{L}] selector matches pod labels", subset(sel, pod["metadata"]["labels"]), sel)
    svc = r.get("Service", fullname)
    check(f"[{L}] Service selects the larder pods", subset(svc["spec"]["selector"], pod["metadata"]["labels"]))
    if "service type" not in L:
        check(f"[{L}] Service type ClusterIP", svc["spec"]["type"] == "ClusterIP")
    sp = {p["name"]: p for p in svc["spec"]["ports"]}
    check(
        f"[{L}] Service: only port 5000 -> registry (no admin port)",
        list(sp) == ["registry"] and sp["registry"]["port"] == 5000 and sp["registry"].get("targetPort") == "registry",
        sp,
    )
    admin = r.get("Service", f"{fullname}-admin")
    ap = {p["name"]: p for p in admin["spec"]["ports"]}
    check(
        f"[{L}] admin Service: ClusterIP, 9090 -> admin (named metrics), selects the larder pods",
        admin["spec"]["type"] == "ClusterIP"
        and list(ap) == ["metrics"]
        and ap["metrics"]["port"] == 9090
        and ap["metrics"].get("targetPort") == "admin"
        and subset(admin["spec"]["selector"], pod["metadata"]["labels"]),
        admin["spec"],
    )
    check(
        f"[{L}] {'DaemonSet' if node else 'StatefulSet'} in {'node' if node else 'deployment'} mode",
        w["kind"] == ("DaemonSet" if node else "StatefulSet"),
    )

    # Every password_file / ca_file in larder.toml is a mounted key.
    for u in conf["upstream"]:
        for key, source in (("password_file", "secret"), ("ca_file", "configMap")):
            if key not in u or (key == "ca_file" and not u[key].startswith("/run/larder/ca/")):
                continue
            d, base = u[key].rsplit("/", 1)
            m = mount(c, d)
            ok = m is not None and m.get("readOnly") is True
            if ok:
                v = volume(pod, m["name"])
                ok = source in v and any(i["path"] == base for i in v[source].get("items", []))
            check(f"[{L}] {u['name']} {key} {u[key]} is a mounted {source} key", ok)


def check_defaults() -> None:
    r = render("default", {})
    if not r:
        return
    check(
        "[default] objects",
        r.kinds()
        == [
            "ConfigMap/larder",
            "Secret/larder-admin-token",
            "Service/larder",
            "Service/larder-admin",
            "Service/larder-headless",
            "ServiceAccount/larder",
            "StatefulSet/larder",
        ],
        r.kinds(),
    )
    check_mirror_pod(r, node=False)
    sts = r.get("StatefulSet", "larder")
    headless = r.get("Service", sts["spec"]["serviceName"])
    check("[default] StatefulSet serviceName is a headless Service", headless["spec"].get("clusterIP") == "None")
    check("[default] replicas 1", sts["spec"]["replicas"] == 1)
    vct = sts["spec"].get("volumeClaimTemplates", [])
    check(
        "[default] PVC template 'cache' 50Gi ReadWriteOnce, default StorageClass",
        len(vct) == 1
        and vct[0]["metadata"]["name"] == "cache"
        and vct[0]["spec"]["resources"]["requests"]["storage"] == "50Gi"
        and vct[0]["spec"]["accessModes"] == ["ReadWriteOnce"]
        and "storageClassName" not in vct[0]["spec"],
        vct,
    )
    pod = sts["spec"]["template"]
    check("[default] cache is the PVC, not a pod volume", all(v["name"] != "cache" for v in pod["spec"]["volumes"]))
    check(
        "[default] no hostPort / hostNetwork",
        "hostNetwork" not in pod["spec"] and all("hostPort" not in p for p in container(pod)["ports"]),
    )
    check(
        "[default] ServiceAccount automount off",
        r.get("ServiceAccount", "larder").get("automountServiceAccountToken") is False,
    )
    check("[default] image larder:<appVersion>", container(pod)["image"] == "larder:0.1.0", container(pod)["image"])
    conf = r.toml()
    check(
        "[default] larder.toml server section",
        conf["server"] == {"listen": "[::]:5000", "admin_listen": "[::]:9090", "shutdown_grace": "25s"},
        conf["server"],
    )
    check(
        "[default] larder.toml cache section",
        conf["cache"]
        == {
            "dir": "/var/lib/larder",
            "max_size": "43520MiB",
            "high_watermark": 0.95,
            "low_watermark": 0.85,
            "memory": "256MiB",
            "tag_ttl": "5m",
            "stale_if_error": "7d",
        },
        conf["cache"],
    )
    names = [u["name"] for u in conf["upstream"]]
    check("[default] upstreams", names == ["docker.io", "ghcr.io", "quay.io", "registry.k8s.io"], names)
    hub = conf["upstream"][0]
    check(
        "[default] docker.io upstream",
        hub
        == {
            "name": "docker.io",
            "url": "https://registry-1.docker.io",
            "default": True,
            "aliases": ["index.docker.io", "registry-1.docker.io"],
        },
        hub,
    )
    check("[default] NOTES name the Service", "larder.cache.svc.cluster.local:5000" in r.notes)
    check_config("default", r.toml_text())
    run_larder("default", r.toml_text(), container(r.get("StatefulSet", "larder")["spec"]["template"])["args"])

    r = render("release 'mirror'", {}, name="mirror")
    if r:
        check("[release 'mirror'] full name mirror-larder", r.get("StatefulSet", "mirror-larder"))
        check_mirror_pod(r, node=False, fullname="mirror-larder")


def check_node_mode() -> None:
    r = render("node+hostNetwork", {"mode": "node", "node": {"hostNetwork": True}})
    if not r:
        return
    check(
        "[node+hostNetwork] objects",
        r.kinds()
        == [
            "ConfigMap/larder",
            "DaemonSet/larder",
            "Secret/larder-admin-token",
            "Service/larder",
            "Service/larder-admin",
            "ServiceAccount/larder",
        ],
        r.kinds(),
    )
    check_mirror_pod(r, node=True)
    ds = r.get("DaemonSet", "larder")
    pod = ds["spec"]["template"]
    spec = pod["spec"]
    c = container(pod)
    reg = next(p for p in c["ports"] if p["name"] == "registry")
    check(
        "[node+hostNetwork] hostNetwork, ClusterFirstWithHostNet",
        spec.get("hostNetwork") is True and spec.get("dnsPolicy") == "ClusterFirstWithHostNet",
    )
    check(
        "[node+hostNetwork] registry hostPort 5000 = containerPort",
        reg.get("hostPort") == 5000 and reg["containerPort"] == 5000,
        reg,
    )
    server = r.toml()["server"]
    check(
        "[node+hostNetwork] admin on 127.0.0.1 only; registry address written at start (placeholder 127.0.0.1)",
        server["admin_listen"] == "127.0.0.1:9090" and server["listen"] == "127.0.0.1:5000",
        server,
    )
    init = [i["name"] for i in spec.get("initContainers", [])]
    check("[node+hostNetwork] init container writes the node's IP as listen address", init == ["listen-address"], init)
    check(
        "[node+hostNetwork] cache: emptyDir with a 10Gi sizeLimit (kubelet-counted)",
        volume(pod, "cache") == {"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}},
        volume(pod, "cache"),
    )
    check(
        "[node+hostNetwork] max_size 85% of the emptyDir", r.toml()["cache"]["max_size"] == "8704MiB", r.toml()["cache"]
    )
    check("[node+hostNetwork] no PVC", "volumeClaimTemplates" not in ds["spec"])
    check(
        "[node+hostNetwork] rolling update without surge (hostPort)",
        ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1},
    )
    check(
        "[node+hostNetwork] tolerates every taint (like nodeSetup)", spec.get("tolerations") == [{"operator": "Exists"}]
    )
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    check(
        "[node+hostNetwork] not on virtual-kubelet or Fargate nodes",
        {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]} in terms[0]["matchExpressions"]
        and any(e["key"] == "eks.amazonaws.com/compute-type" for e in terms[0]["matchExpressions"]),
        terms,
    )
    check("[node+hostNetwork] NOTES: admin Service has no reachable endpoints", "127.0.0.1 only" in r.notes)
    check_config("node+hostNetwork", r.toml_text())

    r = render(
        "node hostPath",
        {"mode": "node", "node": {"cache": {"type": "hostPath"}}, "config": {"cache": {"maxSize": "30GiB"}}},
    )
    if r:
        check_mirror_pod(r, node=True)
        pod = r.get("DaemonSet", "larder")["spec"]["template"]
        spec = pod["spec"]
        cache = volume(pod, "cache")
        check(
            "[node hostPath] cache on hostPath /var/lib/larder, max_size as given",
            cache.get("hostPath") == {"path": "/var/lib/larder", "type": "DirectoryOrCreate"}
            and r.toml()["cache"]["max_size"] == "30GiB",
            cache,
        )
        init = spec.get("initContainers", [])
        check(
            "[node hostPath] init container chowns the hostPath to 65532",
            len(init) == 1
            and init[0]["command"][:2] == ["/bin/sh", "-c"]
            and "owner=65532:65532;" in init[0]["command"][2]
            and 'chown -R "$owner" /var/lib/larder' in init[0]["command"][2]
            and init[0]["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}
            and init[0]["securityContext"]["allowPrivilegeEscalation"] is False,
            init,
        )
        if init:
            # The script itself, on a temporary folder already owned by us: it
            # must see the owner is right and exit 0 without chown.
            with tempfile.TemporaryDirectory(prefix="larder-chown-") as tmp:
                script = init[0]["command"][2].replace("/var/lib/larder", tmp)
                script = script.replace("owner=65532:65532", f"owner={os.getuid()}:{os.getgid()}")
                p = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10)
                check("[node hostPath] chown script runs (owner already right)", p.returncode == 0, p.stderr)
        check(
            "[node hostPath] the registry hostPort on every node address (no node.hostIP), probes on the pod IP",
            "hostIP" not in next(p for p in container(pod)["ports"] if p["name"] == "registry"),
        )
        check_config("node hostPath", r.toml_text())

    r = render(
        "node hostPort 5001 emptyDir",
        {"mode": "node", "node": {"hostPort": 5001, "cache": {"type": "emptyDir", "emptyDirSizeLimit": "20Gi"}}},
    )
    if r:
        check_mirror_pod(r, node=True)
        pod = r.get("DaemonSet", "larder")["spec"]["template"]
        reg = next(p for p in container(pod)["ports"] if p["name"] == "registry")
        check(
            "[node hostPort 5001 emptyDir] hostPort 5001 -> containerPort 5000",
            reg.get("hostPort") == 5001 and reg["containerPort"] == 5000,
            reg,
        )
        check("[node hostPort 5001 emptyDir] not on host network", "hostNetwork" not in pod["spec"])
        check(
            "[node hostPort 5001 emptyDir] cache emptyDir 20Gi, max_size 17408MiB",
            volume(pod, "cache") == {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}}
            and r.toml()["cache"]["max_size"] == "17408MiB",
        )
        check("[node hostPort 5001 emptyDir] no init container", not pod["spec"].get("initContainers"))
        check(
            "[node hostPort 5001 emptyDir] listeners on [::] in the pod",
            r.toml()["server"]["listen"] == "[::]:5000" and r.toml()["server"]["admin_listen"] == "[::]:9090",
        )
        check_config("node hostPort 5001 emptyDir", r.toml_text())

    r = render("node hostNetwork hostPort 5001", {"mode": "node", "node": {"hostNetwork": True, "hostPort": 5001}})
    if r:
        check_mirror_pod(r, node=True)
        reg = next(
            p for p in container(r.get("DaemonSet", "larder")["spec"]["template"])["ports"] if p["name"] == "registry"
        )
        check(
            "[node hostNetwork hostPort 5001] listens on 5001",
            r.toml()["server"]["listen"] == "127.0.0.1:5001" and reg["containerPort"] == 5001 == reg["hostPort"],
            reg,
        )

    r = render("node.hostIP hostPort", {"mode": "node", "node": {"hostIP": "169.254.20.11"}})
    if r:
        check_mirror_pod(r, node=True)
        reg = next(
            p for p in container(r.get("DaemonSet", "larder")["spec"]["template"])["ports"] if p["name"] == "registry"
        )
        check(
            "[node.hostIP hostPort] the hostPort published on 169.254.20.11 only",
            reg.get("hostIP") == "169.254.20.11",
            reg,
        )

    r = render("node.hostIP hostNetwork", {"mode": "node", "node": {"hostIP": "169.254.20.11", "hostNetwork": True}})
    if r:
        check_mirror_pod(r, node=True)
        spec = r.get("DaemonSet", "larder")["spec"]["template"]["spec"]
        check(
            "[node.hostIP hostNetwork] registry on 169.254.20.11, admin on 127.0.0.1, no runtime rewrite",
            r.toml()["server"]["listen"] == "169.254.20.11:5000"
            and r.toml()["server"]["admin_listen"] == "127.0.0.1:9090"
            and not spec.get("initContainers"),
            (r.toml()["server"], spec.get("initContainers")),
        )

    r = render(
        "node adminOnHostIP + ServiceMonitor",
        {"mode": "node", "node": {"hostNetwork": True, "adminOnHostIP": True}, "serviceMonitor": {"enabled": True}},
    )
    if r:
        spec = r.get("DaemonSet", "larder")["spec"]["template"]["spec"]
        script = spec["initContainers"][0]["command"][2]
        check(
            "[node adminOnHostIP] the admin address is written at start too, probes on the pod (= node) IP",
            "admin_listen = " in script
            and container(r.get("DaemonSet", "larder")["spec"]["template"])["livenessProbe"]["httpGet"].get("host")
            is None,
            script,
        )


def check_extras() -> None:
    values = {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "podDisruptionBudget": {"enabled": True},
        "nodeSetup": {"enabled": True},
        "service": {"clusterIP": "10.96.0.50"},
        "grafanaDashboard": {"enabled": True},
        "networkPolicy": {"enabled": True},
    }
    r = render("extras", values)
    if not r:
        return
    check(
        "[extras] objects",
        r.kinds()
        == [
            "ConfigMap/larder",
            "ConfigMap/larder-dashboard",
            "ConfigMap/larder-node-cleanup",
            "ConfigMap/larder-node-setup",
            "DaemonSet/larder-node-cleanup",
            "DaemonSet/larder-node-setup",
            "NetworkPolicy/larder",
            "Pod/larder-node-cleanup-wait",
            "PodDisruptionBudget/larder",
            "Secret/larder-admin-token",
            "Service/larder",
            "Service/larder-admin",
            "Service/larder-headless",
            "Service/larder-node-cleanup",
            "ServiceAccount/larder",
            "ServiceMonitor/larder",
            "StatefulSet/larder",
        ],
        r.kinds(),
    )
    check_mirror_pod(r, node=False)
    pod_labels = r.get("StatefulSet", "larder")["spec"]["template"]["metadata"]["labels"]
    ns_ds = r.get("DaemonSet", "larder-node-setup")
    ns_labels = ns_ds["spec"]["template"]["metadata"]["labels"]

    sm = r.get("ServiceMonitor", "larder")
    ep = sm["spec"]["endpoints"]
    check(
        "[extras] ServiceMonitor scrapes /metrics on port 'metrics'",
        len(ep) == 1 and ep[0]["port"] == "metrics" and ep[0]["path"] == "/metrics",
        ep,
    )
    check("[extras] ServiceMonitor extra labels", sm["metadata"]["labels"].get("release") == "kube-prometheus-stack")
    services = [
        s for s in r.of_kind("Service") if subset(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
    ]
    with_metrics = [s["metadata"]["name"] for s in services if any(p["name"] == "metrics" for p in s["spec"]["ports"])]
    check(
        "[extras] exactly one selected Service has a 'metrics' port: the admin one",
        with_metrics == ["larder-admin"],
        with_metrics,
    )

    pdb = r.get("PodDisruptionBudget", "larder")
    sel = pdb["spec"]["selector"]["matchLabels"]
    check(
        "[extras] PDB maxUnavailable 1",
        pdb["spec"].get("maxUnavailable") == 1 and "minAvailable" not in pdb["spec"],
        pdb["spec"],
    )
    check(
        "[extras] PDB selects larder pods, not node setup pods", subset(sel, pod_labels) and not subset(sel, ns_labels)
    )
    svc = r.get("Service", "larder")
    check("[extras] Service does not select node setup pods", not subset(svc["spec"]["selector"], ns_labels))
    check("[extras] node setup selector matches its pods", subset(ns_ds["spec"]["selector"]["matchLabels"], ns_labels))

    spec = ns_ds["spec"]["template"]["spec"]
    hosts = volume(ns_ds["spec"]["template"], "containerd-hosts")
    config = volume(ns_ds["spec"]["template"], "containerd-config")
    check(
        "[extras] node setup mounts /etc/containerd/certs.d, and /etc/containerd read-only",
        hosts.get("hostPath") == {"path": "/etc/containerd/certs.d", "type": "DirectoryOrCreate"}
        and config.get("hostPath") == {"path": "/etc/containerd", "type": "Directory"},
        (hosts, config),
    )
    init = spec["initContainers"][0]
    check(
        "[extras] node setup init container runs the script with busybox",
        init["image"] == "busybox:1.36.1" and init["command"] == ["/bin/sh", "/opt/larder/containerd-hosts.sh"],
        init,
    )
    config_mount = next(m for m in init["volumeMounts"] if m["name"] == "containerd-config")
    check("[extras] containerd's config mounted read-only", config_mount.get("readOnly") is True, config_mount)
    check(
        "[extras] node setup init container has only SYS_CHROOT (nodeSetup.referrers: auto runs the node's "
        "containerd --version), its failure reason is the termination message",
        init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["SYS_CHROOT"]}
        and init["securityContext"]["allowPrivilegeEscalation"] is False
        and init.get("terminationMessagePolicy") == "FallbackToLogsOnError",
    )
    env = {e["name"]: e.get("value") for e in init["env"]}
    check(
        "[extras] deployment mode: the Service's cluster IP as mirror, dial_timeout 1s, prepend",
        env.get("LARDER_MIRRORS") == "http://10.96.0.50:5000"
        and env.get("LARDER_DIAL_TIMEOUT") == "1s"
        and env.get("LARDER_EXISTING") == "prepend"
        and env.get("LARDER_UPSTREAMS")
        == "docker.io https://registry-1.docker.io\nghcr.io https://ghcr.io\nquay.io https://quay.io\nregistry.k8s.io https://registry.k8s.io",
        env,
    )
    pause = spec["containers"][0]
    check(
        "[extras] node setup keeps running as non-root",
        pause["securityContext"]["runAsNonRoot"] is True and "sleep" in pause["command"][-1],
    )
    check("[extras] node setup tolerates every taint", spec.get("tolerations") == [{"operator": "Exists"}])
    check("[extras] node setup on Linux nodes only", spec.get("nodeSelector") == {"kubernetes.io/os": "linux"})
    exprs = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"
    ]
    check(
        "[extras] node setup not on virtual-kubelet nodes",
        {"key": "type", "operator": "NotIn", "values": ["virtual-kubelet"]} in exprs,
        exprs,
    )
    check(
        "[extras] node setup pods restart when the script changes",
        "checksum/script" in ns_ds["spec"]["template"]["metadata"]["annotations"],
    )
    script = (CHART / "files" / "containerd-hosts.sh").read_text()
    check(
        "[extras] the ConfigMap holds files/containerd-hosts.sh",
        r.get("ConfigMap", "larder-node-setup")["data"]["containerd-hosts.sh"] == script,
    )

    # The uninstall cleanup: post-delete hooks, the wait Pod after the DaemonSet.
    weights = {}
    for kind, name in (
        ("ConfigMap", "larder-node-cleanup"),
        ("Service", "larder-node-cleanup"),
        ("DaemonSet", "larder-node-cleanup"),
        ("Pod", "larder-node-cleanup-wait"),
    ):
        a = r.get(kind, name)["metadata"]["annotations"]
        weights[name, kind] = int(a.get("helm.sh/hook-weight", 0))
        check(
            f"[extras] {kind}/{name}: a post-delete hook, deleted when it succeeded",
            a.get("helm.sh/hook") == "post-delete" and "hook-succeeded" in a.get("helm.sh/hook-delete-policy", ""),
            a,
        )
    check(
        "[extras] cleanup order: script ConfigMap, then DaemonSet and Service, then the wait Pod",
        weights[("larder-node-cleanup", "ConfigMap")]
        < weights[("larder-node-cleanup", "DaemonSet")]
        < weights[("larder-node-cleanup-wait", "Pod")],
        weights,
    )
    cleanup = r.get("DaemonSet", "larder-node-cleanup")["spec"]["template"]["spec"]
    cenv = {e["name"]: e.get("value") for e in cleanup["initContainers"][0]["env"]}
    check(
        "[extras] the cleanup DaemonSet runs the script in cleanup mode on the node setup's nodes",
        cenv.get("LARDER_MODE") == "cleanup"
        and cleanup.get("tolerations") == spec.get("tolerations")
        and cleanup.get("nodeSelector") == spec.get("nodeSelector"),
        cenv,
    )
    wait = r.get("Pod", "larder-node-cleanup-wait")["spec"]["containers"][0]["command"][2]
    check(
        "[extras] the wait Pod polls the cleanup pods through the headless Service",
        "larder-node-cleanup.cache.svc.cluster.local" in wait,
    )
    p = subprocess.run(["sh", "-n", "-c", wait], capture_output=True, text=True)
    check("[extras] the wait Pod's script parses (sh -n)", p.returncode == 0, p.stderr)

    np_ = r.get("NetworkPolicy", "larder")["spec"]
    ingress = np_["ingress"]
    check(
        "[extras] NetworkPolicy: the registry port from anywhere",
        ingress[0] == {"ports": [{"port": "registry", "protocol": "TCP"}]},
        ingress[0],
    )
    check(
        "[extras] NetworkPolicy: the admin port from the monitoring namespace and this release's pods only",
        ingress[1]["ports"] == [{"port": "admin", "protocol": "TCP"}]
        and ingress[1]["from"]
        == [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
            {
                "podSelector": {
                    "matchLabels": {"app.kubernetes.io/name": "larder", "app.kubernetes.io/instance": "larder"}
                }
            },
        ],
        ingress[1],
    )
    check("[extras] NetworkPolicy selects the larder pods", subset(np_["podSelector"]["matchLabels"], pod_labels))

    dash = r.get("ConfigMap", "larder-dashboard")
    check(
        "[extras] dashboard ConfigMap has the sidecar label", dash["metadata"]["labels"].get("grafana_dashboard") == "1"
    )
    shipped = json.loads((CHART / "dashboards" / "larder.json").read_text())
    check(
        "[extras] dashboard ConfigMap holds dashboards/larder.json", json.loads(dash["data"]["larder.json"]) == shipped
    )
    check_config("extras", r.toml_text())

    r = render(
        "node+nodeSetup",
        {"mode": "node", "node": {"hostPort": 5050}, "nodeSetup": {"enabled": True, "certsDir": "/etc/k8s/certs.d"}},
    )
    if r:
        check(
            "[node+nodeSetup] no separate node setup DaemonSet: the larder DaemonSet's own init container writes",
            [d["metadata"]["name"] for d in r.of_kind("DaemonSet")] == ["larder", "larder-node-cleanup"],
            r.kinds(),
        )
        pod = r.get("DaemonSet", "larder")["spec"]["template"]
        init = {i["name"]: i for i in pod["spec"]["initContainers"]}
        env = {e["name"]: e.get("value") for e in init["containerd-hosts"]["env"]}
        check("[node+nodeSetup] mirror: each node's own IP", env.get("LARDER_MIRRORS") == "http://{nodeIP}:5050", env)
        check(
            "[node+nodeSetup] HOST_IP from status.hostIP",
            {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}}
            in init["containerd-hosts"]["env"],
        )
        check(
            "[node+nodeSetup] certsDir from values",
            volume(pod, "containerd-hosts")["hostPath"]["path"] == "/etc/k8s/certs.d"
            and env.get("LARDER_HOSTS_DIR") == "/etc/k8s/certs.d",
        )
        check(
            "[node+nodeSetup] larder pods restart when the script changes",
            "checksum/node-setup-script" in pod["metadata"]["annotations"],
        )
        cleanup = r.get("DaemonSet", "larder-node-cleanup")["spec"]["template"]["spec"]
        check(
            "[node+nodeSetup] the cleanup runs where larder ran",
            cleanup.get("tolerations") == pod["spec"].get("tolerations")
            and cleanup.get("affinity") == pod["spec"].get("affinity"),
        )
        check_mirror_pod(r, node=True)

    r = render(
        "node fallback NodePort, excluded upstream",
        {
            "mode": "node",
            "node": {"fallbackMirror": True},
            "service": {"type": "NodePort", "nodePort": 30500, "trafficDistribution": "PreferSameNode"},
            "nodeSetup": {"enabled": True, "excludeUpstreams": ["quay.io"]},
        },
    )
    if r:
        init = r.get("DaemonSet", "larder")["spec"]["template"]["spec"]["initContainers"][0]
        env = {e["name"]: e.get("value") for e in init["env"]}
        check(
            "[node fallback NodePort] mirrors: the node's larder, then the NodePort on the node's IP",
            env.get("LARDER_MIRRORS") == "http://{nodeIP}:5000\nhttp://{nodeIP}:30500",
            env.get("LARDER_MIRRORS"),
        )
        check(
            "[node fallback NodePort] quay.io excluded",
            "quay.io" not in env.get("LARDER_UPSTREAMS", ""),
            env.get("LARDER_UPSTREAMS"),
        )
        svc = r.get("Service", "larder")["spec"]
        check(
            "[node fallback NodePort] Service: NodePort 30500, PreferSameNode",
            svc["ports"][0].get("nodePort") == 30500 and svc.get("trafficDistribution") == "PreferSameNode",
            svc,
        )

    r = render("no cleanup hook", {"mode": "node", "nodeSetup": {"enabled": True, "cleanupOnUninstall": False}})
    if r:
        check("[no cleanup hook] nodeSetup.cleanupOnUninstall=false: no hooks", not r.of_kind("Pod"), r.kinds())


def check_exposure() -> None:
    """Item 3: the admin port never on a public Service; TLS and client auth."""
    r = render("service type LoadBalancer", {"service": {"type": "LoadBalancer"}})
    if r:
        svc = r.get("Service", "larder")["spec"]
        check(
            "[service type LoadBalancer] the LoadBalancer carries the registry port only",
            svc["type"] == "LoadBalancer" and [p["name"] for p in svc["ports"]] == ["registry"],
            svc,
        )
        check(
            "[service type LoadBalancer] the admin Service stays ClusterIP",
            r.get("Service", "larder-admin")["spec"]["type"] == "ClusterIP",
        )
    r = render(
        "TLS and client auth",
        {
            "config": {
                "tls": {"enabled": True, "existingSecret": "larder-tls"},
                "auth": {"enabled": True, "existingSecret": "larder-htpasswd", "htpasswdKey": "users"},
            }
        },
    )
    if r:
        check_mirror_pod(r, node=False)
        conf = r.toml()["server"]
        check(
            "[TLS and client auth] [server.tls] and [server.auth] in larder.toml",
            conf.get("tls") == {"cert": "/run/larder/tls/tls.crt", "key": "/run/larder/tls/tls.key"}
            and conf.get("auth") == {"htpasswd": "/run/larder/auth/htpasswd", "realm": "larder"},
            conf,
        )
        pod = r.get("StatefulSet", "larder")["spec"]["template"]
        c = container(pod)
        tls, auth = volume(pod, "tls")["secret"], volume(pod, "auth")["secret"]
        check(
            "[TLS and client auth] Secrets mounted where larder.toml says (no subPath: updates reach larder)",
            tls["secretName"] == "larder-tls"
            and [i["path"] for i in tls["items"]] == ["tls.crt", "tls.key"]
            and auth["items"] == [{"key": "users", "path": "htpasswd"}]
            and mount(c, "/run/larder/tls")["readOnly"] is True
            and mount(c, "/run/larder/auth")["readOnly"] is True
            and all("subPath" not in m for m in c["volumeMounts"]),
        )
        check("[TLS and client auth] NOTES: https", "https://larder.cache.svc" in r.notes)
        check_config("TLS and client auth", r.toml_text())


def check_credentials() -> None:
    values = {
        "upstreams": [
            {
                "name": "docker.io",
                "url": "https://registry-1.docker.io",
                "default": True,
                "aliases": ["index.docker.io", "registry-1.docker.io"],
                "tagTtl": "10m",
                "immutableTags": [r"^v?\d+\.\d+\.\d+$"],
                "credentials": {"username": "mirror-bot", "existingSecret": "hub-creds", "passwordKey": "token"},
            },
            {"name": "ghcr.io", "url": "https://ghcr.io"},
            {
                "name": "registry.internal:5443",
                "url": "https://registry.internal:5443",
                "aliases": ["registry.internal"],
                "libraryNamespace": False,
                "maxConcurrency": 8,
                "connectTimeout": "5s",
                "responseTimeout": "15s",
                "bodyIdleTimeout": "1m",
                # A quote and a backslash: needs a basic string, escaped.
                "immutableTags": [r"^release-\d+$", r"^it's-\w+\\$"],
                "caConfigMap": {"name": "internal-ca", "key": "ca.pem"},
                "credentials": {"username": 'robot"$1', "existingSecret": "internal-creds"},
            },
        ],
        "config": {"cache": {"highWatermark": 1, "lowWatermark": 0.5}},
    }
    r = render("credentials", values)
    if not r:
        return
    check_mirror_pod(r, node=False)
    conf = r.toml()
    hub, ghcr, internal = conf["upstream"]
    check(
        "[credentials] docker.io username literal + password_file from the Secret mount",
        hub.get("username") == "mirror-bot" and hub.get("password_file") == "/run/secrets/larder/docker.io/token",
        hub,
    )
    check("[credentials] ghcr.io has no credentials", "username" not in ghcr and "password_file" not in ghcr, ghcr)
    check(
        "[credentials] escaped username, default passwordKey, ':' in the folder name",
        internal.get("username") == 'robot"$1'
        and internal.get("password_file") == "/run/secrets/larder/registry.internal_5443/password",
        internal,
    )
    check(
        "[credentials] ca_file from caConfigMap",
        internal.get("ca_file") == "/run/larder/ca/registry.internal_5443/ca.pem",
        internal,
    )
    check(
        "[credentials] immutable_tags survive TOML quoting byte for byte",
        hub["immutable_tags"] == values["upstreams"][0]["immutableTags"]
        and internal["immutable_tags"] == values["upstreams"][2]["immutableTags"],
        (hub["immutable_tags"], internal["immutable_tags"]),
    )
    check(
        "[credentials] regex without a quote is a TOML literal string",
        r"immutable_tags = ['^v?\d+\.\d+\.\d+$']" in r.toml_text(),
    )
    check(
        "[credentials] per-upstream keys",
        subset(
            {
                "library_namespace": False,
                "max_concurrency": 8,
                "connect_timeout": "5s",
                "response_timeout": "15s",
                "body_idle_timeout": "1m",
                "aliases": ["registry.internal"],
            },
            internal,
        )
        and hub.get("tag_ttl") == "10m",
        internal,
    )
    check(
        "[credentials] integer watermark written as a float",
        "high_watermark = 1.0" in r.toml_text() and conf["cache"]["high_watermark"] == 1.0,
    )
    pod = r.get("StatefulSet", "larder")["spec"]["template"]
    v0 = volume(pod, "upstream-0-credentials")["secret"]
    check(
        "[credentials] Secret hub-creds, key token only",
        v0["secretName"] == "hub-creds" and v0["items"] == [{"key": "token", "path": "token"}],
        v0,
    )
    check(
        "[credentials] secret files readable through fsGroup only",
        v0.get("defaultMode") == 0o440,
        v0.get("defaultMode"),
    )
    v2 = volume(pod, "upstream-2-ca")["configMap"]
    check(
        "[credentials] CA ConfigMap internal-ca, key ca.pem",
        v2["name"] == "internal-ca" and v2["items"] == [{"key": "ca.pem", "path": "ca.pem"}],
        v2,
    )
    check_config("credentials", r.toml_text())
    check_config("credentials", r.toml_text(), expect_ok=False)


def check_client_credentials() -> None:
    """clientCredentials / clientCredentialsTtl: rendered as larder's keys,
    accepted by `larder check-config`, refused where larder would refuse them."""
    values = {
        "upstreams": [
            {"name": "docker.io", "url": "https://registry-1.docker.io", "default": True},
            {"name": "ghcr.io", "url": "https://ghcr.io", "clientCredentials": "verify", "clientCredentialsTtl": "2m"},
            {"name": "quay.io", "url": "https://quay.io", "clientCredentials": "verify"},
            {"name": "gcr.io", "url": "https://gcr.io", "clientCredentials": "ignore"},
        ]
    }
    r = render("client-credentials", values)
    if r is None:
        return
    ups = {u["name"]: u for u in tomllib.loads(r.toml_text())["upstream"]}
    check(
        "[client-credentials] verify with its ttl",
        ups["ghcr.io"].get("client_credentials") == "verify" and ups["ghcr.io"].get("client_credentials_ttl") == "2m",
        ups["ghcr.io"],
    )
    check(
        "[client-credentials] verify with larder's default ttl",
        ups["quay.io"].get("client_credentials") == "verify" and "client_credentials_ttl" not in ups["quay.io"],
        ups["quay.io"],
    )
    check(
        "[client-credentials] ignore and unset write nothing",
        all("client_credentials" not in ups[n] for n in ("docker.io", "gcr.io")),
        ups,
    )
    check_config("client-credentials", r.toml_text())
    verify = {"name": "ghcr.io", "url": "https://ghcr.io", "clientCredentials": "verify"}
    cases = [
        ("a mode larder does not know", {"upstreams": [dict(verify, clientCredentials="check")]}, "clientCredentials"),
        ("a ttl without verify", {"upstreams": [{"name": "q.io", "url": "https://q.io", "clientCredentialsTtl": "1m"}]}, "applies only"),
        ("a ttl in words", {"upstreams": [dict(verify, clientCredentialsTtl="five minutes")]}, "clientCredentialsTtl"),
        ("verify behind a hub", {"mode": "node", "hub": {"url": "http://hub:5000"}, "upstreams": [verify]}, "hub"),
        (
            "verify with htpasswd",
            {"config": {"auth": {"enabled": True, "existingSecret": "h"}}, "upstreams": [verify]},
            "config.auth",
        ),
    ]
    for label, bad, needle in cases:
        err = render_error(bad)
        check(f"[client-credentials refused] {label}", err is not None and needle in err, err or "rendered")


SHARED = {
    "enabled": True,
    "bucket": "larder-cache",
    "prefix": "mirror",
    "endpoint": "http://garage.storage.svc:3900",
    "region": "garage",
    "maxAge": "90d",
    "credentials": {"existingSecret": "garage-key", "accessKeyIdKey": "id", "secretAccessKeyKey": "secret"},
}


def admitted(r: Rendered, port: str, source: dict, namespace: str = NAMESPACE) -> bool:
    """Whether the rendered NetworkPolicies let a pod labelled `source` in
    `namespace` reach the larder pods' named `port`. Pods no policy selects
    are open; otherwise the selecting policies' ingress rules add up (only
    matchLabels selectors, which is all the chart writes)."""
    pod = workload(r)["spec"]["template"]["metadata"]["labels"]
    policies = [p for p in r.of_kind("NetworkPolicy") if subset(p["spec"]["podSelector"]["matchLabels"], pod)]
    if not policies:
        return True
    namespace_labels = {"kubernetes.io/metadata.name": namespace}
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            if not any(p["port"] == port for p in rule.get("ports", [])):
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
                in_namespace = (
                    subset(ns_sel.get("matchLabels", {}), namespace_labels)
                    if ns_sel is not None
                    else namespace == NAMESPACE
                )
                if in_namespace and (pod_sel is None or subset(pod_sel.get("matchLabels", {}), source)):
                    return True
    return False


def generated_secret(r: Rendered, name: str, key: str) -> str:
    return base64.b64decode(r.get("Secret", name)["data"][key]).decode()


def render_with_existing_secret(label: str, values: dict, template: str, data: dict[str, str]) -> Rendered | None:
    """Renders a copy of the chart whose `lookup` of a Secret in `template`
    answers a Secret holding `data` (base64 values), as a cluster with that
    Secret would on `helm upgrade`: Helm's offline engine has no cluster to
    look up."""
    with tempfile.TemporaryDirectory(prefix="larder-chart-lookup-") as tmp:
        copy = Path(tmp) / "larder"
        shutil.copytree(CHART, copy)
        path = copy / "templates" / template
        text = path.read_text()
        call = 'lookup "v1" "Secret" .Release.Namespace $name'
        if not check(f"[{label}] {template} looks the Secret up", call in text):
            return None
        entries = " ".join(f'"{k}" "{v}"' for k, v in data.items())
        path.write_text(text.replace(call, f'dict "data" (dict {entries})'))
        try:
            manifests = helm_python.Chart.load(str(copy)).render(
                values, name="larder", namespace=NAMESPACE, is_upgrade=True
            )
        except helm_python.HelmError as e:
            check(f"[{label}] renders", False, e)
            return None
    return Rendered(label, manifests)


def check_cluster() -> None:
    """cluster.* and shared.*: three replicas as peers through a headless
    Service, with a shared bucket; larder accepts and runs the config."""
    L = "cluster"
    r = render(L, {"replicaCount": 3, "cluster": {"enabled": True}, "shared": SHARED})
    if not r:
        return
    check(
        f"[{L}] objects: a generated cluster Secret and the peers' headless Service",
        r.kinds()
        == [
            "ConfigMap/larder",
            "Secret/larder-admin-token",
            "Secret/larder-cluster-secret",
            "Service/larder",
            "Service/larder-admin",
            "Service/larder-headless",
            "Service/larder-peers",
            "ServiceAccount/larder",
            "StatefulSet/larder",
        ],
        r.kinds(),
    )
    check_mirror_pod(r, node=False)
    conf = r.toml()
    check(
        f"[{L}] [cluster]: peer listener, self from POD_IP, peers from the headless Service, secret file",
        conf.get("cluster")
        == {
            "listen": "[::]:5001",
            "self": "http://${POD_IP}:5001",
            "peers_dns": "larder-peers.cache.svc.cluster.local:5001",
            "secret_file": "/run/secrets/larder-cluster/secret",
        },
        conf.get("cluster"),
    )
    check(
        f"[{L}] [shared]: bucket and prefix as s3:// URL, endpoint, region, key files, max_age",
        conf.get("shared")
        == {
            "url": "s3://larder-cache/mirror",
            "endpoint": "http://garage.storage.svc:3900",
            "region": "garage",
            "access_key_id_file": "/run/secrets/larder-s3/id",
            "secret_access_key_file": "/run/secrets/larder-s3/secret",
            "max_age": "90d",
        },
        conf.get("shared"),
    )
    sts = r.get("StatefulSet", "larder")
    pod = sts["spec"]["template"]
    c = container(pod)
    check(f"[{L}] 3 replicas", sts["spec"]["replicas"] == 3)
    peer_port = next((p for p in c["ports"] if p["name"] == "peer"), None)
    check(f"[{L}] container port 'peer' 5001", peer_port == {"name": "peer", "containerPort": 5001, "protocol": "TCP"})
    pod_ip = next((e for e in c["env"] if e["name"] == "POD_IP"), None)
    check(
        f"[{L}] POD_IP is status.podIP",
        pod_ip == {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        pod_ip,
    )

    # The peer port: only in the peers' headless Service.
    for name in ("larder", "larder-admin", "larder-headless"):
        ports = r.get("Service", name)["spec"]["ports"]
        check(
            f"[{L}] Service {name} does not carry the peer port",
            all(p.get("targetPort") != "peer" and p["port"] != 5001 for p in ports),
            ports,
        )
    peers = r.get("Service", "larder-peers")["spec"]
    check(
        f"[{L}] larder-peers: headless, ready pods only, one family, port peer 5001",
        peers.get("clusterIP") == "None"
        and peers.get("publishNotReadyAddresses") is False
        and peers.get("ipFamilyPolicy") == "SingleStack"
        and peers.get("ipFamilies") == ["IPv4"]
        and peers["ports"] == [{"name": "peer", "port": 5001, "targetPort": "peer", "protocol": "TCP"}],
        peers,
    )
    check(f"[{L}] larder-peers selects the replicas", subset(peers["selector"], pod["metadata"]["labels"]))

    # The generated secret, mounted where secret_file says.
    secret = generated_secret(r, "larder-cluster-secret", "secret")
    check(f"[{L}] generated cluster secret: 48 random characters", re.fullmatch(r"[A-Za-z0-9]{48}", secret), secret)
    again = render(f"{L} again", {"replicaCount": 3, "cluster": {"enabled": True}, "shared": SHARED}, validate=False)
    if again:
        check(
            f"[{L}] offline, each rendering draws a new one (kept on upgrade by lookup, below)",
            generated_secret(again, "larder-cluster-secret", "secret") != secret,
        )
    vol = volume(pod, "cluster-secret")["secret"]
    check(
        f"[{L}] cluster secret volume: Secret larder-cluster-secret, key secret, fsGroup-readable",
        vol
        == {
            "secretName": "larder-cluster-secret",
            "defaultMode": 0o440,
            "items": [{"key": "secret", "path": "secret"}],
        },
        vol,
    )
    check(
        f"[{L}] mounted read-only at /run/secrets/larder-cluster",
        mount(c, "/run/secrets/larder-cluster")
        == {
            "name": "cluster-secret",
            "mountPath": "/run/secrets/larder-cluster",
            "readOnly": True,
        },
    )
    kept = render_with_existing_secret(
        "cluster upgrade",
        {"replicaCount": 3, "cluster": {"enabled": True}},
        "cluster-secret.yaml",
        {"secret": "a2VwdC1hY3Jvc3MtdXBncmFkZXMtMDEyMzQ1Njc4OQ=="},
    )
    if kept:
        check(
            "[cluster upgrade] the Secret already in the cluster keeps its value",
            generated_secret(kept, "larder-cluster-secret", "secret") == "kept-across-upgrades-0123456789",
        )

    # The store's keys from the existing Secret.
    vol = volume(pod, "shared-credentials")["secret"]
    check(
        f"[{L}] shared credentials: Secret garage-key, keys id and secret",
        vol["secretName"] == "garage-key"
        and vol["items"] == [{"key": "id", "path": "id"}, {"key": "secret", "path": "secret"}],
        vol,
    )
    check(
        f"[{L}] mounted read-only at /run/secrets/larder-s3",
        (mount(c, "/run/secrets/larder-s3") or {}).get("readOnly") is True,
    )
    check(
        f"[{L}] NOTES name the peers Service and the bucket",
        "larder-peers" in r.notes and "s3://larder-cache/mirror" in r.notes,
    )
    check_config(L, r.toml_text())
    check_config(L, r.toml_text(), expect_ok=False)
    run_larder(L, r.toml_text(), c["args"])

    L = "cluster, existing secret"
    r = render(L, {"replicaCount": 2, "cluster": {"enabled": True, "existingSecret": "peers", "secretKey": "token"}})
    if r:
        pod = r.get("StatefulSet", "larder")["spec"]["template"]
        check(f"[{L}] no Secret created", "Secret/larder-cluster-secret" not in r.kinds(), r.kinds())
        check(
            f"[{L}] Secret peers, key token, as secret_file",
            volume(pod, "cluster-secret")["secret"]["secretName"] == "peers"
            and volume(pod, "cluster-secret")["secret"]["items"] == [{"key": "token", "path": "token"}]
            and r.toml()["cluster"]["secret_file"] == "/run/secrets/larder-cluster/token",
        )
        check(f"[{L}] no shared tier", "shared" not in r.toml())
        check_config(L, r.toml_text())

    L = "cluster IPv6"
    r = render(L, {"cluster": {"enabled": True, "ipFamily": "IPv6", "port": 7001}})
    if r:
        conf = r.toml()["cluster"]
        check(
            f"[{L}] self in brackets, port 7001, the peers Service in IPv6",
            conf["self"] == "http://[${POD_IP}]:7001"
            and conf["listen"] == "[::]:7001"
            and conf["peers_dns"].endswith(":7001")
            and r.get("Service", "larder-peers")["spec"]["ipFamilies"] == ["IPv6"],
            conf,
        )
        check_config(L, r.toml_text(), env={"POD_IP": "fd00:10:244::7"})

    L = "shared, keys from extraEnv, node mode"
    env = [
        {"name": n, "valueFrom": {"secretKeyRef": {"name": "aws-key", "key": n}}}
        for n in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    ]
    r = render(
        L,
        {"mode": "node", "extraEnv": env, "shared": {"enabled": True, "bucket": "larder-cache", "region": "eu-west-1"}},
    )
    if r:
        check_mirror_pod(r, node=True)
        check(
            f"[{L}] [shared] on AWS: no endpoint, no key files",
            r.toml()["shared"] == {"url": "s3://larder-cache", "region": "eu-west-1"},
            r.toml()["shared"],
        )
        pod = r.get("DaemonSet", "larder")["spec"]["template"]
        check(f"[{L}] no credentials volume", all(v["name"] != "shared-credentials" for v in pod["spec"]["volumes"]))
        keys = {"AWS_ACCESS_KEY_ID": "AKIACHARTTEST", "AWS_SECRET_ACCESS_KEY": "chart-test"}
        check_config(L, r.toml_text(), env=keys)
        check_config(L, r.toml_text(), expect_ok=False, env={})


TLS_SECRET = {"enabled": True, "existingSecret": "larder-tls"}


def check_cluster_tls() -> None:
    """Peers over TLS when config.tls is on: https self, the peers' Service
    name as tls_name, the TLS Secret's CA as ca_file (mounted); larder
    accepts it and serves the peer port over TLS under that name."""
    L = "cluster TLS"
    values = {"replicaCount": 3, "cluster": {"enabled": True}, "config": {"tls": TLS_SECRET}}
    r = render(L, values)
    if not r:
        return
    check_mirror_pod(r, node=False)
    conf = r.toml()
    check(
        f"[{L}] [cluster]: https self, peers verified as larder-peers.cache.svc with the Secret's CA",
        conf.get("cluster")
        == {
            "listen": "[::]:5001",
            "self": "https://${POD_IP}:5001",
            "peers_dns": "larder-peers.cache.svc.cluster.local:5001",
            "secret_file": "/run/secrets/larder-cluster/secret",
            "tls_name": "larder-peers.cache.svc",
            "ca_file": "/run/larder/tls/ca.crt",
        },
        conf.get("cluster"),
    )
    check(f"[{L}] [server.tls] serves the peer listener too", "tls" in conf["server"], conf["server"])
    pod = r.get("StatefulSet", "larder")["spec"]["template"]
    c = container(pod)
    vol = volume(pod, "tls")["secret"]
    check(
        f"[{L}] the TLS Secret's ca.crt is mounted beside tls.crt and tls.key",
        vol["secretName"] == "larder-tls"
        and vol["items"]
        == [
            {"key": "tls.crt", "path": "tls.crt"},
            {"key": "tls.key", "path": "tls.key"},
            {"key": "ca.crt", "path": "ca.crt"},
        ],
        vol,
    )
    tls_mount = mount(c, "/run/larder/tls") or {}
    check(
        f"[{L}] ca_file is in that mount",
        tls_mount.get("name") == "tls" and conf["cluster"]["ca_file"].startswith(tls_mount.get("mountPath", "?") + "/"),
        tls_mount,
    )
    check(
        f"[{L}] NOTES name the TLS name",
        "verified under the name\n" in r.notes and "larder-peers.cache.svc" in r.notes,
        r.notes,
    )
    check_config(L, r.toml_text())
    check_config(L, r.toml_text(), expect_ok=False)
    run_larder_peer_tls(L, r.toml_text(), c["args"])

    L = "cluster TLS, own name, no CA key"
    tls = dict(TLS_SECRET, caKey="")
    named = {"enabled": True, "tls": {"serverName": "mirror-peers.example.internal"}}
    r = render(L, {"cluster": named, "config": {"tls": tls}})
    if r:
        conf = r.toml()["cluster"]
        check(
            f"[{L}] tls_name from cluster.tls.serverName, no ca_file (web PKI roots)",
            conf.get("tls_name") == "mirror-peers.example.internal" and "ca_file" not in conf,
            conf,
        )
        items = volume(r.get("StatefulSet", "larder")["spec"]["template"], "tls")["secret"]["items"]
        check(f"[{L}] no ca.crt mounted", [i["path"] for i in items] == ["tls.crt", "tls.key"], items)
        check_config(L, r.toml_text())

    L = "cluster TLS off (a mesh encrypts)"
    r = render(L, {"cluster": {"enabled": True, "tls": {"enabled": False}}, "config": {"tls": TLS_SECRET}})
    if r:
        conf = r.toml()["cluster"]
        check(
            f"[{L}] http self, no tls_name, no ca_file",
            conf["self"] == "http://${POD_IP}:5001" and "tls_name" not in conf and "ca_file" not in conf,
            conf,
        )
        items = volume(r.get("StatefulSet", "larder")["spec"]["template"], "tls")["secret"]["items"]
        check(f"[{L}] no ca.crt mounted", [i["path"] for i in items] == ["tls.crt", "tls.key"], items)
        check(f"[{L}] NOTES say peers are plain http", "Peers talk plain http" in r.notes)
        check_config(L, r.toml_text())

    L = "cluster TLS IPv6"
    r = render(L, {"cluster": {"enabled": True, "ipFamily": "IPv6"}, "config": {"tls": TLS_SECRET}})
    if r:
        check(f"[{L}] https self in brackets", r.toml()["cluster"]["self"] == "https://[${POD_IP}]:5001")
        check_config(L, r.toml_text(), env={"POD_IP": "fd00:10:244::7"})


def check_admin_tls_and_hosts() -> None:
    """Issue 23: with config.tls the admin port speaks TLS too: larder.toml
    says `[admin] tls = "server"`, the probes use HTTPS and the
    ServiceMonitor scrapes https (insecureSkipVerify unless a tlsConfig is
    given); config.tls.admin=false keeps all three plain. `[admin]
    allowed_hosts` lists the admin Service's names (and the headless
    Service's pods in deployment mode) plus config.adminAllowedHosts."""
    L = "default admin hosts"
    r = render(L, {})
    if r:
        admin = r.toml()["admin"]
        check(
            f"[{L}] allowed_hosts: the admin Service's names and the pods under the headless Service",
            admin.get("allowed_hosts")
            == [
                "larder-admin",
                "larder-admin.cache",
                "larder-admin.cache.svc",
                "larder-admin.cache.svc.cluster.local",
                "*.larder-headless.cache.svc",
                "*.larder-headless.cache.svc.cluster.local",
            ],
            admin,
        )
        check(f"[{L}] no TLS on the admin port without config.tls", "tls" not in admin, admin)
        check(f"[{L}] NOTES: the admin URL is http", "Admin:         http://larder-admin." in r.notes, r.notes)

    L = "admin TLS"
    values = {"config": {"tls": TLS_SECRET, "adminAllowedHosts": ["larder.example.internal"]}, "serviceMonitor": {"enabled": True}}
    r = render(L, values)
    if r:
        check_mirror_pod(r, node=False)
        admin = r.toml()["admin"]
        check(f"[{L}] [admin] tls = \"server\"", admin.get("tls") == "server", admin)
        check(f"[{L}] config.adminAllowedHosts appended", admin["allowed_hosts"][-1] == "larder.example.internal", admin)
        ep = r.get("ServiceMonitor", "larder")["spec"]["endpoints"][0]
        check(
            f"[{L}] the ServiceMonitor scrapes https, not verifying (a scrape carries no credential)",
            ep.get("scheme") == "https" and ep.get("tlsConfig") == {"insecureSkipVerify": True},
            ep,
        )
        check(f"[{L}] NOTES: https admin URL and the CLI's --ca-file/--tls-name", "Admin:         https://" in r.notes and "--ca-file larder-ca.crt --tls-name larder.cache.svc" in r.notes, r.notes)
        check_config(L, r.toml_text())
    verify = {"ca": {"secret": {"name": "larder-tls", "key": "ca.crt"}}, "serverName": "larder.cache.svc"}
    r = render(L + " verified", {**values, "serviceMonitor": {"enabled": True, "tlsConfig": verify}})
    if r:
        ep = r.get("ServiceMonitor", "larder")["spec"]["endpoints"][0]
        check(f"[{L} verified] serviceMonitor.tlsConfig is used as given", ep.get("tlsConfig") == verify, ep)

    L = "admin TLS off"
    r = render(L, {"config": {"tls": dict(TLS_SECRET, admin=False)}, "serviceMonitor": {"enabled": True}})
    if r:
        check_mirror_pod(r, node=False)
        check(f"[{L}] [admin] tls = \"off\"", r.toml()["admin"].get("tls") == "off", r.toml()["admin"])
        ep = r.get("ServiceMonitor", "larder")["spec"]["endpoints"][0]
        check(f"[{L}] the ServiceMonitor scrapes http", ep.get("scheme") == "http" and "tlsConfig" not in ep, ep)
        check_config(L, r.toml_text())

    L = "node hostNetwork no admin token"
    r = render(L, {"mode": "node", "node": {"hostNetwork": True}, "adminToken": {"enabled": False}})
    if r:
        admin = r.toml().get("admin", {})
        check(
            f"[{L}] no token_file, but allowed_hosts: larder generates a token on the loopback admin port",
            "token_file" not in admin and admin.get("allowed_hosts", [None])[0] == "larder-admin",
            admin,
        )
        check(f"[{L}] NOTES say where the generated token is", "/var/lib/larder/admin-token" in r.notes, r.notes)
        check_config(L, r.toml_text())
    L = "no admin token"
    r = render(L, {"adminToken": {"enabled": False}})
    if r:
        check(f"[{L}] no [admin]: operations are refused off loopback", "admin" not in r.toml(), r.toml_text())

    L = "node hostNetwork admin TLS"
    r = render(L, {"mode": "node", "node": {"hostNetwork": True}, "config": {"tls": TLS_SECRET}})
    if r:
        check_mirror_pod(r, node=True)
        admin = r.toml()["admin"]
        check(
            f"[{L}] no headless-Service names in node mode",
            not any("headless" in h for h in admin["allowed_hosts"]),
            admin,
        )
        check_config(L, r.toml_text())


def _openssl_certs(tmp: Path, names: list[str]) -> tuple[str, str, str] | str:
    """A CA and a certificate for DNS `names` only (no IP), signed by it,
    made with the openssl CLI: (ca.crt, tls.crt, tls.key) PEM, or an error."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    san = "subjectAltName=" + ",".join(f"DNS:{n}" for n in names)
    steps = [
        ["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=chart test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *ec, "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=larder", "-addext", san],
        ["x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
         "-copy_extensions", "copy", "-out", "tls.crt"],
    ]
    for step in steps:
        try:
            p = subprocess.run(["openssl", *step], cwd=tmp, capture_output=True, text=True, timeout=30)
        except OSError as e:
            return f"openssl: {e}"
        if p.returncode != 0:
            return f"openssl {step[0]}: {p.stderr.strip()}"
    return tuple((tmp / f).read_text() for f in ("ca.crt", "tls.crt", "tls.key"))  # type: ignore[return-value]


def _tls_status(port: int, ca: Path, name: str, path: str, headers: dict[str, str]) -> int | str:
    """GET `path` over TLS from 127.0.0.1:port, verifying the certificate
    under `name` (sent as SNI) with `ca`: the status, or the error."""
    ctx = ssl.create_default_context(cafile=str(ca))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    request = f"GET {path} HTTP/1.1\r\nHost: {name}\r\n{head}Connection: close\r\n\r\n".encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as tcp:
            with ctx.wrap_socket(tcp, server_hostname=name) as tls:
                tls.sendall(request)
                line = tls.makefile("rb").readline().decode()
        return int(line.split()[1])
    except (OSError, ValueError, IndexError) as e:
        return f"{type(e).__name__}: {e}"


def run_larder_peer_tls(label: str, toml_text: str, args: list[str]) -> None:
    """Starts larder on the rendered TLS cluster config with a real
    certificate for the client Service and the peers' name only (no IP), as
    cert-manager would issue it, and the CA as the Secret's ca.crt: the peer
    port speaks TLS, verified under tls_name, and still wants the secret."""
    if LARDER is None:
        check(f"[{label}] larder runs", False, "no larder binary")
        return
    with tempfile.TemporaryDirectory(prefix="larder-chart-tls-") as tmp:
        conf = tomllib.loads(toml_text)
        tls_name = conf["cluster"]["tls_name"]
        certs = _openssl_certs(Path(tmp), ["larder.cache.svc", tls_name])
        if not check(f"[{label}] a test CA and certificate (openssl)", isinstance(certs, tuple), certs):
            return
        ca_pem, cert_pem, key_pem = certs
        addr, admin, peer = (f"127.0.0.1:{free_port()}" for _ in range(3))
        text = toml_text
        for key, value in (("listen", addr), ("admin_listen", admin)):
            text = text.replace(f"{key} = {json.dumps(conf['server'][key])}", f"{key} = {json.dumps(value)}")
        text = text.replace(f"listen = {json.dumps(conf['cluster']['listen'])}", f"listen = {json.dumps(peer)}")
        text = text.replace('dir = "/var/lib/larder"', f"dir = {json.dumps(str(Path(tmp) / 'cache'))}")
        for in_pod, pem in (
            (conf["server"]["tls"]["cert"], cert_pem),
            (conf["server"]["tls"]["key"], key_pem),
            (conf["cluster"]["ca_file"], ca_pem),
        ):
            text = _recreate_file(text, in_pod, pem, Path(tmp) / "pod")
        text = _rewrite_admin_token(conf, text, Path(tmp))
        text = _rewrite_cluster_files(conf, text, Path(tmp))
        cfg, log = Path(tmp) / "larder.toml", Path(tmp) / "larder.log"
        cfg.write_text(text)
        argv = [str(LARDER)] + [str(cfg) if a == "/etc/larder/larder.toml" else a for a in args]
        ca = Path(tmp) / "ca.crt"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=log_file, env={**os.environ, "POD_IP": "127.0.0.1"})
        admin_port = int(admin.rsplit(":", 1)[1])
        try:
            # The admin port speaks TLS too ([admin] tls = "server"): probed over https.
            status = wait_healthy_tls(proc, admin_port, ca, "larder.cache.svc")
            started = status == 200
            if not check(f"[{label}] larder starts with the pod's args", started, (status, log.read_text()[-800:])):
                return
            status = _tls_status(admin_port, ca, "larder.cache.svc", "/metrics", {})
            check(f"[{label}] the admin port serves /metrics over TLS with the same certificate: 200", status == 200, status)
            status = http_status(f"http://{admin}/healthz")
            check(f"[{label}] ... and gives plain HTTP no answer", not isinstance(status, int), status)
            port = int(peer.rsplit(":", 1)[1])
            secret = {"larder-cluster-secret": "chart-test-cluster-secret-0123456789"}
            status = _tls_status(port, ca, tls_name, "/v2/?ns=docker.io", secret)
            check(
                f"[{label}] the peer port speaks TLS, verified as {tls_name}, and takes the secret (404: no peer path)",
                status == 404,
                status,
            )
            status = _tls_status(port, ca, tls_name, "/v2/docker.io/library/alpine/manifests/3?ns=docker.io", {})
            check(f"[{label}] ... and refuses a request without it: 401", status == 401, status)
            status = _tls_status(int(addr.rsplit(":", 1)[1]), ca, "larder.cache.svc", "/v2/", {})
            check(f"[{label}] the registry port serves the same certificate: GET /v2/ 200", status == 200, status)
            proc.send_signal(signal.SIGTERM)
            try:
                rc: int | str = proc.wait(timeout=duration_seconds(conf["server"]["shutdown_grace"]) + 5)
            except subprocess.TimeoutExpired:
                rc = "still running"
            check(f"[{label}] SIGTERM: larder exits 0", rc == 0, rc)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def check_cluster_network_policy() -> None:
    """The peer port admits this release's replicas only; the other ports
    stay as they were."""
    replica = {
        "app.kubernetes.io/name": "larder",
        "app.kubernetes.io/instance": "larder",
        "app.kubernetes.io/component": "mirror",
    }
    other_release = dict(replica, **{"app.kubernetes.io/instance": "other"})
    node_setup = dict(replica, **{"app.kubernetes.io/component": "node-setup"})
    client = {"app": "ci-runner"}
    web = {"app": "web"}
    prometheus = {"app.kubernetes.io/name": "prometheus"}
    warning = "WARNING: whoever reaches the peer port with the cluster secret reads every repository"
    closed = "A NetworkPolicy admits only this release's replicas to the peer port."

    L = "cluster without a NetworkPolicy"
    r = render(L, {"replicaCount": 3, "cluster": {"enabled": True}})
    if r:
        check(f"[{L}] no NetworkPolicy", r.of_kind("NetworkPolicy") == [])
        check(f"[{L}] so any pod reaches the peer port", admitted(r, "peer", client))
        check(
            f"[{L}] NOTES warn that the secret reads every repository, grants or not, and name the fix",
            warning in r.notes
            and "whatever config.auth.grants say" in r.notes
            and "cluster.networkPolicy.enabled=true" in r.notes
            and closed not in r.notes,
            r.notes,
        )

    L = "cluster NetworkPolicy"
    r = render(L, {"replicaCount": 3, "cluster": {"enabled": True, "networkPolicy": {"enabled": True}}})
    if r:
        check(
            f"[{L}] one NetworkPolicy: larder-peers",
            [o["metadata"]["name"] for o in r.of_kind("NetworkPolicy")] == ["larder-peers"],
        )
        check(f"[{L}] a replica reaches the peer port", admitted(r, "peer", replica))
        check(f"[{L}] another release's larder does not", not admitted(r, "peer", other_release))
        check(f"[{L}] nor does a client pod", not admitted(r, "peer", client))
        check(f"[{L}] nor this release's node setup pods", not admitted(r, "peer", node_setup))
        check(
            f"[{L}] nor a pod in another namespace with a replica's labels",
            not admitted(r, "peer", replica, namespace="elsewhere"),
        )
        check(f"[{L}] the registry port stays open", admitted(r, "registry", client))
        check(f"[{L}] the admin port stays open", admitted(r, "admin", client, namespace="elsewhere"))
        check(f"[{L}] NOTES say the peer port is closed, no warning", closed in r.notes and warning not in r.notes)

    L = "cluster + networkPolicy"
    r = render(
        L,
        {
            "replicaCount": 3,
            "cluster": {"enabled": True, "networkPolicy": {"enabled": True}},
            "networkPolicy": {"enabled": True},
        },
    )
    if r:
        check(f"[{L}] a replica reaches the peer port", admitted(r, "peer", replica))
        check(f"[{L}] another release's larder does not", not admitted(r, "peer", other_release))
        check(f"[{L}] the registry port open to clients", admitted(r, "registry", client))
        check(
            f"[{L}] the admin port still only for monitoring", not admitted(r, "admin", client, namespace="elsewhere")
        )
        check(f"[{L}] ... which reaches it", admitted(r, "admin", prometheus, namespace="monitoring"))

    L = "networkPolicy alone, cluster on"
    r = render(L, {"replicaCount": 2, "cluster": {"enabled": True}, "networkPolicy": {"enabled": True}})
    if r:
        check(f"[{L}] the release's policy admits the replicas to the peer port", admitted(r, "peer", replica))
        check(f"[{L}] and nobody else", not admitted(r, "peer", other_release) and not admitted(r, "peer", client))
        check(f"[{L}] not even this release's node setup pods", not admitted(r, "peer", node_setup))
        check(f"[{L}] NOTES say the peer port is closed, no warning", closed in r.notes and warning not in r.notes)

    # Every port restricted: the registry port to the CI runners and one
    # namespace, the admin port to Prometheus, the peer port to the replicas.
    L = "cluster, every port restricted"
    restricted = {
        "enabled": True,
        "registryFrom": [
            {"podSelector": {"matchLabels": client}},
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "builds"}}},
        ],
        "metricsPodSelector": {"matchLabels": prometheus},
    }
    r = render(L, {"replicaCount": 3, "cluster": {"enabled": True}, "networkPolicy": restricted})
    if r:
        check(f"[{L}] the CI runners reach the registry port", admitted(r, "registry", client))
        check(f"[{L}] so does any pod in the builds namespace", admitted(r, "registry", web, namespace="builds"))
        check(f"[{L}] another pod does not", not admitted(r, "registry", web))
        check(f"[{L}] Prometheus reaches the admin port", admitted(r, "admin", prometheus, namespace="monitoring"))
        check(
            f"[{L}] another pod in the monitoring namespace does not",
            not admitted(r, "admin", web, namespace="monitoring"),
        )
        check(f"[{L}] nor do the CI runners", not admitted(r, "admin", client))
        check(f"[{L}] the replicas reach the peer port", admitted(r, "peer", replica))
        check(
            f"[{L}] the CI runners, the builds namespace and Prometheus do not",
            not admitted(r, "peer", client)
            and not admitted(r, "peer", web, namespace="builds")
            and not admitted(r, "peer", prometheus, namespace="monitoring"),
        )


def check_hub() -> None:
    """hub.url: the node DaemonSet sends every upstream to the cluster's hub."""
    hub = "http://larder.larder.svc.cluster.local:5000"
    L = "node via hub"
    r = render(L, {"mode": "node", "hub": {"url": hub}})
    if not r:
        return
    check_mirror_pod(r, node=True)
    ups = r.toml()["upstream"]
    check(f"[{L}] via on every upstream", [u.get("via") for u in ups] == [hub] * 4, ups)
    check(
        f"[{L}] names and urls unchanged (the hub routes by ?ns=<name>)",
        [(u["name"], u["url"]) for u in ups] == [(u["name"], u["url"]) for u in render_values()["upstreams"]],
    )
    check(f"[{L}] NOTES name the hub", f"all through the hub {hub}" in r.notes)
    check_config(L, r.toml_text())
    r = render("deployment without hub", {})
    if r:
        check("[deployment without hub] no via", all("via" not in u for u in r.toml()["upstream"]))


def check_tracing() -> None:
    """tracing.* becomes larder.toml's [tracing], which larder check-config
    accepts; without tracing.otlpEndpoint there is no [tracing] at all."""
    L = "tracing"
    endpoint = "http://otel-collector.observability:4318"
    r = render(L, {"tracing": {"otlpEndpoint": endpoint, "samplingRatio": 0.25, "serviceName": "larder-eu"}})
    if not r:
        return
    want = {"otlp_endpoint": endpoint, "sampling_ratio": 0.25, "service_name": "larder-eu"}
    check(f"[{L}] [tracing] from the values", r.toml().get("tracing") == want, r.toml().get("tracing"))
    check_config(L, r.toml_text())
    r = render(f"{L}, defaults", {"tracing": {"otlpEndpoint": endpoint}})
    if r:
        want = {"otlp_endpoint": endpoint, "sampling_ratio": 1.0}
        check(f"[{L}, defaults] every trace, service name larder's own", r.toml().get("tracing") == want, r.toml().get("tracing"))
        check_config(f"{L}, defaults", r.toml_text())
    r = render("tracing off", {})
    if r:
        check("[tracing off] no [tracing]", "tracing" not in r.toml(), r.toml().get("tracing"))


def render_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def check_persistence() -> None:
    r = render("persistence disabled", {"persistence": {"enabled": False, "emptyDirSizeLimit": "10Gi"}})
    if r:
        check_mirror_pod(r, node=False)
        sts = r.get("StatefulSet", "larder")
        check("[persistence disabled] no PVC template", "volumeClaimTemplates" not in sts["spec"])
        check(
            "[persistence disabled] cache is an emptyDir",
            volume(sts["spec"]["template"], "cache") == {"name": "cache", "emptyDir": {"sizeLimit": "10Gi"}},
        )
        check("[persistence disabled] NOTES say the cache is lost with the pod", "emptyDir" in r.notes)
        check_config("persistence disabled", r.toml_text())

    r = render(
        "storage class, 3 replicas",
        {
            "replicaCount": 3,
            "persistence": {
                "storageClass": "fast-ssd",
                "size": "200Gi",
                "retentionPolicy": {"whenDeleted": "Delete", "whenScaled": "Retain"},
            },
            "config": {"cache": {"maxSize": "180GiB"}},
        },
    )
    if r:
        sts = r.get("StatefulSet", "larder")
        pvc = sts["spec"]["volumeClaimTemplates"][0]["spec"]
        check(
            "[storage class, 3 replicas] storageClassName and size",
            pvc.get("storageClassName") == "fast-ssd" and pvc["resources"]["requests"]["storage"] == "200Gi",
            pvc,
        )
        check(
            "[storage class, 3 replicas] replicas 3, parallel",
            sts["spec"]["replicas"] == 3 and sts["spec"]["podManagementPolicy"] == "Parallel",
        )
        check(
            "[storage class, 3 replicas] retention policy",
            sts["spec"].get("persistentVolumeClaimRetentionPolicy")
            == {"whenDeleted": "Delete", "whenScaled": "Retain"},
        )
        check("[storage class, 3 replicas] max_size", r.toml()["cache"]["max_size"] == "180GiB")
        check_config("storage class, 3 replicas", r.toml_text())

    r = render("storageClass '-'", {"persistence": {"storageClass": "-"}})
    if r:
        pvc = r.get("StatefulSet", "larder")["spec"]["volumeClaimTemplates"][0]["spec"]
        check("[storageClass '-'] storageClassName \"\"", pvc.get("storageClassName") == "", pvc)


def check_warm() -> None:
    """warm.images becomes the ConfigMap <fullname>-warm, mounted as a
    directory (so the kubelet's updates reach larder) and named by
    cache.warm_file; larder check-config takes the rendered file's lines,
    and reports a bad one with its number. Without images: nothing."""
    L = "warm"
    images = [
        "docker.io/library/postgres:16",
        "ghcr.io/org/app:2 platforms=linux/amd64,linux/arm64",
        "docker.io/library/busybox:1.36 pin=false",
    ]
    upstreams = [
        {"name": "docker.io", "url": "https://registry-1.docker.io", "default": True, "maxSize": "20Gi"},
        {"name": "ghcr.io", "url": "https://ghcr.io", "maxBandwidth": "50Mi"},
    ]
    r = render(L, {"warm": {"images": images, "interval": "1m"}, "upstreams": upstreams})
    if not r:
        return
    text = r.get("ConfigMap", "larder-warm")["data"]["warm.txt"]
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    check(f"[{L}] warm.txt lists warm.images, one per line", lines == images, text)
    pod = workload(r)["spec"]["template"]
    check(f"[{L}] volume from ConfigMap larder-warm", volume(pod, "warm").get("configMap") == {"name": "larder-warm"})
    m = mount(container(pod), "/run/larder/warm")
    check(f"[{L}] mounted read-only as a directory (no subPath)", m and m.get("readOnly") and "subPath" not in m, m)
    conf = r.toml()
    check(f"[{L}] cache.warm_file", conf["cache"].get("warm_file") == "/run/larder/warm/warm.txt", conf["cache"])
    check(f"[{L}] cache.warm_interval", conf["cache"].get("warm_interval") == "1m", conf["cache"])
    # A Kubernetes quantity in values is written in larder's own units.
    check(f"[{L}] upstream max_size 20Gi as 20GiB", conf["upstream"][0].get("max_size") == "20GiB", conf["upstream"][0])
    check(f"[{L}] upstream max_bandwidth 50Mi as 50MiB", conf["upstream"][1].get("max_bandwidth") == "50MiB", conf["upstream"][1])
    check(f"[{L}] no max_bandwidth where none is set", "max_bandwidth" not in conf["upstream"][0], conf["upstream"][0])
    check_mirror_pod(r, node=False)
    if LARDER is None:
        check(f"[{L}] larder check-config", False, "no larder binary")
        return
    for content, bad in ((text, None), (text + "unknown.example/team/app:1\n", 5)):
        with tempfile.TemporaryDirectory(prefix="larder-chart-warm-") as tmp:
            toml_text = _recreate_file(r.toml_text(), "/run/larder/warm/warm.txt", content, Path(tmp))
            toml_text = _rewrite_admin_token(tomllib.loads(toml_text), toml_text, Path(tmp))
            cfg = Path(tmp) / "larder.toml"
            cfg.write_text(toml_text)
            p = subprocess.run(
                [str(LARDER), "check-config", "--config", str(cfg)],
                capture_output=True,
                text=True,
                timeout=30,
                env={**os.environ, **POD_ENV},
            )
            out = (p.stdout + p.stderr).strip()
            check(f"[{L}] larder check-config accepts larder.toml with the warm file", p.returncode == 0, out)
            if bad is None:
                check(f"[{L}] ... and every line of warm.txt", "warning: line" not in out, out)
            else:
                check(f"[{L}] ... and names a bad line by its number", f"warning: line {bad}:" in out, out)

    r = render("warm off", {})
    if r:
        names = [o["metadata"]["name"] for o in r.of_kind("ConfigMap")]
        check("[warm off] no warm ConfigMap", "larder-warm" not in names, names)
        check("[warm off] no cache.warm_file", "warm_file" not in r.toml()["cache"], r.toml()["cache"])
        pod = workload(r)["spec"]["template"]
        check("[warm off] no warm volume", all(v["name"] != "warm" for v in pod["spec"]["volumes"]))


def check_sizes() -> None:
    """Sizes in values may be Kubernetes quantities; larder.toml gets
    larder's units (larder refuses a lone G, which Kubernetes reads as
    10^9, and Gi): each rendered size is accepted by check-config."""
    L = "sizes"
    for given, written in (
        ("50Gi", "50GiB"),
        ("50G", "50GB"),
        ("40GiB", "40GiB"),
        ("1.5Gi", "1610612736B"),
        # More than ten digits of bytes: still a size to larder.
        ("15.5Gi", "16642998272B"),
        ("512Mi", "512MiB"),
        ("2Ti", "2TiB"),
    ):
        r = render(L, {"config": {"cache": {"maxSize": given, "memory": "128Mi"}}, "persistence": {"size": "4Ti"}})
        if not r:
            return
        cache = r.toml()["cache"]
        check(f"[{L}] maxSize {given} as {written}", cache["max_size"] == written, cache)
        check(f"[{L}] memory 128Mi as 128MiB", cache["memory"] == "128MiB", cache)
        check_config(f"{L} {given}", r.toml_text())


def check_pdb_and_bind() -> None:
    r = render(
        "PDB minAvailable 50% of 3, IPv4 bind",
        {
            "replicaCount": 3,
            "podDisruptionBudget": {"enabled": True, "minAvailable": "50%"},
            "config": {"bindAddress": "0.0.0.0"},
        },
    )
    if r:
        spec = r.get("PodDisruptionBudget", "larder")["spec"]
        check(
            "[PDB minAvailable 50% of 3, IPv4 bind] minAvailable 50%, no maxUnavailable",
            spec.get("minAvailable") == "50%" and "maxUnavailable" not in spec,
            spec,
        )
        server = r.toml()["server"]
        check(
            "[PDB minAvailable 50% of 3, IPv4 bind] listeners on 0.0.0.0",
            server["listen"] == "0.0.0.0:5000" and server["admin_listen"] == "0.0.0.0:9090",
            server,
        )
        check_mirror_pod(r, node=False)
        check_config("PDB minAvailable 50% of 3, IPv4 bind", r.toml_text())


def check_dual_stack() -> None:
    """The default bindAddress "[::]" is one socket for both families: the
    real larder, listening on [::]:<port> as the pod does (admin on
    127.0.0.1), answers over 127.0.0.1 and over ::1. The IPv4 half holds
    while net.ipv6.bindv6only is 0 (Linux's default; the README says so)."""
    r = render("dual stack", {})
    if not r:
        return
    server = r.toml()["server"]
    check(
        "[dual stack] default listeners on [::]",
        server["listen"] == "[::]:5000" and server["admin_listen"] == "[::]:9090",
        server,
    )
    if LARDER is None:
        check("[dual stack] larder runs", False, "no larder binary")
        return
    try:
        v6only = Path("/proc/sys/net/ipv6/bindv6only").read_text().strip()
    except OSError as e:
        v6only = f"unreadable ({e})"
    print(f"     net.ipv6.bindv6only = {v6only}")
    with tempfile.TemporaryDirectory(prefix="larder-chart-dual-") as tmp:
        port, admin = free_port(), f"127.0.0.1:{free_port()}"
        text = r.toml_text()
        text = text.replace('listen = "[::]:5000"', f'listen = "[::]:{port}"', 1)
        text = text.replace('admin_listen = "[::]:9090"', f'admin_listen = "{admin}"', 1)
        text = text.replace('dir = "/var/lib/larder"', f"dir = {json.dumps(str(Path(tmp) / 'cache'))}")
        text = _rewrite_admin_token(r.toml(), text, Path(tmp))
        cfg, log = Path(tmp) / "larder.toml", Path(tmp) / "larder.log"
        cfg.write_text(text)
        with open(log, "w") as log_file:
            proc = subprocess.Popen(
                [str(LARDER), "--config", str(cfg), "--log-format", "json"], stdout=log_file, stderr=log_file
            )
        try:
            status = wait_healthy(proc, admin)
            if not check("[dual stack] larder starts on [::]", status == 200, (status, log.read_text()[-500:])):
                return
            for family, host in (("IPv4", "127.0.0.1"), ("IPv6", "[::1]")):
                status = http_status(f"http://{host}:{port}/v2/")
                check(f"[dual stack] GET /v2/ over {family} ({host}) to the [::] listener: 200", status == 200, status)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def check_grace() -> None:
    r = render(
        "preStop sleep",
        {"preStopSleepSeconds": 5, "terminationGracePeriodSeconds": 40, "config": {"shutdownGrace": "30s"}},
    )
    if r:
        check_mirror_pod(r, node=False)
        c = container(r.get("StatefulSet", "larder")["spec"]["template"])
        check(
            "[preStop sleep] preStop sleep 5s",
            c.get("lifecycle") == {"preStop": {"sleep": {"seconds": 5}}},
            c.get("lifecycle"),
        )
        check("[preStop sleep] shutdown_grace 30s", r.toml()["server"]["shutdown_grace"] == "30s")
        check_config("preStop sleep", r.toml_text())


def check_refused() -> None:
    hub = {"name": "docker.io", "url": "https://registry-1.docker.io"}
    cases = [
        ("unknown mode", {"mode": "sidecar"}, "mode"),
        ("shutdownGrace = terminationGracePeriodSeconds", {"config": {"shutdownGrace": "30s"}}, "shutdownGrace"),
        ("shutdownGrace + preStop too long", {"preStopSleepSeconds": 10}, "preStopSleepSeconds"),
        ("shutdownGrace in days", {"config": {"shutdownGrace": "1d"}}, "number and one unit"),
        (
            "two default upstreams",
            {"upstreams": [dict(hub, default=True), {"name": "ghcr.io", "url": "https://ghcr.io", "default": True}]},
            "default",
        ),
        ("no upstreams", {"upstreams": []}, "upstreams"),
        (
            "a misspelt registryFrom peer",
            {"networkPolicy": {"enabled": True, "registryFrom": [{"podselector": {"matchLabels": {"a": "b"}}}]}},
            "registryFrom",
        ),
        ("credentials without username", {"upstreams": [dict(hub, credentials={"existingSecret": "s"})]}, "username"),
        ("TOML spelling of a key", {"upstreams": [dict(hub, tag_ttl="1m")]}, "tag_ttl"),
        (
            "upper-case upstream name",
            {"upstreams": [{"name": "Docker.IO", "url": "https://registry-1.docker.io"}]},
            "host name",
        ),
        ("upstream url with a path", {"upstreams": [{"name": "x.io", "url": "https://x.io/v2"}]}, "no path"),
        (
            "caFile and caConfigMap",
            {"upstreams": [dict(hub, caFile="/x.pem", caConfigMap={"name": "c"})]},
            "caConfigMap",
        ),
        ("watermark above 1", {"config": {"cache": {"highWatermark": 1.5}}}, "highWatermark"),
        ("unknown node cache type", {"mode": "node", "node": {"cache": {"type": "nfs"}}}, "type"),
        # Node disks and memory (item 4).
        (
            "node hostPath without maxSize",
            {"mode": "node", "node": {"cache": {"type": "hostPath"}}},
            "config.cache.maxSize is required with node.cache.type=hostPath",
        ),
        (
            "node emptyDir without sizeLimit",
            {"mode": "node", "node": {"cache": {"emptyDirSizeLimit": ""}}},
            "node.cache.emptyDirSizeLimit is required",
        ),
        (
            "maxSize above the PVC",
            {"config": {"cache": {"maxSize": "60GiB"}}},
            "must be below the cache volume's size (50Gi)",
        ),
        (
            "maxSize above the emptyDir",
            {"mode": "node", "config": {"cache": {"maxSize": "12GiB"}}},
            "must be below the cache volume's size (10Gi)",
        ),
        (
            "emptyDir without sizeLimit or maxSize",
            {"persistence": {"enabled": False}},
            "config.cache.maxSize is required when persistence.enabled=false",
        ),
        ("maxSize not a size", {"config": {"cache": {"maxSize": "lots"}}}, "maxSize"),
        (
            "cache.memory over the memory request",
            {"config": {"cache": {"memory": "300MiB"}}},
            "resources.requests.memory",
        ),
        (
            "cache.memory over the memory limit",
            {
                "config": {"cache": {"memory": "448MiB"}},
                "resources": {"requests": {"memory": "1Gi"}, "limits": {"memory": "512Mi"}},
            },
            "resources.limits.memory",
        ),
        # Mirror addresses nodes cannot reach (items 2 and 8).
        ("deployment nodeSetup without a reachable address", {"nodeSetup": {"enabled": True}}, "service.clusterIP"),
        (
            "fallbackMirror without a reachable address",
            {"mode": "node", "node": {"fallbackMirror": True}, "nodeSetup": {"enabled": True}},
            "node.fallbackMirror",
        ),
        (
            "fallbackMirror with internalTrafficPolicy Local",
            {
                "mode": "node",
                "node": {"fallbackMirror": True},
                "service": {"clusterIP": "10.96.0.5", "internalTrafficPolicy": "Local"},
            },
            "internalTrafficPolicy",
        ),
        ("unknown distribution", {"nodeSetup": {"distribution": "microk8s"}}, "distribution"),
        ("unknown existingHosts policy", {"nodeSetup": {"existingHosts": "merge"}}, "existingHosts"),
        (
            "excluding an unknown upstream",
            {"nodeSetup": {"excludeUpstreams": ["docker.com"]}},
            "is not the name of an upstream",
        ),
        # Exposure and credentials (items 3 and 10).
        (
            "ServiceMonitor with a loopback admin port",
            {"mode": "node", "node": {"hostNetwork": True}, "serviceMonitor": {"enabled": True}},
            "adminOnHostIP",
        ),
        ("TLS without a Secret", {"config": {"tls": {"enabled": True}}}, "config.tls.existingSecret"),
        ("client auth without a Secret", {"config": {"auth": {"enabled": True}}}, "config.auth.existingSecret"),
        (
            "client auth with nodeSetup but no credentials for containerd",
            {
                "config": {"auth": {"enabled": True, "existingSecret": "h"}},
                "nodeSetup": {"enabled": True},
                "service": {"clusterIP": "10.96.0.5"},
            },
            "mirrorCredentials",
        ),
        # Budgets that block drains (item 11).
        ("PDB in node mode", {"mode": "node", "podDisruptionBudget": {"enabled": True}}, "DaemonSet"),
        (
            "PDB minAvailable 1 with 1 replica",
            {"podDisruptionBudget": {"enabled": True, "minAvailable": 1}},
            "never allows an eviction",
        ),
        (
            "PDB minAvailable 50% with 1 replica",
            {"podDisruptionBudget": {"enabled": True, "minAvailable": "50%"}},
            "never allows an eviction",
        ),
        (
            "PDB minAvailable 3 with 3 replicas",
            {"replicaCount": 3, "podDisruptionBudget": {"enabled": True, "minAvailable": 3}},
            "never allows an eviction",
        ),
        (
            "PDB maxUnavailable 0",
            {"podDisruptionBudget": {"enabled": True, "maxUnavailable": 0}},
            "never allows an eviction",
        ),
        # Cluster mode, the shared tier and the hub (issue 11).
        (
            "cluster in node mode",
            {"mode": "node", "cluster": {"enabled": True}},
            "cluster.enabled is for deployment mode",
        ),
        ("peer port = registry port", {"cluster": {"enabled": True, "port": 5000}}, "must differ from ports.registry"),
        ("peer port = admin port", {"cluster": {"enabled": True, "port": 9090}}, "must differ from ports.registry"),
        ("peer port out of range", {"cluster": {"enabled": True, "port": 70000}}, "/cluster/port"),
        ("unknown IP family", {"cluster": {"enabled": True, "ipFamily": "IPv5"}}, "/cluster/ipFamily"),
        ("a path as the secret key", {"cluster": {"enabled": True, "secretKey": "../token"}}, "/cluster/secretKey"),
        ("a static peer list (not a chart value)", {"cluster": {"peers": ["http://10.0.0.1:5001"]}}, "peers"),
        (
            "an address as the peers' TLS name",
            {"cluster": {"enabled": True, "tls": {"serverName": "10.0.0.7"}}},
            "cluster.tls.serverName: \"10.0.0.7\" is not a DNS name",
        ),
        (
            "a wildcard as the peers' TLS name",
            {"cluster": {"enabled": True, "tls": {"serverName": "*.larder.svc"}}},
            "/cluster/tls/serverName",
        ),
        (
            "a port in the peers' TLS name",
            {"cluster": {"enabled": True, "tls": {"serverName": "larder-peers:5001"}}},
            "/cluster/tls/serverName",
        ),
        (
            "capitals in the peers' TLS name",
            {"cluster": {"enabled": True, "tls": {"serverName": "Larder-Peers.cache.svc"}}},
            "/cluster/tls/serverName",
        ),
        ("shared tier without a bucket", {"shared": dict(SHARED, bucket="")}, "shared.bucket is required"),
        ("bucket name with capitals", {"shared": dict(SHARED, bucket="Larder_Cache")}, "/shared/bucket"),
        ("shared tier without a region", {"shared": dict(SHARED, region="")}, "shared.region is required"),
        ("shared tier without credentials", {"shared": dict(SHARED, credentials={})}, "needs credentials"),
        (
            "one key for both credentials",
            {
                "shared": dict(
                    SHARED, credentials={"existingSecret": "k", "accessKeyIdKey": "k", "secretAccessKeyKey": "k"}
                )
            },
            "name the same key",
        ),
        ("max_age under an hour", {"shared": dict(SHARED, maxAge="30m")}, "must be at least 1h"),
        ("max_age in words", {"shared": dict(SHARED, maxAge="90 days")}, "/shared/maxAge"),
        (
            "endpoint with a bucket path",
            {"shared": dict(SHARED, endpoint="http://garage:3900/larder-cache")},
            "/shared/endpoint",
        ),
        ("prefix with '..'", {"shared": dict(SHARED, prefix="a/../b")}, "/shared/prefix"),
        (
            "allow_http is not a value (the endpoint's scheme says it)",
            {"shared": dict(SHARED, allowHttp=True)},
            "allowHttp",
        ),
        (
            "upstream credentials behind a hub",
            {
                "mode": "node",
                "hub": {"url": "http://hub:5000"},
                "upstreams": [dict(hub, credentials={"username": "u", "existingSecret": "s"})],
            },
            "holds the credentials",
        ),
        ("hub URL with a path", {"mode": "node", "hub": {"url": "http://hub:5000/v2"}}, "/hub/url"),
        ("tracing endpoint without a scheme", {"tracing": {"otlpEndpoint": "otel-collector:4318"}}, "otlpEndpoint"),
        ("tracing endpoint with credentials", {"tracing": {"otlpEndpoint": "http://u:p@c:4318"}}, "otlpEndpoint"),
        ("sampling ratio above 1", {"tracing": {"otlpEndpoint": "http://c:4318", "samplingRatio": 2}}, "samplingRatio"),
        ("a misspelt tracing value", {"tracing": {"endpoint": "http://c:4318"}}, "endpoint"),
        ("the release as its own hub", {"hub": {"url": "http://larder.cache.svc:5000"}}, "loop"),
    ]
    for label, values, needle in cases:
        err = render_error(values)
        check(f"[refused] {label}", err is not None and needle in err, err or "rendered")


def check_lint() -> None:
    for label, values in (
        ("default", None),
        ("node", {"mode": "node", "node": {"hostNetwork": True}, "nodeSetup": {"enabled": True}}),
        (
            "cluster",
            {
                "replicaCount": 3,
                "cluster": {"enabled": True, "networkPolicy": {"enabled": True}},
                "networkPolicy": {"enabled": True},
                "shared": SHARED,
            },
        ),
        ("node via hub", {"mode": "node", "hub": {"url": "http://larder.larder.svc:5000"}}),
        (
            "cluster, every port restricted",
            {
                "replicaCount": 3,
                "cluster": {"enabled": True},
                "networkPolicy": {
                    "enabled": True,
                    "registryFrom": [{"podSelector": {"matchLabels": {"app": "ci-runner"}}}],
                    "metricsPodSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
                },
            },
        ),
    ):
        report = helm_python.lint(str(CHART), values, strict=True, kube_version=f"v{KUBE_VERSION}.0")
        bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
        check(f"[lint {label}] helm lint --strict: no errors or warnings", not report.get("errors") and not bad, report)


def check_dashboard() -> None:
    path = CHART / "dashboards" / "larder.json"
    try:
        dash = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        check("[dashboard] larder.json parses", False, e)
        return
    check("[dashboard] larder.json parses", True)
    exprs = []
    ids = []

    def walk(p: dict) -> None:
        ids.append(p["id"])
        exprs.extend(t["expr"] for t in p.get("targets", []) if "expr" in t)
        for sub in p.get("panels", []):
            walk(sub)

    for p in dash["panels"]:
        walk(p)

    def metrics_in(exprs: list[str]) -> set[str]:
        return {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\blarder_[a-z_]+", e)}

    used = metrics_in(exprs)
    # The metric table in the operating guide is the reference; a row may
    # name several metrics in its first cell (`larder_peers_up`, `larder_peers_down`).
    guide = ROOT / "docs" / "operating.md"
    text = guide.read_text() if guide.is_file() else ""
    first_cells = re.findall(r"^\| (`larder_[^|]*)\|", text, re.M)
    documented = {m for cell in first_cells for m in re.findall(r"`(larder_[a-z_]+)`", cell)}
    check("[dashboard] docs/operating.md lists metrics", documented, "no metric table in docs/operating.md")
    check(
        "[dashboard] every metric the dashboard uses is documented",
        used and used <= documented,
        sorted(used - documented),
    )
    for needed in (
        "larder_requests_total",
        "larder_cache_requests_total",
        "larder_upstream_bytes_total",
        "larder_bytes_served_total",
        "larder_fills_in_flight",
        "larder_cache_size_bytes",
        "larder_cache_evictions_total",
        "larder_upstream_requests_total",
        "larder_upstream_request_duration_seconds",
    ):
        check(f"[dashboard] uses {needed}", needed in used)
    check("[dashboard] panel ids unique, row panels included", len(ids) == len(set(ids)), ids)

    # The Cluster row: collapsed (empty without cluster mode), with a panel
    # for each part of the cluster tier.
    rows = {p["title"]: p for p in dash["panels"] if p["type"] == "row"}
    row = rows.get("Cluster")
    if not check("[dashboard] a Cluster row", row is not None, sorted(rows)):
        return
    check("[dashboard] the Cluster row is collapsed", row.get("collapsed") is True)
    in_row = metrics_in([t["expr"] for p in row["panels"] for t in p.get("targets", [])])
    for needed in (
        "larder_peer_requests_total",
        "larder_peers_up",
        "larder_peers_down",
        "larder_peers_marked_down_total",
        "larder_peer_bytes_total",
        "larder_shared_requests_total",
        "larder_shared_bytes_total",
        "larder_shared_uploads_total",
        "larder_pending_uploads",
        "larder_shared_corrupt_total",
    ):
        check(f"[dashboard] Cluster row uses {needed}", needed in in_row, sorted(in_row))
    by_title = {p["title"]: p["targets"][0]["expr"] for p in row["panels"]}
    check(
        "[dashboard] peer requests by direction and result",
        "sum by (direction, result)" in by_title.get("Peer requests by direction and result", ""),
        by_title,
    )
    check(
        "[dashboard] shared-tier requests by operation and result",
        "sum by (op, result)" in by_title.get("Shared tier requests by operation and result", ""),
        by_title,
    )
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in dash["panels"] if p is not row)
    check("[dashboard] the Cluster row comes last", row["gridPos"]["y"] == bottom, row["gridPos"])


def check_docs() -> None:
    """Every value in values.yaml is documented in the chart README's table."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    documented = set(re.findall(r"^\| `([A-Za-z.]+)`", readme, re.M))
    # Objects passed through whole are documented as one key.
    whole = {
        "resources",
        "podSecurityContext",
        "securityContext",
        "startupProbe",
        "livenessProbe",
        "readinessProbe",
        "updateStrategy",
        "labels",
        "annotations",
        "retentionPolicy",
        "nodeSelector",
        "affinity",
        "metricsNamespaceSelector",
    }

    def keys(d: dict, prefix: str = ""):
        for k, v in d.items():
            if isinstance(v, dict) and v and k not in whole:
                yield from keys(v, f"{prefix}{k}.")
            else:
                yield prefix + k

    missing = [k for k in keys(values) if k not in documented]
    check("[docs] every value is in the README values table", not missing, missing)
    # Dotted names (the upstream-key table has undotted ones) must exist.
    stale = sorted(k for k in documented if "." in k and not _has_key(values, k))
    check("[docs] README values table names no missing value", not stale, stale)


def _has_key(d: dict, dotted: str) -> bool:
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return False
        d = d[part]
    return True


def quiet_helm() -> None:
    """Helm's own log lines (e.g. each `fail` the refused cases trigger) go
    nowhere; errors still arrive as exceptions."""
    helm_log = logging.getLogger("larder-chart-test.helm")
    helm_log.addHandler(logging.NullHandler())
    helm_log.propagate = False
    helm_python.enable_logging(logging.CRITICAL, helm_log)


def check_node_setup_values() -> None:
    """priorityClassName on both DaemonSets, seLinuxOptions on the containers
    writing on the node, nodeSetup.mirrorURL into hosts.toml (and a cluster
    DNS name refused), no subPath on any Secret volume mount."""
    se = {"type": "spc_t"}
    r = render(
        "node-setup values",
        {"nodeSetup": {"enabled": True, "mirrorURL": "http://10.96.0.77:5000", "priorityClassName": "system-node-critical", "seLinuxOptions": se}},
    )
    if r is not None:
        ds = r.get("DaemonSet", "larder-node-setup")
        pod = ds["spec"]["template"]["spec"]
        check("[node-setup values] node-setup DaemonSet priorityClassName", pod.get("priorityClassName") == "system-node-critical", pod.get("priorityClassName"))
        init = next(c for c in pod["initContainers"] if c["name"] == "containerd-hosts")
        check("[node-setup values] containerd-hosts seLinuxOptions", init.get("securityContext", {}).get("seLinuxOptions") == se, init.get("securityContext"))
        env = {e["name"]: e.get("value") for e in init.get("env", [])}
        check("[node-setup values] mirrorURL handed to the hosts.toml script", "http://10.96.0.77:5000" in env.values(), env)
    r = render(
        "node mode priority",
        {"mode": "node", "config": {"cache": {"maxSize": "8GiB"}}, "priorityClassName": "system-node-critical", "nodeSetup": {"enabled": True, "seLinuxOptions": se}},
    )
    if r is not None:
        pod = workload(r)["spec"]["template"]["spec"]
        check("[node mode priority] larder DaemonSet priorityClassName", pod.get("priorityClassName") == "system-node-critical", pod.get("priorityClassName"))
        init = next(c for c in pod.get("initContainers", []) if c["name"] == "containerd-hosts")
        check("[node mode priority] containerd-hosts seLinuxOptions", init.get("securityContext", {}).get("seLinuxOptions") == se, init.get("securityContext"))
    for url in ("http://larder.larder.svc:5000", "http://larder.larder.svc.cluster.local:5000"):
        err = render_error({"nodeSetup": {"enabled": True, "mirrorURL": url}})
        check(f"[refused] nodeSetup.mirrorURL {url}", err is not None, err)
    for label, values in (("defaults", {}), ("nodeSetup", {"nodeSetup": {"enabled": True}, "service": {"clusterIP": "10.96.0.50"}})):
        r = render(f"subPath {label}", values, validate=False)
        if r is None:
            continue
        for o in r.objects:
            pod = o.get("spec", {}).get("template", {}).get("spec")
            if not pod:
                continue
            secrets = {v["name"] for v in pod.get("volumes", []) if "secret" in v}
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                bad = [m for m in c.get("volumeMounts", []) if m["name"] in secrets and "subPath" in m]
                check(f"[subPath {label}] {o['kind']}/{o['metadata']['name']} {c['name']}: no subPath on Secret mounts", not bad, bad)


def main() -> int:
    global LARDER
    start = time.monotonic()
    quiet_helm()
    LARDER = larder_bin()
    check("larder binary available", LARDER is not None, os.environ.get("LARDER_BIN", "target/debug/larder"))
    for scenario in (
        check_lint,
        check_defaults,
        check_node_mode,
        check_extras,
        check_credentials,
        check_client_credentials,
        check_exposure,
        check_cluster,
        check_cluster_tls,
        check_admin_tls_and_hosts,
        check_cluster_network_policy,
        check_hub,
        check_tracing,
        check_persistence,
        check_pdb_and_bind,
        check_warm,
        check_sizes,
        check_dual_stack,
        check_node_setup_values,
        check_grace,
        check_refused,
        check_dashboard,
        check_docs,
    ):
        # An exception (a missing object, TOML that does not parse, …) fails
        # the scenario and the run goes on.
        try:
            scenario()
        except Exception as e:  # noqa: BLE001
            frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == __file__]
            where = frames[-1] if frames else traceback.extract_tb(e.__traceback__)[-1]
            check(f"{scenario.__name__} completes", False, f"{type(e).__name__}: {e} (line {where.lineno})")
    print(f"({time.monotonic() - start:.1f}s)")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
