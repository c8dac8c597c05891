//! [`ScriptCall`]: one `EVALSHA` of a Lua script, its keys and arguments each kept in one
//! buffer.
//!
//! `redis::ScriptInvocation` keeps a `Vec<u8>` per key and per argument and copies them all
//! into the command it sends; a flush passes an argument per membership and per delta (a
//! catch-up of 1,000,000 likes: about 1,000,000 of them), and those allocations and copies were
//! a tenth of the aggregator's CPU. Here each list is a `redis::Cmd` used as a buffer (one
//! allocation per list), copied once into the command.

use redis::{Arg, Cmd, ErrorKind, FromRedisValue, RedisResult, ServerErrorKind, ToRedisArgs};

/// Room made per key by [`ScriptCall::with_capacity`]: a prefix, a group and a counter id.
const KEY_BYTES: usize = 40;
/// Room made per argument: a delta, an actor id.
const ARG_BYTES: usize = 12;

/// One call of `script`: add its keys and arguments, in any interleaving (each list keeps its
/// own order), then [`ScriptCall::invoke`].
#[derive(Debug)]
pub struct ScriptCall<'a> {
    script: &'a redis::Script,
    keys: Cmd,
    args: Cmd,
}

impl<'a> ScriptCall<'a> {
    /// A call of `script` with no keys and no arguments yet.
    pub fn new(script: &'a redis::Script) -> Self {
        Self {
            script,
            keys: Cmd::new(),
            args: Cmd::new(),
        }
    }

    /// A call of `script` with room for about `keys` keys and `args` arguments, so that its
    /// buffers are not copied as they grow (a flush knows its counts before it starts).
    pub fn with_capacity(script: &'a redis::Script, keys: usize, args: usize) -> Self {
        Self {
            script,
            keys: Cmd::with_capacity(keys, keys * KEY_BYTES),
            args: Cmd::with_capacity(args, args * ARG_BYTES),
        }
    }

    /// Adds a key (`KEYS[i]` in the script).
    pub fn key<T: ToRedisArgs>(&mut self, key: T) -> &mut Self {
        self.keys.arg(key);
        self
    }

    /// Adds an argument (`ARGV[i]` in the script).
    pub fn arg<T: ToRedisArgs>(&mut self, arg: T) -> &mut Self {
        self.args.arg(arg);
        self
    }

    /// Runs the script by its hash, loading it first if Redis does not know it (as
    /// `redis::ScriptInvocation::invoke_async` does).
    pub async fn invoke<T: FromRedisValue>(
        &self,
        conn: &mut impl redis::aio::ConnectionLike,
    ) -> RedisResult<T> {
        let cmd = self.command();
        match cmd.query_async(conn).await {
            Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
                self.script.load_async(conn).await?;
                cmd.query_async(conn).await
            }
            result => result,
        }
    }

    /// Loads the script into Redis (`SCRIPT LOAD`), for an `EVALSHA` sent by other means.
    pub async fn load(&self, conn: &mut impl redis::aio::ConnectionLike) -> RedisResult<()> {
        self.script.load_async(conn).await.map(drop)
    }

    /// `EVALSHA hash numkeys key... arg...`.
    pub fn command(&self) -> Cmd {
        let keys = self.keys.args_iter();
        let args = self.args.args_iter();
        let bytes: usize = (keys.clone().chain(args.clone()))
            .map(|arg| match arg {
                Arg::Simple(bytes) => bytes.len(),
                _ => 0,
            })
            .sum();
        let mut cmd = Cmd::with_capacity(3 + keys.len() + args.len(), 64 + bytes);
        cmd.arg("EVALSHA")
            .arg(self.script.get_hash())
            .arg(keys.len());
        for arg in keys.chain(args) {
            if let Arg::Simple(bytes) = arg {
                cmd.arg(bytes);
            }
        }
        cmd
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_come_before_arguments_each_in_their_order() {
        let script = redis::Script::new("return 1");
        let mut call = ScriptCall::new(&script);
        call.key("k1").arg("a1").arg(2).key("k2").arg("");
        let sent: Vec<Vec<u8>> = (call.command().args_iter())
            .map(|a| match a {
                Arg::Simple(b) => b.to_vec(),
                _ => panic!("only simple arguments"),
            })
            .collect();
        let hash = script.get_hash().as_bytes().to_vec();
        let expected: Vec<Vec<u8>> = vec![
            b"EVALSHA".to_vec(),
            hash,
            b"2".to_vec(),
            b"k1".to_vec(),
            b"k2".to_vec(),
            b"a1".to_vec(),
            b"2".to_vec(),
            Vec::new(),
        ];
        assert_eq!(sent, expected);
    }
}
