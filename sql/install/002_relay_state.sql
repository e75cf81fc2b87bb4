-- State the relay owns. Both columns are nullable and have no default, so adding
-- them is a catalog-only change: no table rewrite, no cost to producers' inserts.
--
-- relay_retry_at: a failed row is not retried before this time. Keeping it in the
-- table makes backoff hold across relay restarts and across replicas.
-- relay_last_error: why the last publish failed, for `outbox-relay status` and
-- for whoever is paged about a dead row.
alter table {table} add column if not exists relay_retry_at timestamptz null;
alter table {table} add column if not exists relay_last_error text null;

-- Rows waiting out a backoff, by subject: the claim query asks "does an earlier
-- row of this subject wait?" through this index. Producers insert rows with
-- relay_retry_at null, so their inserts never touch it.
create index if not exists {backoff_idx}
  on {table} (subject, created_at, id)
  where published_at is null and relay_retry_at is not null;

-- Spent rows by age, for retention. Producers insert rows with published_at null,
-- so their inserts never touch it either; only the relay's mark does.
create index if not exists {published_idx}
  on {table} (published_at)
  where published_at is not null;
