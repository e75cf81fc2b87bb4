-- A time-partitioned outbox table (`outbox-relay install --partitions PERIOD`):
-- range partitions of one period each on created_at, created ahead by the relay
-- and dropped by its retention once every row in them is spent (relay/partitions.py).
-- The period is the newest partition's width, read from the catalog; nothing else
-- records it. Identifiers come from the configuration and are composed with
-- psycopg.sql; {partition} is one partition, in the table's schema.

-- name: create_table
-- The contract's table (sql/install/001, whose columns a test holds these to),
-- range-partitioned on created_at. Postgres requires the partition key in every
-- unique index, so the primary key is (id, created_at): the envelope id is unique
-- within a partition, not across them (docs/partitions.md; `outbox-relay status`
-- looks for ids written twice). sql/install then adds the relay's columns,
-- indexes and triggers, which Postgres gives every partition.
create table if not exists {table} (
  id           uuid        not null,
  event_type   text        not null,
  source       text        not null,
  subject      text        not null,
  time         timestamptz not null,
  data         jsonb       not null,
  created_at   timestamptz not null default now(),
  published_at timestamptz null,
  attempts     int         not null default 0,
  primary key (id, created_at)
) partition by range (created_at)

-- name: layout
-- 'r' a plain table, 'p' a partitioned one (no row: no such table); and whether
-- it is partitioned the one way the relay manages, by range of created_at alone.
select c.relkind::text,
       coalesce(p.partstrat = 'r' and p.partnatts = 1
                and p.partattrs[0] = (select attnum from pg_attribute
                                       where attrelid = c.oid and attname = 'created_at'),
                false)
  from pg_class c
  left join pg_partitioned_table p on p.partrelid = c.oid
 where c.oid = to_regclass({table_name})

-- name: partitions
-- The table's partitions, oldest first: name, bounds as epoch seconds (MINVALUE
-- and MAXVALUE as -inf and inf, as a plain table attached as the first partition
-- has them; null for a DEFAULT partition, which the relay leaves alone) and
-- whether a detach of it is pending. The bounds are printed and read back in this
-- session's settings, whatever its DateStyle.
select c.relname::text, b.lower, b.upper, i.inhdetachpending
  from pg_inherits i
  join pg_class c on c.oid = i.inhrelid
  left join lateral (
         select extract(epoch from (case m[1] when 'MINVALUE' then '-infinity'
                                    else trim(both '''' from m[1]) end)::timestamptz)::float8,
                extract(epoch from (case m[2] when 'MAXVALUE' then 'infinity'
                                    else trim(both '''' from m[2]) end)::timestamptz)::float8
           from regexp_match(
                  pg_get_expr(c.relpartbound, c.oid),
                  '^FOR VALUES FROM \((MINVALUE|''[^'']*'')\) TO \((MAXVALUE|''[^'']*'')\)$') m
       ) b (lower, upper) on true
 where i.inhparent = {table_name}::regclass
 order by b.lower nulls first, c.relname

-- name: partition_lock
-- One relay at a time creates partitions; the lock ends with the transaction.
select pg_try_advisory_xact_lock({partition_lock})

-- name: create_partition
-- A partition is made as a table of its own and then attached: CREATE TABLE ...
-- PARTITION OF would lock the whole table against producers while it ran, ATTACH
-- only against other DDL. Postgres gives it the table's indexes and triggers as
-- it attaches it (an empty table: no scan to speak of).
create table {partition}
  (like {table} including defaults including constraints including storage)

-- name: attach_partition
alter table {table} attach partition {partition}
  for values from (to_timestamp({start})) to (to_timestamp({end}))

-- name: partition_held
-- Rows that keep an expired partition from being dropped: unpublished (waiting,
-- failing or dead) and not given up on with `skip`.
select id::text
  from {partition}
 where published_at is null and relay_skipped_at is null
 limit 5

-- name: detach_partition
-- Outside a transaction: it waits for the transactions that may still use the
-- partition without taking a lock that producers' inserts would queue behind.
alter table {table} detach partition {partition} concurrently

-- name: finalize_detach
-- A detach interrupted after its first step (a lock_timeout, a lost connection)
-- leaves the partition pending; this finishes it.
alter table {table} detach partition {partition} finalize

-- name: drop_partition
-- A detached partition: nothing that writes to the table can reach it.
drop table {partition}

-- name: duplicate_ids
-- Envelope ids written more than once in the window: across partitions Postgres
-- no longer enforces their uniqueness.
select id::text, count(*)
  from {table}
 where created_at >= now() - make_interval(secs => %(window)s)
 group by id
having count(*) > 1
 order by count(*) desc, id
 limit 10

-- name: partition_lock_wait
-- install: waits for a relay that is creating partitions, and holds them off.
select pg_advisory_xact_lock({partition_lock})

-- name: readable_bounds
-- Before the partitions query, in its transaction: pg_get_expr prints the bounds in
-- the session's TimeZone and DateStyle, and Postgres reads some of what it prints
-- back as another time ("SQL, DMY" in Asia/Kolkata writes IST, read back as
-- Israel's). In UTC and ISO the round trip is exact.
select set_config('TimeZone', 'UTC', true), set_config('DateStyle', 'ISO, YMD', true)

-- Migrating a plain table to a partitioned one, online (docs/partitions.md,
-- *Migrating a plain table*): the plain table becomes the partition of every
-- created_at before a bound, and partitions follow from the bound on. Its rows stay
-- where they are; producers wait only for the switch, a transaction of catalog
-- changes. The plain table is renamed <table>_before.

-- name: migration_bound
-- Step 1, beforehand: what proves the plain table's rows all precede the bound, so
-- that attaching it reads nothing. NOT VALID, then validated apart: the validation
-- reads the table without blocking writes. A row created at the bound or later is
-- refused from here on, so the switch must come before the bound.
alter table {table} add constraint {before_bound} check (created_at < {bound}) not valid

-- name: migration_validate
alter table {table} validate constraint {before_bound}

-- name: migration_key
-- Step 1 too: the partitioned table's key, built without blocking writes (outside
-- a transaction). The switch makes it a constraint, which the key then adopts.
create unique index concurrently if not exists {before_key} on {table} (id, created_at)

-- name: migration_switch
-- Step 2, in one transaction that `outbox-relay install`'s script ends: the plain
-- table and the names of its indexes step aside, its relay triggers go (the
-- partitioned table's, installed next, reach it as a partition), and the
-- partitioned table takes its place. Only catalog work: nothing is read or built.
set local lock_timeout = '2s';
alter table {table} rename to {before_name};
alter index {old_pkey} rename to {before_pkey};
alter index {old_unpublished_idx} rename to {before_unpublished_idx};
alter index {old_claim_idx} rename to {before_claim_idx};
alter index {old_retry_idx} rename to {before_retry_idx};
alter index {old_published_idx} rename to {before_published_idx};
alter index {old_late_idx} rename to {before_late_idx};
alter table {before} add constraint {before_key} unique using index {before_key};
drop trigger {notify_trigger} on {before};
drop trigger {late_trigger} on {before};
drop trigger {revive_trigger} on {before};
drop trigger if exists {late_key_added} on {before};
drop trigger if exists {late_key_moved} on {before};
drop trigger if exists {late_key_gone} on {before};
create table {table} (like {before} including defaults) partition by range (created_at);
alter table {table} add primary key (id, created_at);
alter table {table} attach partition {before} for values from (minvalue) to ({bound})
