from relay_tools import exposition

PAGE = """\
# HELP outbox_relay_held_rows_total Rows claimed and held back for order.
# TYPE outbox_relay_held_rows_total counter
outbox_relay_held_rows_total 12.0
outbox_relay_held_rows_created 1.7e+09
outbox_relay_published_total{event_type="a.b"} 3.0
outbox_relay_published_total{event_type="a c"} 4.0
outbox_relay_published_totals 100.0
"""


def test_samples_are_read_by_name_and_labels_and_summed_by_name():
    found = exposition.samples(PAGE)
    assert found['outbox_relay_published_total{event_type="a c"}'] == 4.0
    assert found["outbox_relay_held_rows_created"] == 1.7e9
    assert exposition.total(found, "outbox_relay_published_total") == 7.0
    assert exposition.total(found, "outbox_relay_held_rows_total") == 12.0
    assert exposition.total(found, "outbox_relay_missing_total") == 0.0
