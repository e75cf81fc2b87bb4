-- Wake the relay as soon as rows commit, without making producers pay for it.
--
-- A plain pg_notify in every inserting transaction halves producer throughput at
-- 8 concurrent writers: a notifying transaction takes the notification queue's
-- lock at commit, so notifying transactions commit one at a time. A busy relay
-- does not need to be told (it will find the rows on its next claim), so the
-- trigger notifies only while a relay is asleep:
--
-- * a relay about to sleep takes the advisory lock {idle_lock} exclusively, on
--   its LISTEN connection, and holds it while it sleeps, and while it works at
--   light load (a few rows a batch: a notification a commit then costs less than
--   the claims that would look for the rows otherwise, relay/scheduler.py);
-- * the trigger tries to take the same lock shared, without waiting. If it cannot
--   (a relay holds it, or is queued for it), it notifies. If it can, no relay is
--   asleep and it skips the notify, holding the shared lock until its transaction
--   ends.
--
-- That shared lock is what makes skipping safe: a relay's exclusive request waits
-- until every transaction that skipped its notify has ended (and so is visible),
-- and the relay claims once more after the lock is granted, before it sleeps.
-- The trigger never waits for anything (the try does not block), never fails,
-- and behaves the same under READ COMMITTED, REPEATABLE READ and SERIALIZABLE:
-- advisory locks are outside MVCC. A statement-level trigger, so a multi-row
-- insert checks once; Postgres folds identical notifications of one transaction
-- into one, and never delivers one for a transaction that rolls back.
--
-- The try is made in the trigger's WHEN, so that while a relay is awake the function
-- is not called at all (docs/performance.md, *Producer cost*); the function tries
-- again, which keeps it right under a trigger from an earlier install that has no
-- WHEN (a second try that is granted holds the lock as the first would have).
create or replace function {notify_function}() returns trigger
language plpgsql as $$
begin
  if not pg_try_advisory_xact_lock_shared({idle_lock}) then
    perform pg_notify({channel}, '');
  end if;
  return null;
end
$$;

-- The trigger only calls the function, so a new install replaces the function
-- above and leaves the trigger (and the table's lock) alone.
do $$
begin
  -- Installs before this one had no WHEN: that trigger goes (a brief lock, once).
  if exists (select 1 from pg_trigger
              where tgrelid = {table_name}::regclass and tgname = {trigger_name}
                and not tgisinternal and tgqual is null) then
    drop trigger {notify_trigger} on {table};
  end if;
  if not exists (select 1 from pg_trigger
                  where tgrelid = {table_name}::regclass and tgname = {trigger_name}
                    and not tgisinternal) then
    create trigger {notify_trigger}
      after insert on {table}
      for each statement
      when (not pg_try_advisory_xact_lock_shared({idle_lock}))
      execute function {notify_function}();
  end if;
  -- ALWAYS: rows written under session_replication_role = replica (logical
  -- replication's apply, pg_restore) wake a sleeping relay too.
  if exists (select 1 from pg_trigger
              where tgrelid = {table_name}::regclass and tgname = {trigger_name}
                and tgenabled <> 'A') then
    alter table {table} enable always trigger {notify_trigger};
  end if;
end
$$;
