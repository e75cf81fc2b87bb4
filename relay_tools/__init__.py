"""Tools around the relay, never imported by `outbox-relay run`: throwaway local
servers (:mod:`relay_tools.localservers`), `outbox-relay demo` and
`outbox-relay bench` (with the audit's cost, :mod:`relay_tools.bench.audit_cost`).
They start servers and create and drop databases, so they live apart from the
runtime package (:mod:`relay`)."""
