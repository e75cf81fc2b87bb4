-- State the relay owns. Its columns are all nullable and have no default, so adding
-- them is a catalog-only change: no table rewrite, no cost to producers' inserts.
--
-- relay_retry_at: a failed row is not retried before this time. Keeping it in the
-- table makes backoff hold across relay restarts and across replicas.
-- relay_last_error: why the last publish failed, for `outbox-relay status` and
-- for whoever is paged about a dead row.
-- relay_dead_at: when the relay gave up on the row (a reason inside the row, or
-- the attempt cap). A dead row leaves the claim index below, so dead rows left by
-- an incident cost the claim nothing; `requeue` clears it. A dead row keeps
-- relay_retry_at at 'infinity': it holds the later rows of its subject back, on
-- every replica, through the same index and question as a row in backoff.
-- relay_skipped_at: when an operator gave up on the row (`outbox-relay skip`): it
-- stays in the table, unpublished, and no longer holds its subject back.
-- relay_late: the row may sit before the relays' start keys: inserted long after
-- its created_at, or brought back by `requeue` (sql/install/004_late_rows.sql).
-- relay_seq: insertion order (below).
-- traceparent, tracestate, headers: written by a producer that wants them, never
-- required: its W3C trace context at the time of the write, and headers of its own
-- for the message (a JSON object of strings; relay/headers.py guards them).
--
-- Every change is made only when missing (checked in the catalog first), so an
-- install on an installed table takes no lock on it: "alter table ... add column
-- if not exists" takes an ACCESS EXCLUSIVE lock even when the column is there.
do $$
declare
  missing text[];
begin
  foreach missing slice 1 in array array[
      ['relay_retry_at', 'timestamptz'], ['relay_last_error', 'text'],
      ['relay_dead_at', 'timestamptz'], ['relay_skipped_at', 'timestamptz'],
      ['relay_seq', 'bigint'], ['relay_late', 'boolean'],
      ['traceparent', 'text'], ['tracestate', 'text'], ['headers', 'jsonb']]
  loop
    if not exists (select 1 from pg_attribute
                    where attrelid = {table_name}::regclass and attname = missing[1]
                      and not attisdropped) then
      execute format('alter table %s add column %I %s null', {table_name}::regclass,
                     missing[1], missing[2]);
    end if;
  end loop;

  -- relay_seq: insertion order. Every row of one transaction shares created_at
  -- (now() is the transaction's start), so created_at alone cannot order them; the
  -- relay publishes ties in relay_seq order, which is the order of the inserts
  -- (a multi-row insert numbers its rows in the order it inserts them). The column
  -- is added without a default (catalog only), then given one, which applies to new
  -- rows only: no rewrite either way. Unpublished rows inserted before are numbered
  -- once here, in the (created_at, id) order earlier relays published them in.
  -- CACHE: each session takes 64 numbers at a time, so that concurrent producers
  -- do not queue for the sequence's page on every insert (docs/performance.md,
  -- *Producer cost*). A session's numbers still rise in the order it inserts, which
  -- is all the relay orders by: rows of one transaction share a created_at, and
  -- rows of different transactions are ordered by created_at first.
  if to_regclass({seq_name}) is null then
    create sequence {seq} as bigint cache 64;
  elsif (select seqcache from pg_sequence where seqrelid = {seq_name}::regclass) < 64 then
    alter sequence {seq} cache 64;
  end if;
  if not exists (select 1 from pg_attrdef d
                   join pg_attribute a on a.attrelid = d.adrelid and a.attnum = d.adnum
                  where d.adrelid = {table_name}::regclass and a.attname = 'relay_seq') then
    alter table {table} alter column relay_seq set default nextval({seq_name}::regclass);
    update {table} t
       set relay_seq = o.seq
      from (select id, row_number() over (order by created_at, id) - count(*) over () - 1
                     as seq
              from {table}
             where published_at is null and relay_seq is null) o
     where t.id = o.id;
  end if;

  -- The claim's walk, in publishing order: unpublished rows that are not dead.
  -- Its order is the claim's own, so a claim reads its batch and stops, however
  -- many rows share a created_at (one transaction's) and however many dead rows
  -- sit before them; the contract's index on created_at alone cannot end a walk
  -- inside a group of ties.
  if to_regclass({claim_idx_name}) is null then
    create index {claim_idx}
      on {table} (created_at, relay_seq)
      where coalesce(published_at, relay_dead_at) is null;
  end if;

  -- Rows waiting out a backoff, and dead rows (their relay_retry_at is 'infinity'),
  -- by subject in publishing order: the claim asks "does an earlier row of this
  -- subject wait?" through this index, once per row it considers. Producers insert
  -- rows with relay_retry_at null, so their inserts never touch it. Its predicate is
  -- relay_retry_at alone (the relay clears it when it marks a row published, and
  -- `skip` and `requeue` clear it), so the claim's question can be answered by
  -- this index and by no other: an index with "published_at is null" in its
  -- predicate, like the unpublished index, would let a planner misled by stale
  -- statistics rescan the whole backlog for every row it considers (seen here: a
  -- claim over a 50,000-row burst on a table last analyzed while drained ran past
  -- the statement timeout).
  if to_regclass({retry_idx_name}) is null then
    create index {retry_idx}
      on {table} (subject, created_at, relay_seq)
      where relay_retry_at is not null;
  end if;

  -- Earlier installs had indexes the claim no longer uses, which would only cost
  -- the relay's marks: one with "published_at is null and relay_retry_at is not
  -- null", then one by (subject, created_at, id). Dropping them locks the table
  -- briefly, once.
  if to_regclass({old_backoff_idx_name}) is not null then
    drop index {old_backoff_idx_qualified};
  end if;
  if to_regclass({old_retry_idx_name}) is not null then
    drop index {old_retry_idx_qualified};
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

-- Producers' inserts take relay_seq's default, nextval of the sequence, which needs
-- USAGE on it: a producer role that may insert into the table may number its rows.
-- Granted to PUBLIC because the sequence is only a counter (anyone's nextval only
-- burns a number), and a role granted INSERT later needs nothing more.
grant usage on sequence {seq} to public;
