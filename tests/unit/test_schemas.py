"""Event data against its schema (relay/schemas.py): compiling a folder, a valid and
an invalid row, a type without a schema with and without --schemas-required, and a
reload that keeps the old set when the new one is bad."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from relay.errors import SetupError
from relay.schemas import REASON_LIMIT, SchemaCheck, Schemas
from relay.validate import INVALID_LISTED, ValidationReport, check_rows

ORDER = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["amount", "currency"],
    "properties": {
        "amount": {"type": "number", "minimum": 0},
        "currency": {"enum": ["EUR", "USD"]},
        "email": {"type": "string", "format": "email"},
        "lines": {"type": "array", "items": {"$ref": "https://schemas.example/line.json"}},
    },
}
LINE = {"$id": "https://schemas.example/line.json", "type": "object", "required": ["sku"]}
# The order's schema without its $ref, for a folder of one file.
ALONE = {**ORDER, "properties": {k: v for k, v in ORDER["properties"].items() if k != "lines"}}


def folder(tmp_path: Path, **documents: object) -> str:
    for name, document in documents.items():
        text = document if isinstance(document, str) else json.dumps(document)
        (tmp_path / f"{name.replace('_', '.')}.schema.json").write_text(text)
    return str(tmp_path)


@pytest.fixture
def schemas(tmp_path: Path) -> Schemas:
    return Schemas.load(folder(tmp_path, order_created=ORDER, line=LINE))


def test_a_valid_row_passes(schemas):
    assert schemas.problem("order.created", {"amount": 5, "currency": "EUR"}) is None
    lines = {"amount": 5, "currency": "EUR", "lines": [{"sku": "a"}]}
    assert schemas.problem("order.created", lines) is None


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ({"amount": -5, "currency": "EUR"}, "schema: /amount: -5 is less than the minimum of 0"),
        ({"amount": 5, "currency": "GBP"}, 'schema: /currency: "GBP" is not one of "EUR" or "USD"'),
        ({"amount": 5}, 'schema: (the data): "currency" is a required property'),
        (
            {"amount": 5, "currency": "EUR", "email": "nope"},
            'schema: /email: "nope" is not a "email"',
        ),
        # Through a $ref to another file of the folder, by its $id.
        (
            {"amount": 5, "currency": "EUR", "lines": [{}]},
            'schema: /lines/0: "sku" is a required property',
        ),
    ],
)
def test_an_invalid_row_names_the_pointer_and_the_rule(schemas, data, reason):
    assert schemas.problem("order.created", data) == reason


def test_a_long_reason_is_cut(tmp_path):
    loaded = Schemas.load(folder(tmp_path, a_b={"const": "x" * 1000}))
    reason = loaded.problem("a.b", "y")
    assert reason is not None
    assert len(reason) == REASON_LIMIT
    assert reason.endswith("...")


def test_a_type_without_a_schema_is_unchecked_unless_schemas_are_required(tmp_path):
    directory = folder(tmp_path, order_created=ALONE)
    assert Schemas.load(directory).problem("order.shipped", {"anything": 1}) is None
    required = Schemas.load(directory, required=True)
    assert required.problem("order.shipped", {}) == (
        f"schema: no order.shipped.schema.json in {directory} (--schemas-required)"
    )


def test_the_check_counts_rejections_and_unchecked_types(schemas):
    rejected: list[str] = []
    unchecked: list[str] = []
    check = SchemaCheck(schemas, rejected.append, unchecked.append)
    assert check.problem("order.created", '{"amount": 1, "currency": "USD"}') is None
    assert check.problem("order.created", '{"amount": -1, "currency": "USD"}') is not None
    assert check.problem("order.shipped", "{}") is None
    assert (rejected, unchecked) == (["order.created"], ["order.shipped"])
    assert SchemaCheck(None).problem("order.created", "not even parsed") is None


@pytest.mark.parametrize(
    ("document", "error"),
    [
        ("{not json", "order.created.schema.json: not readable as JSON"),
        ({"type": "nonsense"}, "order.created.schema.json: "),
        ({"$ref": "https://elsewhere.example/x.json"}, "schemas are never fetched"),
    ],
)
def test_a_schema_that_does_not_compile_stops_the_start_naming_the_file(tmp_path, document, error):
    with pytest.raises(SetupError, match=r"^--schemas: ") as raised:
        Schemas.load(folder(tmp_path, order_created=document))
    assert error in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_folder_that_is_not_there(tmp_path):
    with pytest.raises(SetupError, match="is not a directory"):
        Schemas.load(str(tmp_path / "missing"))


def test_a_reload_takes_the_new_set_and_keeps_the_old_on_a_bad_one(tmp_path, caplog):
    directory = folder(tmp_path, order_created=ALONE)
    check = SchemaCheck(Schemas.load(directory))
    assert check.problem("order.created", '{"amount": -1, "currency": "EUR"}') is not None
    relaxed = {**ALONE, "properties": {"amount": {"type": "number"}}}
    folder(tmp_path, order_created=relaxed)
    assert check.reload()
    assert check.problem("order.created", '{"amount": -1, "currency": "EUR"}') is None
    folder(tmp_path, order_created="{broken")
    with caplog.at_level(logging.ERROR):
        assert not check.reload()
    assert "the old set stays in force" in caplog.text
    assert check.problem("order.created", '{"amount": -1, "currency": "EUR"}') is None


def test_validate_reports_each_invalid_row_and_the_types_without_a_schema(schemas):
    report = ValidationReport()
    rows = [
        ("id-1", "order.created", '{"amount": 1, "currency": "EUR"}'),
        ("id-2", "order.created", '{"amount": -1, "currency": "EUR"}'),
        ("id-3", "order.shipped", "{}"),
    ]
    check_rows(rows, schemas, report)
    assert report.checked == 3
    assert report.invalid == [
        {
            "id": "id-2",
            "type": "order.created",
            "reason": "schema: /amount: -1 is less than the minimum of 0",
        }
    ]
    assert report.no_schema == {"order.shipped": 1}
    assert json.loads(report.as_json())["no_schema"] == {"order.shipped": 1}
    assert report.summary().endswith(
        "checked 3 rows: 1 invalid, 1 of 1 event types without a schema (order.shipped)\n"
    )


def test_validate_lists_a_bounded_number_of_invalid_rows_and_counts_them_all(schemas):
    report = ValidationReport()
    extra = 5
    rows = [
        (f"id-{n}", "order.created", '{"amount": -1, "currency": "EUR"}')
        for n in range(INVALID_LISTED + extra)
    ]
    check_rows(rows, schemas, report)
    assert report.invalid_count == INVALID_LISTED + extra
    assert len(report.invalid) == INVALID_LISTED
    assert f"... and {extra} more invalid rows" in report.summary()


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        ('{"amount": 1' + "0" * 400 + ', "currency": "EUR"}', None),  # beyond a double: exact
        ("[" * 3000 + "]" * 3000, "schema: the data nested deeper than the relay reads"),
    ],
)
def test_data_no_double_can_hold_is_checked_exactly_and_too_deep_data_is_invalid(
    schemas, data, reason
):
    assert schemas.text_problem("order.created", data) == reason
