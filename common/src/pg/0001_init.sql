-- tally's PostgreSQL store, version 1: counter shares and the exactly-once bookkeeping.
-- {schema} is the deployment's schema, named by its key prefix.

-- A counter's share in one shard group; its total is the sum over its shards.
CREATE TABLE {schema}.shares (
    counter text    NOT NULL,
    shard   integer NOT NULL,
    value   bigint  NOT NULL,
    PRIMARY KEY (counter, shard)
);

-- Per partition (field = "<topic>/<partition>") and shard group: the epoch of its current owner
-- (fence) and the offset after the last message applied in that group (ledger).
CREATE TABLE {schema}.partitions (
    field  text    NOT NULL,
    shard  integer NOT NULL,
    fence  bigint,
    ledger bigint,
    PRIMARY KEY (field, shard)
);

-- Per partition: the last epoch handed out.
CREATE TABLE {schema}.epochs (
    field text   PRIMARY KEY,
    epoch bigint NOT NULL
);

-- Per partition: where it resumes, and the groups' ledgers when that was stored.
CREATE TABLE {schema}.watermarks (
    field     text PRIMARY KEY,
    watermark text NOT NULL
);
