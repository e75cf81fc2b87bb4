"""deploy/: the container image, compose file, Kubernetes manifests, systemd unit
and NATS stream are valid and agree with the relay's own settings."""

from __future__ import annotations

import json
import re
import subprocess
import sys
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
    assert result.stdout.count("passed") == len(files), result.stdout


def load(name: str) -> dict:
    return yaml.safe_load((K8S / name).read_text())


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
    assert "OUTBOX_RELAY_DATABASE_URL" in load("secret.yaml")["stringData"]
    assert load("job-install.yaml")["spec"]["template"]["spec"]["containers"][0]["args"] == [
        "install"
    ]
    listed = set(load("kustomization.yaml")["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}


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
