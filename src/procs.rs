//! Other processes as /proc shows them: state, parent, owner, start time, name, RSS. What
//! `info`, `watch` and `clean` need to tell a live process from a stopped, dead or orphaned one.
use std::fs;

use serde::{Deserialize, Serialize};

/// One process, read at one moment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    pub pid: u32,
    pub ppid: u32,
    /// /proc/PID/stat's state letter: R, S, D, T (stopped), t (traced), Z (zombie), ...
    pub state: char,
    /// Clock ticks since boot when it started: with the pid, it names one process for good.
    pub started: u64,
    pub uid: u32,
    pub name: String,
    pub rss_bytes: u64,
}

impl Proc {
    /// None when no such process exists (or it ended while being read).
    pub fn read(pid: u32) -> Option<Proc> {
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // The name sits in parentheses and may hold spaces or parentheses itself: split at the last.
        let open = stat.find('(')?;
        let close = stat.rfind(')')?;
        let name = stat[open + 1..close].to_owned();
        let rest: Vec<&str> = stat[close + 1..].split_whitespace().collect();
        // Fields after the name, from field 3 (state): ppid is 4, starttime 22, rss (pages) 24.
        let field = |n: usize| rest.get(n - 3).copied();
        let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|r| r.split_whitespace().next()?.parse().ok())?;
        Some(Proc {
            pid,
            ppid: field(4)?.parse().ok()?,
            state: field(3)?.chars().next()?,
            started: field(22)?.parse().ok()?,
            uid,
            name,
            rss_bytes: field(24)?.parse::<u64>().ok()? * crate::sysmem::page_size(),
        })
    }

    /// Whether the process `pid` that started at `started` still runs (not a zombie, and not
    /// another process that reused the pid).
    pub fn alive(pid: u32, started: u64) -> bool {
        Proc::read(pid).is_some_and(|p| p.started == started && p.state != 'Z')
    }

    pub fn state(&self) -> Option<Stale> {
        match self.state {
            'T' | 't' => Some(Stale::Stopped),
            'Z' => Some(Stale::Zombie),
            _ => None,
        }
    }

    pub fn user(&self) -> String {
        user_name(self.uid)
    }
}

/// Why a process that holds memory should probably not be holding it any more.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stale {
    /// Stopped (Ctrl-Z, SIGSTOP, a debugger): holds its memory and makes no progress.
    Stopped,
    /// Ended, not yet reaped by its parent.
    Zombie,
    /// A memtrain run or rank whose launcher (the process that started it) has gone.
    Orphaned,
}

impl Stale {
    pub fn name(self) -> &'static str {
        match self {
            Stale::Stopped => "stopped",
            Stale::Zombie => "zombie",
            Stale::Orphaned => "orphaned",
        }
    }
}

/// This process's real user id.
pub fn my_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

/// The login name of `uid` from /etc/passwd, else the number.
pub fn user_name(uid: u32) -> String {
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    passwd
        .lines()
        .find_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            (f.nth(1)?.parse::<u32>().ok()? == uid).then(|| name.to_owned())
        })
        .unwrap_or_else(|| uid.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_reads_back_alive_and_owned_by_its_user() {
        let me = Proc::read(std::process::id()).unwrap();
        assert_eq!(me.uid, my_uid());
        assert!(me.rss_bytes > 0);
        assert_eq!(me.state(), None, "a running test is not stopped: {me:?}");
        assert!(Proc::alive(me.pid, me.started));
        assert!(
            !Proc::alive(me.pid, me.started + 1),
            "another start time is another process"
        );
        assert_eq!(me.ppid, std::os::unix::process::parent_id());
    }
}
