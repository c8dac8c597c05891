-- tally's PostgreSQL store, version 2: one like per actor.
-- An actor is in a counter's members while its like counts (namespaces with dedup = true).
CREATE TABLE {schema}.members (
    counter text NOT NULL,
    actor   text NOT NULL,
    PRIMARY KEY (counter, actor)
);
