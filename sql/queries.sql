-- Every query the relay runs, by name. Loaded once by relay/sqlfiles.py; {names}
-- are identifiers from configuration, composed with psycopg.sql; %(names)s are
-- bound parameters. The claim's parameters are slots too, {batch_size} and
-- {max_attempts}: bound parameters when it runs as it is, $1 and $2 when the relay
-- prepares it (relay/database.py says why).

-- fragment: claimable
-- A row the claim may take ({row} is its alias): unpublished and not dead, under
-- the attempt cap, not waiting out a retry, and with no earlier row of its subject
-- waiting or dead (a dead row waits until 'infinity'). The first line is the claim
-- index's predicate in its own words, so the planner walks that index and not the
-- contract's one on created_at alone. The probe has no "published_at is null":
-- marking a row published clears relay_retry_at, and so do requeue and skip.
-- Fence: "offset 0" keeps the probe a per-row lookup in the waiting index; as a
-- join, on statistics from before a burst, it rescanned the backlog for each row.
coalesce({row}.published_at, {row}.relay_dead_at) is null
and {row}.attempts < {max_attempts}
and ({row}.relay_retry_at is null or {row}.relay_retry_at <= now())
and not exists (
      select 1
        from {table} b
       where b.subject = {row}.subject
         and b.relay_retry_at > now()
         and (b.created_at, b.relay_seq) < ({row}.created_at, {row}.relay_seq)
         and b.created_at <= {row}.created_at
         {walk_floor(b)}
         {walk_ceiling(b)}
      offset 0)

-- fragment: dead
-- A row the relay gave up on ({row} is its alias): at the attempt cap, or marked
-- dead (a reason inside the row). Skipped rows are dead too; callers that count
-- them apart say "relay_skipped_at is null" beside it.
({row}.attempts >= %(max_attempts)s or {row}.relay_dead_at is not null)

-- fragment: created_span
-- On a partitioned table, the marks' bound by the batch's created_at span
-- (%(since)s, %(until)s, epoch seconds): planned without it, a mark opened every
-- partition (docs/partitions.md). A plain table's marks go without: it would only
-- add to their planning.
and {row}.created_at between to_timestamp(%(since)s) and to_timestamp(%(until)s)

-- fragment: walk_ceiling
-- On a partitioned table, where a claim's walks end ({row} is its alias): a bound
-- Postgres can prune by when the claim starts (a stable expression and a parameter),
-- so that the partitions kept ahead, empty, are not opened by every walk of every
-- claim (docs/partitions.md). A row is inserted within the claim's reach of now less
-- its margin, or the late-row trigger flagged it (sql/install/004_late_rows.sql);
-- the claim reports flagged rows beyond the bound (rows_beyond), and the relay then
-- sends the ceiling 'infinity' until none is left. The bound only ever delays a
-- row: the walks cut the claim order at one point, and rows after it wait. A plain
-- table's claim goes without.
and {row}.created_at <= greatest(statement_timestamp() + {claim_reach}, {ceiling})

-- fragment: walk_floor
-- On a partitioned table, where a claim's walks from its start begin at the earliest
-- ({row} is its alias): the start key's created_at, or its bound less the late-insert
-- slack if earlier, less the claim's reach; or nowhere, with the floor_cap
-- '-infinity'. Parameters only, so Postgres prunes by it when the claim starts, and
-- the partitions behind the start key (a week of them by default) are not opened by
-- each of those walks (docs/partitions.md). The per-row probe of claimable begins
-- there too (dead_below says why it may). The late rows' lookup reads their keys'
-- own table, which has no partitions to open. A claim whose walks would start
-- below the floor claims nothing (floor_refusal), and the relay runs it again with
-- the floor_cap '-infinity'.
and {row}.created_at >= least({raw_floor(k)}, {floor_cap})

-- fragment: raw_floor
-- The floor itself (walk_floor says why). The writers' bound is taken from the poll
-- (locks_at) where the claim takes the earliest finished writer's if earlier: the
-- claim's reach covers a writer of up to a minute.
least({start_at}::timestamptz,
      greatest({bound_at}::timestamptz, {locks_at}::timestamptz) - {late_insert})
  - {claim_reach}

-- fragment: floor_refusal
-- On a partitioned table, a CTE ({row} is unused): whether this claim's walks would
-- start below their floor, so that it must claim nothing: a live flagged row lies
-- below it (inserted late with an old created_at, or requeued), a finished writer's
-- bound lies more than the reach behind the poll's, or the guard is off. The relay
-- then claims again without the floor, and the start key it gets keeps such a row
-- above the floors after it.
floor_refusal as materialized (
  select (select created_at from walk_from) < least({raw_floor(k)}, {floor_cap}) as refused
),

-- fragment: dead_below
-- On a partitioned table, a CTE ({row} is its alias): the subjects of the rows that
-- wait or are dead below the walks' floor, read once a claim. The probe of claimable
-- for an earlier waiting row of a subject begins at the floor, so that it does not
-- open every partition behind it once for each row the claim considers: every row
-- still to publish that the claim can see lies above the floor, or the claim is
-- refused, so below it only dead rows remain, which hold their subjects for good.
-- The waiting index holds nothing else (published and skipped rows leave it).
dead_below as materialized (
  select {row}.subject
    from {table} {row}
   where {row}.relay_retry_at > now()
     and {row}.created_at < least({raw_floor(k)}, {floor_cap})
),

-- fragment: past_dead_below
-- On a partitioned table, beside claimable: that no row below the walks' floor
-- holds this row's subject ({row} is its alias; dead_below says why). Fence: "is
-- not true" keeps this a hashed subplan, as in the claim's blockers.
and ({row}.subject in (select subject from dead_below)) is not true

-- fragment: refusal
-- On a partitioned table, the start's condition that the claim was not refused
-- (floor_refusal): a refused claim finds no start, so it claims nothing.
and not (select refused from floor_refusal)

-- fragment: refused
-- On a partitioned table, whether the claim was refused (floor_refusal), for the
-- summary (1 or 0, in the attempts column); on a plain table, null.
(select refused from floor_refusal)::int

-- fragment: rows_beyond
-- Whether a live flagged row lies beyond the walks' bound when the relay sends no
-- ceiling of its own ({row} is its alias), looked for when the parameter beyond_from
-- is '-infinity': with 'infinity' every partition is pruned and nothing is read. On a
-- plain table, null.
exists (select 1
          from {table} {row}
         where {row}.relay_late and coalesce({row}.published_at, {row}.relay_dead_at) is null
           and {row}.attempts < {max_attempts}
           and {row}.created_at > greatest(statement_timestamp() + {claim_reach}, {beyond_from}))

-- fragment: exact_time
-- A timestamptz ({row}, a column name) as text that Postgres reads back exactly
-- whatever the session's DateStyle and TimeZone ("SQL, DMY" with Asia/Kolkata
-- writes "IST", which it reads back as Israel's time): UTC, ISO order, microseconds,
-- the era; infinities as themselves.
case when isfinite({row})
     then to_char({row} at time zone 'UTC', 'YYYY-MM-DD HH24:MI:SS.US"+00" BC')
     else {row}::text end

-- fragment: rfc3339_time
-- The envelope's time ({row} is its alias) as RFC 3339 text in UTC, or null where
-- RFC 3339 cannot write it (infinite, or outside years 1-9999).
case when {row}.time >= '0001-01-01 00:00:00+00' and {row}.time < '10000-01-01 00:00:00+00'
     then to_char({row}.time at time zone 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
end

-- name: claim
-- The next batch, in (created_at, relay_seq) order, the claim index's:
--   walk_from where this claim's walks start: the earliest of the relay's start
--            key and the earliest live row flagged late (see below);
--   start    the first live entry of the claim index from there;
--   horizon  the 2 x batch_size-th claimable row: how far this claim looks;
--   claimed  up to batch_size claimable rows up to the horizon, locked
--            FOR UPDATE SKIP LOCKED (rows another relay holds are skipped);
--   ahead    the blockers: unpublished live rows of the claimed subjects, not in
--            the batch and before its last row (another relay holds them, or they
--            committed after a concurrent claim's snapshot). A claimed row behind
--            the earliest blocker of its subject waits; the relay picks that one
--            (a DISTINCT ON here would need a sort).
-- One result: the claimed rows (blocker = false), then the blockers, then one
-- summary row (blocker null) that the relay keeps for its next claim: where the
-- live rows started, and when and in which snapshot this claim looked.
--
-- Why a start key. Every row the relay publishes leaves a dead entry in the claim
-- index, and while anything holds the MVCC horizon back (a long transaction, a
-- standby, a slot) no vacuum and no index scan may remove it: a walk from the
-- index's first entry would pay for every row published since. So the walks start
-- at the start key (start_at, start_seq), which the relay carries from its last claim
-- (relay/claimstart.py): the first live entry that claim saw, or, if earlier, the
-- earliest created_at a row committed since can have. That bound comes from the
-- snapshot: a transaction that commits later has an xid no older than the
-- snapshot's xmin, so it took its xid after bound_at, the time of an earlier
-- claim whose own xid is older than that xmin, and a row it inserts then has a
-- created_at no earlier than that, less the late-insert slack, unless the late-insert
-- trigger flagged it (relay_late, sql/install/004_late_rows.sql): those, and rows
-- `requeue` brought back, are found through their keys' own table. A transaction
-- that has written and stays open holds that xmin itself; the table's writers
-- (relay/writers.py) give a second bound (locks_at, and the writers this claim's
-- snapshot sees finished), and the later of the two is the claim's ("bound").
-- A start_at of '-infinity' walks from the first entry (at start, and to rewind).
--
-- Each walk reads at most two batches' worth and stops, however many rows share a
-- created_at and however many dead rows there are (they are not in the index).
-- Timestamps leave as text and numbers Python can always read: ``time`` as the
-- envelope's RFC 3339 text (null where RFC 3339 cannot express it: infinite, or
-- outside years 1-9999), ``created_at`` as epoch seconds (float8 keeps microsecond
-- order near now, and turns +-infinity into +-inf).
-- Fences: each CTE is "materialized" so it runs once, not inlined into its users.
with finished_writers as materialized (
  -- The table's writers that the relay's last poll of pg_locks saw (relay/writers.py)
  -- and this claim's snapshot sees finished: rows they committed may be older
  -- than the poll, but no older than their own bound.
  select w.xid, w.since
    from unnest({writer_xids}::xid8[], {writer_since}::timestamptz[]) w (xid, since)
   where pg_visible_in_snapshot(w.xid, pg_current_snapshot())
),
bound as materialized (
  -- The earliest created_at of a row, unflagged, that this claim may see and the
  -- last did not, less the late-insert slack: the later of the two bounds, the
  -- snapshot's (bound_at) and the writers' (locks_at, or a finished writer's own).
  select greatest({bound_at}::timestamptz,
                  least({locks_at}::timestamptz,
                        (select min(since) from finished_writers))) as since
),
guard as materialized (
  -- Whether the start key may be trusted now: the late-row triggers, and those that
  -- keep the late rows' keys, fire ALWAYS (sql/install/004_late_rows.sql; disabled,
  -- they flag nothing, or the claim does not find what they flagged), and the
  -- clock has not gone back behind the bound (rows committed since may carry
  -- created_at values before it). Otherwise this claim walks from the first entry.
  -- A partitioned table's partitions carry their own copies of the triggers, which
  -- can be disabled one by one (pg_partition_tree has no row for a plain table).
  select (select count(*) from pg_trigger
           where tgrelid = {table_name}::regclass
             and tgname in ({late_trigger_names})
             and tgenabled = 'A') < {late_trigger_count}
         or exists (select 1 from pg_trigger
                     where tgrelid in (select relid from pg_partition_tree({table_name}))
                       and tgname in ({late_trigger_names})
                       and tgenabled <> 'A')
         or statement_timestamp() < (select since from bound) as off
),
walk_from as materialized (
  select k.created_at, k.relay_seq
    from (select {start_at}::timestamptz, {start_seq}::bigint
          union all
          select '-infinity'::timestamptz, -9223372036854775808 where (select off from guard)
          union all
          select (select since from bound) - {late_insert}, -9223372036854775808
          union all
          (select l.created_at, l.relay_seq
             from {late_keys} l
            where true
              {walk_ceiling(l)}
            order by l.created_at, l.relay_seq
            limit 1)) k (created_at, relay_seq)
   order by k.created_at, k.relay_seq
   limit 1
),
{floor_refusal(u)}
{dead_below(d)}
start as materialized (
  select s.created_at, s.relay_seq
    from {table} s
   where coalesce(s.published_at, s.relay_dead_at) is null
     and (s.created_at, s.relay_seq)
         >= ((select created_at from walk_from), (select relay_seq from walk_from))
     and s.created_at >= (select created_at from walk_from)
     {refusal(s)}
     {walk_floor(s)}
     {walk_ceiling(s)}
   order by s.created_at, s.relay_seq
   limit 1
),
horizon as materialized (
  -- Counting the rows other relays hold (a plain read does not skip them): a claim
  -- that walked on past their batches would take rows of the subjects they hold,
  -- only to let them go again behind the gate (docs/performance.md).
  select h.created_at, h.relay_seq
    from {table} h
   where {claimable(h)}
     {past_dead_below(h)}
     and (h.created_at, h.relay_seq)
         >= ((select created_at from start), (select relay_seq from start))
     and h.created_at >= (select created_at from start)
     {walk_floor(h)}
     {walk_ceiling(h)}
   order by h.created_at, h.relay_seq
   offset 2 * {batch_size} - 1
   limit 1
),
claimed as materialized (
  select o.id, o.event_type, o.source, o.subject, {rfc3339_time(o)} as time,
         o.data::text as data, o.created_at, o.relay_seq, o.attempts,
         o.traceparent, o.tracestate, o.headers::text as headers
    from {table} o
   where {claimable(o)}
     {past_dead_below(o)}
     and (o.created_at, o.relay_seq)
         >= ((select created_at from start), (select relay_seq from start))
     and o.created_at >= (select created_at from start)
     {walk_floor(o)}
     {walk_ceiling(o)}
     -- The horizon as two parameters: an index condition that ends the walk there.
     -- The filter is the horizon's again: this scan locks the rows, and only its
     -- conditions are checked again on a row another relay changed meanwhile.
     and (o.created_at, o.relay_seq)
         <= (coalesce((select created_at from horizon), 'infinity'),
             coalesce((select relay_seq from horizon), 9223372036854775807))
   order by o.created_at, o.relay_seq
   limit {batch_size}
     for update of o skip locked
),
last as materialized (
  select created_at, relay_seq from claimed order by created_at desc, relay_seq desc limit 1
),
-- The unpublished live rows from the start to the batch's last row, in two walks of
-- the claim index, each bounded by parameters: rows of an earlier created_at, then
-- rows of the last created_at before the last row. Fence: one walk with the row
-- comparison "(created_at, relay_seq) < last" was planned as "created_at <= last",
-- reading every row that shares the batch's last created_at (the rest of one big
-- transaction).
ahead as (
  select e.id, e.subject, e.created_at, e.relay_seq
    from {table} e
   where coalesce(e.published_at, e.relay_dead_at) is null
     and e.attempts < {max_attempts}
     and (e.created_at, e.relay_seq)
         >= ((select created_at from start), (select relay_seq from start))
     and e.created_at >= (select created_at from start)
     and e.created_at < (select created_at from last)
     {walk_floor(e)}
     {walk_ceiling(e)}
  union all
  select e.id, e.subject, e.created_at, e.relay_seq
    from {table} e
   where coalesce(e.published_at, e.relay_dead_at) is null
     and e.attempts < {max_attempts}
     and (e.created_at, e.relay_seq)
         >= ((select created_at from start), (select relay_seq from start))
     and e.created_at >= (select created_at from start)
     and e.created_at = (select created_at from last)
     and e.relay_seq < (select relay_seq from last)
     {walk_floor(e)}
     {walk_ceiling(e)}
)
select false as blocker, id::text, event_type, source, subject, time, data,
       extract(epoch from created_at)::float8 as created_at,
       coalesce(relay_seq, 9223372036854775807) as relay_seq, attempts,
       traceparent, tracestate, headers
  from claimed
union all
select true, a.id::text, null, null, a.subject, null, null,
       extract(epoch from a.created_at)::float8,
       coalesce(a.relay_seq, 9223372036854775807), null, null, null, null
  from ahead a
 -- Fence: "is true" keeps this a hashed subplan, as "not in" below is; a bare "in"
 -- becomes a semi join that, on statistics from before a burst, loops over every
 -- claimed row for every row here (docs/performance.md).
 where (a.subject in (select subject from claimed)) is true
   and a.id not in (select id from claimed)
union all
-- The summary, last, so that the claim's row locks (which give this transaction its
-- xid) were taken before it is read: the start (its created_at as exact text; null
-- when no live row was found), this statement's time, the snapshot's xmin, this
-- transaction's xid (null when it claimed nothing), whether the guard was off, the
-- writers it saw finished, the start's relay_seq, whether it was refused (below its
-- floor), whether it walked from the first entry, its bound, and whether a flagged
-- row lies beyond the walks' bound (null when not looked for).
select null, (select {exact_time(created_at)} from start),
       (select {exact_time(t)} from (select statement_timestamp()) n (t)),
       pg_snapshot_xmin(pg_current_snapshot())::text,
       pg_current_xact_id_if_assigned()::text, (select off from guard)::text,
       (select coalesce(array_agg(xid), '{{}}') from finished_writers)::text, null,
       (select relay_seq from start), {refused(r)},
       ((select created_at from walk_from) = '-infinity')::text,
       (select {exact_time(since)} from bound), ({rows_beyond(f)})::text;

-- name: mark_published
-- The ids come as one uuid[] literal in a string: the relay holds them as text, and
-- one string costs nothing to send where an array of 500 is dumped element by element.
-- The server reads it once, as the uuid[] parameter (an expression built from it
-- here, such as string_to_array, would be evaluated again for every row it is
-- compared with). The created_span slot is empty on a plain table (its fragment says why).
update {table} t
   set published_at = clock_timestamp(), relay_retry_at = null, relay_last_error = null
 where t.id = any(%(ids)s::uuid[]) {created_span};

-- name: mark_failed
-- A row with no delay is dead from now on: relay_dead_at set takes it out of the
-- claim index, relay_retry_at 'infinity' holds its subject back.
update {table} t
   set attempts = f.attempts,
       relay_retry_at = case when f.delay is null then 'infinity'
                             else clock_timestamp() + make_interval(secs => f.delay) end,
       relay_last_error = f.error,
       relay_dead_at = case when f.delay is null then clock_timestamp() end
  from unnest(%(ids)s::text[]::uuid[], %(attempts)s::int[], %(delays)s::float8[],
              %(errors)s::text[])
       as f(id, attempts, delay, error)
 where t.id = f.id {created_span};

-- name: purge_late_keys
-- Retention: the late rows' keys that no live late row has any longer (a TRUNCATE,
-- a partition dropped by hand: sql/install/004_late_rows.sql). Harmless while they
-- stay, but every claim's walks would start at the earliest of them. A key another
-- transaction is writing is not seen yet, and its row is live when it is.
delete from {late_keys} k
 where not exists (select 1 from {table} t
                    where t.id = k.id and t.created_at = k.created_at
                      and t.relay_seq = k.relay_seq and t.relay_late
                      and coalesce(t.published_at, t.relay_dead_at) is null);

-- name: delete_spent
-- Retention: spent rows only, oldest first, with the same skip-locked discipline
-- as the publisher so it never waits on (or blocks) a batch in flight. It walks the
-- published_at index from %(after)s, the last row the previous statement deleted:
-- the entries before it are the rows retention deleted, dead ones that no vacuum
-- may remove while something holds the horizon back, and a walk from the index's
-- first entry would visit them all in every statement (relay/retention.py walks
-- from the first entry now and then, for rows another relay's retention held). A
-- null %(after)s walks from the rows that came of age in the last %(lookback)s
-- seconds (where a pass starts when a walk from the first entry failed).
-- Returns how many rows went, and the last one's published_at, exact, as text.
with spent as (
  select id, published_at
    from {table}
   where published_at is not null
     and published_at >= coalesce(%(after)s::timestamptz,
                                  now() - make_interval(secs => %(retention)s + %(lookback)s))
     and published_at < now() - make_interval(secs => %(retention)s)
   order by published_at
   limit %(batch_size)s
     for update skip locked
),
-- Fence: the ids as an array, so each is one probe of the primary key; as a join
-- with "spent" the planner hashed it against a sequential scan of the whole table,
-- dead tuples and all, in every statement.
deleted as (
  delete from {table} t
   where t.id = any (array(select id from spent))
  returning t.published_at
)
select count(*), (select {exact_time(m)} from (select max(published_at) from deleted) d (m))
  from deleted;

-- name: relay_columns
select count(*) from pg_attribute
 where attrelid = %(table)s::regclass
   and attname in ('relay_retry_at', 'relay_last_error', 'relay_dead_at', 'relay_seq',
                   'relay_skipped_at', 'relay_late', 'traceparent', 'tracestate', 'headers')
   and not attisdropped;

-- name: trigger_present
select count(*) from pg_trigger
 where tgrelid = %(table)s::regclass and tgname = %(trigger)s and not tgisinternal;

-- name: late_guard
-- What the start keys rest on and the table lacks (an empty array: nothing), read
-- at start (sql/install/004_late_rows.sql says why each matters). Each claim checks
-- the triggers again itself (its guard).
select array_remove(array[
  case when (select count(*) from pg_trigger
              where tgrelid = {table_name}::regclass
                and tgname in ({late_trigger_names})
                and tgenabled = 'A') < {late_trigger_count}
       then 'the late-row triggers are missing or do not fire ALWAYS' end,
  (select 'the late-row triggers do not fire ALWAYS on partition ' || min(tgrelid::regclass::text)
     from pg_trigger
    where tgrelid in (select relid from pg_partition_tree({table_name}))
      and tgname in ({late_trigger_names})
      and tgenabled <> 'A'
   having count(*) > 0),
  case when not exists (select 1 from pg_constraint
                         where conrelid = {table_name}::regclass and conname = {seq_check_name})
       then 'the check that every live row has a relay_seq is missing' end,
  -- tgtype: 1 row, 2 before, 4 insert, 16 update (pg_trigger.h).
  (select 'the BEFORE row trigger ' || quote_ident(tgname)
          || ' fires after the late-row triggers and may change created_at unseen'
     from pg_trigger
    where tgrelid = {table_name}::regclass and not tgisinternal
      and tgtype & 3 = 3 and tgtype & 20 <> 0 and tgname > {late_trigger_name}
      and tgname <> {revive_trigger_name}
    order by tgname
    limit 1)], null);

-- name: backlog
-- Table-wide gauges. Reads only the partial index of unpublished rows (and their
-- heap tuples), so it costs the backlog, not the table.
-- A skipped row is not dead: an operator let it go.
select count(*) as unpublished,
       count(*) filter (where {dead(u)} and u.relay_skipped_at is null) as dead,
       count(*) filter (where u.relay_skipped_at is not null) as skipped,
       count(distinct u.subject) filter (where {dead(u)} and u.relay_skipped_at is null)
         as held_subjects,
       coalesce(extract(epoch from clock_timestamp()
                - min(u.created_at) filter (where not {dead(u)})), 0)::float8
         as oldest_age_seconds
  from {table} u
 where u.published_at is null;

-- name: status
-- `outbox-relay status`: the backlog per event_type, from the partial index.
select event_type,
       count(*) as unpublished,
       count(*) filter (where {dead(u)} and u.relay_skipped_at is null) as dead,
       count(*) filter (where u.relay_skipped_at is not null) as skipped,
       count(*) filter (where not {dead(u)} and u.relay_retry_at > now()) as backing_off,
       coalesce(extract(epoch from clock_timestamp() - min(created_at)), 0)::float8
         as oldest_age_seconds,
       max(attempts) as max_attempts,
       (array_agg(relay_last_error order by created_at)
          filter (where relay_last_error is not null))[1] as last_error
  from {table} u
 where u.published_at is null
 group by event_type
 order by oldest_age_seconds desc, event_type;

-- name: held_subjects
-- `outbox-relay status`: subjects a dead row holds back, the earliest first, with
-- how many live rows of each wait. Reads the unpublished rows (the contract's
-- partial index), then those of each held subject.
with dead as (
  select subject, count(*) as dead, min(created_at) as since,
         (array_agg(id order by created_at, relay_seq))[1] as first_dead,
         (array_agg(relay_last_error order by created_at, relay_seq))[1] as error
    from {table} u
   where u.published_at is null and u.relay_skipped_at is null and {dead(u)}
   group by subject
)
select d.subject, d.dead,
       (select count(*) from {table} w
         where w.subject = d.subject and w.published_at is null and not {dead(w)})
         as waiting,
       d.first_dead, d.error
  from dead d
 order by d.since, d.subject
 limit %(limit)s;

-- name: requeue_select
-- Rows `outbox-relay requeue` would reset: unpublished, and dead or chosen by id.
-- A skipped row comes back only by its id: skipping it was an operator's decision.
select id, event_type, attempts, relay_last_error, relay_skipped_at is not null as skipped
  from {table} u
 where published_at is null
   and (attempts > 0 or relay_retry_at is not null or relay_dead_at is not null)
   and (   id = any(%(ids)s)
        or (relay_skipped_at is null and {dead(u)}
            and (%(all_dead)s or event_type = any(%(event_types)s))))
 order by created_at, relay_seq
   for update;

-- name: requeue_reset
-- Flagged late: a row back in the claim index at its old place, which the relays'
-- start keys may have passed (see the claim).
update {table}
   set attempts = 0, relay_retry_at = null, relay_last_error = null, relay_dead_at = null,
       relay_skipped_at = null, relay_late = true
 where id = any(%(ids)s) and published_at is null;

-- name: skip_select
-- Rows `outbox-relay skip` would let go: unpublished and not skipped yet. Waits for
-- a batch in flight that holds one (it may be publishing it right now).
select id, event_type, subject, attempts, relay_last_error, {dead(u)} as dead
  from {table} u
 where id = any(%(ids)s) and published_at is null and relay_skipped_at is null
 order by created_at, relay_seq
   for update;

-- name: skip_mark
-- Skipped: out of the claim index (relay_dead_at), holding nothing back
-- (relay_retry_at null), and kept, unpublished, for whoever needs it later.
update {table}
   set relay_skipped_at = clock_timestamp(),
       relay_dead_at = coalesce(relay_dead_at, clock_timestamp()),
       relay_retry_at = null
 where id = any(%(ids)s) and published_at is null and relay_skipped_at is null;

-- name: adopt_dead
-- Dead rows not marked as this version marks them, marked at start: rows at the cap
-- without relay_dead_at (left by a relay from before it, set by hand, or under a
-- lower --max-attempts) leave the claim index, and dead rows of an earlier version
-- (relay_retry_at null) now hold their subject. Reads the unpublished rows once.
update {table} u
   set relay_dead_at = coalesce(relay_dead_at, clock_timestamp()), relay_retry_at = 'infinity'
 where published_at is null
   and relay_skipped_at is null
   and {dead(u)}
   and relay_retry_at is distinct from 'infinity';

-- name: wake_relays
select pg_notify(%(channel)s, '');

-- name: idle_lock
-- Run on the LISTEN connection, with lock_timeout set: wait for every producer
-- that skipped its notify to finish, then hold the lock while asleep.
select pg_advisory_lock({idle_lock});

-- name: idle_unlock
select pg_advisory_unlock({idle_lock});

-- name: presence_lock
-- Run on the LISTEN connection once it listens: held, shared, for as long as the
-- session lasts, so that the relays sharing the table can be counted (table_health).
select pg_advisory_lock_shared({presence_lock});

-- name: pace_lock
-- Run on the LISTEN connection: the relay that gets it paces the table (claims as a
-- relay alone would), the others stand by. Held until the session ends or the relay
-- lets it go (while it cannot publish), so that another relay takes it then.
select pg_try_advisory_lock({pace_lock});

-- name: pace_unlock
select pg_advisory_unlock({pace_lock});

-- name: idle_sleeper
-- Another relay asleep (holding the lock exclusively) makes producers notify, so
-- this relay may sleep too. Two-key advisory locks show as objsubid 2.
select count(*)
  from pg_locks
 where locktype = 'advisory' and database = (select oid from pg_database
                                             where datname = current_database())
   and (classid, objid, objsubid) = ({idle_lock_key1}::oid, {idle_lock_key2}::oid, 2)
   and mode = 'ExclusiveLock' and granted and pid <> pg_backend_pid();

-- name: audit_lock
-- A relay audits only while it holds this (session) lock: one replica at a time.
select pg_try_advisory_lock({audit_lock});

-- name: audit_window
-- `outbox-relay audit`: the window, on the database's clock (published_at's). It
-- ends now, before the streams are read: a row marked after this may have been
-- stored after the read, and is left to the next audit. As exact text: psycopg reads
-- a timestamptz only in the ISO DateStyle.
select {exact_time(s)}, {exact_time(e)}
  from (select clock_timestamp() - make_interval(secs => %(since)s), clock_timestamp()) w (s, e);

-- name: audit_event_types
-- The event types published in the window, to find the streams that hold them.
-- Walks the published_at index over the window.
select distinct event_type
  from {table}
 where published_at >= %(start)s and published_at < %(end)s;

-- name: audit_published
-- Every row marked published in the window, oldest first (the published_at index),
-- read through a server-side cursor: a million rows are never held at once.
select id::text, event_type, subject, extract(epoch from published_at)::float8
  from {table}
 where published_at >= %(start)s and published_at < %(end)s
 order by published_at;

-- name: audit_rows
-- The missing rows to publish again, rendered as the claim renders them, in
-- publishing order.
select id::text, event_type, source, subject, {rfc3339_time(r)} as time,
       data::text as data, extract(epoch from created_at)::float8 as created_at,
       coalesce(relay_seq, 9223372036854775807) as relay_seq, attempts,
       traceparent, tracestate, headers::text
  from {table} r
 where id = any(%(ids)s::text[]::uuid[])
 order by created_at, relay_seq;

-- name: horizon_holders
-- What holds the MVCC horizon back for this table, oldest first, by kind: a session
-- with an xid (writer) or with only a snapshot (snapshot) of this database, a
-- standby's hot_standby_feedback (standby: its walsender, which has no database), a
-- replication slot's xmin (slot), a prepared transaction of this database
-- (prepared); and whether it holds a RowExclusiveLock on the table (it has written to
-- it: the claims wait for its commit, relay/writers.py). While one does, no vacuum
-- may remove what the relay's marks and retention leave behind. A session of
-- another role shows its state and transaction start only to a role with
-- pg_read_all_stats (visible is false, and both are null, otherwise). A logical
-- slot's catalog_xmin holds back the catalogs only, not this table.
with locks as materialized (
  select locktype, relation, transactionid, virtualtransaction, pid, mode, granted
    from pg_locks
),
table_locks as materialized (
  -- A prepared transaction's locks have no pid; its xid lock shares their
  -- virtual transaction.
  select l.pid, x.transactionid
    from locks l
    left join locks x on x.virtualtransaction = l.virtualtransaction
                     and x.locktype = 'transactionid' and x.mode = 'ExclusiveLock'
   where l.locktype = 'relation' and l.relation = %(table)s::regclass
     and l.mode = 'RowExclusiveLock' and l.granted
)
select kind, pid, name, state, xids, seconds, visible, wrote_table
  from (select case when backend_type = 'walsender' then 'standby'
                    when backend_xid is not null then 'writer'
                    else 'snapshot' end as kind,
               pid, application_name as name, state,
               greatest(age(backend_xmin), age(backend_xid)) as xids,
               extract(epoch from clock_timestamp() - xact_start)::float8 as seconds,
               state is not null or backend_type = 'walsender' as visible,
               exists (select 1 from table_locks l where l.pid = a.pid) as wrote_table
          from pg_stat_activity a
         where (backend_xmin is not null or backend_xid is not null)
           and pid <> pg_backend_pid()
           and (datname = current_database() or datid is null)
        union all
        select 'slot', active_pid, slot_name,
               case when active then 'active' else 'inactive' end, age(xmin), null, true, false
          from pg_replication_slots
         where xmin is not null
        union all
        select 'prepared', null, gid, 'prepared', age(transaction),
               extract(epoch from clock_timestamp() - prepared)::float8, true,
               exists (select 1 from table_locks l
                        where l.pid is null and l.transactionid = p.transaction)
          from pg_prepared_xacts p
         where database = current_database()) holders
 order by xids desc
 limit %(limit)s;

-- name: table_writers
-- The table's writers (relay/writers.py): transactions holding a granted
-- RowExclusiveLock on it (every insert, update and delete takes one and keeps it to
-- the end of its transaction) and an xid: a prepared one too, as its locks stay. Each
-- with its top-level xid with the epoch (pg_locks gives 32 bits, put back beside the
-- next xid, signed: a running xid is never 2^31 away) and its transaction's start
-- where this role may read it; and when this read began (before pg_locks was read).
-- One row with a null xid when there is none. pg_locks is read once.
with locks as materialized (
  select locktype, database, relation, transactionid, virtualtransaction, pid, mode, granted
    from pg_locks
),
next_xid as materialized (
  select pg_snapshot_xmax(pg_current_snapshot())::text::bigint as xid
),
writers as (
  select min(r.pid) as pid,
         min(n.xid - ((n.xid %% 4294967296 - x.transactionid::text::bigint + 6442450944)
                      %% 4294967296 - 2147483648)) as xid
    from locks r
    join locks x on x.virtualtransaction = r.virtualtransaction
                and x.locktype = 'transactionid' and x.mode = 'ExclusiveLock' and x.granted
   cross join next_xid n
   where r.locktype = 'relation' and r.relation = %(table)s::regclass
     and r.database = (select oid from pg_database where datname = current_database())
     and r.mode = 'RowExclusiveLock' and r.granted
   group by r.virtualtransaction
)
select {exact_time(polled_at)}, w.xid,
       (select {exact_time(xact_start)} from pg_stat_activity a
         where a.pid = w.pid and a.backend_xid::text::bigint = w.xid %% 4294967296)
  from (select statement_timestamp()) p (polled_at)
  left join writers w on true;

-- name: table_health
-- The table's dead tuples (the statistics' estimate), its size with its indexes
-- and TOAST, the next transaction id to be used (for relay/horizon.py's clock), and
-- how many relays share the table (their LISTEN sessions hold the presence lock).
-- A partitioned table's are its partitions' (pg_partition_tree has no row for a
-- plain table, and the partitioned table itself holds nothing).
with parts as (
  select %(table)s::regclass as relid
  union
  select relid from pg_partition_tree(%(table)s::regclass)
)
select coalesce((select sum(n_dead_tup) from pg_stat_user_tables
                  where relid in (select relid from parts)), 0)::bigint,
       (select sum(pg_total_relation_size(relid)) from parts)::bigint,
       pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
       (select count(*)
          from pg_locks
         where locktype = 'advisory' and database = (select oid from pg_database
                                                     where datname = current_database())
           and (classid, objid, objsubid) = ({presence_lock_key1}::oid, {idle_lock_key2}::oid, 2)
           and mode = 'ShareLock' and granted)::int;

-- name: sweep
-- Off the claim's path, now and then: whether a live row sits before where this
-- relay's claims start (a row put back by hand, a clock stepped back, a late row
-- inserted while the trigger was missing), which no claim would find. Walks the claim
-- index from its first entry, once.
select exists (
  select 1
    from {table} s
   where coalesce(s.published_at, s.relay_dead_at) is null
     and s.relay_late is not true
     and (s.created_at, s.relay_seq)
         < (least(%(start_at)s::timestamptz, %(bound_at)s::timestamptz - {late_insert}),
            case when %(start_at)s::timestamptz < %(bound_at)s::timestamptz - {late_insert}
                 then %(start_seq)s::bigint else -9223372036854775808 end));

-- name: validate_since
-- Where `outbox-relay validate --since` starts, on the database's clock, as exact
-- text (psycopg reads a timestamptz only in the ISO DateStyle).
select {exact_time(s)} from (select clock_timestamp() - make_interval(secs => %(since)s)) w (s);

-- name: validate_rows
-- `outbox-relay validate`: every row written since %(since)s (all rows when null),
-- published or not, read through a server-side cursor in table order (no sort, no
-- lock): a table of millions is never held at once.
select id::text, event_type, data::text
  from {table}
 where %(since)s::timestamptz is null or created_at >= %(since)s::timestamptz;
