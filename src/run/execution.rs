//! How a run executes: one process, or one rank of a data-parallel group. The step and the
//! trainer ask the strategy instead of threading an optional group through every call.
use anyhow::{Context, Result};
use tch::Tensor;

use super::graph::{CaptureOom, StepGraphs};
use crate::checkpoint::NamedTensors;
use crate::optim::Optimizer;
use crate::parallel::Dist;
use crate::plan::GraphPlan;
use crate::records::{GraphEvent, RankPeak};

pub enum Execution {
    /// One process, whose steps may be captured as CUDA graphs.
    Local(StepGraphs),
    DataParallel(Dist),
}

impl Execution {
    pub fn group(&self) -> Option<&Dist> {
        match self {
            Execution::Local(_) => None,
            Execution::DataParallel(d) => Some(d),
        }
    }

    /// Rank 0 of a group, or a single process: the one that writes records and checkpoints.
    pub fn leads(&self) -> bool {
        self.group().is_none_or(|d| d.rank() == 0)
    }

    /// This rank's share of a group of samples, and whether it contributes to the loss: a rank
    /// left without samples runs the group's first one with a zero loss so that its Reducer
    /// takes part.
    pub fn share<'a>(&self, group: &'a [i64], micro_batch: usize) -> (&'a [i64], bool) {
        match self.group() {
            None => (group, true),
            Some(d) => match crate::parallel::share(group, micro_batch, d.rank(), d.size()) {
                [] => (&group[..1], false),
                s => (s, true),
            },
        }
    }

    /// Whether the run stops after this step: a group stops on the step its ranks agreed on,
    /// never on one rank's own.
    pub fn stops(&self, agreed: bool, asked_here: bool) -> bool {
        match self {
            Execution::Local(_) => asked_here,
            Execution::DataParallel(_) => agreed,
        }
    }

    /// Every rank's peaks (a collective); empty for a single process.
    pub fn peaks(&self, own: RankPeak) -> Result<Vec<RankPeak>> {
        match self.group() {
            Some(d) => d.peaks(RankPeak { rank: d.rank(), ..own }),
            None => Ok(Vec::new()),
        }
    }

    /// The optimizer's whole state: sharded state comes together on rank 0.
    pub fn state_tensors(&self, opt: &Optimizer) -> Result<NamedTensors> {
        match self.group() {
            Some(d) => d.gather_state(opt).context("gathering the sharded optimizer state"),
            None => Ok(opt.state_tensors()),
        }
    }

    /// Rank 0's weights and buffers everywhere, as DDP does at start, and the gradient Reducer.
    pub fn share_model(&mut self, vars: &[(String, Tensor)], params: &[&Tensor]) -> Result<()> {
        if let Execution::DataParallel(d) = self {
            let all: Vec<&Tensor> = vars.iter().map(|(_, t)| t).collect();
            d.broadcast(&all).context("sharing rank 0's model")?;
            d.attach(params).context("creating the gradient Reducer")?;
        }
        Ok(())
    }

    /// Another rank is gone: no collective runs from here on. (Called after any save: dropping
    /// a group can block on a hung peer with NCCL.)
    pub fn lose_peers(&mut self) {
        let why = "the data-parallel group was lost".to_owned();
        *self = Execution::Local(StepGraphs::new(GraphPlan::Eager(why)));
    }

    /// Captures that ran out of memory since last asked (none in a group).
    pub fn capture_ooms(&mut self) -> Vec<CaptureOom> {
        match self {
            Execution::Local(g) => g.take_ooms(),
            Execution::DataParallel(_) => Vec::new(),
        }
    }

    /// What the captured steps have to record since last asked (nothing in a group).
    pub fn graph_events(&mut self) -> Vec<GraphEvent> {
        match self {
            Execution::Local(g) => g.take_events(),
            Execution::DataParallel(_) => Vec::new(),
        }
    }
}
