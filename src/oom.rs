//! Out-of-memory: recognising it in libtorch's errors (by text, and by the allocator's OOM
//! counter rising), catching it where tch panics, and the batch shape that backoff changes.
//! What to do about one is `run::recovery`'s business.
use std::cell::{Cell, RefCell};
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

use serde::{Deserialize, Serialize};

pub use crate::fault::Phase;
use crate::shim::{grad_enabled, set_grad_enabled};

/// What kind of allocation failure an error text describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OomKind {
    Cuda,
    Cpu,
    /// cuDNN gives up with NOT_SUPPORTED when it has no workspace memory for any algorithm.
    Cudnn,
    /// Data-parallel: another rank ran out of memory; this one rolls back with it.
    Peer,
}

/// The error texts that are out-of-memory conditions, whatever layer reports them.
const CUDA_TEXTS: &[&str] = &[
    "CUDA out of memory",
    "OutOfMemoryError",
    // A kernel launch or cudaMalloc outside the caching allocator (C10_CUDA_CHECK).
    "CUDA error: out of memory",
    // cuBLAS: its workspace, and its handle at first use, which fails when nothing is left.
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_NOT_INITIALIZED",
    "CUDNN_STATUS_ALLOC_FAILED",
    // PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync under a per-process fraction.
    "would exceed allowed memory",
];

pub fn classify(text: &str) -> Option<OomKind> {
    if CUDA_TEXTS.iter().any(|t| text.contains(t)) {
        Some(OomKind::Cuda)
    } else if text.contains("CPU out of memory")
        || text.contains("DefaultCPUAllocator: can't allocate memory")
        || text.contains("DefaultCPUAllocator: not enough memory")
    {
        Some(OomKind::Cpu)
    } else {
        None
    }
}

/// Errors that leave the CUDA context unusable: every later call fails the same way, so a
/// retry at a smaller batch would only loop. cuDNN's plan search catches OOMs of its own, which
/// raises the allocator's counter on steps that then fail for these other reasons.
const STICKY_TEXTS: &[&str] = &[
    "illegal memory access",
    "unspecified launch failure",
    "device-side assert triggered",
    "misaligned address",
    "illegal instruction",
    "CUDA error: launch failure",
    "CUDA error: an illegal",
];

/// `classify`, knowing whether the allocator's OOM counter rose while the failed work ran. A
/// rise makes any failure an OOM (the allocator ran out, whatever the message became on the
/// way up); cuDNN's NOT_SUPPORTED is one only then, since it also means a genuinely unsupported
/// configuration.
pub fn classify_step(text: &str, allocator_ooms_rose: bool) -> Option<OomKind> {
    if STICKY_TEXTS.iter().any(|t| text.contains(t)) {
        return None;
    }
    match classify(text) {
        Some(k) => Some(k),
        None if allocator_ooms_rose && text.contains("CUDNN_STATUS_NOT_SUPPORTED") => Some(OomKind::Cudnn),
        None if allocator_ooms_rose => Some(OomKind::Cuda),
        None => None,
    }
}

/// A failure inside a guarded region: an OOM the policy may absorb, or any other error.
#[derive(Debug, Clone)]
pub enum StepError {
    Oom {
        kind: OomKind,
        message: String,
        /// The stage the guarded work had reached ([`entering`]), when it marks its stages: the
        /// step pipeline tells forward, backward and the optimizer step apart this way.
        phase: Option<Phase>,
    },
    /// Data-parallel: another rank stopped answering before this step wrote anything, so the
    /// state is the last completed step's and can still be saved.
    PeerLost(String),
    /// Data-parallel: this rank ran out of memory inside a collective, which the others are
    /// already in, so it cannot be retried; nothing was written, as with a lost peer.
    OomInCollective(String),
    Other(String),
}

thread_local! {
    static GUARDED: RefCell<bool> = const { RefCell::new(false) };
    static STAGE: Cell<Option<Phase>> = const { Cell::new(None) };
}

/// Guarded work marks the stage it enters, so an OOM that unwinds out of it names the stage
/// (the pipeline's forward, backward, optimizer step) without every stage catching on its own.
pub fn entering(phase: Phase) {
    STAGE.with(|s| s.set(Some(phase)));
}

/// Installs a panic hook that stays silent inside `guarded` (the error is reported properly by
/// the caller) and behaves as usual everywhere else.
pub fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(|g| *g.borrow()) {
                default(info);
            }
        }));
    });
}

fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else {
        "unknown panic".to_owned()
    }
}

/// tch's libtorch messages end in a C++ backtrace; keep the reason.
pub fn short_message(text: &str) -> String {
    let t = text.trim_start_matches("called `Result::unwrap()` on an `Err` value: ");
    let t = t
        .strip_prefix("Torch(\"")
        .map(|s| s.trim_end_matches("\")"))
        .unwrap_or(t);
    crate::shim::first_line(&t.replace("\\n", "\n")).to_owned()
}

/// Runs `f`, turning a libtorch panic into a `StepError`. Every tensor `f` created is dropped
/// while unwinding, so an OOM leaves nothing of the failed step behind.
/// The value of a libtorch call made inside the guard, whose error leaves the step as a panic
/// (the guard turns it back into an error).
pub fn inside_guard<T>(r: anyhow::Result<T>) -> T {
    r.unwrap_or_else(|e| panic!("{e:#}"))
}

pub fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, StepError> {
    guarded_counting(|| 0, f)
}

/// `guarded`, with `ooms` reading the allocator's OOM counter of the device the work runs on
/// (`memory::oom_count`), so that an OOM whose message lost its wording is still one.
pub fn guarded_counting<T>(ooms: impl Fn() -> u64, f: impl FnOnce() -> T) -> Result<T, StepError> {
    install_hook();
    let ooms_before = ooms();
    let grad_mode = grad_enabled();
    let outer_stage = STAGE.with(|s| s.take());
    // Guards nest (check's count inside a set-up OOM's message): the outer stays guarded.
    let outer_guarded = GUARDED.with(|g| g.replace(true));
    let r = panic::catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| *g.borrow_mut() = outer_guarded);
    let phase = STAGE.with(|s| s.replace(outer_stage));
    if r.is_err() {
        // tch's `no_grad` restores the grad mode only when its closure returns; an error inside
        // (an OOM in the optimizer step or validation) would leave gradients off for the retry.
        set_grad_enabled(grad_mode);
    }
    r.map_err(|p| {
        let text = panic_text(p.as_ref());
        let message = short_message(&text);
        match classify_step(&text, ooms() > ooms_before) {
            Some(kind) => StepError::Oom { kind, message, phase },
            None => StepError::Other(message),
        }
    })
}

/// The micro-batch and accumulation in force. Their product (the effective batch) never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct BatchShape {
    pub micro_batch: i64,
    pub accumulation_steps: i64,
}

impl BatchShape {
    pub fn effective(&self) -> i64 {
        self.micro_batch * self.accumulation_steps
    }

    /// Half the micro-batch, twice the accumulation; None below `min`.
    pub fn halved(&self, min: i64) -> Option<BatchShape> {
        let half = self.micro_batch / 2;
        (half >= min && half >= 1).then(|| BatchShape {
            micro_batch: half,
            accumulation_steps: (self.effective() + half - 1) / half,
        })
    }
}

/// What was done about one OOM (decided by `run::recovery`): the action of the lever engaged
/// (`"recompute"`, `"backoff"` with the shape it went `to`, `"move_to_cpu"`), or `"fail"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    pub action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<BatchShape>,
}

impl Decision {
    pub const FAIL: &'static str = "fail";
    /// Capturing the step as a CUDA graph ran out of memory: the step runs eager.
    pub const EAGER: &'static str = "eager";
    /// Validation's own micro-batch halved (training's shape untouched).
    pub const EVAL_BACKOFF: &'static str = "eval_backoff";
    /// Validation at one sample still ran out of memory: this epoch's validation is skipped.
    pub const SKIP_VALIDATION: &'static str = "skip_validation";
    /// Work the run can go on without (a periodic checkpoint) was left out; no lever engaged.
    pub const SKIP: &'static str = "skip";

    pub fn fail() -> Decision {
        Decision {
            action: Self::FAIL.into(),
            to: None,
        }
    }

    pub fn skip() -> Decision {
        Decision {
            action: Self::SKIP.into(),
            to: None,
        }
    }

    pub fn is_fail(&self) -> bool {
        self.action == Self::FAIL
    }
}

/// OOM counts over a run, for summary.json: OOM events, engagements of each lever under the
/// lever's count name (`"backoffs"`), and grow-backs; validation's own halvings and
/// grow-backs apart, since they never touch training.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomCounts {
    pub events: u64,
    #[serde(flatten)]
    pub engaged: std::collections::BTreeMap<String, u64>,
    pub grow_backs: u64,
    #[serde(default)]
    pub eval_backoffs: u64,
    #[serde(default)]
    pub eval_grow_backs: u64,
}

impl OomCounts {
    /// Every name starts at 0, so the summary lists each lever whether or not it was engaged.
    pub fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> OomCounts {
        OomCounts {
            engaged: names.into_iter().map(|n| (n.to_owned(), 0)).collect(),
            ..Default::default()
        }
    }

    pub fn of(&self, name: &str) -> u64 {
        self.engaged.get(name).copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classifies_the_three_oom_texts() {
        assert_eq!(
            classify("CUDA out of memory. Tried to allocate 2.35 GiB."),
            Some(OomKind::Cuda)
        );
        assert_eq!(
            classify("[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you tried to allocate 4 bytes."),
            Some(OomKind::Cpu)
        );
        assert_eq!(classify("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"), None);
        assert_eq!(classify("shape mismatch"), None);
        for t in [
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
            "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
            "cuDNN error: CUDNN_STATUS_ALLOC_FAILED",
            "Allocation on device 0 would exceed allowed memory. (out of memory)",
        ] {
            assert_eq!(classify(t), Some(OomKind::Cuda), "{t}");
        }
        assert_eq!(
            classify("CPU out of memory: can't allocate memory: tried to allocate 32.00 MiB"),
            Some(OomKind::Cpu)
        );
    }

    #[test]
    fn the_allocator_counter_decides_what_the_text_cannot() {
        let nsup =
            "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.";
        assert_eq!(classify_step(nsup, false), None, "not every NOT_SUPPORTED is an OOM");
        assert_eq!(classify_step(nsup, true), Some(OomKind::Cudnn));
        assert_eq!(
            classify_step(
                "CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm",
                true
            ),
            Some(OomKind::Cuda),
            "a message the OOM lost on its way up"
        );
        assert_eq!(classify_step("shape mismatch", false), None);
        // Sticky errors are never OOMs, whatever the counter did: a retry would loop on them.
        for sticky in [
            "CUDA error: an illegal memory access was encountered",
            "CUDA error: unspecified launch failure",
            "CUDA error: device-side assert triggered",
            "CUDA error: misaligned address",
        ] {
            assert_eq!(classify_step(sticky, true), None, "{sticky}");
        }
    }

    #[test]
    fn halving_keeps_the_effective_batch() {
        let s = BatchShape {
            micro_batch: 32,
            accumulation_steps: 1,
        };
        let h = s.halved(1).unwrap();
        assert_eq!((h.micro_batch, h.accumulation_steps), (16, 2));
        assert_eq!(h.halved(16), None);
        let odd = BatchShape {
            micro_batch: 3,
            accumulation_steps: 2,
        };
        assert_eq!(
            odd.halved(1),
            Some(BatchShape {
                micro_batch: 1,
                accumulation_steps: 6
            })
        );
    }

    #[test]
    fn guarded_turns_a_libtorch_error_into_a_step_error() {
        let r = guarded(|| {
            tch::Tensor::zeros([2, 3], tch::kind::FLOAT_CPU).matmul(&tch::Tensor::zeros([2, 3], tch::kind::FLOAT_CPU))
        });
        match r {
            Err(StepError::Other(m)) => assert!(m.contains("cannot be multiplied") || m.contains("shapes"), "{m}"),
            other => panic!("expected an error, got {other:?}"),
        }
    }

    #[test]
    fn an_error_inside_no_grad_does_not_leave_gradients_off() {
        assert!(grad_enabled());
        let r = guarded(|| {
            tch::no_grad(|| {
                tch::Tensor::zeros([2, 3], tch::kind::FLOAT_CPU)
                    .matmul(&tch::Tensor::zeros([2, 3], tch::kind::FLOAT_CPU))
            })
        });
        assert!(r.is_err());
        assert!(grad_enabled(), "grad mode must be restored for the retry");
        let w = tch::Tensor::ones([2], tch::kind::FLOAT_CPU).set_requires_grad(true);
        (&w * 3.0).sum(tch::Kind::Float).backward();
        assert_eq!(w.grad().double_value(&[0]), 3.0);
    }
}
