-- tally's PostgreSQL store, version 3: room on each page for updated rows.
-- Every flush updates share rows and each partition's ledger row in place; with free space on
-- the page the new row version stays there (a HOT update: no index entry, cheap to vacuum).
-- Applies to pages written from now on.
ALTER TABLE {schema}.shares SET (fillfactor = 85);
ALTER TABLE {schema}.partitions SET (fillfactor = 50);
