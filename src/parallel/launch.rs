//! `memtrain run --nproc N`: starts N ranks of this same command on this machine, with the
//! environment torchrun would give them, and watches them. Ctrl-C is passed on once to every
//! rank (they agree on the step to stop after); a rank that dies is named, and the others are
//! stopped if they do not stop by themselves within the collective timeout.
use std::net::TcpListener;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::exit;

/// The ranks' exit, folded into one: 0 when all succeeded, 130 when they stopped on Ctrl-C,
/// else the first failing rank's code (1 for a signal).
fn fold(statuses: &[Option<ExitStatus>]) -> i32 {
    let codes: Vec<i32> = statuses
        .iter()
        .map(|s| s.and_then(|s| s.code()).unwrap_or(exit::FAILURE))
        .collect();
    if codes.iter().all(|&c| c == exit::OK) {
        exit::OK
    } else if codes.iter().all(|&c| c == exit::OK || c == exit::INTERRUPTED) {
        exit::INTERRUPTED
    } else {
        codes
            .iter()
            .copied()
            .find(|&c| c != exit::OK && c != exit::INTERRUPTED)
            .unwrap_or(exit::FAILURE)
    }
}

fn describe(rank: usize, status: &ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => format!("rank {rank} exited with code {c}"),
        (None, Some(libc::SIGKILL)) => format!("rank {rank} was killed (SIGKILL)"),
        (None, Some(s)) => format!("rank {rank} was killed by signal {s}"),
        _ => format!("rank {rank} ended"),
    }
}

/// A free port on 127.0.0.1 for the rendezvous (closed again before rank 0 binds it).
fn free_port() -> Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0").context("finding a free port for the ranks' rendezvous")?;
    Ok(l.local_addr()?.port())
}

/// Host memory one rank takes before it trains: a process with its own libtorch.
const RANK_BYTES: u64 = 256 << 20;

/// Refuses a rank count this machine cannot start: more than four ranks a core (each rank is a
/// process that needs a core to make progress; a few to a core still rehearse a larger group) or
/// than its available memory holds at `RANK_BYTES` each.
pub fn check_rank_count(n: usize, cores: usize, available_bytes: Option<u64>) -> Result<(), String> {
    let most = (4 * cores).max(2);
    if n > most {
        return Err(format!(
            "--nproc {n}: more ranks than this machine can run ({cores} core(s): at most {most}); \
             use one rank per GPU on CUDA, or a few per core on the CPU"
        ));
    }
    if let Some(avail) = available_bytes.filter(|&b| b > 0) {
        let fit = (avail / RANK_BYTES).max(1) as usize;
        if n > fit {
            return Err(format!(
                "--nproc {n}: each rank is a process of its own with libtorch (about {} of host memory), and {} is available: at most {fit} ranks fit",
                crate::human::human_bytes(RANK_BYTES),
                crate::human::human_bytes(avail)
            ));
        }
    }
    Ok(())
}

/// Runs `args` (this command line without `--nproc`) as `n` ranks; returns the exit code.
pub fn launch(n: usize, args: &[String], timeout: Duration) -> Result<i32> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().context("finding the memtrain executable")?;
    let port = free_port()?;
    let stop = crate::signals::StopFlag::install()?;
    let mut children: Vec<Child> = Vec::with_capacity(n);
    for rank in 0..n {
        let mut c = Command::new(&exe);
        c.args(args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", rank.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("MEMTRAIN_DIST_TIMEOUT", timeout.as_secs_f64().to_string())
            .env_remove("TORCHELASTIC_USE_AGENT_STORE")
            // Own process group: a terminal's Ctrl-C reaches the launcher only, which passes it on
            // once (a second SIGINT would end a rank at once, without its checkpoint).
            .process_group(0);
        match c.spawn() {
            Ok(child) => children.push(child),
            Err(e) => {
                // The ranks already started would wait for the missing one until the timeout.
                for child in &mut children {
                    let _ = child.kill();
                    let _ = child.wait();
                }
                return Err(e).with_context(|| format!("starting rank {rank} of {n}"));
            }
        }
    }
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    let mut forwarded = false;
    let mut failed_at: Option<Instant> = None;
    let mut killed = false;
    loop {
        for (rank, child) in children.iter_mut().enumerate() {
            if statuses[rank].is_none() {
                if let Some(s) = child.try_wait()? {
                    let ok = s.code() == Some(exit::OK) || s.code() == Some(exit::INTERRUPTED);
                    if !ok {
                        eprintln!("memtrain: {}", describe(rank, &s));
                        failed_at.get_or_insert_with(Instant::now);
                    }
                    statuses[rank] = Some(s);
                }
            }
        }
        if statuses.iter().all(Option::is_some) {
            break;
        }
        if stop.requested() && !forwarded {
            forwarded = true;
            for (rank, child) in children.iter().enumerate() {
                if statuses[rank].is_none() {
                    unsafe { libc::kill(child.id() as i32, libc::SIGINT) };
                }
            }
        }
        // The others notice a dead rank at their next collective; past the timeout (and a
        // margin for a checkpoint) they are stopped.
        if let Some(t) = failed_at {
            if !killed && t.elapsed() > timeout + Duration::from_secs(30) {
                killed = true;
                for (rank, child) in children.iter_mut().enumerate() {
                    if statuses[rank].is_none() {
                        eprintln!("memtrain: rank {rank} did not stop after another rank failed; killing it");
                        let _ = child.kill();
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(fold(&statuses))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_rank_count_the_machine_cannot_start_is_refused() {
        assert!(check_rank_count(2, 2, Some(8 << 30)).is_ok());
        assert!(check_rank_count(8, 2, Some(8 << 30)).is_ok());
        assert!(check_rank_count(2, 1, None).is_ok());
        let e = check_rank_count(100_000, 2, Some(8 << 30)).unwrap_err();
        assert!(
            e.contains("--nproc 100000: more ranks than this machine can run (2 core(s): at most 8)"),
            "{e}"
        );
        let e = check_rank_count(8, 16, Some(1 << 30)).unwrap_err();
        assert!(e.contains("at most 4 ranks fit"), "{e}");
    }

    #[test]
    fn exit_codes_fold_to_the_most_telling() {
        let code = |c: i32| Some(ExitStatus::from_raw(c << 8));
        let signal = |s: i32| Some(ExitStatus::from_raw(s));
        assert_eq!(fold(&[code(0), code(0)]), 0);
        assert_eq!(fold(&[code(130), code(130)]), 130);
        assert_eq!(fold(&[code(0), code(3)]), 3);
        assert_eq!(fold(&[code(130), code(1)]), 1);
        assert_eq!(fold(&[signal(9), code(1)]), 1);
        assert_eq!(describe(1, &ExitStatus::from_raw(9)), "rank 1 was killed (SIGKILL)");
    }
}
