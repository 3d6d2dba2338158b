//! The CPU fallback as a lever: parameters, their gradients and every optimizer's state move to
//! the CPU and the run goes on there, slower. A resumed run that fell back stays on the CPU
//! (the plan puts it there).
use super::lever::{About, Described, Lever, Position, Search, Situation, Target};
use crate::estimate::Estimate;
use crate::human::human_bytes;
use crate::oom::BatchShape;
use crate::spec::Precision;

pub struct CpuFallback;

/// The precision a run continues in on the CPU: fp16 autocast there is 10-20x slower than bf16
/// (measured on a 2-core machine), so fp16-mixed goes on as bf16-mixed. The loss scaler stays:
/// scaling by a power of two and back is exact, and bf16 has fp32's range.
pub fn precision_on_cpu(p: Precision) -> Precision {
    match p {
        Precision::Fp16Mixed => Precision::Bf16Mixed,
        p => p,
    }
}

impl CpuFallback {
    pub const ABOUT: About = About {
        name: "cpu",
        title: "the CPU fallback",
        label: "CPU fallback",
        counted_as: "cpu_fallbacks",
        action: "move_to_cpu",
        answers: "cpu",
        search: Search::Never("fit looks for the fastest setting on the device; falling back to the CPU is a last resort for a run, not a setting"),
        colour: [140, 86, 75],
        setting: None,
        moves_static_bill: true,
        said,
        estimate,
    };
}

impl Lever for CpuFallback {
    fn about(&self) -> &'static About {
        &Self::ABOUT
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        if s.planned_on_cpu || s.at.engaged.contains(self.name()) {
            Err("the run is already on the CPU".into())
        } else if s.data_parallel {
            // The NCCL group and its Reducer are CUDA-only: the next collective would fail.
            Err("the ranks share gradients through NCCL, which has no CPU side; put \"backoff\" or \"offload\" before \"cpu\", or train on the CPU with job.device = \"cpu\"".into())
        } else if s.torchscript {
            // Moving the variables would leave the graph's constant tensors on the GPU, and the
            // next forward would mix devices.
            Err("a TorchScript model's constant tensors were loaded onto the GPU and cannot follow its variables to the CPU; put \"backoff\" or \"offload\" before \"cpu\", or train on the CPU with job.device = \"cpu\"".into())
        } else {
            Ok(())
        }
    }

    fn engage(&self, run: &mut dyn Target) {
        run.move_to_cpu(precision_on_cpu);
    }
}

fn said(_before: &Position, _after: &Position, _configured: BatchShape) -> String {
    "MOVING THE RUN TO THE CPU as memory.on_oom says. It continues, slower.".into()
}

fn estimate(e: &Estimate) -> String {
    format!(
        "the whole bill ({} static, plus activations) moves to host memory and the run goes on on the CPU, many times slower",
        human_bytes(e.total_bytes())
    )
}

#[cfg(test)]
mod tests {
    use super::super::lever::Engaged;
    use super::*;
    use crate::oom::BatchShape;

    #[test]
    fn fp16_mixed_goes_on_as_bf16_mixed_on_the_cpu() {
        assert_eq!(precision_on_cpu(Precision::Fp16Mixed), Precision::Bf16Mixed);
        for p in [Precision::Fp32, Precision::Bf16Mixed, Precision::Bf16] {
            assert_eq!(precision_on_cpu(p), p);
        }
    }

    #[test]
    fn applies_off_the_cpu_only_once() {
        let mut s = Situation {
            at: Position {
                shape: BatchShape {
                    micro_batch: 8,
                    accumulation_steps: 1,
                },
                clean_steps: 0,
                engaged: Engaged::default(),
            },
            min_batch: 1,
            planned_on_cpu: false,
            has_blocks: false,
            blockwise: false,
            data_parallel: false,
            state_slots: 2,
            torchscript: false,
        };
        assert_eq!(CpuFallback.applies(&s), Ok(()));
        let ranks = Situation {
            data_parallel: true,
            ..s
        };
        assert!(CpuFallback
            .applies(&ranks)
            .unwrap_err()
            .contains("NCCL, which has no CPU side"));
        let scripted = Situation { torchscript: true, ..s };
        assert!(CpuFallback.applies(&scripted).unwrap_err().contains("TorchScript"));
        s.at = CpuFallback.engaged(&s);
        assert_eq!(CpuFallback.applies(&s), Err("the run is already on the CPU".into()));
        s.at.engaged = Engaged::default();
        s.planned_on_cpu = true;
        assert_eq!(CpuFallback.applies(&s), Err("the run is already on the CPU".into()));
    }
}
