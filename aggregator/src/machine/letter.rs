//! A message that goes to the dead-letter topic, as the state machine and the batch hold it.

use tally_common::DeadLetterReason;

/// A malformed message, copied out of the consumer's buffer.
#[derive(Debug, Clone)]
pub struct DeadLetter {
    /// The original key.
    pub key: Option<Vec<u8>>,
    /// The original payload.
    pub payload: Option<Vec<u8>>,
    /// Why.
    pub reason: DeadLetterReason,
    /// The full error message.
    pub error: String,
    /// Where it came from.
    pub partition: i32,
    /// Its offset.
    pub offset: i64,
}
