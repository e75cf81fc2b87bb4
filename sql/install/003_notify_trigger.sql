-- Wake the relay as soon as rows commit. A statement-level trigger, so a
-- multi-row insert notifies once, and Postgres folds identical notifications
-- of one transaction into one. The notification is delivered at commit and
-- never for a transaction that rolls back; the relay treats it as a hint and
-- re-reads the table, so its payload is empty.
create or replace function {notify_function}() returns trigger
language plpgsql as $$
begin
  perform pg_notify({channel}, '');
  return null;
end
$$;

create or replace trigger {notify_trigger}
  after insert on {table}
  for each statement
  execute function {notify_function}();
