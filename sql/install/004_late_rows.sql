-- Rows inserted long after their transaction began, flagged so that a claim finds
-- them.
--
-- A claim walks the claim index from a start key, not from its first entry (see
-- the claim in sql/queries.sql): while something holds the MVCC horizon back, the
-- entries before the live rows are dead ones no vacuum may remove yet, and walking
-- them cost every claim more the longer the horizon was held. The start key is no
-- later than the earliest created_at a row committing now can have, on the
-- assumption that a row is inserted within {late_insert} of its created_at, which
-- is now(), the transaction's start, by default. A transaction that read for a
-- while before it wrote breaks that: relay_late's default flags its rows, and the
-- claim starts at the earliest flagged row that is still live. A default, like
-- relay_seq's, costs an insert next to nothing; a row trigger with a WHEN test cost
-- producers 7% of their commits (docs/performance.md). A created_at given
-- explicitly and older than its transaction (a backfill) is not flagged: the
-- relay's sweep finds such a row within a minute (README: When something holds the
-- vacuum horizon).
--
-- Set only when missing (checked in the catalog first: no lock otherwise); it
-- applies to new rows only, no rewrite.
do $$
begin
  if not exists (select 1 from pg_attrdef d
                   join pg_attribute a on a.attrelid = d.adrelid and a.attnum = d.adnum
                  where d.adrelid = {table_name}::regclass and a.attname = 'relay_late') then
    alter table {table} alter column relay_late
      set default (case when now() < clock_timestamp() - {late_insert} then true end);
  end if;

  -- The live late rows, in claim order: few, so the claim's look at them is cheap.
  if to_regclass({late_idx_name}) is null then
    create index {late_idx}
      on {table} (created_at, relay_seq)
      where relay_late and coalesce(published_at, relay_dead_at) is null;
  end if;
end
$$;
