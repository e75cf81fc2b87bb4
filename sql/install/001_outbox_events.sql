-- The contract's table and index, exactly as the event-outbox document gives them.
-- The relay never changes these columns; it only adds its own (002).
create table if not exists {table} (
  id           uuid        primary key,
  event_type   text        not null,
  source       text        not null,
  subject      text        not null,
  time         timestamptz not null,
  data         jsonb       not null,
  created_at   timestamptz not null default now(),
  published_at timestamptz null,
  attempts     int         not null default 0
);

-- The publisher's only query. Without this it is a sequential scan of every
-- event the service has ever published, forever.
--
-- (Created only when missing, checked in the catalog first: install runs on every
-- deploy, beside live producers and relays, and must then take no lock at all on
-- the table. "create index if not exists" would still lock it.)
do $$
begin
  if to_regclass({unpublished_idx_name}) is null then
    create index {unpublished_idx}
      on {table} (created_at)
      where published_at is null;
  end if;
end
$$;
