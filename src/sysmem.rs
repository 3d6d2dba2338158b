//! Host memory as the kernel reports it: RAM totals, this process's RSS and its high-water mark.
//! (The CPU cap is not here: the counting allocator in the shim enforces it on tensor bytes.)
use std::fs;
use std::path::Path;
use std::sync::OnceLock;

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

/// RAM this process can still take: the kernel's `MemAvailable`, or less where the process's
/// cgroup has a memory limit with less room left under it (a container on a large host sees the
/// host's RAM in /proc/meminfo, not its own limit). None where neither is known.
pub fn available_bytes() -> Option<u64> {
    let ram = host_memory().ok().map(|h| h.ram_available_bytes).filter(|&b| b > 0);
    let cgroup = fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|c| cgroup_room(&c, |p| fs::read_to_string(Path::new(CGROUP_ROOT).join(p)).ok()));
    match (ram, cgroup) {
        (Some(r), Some(c)) => Some(r.min(c)),
        (r, c) => r.or(c),
    }
}

const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// Bytes left under the tightest memory limit of the cgroup that `self_cgroup` (the text of
/// /proc/self/cgroup) names, or of any cgroup above it, reading each file through `read` (a path
/// under /sys/fs/cgroup): cgroup v2's `memory.max` minus `memory.current`, or v1's
/// `memory.limit_in_bytes` minus `memory.usage_in_bytes`. None where no limit is set.
pub fn cgroup_room(self_cgroup: &str, read: impl Fn(&str) -> Option<String>) -> Option<u64> {
    let mut room = None;
    for line in self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        let (dir, limit, usage) = match controllers {
            "" => ("", "memory.max", "memory.current"),
            c if c.split(',').any(|c| c == "memory") => ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
            _ => continue,
        };
        // The cgroup and each above it, up to the root; a container sees its own as "/".
        let mut at = path.trim_matches('/').to_owned();
        loop {
            let file = |name: &str| {
                let p = [dir, at.as_str(), name]
                    .iter()
                    .filter(|s| !s.is_empty())
                    .copied()
                    .collect::<Vec<_>>();
                read(&p.join("/"))
            };
            if let Some(r) = file(limit).and_then(|l| limit_room(&l, &file(usage)?)) {
                room = Some(room.map_or(r, |x: u64| x.min(r)));
            }
            match at.rfind('/') {
                Some(i) => at.truncate(i),
                None if !at.is_empty() => at.clear(),
                None => break,
            }
        }
    }
    room
}

/// Room under a limit (`max`, or a number of bytes) with `usage` bytes used; None for no limit.
/// cgroup v1 writes "no limit" as a number near 2^63.
fn limit_room(limit: &str, usage: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok()?;
    if limit >= 1 << 62 {
        return None;
    }
    let usage: u64 = usage.trim().parse().ok()?;
    Some(limit.saturating_sub(usage))
}

/// (current RSS, peak RSS since start or the last `reset_peak_rss`) in bytes.
pub fn rss() -> (u64, u64) {
    let text = fs::read_to_string("/proc/self/status").unwrap_or_default();
    (
        kb_field(&text, "VmRSS").unwrap_or(0),
        kb_field(&text, "VmHWM").unwrap_or(0),
    )
}

/// Current RSS from /proc/self/statm: a few numbers, far cheaper to read than
/// /proc/self/status, for the per-step reading. The file stays open and is re-read at offset 0
/// (procfs regenerates it), which saves the open and close on every step.
pub fn rss_now() -> u64 {
    use std::os::unix::fs::FileExt;
    static STATM: OnceLock<Option<fs::File>> = OnceLock::new();
    let Some(f) = STATM.get_or_init(|| fs::File::open("/proc/self/statm").ok()) else {
        return 0;
    };
    let mut buf = [0u8; 128];
    let n = f.read_at(&mut buf, 0).unwrap_or(0);
    let pages: u64 = std::str::from_utf8(&buf[..n])
        .ok()
        .and_then(|t| t.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0);
    pages * page_size()
}

/// Anonymous memory resident now (statm's resident less its shared, file-backed pages): what
/// the process itself holds, without the files it maps.
pub fn rss_anon_now() -> u64 {
    let text = fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: Vec<u64> = text.split_whitespace().take(3).filter_map(|v| v.parse().ok()).collect();
    match pages[..] {
        [_, resident, shared] => resident.saturating_sub(shared) * page_size(),
        _ => 0,
    }
}

pub(crate) fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

/// Resets the kernel's RSS high-water mark (VmHWM) so each epoch reports its own peak.
/// Returns false where the kernel does not allow it (then peaks are since process start).
pub fn reset_peak_rss() -> bool {
    fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Largest threshold glibc's dynamic mmap rule reaches on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const GLIBC_DYNAMIC_MMAP_MAX: usize = 32 << 20;

/// Raises glibc's malloc thresholds the way glibc itself does, before training starts.
///
/// glibc serves a request above its mmap threshold (128 KiB at start) with a fresh mmap, and
/// returns the top of the heap to the kernel once more than the trim threshold is free there.
/// Freeing an mmapped chunk raises both (mmap to that chunk's size, trim to twice it), up to
/// 32 MiB. A Python process has long passed through that by the time it trains; memtrain had
/// not, so with gradients released every step (as PyTorch does) a bf16 MLP's few-MiB buffers
/// went back to the kernel and were faulted in again each step: 2.3× the page faults and half
/// PyTorch's speed. Freeing one 32 MiB chunk at start takes the same path glibc's rule takes.
/// `mallopt` would freeze the thresholds instead (it turns the dynamic rule off), which is
/// what made a capped DARTS run 1.6× slower when M_MMAP_THRESHOLD was set.
pub fn warm_malloc_thresholds() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: a plain malloc/free pair; black_box keeps the compiler from eliding it.
    unsafe {
        // A little under the maximum: the chunk (request, header, page rounding) must not exceed it.
        let p = std::hint::black_box(libc::malloc(GLIBC_DYNAMIC_MMAP_MAX - (64 << 10)));
        libc::free(p);
    }
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

    /// A fake /sys/fs/cgroup: file contents by path.
    fn files<'a>(list: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |p: &str| list.iter().find(|(k, _)| *k == p).map(|(_, v)| v.to_string())
    }

    #[test]
    fn cgroup_v2_room_is_the_tightest_limit_less_usage() {
        // A container: its own cgroup is the namespace's root.
        let v2 = files(&[("memory.max", "1073741824\n"), ("memory.current", "268435456\n")]);
        assert_eq!(cgroup_room("0::/\n", &v2), Some(768 << 20));
        // No limit.
        let max = files(&[("memory.max", "max\n"), ("memory.current", "268435456\n")]);
        assert_eq!(cgroup_room("0::/\n", &max), None);
        // A nested cgroup under a tighter parent: the parent's room counts.
        let nested = files(&[
            ("ci/job/memory.max", "max\n"),
            ("ci/job/memory.current", "100\n"),
            ("ci/memory.max", "1000\n"),
            ("ci/memory.current", "400\n"),
        ]);
        assert_eq!(cgroup_room("0::/ci/job\n", &nested), Some(600));
        // Over the limit (reclaim pending): no room, not an underflow.
        let over = files(&[("memory.max", "100"), ("memory.current", "150")]);
        assert_eq!(cgroup_room("0::/", &over), Some(0));
    }

    #[test]
    fn cgroup_v1_room_reads_the_memory_controller() {
        let text = "9:name=systemd:/\n4:memory:/docker/abc\n1:cpu,cpuacct:/\n0::/\n";
        let v1 = files(&[
            ("memory/docker/abc/memory.limit_in_bytes", "2147483648\n"),
            ("memory/docker/abc/memory.usage_in_bytes", "1073741824\n"),
            ("memory/memory.limit_in_bytes", "9223372036854771712\n"),
            ("memory/memory.usage_in_bytes", "5\n"),
        ]);
        assert_eq!(cgroup_room(text, &v1), Some(1 << 30));
        // v1's "no limit" is a number near 2^63.
        let unlimited = files(&[
            ("memory/docker/abc/memory.limit_in_bytes", "9223372036854771712\n"),
            ("memory/docker/abc/memory.usage_in_bytes", "1073741824\n"),
        ]);
        assert_eq!(cgroup_room(text, &unlimited), None);
        assert_eq!(cgroup_room("", &unlimited), None, "no cgroup file");
        assert_eq!(cgroup_room(text, files(&[])), None, "no cgroup filesystem");
    }

    #[test]
    fn available_memory_is_known_here() {
        let a = available_bytes().expect("this host reports its memory");
        let ram = host_memory().unwrap().ram_available_bytes;
        assert!(a > 0 && a <= ram, "{a} of {ram}");
    }

    #[test]
    fn rss_is_nonzero_and_peak_at_least_current() {
        let (cur, peak) = rss();
        assert!(cur > 0 && peak >= cur);
        // statm and status count the same pages; allow for the process growing in between.
        let now = rss_now();
        assert!(now > cur / 2 && now < cur * 2, "statm {now} vs status {cur}");
        // Re-read through the open file: it follows the process, it is not a stale copy. Fresh
        // anonymous pages, touched, grow RSS by their size (a Vec might reuse resident memory).
        const LEN: usize = 64 << 20;
        // SAFETY: a private anonymous mapping, written within its length, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                LEN,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        unsafe { std::ptr::write_bytes(p as *mut u8, 1, LEN) };
        let after = rss_now();
        let status = rss().0;
        unsafe { libc::munmap(p, LEN) };
        // Other tests in this process allocate and free meanwhile: loose bounds.
        assert!(after >= now + (32 << 20), "{now} -> {after}");
        assert!(after.abs_diff(status) < 32 << 20, "statm {after} vs status {status}");
    }
}
