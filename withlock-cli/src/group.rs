//! The command's process group: who is still in it, signals to it, and
//! the sweep that ends it before the lock is released.
//!
//! The group's id is the supervisor's process id. Whoever sweeps keeps
//! that process from being reaped until the sweep is over (`run` waits
//! for it with `WNOWAIT`; the supervisor sweeps while alive), so the id
//! cannot be given to another process, and so to another group, while
//! signals are sent to it.

use std::io;
use std::time::Duration;

use nix::errno::Errno;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use tokio::time::Instant;

/// How often a sweep looks whether the group is empty.
const POLL: Duration = Duration::from_millis(20);
/// How long a sweep waits for processes that got SIGKILL to be gone.
const AFTER_KILL: Duration = Duration::from_secs(5);

/// Sends `signal` to the process group `group`. A group that is gone
/// already (`ESRCH`) is what we wanted; nothing else can fail here for a
/// group this process made.
pub(crate) fn signal(group: Pid, signal: Signal) {
    if let Err(error) = killpg(group, signal) {
        if error != Errno::ESRCH {
            eprintln!("withlock: could not send {signal} to the command: {error}");
        }
    }
}

/// Whether a process other than `except` (and other than a zombie) is in
/// `group`. Read from `/proc`; where it cannot be read, any process the
/// group still has counts, a zombie leader too.
pub(crate) fn has_members(group: Pid, except: Option<Pid>) -> bool {
    match members(group, except) {
        Ok(found) => found,
        Err(_) => killpg(group, None).is_ok(),
    }
}

/// Whether `/proc` shows a live process of `group` other than `except`.
fn members(group: Pid, except: Option<Pid>) -> io::Result<bool> {
    for entry in std::fs::read_dir("/proc")? {
        let Ok(entry) = entry else { continue };
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if Some(Pid::from_raw(pid)) == except {
            continue;
        }
        // Gone since the directory was listed: not a member.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((state, pgrp)) = state_and_group(&stat) {
            if pgrp == group.as_raw() && state != 'Z' && state != 'X' {
                return Ok(true);
            }
        }
    }
    Ok(false)
}

/// The state and the process group of a `/proc/PID/stat` line:
/// `pid (comm) state ppid pgrp …`, where `comm` may hold anything.
fn state_and_group(stat: &str) -> Option<(char, i32)> {
    let (_, rest) = stat.rsplit_once(')')?;
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let _ppid = fields.next()?;
    let pgrp = fields.next()?.parse().ok()?;
    Some((state, pgrp))
}

/// What a sweep had to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Swept {
    /// The group was empty already.
    Empty,
    /// Processes were left; SIGTERM ended them.
    Terminated,
    /// Processes were left past the grace; SIGKILL ended them (or they
    /// were still there `AFTER_KILL` later, which only a process stuck in
    /// the kernel does).
    Killed,
}

/// Ends what is left in `group` (but `except`): SIGTERM unless `kill_at`
/// has passed, then SIGKILL at `kill_at`; returns once the group is
/// empty.
pub(crate) async fn sweep(group: Pid, except: Option<Pid>, kill_at: Instant) -> Swept {
    if !has_members(group, except) {
        return Swept::Empty;
    }
    if Instant::now() < kill_at {
        signal(group, Signal::SIGTERM);
        if emptied(group, except, kill_at).await {
            return Swept::Terminated;
        }
    }
    kill(group, except).await;
    Swept::Killed
}

/// SIGKILL to `group`, then waits (bounded) until it is empty.
pub(crate) async fn kill(group: Pid, except: Option<Pid>) {
    signal(group, Signal::SIGKILL);
    emptied(group, except, Instant::now() + AFTER_KILL).await;
}

/// Waits until `group` has no member but `except`, or `until`; says
/// whether it emptied.
async fn emptied(group: Pid, except: Option<Pid>, until: Instant) -> bool {
    loop {
        if !has_members(group, except) {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(POLL.min(until - Instant::now())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_lines_with_odd_names_parse() {
        assert_eq!(state_and_group("42 (sh) S 1 42 42 0 -1"), Some(('S', 42)));
        assert_eq!(state_and_group("7 (a) b (c) Z 1 9 9 0"), Some(('Z', 9)));
        assert_eq!(state_and_group("garbage"), None);
    }

    #[test]
    fn this_process_is_in_its_own_group() {
        let me = nix::unistd::getpid();
        let group = nix::unistd::getpgrp();
        assert!(has_members(group, None));
        // A group id no process has.
        assert!(!has_members(Pid::from_raw(i32::MAX - 1), Some(me)));
    }
}
