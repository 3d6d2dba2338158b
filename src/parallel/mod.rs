//! Data-parallel training: which rank this process is, the group it trains in, and what the
//! ranks agree on every step. The engine is PyTorch's own c10d (through `shim::dist`).
//!
//! Each optimizer step's group of samples (the spec's effective batch, global) is split across
//! ranks ([`share`]); every rank divides its loss by the global group size, and DDP's Reducer
//! sums the gradients, so N ranks compute the gradient one process would. After its backward
//! work and before its optimizer writes anything, every rank takes part in one small exchange
//! ([`Dist::exchange`]): whether it ran out of memory, whether it was asked to stop, its loss and
//! correct count. An OOM anywhere makes every rank roll back the same group and take the same
//! recovery decision; a stop request anywhere stops every rank after the same group.
pub mod launch;
pub mod net;

use std::time::Duration;

use anyhow::{bail, Context, Result};
use tch::{Device, Kind, Tensor};

use crate::optim::Optimizer;
use crate::records::RankPeak;
use crate::shim::dist::{GlooDevice, Group, Join, Reducer};

/// Test-only switch: a process not launched as a rank forms a group of one (Gloo on the CPU,
/// NCCL on CUDA) and trains through the data-parallel path, so that path can be checked on a
/// machine with one GPU (scripts/gpu-check) or one core.
pub const SINGLE_RANK_GROUP: &str = "MEMTRAIN_TEST_SINGLE_RANK_GROUP";

/// How long a collective waits for the other ranks before failing (a dead or hung rank).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// This process's place in a data-parallel run, from the launcher's environment (torchrun's
/// names: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
#[derive(Debug, Clone, PartialEq)]
pub struct World {
    pub rank: usize,
    pub size: usize,
    pub local_rank: usize,
    pub local_size: usize,
    pub addr: String,
    pub port: u16,
    /// torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); else rank 0 does.
    pub agent_store: bool,
    pub timeout: Duration,
}

impl World {
    /// None when this process was not launched as a rank (or as the only one).
    pub fn from_env() -> Result<Option<World>> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    pub fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<Option<World>> {
        let num = |k: &str| -> Result<Option<usize>> {
            get(k)
                .map(|v| {
                    v.trim()
                        .parse::<usize>()
                        .with_context(|| format!("{k}={v:?} is not a non-negative integer"))
                })
                .transpose()
        };
        let timeout = match get("MEMTRAIN_DIST_TIMEOUT") {
            Some(v) => Duration::from_secs_f64(
                v.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|s| *s > 0.0 && *s <= 86_400.0)
                    .with_context(|| format!("MEMTRAIN_DIST_TIMEOUT={v:?}: give seconds, more than 0 and at most a day (86400), e.g. 120"))?,
            ),
            None => DEFAULT_TIMEOUT,
        };
        let single = match get(SINGLE_RANK_GROUP).as_deref().map(str::trim) {
            None | Some("" | "0") => false,
            Some("1") => true,
            Some(v) => bail!("{SINGLE_RANK_GROUP}={v:?}: set it to 1 (a one-rank group) or 0"),
        };
        let (rank, size) = (num("RANK")?, num("WORLD_SIZE")?);
        if single && size.unwrap_or(1) <= 1 {
            // Port 0: rank 0's store takes a free port, and nobody else needs to know it.
            return Ok(Some(World {
                rank: 0,
                size: 1,
                local_rank: 0,
                local_size: 1,
                addr: "127.0.0.1".into(),
                port: 0,
                agent_store: false,
                timeout,
            }));
        }
        let (Some(rank), Some(size)) = (rank, size) else {
            return Ok(None);
        };
        if size <= 1 {
            return Ok(None);
        }
        if rank >= size {
            bail!("RANK={rank} is not below WORLD_SIZE={size}");
        }
        let addr =
            get("MASTER_ADDR").context("WORLD_SIZE is set but MASTER_ADDR is not: the launcher must set both")?;
        let port =
            get("MASTER_PORT").context("WORLD_SIZE is set but MASTER_PORT is not: the launcher must set both")?;
        let port = port
            .trim()
            .parse::<u16>()
            .with_context(|| format!("MASTER_PORT={port:?} is not a port number"))?;
        Ok(Some(World {
            rank,
            size,
            local_rank: num("LOCAL_RANK")?.unwrap_or(rank),
            local_size: num("LOCAL_WORLD_SIZE")?.unwrap_or(size),
            addr,
            port,
            agent_store: get("TORCHELASTIC_USE_AGENT_STORE").is_some_and(|v| v.eq_ignore_ascii_case("true")),
            timeout,
        }))
    }
}

/// Rank `rank`'s part of `group` when `size` ranks share it, cut at micro-batch boundaries
/// where there are enough micro-batches (so each is computed as one process would), else in
/// near-equal slices. Contiguous, in rank order; earlier ranks take the remainder.
pub fn share(group: &[i64], micro_batch: usize, rank: usize, size: usize) -> &[i64] {
    let micro = micro_batch.max(1);
    let chunks = group.len().div_ceil(micro);
    let (unit, units, len) = if chunks >= size {
        (micro, chunks, group.len())
    } else {
        (1, group.len(), group.len())
    };
    let (base, extra) = (units / size, units % size);
    let first = rank * base + rank.min(extra);
    let count = base + usize::from(rank < extra);
    let start = (first * unit).min(len);
    let end = ((first + count) * unit).min(len);
    &group[start..end]
}

/// What all ranks agreed on after one step's backward work.
#[derive(Debug, Clone, PartialEq)]
pub struct Agreed {
    /// Ranks that ran out of memory.
    pub failed: Vec<usize>,
    /// Ranks whose step failed for another reason: every rank stops.
    pub broken: Vec<usize>,
    /// Some rank was asked to stop.
    pub stop: bool,
    /// Summed over ranks in rank order.
    pub loss_sum: f64,
    pub correct: i64,
}

/// How a rank's step went, as the exchange carries it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Outcome {
    Done,
    OutOfMemory,
    /// Any other error: not something a smaller micro-batch fixes.
    Broken,
}

/// This rank's side of the exchange.
#[derive(Debug, Clone, Copy)]
pub struct Local {
    pub outcome: Outcome,
    pub stop: bool,
    pub loss_sum: f64,
    pub correct: i64,
}

/// One slot per rank and field, summed: every rank reads every rank's values.
fn exchange_layout(size: usize, rank: usize, l: &Local) -> Vec<f64> {
    let mut v = vec![0.0; 4 * size];
    v[rank] = match l.outcome {
        Outcome::Done => 0.0,
        Outcome::OutOfMemory => 1.0,
        Outcome::Broken => 2.0,
    };
    v[size + rank] = f64::from(u8::from(l.stop));
    v[2 * size + rank] = l.loss_sum;
    v[3 * size + rank] = l.correct as f64;
    v
}

fn read_exchange(size: usize, v: &[f64]) -> Agreed {
    Agreed {
        failed: (0..size).filter(|&r| v[r] == 1.0).collect(),
        broken: (0..size).filter(|&r| v[r] == 2.0).collect(),
        stop: (0..size).any(|r| v[size + r] > 0.0),
        loss_sum: (0..size).fold(0.0, |a, r| a + v[2 * size + r]),
        correct: (0..size).map(|r| v[3 * size + r] as i64).sum(),
    }
}

/// A rank in a running group.
pub struct Dist {
    pub world: World,
    /// Where the group's collectives run (CUDA for NCCL, the CPU for Gloo).
    device: Device,
    group: Group,
    reducer: Option<Reducer>,
    /// Every rank's process id, to name a rank that died (same host only).
    pids: Vec<i32>,
}

impl std::fmt::Debug for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dist(rank {} of {})", self.world.rank, self.world.size)
    }
}

impl Dist {
    pub fn join(world: World, device: Device) -> Result<Dist> {
        let cuda_device = match device {
            Device::Cuda(i) => Some(i),
            _ => None,
        };
        let gloo = match cuda_device {
            None => net::gloo_device(std::env::var(net::IFNAME).ok().as_deref(), &world.addr, world.port)
                .with_context(|| format!("rank {} of {}: choosing Gloo's network device", world.rank, world.size))?,
            Some(_) => GlooDevice::Interfaces(vec![]),
        };
        let group = Group::join(&Join {
            host: &world.addr,
            port: world.port,
            rank: world.rank,
            size: world.size,
            host_store: !world.agent_store,
            prefix: "memtrain/",
            cuda_device,
            gloo: &gloo,
            timeout_ms: world.timeout.as_millis() as i64,
        })
        .with_context(|| {
            format!(
                "rank {} of {}: joining the group at {}:{}",
                world.rank, world.size, world.addr, world.port
            )
        })?;
        group.store_set(&format!("pid/{}", world.rank), &std::process::id().to_string())?;
        let mut pids = Vec::with_capacity(world.size);
        for r in 0..world.size {
            pids.push(group.store_get(&format!("pid/{r}"))?.parse().unwrap_or(0));
        }
        Ok(Dist {
            world,
            device,
            group,
            reducer: None,
            pids,
        })
    }

    pub fn rank(&self) -> usize {
        self.world.rank
    }

    pub fn size(&self) -> usize {
        self.world.size
    }

    /// Rank 0's values everywhere (parameters and buffers at start, as DDP does).
    pub fn broadcast(&self, tensors: &[&Tensor]) -> Result<()> {
        tch::no_grad(|| self.group.broadcast(tensors, 0)).map_err(|e| self.explain(e))
    }

    /// (Re)creates the Reducer over the weight parameters, in the order every rank gives them.
    pub fn attach(&mut self, params: &[&Tensor]) -> Result<()> {
        self.reducer = None; // its hooks go before the new one's are added
        self.reducer = Some(Reducer::new(&self.group, params)?);
        Ok(())
    }

    pub fn reducer(&self) -> Option<&Reducer> {
        self.reducer.as_ref()
    }

    pub fn exchange(&self, local: &Local) -> Result<Agreed> {
        let v = exchange_layout(self.world.size, self.world.rank, local);
        // Made while the others already wait in the collective: a buffer that cannot be made is
        // a failure of the collective.
        let t = Tensor::f_from_slice(&v)
            .map_err(|e| self.explain(e.into()))?
            .to_kind(Kind::Double)
            .to_device(self.device);
        self.group.allreduce_sum(&t).map_err(|e| self.explain(e))?;
        let back = crate::readback::all(&t).context("reading the exchange")?;
        Ok(read_exchange(self.world.size, &back))
    }

    /// Sharded optimizer state, after the owners' step: every parameter takes its owner's
    /// updated values (in place, one broadcast each, all in flight together).
    pub fn sync_shards(&self, opt: &Optimizer) -> Result<()> {
        let Some(shard) = opt.shard() else { return Ok(()) };
        let params: Vec<&Tensor> = opt.params().iter().map(|(_, t)| t).collect();
        tch::no_grad(|| self.group.broadcast_each(&params, &shard.owners)).map_err(|e| self.explain(e))
    }

    /// The whole optimizer state on rank 0, for a checkpoint any rank count can resume from:
    /// each state tensor is sent by its owner, one at a time, so rank 0 holds at most the full
    /// state and the other ranks nothing extra. Ranks other than 0 get an empty list. Unsharded:
    /// this rank's own state, no communication.
    pub fn gather_state(&self, opt: &Optimizer) -> Result<Vec<(String, Tensor)>> {
        let Some(shard) = opt.shard() else {
            return Ok(opt.state_tensors());
        };
        let mut out = Vec::new();
        let mut tag = 0i32;
        for (i, (_, p)) in opt.params().iter().enumerate() {
            let owner = shard.owners[i];
            let layout = opt.state_layout_of(i);
            for (s, name) in opt.state_names_of(i).into_iter().enumerate() {
                tag = tag.wrapping_add(1);
                match (self.rank(), owner) {
                    (0, 0) => out.push((name, opt.state_of(i)[s].shallow_clone())),
                    (0, from) => {
                        let slot = &layout[s];
                        let t = tch::no_grad(|| Tensor::f_zeros(&slot.size, (slot.kind, p.device())))
                            .context("rank 0 holding the other ranks' optimizer state")?;
                        self.group.recv(&t, from, tag).map_err(|e| self.explain(e))?;
                        out.push((name, t));
                    }
                    (me, _) if me == owner => self
                        .group
                        .send(&opt.state_of(i)[s], 0, tag)
                        .map_err(|e| self.explain(e))?,
                    _ => {}
                }
            }
        }
        Ok(out)
    }

    /// Every rank's peaks, from each rank's own (collective: every rank calls it).
    pub fn peaks(&self, own: RankPeak) -> Result<Vec<RankPeak>> {
        let opt = |v: Option<u64>| v.map_or(-1.0, |b| b as f64);
        let got = self.gather(&[
            opt(own.peak_allocated_bytes),
            opt(own.peak_reserved_bytes),
            own.peak_rss_bytes as f64,
        ])?;
        let back = |v: f64| (v >= 0.0).then_some(v as u64);
        Ok(got
            .iter()
            .enumerate()
            .map(|(rank, v)| RankPeak {
                rank,
                peak_allocated_bytes: back(v[0]),
                peak_reserved_bytes: back(v[1]),
                peak_rss_bytes: v[2] as u64,
            })
            .collect())
    }

    /// Every rank's `values` (same length everywhere), rank by rank. On the group's device:
    /// an NCCL group has no CPU backend.
    pub fn gather(&self, values: &[f64]) -> Result<Vec<Vec<f64>>> {
        let input = Tensor::from_slice(values).to_kind(Kind::Double).to_device(self.device);
        let out: Vec<Tensor> = (0..self.world.size).map(|_| input.zeros_like()).collect();
        self.group.allgather(&input, &out).map_err(|e| self.explain(e))?;
        out.iter()
            .map(|t| crate::readback::all(t).context("reading a gathered value"))
            .collect()
    }

    pub fn barrier(&self) -> Result<()> {
        self.group.barrier().map_err(|e| self.explain(e))
    }

    /// A collective failed: say which rank is gone, where that can be seen from here.
    pub fn explain(&self, e: anyhow::Error) -> anyhow::Error {
        if crate::oom::classify(&format!("{e:#}")).is_some() {
            // Not a lost peer: the others are still waiting in the collective.
            return e.context(
                "this rank ran out of memory inside a collective with the other ranks, which cannot be retried",
            );
        }
        let gone: Vec<String> = self
            .pids
            .iter()
            .enumerate()
            .filter(|&(r, &pid)| r != self.world.rank && pid > 0 && !alive(pid))
            .map(|(r, pid)| format!("rank {r} (pid {pid})"))
            .collect();
        if gone.is_empty() {
            e.context(format!(
                "a collective with the other ranks failed (a rank on another host died or hung past the {} s timeout?)",
                self.world.timeout.as_secs()
            ))
        } else {
            e.context(format!("{} stopped answering: it died; stopping", gone.join(", ")))
        }
    }
}

/// Whether `pid` still runs: a rank that just died may be a zombie until its launcher reaps
/// it, and may take a moment to die after closing its sockets, so look a few times.
fn alive(pid: i32) -> bool {
    for _ in 0..10 {
        let state = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next()));
        match state {
            None | Some('Z') | Some('X') => return false,
            Some(_) => std::thread::sleep(std::time::Duration::from_millis(100)),
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_cover_the_group_in_order_at_micro_batch_boundaries() {
        let g: Vec<i64> = (0..8).collect();
        // 2 micro-batches of 4, 2 ranks: one micro-batch each.
        assert_eq!(share(&g, 4, 0, 2), &[0, 1, 2, 3]);
        assert_eq!(share(&g, 4, 1, 2), &[4, 5, 6, 7]);
        // 3 micro-batches (4, 4, 2) over 2 ranks: the first takes two.
        let g10: Vec<i64> = (0..10).collect();
        assert_eq!(share(&g10, 4, 0, 2), &[0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(share(&g10, 4, 1, 2), &[8, 9]);
        // One micro-batch of 8 over 2 ranks: halves.
        assert_eq!(share(&g, 8, 0, 2), &[0, 1, 2, 3]);
        assert_eq!(share(&g, 8, 1, 2), &[4, 5, 6, 7]);
        // Fewer samples than ranks: the last rank gets none.
        assert_eq!(share(&[7], 4, 0, 2), &[7]);
        assert!(share(&[7], 4, 1, 2).is_empty());
        for size in 1..5 {
            for micro in 1..11 {
                let joined: Vec<i64> = (0..size).flat_map(|r| share(&g10, micro, r, size).to_vec()).collect();
                assert_eq!(joined, g10, "size {size} micro {micro}");
            }
        }
    }

    #[test]
    fn exchange_sums_in_rank_order_and_names_failed_ranks() {
        let size = 3;
        let locals = [
            Local {
                outcome: Outcome::Done,
                stop: false,
                loss_sum: 1.5,
                correct: 2,
            },
            Local {
                outcome: Outcome::OutOfMemory,
                stop: false,
                loss_sum: 0.0,
                correct: 0,
            },
            Local {
                outcome: Outcome::Broken,
                stop: true,
                loss_sum: 2.25,
                correct: 3,
            },
        ];
        let mut sum = vec![0.0; 4 * size];
        for (r, l) in locals.iter().enumerate() {
            for (s, v) in sum.iter_mut().zip(exchange_layout(size, r, l)) {
                *s += v;
            }
        }
        assert_eq!(
            read_exchange(size, &sum),
            Agreed {
                failed: vec![1],
                broken: vec![2],
                stop: true,
                loss_sum: 3.75,
                correct: 5
            }
        );
    }

    #[test]
    fn world_from_torchrun_names() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| pairs.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
        };
        assert_eq!(World::from_lookup(env(&[])).unwrap(), None);
        assert_eq!(
            World::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "1")])).unwrap(),
            None
        );
        let w = World::from_lookup(env(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(
            (w.rank, w.size, w.local_rank, w.port, w.agent_store),
            (1, 2, 1, 29500, true)
        );
        let e = World::from_lookup(env(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("not below"), "{e}");
        let e = World::from_lookup(env(&[("RANK", "0"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(e.to_string().contains("MASTER_ADDR"), "{e}");
        let one = World::from_lookup(env(&[("MEMTRAIN_TEST_SINGLE_RANK_GROUP", "1")]))
            .unwrap()
            .unwrap();
        assert_eq!((one.rank, one.size, one.port, one.agent_store), (0, 1, 0, false));
        assert_eq!(
            World::from_lookup(env(&[("MEMTRAIN_TEST_SINGLE_RANK_GROUP", "0")])).unwrap(),
            None
        );
        // Launched as one of several ranks, the switch changes nothing.
        let w = World::from_lookup(env(&[
            ("MEMTRAIN_TEST_SINGLE_RANK_GROUP", "1"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(w.size, 2);
        let e = World::from_lookup(env(&[("MEMTRAIN_TEST_SINGLE_RANK_GROUP", "yes")])).unwrap_err();
        assert!(e.to_string().contains("set it to 1"), "{e}");
        let timeouts: [&'static [(&'static str, &'static str)]; 4] = [
            &[("MEMTRAIN_DIST_TIMEOUT", "inf"), ("RANK", "0"), ("WORLD_SIZE", "1")],
            &[("MEMTRAIN_DIST_TIMEOUT", "1e30"), ("RANK", "0"), ("WORLD_SIZE", "1")],
            &[("MEMTRAIN_DIST_TIMEOUT", "0"), ("RANK", "0"), ("WORLD_SIZE", "1")],
            &[("MEMTRAIN_DIST_TIMEOUT", "soon"), ("RANK", "0"), ("WORLD_SIZE", "1")],
        ];
        for pairs in timeouts {
            let e = World::from_lookup(env(pairs)).unwrap_err();
            assert!(e.to_string().contains("at most a day (86400)"), "{pairs:?}: {e}");
        }
    }
}
