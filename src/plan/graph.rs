//! Whether a run captures its step as a CUDA graph (`train.cuda_graph`), decided once from the
//! spec, the device and the world. What can change during a run (a lever engaged by recovery,
//! a fall back to the CPU, a short last group, a new micro-batch after backoff) is the step's
//! to decide, step by step, within this plan.
use crate::exit::UsageError;
use crate::memory::Place;
use crate::spec::{graph_declines, CudaGraph, Spec};

/// Eager steps at a batch shape before it is captured: the first creates the optimizer's state
/// and the step's lazily made workspaces outside any graph; the other two run on the capture
/// stream, so the libraries' per-stream workspaces exist before capture too (PyTorch's own
/// recipe warms up three times on the side stream).
pub const WARMUP_STEPS: u32 = 3;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GraphPlan {
    /// Each batch shape is captured after `warmup` eager steps at it, then replayed.
    Capture { warmup: u32 },
    /// Every step runs eager, for this reason.
    Eager(String),
}

impl GraphPlan {
    pub fn captures(&self) -> bool {
        matches!(self, GraphPlan::Capture { .. })
    }

    /// The decision in words, for the start record, the terminal and the resolved spec.
    pub fn describe(&self) -> String {
        match self {
            GraphPlan::Capture { warmup } => {
                format!("captured: each batch shape after {warmup} eager steps, then replayed")
            }
            GraphPlan::Eager(why) => format!("eager: {why}"),
        }
    }
}

/// The plan for `spec` on `device`; `data_parallel`: this process is one rank of a group.
/// "on" with a reason the spec alone shows is refused by validation before this; "on" in a
/// group is refused here.
pub fn resolve(spec: &Spec, device: Place, data_parallel: bool) -> Result<GraphPlan, UsageError> {
    let asked = spec.train.cuda_graph;
    if asked == CudaGraph::Off {
        return Ok(GraphPlan::Eager("train.cuda_graph = \"off\"".into()));
    }
    if let Some(why) = graph_declines(spec) {
        return Ok(GraphPlan::Eager(why));
    }
    if data_parallel {
        let why = "a data-parallel rank all-reduces its gradients through the process group inside the step, which memtrain does not capture";
        return match asked {
            CudaGraph::On => Err(UsageError(format!(
                "train.cuda_graph = \"on\" cannot capture this run's step: {why}; set train.cuda_graph = \"auto\" (the ranks then run eager) or \"off\""
            ))),
            _ => Ok(GraphPlan::Eager(why.into())),
        };
    }
    if device == Place::Cpu {
        return Ok(GraphPlan::Eager(
            "the run is on the CPU, and CUDA graphs are CUDA's".into(),
        ));
    }
    Ok(GraphPlan::Capture { warmup: WARMUP_STEPS })
}

/// What `run` says when "on" meets a CPU: the spec is fine, the machine has no GPU.
pub fn cpu_notice(spec: &Spec, device: Place) -> Option<String> {
    (spec.train.cuda_graph == CudaGraph::On && device == Place::Cpu)
        .then(|| "train.cuda_graph = \"on\" has no effect on the CPU: every step runs eager".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::Home;
    use crate::spec::{OptimizerImpl, Precision};

    fn spec(mode: CudaGraph) -> Spec {
        let mut s: Spec = toml::from_str("[model]\npreset = \"mlp\"\n").expect("a minimal spec parses");
        s.train.cuda_graph = mode;
        s
    }

    fn eager(p: GraphPlan) -> String {
        match p {
            GraphPlan::Eager(why) => why,
            other => panic!("expected eager, got {other:?}"),
        }
    }

    #[test]
    fn auto_captures_a_plain_cuda_run_and_runs_eager_on_the_cpu() {
        let s = spec(CudaGraph::Auto);
        assert_eq!(
            resolve(&s, Place::Cuda(0), false).unwrap(),
            GraphPlan::Capture { warmup: WARMUP_STEPS }
        );
        assert!(eager(resolve(&s, Place::Cpu, false).unwrap()).contains("CPU"));
        assert_eq!(cpu_notice(&s, Place::Cpu), None, "auto says nothing extra on the CPU");
        let on = spec(CudaGraph::On);
        assert!(cpu_notice(&on, Place::Cpu).unwrap().contains("no effect on the CPU"));
        assert!(!resolve(&on, Place::Cpu, false).unwrap().captures());
    }

    #[test]
    fn off_never_captures() {
        let s = spec(CudaGraph::Off);
        assert!(eager(resolve(&s, Place::Cuda(0), false).unwrap()).contains("\"off\""));
    }

    #[test]
    fn auto_declines_each_setting_that_rules_capture_out_and_names_it() {
        type Set = fn(&mut Spec);
        let cases: [(Set, &str); 8] = [
            (|s| s.memory.parameters = Home::Host, "memory.parameters"),
            (|s| s.memory.optimizer_state = Home::Host, "memory.optimizer_state"),
            (|s| s.memory.gradients = Home::Host, "memory.gradients"),
            (|s| s.memory.activations = Home::Host, "memory.activations"),
            (|s| s.train.activation_checkpointing = true, "activation_checkpointing"),
            (|s| s.train.precision = Precision::Fp16Mixed, "fp16-mixed"),
            (|s| s.train.optimizer_state_bits = 8, "optimizer_state_bits"),
            (|s| s.train.optimizer_impl = OptimizerImpl::Foreach, "optimizer_impl"),
        ];
        for (set, key) in cases {
            let mut s = spec(CudaGraph::Auto);
            set(&mut s);
            let why = eager(resolve(&s, Place::Cuda(0), false).unwrap());
            assert!(why.contains(key), "{key}: {why}");
        }
        let mut fused = spec(CudaGraph::Auto);
        fused.train.optimizer_impl = OptimizerImpl::Fused;
        fused.train.precision = Precision::Bf16Mixed;
        assert!(resolve(&fused, Place::Cuda(0), false).unwrap().captures());
    }

    #[test]
    fn a_data_parallel_rank_runs_eager_under_auto_and_is_refused_under_on() {
        let why = eager(resolve(&spec(CudaGraph::Auto), Place::Cuda(0), true).unwrap());
        assert!(why.contains("data-parallel"), "{why}");
        let err = resolve(&spec(CudaGraph::On), Place::Cuda(0), true).unwrap_err();
        assert!(err.0.contains("\"auto\""), "{}", err.0);
    }
}
