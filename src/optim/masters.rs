//! The host's master copies of the parameters a host update writes, and the runs that update
//! takes.
use tch::{Device, Tensor};

use crate::host::Host;

/// The host's copy of each parameter a host update writes, made when the first such update
/// needs it: the master copy, so that a step uploads parameters and never downloads them. Only
/// the optimizer writes parameters between steps; whatever else writes them (a checkpoint's
/// state, a placement change, a move) drops the copies, and the next update makes them again.
#[derive(Default)]
pub(super) struct Masters(Vec<Option<Tensor>>);

impl Masters {
    /// The tensors the host update writes: each parameter itself where it rests on the CPU (a
    /// CPU run, streamed parameters), its master copy where it lives on a CUDA device.
    pub(super) fn targets(
        &mut self,
        host: &Host,
        params: &[(String, Tensor)],
        live: &[(usize, Tensor)],
    ) -> Vec<(String, Tensor)> {
        self.0.resize_with(params.len(), || None);
        let mut out: Vec<(String, Tensor)> = params.iter().map(|(n, p)| (n.clone(), p.shallow_clone())).collect();
        for (i, _) in live {
            let p = &params[*i].1;
            if p.device() == Device::Cpu {
                continue;
            }
            let master = self.0[*i].get_or_insert_with(|| host.copy_of(p));
            out[*i].1 = master.shallow_clone();
        }
        out
    }

    pub(super) fn drop_all(&mut self) {
        self.0.clear();
    }
}

/// The live parameters in runs of about 64 MiB of gradient bytes, as ranges of `live`, each
/// within one block (`block_of` a parameter): a host update waits for one run's gradients,
/// updates it and sends it up while the next run's gradients land and the previous run's
/// parameters travel.
pub(super) fn update_runs<K: PartialEq>(
    live: &[(usize, Tensor)],
    block_of: impl Fn(usize) -> K,
) -> Vec<std::ops::Range<usize>> {
    const RUN_BYTES: u64 = 64 << 20;
    let mut out = Vec::new();
    let (mut start, mut bytes) = (0, 0);
    for (j, (i, g)) in live.iter().enumerate() {
        bytes += crate::memory::tensor_bytes(g);
        let last_of_block = live.get(j + 1).is_none_or(|(next, _)| block_of(*next) != block_of(*i));
        if bytes >= RUN_BYTES || last_of_block {
            out.push(start..j + 1);
            (start, bytes) = (j + 1, 0);
        }
    }
    out
}
