"""The relay's decisions, as pure functions: no servers, no clock."""

from __future__ import annotations

import json
import logging
import math
import random
import uuid

import pytest
from nats.aio.msg import Msg

from relay.app import start_failure
from relay.backoff import ReconnectBackoff, row_retry_delay
from relay.config import Config
from relay.envelope import MSG_ID_HEADER, build_message
from relay.errors import ConfigError, SetupError
from relay.inboxes import AckInbox, Wave
from relay.logs import RepeatedWarnings
from relay.marks import BROKER_FAULT_RETRY_MAX, broker_fault_delay, broker_outage, decide_marks
from relay.model import Acked, Failed, FailureReason, OutboxRow
from relay.ordering import (
    SubjectQueues,
    earliest_blockers,
    held_behind_blockers,
    unsettled_subjects,
)
from relay.publishable import size_problem, subject_problem
from relay.replies import PERMISSION_DENIED, denied_subject, parse_ack
from relay.scheduler import (
    LINGER_MAX,
    RATE_FAST,
    RATE_SLOW,
    STANDBY_PAUSE,
    STANDBY_PAUSE_IDLE,
    ClaimRate,
    linger_for,
    sleep_retry_pause,
    standby_pause,
)
from relay.streams import short_duplicate_windows

T0 = 1_767_225_600.0  # created_at, epoch seconds: 2026-01-01T00:00:00Z
NOW = T0 + 600.0  # when the marks are decided
TIME = "2026-01-01T00:00:00.000000Z"  # time, as the claim query renders it


def build(r: OutboxRow):
    assert r.time is not None
    return build_message(r, r.time)


def row(
    subject: str = "s",
    *,
    seconds: float = 0,
    seq: int = 0,
    attempts: int = 0,
    event_type: str = "a.b",
    data: str = "{}",
    created_ago: float | None = None,
) -> OutboxRow:
    return OutboxRow(
        str(uuid.uuid4()),
        event_type,
        "src",
        subject,
        TIME,
        data,
        NOW - created_ago if created_ago is not None else T0 + seconds,
        seq,
        attempts,
    )


class TestRowRetryDelay:
    def test_doubles_from_the_base(self):
        assert [row_retry_delay(n, 1.0, 300.0) for n in range(1, 7)] == [1, 2, 4, 8, 16, 32]

    def test_is_capped(self):
        assert row_retry_delay(9, 1.0, 300.0) == 256
        assert row_retry_delay(10, 1.0, 300.0) == 300
        assert row_retry_delay(10_000, 1.0, 300.0) == 300

    def test_rejects_zero_attempts(self):
        with pytest.raises(ValueError, match="starts at 1"):
            row_retry_delay(0, 1.0, 300.0)


def test_reconnect_backoff_grows_is_capped_and_resets():
    backoff = ReconnectBackoff(initial=0.1, cap=2.0)
    rng = random.Random(7)
    delays = [backoff.next_delay(rng) for _ in range(12)]
    assert all(0.05 <= d <= 2.0 for d in delays)
    assert delays[-1] > 0.9  # near the cap, never above it
    assert delays[0] <= 0.1
    backoff.reset()
    assert backoff.next_delay(rng) <= 0.1


@pytest.mark.parametrize(
    ("subject", "problem"),
    [
        ("billing.invoice.paid", None),
        ("a", None),
        ("ünïcode.ok", None),
        ("a-b_c.d1", None),
        ("", "empty"),
        ("a b", "whitespace"),
        ("a\tb", "whitespace"),
        ("a\nb", "whitespace"),
        ("a\x00b", "control"),
        ("a.*", "wildcard"),
        ("*", "wildcard"),
        ("a.>", "wildcard"),
        (">", "wildcard"),
        ("a..b", "empty token"),
        (".a", "empty token"),
        ("a.", "empty token"),
        ("$JS.API.INFO", "reserved"),
        ("$SYS.x", "reserved"),
    ],
)
def test_subject_grammar(subject, problem):
    found = subject_problem(subject)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def test_size_limit_is_inclusive():
    assert size_problem(1024, 1024) is None
    assert "1025 bytes" in (size_problem(1025, 1024) or "")


class TestDuplicateWindows:
    def test_streams_that_forget_ids_before_a_retry_are_named_in_order(self):
        windows = [("ORDERS", 120.0), ("BILLING", 1200.0), ("AUDIT", 304.999), ("ALL", 305.0)]
        assert short_duplicate_windows(windows, 305.0) == [("AUDIT", 304.999), ("ORDERS", 120.0)]
        assert short_duplicate_windows([], 305.0) == []


class TestEnvelope:
    def test_cloudevents_fields_and_dedupe_header(self):
        r = OutboxRow(
            str(uuid.uuid4()),
            "billing.paid",
            "billing",
            "invoice/1",
            "2026-03-04T05:06:07.890000Z",
            '{"b": [1, 2], "a": "ü"}',
            T0,
            1,
            0,
        )
        message = build(r)
        assert message.subject == "billing.paid"
        assert message.headers == {MSG_ID_HEADER: str(r.id)}
        assert json.loads(message.body) == {
            "specversion": "1.0",
            "id": str(r.id),
            "type": "billing.paid",
            "source": "billing",
            "subject": "invoice/1",
            "time": "2026-03-04T05:06:07.890000Z",
            "datacontenttype": "application/json",
            "data": {"b": [1, 2], "a": "ü"},
        }

    @pytest.mark.parametrize(
        "text", ['quote " back \\ slash', "tab\tnewline\ncontrol\x01", "ünï 😀 \u2028", ""]
    )
    def test_odd_text_columns_are_escaped(self, text):
        r = OutboxRow(str(uuid.uuid4()), text, text, text, TIME, "{}", T0, 1, 0)
        body = json.loads(build(r).body)
        assert (body["type"], body["source"], body["subject"]) == (text, text, text)

    @pytest.mark.parametrize(
        "data", ["null", "3", '"text"', "[]", '{"k": "\\u0000 odd \\" quote"}']
    )
    def test_any_json_value_splices_into_valid_json(self, data):
        body = json.loads(build(row(data=data)).body)
        assert body["data"] == json.loads(data)

    def test_wire_size_counts_headers_and_body(self):
        message = build(row())
        header_block = (
            b"NATS/1.0\r\n"
            + f"{MSG_ID_HEADER}: {message.headers[MSG_ID_HEADER]}\r\n".encode()
            + b"\r\n"
        )
        assert message.wire_size == len(header_block) + len(message.body)


class TestOrdering:
    def test_rows_behind_an_outside_blocker_are_held(self):
        a1, a2, b1 = row("a", seconds=1), row("a", seconds=3), row("b", seconds=2)
        blockers = {"a": (T0 + 2, 0, str(uuid.UUID(int=0)))}
        assert held_behind_blockers([a1, a2, b1], blockers) == {a2.id}

    def test_ties_on_created_at_are_broken_by_insertion_order_not_id(self):
        low, high = str(uuid.UUID(int=1)), str(uuid.UUID(int=2))
        first = OutboxRow(high, "t", "s", "a", TIME, "{}", T0, 7, 0)
        second = OutboxRow(low, "t", "s", "a", TIME, "{}", T0, 8, 0)
        assert held_behind_blockers([second], {"a": first.order_key}) == {low}
        assert held_behind_blockers([first], {"a": second.order_key}) == set()
        assert [r.id for r in SubjectQueues([second, first]).next_wave()] == [high]

    def test_ids_as_text_order_as_postgres_orders_uuids(self):
        # Postgres compares uuids byte by byte; the relay compares their text.
        ids = [uuid.UUID(bytes=random.randbytes(16)) for _ in range(2000)]
        ids += [uuid.UUID(int=n) for n in (0, 9, 10, 15, 16, 2**127, 2**128 - 1)]
        assert sorted(ids, key=lambda u: u.bytes) == sorted(ids, key=str)

    def test_earliest_blocker_per_subject_leaves_out_our_own_batches(self):
        ours, theirs, later = str(uuid.UUID(int=1)), str(uuid.UUID(int=2)), str(uuid.UUID(int=3))
        found = [("a", (T0 + 3, 3, later)), ("a", (T0 + 1, 1, ours)), ("a", (T0 + 2, 2, theirs))]
        assert earliest_blockers(found) == {"a": (T0 + 1, 1, ours)}
        assert earliest_blockers(found, {ours}) == {"a": (T0 + 2, 2, theirs)}
        assert earliest_blockers(found, {ours, theirs, later}) == {}

    def test_a_subject_is_settled_only_when_every_row_of_it_was_acked(self):
        # A dead row holds its subject as a waiting one does.
        acked, dead, failed, unsent = row("a"), row("b"), row("c"), row("d")
        also_acked = row("c")
        results = {
            acked.id: Acked(),
            dead.id: Failed(FailureReason.TOO_LARGE, "x"),
            failed.id: Failed(FailureReason.TIMEOUT, "x"),
            also_acked.id: Acked(),
        }
        rows = [acked, dead, failed, also_acked, unsent]
        assert unsettled_subjects(rows, results) == {"b", "c", "d"}

    def test_waves_take_one_row_per_subject_in_order(self):
        a1, a2, a3 = row("a", seconds=1), row("a", seconds=2), row("a", seconds=3)
        b1, c1, c2 = row("b", seconds=1.5), row("c", seconds=0), row("c", seconds=9)
        queues = SubjectQueues([a3, c2, b1, a1, c1, a2])
        waves = []
        while queues:
            waves.append(queues.next_wave())
        assert [set(w) for w in waves] == [{a1, b1, c1}, {a2, c2}, {a3}]

    def test_stopping_a_subject_leaves_its_later_rows_unsent(self):
        a1, a2, a3, b1, b2 = (
            row("a", seconds=1),
            row("a", seconds=2),
            row("a", seconds=3),
            row("b", seconds=1),
            row("b", seconds=2),
        )
        queues = SubjectQueues([a1, a2, a3, b1, b2])
        assert set(queues.next_wave()) == {a1, b1}
        assert queues.stop("a") == [a2, a3]
        assert queues.next_wave() == [b2]
        assert not queues


class TestMarks:
    def decide(self, rows, results, max_attempts=5):
        return decide_marks(
            {r.id: r for r in rows},
            results,
            now=NOW,
            max_attempts=max_attempts,
            backoff_base=1.0,
            backoff_max=60.0,
        )

    def test_acked_rows_are_published_in_one_list(self):
        a, b = row(), row()
        marks = self.decide([a, b], {a.id: Acked(), b.id: Acked(duplicate=True)})
        assert marks.published == [a.id, b.id]
        assert marks.failed == []

    def test_a_row_the_stream_refused_counts_an_attempt_and_backs_off(self):
        r, ok = row(attempts=2), row()
        marks = self.decide([r, ok], {r.id: Failed(FailureReason.REFUSED, "no"), ok.id: Acked()})
        [mark] = marks.failed
        assert (mark.attempts, mark.retry_delay) == (3, 4.0)
        assert mark.error == "refused: no"
        assert marks.newly_dead == []

    @pytest.mark.parametrize("reason", [r for r in FailureReason if r.broker_fault])
    def test_a_broker_fault_beside_an_acked_row_waits_without_an_attempt(self, reason):
        # One stream down, or a subject no stream captures yet, while others take
        # their rows: the row waits (holding its subject), its attempts untouched,
        # even on its last attempt, for as long as the fault lasts.
        r, ok = row(attempts=4, created_ago=120.0), row()
        marks = self.decide([r, ok], {r.id: Failed(reason, "x"), ok.id: Acked()})
        [mark] = marks.failed
        assert (mark.attempts, mark.retry_delay) == (4, 12.0)  # a tenth of its age
        assert [w.id for w, _ in marks.broker_faults] == [r.id]
        assert marks.newly_dead == []
        assert not marks.broker_outage

    def test_the_wait_after_a_broker_fault_grows_with_age_within_bounds(self):
        assert broker_fault_delay(0.0, 1.0, 300.0) == 1.0  # backoff_base at first
        assert broker_fault_delay(50.0, 1.0, 300.0) == 5.0
        assert broker_fault_delay(3600.0, 1.0, 300.0) == BROKER_FAULT_RETRY_MAX
        assert broker_fault_delay(3600.0, 1.0, 2.0) == 2.0  # never past backoff_max
        assert broker_fault_delay(-5.0, 0.5, 2.0) == 0.5  # a created_at in the future

    def test_last_attempt_goes_dead(self):
        r = row(attempts=4)
        marks = self.decide([r], {r.id: Failed(FailureReason.REFUSED, "refused by the stream")})
        [mark] = marks.failed
        assert (mark.attempts, mark.retry_delay) == (5, None)
        assert [dead.id for dead, _ in marks.newly_dead] == [r.id]

    def test_the_relays_own_error_never_counts_against_the_row(self):
        # A bug of the relay's (or nats-py's) on every publish must not walk good rows
        # to the cap: the row waits, as for the broker, with its attempts untouched.
        r = row(attempts=4)
        marks = self.decide([r], {r.id: Failed(FailureReason.RELAY_ERROR, "TypeError: x")})
        [mark] = marks.failed
        assert mark.attempts == 4
        assert mark.retry_delay is not None
        assert not marks.newly_dead
        assert not marks.broker_faults

    @pytest.mark.parametrize(
        "reason",
        [
            r
            for r in FailureReason
            if r.broker_fault
            and r not in (FailureReason.NO_STREAM, FailureReason.PERMISSION_DENIED)
        ],
    )
    def test_a_batch_the_broker_failed_whole_burns_no_attempt(self, reason):
        # Nothing acked, and every failure one no row can cause: the broker's outage.
        # Even a row on its last attempt is left exactly as it was; a row rejected
        # before sending still goes to the cap, for its own reason.
        last, other = row(attempts=4), row()
        bad = row(event_type="a.*")
        results = {
            last.id: Failed(reason, "x"),
            other.id: Failed(reason, "x"),
            bad.id: Failed(FailureReason.INVALID_SUBJECT, "wildcard"),
        }
        assert broker_outage(results)
        marks = self.decide([last, other, bad], results)
        assert marks.broker_outage
        assert [m.id for m in marks.failed] == [bad.id]
        assert [dead.id for dead, _ in marks.newly_dead] == [bad.id]

    def test_one_ack_or_one_refusal_makes_it_the_rows_business(self):
        a, b = row(), row()
        timeout = Failed(FailureReason.TIMEOUT, "slow")
        assert not broker_outage({a.id: timeout, b.id: Acked()})
        assert not broker_outage({a.id: timeout, b.id: Failed(FailureReason.REFUSED, "no")})
        assert not broker_outage({a.id: timeout, b.id: Failed(FailureReason.RELAY_ERROR, "?")})
        assert not broker_outage({a.id: Failed(FailureReason.INVALID_SUBJECT, "x")})
        # JetStream answered which stream captures the subject: none. Not an outage.
        assert not broker_outage({a.id: timeout, b.id: Failed(FailureReason.NO_STREAM, "none")})
        # So did the server that said this user may not publish there.
        denied = Failed(FailureReason.PERMISSION_DENIED, "denied")
        assert not broker_outage({a.id: timeout, b.id: denied})
        assert not broker_outage({})

    @pytest.mark.parametrize("reason", [r for r in FailureReason if r.permanent])
    def test_a_failure_inside_the_row_makes_it_dead_at_once(self, reason):
        r = row()
        marks = self.decide([r], {r.id: Failed(reason, "never")}, max_attempts=20)
        [mark] = marks.failed
        assert (mark.attempts, mark.retry_delay) == (20, None)
        assert len(marks.newly_dead) == 1

    def test_rows_without_a_result_are_untouched(self):
        sent, unsent = row(), row()
        marks = self.decide([sent, unsent], {sent.id: Acked()})
        assert marks.published == [sent.id]
        assert all(m.id != unsent.id for m in marks.failed)

    def test_error_text_is_bounded(self):
        r = row()
        marks = self.decide([r], {r.id: Failed(FailureReason.REFUSED, "x" * 5000)})
        assert len(marks.failed[0].error) == 1000


def test_linger_grows_with_the_rows_found_and_is_capped():
    assert linger_for(0) == 0
    assert linger_for(1) == pytest.approx(0.0002)
    assert linger_for(20) == pytest.approx(0.004)
    assert linger_for(500) == 0.01
    assert linger_for(500, 0.004) == 0.004  # --linger
    assert linger_for(5, 0.004) == pytest.approx(0.001)
    assert Config().linger == LINGER_MAX


def steady(rate: ClaimRate, per_second: float, seconds: float, start: float = 0.0) -> float:
    """Claims of one row each at ``per_second`` for ``seconds``; the time after."""
    now = start
    for _ in range(round(per_second * seconds)):
        now += 1 / per_second
        rate.observe(now, 1)
    return now


def test_the_claim_rate_is_fast_above_the_fast_rate_and_until_below_the_slow_one():
    rate = ClaimRate()
    now = steady(rate, RATE_SLOW * 0.9, 5)
    assert not rate.fast
    now = steady(rate, (RATE_FAST + RATE_SLOW) / 2, 5, now)
    assert not rate.fast  # between the two, from below: still slow
    now = steady(rate, RATE_FAST * 1.1, 5, now)
    assert rate.fast
    now = steady(rate, (RATE_FAST + RATE_SLOW) / 2, 5, now)
    assert rate.fast  # between the two, from above: still fast
    now = steady(rate, RATE_SLOW * 0.9, 5, now)
    assert not rate.fast
    # Batches count by their rows, and a pause with none counts as time gone by.
    assert rate.observe(now + 0.001, 500)
    assert not rate.observe(now + 5, 0)


def test_a_relay_standing_by_claims_often_only_while_rows_wait_for_it():
    # The relay that paces keeps up: what a standby finds is young, and it claims
    # seldom; a row that has waited half a long pause makes it claim often.
    assert standby_pause(0.010) == STANDBY_PAUSE_IDLE
    assert standby_pause(-1.0) == STANDBY_PAUSE_IDLE  # a clock ahead of the server's
    assert standby_pause(STANDBY_PAUSE_IDLE / 2 + 0.001) == STANDBY_PAUSE
    assert standby_pause(math.inf) == STANDBY_PAUSE  # created_at -infinity
    assert STANDBY_PAUSE < STANDBY_PAUSE_IDLE


def test_a_claim_that_finds_nothing_while_rows_come_fast_waits_about_two_rows_worth():
    rate = ClaimRate()
    assert rate.gap() == LINGER_MAX
    steady(rate, 2_000, 5)
    assert rate.gap() == pytest.approx(0.001, rel=0.05)
    steady(rate, 100, 10)
    assert rate.gap() == LINGER_MAX
    assert rate.gap(0.003) == 0.003  # --linger


def test_sleep_retry_pause_starts_at_zero_and_doubles_to_a_cap():
    assert [sleep_retry_pause(n) for n in range(1, 8)] == pytest.approx(
        [0, 0.001, 0.002, 0.004, 0.008, 0.016, 0.02]
    )
    assert sleep_retry_pause(1000) == 0.02


def jetstream_reply(data: bytes, headers: dict[str, str] | None = None) -> Msg:
    return Msg(_client=None, subject="_INBOX.x.1", data=data, headers=headers)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("reply", "reason"),
    [
        # As nats-server 2.9.10 and 2.15.1 send them: a full stream (max_msgs with
        # discard new), and a message over the stream's max_msg_size.
        (b'{"error":{"code":503,"err_code":10077,"description":"maximum messages exceeded"},'
         b'"stream":"S","seq":0}', FailureReason.STREAM_UNAVAILABLE),
        (b'{"error":{"code":400,"err_code":10054,"description":"message size exceeds maximum'
         b' allowed"},"stream":"S","seq":0}', FailureReason.REFUSED),
        # An err_code known as the stream's state, whatever the status; a 5xx or 429
        # status, whatever the err_code.
        (b'{"error":{"code":400,"err_code":10118,"description":"stream is offline"}}',
         FailureReason.STREAM_UNAVAILABLE),
        (b'{"error":{"code":429,"err_code":19998,"description":"too many requests"}}',
         FailureReason.STREAM_UNAVAILABLE),
        # An error code unknown here, with a 400 status: a refusal of the message.
        (b'{"error":{"code":400,"err_code":19999,"description":"new in a later server"}}',
         FailureReason.REFUSED),
        (b'{"error":"a bare string"}', FailureReason.REFUSED),
        (b"not json", FailureReason.RELAY_ERROR),
    ],
)  # fmt: skip
def test_a_jetstream_refusal_is_put_down_to_the_stream_or_the_message(reply, reason):
    result = parse_ack(jetstream_reply(reply))
    assert isinstance(result, Failed)
    assert result.reason is reason


def test_no_responders_is_the_brokers_until_jetstream_says_no_stream_captures_it():
    result = parse_ack(jetstream_reply(b"", {"Status": "503"}))
    assert isinstance(result, Failed)
    assert result.reason is FailureReason.NO_RESPONDERS
    assert result.reason.broker_fault
    assert FailureReason.NO_STREAM.broker_fault
    assert parse_ack(jetstream_reply(b'{"stream":"S","seq":7}')) == Acked()
    assert parse_ack(jetstream_reply(b'{"stream":"S","seq":7,"duplicate":true}')) == Acked(True)


def test_every_reason_is_put_down_to_exactly_one_party():
    # The row's (dead at once), the broker's or the relay's (never counted), or
    # counted refusals.
    for reason in FailureReason:
        parties = [reason.permanent, reason.broker_fault, reason.relay_fault]
        assert sum(parties) <= 1, reason
    counted = {r for r in FailureReason if not (r.permanent or r.broker_fault or r.relay_fault)}
    assert counted == {FailureReason.REFUSED}


def test_a_publish_the_server_denies_settles_at_once_as_the_brokers():
    # nats-py hands the server's -ERR to the error callback; no ack ever comes.
    assert denied_subject('nats: permissions violation for publish to "orders.paid"') == (
        "orders.paid"
    )
    assert denied_subject('nats: Permissions Violation for Publish to "a.b"') == "a.b"
    assert denied_subject('nats: permissions violation for subscription to "_INBOX.x.*"') is None
    assert denied_subject("nats: authorization violation") is None
    inbox, wave = AckInbox("_INBOX.r."), Wave(3)
    tokens = [inbox.expect(wave, i, s) for i, s in enumerate(["a", "denied", "denied"])]
    inbox.deny("denied")
    assert wave.results == [None, PERMISSION_DENIED, PERMISSION_DENIED]
    assert not wave.done.is_set()
    inbox.deny("denied")  # a second -ERR for the same subject: nothing left to settle
    assert wave.pending == 1
    assert tokens[0].startswith("_INBOX.r.")
    assert PERMISSION_DENIED.reason.broker_fault


def test_a_warning_repeated_every_half_second_is_logged_once_a_minute(caplog):
    warnings = RepeatedWarnings(logging.getLogger("test.repeated"), every=60.0)
    with caplog.at_level(logging.WARNING, logger="test.repeated"):
        for tick in range(240):  # two minutes of refused reconnects
            warnings.warn("NATS client error: nats: authorization violation", now=tick * 0.5)
        warnings.warn("another error", now=120.0)
    assert [r.getMessage() for r in caplog.records] == [
        "NATS client error: nats: authorization violation",
        "NATS client error: nats: authorization violation (119 more times in the last 60s)",
        "another error",
    ]


def test_warnings_of_one_kind_that_each_name_a_row_are_logged_once_a_minute(caplog):
    warnings = RepeatedWarnings(logging.getLogger("test.repeated"), every=60.0)
    with caplog.at_level(logging.WARNING, logger="test.repeated"):
        for n in range(100):
            warnings.warn(f"row {n}: traceparent 'x' is not W3C", now=n * 0.5, key="traceparent")
    assert [r.getMessage() for r in caplog.records] == ["row 0: traceparent 'x' is not W3C"]


def test_a_start_failure_found_by_a_task_is_one_line_not_a_traceback():
    setup = SetupError("this nats-py has no _pending write queue")
    assert start_failure(setup) is setup
    assert start_failure(ExceptionGroup("tasks", [setup])) is setup
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [setup])])
    assert start_failure(nested) is setup
    config = ConfigError("--table", "bad")
    assert start_failure(ExceptionGroup("tasks", [config])) is config
    # A bug beside it is a crash, shown whole.
    assert start_failure(ExceptionGroup("tasks", [setup, KeyError("x")])) is None
    assert start_failure(KeyError("x")) is None
