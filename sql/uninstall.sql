-- Removes what the relay added for waking and bookkeeping speed: the trigger, its
-- function and the relay's two indexes. Never the table or its rows, and not the
-- relay_* columns either: they hold backoff state and the last error of stuck
-- rows (drop them by hand once no relay runs, if you must).
drop trigger if exists {notify_trigger} on {table};
drop function if exists {notify_function}();
drop index if exists {retry_idx_qualified};
drop index if exists {old_backoff_idx_qualified};
drop index if exists {published_idx_qualified};
