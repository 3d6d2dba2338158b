//! Fault injection for the tests that must produce a failure at one exact place: an OOM inside
//! the optimizer step, a crash half-way through a save, a signal at a known step. Each is off
//! unless its environment variable is set; documented in CONTRIBUTING.md's test hooks.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::shim;

/// `MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP=N`: at global step N's first attempt, the CPU cap is
/// lowered to the bytes allocated when the optimizer step begins, so its first allocation fails
/// for real in the counting allocator. The guard puts the cap back when the step ends or unwinds.
/// `N@R` fires on data-parallel rank R only (the RANK variable), for an OOM on one rank.
/// The same as `MEMTRAIN_FAULT_OOM_IN=optimizer:N`, kept for the tests that name it.
pub const OOM_IN_OPTIMIZER: &str = "MEMTRAIN_FAULT_OOM_IN_OPTIMIZER_AT_STEP";

/// `MEMTRAIN_FAULT_OOM_IN=PHASE[:N][@R]`: the first time the run enters PHASE (at global step N,
/// when given; on data-parallel rank R only, when given), the CPU cap is lowered to the bytes
/// allocated at that moment, so the phase's next allocation fails for real in the counting
/// allocator, as it would under a tight cap. Fires once per process. PHASE is one of
/// [`Phase::ALL`]'s names. The phase-by-phase OOM tests use it to put a real allocation failure
/// at one exact place.
pub const OOM_IN: &str = "MEMTRAIN_FAULT_OOM_IN";

/// The places of a run where an out-of-memory error can happen, each with its own answer
/// (docs/guide.md, "Out of memory in every phase").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Data,
    Model,
    InitFrom,
    Resume,
    Preflight,
    Forward,
    Backward,
    Optimizer,
    Arch,
    Validation,
    Checkpoint,
    Report,
}

impl Phase {
    pub const ALL: [Phase; 12] = [
        Phase::Data,
        Phase::Model,
        Phase::InitFrom,
        Phase::Resume,
        Phase::Preflight,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
        Phase::Arch,
        Phase::Validation,
        Phase::Checkpoint,
        Phase::Report,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Data => "data",
            Phase::Model => "model",
            Phase::InitFrom => "init_from",
            Phase::Resume => "resume",
            Phase::Preflight => "preflight",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
            Phase::Arch => "arch",
            Phase::Validation => "validation",
            Phase::Checkpoint => "checkpoint",
            Phase::Report => "report",
        }
    }

    /// The phase as OOM messages and records name it.
    pub fn label(self) -> &'static str {
        match self {
            Phase::Data => "reading the data",
            Phase::Model => "building the model",
            Phase::InitFrom => "model.init_from",
            Phase::Resume => "resuming a checkpoint",
            Phase::Preflight => "preflight",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer step",
            Phase::Arch => "architecture step",
            Phase::Validation => "validation",
            Phase::Checkpoint => "writing a checkpoint",
            Phase::Report => "writing the report",
        }
    }
}

static FIRED: AtomicBool = AtomicBool::new(false);

pub struct Squeeze {
    restore: Option<Option<u64>>,
}

impl Squeeze {
    /// Whether this guard lowered the cap (the fault fired here).
    pub fn fired(&self) -> bool {
        self.restore.is_some()
    }
}

impl Drop for Squeeze {
    fn drop(&mut self) {
        if let Some(cap) = self.restore {
            shim::cpu_alloc_set_cap(cap);
        }
    }
}

/// What `MEMTRAIN_FAULT_OOM_IN` asks for: a phase, maybe a step, maybe a rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Wanted {
    phase: Phase,
    step: Option<i64>,
}

fn parse_wanted(v: &str, rank: Option<&str>) -> Option<Wanted> {
    let (v, on_rank) = match v.split_once('@') {
        Some((v, r)) => (v, Some(r.trim())),
        None => (v, None),
    };
    if on_rank.is_some() && on_rank != rank.map(str::trim) {
        return None;
    }
    let (name, step) = match v.split_once(':') {
        Some((n, s)) => (n.trim(), Some(s.trim().parse().ok()?)),
        None => (v.trim(), None),
    };
    let phase = Phase::ALL.into_iter().find(|p| p.name() == name)?;
    Some(Wanted { phase, step })
}

/// Entering `phase` at global step `step` (the step being worked on, or the last one done
/// outside the loop; none for work outside the count, such as DARTS's architecture step):
/// squeezes the cap if the fault asks for this place. The returned guard lifts it again.
pub fn squeeze_in(phase: Phase, step: impl Into<Option<i64>>) -> Squeeze {
    let step = step.into();
    static WANTED: OnceLock<Option<Wanted>> = OnceLock::new();
    let wanted = WANTED.get_or_init(|| {
        let optimizer = std::env::var(OOM_IN_OPTIMIZER).ok().map(|n| format!("optimizer:{n}"));
        let v = std::env::var(OOM_IN).ok().or(optimizer)?;
        let w = parse_wanted(&v, std::env::var("RANK").ok().as_deref());
        if w.is_none() && !v.contains('@') {
            eprintln!(
                "fault: {OOM_IN}={v:?} names no phase; expected PHASE[:STEP][@RANK] with PHASE one of {}",
                Phase::ALL.map(Phase::name).join(", ")
            );
        }
        w
    });
    let hit = wanted.is_some_and(|w| w.phase == phase && w.step.is_none_or(|s| Some(s) == step));
    if !hit || FIRED.swap(true, Ordering::SeqCst) {
        return Squeeze { restore: None };
    }
    squeeze_now()
}

/// The CPU cap lowered to what is allocated now, so the next allocation fails for real; the
/// guard puts the cap back.
fn squeeze_now() -> Squeeze {
    let s = shim::cpu_alloc_stats();
    shim::cpu_alloc_set_cap(Some(s.allocated.max(1)));
    Squeeze { restore: Some(s.cap) }
}

pub fn squeeze_before_optimizer(step: Option<i64>) -> Squeeze {
    squeeze_in(Phase::Optimizer, step)
}

fn step_from(var: &'static str, cell: &'static OnceLock<Option<i64>>) -> Option<i64> {
    *cell.get_or_init(|| {
        let v = std::env::var(var).ok()?;
        let (step, rank) = match v.split_once('@') {
            Some((step, rank)) => (step, Some(rank)),
            None => (v.as_str(), None),
        };
        let Ok(step) = step.trim().parse() else {
            eprintln!("fault: {var}={v:?} is not a global step (N, or N@RANK); ignored");
            return None;
        };
        match rank {
            Some(rank) => (std::env::var("RANK").ok()?.trim() == rank.trim()).then_some(step),
            None => Some(step),
        }
    })
}

/// `MEMTRAIN_FAULT_OOM_IN_COLLECTIVE_AT_STEP=N`: at global step N's outcome exchange (the
/// collective every data-parallel step ends with), the CPU cap is lowered to the bytes allocated,
/// so making this rank's part of the collective fails for real while the others wait in it.
/// `N@R` fires on data-parallel rank R only.
pub const OOM_IN_COLLECTIVE: &str = "MEMTRAIN_FAULT_OOM_IN_COLLECTIVE_AT_STEP";

pub fn squeeze_in_collective(step: Option<i64>) -> Squeeze {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step.is_none() || step_from(OOM_IN_COLLECTIVE, &WANTED) != step || FIRED.swap(true, Ordering::SeqCst) {
        return Squeeze { restore: None };
    }
    squeeze_now()
}

/// `MEMTRAIN_FAULT_ABORT_SAVE_AT_STEP=N`: the checkpoint save for global step N aborts the
/// process after writing its first file, as a power cut would.
pub const ABORT_SAVE: &str = "MEMTRAIN_FAULT_ABORT_SAVE_AT_STEP";

pub fn abort_save_at(step: i64) {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(ABORT_SAVE, &WANTED) == Some(step) {
        std::process::abort();
    }
}

/// `MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP=N`: after global step N the loop prints
/// `fault: waiting for a signal at step N` to stderr and waits until Ctrl-C or SIGTERM arrives,
/// so a test can interrupt a run at a known step without racing it.
pub const AWAIT_SIGNAL: &str = "MEMTRAIN_FAULT_AWAIT_SIGNAL_AT_STEP";

pub fn await_signal_at(step: i64, stop: impl Fn() -> bool) {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(AWAIT_SIGNAL, &WANTED) != Some(step) {
        return;
    }
    eprintln!("fault: waiting for a signal at step {step}");
    while !stop() {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// `MEMTRAIN_FAULT_LATE_READS=1`: on the CPU too, a step record waits for the next step (or
/// for whatever else writes a record, reads the sums or ends the run), as on a GPU, where the
/// loss read is collected only once the next step is queued. On the CPU the read is in when it
/// is staged, so the record is written at once otherwise.
pub const LATE_READS: &str = "MEMTRAIN_FAULT_LATE_READS";

pub fn late_reads() -> bool {
    static SET: OnceLock<bool> = OnceLock::new();
    *SET.get_or_init(|| std::env::var_os(LATE_READS).is_some_and(|v| v == "1"))
}

/// `MEMTRAIN_FAULT_OOM_IN_CAPTURE=1`: the run's first capture of a step as a CUDA graph asks,
/// inside the capture, for more device memory than any GPU has, so the capture meets a real
/// allocation failure and must leave no graph behind.
pub const OOM_IN_CAPTURE: &str = "MEMTRAIN_FAULT_OOM_IN_CAPTURE";

pub fn oom_in_capture(device: tch::Device) {
    static SET: OnceLock<bool> = OnceLock::new();
    static DONE: AtomicBool = AtomicBool::new(false);
    let set = *SET.get_or_init(|| std::env::var_os(OOM_IN_CAPTURE).is_some_and(|v| v == "1"));
    if set && !DONE.swap(true, Ordering::SeqCst) {
        // 4 TiB: no device has it, so the allocator fails for real.
        let _ = tch::Tensor::empty([1i64 << 42], (tch::Kind::Uint8, device));
    }
}

/// `MEMTRAIN_FAULT_HOST_READ_IN_CAPTURE=1`: the run's first capture of a step as a CUDA graph
/// reads a value of the device on the host, inside the capture, as a step that waits on the
/// device would: CUDA refuses the wait and invalidates the capture, so the capture fails with
/// an error that is no OOM and must leave no graph, no pool and no generator still capturing.
pub const HOST_READ_IN_CAPTURE: &str = "MEMTRAIN_FAULT_HOST_READ_IN_CAPTURE";

pub fn host_read_in_capture(device: tch::Device) {
    static SET: OnceLock<bool> = OnceLock::new();
    static DONE: AtomicBool = AtomicBool::new(false);
    let set = *SET.get_or_init(|| std::env::var_os(HOST_READ_IN_CAPTURE).is_some_and(|v| v == "1"));
    if set && !DONE.swap(true, Ordering::SeqCst) {
        // A copy to the host and a wait on the capturing stream; the refusal panics as any
        // libtorch error inside the step does.
        let _ = tch::Tensor::zeros([], (tch::Kind::Float, device)).double_value(&[]);
    }
}

/// `MEMTRAIN_FAULT_CUDA_SYNC_ERROR_AFTER_STEP=N`: after global step N's record is staged, every
/// synchronizing CUDA call fails with where it came from (set `TORCH_SHOW_CPP_STACKTRACES=1`
/// for libtorch's frames): finds a wait on the device that a step makes without meaning to.
pub const SYNC_ERROR_AFTER: &str = "MEMTRAIN_FAULT_CUDA_SYNC_ERROR_AFTER_STEP";

pub fn sync_errors_after(step: i64) {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(SYNC_ERROR_AFTER, &WANTED) == Some(step) {
        if let Err(e) = crate::shim::copies::cuda_sync_debug_error() {
            eprintln!("fault: {SYNC_ERROR_AFTER}: {e:#}");
        }
    }
}

/// `MEMTRAIN_FAULT_INF_GRAD_AT_STEP=N`: at global step N, after backward, the first gradient of
/// the weight optimizer becomes inf, as an fp16 overflow would make it; the loss scaler must
/// skip that step and back off.
pub const INF_GRAD: &str = "MEMTRAIN_FAULT_INF_GRAD_AT_STEP";

/// `grads` lists the step's gradients; asked for only when the fault fires.
pub fn plant_inf_at(step: i64, grads: impl FnOnce() -> Vec<tch::Tensor>) {
    static WANTED: OnceLock<Option<i64>> = OnceLock::new();
    if step_from(INF_GRAD, &WANTED) == Some(step) {
        if let Some(g) = grads().first() {
            let _ = g.shallow_clone().fill_(f64::INFINITY);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fault_names_a_phase_a_step_and_a_rank() {
        let w = |phase, step| Some(Wanted { phase, step });
        assert_eq!(parse_wanted("validation", None), w(Phase::Validation, None));
        assert_eq!(parse_wanted("optimizer:3", None), w(Phase::Optimizer, Some(3)));
        assert_eq!(parse_wanted("optimizer:3@1", Some("1")), w(Phase::Optimizer, Some(3)));
        assert_eq!(parse_wanted("optimizer:3@1", Some("0")), None, "another rank's fault");
        assert_eq!(parse_wanted("optimizer:3@1", None), None, "not a data-parallel run");
        assert_eq!(parse_wanted("nowhere", None), None);
        assert_eq!(parse_wanted("forward:x", None), None);
        for p in Phase::ALL {
            assert_eq!(parse_wanted(p.name(), None), w(p, None));
        }
    }
}
