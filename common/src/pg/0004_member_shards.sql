-- tally's PostgreSQL store, version 4: each like remembers the shard it was counted in.
-- A reset clears a counter one shard group at a time (one transaction each), so each group must
-- find the members whose likes its share holds. Rows from before this version have no shard:
-- the first group to reset their counter clears them, as their likes are cleared with it.
ALTER TABLE {schema}.members ADD COLUMN shard integer;
