//! How a step is launched: the optimizer's implementation (`train.optimizer_impl`) and whether
//! the whole step is captured as a CUDA graph and replayed (`train.cuda_graph`), with the
//! reasons a spec's step cannot be captured whatever the device.
use serde::{Deserialize, Serialize};

use super::{Memory, Precision, Spec, Train};

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

/// Why no step of `s` can be captured as one graph, on any device; None when it can. Each
/// reason names the setting, because a captured step may neither wait for the host nor move
/// memory between host and device in the middle.
pub fn graph_declines(s: &Spec) -> Option<String> {
    graph_declines_of(&s.train, &s.memory)
}

/// [`graph_declines`] from the spec's `[train]` and `[memory]` tables alone.
pub fn graph_declines_of(t: &Train, m: &Memory) -> Option<String> {
    let host = [
        (
            m.parameters.is_host(),
            "memory.parameters = \"host\" streams blocks in and out during the step",
        ),
        (
            m.optimizer_state.is_host(),
            "memory.optimizer_state = \"host\" runs the update on the host",
        ),
        (
            m.gradients.is_host(),
            "memory.gradients = \"host\" moves gradients to the host during backward",
        ),
        (
            m.activations.is_host(),
            "memory.activations = \"host\" moves activations to the host during the step",
        ),
    ];
    if let Some((_, why)) = host.iter().find(|(on, _)| *on) {
        return Some((*why).to_owned());
    }
    if t.activation_checkpointing {
        return Some(
            "train.activation_checkpointing restores the generator's state from the host for each recomputed block"
                .into(),
        );
    }
    if t.precision == Precision::Fp16Mixed {
        return Some("fp16-mixed decides on the host whether to skip a step whose gradients are not finite".into());
    }
    if t.optimizer_state_bits == 8 {
        return Some(
            "train.optimizer_state_bits = 8 updates one parameter at a time, with no fused kernel to capture".into(),
        );
    }
    match t.optimizer_impl {
        OptimizerImpl::Single | OptimizerImpl::Foreach => Some(format!(
            "train.optimizer_impl = \"{}\" takes the learning rate from the host; a captured step needs \"fused\" (or \"auto\"), which reads it on the device",
            t.optimizer_impl.name()
        )),
        OptimizerImpl::Fused | OptimizerImpl::Auto => None,
    }
}
