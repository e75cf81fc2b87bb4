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
  -- row of this subject wait?" through this index. Producers insert rows with
  -- relay_retry_at null, so their inserts never touch it.
  if to_regclass({backoff_idx_name}) is null then
    create index {backoff_idx}
      on {table} (subject, created_at, id)
      where published_at is null and relay_retry_at is not null;
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
