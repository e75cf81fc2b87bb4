"""A throwaway three-node NATS JetStream cluster on loopback, for the tests that kill,
stop or restart its nodes. Each node keeps its store across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nats

from relay.localservers import free_port, nats_server_binary, wait_for_port
from tests.support.relayproc import wait_until
from tests.support.stream import TestStream, run_js


class ClusterNode:
    def __init__(self, name: str, directory: Path, port: int, cluster_port: int) -> None:
        self.name = name
        self.dir = directory
        self.port = port
        self.cluster_port = cluster_port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self.process is not None

    def start(self, routes: list[int]) -> None:
        config = self.dir / "nats.conf"
        route_urls = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in routes)
        config.write_text(
            f'server_name: "{self.name}"\n'
            f'jetstream {{\n  store_dir: "{self.dir / "store"}"\n}}\n'
            f'cluster {{\n  name: "outbox-relay-test"\n  listen: "127.0.0.1:{self.cluster_port}"\n'
            f"  routes: [{route_urls}]\n}}\n"
        )
        self.process = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-c", str(config),
             "-l", str(self.dir / "nats.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        wait_for_port(self.port)

    def kill(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()
            self.process = None


class ThrowawayCluster:
    """Three JetStream nodes routed to each other, every port on loopback."""

    def __init__(self, size: int = 3) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="outbox-relay-cluster-"))
        self.nodes: list[ClusterNode] = []
        for index in range(size):
            directory = self.dir / f"n{index + 1}"
            directory.mkdir()
            self.nodes.append(ClusterNode(f"n{index + 1}", directory, free_port(), free_port()))

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated, as the relay takes them."""
        return ",".join(self.urls)

    def r3_stream(self) -> TestStream:
        """A test stream with a replica on every node, once the cluster can make one
        (a new cluster elects its meta leader first)."""

        def attempt() -> TestStream | None:
            try:
                return TestStream(self.url, num_replicas=3)
            except Exception:  # noqa: BLE001 - not yet: try again
                return None

        return wait_until(attempt, timeout=60, message="an R3 stream on the new cluster")

    def leader(self, stream: str) -> ClusterNode:
        async def action(js: object) -> str:
            info = await js.stream_info(stream)  # type: ignore[attr-defined]
            return str(info.cluster.leader)

        return self.node(run_js(self.url, action))

    def step_down(self, stream: str) -> ClusterNode:
        """Ask the stream's leader to hand over to another replica (again, while a
        node that just restarted still catches up and the request goes unanswered);
        the new leader."""
        before = self.wait_for_leader(stream)

        async def request() -> bool:
            nc = await nats.connect(self.url.split(","), connect_timeout=5)
            try:
                reply = await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
            except nats.errors.TimeoutError:
                return False
            finally:
                await nc.close()
            return bool(json.loads(reply.data).get("success"))

        wait_until(lambda: asyncio.run(request()), timeout=60, message="a leader stepdown")
        return wait_until(
            lambda: (leader := self.wait_for_leader(stream)) != before and leader,
            timeout=60,
            message="another leader",
        )

    def wait_for_leader(self, stream: str) -> ClusterNode:
        def found() -> ClusterNode | None:
            try:
                return self.leader(stream)
            except Exception:  # noqa: BLE001 - electing: ask again
                return None

        return wait_until(found, timeout=60, message=f"a leader for {stream}")

    def node(self, name: str) -> ClusterNode:
        return next(node for node in self.nodes if node.name == name)

    def start(self, node: ClusterNode | None = None) -> None:
        routes = [n.cluster_port for n in self.nodes]
        for each in [node] if node is not None else self.nodes:
            each.start(routes)

    def destroy(self) -> None:
        for node in self.nodes:
            node.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[ThrowawayCluster]:
    cluster = ThrowawayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()
