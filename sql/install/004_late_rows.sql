-- Rows inserted long after their created_at, flagged so that a claim finds them.
--
-- A claim walks the claim index from a start key, not from its first entry (see
-- the claim in sql/queries.sql): while something holds the MVCC horizon back, the
-- entries before the live rows are dead ones no vacuum may remove yet, and walking
-- them cost every claim more the longer the horizon was held. The start key is no
-- later than the earliest created_at a row committing now can have, on the
-- assumption that a row is inserted within {late_insert} of its created_at
-- (now(), the transaction's start, by default). A row inserted later than that (a
-- transaction that read for a while before it wrote, or a created_at given
-- explicitly) is flagged here, and the claim starts at the earliest flagged row
-- that is still live. Other rows pay only for the WHEN test: the function runs
-- only for a late row. (A column default flagging rows inserted long after their
-- transaction began cost producers as much, and missed an old created_at given
-- explicitly: docs/performance.md.)
create or replace function {late_function}() returns trigger
language plpgsql as $$
begin
  new.relay_late := true;
  return new;
end
$$;

do $$
begin
  if not exists (select 1 from pg_trigger
                  where tgrelid = {table_name}::regclass and tgname = {late_trigger_name}
                    and not tgisinternal) then
    create trigger {late_trigger}
      before insert on {table}
      for each row
      when (new.created_at < clock_timestamp() - {late_insert})
      execute function {late_function}();
  end if;

  -- The live late rows, in claim order: few, so the claim's look at them is cheap.
  if to_regclass({late_idx_name}) is null then
    create index {late_idx}
      on {table} (created_at, relay_seq)
      where relay_late and coalesce(published_at, relay_dead_at) is null;
  end if;
end
$$;
