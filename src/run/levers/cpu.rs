//! The CPU fallback as a lever: parameters, their gradients and every optimizer's state move to
//! the CPU and the run goes on there, slower. A resumed run that fell back stays on the CPU
//! (the plan puts it there).
use tch::Device;

use super::lever::{Lever, Parts, Position, Search, Situation};
use crate::estimate::Estimate;
use crate::human::human_bytes;
use crate::oom::BatchShape;

pub struct CpuFallback;

impl Lever for CpuFallback {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn title(&self) -> &'static str {
        "the CPU fallback"
    }

    fn counted_as(&self) -> &'static str {
        "cpu_fallbacks"
    }

    fn label(&self) -> &'static str {
        "CPU fallback"
    }

    fn action(&self) -> &'static str {
        "move_to_cpu"
    }

    fn applies(&self, s: &Situation) -> Result<(), String> {
        if s.planned_on_cpu || s.at.engaged.contains(self.name()) {
            Err("the run is already on the CPU".into())
        } else if s.data_parallel {
            // The NCCL group and its Reducer are CUDA-only: the next collective would fail.
            Err("the ranks share gradients through NCCL, which has no CPU side; put \"backoff\" or \"offload\" before \"cpu\", or train on the CPU with job.device = \"cpu\"".into())
        } else {
            Ok(())
        }
    }

    /// `VarStore::set_device` alone would leave `.grad` behind on the GPU.
    fn engage(&self, parts: &mut Parts<'_>) {
        let cpu = Device::Cpu;
        let model = &mut *parts.model;
        tch::no_grad(|| {
            for (_, p) in model.vs.variables() {
                let g = p.grad();
                if g.defined() && g.device() != cpu {
                    g.shallow_clone().set_data(&g.to_device(cpu));
                }
            }
        });
        // Streamed parameters rest on the host, which is the CPU: they stay where they are
        // and the run stops streaming them.
        model.vs.set_device(cpu);
        model.stream = None;
        model.opt.to_device(cpu);
        if let Some(a) = &mut parts.arch {
            a.opt.to_device(cpu);
        }
        parts.forward.device = cpu;
        let _ = crate::shim::empty_cache();
    }

    fn said(&self, _before: &Position, _after: &Position, _configured: BatchShape) -> String {
        "MOVING THE RUN TO THE CPU as memory.on_oom says. It continues, slower.".into()
    }

    fn estimate(&self, e: &Estimate) -> String {
        format!(
            "the whole bill ({} static, plus activations) moves to host memory and the run goes on on the CPU, many times slower",
            human_bytes(e.total_bytes())
        )
    }

    fn search(&self) -> Search {
        Search::Never("fit looks for the fastest setting on the device; falling back to the CPU is a last resort for a run, not a setting")
    }
}

#[cfg(test)]
mod tests {
    use super::super::lever::Engaged;
    use super::*;
    use crate::oom::BatchShape;

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
        s.at = CpuFallback.engaged(&s);
        assert_eq!(CpuFallback.applies(&s), Err("the run is already on the CPU".into()));
        s.at.engaged = Engaged::default();
        s.planned_on_cpu = true;
        assert_eq!(CpuFallback.applies(&s), Err("the run is already on the CPU".into()));
    }
}
