"""Event data checked against its JSON Schema: `--schemas DIR` holds one
`<event_type>.schema.json` per event type, the layout of the contract's
`schemas/events/`.

Validation is jsonschema-rs (drafts 4, 6, 7, 2019-09 and 2020-12, chosen by each
schema's `$schema`, 2020-12 without one; `format` is asserted, not only
annotated). A schema may `$ref` another file of the folder by its `$id`; nothing is
fetched from the network. A row whose data fails its schema is the row's fault: it
goes dead at once with the reason (relay/model.py `INVALID_DATA`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema_rs

from relay.errors import SetupError
from relay.jsontext import UnreadableJson, parse_json

log = logging.getLogger(__name__)

SCHEMA_SUFFIX = ".schema.json"
# relay_last_error has room for more, but a reason is read by people.
REASON_LIMIT = 300


def _pointer(path: list[str | int]) -> str:
    """An instance path as a JSON Pointer (RFC 6901)."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in path)


def _reason(error: Any) -> str:
    pointer = _pointer(list(error.instance_path)) or "(the data)"
    reason = f"schema: {pointer}: {error.message}"
    return reason if len(reason) <= REASON_LIMIT else reason[: REASON_LIMIT - 3] + "..."


@dataclass(frozen=True)
class Schemas:
    """Every event type's compiled schema, from one folder."""

    directory: str
    validators: Mapping[str, Any]  # event type -> jsonschema_rs validator
    required: bool = False  # a type without a schema is invalid, not unchecked

    @classmethod
    def load(cls, directory: str, *, required: bool = False) -> Schemas:
        """Read and compile every schema of ``directory``; a file that is not JSON,
        or not a valid schema, raises SetupError naming it."""
        folder = Path(directory)
        if not folder.is_dir():
            raise SetupError(f"--schemas: {directory} is not a directory")
        documents: dict[str, Any] = {}
        for path in sorted(folder.glob("*" + SCHEMA_SUFFIX)):
            try:
                documents[path.name[: -len(SCHEMA_SUFFIX)]] = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
                reason = exc if str(exc) else exc.__class__.__name__
                raise SetupError(
                    f"--schemas: {path.name}: not readable as JSON: {reason}"
                ) from None
        try:
            registry = _registry(documents)
        except (jsonschema_rs.ReferencingError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0]
            raise SetupError(f"--schemas: a schema's $id cannot be used: {first}") from None
        validators: dict[str, Any] = {}
        for event_type, schema in documents.items():
            try:
                validators[event_type] = jsonschema_rs.validator_for(
                    schema, validate_formats=True, registry=registry, retriever=_never_fetch
                )
            except (
                jsonschema_rs.ValidationError,
                jsonschema_rs.ReferencingError,
                ValueError,
            ) as exc:
                first = str(exc).strip().splitlines()[0]
                raise SetupError(f"--schemas: {event_type}{SCHEMA_SUFFIX}: {first}") from None
        return cls(directory, validators, required)

    def problem(self, event_type: str, data: Any) -> str | None:
        """Why ``data`` (parsed) is not valid for ``event_type``, or None. A type
        with no schema is valid unless schemas are required."""
        validator = self.validators.get(event_type)
        if validator is None:
            if self.required:
                return (
                    f"schema: no {event_type}{SCHEMA_SUFFIX} in {self.directory} "
                    "(--schemas-required)"
                )
            return None
        try:
            if validator.is_valid(data):
                return None
            return _reason(next(iter(validator.iter_errors(data))))
        except (ValueError, RecursionError) as exc:  # what the validator cannot take in
            return f"schema: the data cannot be checked: {str(exc)[:200]}"

    def text_problem(self, event_type: str, text: str) -> str | None:
        """:meth:`problem` for data as jsonb renders it (the claim's and `validate`'s
        text): data that cannot be read is invalid too, with the reason."""
        if event_type not in self.validators:
            return self.problem(event_type, None)  # no schema: the data is not read
        try:
            data = parse_json(text)
        except UnreadableJson as exc:
            return f"schema: the data {exc}"
        return self.problem(event_type, data)

    def covers(self, event_type: str) -> bool:
        return event_type in self.validators


def _never_fetch(uri: str) -> Any:
    raise ValueError(f"{uri} is not in the folder (schemas are never fetched)")


def _registry(documents: Mapping[str, Any]) -> Any:
    """The folder's schemas by their `$id`, for a `$ref` from one to another."""
    resources = [
        (schema["$id"], schema)
        for schema in documents.values()
        if isinstance(schema, dict) and isinstance(schema.get("$id"), str)
    ]
    return jsonschema_rs.Registry(resources, retriever=_never_fetch) if resources else None


class SchemaCheck:
    """The schemas in force for the relay's batches (reread on SIGHUP), and the
    counts of what the check did."""

    def __init__(
        self,
        schemas: Schemas | None,
        on_rejected: Callable[[str], None] = lambda event_type: None,
        on_unchecked: Callable[[str], None] = lambda event_type: None,
    ) -> None:
        self.schemas = schemas
        self._on_rejected = on_rejected
        self._on_unchecked = on_unchecked

    def problem(self, event_type: str, data_text: str) -> str | None:
        """Why a claimed row's data (JSON text, as the claim renders it) is invalid."""
        schemas = self.schemas
        if schemas is None:
            return None
        if not schemas.covers(event_type) and not schemas.required:
            self._on_unchecked(event_type)
            return None
        problem = schemas.text_problem(event_type, data_text)
        if problem is not None:
            self._on_rejected(event_type)
        return problem

    def reload(self) -> bool:
        """Read the folder again; a bad schema is logged and the old set kept."""
        old = self.schemas
        if old is None:
            return False
        try:
            self.schemas = Schemas.load(old.directory, required=old.required)
        except SetupError as exc:
            log.error("schemas not reloaded, the old set stays in force: %s", exc)
            return False
        log.info(
            "schemas reloaded from %s: %d event types", old.directory, len(self.schemas.validators)
        )
        return True
