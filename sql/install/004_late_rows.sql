-- Rows the claims' start keys may have passed, flagged so that a claim finds them.
--
-- A claim walks the claim index from a start key, not from its first entry (see
-- the claim in sql/queries.sql): while something holds the MVCC horizon back, the
-- entries before the live rows are dead ones no vacuum may remove yet, and walking
-- them cost every claim more the longer the horizon was held. The start key is no
-- later than the earliest created_at a row committing now can have, on the
-- assumption that a row is inserted within {late_insert} of its created_at
-- (now(), the transaction's start, by default), read after its transaction took
-- its xid. Rows outside that assumption are flagged (relay_late) here, and the
-- claim starts at the earliest flagged row that is still live:
--
-- * inserted later than that after its created_at (a transaction that read for a
--   while before it wrote, or a created_at given explicitly);
-- * inserted more than that before its created_at (a created_at given explicitly,
--   from a clock ahead of the database's): on a partitioned table the claims' walks
--   end a little past now, and find such rows by their flag (walk_ceiling in
--   sql/queries.sql);
-- * put back in the claim index by an UPDATE (published_at or relay_dead_at set
--   back to null by hand, as an older `requeue` did), or moved in it (created_at
--   or relay_seq changed on a live row).
--
-- The same function gives a row with a null relay_seq (an explicit null, a COPY or
-- restore that carries the column) its number, so every live row has one (the
-- check below holds it).
--
-- The assumptions hold only while these triggers fire, so:
-- * they fire ALWAYS, also under session_replication_role = replica (logical
--   replication's apply, pg_restore, some ETL tools), where ordinary triggers do not;
-- * their names start with "zz_": row triggers fire in name order, and a service's
--   own BEFORE trigger that sorts later could change created_at after the test;
-- * the WHEN test takes the transaction's xid (pg_current_xact_id) before it reads
--   the clock: a service trigger that waits before the insert takes its xid would
--   otherwise put the clock reading before the xid;
-- * every claim checks that both fire ALWAYS, and walks from the first entry
--   while they do not (the claim's "guard"), and the relay checks at start.
--
-- On-time rows pay only for the WHEN test: the function runs for a late row alone.
create or replace function {late_function}() returns trigger
language plpgsql as $$
begin
  if new.relay_seq is null then
    new.relay_seq := nextval({seq_name}::regclass);
  end if;
  if tg_op = 'UPDATE' or new.created_at < clock_timestamp() - {late_insert}
     or new.created_at > clock_timestamp() + {late_insert} then
    new.relay_late := true;
  end if;
  return new;
end
$$;

do $$
begin
  -- Installs before this one named the insert trigger without the "zz_" prefix.
  if exists (select 1 from pg_trigger
              where tgrelid = {table_name}::regclass and tgname = {old_late_trigger_name}
                and not tgisinternal) then
    drop trigger {old_late_trigger} on {table};
  end if;

  -- Installs before this one did not flag rows from the future: their trigger, which
  -- has no comment, is made again (in this transaction: no insert goes without one).
  -- The comment is read from the catalog: pg_get_triggerdef would lock the table.
  if exists (select 1 from pg_trigger
              where tgrelid = {table_name}::regclass and tgname = {late_trigger_name}
                and not tgisinternal
                and obj_description(oid, 'pg_trigger') is distinct from {late_trigger_comment}) then
    drop trigger {late_trigger} on {table};
  end if;

  if not exists (select 1 from pg_trigger
                  where tgrelid = {table_name}::regclass and tgname = {late_trigger_name}
                    and not tgisinternal) then
    create trigger {late_trigger}
      before insert on {table}
      for each row
      when (new.relay_seq is null
            or (pg_current_xact_id() is not null
                and new.created_at < clock_timestamp() - {late_insert})
            or new.created_at > clock_timestamp() + {late_insert})
      execute function {late_function}();
    comment on trigger {late_trigger} on {table} is {late_trigger_comment};
  end if;

  if not exists (select 1 from pg_trigger
                  where tgrelid = {table_name}::regclass and tgname = {revive_trigger_name}
                    and not tgisinternal) then
    create trigger {revive_trigger}
      before update on {table}
      for each row
      when (coalesce(new.published_at, new.relay_dead_at) is null
            and (coalesce(old.published_at, old.relay_dead_at) is not null
                 or new.created_at is distinct from old.created_at
                 or new.relay_seq is distinct from old.relay_seq))
      execute function {late_function}();
  end if;

  if exists (select 1 from pg_trigger
              where tgrelid = {table_name}::regclass
                and tgname in ({late_trigger_name}, {revive_trigger_name})
                and tgenabled <> 'A') then
    alter table {table} enable always trigger {late_trigger};
    alter table {table} enable always trigger {revive_trigger};
  end if;

  -- A live row always has its place among the inserts. NOT VALID: rows already there
  -- are not read (published rows from before the first install have none); every
  -- insert and update from now on is checked, whatever the session's replication role.
  -- Once, with it: live rows left without a number (written while an earlier
  -- install's trigger did not fire) are numbered in the order earlier relays
  -- published them in, and flagged late (reads the unpublished rows once, through
  -- the contract's index). A reinstall does neither, and takes no lock on the table.
  if not exists (select 1 from pg_constraint
                  where conrelid = {table_name}::regclass and conname = {seq_check_name}) then
    update {table} t
       set relay_seq = o.seq, relay_late = true
      from (select id, nextval({seq_name}::regclass) as seq
              from (select id from {table}
                     where published_at is null and relay_seq is null
                     order by created_at, id) unnumbered) o
     where t.id = o.id;
    alter table {table} add constraint {seq_check}
      check (relay_seq is not null or published_at is not null) not valid;
  end if;

  -- The live late rows, in claim order: few, so the claim's look at them is cheap.
  if to_regclass({late_idx_name}) is null then
    create index {late_idx}
      on {table} (created_at, relay_seq)
      where relay_late and coalesce(published_at, relay_dead_at) is null;
  end if;
end
$$;

-- The live late rows' keys, in a small table of their own: where the claim looks for
-- them. On a partitioned table the index above is one index a partition, and a claim
-- that looked there opened every partition, at every claim (docs/partitions.md,
-- *What partitions cost*). A key is the row's (id, created_at, relay_seq): a producer
-- may give a relay_seq twice, never an id within a partition.
--
-- Written by AFTER row triggers, so that a row an "on conflict do nothing" skipped
-- leaves no key, and removed in the same transaction that publishes, kills, deletes
-- or moves the row. The function runs as its owner (security definer, with a search
-- path of its own): a producer's role may insert into the outbox and nothing else.
-- A key outlives its row only where no row trigger fires (TRUNCATE, a partition
-- dropped by hand): it only makes the claims' walks start earlier, and retention
-- removes it (purge_late_keys in sql/queries.sql).
--
-- No unique key (a restore may bring a key back beside the one its row's insert
-- writes), so its replica identity is the whole row: in a database with a
-- publication FOR ALL TABLES, a delete from a table without one fails, and with it
-- the mark that publishes a late row.
do $$
begin
  if to_regclass({late_keys_name}) is null then
    create table {late_keys} as
      select id, created_at, relay_seq from {table} with no data;
    create index {late_keys_idx} on {late_keys} (created_at, relay_seq);
    alter table {late_keys} replica identity full;
  end if;
end
$$;

create or replace function {late_key_function}() returns trigger
language plpgsql security definer as $$
begin
  if tg_op <> 'INSERT' then
    if old.relay_late and coalesce(old.published_at, old.relay_dead_at) is null then
      if tg_op = 'DELETE' then
        delete from {late_keys} k
         where k.id = old.id and k.created_at = old.created_at and k.relay_seq = old.relay_seq;
        return null;
      end if;
      if new.relay_late and coalesce(new.published_at, new.relay_dead_at) is null
         and (new.id, new.created_at, new.relay_seq) = (old.id, old.created_at, old.relay_seq) then
        return null;  -- still live, still where it was: a failed attempt, say
      end if;
      delete from {late_keys} k
       where k.id = old.id and k.created_at = old.created_at and k.relay_seq = old.relay_seq;
    end if;
  end if;
  if tg_op <> 'DELETE' and new.relay_late
     and coalesce(new.published_at, new.relay_dead_at) is null then
    insert into {late_keys} (id, created_at, relay_seq)
    values (new.id, new.created_at, new.relay_seq);
  end if;
  return null;
end
$$;

do $$
begin
  -- Its own search path: pg_catalog first, then the keys table's schema, pg_temp
  -- last, so that no caller's search path or temporary table stands in for them.
  execute format('alter function %s() set search_path = pg_catalog, %I, pg_temp',
                 {late_key_function_name}::regproc,
                 (select n.nspname from pg_class c
                    join pg_namespace n on n.oid = c.relnamespace
                   where c.oid = {late_keys_name}::regclass));

  -- Made when missing, and then the keys of the live late rows are read afresh: the
  -- trigger's creation waits for every insert under way and holds the others back
  -- until this transaction ends, so no late row goes without its key.
  if not exists (select 1 from pg_trigger
                  where tgrelid = {table_name}::regclass and tgname = {late_key_added_name}
                    and not tgisinternal) then
    create trigger {late_key_added}
      after insert on {table}
      for each row
      when (new.relay_late)
      execute function {late_key_function}();
    delete from {late_keys};
    insert into {late_keys} (id, created_at, relay_seq)
      select id, created_at, relay_seq from {table}
       where relay_late and coalesce(published_at, relay_dead_at) is null;
  end if;
  if not exists (select 1 from pg_trigger
                  where tgrelid = {table_name}::regclass and tgname = {late_key_moved_name}
                    and not tgisinternal) then
    create trigger {late_key_moved}
      after update on {table}
      for each row
      when ((old.relay_late and coalesce(old.published_at, old.relay_dead_at) is null)
            or (new.relay_late and coalesce(new.published_at, new.relay_dead_at) is null))
      execute function {late_key_function}();
  end if;
  if not exists (select 1 from pg_trigger
                  where tgrelid = {table_name}::regclass and tgname = {late_key_gone_name}
                    and not tgisinternal) then
    create trigger {late_key_gone}
      after delete on {table}
      for each row
      when (old.relay_late and coalesce(old.published_at, old.relay_dead_at) is null)
      execute function {late_key_function}();
  end if;
  if exists (select 1 from pg_trigger
              where tgrelid = {table_name}::regclass
                and tgname in ({late_key_added_name}, {late_key_moved_name}, {late_key_gone_name})
                and tgenabled <> 'A') then
    alter table {table} enable always trigger {late_key_added};
    alter table {table} enable always trigger {late_key_moved};
    alter table {table} enable always trigger {late_key_gone};
  end if;
end
$$;
