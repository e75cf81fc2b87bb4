"""A throwaway three-node NATS JetStream cluster on loopback, for the tests that kill,
stop or restart its nodes. Each node keeps its store across a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import nats

from relay_tools.localservers import ThrowawayNats, free_port
from tests.support.relayproc import wait_until
from tests.support.stream import TestStream, run_js


class ClusterNode(ThrowawayNats):
    """One node: a throwaway server with a name and routes to every node."""

    def __init__(self, name: str, cluster_port: int, route_ports: list[int]) -> None:
        routes = ", ".join(f'"nats-route://127.0.0.1:{port}"' for port in route_ports)
        super().__init__(
            extra_config=(
                f'server_name: "{name}"\n'
                f'cluster {{\n  name: "outbox-relay-test"\n'
                f'  listen: "127.0.0.1:{cluster_port}"\n  routes: [{routes}]\n}}\n'
            )
        )
        self.name = name


class ThrowawayCluster:
    """Three JetStream nodes routed to each other, every port on loopback."""

    def __init__(self, size: int = 3) -> None:
        cluster_ports = [free_port() for _ in range(size)]
        self.nodes = [
            ClusterNode(f"n{index + 1}", port, cluster_ports)
            for index, port in enumerate(cluster_ports)
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated, as the relay takes them."""
        return ",".join(self.urls)

    def r3_stream(self, **settings: object) -> TestStream:
        """A test stream with a replica on every node, once the cluster can make one
        (a new cluster elects its meta leader first); ``settings``: more of its
        configuration (the batch publishing it allows)."""

        def attempt() -> TestStream | None:
            try:
                return TestStream(self.url, num_replicas=3, **settings)
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
        for each in [node] if node is not None else self.nodes:
            each.start()

    def destroy(self) -> None:
        for node in self.nodes:
            node.destroy()


@contextlib.contextmanager
def throwaway_cluster() -> Iterator[ThrowawayCluster]:
    cluster = ThrowawayCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()
