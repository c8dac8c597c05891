//! What a store's error says, one table per store: Redis by its error code (the first word of its
//! error reply), PostgreSQL by its SQLSTATE.
//!
//! **No error refuses a delta.** A delta is refused (and its events dead-lettered) only by a
//! check of the data itself: the flush script or the transaction reads the key and finds another
//! type, a string that is not a 64-bit integer, or a sum past 64 bits (`scripts/flush.lua`,
//! `crate::store::transactions`, `crate::store::pg_sink`, and at least once `crate::store::redis_sink`'s reading of
//! the transaction's per-command replies). Every error, whatever its class, fails the whole
//! write with nothing of it applied (at least once, see `Sink::apply` for the one exception),
//! and the flush retries it with capped backoff until the store takes it; its offsets do not
//! move meanwhile. The class only says what to tell the
//! operator: whether the store is expected to heal by itself ([`ErrorClass::Unavailable`]),
//! needs someone to act ([`ErrorClass::Permission`], [`ErrorClass::Data`]), or said something
//! this table does not know ([`ErrorClass::Unknown`]), which is retried like the rest.

use std::fmt;

/// What an error says about the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// The store cannot take the write now and is expected to by itself: a lost, refused or
    /// timed-out connection, out of memory, read-only (a replica, a failover), loading, busy,
    /// paused, a cluster redirect or a master down, a serialization failure or a deadlock.
    Unavailable,
    /// The store's user lacks a permission the write needs (an ACL, a grant): an operator must
    /// give it back; retried meanwhile.
    Permission,
    /// The store's data or schema cannot take the write as it stands (a key of another type met
    /// outside a checked path, a missing table): an operator must look; retried meanwhile.
    Data,
    /// Not in the table: retried, never taken as the event's fault.
    Unknown,
}

impl ErrorClass {
    /// Whether the store is expected to heal without an operator.
    pub fn heals_by_itself(self) -> bool {
        self == ErrorClass::Unavailable
    }
}

/// Redis's error codes, by class. `ERR` is the catch-all code, told apart by its text below.
const REDIS_CODES: &[(&str, ErrorClass)] = &[
    ("OOM", ErrorClass::Unavailable),
    ("READONLY", ErrorClass::Unavailable),
    ("LOADING", ErrorClass::Unavailable),
    ("BUSY", ErrorClass::Unavailable),
    ("MASTERDOWN", ErrorClass::Unavailable),
    ("CLUSTERDOWN", ErrorClass::Unavailable),
    ("TRYAGAIN", ErrorClass::Unavailable),
    ("MOVED", ErrorClass::Unavailable),
    ("ASK", ErrorClass::Unavailable),
    ("NOSCRIPT", ErrorClass::Unavailable),
    ("MISCONF", ErrorClass::Unavailable),
    ("NOREPLICAS", ErrorClass::Unavailable),
    ("EXECABORT", ErrorClass::Unavailable),
    ("UNBLOCKED", ErrorClass::Unavailable),
    ("NOPERM", ErrorClass::Permission),
    ("NOAUTH", ErrorClass::Permission),
    ("WRONGPASS", ErrorClass::Permission),
    ("WRONGTYPE", ErrorClass::Data),
];

/// The text of Redis's `ERR` for an `INCRBY` on a string it does not read as an integer (also
/// matched, word for word, in `scripts/flush.lua`).
pub const ERR_NOT_AN_INTEGER: &str = "value is not an integer or out of range";

/// The text of Redis's `ERR` for an `HINCRBY` of a field it does not read as an integer (also
/// in `scripts/flush.lua`).
pub const ERR_FIELD_NOT_AN_INTEGER: &str = "hash value is not an integer";

/// The text of Redis's `ERR` for an `INCRBY` whose sum would pass 64 bits (also in
/// `scripts/flush.lua`).
pub const ERR_OVERFLOW: &str = "increment or decrement would overflow";

/// `ERR` replies by a piece of their text.
const REDIS_ERR_TEXTS: &[(&str, ErrorClass)] = &[
    ("max number of clients reached", ErrorClass::Unavailable),
    ("unknown command", ErrorClass::Permission),
    // A script's call that the ACL refuses (Redis 7).
    (
        "can't run this command or subcommand",
        ErrorClass::Permission,
    ),
    (ERR_NOT_AN_INTEGER, ErrorClass::Data),
    (ERR_FIELD_NOT_AN_INTEGER, ErrorClass::Data),
    (ERR_OVERFLOW, ErrorClass::Data),
];

/// The class of a Redis error reply, `code` being its first word and `detail` the rest.
pub fn redis_class(code: &str, detail: &str) -> ErrorClass {
    if code == "ERR" {
        return (REDIS_ERR_TEXTS.iter())
            .find(|(text, _)| detail.contains(text))
            .map_or(ErrorClass::Unknown, |(_, class)| *class);
    }
    (REDIS_CODES.iter())
        .find(|(known, _)| *known == code)
        .map_or(ErrorClass::Unknown, |(_, class)| *class)
}

/// The class of an error from redis-rs: a server's reply by [`redis_class`]; the connection's
/// own failures (I/O, timeout, dropped, refused) are [`ErrorClass::Unavailable`].
pub fn redis_error_class(e: &redis::RedisError) -> ErrorClass {
    if e.is_io_error()
        || e.is_timeout()
        || e.is_connection_dropped()
        || e.is_connection_refusal()
        || e.is_unrecoverable_error()
        || e.kind() == redis::ErrorKind::ClusterConnectionNotFound
    {
        return ErrorClass::Unavailable;
    }
    match e.code() {
        Some(code) => redis_class(code, e.detail().unwrap_or("")),
        None => ErrorClass::Unknown,
    }
}

/// An error reply that a script caught and returned (`{'failed', error}`): the reply's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisReply(pub String);

impl RedisReply {
    /// Its class, from its first word.
    pub fn class(&self) -> ErrorClass {
        let (code, detail) = self.0.split_once(' ').unwrap_or((&self.0, ""));
        redis_class(code, detail)
    }
}

impl fmt::Display for RedisReply {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Redis answered inside the flush script: {}", self.0)
    }
}

impl std::error::Error for RedisReply {}

/// PostgreSQL's SQLSTATEs and classes (their first two characters), by class. An exact code is
/// looked up before its class.
const PG_STATES: &[(&str, ErrorClass)] = &[
    // Connection exceptions, the server shutting down or starting, resources.
    ("08", ErrorClass::Unavailable),
    ("57P01", ErrorClass::Unavailable), // admin_shutdown
    ("57P02", ErrorClass::Unavailable), // crash_shutdown
    ("57P03", ErrorClass::Unavailable), // cannot_connect_now
    ("57P05", ErrorClass::Unavailable), // idle_session_timeout
    ("57014", ErrorClass::Unavailable), // query_canceled
    ("53", ErrorClass::Unavailable),    // disk_full, out_of_memory, too_many_connections
    ("40", ErrorClass::Unavailable),    // serialization_failure, deadlock_detected
    ("25006", ErrorClass::Unavailable), // read_only_sql_transaction
    ("25P03", ErrorClass::Unavailable), // idle_in_transaction_session_timeout
    ("55P03", ErrorClass::Unavailable), // lock_not_available
    ("55006", ErrorClass::Unavailable), // object_in_use
    ("58", ErrorClass::Unavailable),    // system_error, io_error
    ("HV", ErrorClass::Unavailable),    // foreign data wrapper errors
    // Privileges and authentication.
    ("42501", ErrorClass::Permission), // insufficient_privilege
    ("28", ErrorClass::Permission),    // invalid authorization
    // The data or the schema.
    ("22", ErrorClass::Data), // data exceptions (numeric_value_out_of_range, ...)
    ("23", ErrorClass::Data), // integrity constraint violations
    ("42", ErrorClass::Data), // syntax error or access rule violation (a missing table)
    ("3D", ErrorClass::Data), // invalid catalog name
    ("3F", ErrorClass::Data), // invalid schema name
];

/// The class of a PostgreSQL SQLSTATE.
pub fn pg_class(sqlstate: &str) -> ErrorClass {
    let exact = PG_STATES.iter().find(|(state, _)| *state == sqlstate);
    let class =
        || (PG_STATES.iter()).find(|(state, _)| state.len() == 2 && sqlstate.starts_with(state));
    exact
        .or_else(class)
        .map_or(ErrorClass::Unknown, |(_, class)| *class)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Error replies as redis-server 7 sends them, each with its class.
    const REDIS_REPLIES: &[(&str, ErrorClass)] = &[
        (
            "OOM command not allowed when used memory > 'maxmemory'.",
            ErrorClass::Unavailable,
        ),
        (
            "READONLY You can't write against a read only replica.",
            ErrorClass::Unavailable,
        ),
        (
            "LOADING Redis is loading the dataset in memory",
            ErrorClass::Unavailable,
        ),
        (
            "BUSY Redis is busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE.",
            ErrorClass::Unavailable,
        ),
        (
            "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
            ErrorClass::Unavailable,
        ),
        ("CLUSTERDOWN The cluster is down", ErrorClass::Unavailable),
        ("CLUSTERDOWN Hash slot not served", ErrorClass::Unavailable),
        (
            "TRYAGAIN Multiple keys request during rehashing of slot",
            ErrorClass::Unavailable,
        ),
        ("MOVED 3999 127.0.0.1:6381", ErrorClass::Unavailable),
        ("ASK 3999 127.0.0.1:6381", ErrorClass::Unavailable),
        (
            "NOSCRIPT No matching script. Please use EVAL.",
            ErrorClass::Unavailable,
        ),
        (
            "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
            ErrorClass::Unavailable,
        ),
        (
            "NOREPLICAS Not enough good replicas to write.",
            ErrorClass::Unavailable,
        ),
        (
            "EXECABORT Transaction discarded because of previous errors.",
            ErrorClass::Unavailable,
        ),
        ("ERR max number of clients reached", ErrorClass::Unavailable),
        (
            "NOPERM User tally has no permissions to run the 'incrby' command",
            ErrorClass::Permission,
        ),
        (
            "NOPERM this user has no permissions to access one of the keys used as arguments",
            ErrorClass::Permission,
        ),
        ("NOAUTH Authentication required.", ErrorClass::Permission),
        (
            "WRONGPASS invalid username-password pair or user is disabled.",
            ErrorClass::Permission,
        ),
        (
            "ERR The user executing the script can't run this command or subcommand",
            ErrorClass::Permission,
        ),
        (
            "NOPERM the flush script may not run INCRBY on c1: its user lacks the permission",
            ErrorClass::Permission,
        ),
        (
            "ERR unknown command 'EVALSHA', with args beginning with: ",
            ErrorClass::Permission,
        ),
        (
            "WRONGTYPE Operation against a key holding the wrong kind of value",
            ErrorClass::Data,
        ),
        (
            "ERR value is not an integer or out of range",
            ErrorClass::Data,
        ),
        (
            "ERR increment or decrement would overflow",
            ErrorClass::Data,
        ),
        ("ERR something new", ErrorClass::Unknown),
        ("NEWCODE from a newer server", ErrorClass::Unknown),
        ("", ErrorClass::Unknown),
    ];

    #[test]
    fn each_redis_reply_has_its_class() {
        for (reply, class) in REDIS_REPLIES {
            assert_eq!(RedisReply((*reply).to_owned()).class(), *class, "{reply}");
        }
    }

    #[test]
    fn redis_rs_errors_take_the_same_classes() {
        let io = redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::BrokenPipe));
        assert_eq!(redis_error_class(&io), ErrorClass::Unavailable);
        let refused =
            redis::RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert_eq!(redis_error_class(&refused), ErrorClass::Unavailable);
        let read_only = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "READONLY",
            "You can't write against a read only replica.".to_owned(),
        ));
        assert_eq!(redis_error_class(&read_only), ErrorClass::Unavailable);
        let no_perm = redis::RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::NoPerm),
            "NOPERM",
            "User tally has no permissions to run the 'hset' command".to_owned(),
        ));
        assert_eq!(redis_error_class(&no_perm), ErrorClass::Permission);
    }

    /// SQLSTATEs as PostgreSQL sends them, each with its class.
    const PG_CODES: &[(&str, ErrorClass)] = &[
        ("08006", ErrorClass::Unavailable), // connection_failure
        ("08001", ErrorClass::Unavailable), // sqlclient_unable_to_establish_sqlconnection
        ("57P01", ErrorClass::Unavailable), // admin_shutdown
        ("57P02", ErrorClass::Unavailable), // crash_shutdown
        ("57P03", ErrorClass::Unavailable), // cannot_connect_now
        ("57014", ErrorClass::Unavailable), // query_canceled
        ("53300", ErrorClass::Unavailable), // too_many_connections
        ("53100", ErrorClass::Unavailable), // disk_full
        ("53200", ErrorClass::Unavailable), // out_of_memory
        ("40001", ErrorClass::Unavailable), // serialization_failure
        ("40P01", ErrorClass::Unavailable), // deadlock_detected
        ("25006", ErrorClass::Unavailable), // read_only_sql_transaction
        ("55P03", ErrorClass::Unavailable), // lock_not_available
        ("58030", ErrorClass::Unavailable), // io_error
        ("42501", ErrorClass::Permission),  // insufficient_privilege
        ("28P01", ErrorClass::Permission),  // invalid_password
        ("22003", ErrorClass::Data),        // numeric_value_out_of_range
        ("23505", ErrorClass::Data),        // unique_violation
        ("42P01", ErrorClass::Data),        // undefined_table
        ("XX000", ErrorClass::Unknown),     // internal_error
        ("P0001", ErrorClass::Unknown),     // raise_exception
        ("57P04", ErrorClass::Unknown),     // database_dropped
    ];

    #[test]
    fn each_sqlstate_has_its_class() {
        for (state, class) in PG_CODES {
            assert_eq!(pg_class(state), *class, "{state}");
        }
        // The constants tokio-postgres names agree with the strings above.
        use tokio_postgres::error::SqlState;
        for (state, class) in [
            (SqlState::READ_ONLY_SQL_TRANSACTION, ErrorClass::Unavailable),
            (SqlState::TOO_MANY_CONNECTIONS, ErrorClass::Unavailable),
            (SqlState::ADMIN_SHUTDOWN, ErrorClass::Unavailable),
            (SqlState::T_R_SERIALIZATION_FAILURE, ErrorClass::Unavailable),
            (SqlState::T_R_DEADLOCK_DETECTED, ErrorClass::Unavailable),
            (SqlState::DISK_FULL, ErrorClass::Unavailable),
            (SqlState::NUMERIC_VALUE_OUT_OF_RANGE, ErrorClass::Data),
        ] {
            assert_eq!(pg_class(state.code()), class, "{state:?}");
        }
    }
}
