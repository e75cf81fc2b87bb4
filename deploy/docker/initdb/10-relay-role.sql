-- The relay's runtime role: it logs in, and `outbox-relay install --grant-to
-- outbox_relay` gives it what `run` needs on the outbox table, nothing more.
-- The password matches secrets/relay-database-url: example values for a local
-- trial; use your secret store for anything else.
create role outbox_relay login password 'relay-runtime';
