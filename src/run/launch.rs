//! Which way a step runs: one rank of a data-parallel group, or a single process whose steps
//! may be captured as CUDA graphs (`graph`), eager otherwise.
use super::execution::Execution;
use super::graph::StepKind;
use super::step::{StepOutput, StepPipeline, Stepping, Work};
use super::tally::Tally;
use crate::model::Net;
use crate::oom::StepError;
use crate::optim::Optimizer;

impl StepPipeline {
    /// Runs the pipeline once for `work`, stepping `opt`; `others` are optimizers whose
    /// gradients are zeroed too (their parameters get gradients from this backward pass but
    /// are not stepped here). The step's loss and correct count go into `tally` (the weight
    /// step's; the architecture step keeps none).
    pub fn run(
        &self,
        net: &dyn Net,
        opt: &mut Optimizer,
        others: &mut [&mut Optimizer],
        work: &Work,
        exec: &mut Execution,
        tally: Option<&mut Tally>,
    ) -> Result<StepOutput, StepError> {
        let stepping = Stepping {
            net,
            opt,
            others,
            work,
            tally,
        };
        match exec {
            Execution::Local(graphs) => {
                // DARTS's architecture step is the one the step count leaves out.
                let kind = match work.step {
                    Some(_) => StepKind::Weights,
                    None => StepKind::Architecture,
                };
                graphs.step(self, kind, stepping)
            }
            Execution::DataParallel(d) => self.data_parallel(d, stepping),
        }
    }
}
