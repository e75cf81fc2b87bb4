-- State the relay owns. Both columns are nullable and have no default, so adding
-- them is a catalog-only change: no table rewrite, no cost to producers' inserts.
--
-- relay_retry_at: a failed row is not retried before this time. Keeping it in the
-- table makes backoff hold across relay restarts and across replicas.
-- relay_last_error: why the last publish failed, for `outbox-relay status` and
-- for whoever is paged about a dead row.
--
-- Every change is made only when missing (checked in the catalog first), so an
-- install on an installed table takes no lock on it: "alter table ... add column
-- if not exists" takes an ACCESS EXCLUSIVE lock even when the column is there.
do $$
begin
  if not exists (select 1 from pg_attribute
                  where attrelid = {table_name}::regclass and attname = 'relay_retry_at'
                    and not attisdropped) then
    alter table {table} add column relay_retry_at timestamptz null;
  end if;
  if not exists (select 1 from pg_attribute
                  where attrelid = {table_name}::regclass and attname = 'relay_last_error'
                    and not attisdropped) then
    alter table {table} add column relay_last_error text null;
  end if;

  -- Rows waiting out a backoff, by subject: the claim query asks "does an earlier
  -- row of this subject wait?" through this index, once per row it considers.
  -- Producers insert rows with relay_retry_at null, so their inserts never touch it.
  -- Its predicate is relay_retry_at alone (the relay clears it when it marks a row
  -- published), so the claim's question can be answered by this index and by no
  -- other: an index with "published_at is null" in its predicate, like the
  -- unpublished index, would let a planner misled by stale statistics rescan the
  -- whole backlog for every row it considers (seen here: a claim over a 50,000-row
  -- burst on a table last analyzed while drained ran past the statement timeout).
  if to_regclass({retry_idx_name}) is null then
    create index {retry_idx}
      on {table} (subject, created_at, id)
      where relay_retry_at is not null;
  end if;

  -- Installs before this index had one with "published_at is null and
  -- relay_retry_at is not null": the claim no longer uses it, and it would only
  -- cost the relay's marks. Dropping it locks the table briefly, once.
  if to_regclass({old_backoff_idx_name}) is not null then
    drop index {old_backoff_idx_qualified};
  end if;

  -- Spent rows by age, for retention. Producers insert rows with published_at
  -- null, so their inserts never touch it either; only the relay's mark does.
  if to_regclass({published_idx_name}) is null then
    create index {published_idx}
      on {table} (published_at)
      where published_at is not null;
  end if;
end
$$;
