//! Reading a checkpoint back where the memory policy puts the optimizer state, before the cap
//! can stop the resume.
use anyhow::Result;

use crate::checkpoint::Loaded;
use crate::exit::OomExit;
use crate::host::Home;
use crate::optim::Optimizer;
use crate::policy::levers::{Described, HostState};

/// Reads a checkpoint with `read`, given where the optimizer state lives (state on the host is
/// read there). When the state is on the device, the read runs out of memory and `memory.on_oom`
/// has "offload", the state moves to the host as that lever would move it at the first step,
/// and the read is tried once more. Some: the lever that moved it, which the run keeps engaged.
pub(super) fn read(
    opt: &mut Optimizer,
    offload_on_oom: bool,
    read: impl Fn(Home) -> Result<Loaded>,
) -> Result<(Loaded, Option<&'static str>)> {
    let home = opt.state_home();
    let movable = offload_on_oom && home == Home::Device && !opt.hyper().state_slots().is_empty();
    match read(home) {
        Err(e) if movable && e.is::<OomExit>() => {
            tracing::warn!(
                "out of memory reading the checkpoint beside the optimizer state on the device; memory.on_oom has \"offload\": the optimizer state moves to host memory and the checkpoint is read again"
            );
            opt.place_state(Home::Host);
            Ok((read(Home::Host)?, Some(HostState.name())))
        }
        r => Ok((r?, None)),
    }
}
