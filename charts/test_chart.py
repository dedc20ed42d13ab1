#!/usr/bin/env python3
"""Tests for the larder Helm chart in charts/larder.

Needs: python3 -m pip install helm-python-sdk kubernetes-validate pyyaml
(helm-python-sdk bundles Helm's Go SDK v4: no helm binary, no cluster, no
network).

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
  * checks that invalid values are refused at render time;
  * checks dashboards/larder.json parses and uses only metrics listed in the
    project README's metric table, and that every value in values.yaml is
    in the chart README's values table.

Runs in about two seconds.

Prints one line per check and, last, "N passed, M failed"; the exit status
is 1 when anything failed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import signal
import socket
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


def render(label: str, values: dict, name: str = "larder") -> Rendered | None:
    try:
        manifests = chart().render(values, name=name, namespace=NAMESPACE, is_install=True)
    except helm_python.HelmError as e:
        check(f"[{label}] renders", False, e)
        return None
    r = Rendered(label, manifests)
    check(f"[{label}] renders ({len(r.objects)} objects)", r.objects)
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


def check_config(label: str, toml_text: str, expect_ok: bool = True) -> None:
    """Runs `larder check-config` on toml_text.

    The in-pod paths of password_file and ca_file are recreated under a
    temporary folder (dummy contents) and the TOML is rewritten to point
    there, because check-config reads the password file and requires the CA
    file to exist. With expect_ok=False the TOML is checked as rendered and
    must be refused.
    """
    if LARDER is None:
        check(f"[{label}] larder check-config", False, "no larder binary")
        return
    with tempfile.TemporaryDirectory(prefix="larder-chart-") as tmp:
        text = toml_text
        if expect_ok:
            parsed = tomllib.loads(toml_text)
            for u in parsed.get("upstream", []):
                for key, content in (("password_file", "s3cret\n"), ("ca_file", "-----BEGIN CERTIFICATE-----\n")):
                    if key in u:
                        inside = Path(tmp) / u[key].lstrip("/")
                        inside.parent.mkdir(parents=True, exist_ok=True)
                        inside.write_text(content)
                        quoted = json.dumps(u[key])
                        assert quoted in text, quoted
                        text = text.replace(quoted, json.dumps(str(inside)))
            text = _rewrite_admin_token(parsed, text, Path(tmp))
        cfg = Path(tmp) / "larder.toml"
        cfg.write_text(text)
        p = subprocess.run(
            [str(LARDER), "check-config", "--config", str(cfg)], capture_output=True, text=True, timeout=30
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Straight to 127.0.0.1, whatever http_proxy says.
_direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_status(url: str) -> int | str:
    try:
        with _direct.open(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError as e:
        return str(e)


def run_larder(label: str, toml_text: str, args: list[str]) -> None:
    """Starts larder as the pod would (the container's args), on the rendered
    larder.toml with the listeners moved to free 127.0.0.1 ports and the
    cache to a temporary folder; checks the probe endpoints, /metrics and
    the registry API answer and the logs are JSON, then that SIGTERM ends
    it with status 0 within shutdown_grace."""
    if LARDER is None:
        check(f"[{label}] larder runs", False, "no larder binary")
        return
    with tempfile.TemporaryDirectory(prefix="larder-chart-run-") as tmp:
        conf = tomllib.loads(toml_text)
        addr, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        text = toml_text
        for key, value in (("listen", addr), ("admin_listen", admin)):
            text = text.replace(f"{key} = {json.dumps(conf['server'][key])}", f"{key} = {json.dumps(value)}")
        text = text.replace('dir = "/var/lib/larder"', f"dir = {json.dumps(str(Path(tmp) / 'cache'))}")
        text = _rewrite_admin_token(conf, text, Path(tmp))
        cfg, log = Path(tmp) / "larder.toml", Path(tmp) / "larder.log"
        cfg.write_text(text)
        argv = [str(LARDER)] + [str(cfg) if a == "/etc/larder/larder.toml" else a for a in args]
        with open(log, "w") as log_file:
            proc = subprocess.Popen(argv, stdout=log_file, stderr=log_file)
        try:
            deadline = time.monotonic() + 20
            status: int | str = "not started"
            while time.monotonic() < deadline and proc.poll() is None:
                status = http_status(f"http://{admin}/healthz")
                if status == 200:
                    break
                time.sleep(0.05)
            if not check(
                f"[{label}] larder starts with the pod's args", status == 200, (status, log.read_text()[-500:])
            ):
                return
            for url in (f"http://{admin}/readyz", f"http://{admin}/metrics", f"http://{addr}/v2/"):
                status = http_status(url)
                port = "admin" if admin in url else "registry"
                check(f"[{label}] GET /{url.split('/', 3)[3]} on the {port} port: 200", status == 200, status)
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
    objs = r.of_kind("StatefulSet") + [d for d in r.of_kind("DaemonSet") if "node-setup" not in d["metadata"]["name"]]
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
    check(
        f"[{L}] args",
        c["args"] == ["--config", "/etc/larder/larder.toml", "--log-format", "json"],
        c["args"],
    )
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    check(f"[{L}] RUST_LOG from logLevel", env.get("RUST_LOG") == "larder=info", env)
    ports = {p["name"]: p for p in c["ports"]}
    check(f"[{L}] admin port 9090", ports.get("admin", {}).get("containerPort") == 9090, ports)
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        g = c.get(probe, {}).get("httpGet", {})
        check(
            f"[{L}] {probe} GET {path} on 9090",
            g.get("path") == path and named_port(c, g.get("port")) == 9090,
            g,
        )
    res = c["resources"]
    check(
        f"[{L}] resources 100m/128Mi requests, 512Mi limit",
        res.get("requests") == {"cpu": "100m", "memory": "128Mi"} and res.get("limits", {}).get("memory") == "512Mi",
        res,
    )

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
    check(f"[{L}] Service type ClusterIP", svc["spec"]["type"] == "ClusterIP")
    sp = {p["name"]: p for p in svc["spec"]["ports"]}
    check(
        f"[{L}] Service port 5000 -> registry",
        sp.get("registry", {}).get("port") == 5000 and sp["registry"].get("targetPort") == "registry",
        sp,
    )
    check(
        f"[{L}] Service port 9090 -> admin (named metrics)",
        sp.get("metrics", {}).get("port") == 9090 and sp["metrics"].get("targetPort") == "admin",
        sp,
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
        conf["server"] == {"listen": "0.0.0.0:5000", "admin_listen": "0.0.0.0:9090", "shutdown_grace": "25s"},
        conf["server"],
    )
    check(
        "[default] larder.toml cache section",
        conf["cache"]
        == {
            "dir": "/var/lib/larder",
            "max_size": "40GiB",
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
        == ["ConfigMap/larder", "DaemonSet/larder", "Secret/larder-admin-token", "Service/larder", "ServiceAccount/larder"],
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
    cache = volume(pod, "cache")
    check(
        "[node+hostNetwork] cache on hostPath /var/lib/larder",
        cache.get("hostPath") == {"path": "/var/lib/larder", "type": "DirectoryOrCreate"},
        cache,
    )
    init = spec.get("initContainers", [])
    check(
        "[node+hostNetwork] init container chowns the hostPath to 65532",
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
            check("[node+hostNetwork] chown script runs (owner already right)", p.returncode == 0, p.stderr)
    check("[node+hostNetwork] no PVC", "volumeClaimTemplates" not in ds["spec"])
    check(
        "[node+hostNetwork] rolling update without surge (hostPort)",
        ds["spec"]["updateStrategy"]["rollingUpdate"] == {"maxUnavailable": 1},
    )
    check_config("node+hostNetwork", r.toml_text())

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
            "[node hostPort 5001 emptyDir] cache emptyDir 20Gi",
            volume(pod, "cache") == {"name": "cache", "emptyDir": {"sizeLimit": "20Gi"}},
        )
        check("[node hostPort 5001 emptyDir] no init container", not pod["spec"].get("initContainers"))
        check_config("node hostPort 5001 emptyDir", r.toml_text())

    r = render("node hostNetwork hostPort 5001", {"mode": "node", "node": {"hostNetwork": True, "hostPort": 5001}})
    if r:
        check_mirror_pod(r, node=True)
        reg = next(
            p for p in container(r.get("DaemonSet", "larder")["spec"]["template"])["ports"] if p["name"] == "registry"
        )
        check(
            "[node hostNetwork hostPort 5001] listens on 5001",
            r.toml()["server"]["listen"] == "0.0.0.0:5001" and reg["containerPort"] == 5001 == reg["hostPort"],
            reg,
        )


def run_node_setup(label: str, cm: dict) -> dict[str, str]:
    """Runs the rendered install.sh with /config and /host/certs.d moved to
    temporary folders; returns {relative path: content} of what it wrote."""
    with tempfile.TemporaryDirectory(prefix="larder-nodesetup-") as tmp:
        conf, certs = Path(tmp, "config"), Path(tmp, "certs.d")
        conf.mkdir()
        for k, v in cm["data"].items():
            (conf / k).write_text(v)
        script = cm["data"]["install.sh"].replace("/host/certs.d", str(certs)).replace("/config/", f"{conf}/")
        p = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30)
        check(f"[{label}] node setup script runs", p.returncode == 0, p.stderr)
        return {str(f.relative_to(certs)): f.read_text() for f in certs.rglob("*") if f.is_file()}


def check_extras() -> None:
    values = {
        "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "podDisruptionBudget": {"enabled": True},
        "nodeSetup": {"enabled": True},
        "grafanaDashboard": {"enabled": True},
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
            "ConfigMap/larder-node-setup",
            "DaemonSet/larder-node-setup",
            "PodDisruptionBudget/larder",
            "Secret/larder-admin-token",
            "Service/larder",
            "Service/larder-headless",
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
    check("[extras] exactly one selected Service has a 'metrics' port", with_metrics == ["larder"], with_metrics)

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
    certs = volume(ns_ds["spec"]["template"], "certs-d")
    check(
        "[extras] node setup mounts /etc/containerd/certs.d",
        certs.get("hostPath") == {"path": "/etc/containerd/certs.d", "type": "DirectoryOrCreate"},
        certs,
    )
    init = spec["initContainers"][0]
    check(
        "[extras] node setup init container runs the script with busybox",
        init["image"] == "busybox:1.36.1" and init["command"] == ["/bin/sh", "/config/install.sh"],
        init,
    )
    check(
        "[extras] node setup init container has no capabilities",
        init["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        and init["securityContext"]["allowPrivilegeEscalation"] is False,
    )
    pause = spec["containers"][0]
    check(
        "[extras] node setup keeps running as non-root",
        pause["securityContext"]["runAsNonRoot"] is True and "sleep" in pause["command"][-1],
    )
    check("[extras] node setup tolerates every taint", spec.get("tolerations") == [{"operator": "Exists"}])

    cm = r.get("ConfigMap", "larder-node-setup")
    mirror = "http://larder.cache.svc.cluster.local:5000"
    upstreams = r.toml()["upstream"]
    for i, u in enumerate(upstreams):
        hosts = tomllib.loads(cm["data"][f"upstream-{i}.hosts.toml"])
        check(
            f"[extras] hosts.toml for {u['name']}: server {u['url']}, mirror {mirror} pull+resolve",
            hosts == {"server": u["url"], "host": {mirror: {"capabilities": ["pull", "resolve"]}}},
            hosts,
        )
    written = run_node_setup("extras", cm)
    expected = {f"{u['name']}/hosts.toml" for u in upstreams}
    check(
        "[extras] node setup writes <certs.d>/<upstream>/hosts.toml for each upstream",
        set(written) == expected,
        sorted(written),
    )
    check(
        "[extras] installed hosts.toml files are the rendered ones",
        all(
            written.get(f"{u['name']}/hosts.toml") == cm["data"][f"upstream-{i}.hosts.toml"]
            for i, u in enumerate(upstreams)
        ),
    )
    check(
        "[extras] node setup pods restart on config change",
        "checksum/config" in ns_ds["spec"]["template"]["metadata"]["annotations"],
    )

    dash = r.get("ConfigMap", "larder-dashboard")
    check(
        "[extras] dashboard ConfigMap has the sidecar label", dash["metadata"]["labels"].get("grafana_dashboard") == "1"
    )
    shipped = json.loads((CHART / "dashboards" / "larder.json").read_text())
    check(
        "[extras] dashboard ConfigMap holds dashboards/larder.json", json.loads(dash["data"]["larder.json"]) == shipped
    )
    check("[extras] NOTES warn about cluster DNS on nodes", "WARNING" in r.notes)
    check_config("extras", r.toml_text())

    r = render("nodeSetup via clusterIP", {"nodeSetup": {"enabled": True}, "service": {"clusterIP": "10.96.0.50"}})
    if r:
        cm = r.get("ConfigMap", "larder-node-setup")
        hosts = tomllib.loads(cm["data"]["upstream-1.hosts.toml"])
        check(
            "[nodeSetup via clusterIP] mirror http://10.96.0.50:5000",
            list(hosts["host"]) == ["http://10.96.0.50:5000"],
            hosts,
        )
        check(
            "[nodeSetup via clusterIP] Service clusterIP fixed",
            r.get("Service", "larder")["spec"].get("clusterIP") == "10.96.0.50",
        )

    r = render(
        "node+nodeSetup",
        {"mode": "node", "node": {"hostPort": 5050}, "nodeSetup": {"enabled": True, "certsDir": "/etc/k8s/certs.d"}},
    )
    if r:
        cm = r.get("ConfigMap", "larder-node-setup")
        hosts = tomllib.loads(cm["data"]["upstream-0.hosts.toml"])
        check("[node+nodeSetup] mirror http://127.0.0.1:5050", list(hosts["host"]) == ["http://127.0.0.1:5050"], hosts)
        ds = r.get("DaemonSet", "larder-node-setup")
        check(
            "[node+nodeSetup] certsDir from values",
            volume(ds["spec"]["template"], "certs-d")["hostPath"]["path"] == "/etc/k8s/certs.d",
        )


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


def check_pdb_and_bind() -> None:
    r = render(
        "PDB minAvailable, IPv6 bind",
        {"podDisruptionBudget": {"enabled": True, "minAvailable": "50%"}, "config": {"bindAddress": "[::]"}},
    )
    if r:
        spec = r.get("PodDisruptionBudget", "larder")["spec"]
        check(
            "[PDB minAvailable, IPv6 bind] minAvailable 50%, no maxUnavailable",
            spec.get("minAvailable") == "50%" and "maxUnavailable" not in spec,
            spec,
        )
        server = r.toml()["server"]
        check(
            "[PDB minAvailable, IPv6 bind] listeners on [::]",
            server["listen"] == "[::]:5000" and server["admin_listen"] == "[::]:9090",
            server,
        )
        check_mirror_pod(r, node=False)
        check_config("PDB minAvailable, IPv6 bind", r.toml_text())


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
    ]
    for label, values, needle in cases:
        err = render_error(values)
        check(f"[refused] {label}", err is not None and needle in err, err or "rendered")


def check_lint() -> None:
    for label, values in (
        ("default", None),
        ("node", {"mode": "node", "node": {"hostNetwork": True}, "nodeSetup": {"enabled": True}}),
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

    def walk(p: dict) -> None:
        exprs.extend(t["expr"] for t in p.get("targets", []) if "expr" in t)
        for sub in p.get("panels", []):
            walk(sub)

    for p in dash["panels"]:
        walk(p)
    used = {re.sub(r"_(bucket|sum|count)$", "", m) for e in exprs for m in re.findall(r"\blarder_[a-z_]+", e)}
    # The metric table in the project README is the reference.
    readme = (ROOT / "README.md").read_text() if (ROOT / "README.md").is_file() else ""
    documented = set(re.findall(r"^\| `(larder_[a-z_]+)`", readme, re.M))
    check("[dashboard] README lists metrics", documented, "no metric table in README.md")
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
    ids = [p["id"] for p in dash["panels"]]
    check("[dashboard] panel ids unique", len(ids) == len(set(ids)))


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


def main() -> int:
    global LARDER
    start = time.monotonic()
    # Helm's own log lines (e.g. each `fail` the refused cases trigger) go
    # nowhere; errors still arrive as exceptions.
    helm_log = logging.getLogger("larder-chart-test.helm")
    helm_log.addHandler(logging.NullHandler())
    helm_log.propagate = False
    helm_python.enable_logging(logging.CRITICAL, helm_log)
    LARDER = larder_bin()
    check("larder binary available", LARDER is not None, os.environ.get("LARDER_BIN", "target/debug/larder"))
    for scenario in (
        check_lint,
        check_defaults,
        check_node_mode,
        check_extras,
        check_credentials,
        check_persistence,
        check_pdb_and_bind,
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
