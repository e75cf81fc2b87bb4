"""deploy/: the container image, compose file, Kubernetes manifests, systemd unit
and NATS stream are valid and agree with the relay's own settings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from relay.config import Config, parse_duration

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S = DEPLOY / "kubernetes"


def test_dockerfile_runs_as_non_root_with_a_health_check():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^USER 10001$", text, re.M)
    assert 'ENTRYPOINT ["outbox-relay"]' in text
    assert 'CMD ["run"]' in text
    assert "HEALTHCHECK" in text
    assert "/healthz" in text
    assert "python:3.11-slim" in text


def test_kubernetes_manifests_validate():
    files = sorted(
        str(p)
        for p in K8S.glob("*.yaml")
        if p.name not in ("servicemonitor.yaml", "kustomization.yaml")
    )
    result = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *files],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    documents = sum(len(documents_of(Path(f).name)) for f in files)
    assert result.stdout.count("passed") == documents, result.stdout


def documents_of(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def load(name: str) -> dict:
    [document] = documents_of(name)
    return document


def secrets() -> dict[str, dict[str, str]]:
    return {s["metadata"]["name"]: s["stringData"] for s in documents_of("secret.yaml")}


def secret_files(pod: dict) -> dict[str, str]:
    """The files a pod's containers read secrets from, as {path: the Secret's key},
    and each path that an OUTBOX_RELAY_* variable names, checked to be one of them."""
    volumes = {v["name"]: v["secret"] for v in pod["volumes"] if "secret" in v}
    [container] = pod["containers"]
    files = {}
    for mount in container["volumeMounts"]:
        secret = volumes[mount["name"]]
        assert secret["defaultMode"] & 0o007 == 0, "secret files readable by others"
        for key in secrets()[secret["secretName"]]:
            files[f"{mount['mountPath']}/{key}"] = key
    for variable in container["env"]:
        assert variable["name"].startswith("OUTBOX_RELAY_")
        assert variable["value"] in files, variable
    assert "secretRef" not in str(container.get("envFrom")), "a secret in the environment"
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    return files


def test_kubernetes_pieces_fit_together():
    deployment, service = load("deployment.yaml"), load("service.yaml")
    monitor, pdb = load("servicemonitor.yaml"), load("poddisruptionbudget.yaml")
    config = load("configmap.yaml")["data"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["replicas"] == 2
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == service["spec"]["ports"][0]["name"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["resources"]["requests"]
    assert container["resources"]["limits"]
    sources = {next(iter(s.values()))["name"] for s in container["envFrom"]}
    assert sources == {"outbox-relay"}
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > parse_duration(config["OUTBOX_RELAY_PUBLISH_TIMEOUT"]) + 5
    listed = set(load("kustomization.yaml")["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


def test_kubernetes_secrets_are_mounted_files_and_install_alone_holds_the_owner_role():
    deployment, job = load("deployment.yaml"), load("job-install.yaml")
    relay_files = secret_files(deployment["spec"]["template"]["spec"])
    install_files = secret_files(job["spec"]["template"]["spec"])
    relay_env = {
        e["name"]: e["value"]
        for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert set(relay_env) == {"OUTBOX_RELAY_DATABASE_URL_FILE", "OUTBOX_RELAY_NATS_CREDS"}
    assert set(relay_files.values()) == {"database-url", "nats.creds"}
    assert set(install_files.values()) == {"database-url"}
    runtime, owner = secrets()["outbox-relay"], secrets()["outbox-relay-install"]
    # The relay's pods mount the runtime role's URL; only the Job gets the owner's.
    runtime_role, owner_role = (
        re.match(r"postgresql://([^:]+):", s["database-url"])[1] for s in (runtime, owner)
    )
    assert runtime_role != owner_role
    [install] = job["spec"]["template"]["spec"]["containers"]
    assert install["args"] == ["install", "--grant-to", runtime_role]


def test_stream_duplicate_window_covers_the_relay_retries():
    stream = json.loads((DEPLOY / "nats" / "events-stream.json").read_text())
    window = stream["duplicate_window"] / 1e9
    config = load("configmap.yaml")["data"]
    backoff_max = parse_duration(config.get("OUTBOX_RELAY_BACKOFF_MAX", "5m"))
    publish_timeout = parse_duration(config["OUTBOX_RELAY_PUBLISH_TIMEOUT"])
    # A message stored but not acked is retried after at most backoff_max: a window
    # longer than that (plus the publish timeout) turns every such retry into a
    # duplicate=true ack instead of a second copy in the stream.
    assert window >= backoff_max + publish_timeout
    assert Config().backoff_max <= window


def test_dockerfile_copies_every_directory_the_wheel_is_built_from():
    # pip builds the wheel inside the image: a package directory pyproject.toml
    # lists but the Dockerfile does not copy fails the build.
    setuptools = tomllib.loads((DEPLOY.parent / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapped = setuptools["package-dir"]
    directories = {
        mapped.get(package, package.replace(".", "/")).split("/")[0]
        for package in setuptools["packages"]
    }
    text = (DEPLOY / "Dockerfile").read_text()
    assert directories == {"relay", "relay_tools", "sql"}
    for directory in directories:
        assert f"COPY {directory} ./{directory}" in text, directory
