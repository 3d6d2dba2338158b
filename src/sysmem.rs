//! Host memory as the kernel reports it: RAM totals, this process's RSS and its high-water mark,
//! and the data-segment limit that emulates a small memory on the CPU.
use std::fs;

use anyhow::{Context, Result};
use serde::Serialize;

#[derive(Debug, Clone, Copy, Serialize, Default)]
pub struct HostMemory {
    pub ram_total_bytes: u64,
    pub ram_available_bytes: u64,
}

/// A `kB` field of /proc/meminfo or /proc/self/status, in bytes.
fn kb_field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
        .and_then(|rest| rest.split_whitespace().next()?.parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

pub fn host_memory() -> Result<HostMemory> {
    let text = fs::read_to_string("/proc/meminfo").context("reading /proc/meminfo")?;
    Ok(HostMemory {
        ram_total_bytes: kb_field(&text, "MemTotal").unwrap_or(0),
        ram_available_bytes: kb_field(&text, "MemAvailable").unwrap_or(0),
    })
}

/// (current RSS, peak RSS since start or the last `reset_peak_rss`) in bytes.
pub fn rss() -> (u64, u64) {
    let text = fs::read_to_string("/proc/self/status").unwrap_or_default();
    (
        kb_field(&text, "VmRSS").unwrap_or(0),
        kb_field(&text, "VmHWM").unwrap_or(0),
    )
}

/// Resets the kernel's RSS high-water mark (VmHWM) so each epoch reports its own peak.
/// Returns false where the kernel does not allow it (then peaks are since process start).
pub fn reset_peak_rss() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The current soft limit on the data segment, None when unlimited.
pub fn data_limit() -> Option<u64> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass.
    if unsafe { libc::getrlimit(libc::RLIMIT_DATA, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Caps the process's data segment (heap and anonymous mappings) at `bytes`, so allocations
/// beyond it fail the way a full GPU does, and libtorch reports "can't allocate memory".
pub fn set_data_limit(bytes: u64) -> Result<()> {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_DATA, &mut r) != 0 {
            return Err(std::io::Error::last_os_error()).context("getrlimit(RLIMIT_DATA)");
        }
        let want = if r.rlim_max == libc::RLIM_INFINITY {
            bytes
        } else {
            bytes.min(r.rlim_max)
        };
        r.rlim_cur = want;
        if libc::setrlimit(libc::RLIMIT_DATA, &r) != 0 {
            return Err(std::io::Error::last_os_error()).context("setrlimit(RLIMIT_DATA)");
        }
    }
    Ok(())
}

/// Raises the data-segment soft limit back to the hard limit.
pub fn lift_data_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a struct we own.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_DATA, &mut r) == 0 {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_DATA, &r);
        }
    }
}

/// Makes freed memory leave the data segment promptly: allocations from 128 KiB up get their
/// own mappings, returned to the kernel on free, instead of staying in malloc's heap where
/// they would keep counting against RLIMIT_DATA. Without it a CPU cap fires on fragmentation
/// long before live tensors reach it.
pub fn tighten_malloc() {
    // SAFETY: mallopt only adjusts glibc's allocator parameters.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Data-segment bytes in use now (VmData), the quantity RLIMIT_DATA limits.
pub fn data_in_use() -> u64 {
    let text = fs::read_to_string("/proc/self/status").unwrap_or_default();
    kb_field(&text, "VmData").unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kb_fields() {
        let t = "MemTotal:       16318940 kB\nMemFree:  1 kB\nMemAvailable:   9000 kB\n";
        assert_eq!(kb_field(t, "MemTotal"), Some(16318940 * 1024));
        assert_eq!(kb_field(t, "MemAvailable"), Some(9000 * 1024));
        assert_eq!(kb_field(t, "Missing"), None);
    }

    #[test]
    fn rss_is_nonzero_and_peak_at_least_current() {
        let (cur, peak) = rss();
        assert!(cur > 0 && peak >= cur);
    }
}
