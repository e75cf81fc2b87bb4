-- Removes what the relay added for waking and bookkeeping speed: the triggers, their
-- functions, the relay's indexes, and relay_seq's default and sequence (so producers
-- pay for nothing of the relay's). Never the table or its rows, and not the relay_*
-- columns either: they hold backoff state and the last error of stuck rows (drop
-- them by hand once no relay runs, if you must). Nor the late rows' keys: relays
-- still running claim through them (and walk from the first entry, the triggers
-- gone); drop that table by hand too once none runs.
drop trigger if exists {notify_trigger} on {table};
drop function if exists {notify_function}();
drop trigger if exists {late_trigger} on {table};
drop trigger if exists {old_late_trigger} on {table};
drop trigger if exists {revive_trigger} on {table};
drop trigger if exists {late_key_added} on {table};
drop trigger if exists {late_key_moved} on {table};
drop trigger if exists {late_key_gone} on {table};
drop function if exists {late_key_function}();
alter table {table} drop constraint if exists {seq_check};
drop function if exists {late_function}();
drop index if exists {late_idx_qualified};
drop index if exists {claim_idx_qualified};
drop index if exists {retry_idx_qualified};
drop index if exists {old_retry_idx_qualified};
drop index if exists {old_backoff_idx_qualified};
drop index if exists {published_idx_qualified};
do $$
begin
  if exists (select 1 from pg_attrdef d
               join pg_attribute a on a.attrelid = d.adrelid and a.attnum = d.adnum
              where d.adrelid = {table_name}::regclass and a.attname = 'relay_seq') then
    alter table {table} alter column relay_seq drop default;
  end if;
end
$$;
drop sequence if exists {seq};
