//! Exit codes, and the one-line failure a command ends with.

use std::error::Error as StdError;

/// Bad arguments; nothing was touched (`EX_USAGE`).
pub(crate) const USAGE: u8 = 64;
/// The backend could not be reached or failed; the command did not run
/// (`EX_UNAVAILABLE`). Also `list` on a store of which a part (a Redis
/// Cluster master) did not answer: the rest is printed, not the whole.
pub(crate) const UNAVAILABLE: u8 = 69;
/// `release --force` refused: the key is not a withlock lock and was left
/// untouched (`EX_DATAERR`: the key's data is not what was asked for).
pub(crate) const NOT_A_LOCK: u8 = 65;
/// A bug or an unexpected local failure (`EX_SOFTWARE`).
pub(crate) const SOFTWARE: u8 = 70;
/// The lock was busy; the command did not run (`EX_TEMPFAIL`). The
/// default of `--busy-exit`.
pub(crate) const BUSY: u8 = 75;
/// The store refused the credentials or a permission the command needs;
/// trying again cannot help (`EX_NOPERM`).
pub(crate) const NO_PERMISSION: u8 = 77;
/// The store is not set up as the command needs: no such database,
/// schema or table, a database index out of range, a column of the wrong
/// type (`EX_CONFIG`).
pub(crate) const CONFIG: u8 = 78;
/// The lock was lost while the command ran. Outside the sysexits range
/// (64–78) and below the shell's own codes (126 and up).
pub(crate) const LOST: u8 = 79;
// sysexits.h ends at EX_CONFIG (78); shells use 126 and up.
const _: () = assert!(LOST > 78 && LOST < 126);
/// The command was found but could not be executed (as `env`, `nohup`).
pub(crate) const CANNOT_EXECUTE: u8 = 126;
/// The command was not found (as `env`, `nohup`).
pub(crate) const NOT_FOUND: u8 = 127;
/// The command ran past `--max-runtime` and was terminated (as
/// `timeout(1)`).
pub(crate) const TIMED_OUT: u8 = 124;

/// The exit code for death by signal `signal`, as shells report it.
pub(crate) fn signalled(signal: i32) -> u8 {
    u8::try_from(128 + signal).unwrap_or(u8::MAX)
}

/// Why a command ends early: an exit code and one line for stderr.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(code: u8, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }

    pub(crate) fn usage(message: impl Into<String>) -> Self {
        Self::new(USAGE, message)
    }

    /// The backend failed: `what`, then the error's whole source chain;
    /// 77 or 78 for a refusal that trying again cannot mend, else 69.
    pub(crate) fn backend(what: &str, error: &(dyn StdError + 'static)) -> Self {
        crate::setup::failure(what, error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_do_not_clash() {
        let mut codes = vec![
            USAGE,
            NOT_A_LOCK,
            UNAVAILABLE,
            SOFTWARE,
            BUSY,
            NO_PERMISSION,
            CONFIG,
            LOST,
            TIMED_OUT,
            CANNOT_EXECUTE,
        ];
        codes.push(NOT_FOUND);
        let all = codes.len();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), all);
        assert_eq!(signalled(15), 143);
    }
}
