-- `outbox-relay install --grant-to ROLE`: what a relay running as that role needs,
-- and nothing more. `run` claims (SELECT ... FOR UPDATE), marks (UPDATE) and
-- deletes spent rows (DELETE, retention); `status` reads, `requeue` and `skip`
-- update. The rest needs no grant: LISTEN and pg_notify, advisory locks, reading
-- pg_locks and the catalogs, and maintaining the indexes on the rows it updates. No
-- DDL: the role cannot alter, drop or truncate the table, nor create anything.
-- The role's name reaches the block below as a setting, never as text inside it.
select set_config('outbox_relay.grant_to', {role_name}, false);
do $$
begin
  execute format('grant usage on schema %I to %I',
                 (select n.nspname from pg_class c
                    join pg_namespace n on n.oid = c.relnamespace
                   where c.oid = {table_name}::regclass),
                 current_setting('outbox_relay.grant_to'));
end
$$;
grant select, update, delete on {table} to {role};
-- The late rows' keys: read by every claim, purged by retention.
grant select, delete on {late_keys} to {role};
