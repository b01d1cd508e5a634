//! `--log-format`: a line on stderr when the command starts and one when
//! the run ends, so that the journal or syslog tells which host ran the
//! job. Off unless asked for, so that a host that ran the job is as quiet
//! as one that found the lock busy.

use std::time::Duration;

use serde_json::json;

use crate::args::LogFormat;
use crate::format::{ttl_text, Shown};

/// Who runs, for the record lines.
#[derive(Debug)]
pub(crate) struct Record {
    format: Option<LogFormat>,
    key: String,
    host: String,
    node: String,
}

/// How a run ended, for the last line.
#[derive(Debug, Default)]
pub(crate) struct Ended<'a> {
    /// The fencing token, if the lock was taken.
    pub(crate) token: Option<u64>,
    /// How long the wait for the lock took.
    pub(crate) waited: Duration,
    /// How long the command ran, if it did.
    pub(crate) ran: Option<Duration>,
    /// withlock's exit code.
    pub(crate) exit: u8,
    /// Why it ended other than by the command exiting with the lock held
    /// (`busy`, `lost: …`, `max-runtime`, …).
    pub(crate) cause: Option<&'a str>,
}

impl Record {
    pub(crate) fn new(format: Option<LogFormat>, key: &str, host: String, node: &str) -> Self {
        Self {
            format,
            key: key.to_owned(),
            host,
            node: node.to_owned(),
        }
    }

    /// The command has started under the lock.
    pub(crate) fn started(&self, token: u64, waited: Duration) {
        match self.format {
            None => {}
            Some(LogFormat::Text) => eprintln!(
                "withlock: {} started on host {} as node {} (fencing token {token}, waited {})",
                Shown(&self.key),
                self.host,
                Shown(&self.node),
                ttl_text(waited)
            ),
            Some(LogFormat::Json) => eprintln!(
                "{}",
                json!({
                    "event": "started",
                    "key": self.key,
                    "host": self.host,
                    "node": self.node,
                    "token": token,
                    "waited_ms": millis(waited),
                })
            ),
        }
    }

    /// The run is over.
    pub(crate) fn ended(&self, ended: &Ended<'_>) {
        match self.format {
            None => {}
            Some(LogFormat::Text) => {
                let ran = ended.ran.map_or_else(
                    || "did not run".to_owned(),
                    |r| format!("ran {}", ttl_text(r)),
                );
                let cause = ended.cause.map(|c| format!(", {c}")).unwrap_or_default();
                eprintln!(
                    "withlock: {} ended on host {} as node {}: {ran}, exit {}{cause}",
                    Shown(&self.key),
                    self.host,
                    Shown(&self.node),
                    ended.exit
                );
            }
            Some(LogFormat::Json) => eprintln!(
                "{}",
                json!({
                    "event": "ended",
                    "key": self.key,
                    "host": self.host,
                    "node": self.node,
                    "token": ended.token,
                    "waited_ms": millis(ended.waited),
                    "ran_ms": ended.ran.map(millis),
                    "exit": ended.exit,
                    "cause": ended.cause,
                })
            ),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
