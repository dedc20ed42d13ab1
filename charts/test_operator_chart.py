#!/usr/bin/env python3
"""Tests for the operator's side of the Helm charts: alerts, the admin token,
and the sidecar library with its example parent chart.

Needs: python3 -m pip install helm-python-sdk kubernetes-validate pyyaml,
and Debian's `prometheus` package (for `promtool`).

What it does:
  * alerts: `promtool check rules` and `promtool test rules` (unit tests with
    synthetic series, charts/larder/alerts/larder.rules.test.yaml) on the rule
    file, and again on the rules taken out of the rendered PrometheusRule
    (so the template keeps them intact); prometheusRule.alertLabels reach
    every alert and prometheusRule.disabledAlerts leave alerts out;
  * admin token: by default the chart creates a Secret with a random
    48-character token, mounts it read-only and renders `[admin] token_file`
    pointing at it; `larder check-config` accepts the rendered larder.toml
    with the file recreated under a temporary folder; an existing Secret is
    used instead of a created one; adminToken.enabled=false renders neither;
  * sidecar: lints the larder-sidecar library chart and the example parent
    chart charts/examples/dind-runner, renders the example with Helm's own
    engine in three configurations, validates every object against the
    Kubernetes 1.30 schemas (kubernetes-validate, strict), checks the native
    sidecar (init container, restartPolicy Always, startup probe on the
    admin port), the loopback registry port, the volumes, and dockerd's
    daemon.json pointing at the sidecar; `larder check-config` accepts the
    sidecar's larder.toml, also with hub.url (`via` on every upstream);
    cluster.enabled and shared.enabled are refused for a sidecar.

`--emit DIR` renders the example with its default values and writes the
sidecar's larder.toml and dockerd's daemon.json into DIR (used by
tests/sidecar_dockerd.rs, which runs them with a real larder and dockerd)
instead of running the checks.

Prints one line per check and, last, "N passed, M failed"; the exit status
is 1 when anything failed.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import traceback
from pathlib import Path

import helm_python
import kubernetes_validate
import yaml

CHARTS = Path(__file__).resolve().parent
ROOT = CHARTS.parent
LARDER_CHART = CHARTS / "larder"
LIBRARY = CHARTS / "larder-sidecar"
EXAMPLE = CHARTS / "examples" / "dind-runner"
ALERTS = LARDER_CHART / "alerts"
KUBE_VERSION = "1.30"
NAMESPACE = "ops"
CRD_KINDS = {("monitoring.coreos.com/v1", "PrometheusRule"), ("monitoring.coreos.com/v1", "ServiceMonitor")}

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


def render(chart_dir: Path, values: dict, name: str = "larder") -> list[dict]:
    manifests = helm_python.Chart.load(str(chart_dir)).render(values, name=name, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc is not None)
    return objects


def find(objects: list[dict], kind: str, name: str | None = None) -> dict | None:
    return next((o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)), None)


def validate(label: str, objects: list[dict]) -> None:
    for obj in objects:
        ident = f"{obj['kind']}/{obj['metadata']['name']}"
        if (obj.get("apiVersion"), obj.get("kind")) in CRD_KINDS:
            check(f"[{label}] {ident}: CRD object has a spec", isinstance(obj.get("spec"), dict))
            continue
        try:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
            check(f"[{label}] {ident}: valid Kubernetes {KUBE_VERSION}", True)
        except kubernetes_validate.ValidationError as e:
            path = "/".join(str(p) for p in e.path)
            check(f"[{label}] {ident}: valid Kubernetes {KUBE_VERSION}", False, f"{path}: {e.message}")


def larder_bin() -> Path | None:
    p = Path(os.environ.get("LARDER_BIN", ROOT / "target" / "debug" / "larder"))
    if not p.is_file() and "LARDER_BIN" not in os.environ:
        subprocess.run(["cargo", "build", "--quiet"], cwd=ROOT, check=False)
    return p if p.is_file() else None


def check_config(label: str, toml_text: str, files: dict[str, str]) -> None:
    """`larder check-config` on toml_text, with each in-pod path in `files`
    recreated under a temporary folder (and the TOML pointed there)."""
    larder = larder_bin()
    if larder is None:
        check(f"[{label}] larder check-config", False, "no larder binary")
        return
    with tempfile.TemporaryDirectory(prefix="larder-op-chart-") as tmp:
        text = toml_text
        for in_pod, content in files.items():
            outside = Path(tmp) / in_pod.lstrip("/")
            outside.parent.mkdir(parents=True, exist_ok=True)
            outside.write_text(content)
            assert json.dumps(in_pod) in text, in_pod
            text = text.replace(json.dumps(in_pod), json.dumps(str(outside)))
        cfg = Path(tmp) / "larder.toml"
        cfg.write_text(text)
        p = subprocess.run([str(larder), "check-config", "--config", str(cfg)], capture_output=True, text=True)
        check(f"[{label}] larder check-config accepts larder.toml", p.returncode == 0, (p.stdout + p.stderr).strip())


# ------------------------------------------------------------------ alerts


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


def check_alerts() -> None:
    if not shutil.which("promtool"):
        check("promtool available (Debian package prometheus)", False)
        return
    p = promtool("check", "rules", str(ALERTS / "larder.rules.yaml"))
    check("[alerts] promtool check rules larder.rules.yaml", p.returncode == 0, p.stdout + p.stderr)
    p = promtool("test", "rules", str(ALERTS / "larder.rules.test.yaml"))
    check("[alerts] promtool test rules larder.rules.test.yaml", p.returncode == 0, p.stdout + p.stderr)
    source = yaml.safe_load((ALERTS / "larder.rules.yaml").read_text())
    names = [r["alert"] for g in source["groups"] for r in g["rules"]]
    tested = yaml.safe_load((ALERTS / "larder.rules.test.yaml").read_text())
    covered = {t["alertname"] for case in tested["tests"] for t in case.get("alert_rule_test", []) if t["exp_alerts"]}
    check("[alerts] every alert has a unit test where it fires", set(names) <= covered, set(names) - covered)
    check("[alerts] no PrometheusRule by default", find(render(LARDER_CHART, {}), "PrometheusRule") is None)

    objects = render(LARDER_CHART, {"prometheusRule": {"enabled": True, "labels": {"release": "kps"}}})
    rule = find(objects, "PrometheusRule", "larder")
    if not check("[alerts] PrometheusRule rendered", rule is not None):
        return
    validate("alerts", [rule])
    check("[alerts] PrometheusRule extra labels", rule["metadata"]["labels"].get("release") == "kps")
    check(
        "[alerts] the PrometheusRule carries the rule file's groups unchanged",
        rule["spec"]["groups"] == source["groups"],
    )
    # The rendered rules pass promtool's checks and unit tests too.
    with tempfile.TemporaryDirectory(prefix="larder-rules-") as tmp:
        (Path(tmp) / "larder.rules.yaml").write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        shutil.copy(ALERTS / "larder.rules.test.yaml", tmp)
        p = promtool("check", "rules", str(Path(tmp) / "larder.rules.yaml"))
        check("[alerts] promtool check rules on the rendered PrometheusRule", p.returncode == 0, p.stdout + p.stderr)
        p = promtool("test", "rules", str(Path(tmp) / "larder.rules.test.yaml"))
        check("[alerts] promtool test rules on the rendered PrometheusRule", p.returncode == 0, p.stdout + p.stderr)

    objects = render(
        LARDER_CHART,
        {
            "prometheusRule": {
                "enabled": True,
                "alertLabels": {"team": "platform"},
                "disabledAlerts": ["LarderAdminAuthFailures"],
            }
        },
    )
    rules = [r for g in find(objects, "PrometheusRule")["spec"]["groups"] for r in g["rules"]]
    check("[alerts] disabledAlerts leaves the alert out", "LarderAdminAuthFailures" not in [r["alert"] for r in rules])
    check("[alerts] alertLabels on every alert", all(r["labels"].get("team") == "platform" for r in rules))
    check("[alerts] severities kept", all(r["labels"].get("severity") in ("warning", "critical") for r in rules))


# -------------------------------------------------------------- admin token


def pod_spec(objects: list[dict]) -> dict:
    workload = find(objects, "StatefulSet") or find(objects, "DaemonSet")
    return workload["spec"]["template"]["spec"]


def check_admin_token() -> None:
    objects = render(LARDER_CHART, {})
    validate("admin token", objects)
    secret = find(objects, "Secret", "larder-admin-token")
    if not check("[admin token] a Secret is created by default", secret is not None):
        return
    import base64

    token = base64.b64decode(secret["data"]["token"]).decode()
    check("[admin token] 48 random characters", len(token) == 48 and token.isalnum(), len(token))
    again = find(render(LARDER_CHART, {}), "Secret", "larder-admin-token")
    check("[admin token] a fresh token per render without a cluster", again["data"]["token"] != secret["data"]["token"])
    spec = pod_spec(objects)
    larder = next(c for c in spec["containers"] if c["name"] == "larder")
    mount = next((m for m in larder["volumeMounts"] if m["name"] == "admin-token"), None)
    check(
        "[admin token] mounted read-only at /run/secrets/larder-admin",
        mount == {"name": "admin-token", "mountPath": "/run/secrets/larder-admin", "readOnly": True},
        mount,
    )
    vol = next(v for v in spec["volumes"] if v["name"] == "admin-token")
    check("[admin token] volume from the Secret", vol["secret"]["secretName"] == "larder-admin-token", vol)
    check("[admin token] not world-readable", vol["secret"]["defaultMode"] == 0o440, vol)
    toml_text = find(objects, "ConfigMap", "larder")["data"]["larder.toml"]
    cfg = tomllib.loads(toml_text)
    check(
        "[admin token] [admin] token_file is the mounted key",
        cfg.get("admin", {}).get("token_file") == "/run/secrets/larder-admin/token",
        cfg.get("admin"),
    )
    check_config("admin token", toml_text, {"/run/secrets/larder-admin/token": token + "\n"})

    objects = render(LARDER_CHART, {"adminToken": {"existingSecret": "ops-admin", "key": "larder"}})
    check("[existing admin token] no Secret created", find(objects, "Secret") is None)
    spec = pod_spec(objects)
    vol = next(v for v in spec["volumes"] if v["name"] == "admin-token")
    check("[existing admin token] the named Secret and key", vol["secret"]["secretName"] == "ops-admin"
          and vol["secret"]["items"] == [{"key": "larder", "path": "larder"}], vol)
    cfg = tomllib.loads(find(objects, "ConfigMap", "larder")["data"]["larder.toml"])
    check("[existing admin token] token_file", cfg["admin"]["token_file"] == "/run/secrets/larder-admin/larder")

    objects = render(LARDER_CHART, {"adminToken": {"enabled": False}})
    check("[no admin token] no Secret", find(objects, "Secret") is None)
    check("[no admin token] no volume", all(v["name"] != "admin-token" for v in pod_spec(objects)["volumes"]))
    check("[no admin token] no [admin]", "admin" not in tomllib.loads(find(objects, "ConfigMap", "larder")["data"]["larder.toml"]))


# ------------------------------------------------------------------ sidecar


def example(values: dict) -> list[dict]:
    return render(EXAMPLE, values, name="ci")


def sidecar_files(objects: list[dict]) -> tuple[str, dict]:
    larder_toml = find(objects, "ConfigMap", "ci-dind-runner-larder")["data"]["larder.toml"]
    daemon = json.loads(find(objects, "ConfigMap", "ci-dind-runner-dockerd")["data"]["daemon.json"])
    return larder_toml, daemon


def check_sidecar() -> None:
    for label, path in (("library", LIBRARY), ("example", EXAMPLE)):
        report = helm_python.lint(str(path), None, strict=True, kube_version=f"v{KUBE_VERSION}.0")
        bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
        check(f"[sidecar] helm lint --strict {label}", not report.get("errors") and not bad, report)

    objects = example({})
    validate("sidecar", objects)
    deploy = find(objects, "Deployment", "ci-dind-runner")
    spec = deploy["spec"]["template"]["spec"]
    init = {c["name"]: c for c in spec.get("initContainers", [])}
    larder = init.get("larder")
    if not check("[sidecar] larder is a native sidecar (init container)", larder is not None, list(init)):
        return
    check("[sidecar] restartPolicy Always", larder.get("restartPolicy") == "Always")
    probe = larder.get("startupProbe", {}).get("httpGet", {})
    check("[sidecar] startup probe /healthz on the admin port", probe == {"path": "/healthz", "port": "larder-admin"}, probe)
    check("[sidecar] image from the library's appVersion", larder["image"] == "larder:0.1.0", larder["image"])
    check("[sidecar] locked-down security context", larder["securityContext"].get("readOnlyRootFilesystem") is True
          and larder["securityContext"].get("runAsNonRoot") is True)
    mounts = {m["mountPath"]: m["name"] for m in larder["volumeMounts"]}
    check("[sidecar] config, cache and tmp mounted", mounts == {"/etc/larder": "larder-config",
          "/var/lib/larder": "larder-cache", "/tmp": "larder-tmp"}, mounts)
    volumes = {v["name"]: v for v in spec["volumes"]}
    check("[sidecar] emptyDir cache with its size limit", volumes["larder-cache"] == {"name": "larder-cache",
          "emptyDir": {"sizeLimit": "20Gi"}}, volumes.get("larder-cache"))
    check("[sidecar] config volume is the rendered ConfigMap", volumes["larder-config"]["configMap"]["name"]
          == "ci-dind-runner-larder")
    larder_toml, daemon = sidecar_files(objects)
    cfg = tomllib.loads(larder_toml)
    check("[sidecar] registry port on loopback only", cfg["server"]["listen"] == "127.0.0.1:5000", cfg["server"])
    check("[sidecar] admin port reachable for probes (config.bindAddress)", cfg["server"]["admin_listen"] == "[::]:9090", cfg["server"])
    check("[sidecar] no admin token (operations refused off loopback)", "admin" not in cfg)
    check("[sidecar] the example's cache size", cfg["cache"]["max_size"] == "16GiB")
    check("[sidecar] Docker Hub as the default upstream", cfg["upstream"][0]["name"] == "docker.io"
          and cfg["upstream"][0]["default"] is True)
    check("[sidecar] dockerd's registry-mirrors is the sidecar", daemon.get("registry-mirrors") == ["http://127.0.0.1:5000"], daemon)
    check("[sidecar] the mirror is an insecure (plain HTTP) registry", daemon.get("insecure-registries") == ["127.0.0.1:5000"])
    dockerd = next(c for c in spec["containers"] if c["name"] == "dockerd")
    check("[sidecar] dockerd reads the rendered daemon.json", "--config-file=/etc/docker/daemon.json" in dockerd["args"])
    check_config("sidecar", larder_toml, {})

    objects = example(
        {
            "larder": {
                "sidecar": {"native": False, "cache": {"claimName": "runner-cache"}},
                "ports": {"registry": 5055},
                "upstreams": [
                    {"name": "docker.io", "url": "https://registry-1.docker.io", "default": True,
                     "credentials": {"username": "bot", "existingSecret": "hub"}},
                ],
            },
            "daemonConfig": {"max-concurrent-downloads": 6},
        }
    )
    validate("sidecar, plain container, claim", objects)
    spec = find(objects, "Deployment")["spec"]["template"]["spec"]
    names = [c["name"] for c in spec["containers"]]
    check("[sidecar, plain container, claim] larder among the containers", names == ["larder", "dockerd"]
          and not spec.get("initContainers"), names)
    larder = spec["containers"][0]
    check("[sidecar, plain container, claim] no restartPolicy on a regular container", "restartPolicy" not in larder)
    volumes = {v["name"]: v for v in spec["volumes"]}
    check("[sidecar, plain container, claim] the cache is the claim",
          volumes["larder-cache"].get("persistentVolumeClaim") == {"claimName": "runner-cache"})
    check("[sidecar, plain container, claim] credentials Secret mounted",
          volumes["larder-upstream-0-credentials"]["secret"]["secretName"] == "hub")
    larder_toml, daemon = sidecar_files(objects)
    cfg = tomllib.loads(larder_toml)
    check("[sidecar, plain container, claim] port follows ports.registry", cfg["server"]["listen"] == "127.0.0.1:5055")
    check("[sidecar, plain container, claim] mirror follows it", daemon["registry-mirrors"] == ["http://127.0.0.1:5055"])
    check("[sidecar, plain container, claim] daemonConfig merged", daemon.get("max-concurrent-downloads") == 6)
    check_config("sidecar, credentials", larder_toml, {"/run/secrets/larder/docker.io/password": "s3cret\n"})

    # A runner's sidecar in front of the cluster's hub: every upstream goes there.
    hub = "http://larder.larder.svc.cluster.local:5000"
    larder_toml, _ = sidecar_files(example({"larder": {"hub": {"url": hub}}}))
    upstreams = tomllib.loads(larder_toml)["upstream"]
    check("[sidecar via hub] via on every upstream", [u.get("via") for u in upstreams] == [hub], upstreams)
    check_config("sidecar via hub", larder_toml, {})
    # No peers and no store keys in one pod's sidecar: refused, not ignored.
    for key in ("cluster", "shared"):
        try:
            example({"larder": {key: {"enabled": True}}})
            err = None
        except helm_python.HelmError as e:
            err = str(e)
        check(f"[sidecar] {key}.enabled refused", err is not None and "not for the larder sidecar" in err, err)


def emit(directory: Path) -> int:
    larder_toml, daemon = sidecar_files(example({}))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "larder.toml").write_text(larder_toml)
    (directory / "daemon.json").write_text(json.dumps(daemon, indent=2))
    print(f"wrote {directory}/larder.toml and {directory}/daemon.json")
    return 0


def main() -> int:
    helm_log = logging.getLogger("larder-operator-chart-test.helm")
    helm_log.addHandler(logging.NullHandler())
    helm_log.propagate = False
    helm_python.enable_logging(logging.CRITICAL, helm_log)
    if len(sys.argv) == 3 and sys.argv[1] == "--emit":
        return emit(Path(sys.argv[2]))
    start = time.monotonic()
    for scenario in (check_alerts, check_admin_token, check_sidecar):
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
