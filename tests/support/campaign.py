"""A fault campaign: producers commit domain rows and events concurrently, with
per-subject sequence numbers, while a test injects faults; afterwards the stream
is read back and checked against the producers' record and the table."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field

import psycopg

from relay import backlog
from relay.config import Config
from tests.support import database
from tests.support.checker import Committed, RowState, Stored, Verdict, check
from tests.support.relayproc import RelayProcess, wait_until
from tests.support.stream import TestStream

MAX_ATTEMPTS = 8
# Fast retries, so a campaign drains in seconds after its faults.
FAST = {
    "backoff_base": "50ms",
    "backoff_max": "500ms",
    "max_attempts": MAX_ATTEMPTS,
    "publish_timeout": "1s",
    "poll_interval": "200ms",
}

DOMAIN = """
create table if not exists campaign_domain (
  entity text not null, seq int not null, primary key (entity, seq))
"""

# Rows that can never be published, and odd but valid ones that must be.
POISON_TYPES = ["bad subject", "x.*", "a..b", ".lead", "", "$SYS.nope"]
# Kinds of odd row the poison mix writes that are valid, and so must be published:
# "late_stream" rows have an event type no stream captures until the test extends
# the stream's subjects (capture_late_subjects); until then they wait.
GOOD_KINDS = ("odd", "big_ok", "late_stream")

# Ways a producer writes that Postgres accepts and the start key's model does not
# assume (issue 39), drawn per transaction. Each keeps a subject's
# created_at rising with its sequence (the producer owns its subjects and commits
# them one at a time), so any reordering the checker sees is the relay's. A share of
# the transactions (hostile_rate) is drawn this way, the rest are plain.
HOSTILE_KINDS = (
    "plain",
    "pause_before",  # reads for a while first: created_at (now()) is old at the insert
    "pause_after",  # commits long after its insert: the snapshot's xmin must hold
    "old_created_at",  # an explicit created_at in the past (after the subject's last)
    "replica",  # session_replication_role = replica: ordinary triggers do not fire
    "null_seq",  # an explicit null relay_seq
    "service_wait",  # a service's BEFORE trigger sorting after the relay's waits
)
HOSTILE_PAUSE = 1.5

# The service's own trigger: sorts after the relay's, and waits as long as the row
# asks (a lock, a lookup).
SERVICE_TRIGGER = """
create or replace function zzz_campaign_lookup() returns trigger language plpgsql as $$
begin
  perform pg_sleep(coalesce((new.data->>'wait')::float8, 0));
  return new;
end $$;
drop trigger if exists zzz_campaign_lookup on outbox_events;
create trigger zzz_campaign_lookup before insert on outbox_events
  for each row when (new.data ? 'wait') execute function zzz_campaign_lookup();
"""


@dataclass
class Producer:
    index: int
    subjects: list[str]
    seq: dict[str, int] = field(default_factory=dict)
    # Each subject's last created_at, as exact text: an explicit one goes after it.
    created_at: dict[str, str] = field(default_factory=dict)


class Campaign:
    def __init__(
        self,
        db_url: str,
        stream: TestStream,
        *,
        producers: int = 4,
        subjects_per_producer: int = 10,
        rollback_rate: float = 0.05,
        poison_rate: float = 0.0,
        pause: float = 0.002,
        hostile_rate: float = 0.0,
    ) -> None:
        self.db_url = db_url
        self.stream = stream
        self.event_type = stream.subject("entity.updated")
        self.rollback_rate = rollback_rate
        self.poison_rate = poison_rate
        self.pause = pause
        self.hostile_rate = hostile_rate
        # Published rows an operator put back by hand (published_at set to null).
        self.put_back: list[str] = []
        # Committed rows by the hostile kind of their write.
        self.kinds: Counter[str] = Counter()
        self.committed: list[Committed] = []
        self.in_doubt: dict[str, Committed] = {}
        self.rolled_back: set[str] = set()
        # Ids of rows written to be unpublishable, and of odd rows that must publish.
        self.poison: set[str] = set()
        self.odd: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._operator_stop = threading.Event()
        self.operator_errors: list[str] = []
        self.late_event_type = f"{stream.prefix}_late.updated"
        self.late_captured = False
        self._producers = [
            Producer(i, [f"entity-{i}-{k}" for k in range(subjects_per_producer)])
            for i in range(producers)
        ]
        self._threads: list[threading.Thread] = []
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(DOMAIN)
            if hostile_rate:
                conn.execute(SERVICE_TRIGGER)

    # -- producing ---------------------------------------------------------------

    def start(self) -> Campaign:
        for producer in self._producers:
            thread = threading.Thread(target=self._produce, args=(producer,), daemon=True)
            thread.start()
            self._threads.append(thread)
        if self.poison_rate or self.hostile_rate:
            self._operator = threading.Thread(target=self._operate, daemon=True)
            self._operator.start()
        return self

    def stop(self) -> None:
        """Stop the producers. The operator goes on until :meth:`close`."""
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def close(self) -> None:
        self.stop()
        self._operator_stop.set()
        if hasattr(self, "_operator"):
            self._operator.join(30)

    def capture_late_subjects(self) -> None:
        """The operator adds the late event type to the stream's subjects, as one does
        who deployed a new event type before extending the stream."""
        if not self.late_captured:

            def update() -> bool:
                try:
                    self.stream.update(
                        self.stream.name,
                        subjects=[f"{self.stream.prefix}.>", f"{self.late_event_type}"],
                    )
                except Exception:  # noqa: BLE001 - a cluster back from an outage may not answer yet
                    return False
                return True

            wait_until(update, timeout=60, message="the stream extended to the late subject")
            self.late_captured = True

    def _operate(self) -> None:
        """The on-call operator: soon after the relay finds a poison row dead (and its
        subject held behind it), gives up on it with `skip`, so the rows behind it go.
        Only poison rows: a good row found dead stays dead, for the checker to see."""
        while not self._operator_stop.wait(0.3):
            try:
                self.skip_dead_poison()
                if self.hostile_rate and not self._stop.is_set():
                    self.put_one_back()
            except psycopg.Error:
                continue  # the database is down for a fault: try again
            except Exception as exc:  # noqa: BLE001 - kept for the drain's report
                # Anything else would end the thread silently, and the poison rows
                # found dead from then on would hold their subjects for good.
                self.operator_errors.append(repr(exc))

    def skip_dead_poison(self) -> int:
        with psycopg.connect(self.db_url, connect_timeout=3) as conn:
            rows = conn.execute(
                "select id::text from outbox_events where published_at is null "
                "and relay_dead_at is not null and relay_skipped_at is null"
            ).fetchall()
        with self._lock:
            ids = [uuid.UUID(row_id) for (row_id,) in rows if row_id in self.poison]
        if not ids:
            return 0
        return backlog.skip(self.db_url, Config(), ids=ids, execute=True).skipped

    def put_one_back(self) -> None:
        """As an operator with an older CLI did: a published row set unpublished again
        by hand, to be published again (with its id: the stream drops the copy inside
        its duplicate window, consumers after it)."""
        with psycopg.connect(self.db_url, connect_timeout=3, autocommit=True) as conn:
            row = conn.execute(
                "update outbox_events set published_at = null where id = (select id "
                "from outbox_events where published_at is not null and event_type = %s "
                "order by random() limit 1) returning id::text",
                (self.event_type,),
            ).fetchone()
        if row is not None:
            with self._lock:
                self.put_back.append(row[0])

    def record(self, event: Committed) -> None:
        """An event a test committed itself, beside the producers."""
        with self._lock:
            self.committed.append(event)

    def wait_for(self, events: int, timeout: float = 60.0) -> None:
        wait_until(
            lambda: len(self.committed) >= events,
            timeout,
            interval=0.05,
            message=f"{events} committed events",
        )

    def _produce(self, producer: Producer) -> None:
        rng = random.Random(producer.index)
        conn: psycopg.Connection | None = None
        while not self._stop.is_set():
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.db_url, connect_timeout=3)
                self._one_transaction(conn, producer, rng)
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                time.sleep(0.05)
            time.sleep(rng.uniform(0, self.pause))
        if conn is not None:
            conn.close()

    def _one_transaction(
        self, conn: psycopg.Connection, producer: Producer, rng: random.Random
    ) -> None:
        subject = rng.choice(producer.subjects)
        seq = producer.seq.get(subject, 0) + 1
        event_id = str(uuid.uuid4())
        event_type, data, source = self.event_type, {"subject": subject, "seq": seq}, "campaign"
        if rng.random() < self.poison_rate:
            kind, event_type, data, source = self._poison_row(rng, subject, seq)
            # Recorded before the commit: an in-doubt commit may still have happened.
            with self._lock:
                (self.odd if kind in GOOD_KINDS else self.poison).add(event_id)
        rollback = rng.random() < self.rollback_rate
        hostile = rng.choice(HOSTILE_KINDS) if rng.random() < self.hostile_rate else "plain"
        created_at = "clock_timestamp()"
        if hostile == "pause_before":
            conn.execute("select 1")  # the transaction begins: now() is taken
            time.sleep(rng.uniform(0, HOSTILE_PAUSE))
            created_at = "now()"
        elif hostile == "old_created_at":
            created_at = (
                "greatest(coalesce(%(last)s::timestamptz, '-infinity') + interval '1 us', "
                "clock_timestamp() - make_interval(secs => %(back)s))"
            )
        elif hostile == "replica":
            conn.execute("set local session_replication_role = replica")
        elif hostile == "service_wait":
            # Past the late-insert slack: a row whose xid came after the relay's clock
            # test would sit behind the start key.
            data = {**data, "wait": round(rng.uniform(0.5, 2.5), 3)}
        domain = (
            "insert into campaign_domain (entity, seq) values (%s, %s)",
            (f"{subject}/{event_id}", seq),
        )
        if hostile != "service_wait":
            conn.execute(*domain)
        row = conn.execute(
            "insert into outbox_events (id, event_type, source, subject, time, data, created_at"
            + (", relay_seq" if hostile in ("null_seq", "replica") else "")
            + ") values (%(id)s, %(type)s, %(source)s, %(subject)s, now(), %(data)s, "
            + created_at
            + (", null" if hostile in ("null_seq", "replica") else "")
            + ") returning created_at::text",
            {
                "id": event_id, "type": event_type, "source": source, "subject": subject,
                "data": json.dumps(data), "last": producer.created_at.get(subject),
                "back": rng.uniform(0, 5),
            },
        ).fetchone()  # fmt: skip
        if hostile == "service_wait":
            # The outbox row is the transaction's first write: its xid is taken there.
            conn.execute(*domain)
        if hostile == "pause_after":
            time.sleep(rng.uniform(0, HOSTILE_PAUSE))
        event = Committed(event_id, subject, seq)
        if rollback:
            conn.rollback()
            with self._lock:
                self.rolled_back.add(event_id)
            return
        producer.seq[subject] = seq  # a gap after an in-doubt commit is harmless
        if row is not None:
            producer.created_at[subject] = row[0]
        try:
            conn.commit()
        except psycopg.Error:
            with self._lock:
                self.in_doubt[event_id] = event  # resolved against the table later
            raise
        with self._lock:
            self.committed.append(event)
            self.kinds[hostile] += 1

    def _poison_row(self, rng: random.Random, subject: str, seq: int) -> tuple[str, str, dict, str]:
        """(kind, event_type, data, source) of a row that can never be published, or
        of an odd one that must be (``GOOD_KINDS``)."""
        kind = rng.choice(["invalid", "too_large", *GOOD_KINDS])
        data: dict = {"subject": subject, "seq": seq}
        if kind == "invalid":
            return kind, rng.choice(POISON_TYPES), data, "campaign"
        if kind == "too_large":
            return kind, self.event_type, {**data, "blob": "x" * (1024 * 1024 + 10)}, "campaign"
        if kind == "late_stream":
            return kind, self.late_event_type, data, "campaign"
        if kind == "odd":
            # Unicode and odd (NUL-free) strings in every text column.
            odd = {**data, "text": "żółć 🚀 \\\" ' \t \u202e"}
            return kind, self.event_type, odd, 'sørce ✓ "q"'
        big = {**data, "blob": "y" * rng.choice([7_999, 100_000])}
        return kind, self.event_type, big, "campaign"

    # -- checking ----------------------------------------------------------------

    def table(self) -> dict[str, RowState]:
        with psycopg.connect(self.db_url) as conn:
            rows = conn.execute(
                "select id::text, published_at is not null, attempts, relay_dead_at is not null, "
                "relay_skipped_at is not null from outbox_events"
            ).fetchall()
        return {row_id: RowState(*state) for row_id, *state in rows}

    def drain(self, max_attempts: int, stall: float = 90.0, limit: float = 900.0) -> int:
        """Until every row is published or given up on (dead, or skipped by the
        operator: each poison row is, and its subject's later rows then go); the
        number of rows that were left when it began.

        Fails when no row has been finished for ``stall`` seconds: a campaign checks
        that the relays keep going, not how fast (a backlog of 100,000 rows on a
        busy CI machine may take minutes). ``limit`` bounds the whole wait."""
        left_at_start = best = self.rows_left(max_attempts)
        started = last_progress = time.monotonic()
        while best:
            time.sleep(0.2)
            left = self.rows_left(max_attempts)
            now = time.monotonic()
            if left < best:
                best, last_progress = left, now
            if now - last_progress > stall or now - started > limit:
                raise AssertionError(
                    f"the drain stopped: {left} of {left_at_start} rows left, none finished "
                    f"in the last {now - last_progress:.0f} s ({now - started:.0f} s in all)\n"
                    f"{self.what_holds_the_drain()}"
                )
        return left_at_start

    def rows_left(self, max_attempts: int) -> int:
        """Rows neither published nor given up on: what a drain waits for."""
        with psycopg.connect(self.db_url) as conn:
            row = conn.execute(
                "select count(*) from outbox_events where published_at is null "
                "and relay_dead_at is null and relay_skipped_at is null and attempts < %s",
                (max_attempts,),
            ).fetchone()
        assert row is not None
        return int(row[0])

    def what_holds_the_drain(self) -> str:
        """For a drain that never ends: the first unpublished row of each subject that
        still has live rows (what every later row of it waits behind), and whether
        it was written as poison."""
        with psycopg.connect(self.db_url) as conn:
            heads = conn.execute(
                "select distinct on (subject) subject, id::text, event_type, attempts, "
                "relay_dead_at is not null, relay_skipped_at is not null, "
                "relay_retry_at::text, relay_last_error from outbox_events "
                "where published_at is null and relay_skipped_at is null "
                "and subject in (select subject from outbox_events where published_at is null "
                "and relay_dead_at is null) order by subject, created_at, relay_seq"
            ).fetchall()
        with self._lock:
            poison = set(self.poison)
        lines = [
            f"  {subject}: first row {row_id} ({event_type!r}, attempts {attempts}, "
            f"dead {dead}, skipped {skipped}, retry at {retry}, poison {row_id in poison}): "
            f"{error}"
            for subject, row_id, event_type, attempts, dead, skipped, retry, error in heads[:20]
        ]
        errors = f"\nthe operator thread's errors: {self.operator_errors[-5:]}"
        return (
            f"{len(heads)} subjects hold live rows:\n"
            + "\n".join(lines)
            + (errors if self.operator_errors else "")
            + "\n"
            + self.open_transactions()
        )

    def open_transactions(self) -> str:
        """The sessions in a transaction now, oldest first: a batch's transaction that
        outlived its relay holds its rows locked, and every claim skips them."""
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            sessions = conn.execute(
                "select pid, application_name, state, wait_event_type, wait_event, "
                "round(extract(epoch from now() - xact_start)::numeric, 1), "
                "client_port, left(query, 100) from pg_stat_activity "
                "where xact_start is not null and pid <> pg_backend_pid() "
                "order by xact_start"
            ).fetchall()
        return "sessions in a transaction: " + (
            "none"
            if not sessions
            else "".join(
                f"\n  pid {pid} {app!r} {state} waiting on {wtype}/{wevent}, "
                f"in a transaction for {age} s, client port {port}: {q!r}"
                for pid, app, state, wtype, wevent, age, port, q in sessions
            )
        )

    def verdict(self, max_attempts: int) -> Verdict:
        table = self.table()
        committed = list(self.committed)
        # A commit that raised may or may not have happened: the table knows.
        committed += [event for row_id, event in self.in_doubt.items() if row_id in table]
        messages = []
        for message in self.stream.read_all():
            envelope = message.envelope
            data = envelope.get("data") or {}
            messages.append(
                Stored(
                    message.msg_id, str(data.get("subject", envelope["subject"])),
                    int(data.get("seq", 0)), str(envelope.get("id")),
                )
            )  # fmt: skip
        return check(committed, table, messages, max_attempts=max_attempts, poison=self.poison)


def finish(
    campaign: Campaign, *relays: RelayProcess, title: str = "campaign", drain_stall: float = 90.0
) -> Verdict:
    """Stop the producers, let the relays come back to ready, drain, check, and show
    the counts. A campaign without poison rows ends with no dead row at all; with
    them, exactly the poison rows are dead."""
    campaign.stop()
    campaign.capture_late_subjects()
    for relay in relays:
        assert relay.process is not None
        assert relay.process.poll() is None, (
            f"the relay should still be serving; it exited with {relay.process.returncode}, "
            f"its log ends:\n{relay.logs()[-4000:]}"
        )
        wait_until(relay.ready, timeout=60, message="every relay ready again")
    started = time.monotonic()
    try:
        left = campaign.drain(MAX_ATTEMPTS, stall=drain_stall)
    except AssertionError as exc:
        tails = "".join(
            f"\nrelay {n} (pid {relay.process.pid}), its log ends:\n{relay.logs()[-3000:]}"
            for n, relay in enumerate(relays)
            if relay.process is not None
        )
        raise AssertionError(f"{exc}{tails}") from None
    drained = f"drained {left} rows in {time.monotonic() - started:.1f} s"
    verdict = campaign.verdict(MAX_ATTEMPTS)
    print(f"\n{title}: {drained}; {verdict.summary()}")
    assert verdict.ok, verdict.summary() + "\n" + verdict.details()
    assert verdict.committed > 0
    assert verdict.poison_dead == verdict.poison
    if not campaign.poison_rate:
        assert verdict.poison == 0
        assert database.dead_count(campaign.db_url, MAX_ATTEMPTS) == 0
    return verdict
