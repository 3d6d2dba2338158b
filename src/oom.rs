//! Out-of-memory: recognising it in libtorch's errors, catching it where tch panics, and the
//! policy state (micro-batch, accumulation, fallbacks) that `memory.on_oom` drives.
use std::cell::RefCell;
use std::panic::{self, AssertUnwindSafe};
use std::sync::Once;

use serde::Serialize;

use crate::spec::OomAction;

/// What kind of allocation failure an error text describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OomKind {
    Cuda,
    Cpu,
    /// cuDNN gives up with NOT_SUPPORTED when it has no workspace memory for any algorithm.
    Cudnn,
}

pub fn classify(text: &str) -> Option<OomKind> {
    if text.contains("CUDA out of memory")
        || text.contains("OutOfMemoryError")
        || text.contains("CUBLAS_STATUS_ALLOC_FAILED")
    {
        Some(OomKind::Cuda)
    } else if text.contains("DefaultCPUAllocator: can't allocate memory")
        || text.contains("DefaultCPUAllocator: not enough memory")
    {
        Some(OomKind::Cpu)
    } else if text.contains("CUDNN_STATUS_NOT_SUPPORTED") {
        Some(OomKind::Cudnn)
    } else {
        None
    }
}

/// A failure inside a guarded region: an OOM the policy may absorb, or any other error.
#[derive(Debug, Clone)]
pub enum StepError {
    Oom { kind: OomKind, message: String },
    Other(String),
}

thread_local! {
    static GUARDED: RefCell<bool> = const { RefCell::new(false) };
}

/// Installs a panic hook that stays silent inside `guarded` (the error is reported properly by
/// the caller) and behaves as usual everywhere else, after lifting a CPU memory cap: printing a
/// panic allocates, and under an exhausted RLIMIT_DATA that would hang the process.
pub fn install_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let default = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(|g| *g.borrow()) {
                crate::sysmem::lift_data_limit();
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

/// Sets autograd's grad mode and returns the previous one (tch does not expose this).
fn set_grad_enabled(on: bool) -> bool {
    // SAFETY: a plain call into libtorch's C API that toggles a thread-local flag.
    unsafe { torch_sys::at_grad_set_enabled(on as i32) != 0 }
}

fn grad_enabled() -> bool {
    let prev = set_grad_enabled(true);
    set_grad_enabled(prev);
    prev
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
pub fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, StepError> {
    install_hook();
    let grad_mode = grad_enabled();
    GUARDED.with(|g| *g.borrow_mut() = true);
    let r = panic::catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| *g.borrow_mut() = false);
    if r.is_err() {
        // tch's `no_grad` restores the grad mode only when its closure returns; an error inside
        // (an OOM in the optimizer step or validation) would leave gradients off for the retry.
        set_grad_enabled(grad_mode);
    }
    r.map_err(|p| {
        let text = panic_text(p.as_ref());
        let message = short_message(&text);
        match classify(&text) {
            Some(kind) => StepError::Oom { kind, message },
            None => StepError::Other(message),
        }
    })
}

/// The micro-batch and accumulation in force. Their product (the effective batch) never changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
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

/// What the policy decided for one OOM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "action")]
pub enum Decision {
    Backoff { to: BatchShape },
    MoveToCpu,
    Fail,
}

/// Walks `memory.on_oom` in order for each OOM: the first action that still applies wins.
#[derive(Debug, Clone)]
pub struct Policy {
    actions: Vec<OomAction>,
    min_batch: i64,
}

impl Policy {
    pub fn new(actions: Vec<OomAction>, min_batch: i64) -> Self {
        Policy { actions, min_batch }
    }

    /// `on_cpu`: the run is already on the CPU, where "cpu" cannot help. `skipped` collects the
    /// actions that did not apply, for the notice.
    pub fn decide(&self, shape: BatchShape, on_cpu: bool, skipped: &mut Vec<String>) -> Decision {
        for a in &self.actions {
            match a {
                OomAction::Backoff => match shape.halved(self.min_batch) {
                    Some(to) => return Decision::Backoff { to },
                    None => skipped.push(format!(
                        "backoff: micro-batch {} cannot be halved without going below memory.min_batch_size {}",
                        shape.micro_batch, self.min_batch
                    )),
                },
                OomAction::Cpu if on_cpu => skipped.push("cpu: the run is already on the CPU".into()),
                OomAction::Cpu => return Decision::MoveToCpu,
                OomAction::Fail => return Decision::Fail,
            }
        }
        Decision::Fail
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
        assert_eq!(
            classify("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"),
            Some(OomKind::Cudnn)
        );
        assert_eq!(classify("shape mismatch"), None);
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
    fn policy_walks_its_list() {
        let p = Policy::new(vec![OomAction::Backoff, OomAction::Cpu, OomAction::Fail], 4);
        let mut skipped = vec![];
        let big = BatchShape {
            micro_batch: 8,
            accumulation_steps: 1,
        };
        assert!(matches!(p.decide(big, false, &mut skipped), Decision::Backoff { .. }));
        let small = BatchShape {
            micro_batch: 4,
            accumulation_steps: 2,
        };
        assert_eq!(p.decide(small, false, &mut skipped), Decision::MoveToCpu);
        skipped.clear();
        assert_eq!(p.decide(small, true, &mut skipped), Decision::Fail);
        assert_eq!(skipped.len(), 2);
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
