"""outbox-relay: committed outbox rows to NATS JetStream, woken by LISTEN/NOTIFY."""

# trio_asyncio must be imported before psycopg and nats, or psycopg's async
# API fails with "no running event loop". Importing it here, first, makes the
# order hold for every module of the package and for anything importing it.
import trio_asyncio  # noqa: F401  # isort: skip

__version__ = "0.1.0"
