//! How a step is launched: the optimizer's implementation (`train.optimizer_impl`) and whether
//! the whole step is captured as a CUDA graph and replayed (`train.cuda_graph`).
use serde::{Deserialize, Serialize};

/// `train.optimizer_impl`: how the optimizer's update is launched (the numbers are PyTorch's
/// implementation of the same name).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerImpl {
    /// One parameter at a time (`foreach=False, fused=False`).
    Single,
    /// Multi-tensor `_foreach_*` ops over groups of parameters (`foreach=True`).
    Foreach,
    /// One fused kernel per group (`fused=True`: `_fused_sgd_`, `_fused_adam_`, `_fused_adamw_`).
    Fused,
    /// PyTorch's default: foreach on CUDA, single on the CPU, single wherever the others cannot
    /// apply.
    Auto,
}

impl OptimizerImpl {
    pub fn name(self) -> &'static str {
        match self {
            OptimizerImpl::Single => "single",
            OptimizerImpl::Foreach => "foreach",
            OptimizerImpl::Fused => "fused",
            OptimizerImpl::Auto => "auto",
        }
    }
}

/// `train.cuda_graph`: capture the whole on-device step (forward, loss, backward, clipping and
/// the fused update) once per batch shape and replay it with one launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CudaGraph {
    /// Capture where the run allows it; run eager elsewhere and say why.
    Auto,
    /// Capture; a spec whose step cannot be captured is refused.
    On,
    /// Run every step eager.
    Off,
}

impl CudaGraph {
    pub fn name(self) -> &'static str {
        match self {
            CudaGraph::Auto => "auto",
            CudaGraph::On => "on",
            CudaGraph::Off => "off",
        }
    }
}
