"""The streams' publish modes as the broker caches them (relay/streams.py
StreamModesCache): when a batch must wait for a read, when a read goes beside it,
and which reads are taken."""

from relay.streams import STREAM_MODES_RETRY, STREAM_MODES_TTL, StreamModes, StreamModesCache

R1 = [StreamModes("EVENTS", ("orders.>",), allow_batched=True, replicas=1)]
R3 = [StreamModes("EVENTS", ("orders.>",), allow_batched=True, replicas=3)]


def test_until_a_read_is_taken_nothing_is_known_and_the_batch_reads_first():
    cache = StreamModesCache()
    assert cache.must_read_first(0.0)
    assert cache.known() == []
    assert cache.read_done(cache.read_started(), R1, now=1.0)
    assert cache.known() == R1
    assert not cache.must_read_first(1.0)
    assert not cache.may_refresh(1.0 + STREAM_MODES_TTL - 0.1)
    assert cache.may_refresh(1.0 + STREAM_MODES_TTL)


def test_a_read_in_flight_when_a_stream_changed_is_not_taken():
    cache = StreamModesCache()
    cache.read_done(cache.read_started(), R1, now=0.0)
    token = cache.read_started()  # a refresh beside a batch, from before the change
    cache.changed()  # the stream went to three replicas meanwhile
    assert not cache.read_done(token, R1, now=1.0)
    assert cache.stale
    assert cache.known() == []  # per message until a read after the change
    assert cache.must_read_first(1.0)
    assert cache.read_done(cache.read_started(), R3, now=1.5)
    assert cache.known() == R3


def test_a_failed_read_is_tried_again_after_a_pause_and_keeps_what_was_known():
    cache = StreamModesCache()
    cache.read_done(cache.read_started(), R1, now=0.0)
    cache.read_started()
    cache.read_failed(now=STREAM_MODES_TTL)
    assert cache.known() == R1
    assert not cache.may_refresh(STREAM_MODES_TTL + STREAM_MODES_RETRY - 0.1)
    assert cache.may_refresh(STREAM_MODES_TTL + STREAM_MODES_RETRY)


def test_forgetting_reads_again_before_the_next_batch_without_dropping_what_is_known():
    cache = StreamModesCache()
    cache.read_done(cache.read_started(), R1, now=0.0)
    cache.forget()
    assert cache.may_refresh(0.1)
    assert cache.known() == R1
