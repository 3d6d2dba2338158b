//! The prefetching loader: background threads make the next training batches while the step
//! runs. The trainer hands it the epoch's micro-batches (their sample indices) in order; a
//! thread takes the next one whenever fewer than `depth` are staged or being made, gathers it
//! into a reused buffer, and the step takes it when it asks for exactly those indices.
//!
//! Timing changes only when a batch is ready, never what it holds: a batch is a function of its
//! indices and epoch alone ([`Source::gather_into`]), and a request that is not the next planned
//! one (a retried step, a changed micro-batch before the plan follows) is gathered on the spot.
//! So the batches, and training, are the same for any number of threads and any depth.
use std::collections::{BTreeMap, TryReserveError, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;

use super::gather::{NotFinite, Source, Staged};

/// A batch the plan holds: its sample indices, and its buffer once made.
struct Slot {
    idx: Vec<i64>,
    staged: Option<Staged>,
}

#[derive(Default)]
struct State {
    /// Bumped by each plan: a batch made for an older plan is dropped.
    generation: u64,
    epoch: i64,
    next_seq: u64,
    /// Planned, not started.
    todo: VecDeque<(u64, Vec<i64>)>,
    /// Started (being made, or staged), by plan order.
    started: BTreeMap<u64, Slot>,
    /// Batches staged or being made at most.
    depth: usize,
    /// Buffers of taken batches, reused.
    free: Vec<Staged>,
    stop: bool,
    /// Depth given up under host-memory pressure, not yet reported: (from, to, available bytes).
    shed: Vec<(usize, usize, u64)>,
}

struct Shared {
    state: Mutex<State>,
    ready: Condvar,
    source: Source,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock (a batch is made outside it), so a poisoned
        // lock still guards a consistent queue.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

pub struct Loader {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Loader({} threads)", self.threads.len())
    }
}

/// Below this much available RAM a thread gives up one level of depth (down to 1) instead of
/// making another batch; each level shows as a record.
const LOW_MEMORY: u64 = 256 << 20;

impl Loader {
    /// `threads` threads keeping up to `depth` batches of `source` ahead.
    pub fn start(source: Source, depth: usize, threads: usize) -> Loader {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                depth,
                ..State::default()
            }),
            ready: Condvar::new(),
            source,
        });
        let threads = (0..threads.max(1))
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("memtrain-loader-{i}"))
                    .spawn(move || work(&s))
                    .expect("spawning a loader thread")
            })
            .collect();
        Loader { shared, threads }
    }

    /// The batches to make next, in order, for `epoch`; what an earlier plan staged is dropped.
    pub fn plan(&self, epoch: i64, batches: Vec<Vec<i64>>) {
        let mut s = self.shared.lock();
        s.generation += 1;
        s.epoch = epoch;
        let old: Vec<Slot> = std::mem::take(&mut s.started).into_values().collect();
        s.free.extend(old.into_iter().filter_map(|slot| slot.staged));
        let first = s.next_seq;
        s.next_seq += batches.len() as u64;
        s.todo = (first..).zip(batches).collect();
        drop(s);
        self.shared.ready.notify_all();
    }

    /// The batch of `idx` in `epoch`: the staged one when it is next in the plan (waiting for
    /// it if a thread is making it), else made here.
    pub fn take(&self, idx: &[i64], epoch: i64) -> Result<Staged, NotFinite> {
        let mut s = self.shared.lock();
        loop {
            if s.epoch != epoch {
                break;
            }
            if let Some(mut head) = s.started.first_entry() {
                if head.get().idx != idx {
                    if s.skip_to(idx) {
                        continue;
                    }
                    break;
                }
                if let Some(staged) = head.get_mut().staged.take() {
                    head.remove();
                    drop(s);
                    self.shared.ready.notify_all();
                    return Ok(staged);
                }
                s = self.shared.ready.wait(s).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            // Nothing started: the next planned batch, if this is it, is made here.
            match s.todo.front().is_some_and(|(_, i)| i == idx) {
                true => {
                    s.todo.pop_front();
                }
                false if s.skip_to(idx) => continue,
                false => {}
            }
            break;
        }
        let mut out = s.free.pop().unwrap_or_default();
        drop(s);
        self.shared.source.gather_into(idx, epoch, &mut out)?;
        Ok(out)
    }

    /// A taken batch's buffer, for the next batch.
    pub fn give_back(&self, staged: Staged) {
        let mut s = self.shared.lock();
        if s.free.len() <= s.depth {
            s.free.push(staged);
        }
    }

    /// Depth given up under host-memory pressure since the last call: (from, to, available
    /// RAM when it was given up).
    pub fn shed(&self) -> Vec<(usize, usize, u64)> {
        std::mem::take(&mut self.shared.lock().shed)
    }
}

impl State {
    /// A step asks for a planned batch further on: the planned ones before it were skipped (a
    /// group that finished at another micro-batch), and would otherwise hold the plan's head
    /// for the rest of the epoch. They are dropped; false if `idx` is nowhere in the plan.
    fn skip_to(&mut self, idx: &[i64]) -> bool {
        if let Some(at) = self.started.iter().find(|(_, slot)| slot.idx == idx).map(|(k, _)| *k) {
            let ahead: Vec<u64> = self.started.range(..at).map(|(k, _)| *k).collect();
            for k in ahead {
                // One being made goes to `free` when its thread finds its slot gone.
                if let Some(staged) = self.started.remove(&k).and_then(|slot| slot.staged) {
                    self.free.push(staged);
                }
            }
            return true;
        }
        let Some(p) = self.todo.iter().position(|(_, i)| i == idx) else {
            return false;
        };
        let started = std::mem::take(&mut self.started);
        self.free.extend(started.into_values().filter_map(|slot| slot.staged));
        self.todo.drain(..p);
        true
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl State {
    /// One batch fewer ahead, recorded with the memory available then; the spare buffers past
    /// the new depth go. Returns the new depth.
    fn shed_level(&mut self, available: u64) -> usize {
        let from = self.depth;
        self.depth -= 1;
        self.shed.push((from, self.depth, available));
        self.free.truncate(self.depth);
        self.depth
    }
}

/// A loader thread: makes the next planned batch whenever the depth allows.
fn work(shared: &Shared) {
    let mut s = shared.lock();
    loop {
        if s.stop {
            return;
        }
        if s.todo.is_empty() || s.started.len() >= s.depth {
            s = shared.ready.wait(s).unwrap_or_else(|e| e.into_inner());
            continue;
        }
        if s.depth > 1 {
            if let Some(avail) = memory_is_low() {
                let depth = s.shed_level(avail);
                // One level per batch made: the memory a level frees shows before the next look.
                if s.started.len() >= depth {
                    continue;
                }
            }
        }
        let (seq, idx) = s.todo.pop_front().expect("not empty");
        let (generation, epoch) = (s.generation, s.epoch);
        let mut out = s.free.pop().unwrap_or_default();
        s.started.insert(
            seq,
            Slot {
                idx: idx.clone(),
                staged: None,
            },
        );
        drop(s);
        // A batch whose buffer cannot be had is no reason to stop training: the loader keeps
        // one batch fewer ahead, and the batch goes back to the plan.
        if reserve(&shared.source, &idx, &mut out).is_err() {
            s = shared.lock();
            s.started.remove(&seq);
            if s.generation == generation {
                s.todo.push_front((seq, idx));
            }
            s.shed_level(crate::sysmem::available_bytes().unwrap_or(0));
            s.free.clear();
            shared.ready.notify_all();
            continue;
        }
        // A batch that cannot be made (a defect, a sample that is not finite) is taken off the
        // plan: the step then makes it itself and the error surfaces there, instead of the step
        // waiting forever.
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            shared.source.gather_into(&idx, epoch, &mut out).map(|()| out)
        }));
        s = shared.lock();
        let current = s.generation == generation;
        match (made, s.started.get_mut(&seq)) {
            (Ok(Ok(out)), Some(slot)) if current => slot.staged = Some(out),
            (Ok(Ok(out)), _) => s.free.push(out),
            (Ok(Err(_)) | Err(_), _) => {
                s.started.remove(&seq);
            }
        }
        shared.ready.notify_all();
    }
}

/// Room in `out` for the batch of `idx`, asked of the allocator so that a refusal is an error
/// here rather than an abort of the process where the batch is gathered.
fn reserve(source: &Source, idx: &[i64], out: &mut Staged) -> Result<(), TryReserveError> {
    let values = idx.len() * source.store.sample_values();
    if alloc_fault() {
        // Ask for more than any machine has: the allocator's refusal is real.
        out.x.try_reserve_exact(isize::MAX as usize / 8)?;
    }
    out.x.clear();
    out.x.try_reserve_exact(values)?;
    out.y.clear();
    out.y.try_reserve_exact(idx.len())
}

/// `MEMTRAIN_FAULT_LOADER_ALLOC_FAILS=N`, a test hook: the loader threads' first N batch
/// buffers are refused by the allocator.
fn alloc_fault() -> bool {
    static LEFT: OnceLock<AtomicU64> = OnceLock::new();
    let left = LEFT.get_or_init(|| {
        AtomicU64::new(
            std::env::var("MEMTRAIN_FAULT_LOADER_ALLOC_FAILS")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
        )
    });
    left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
        .is_ok()
}

/// Available RAM (under the cgroup's limit, where there is one) when it is below [`LOW_MEMORY`].
fn memory_is_low() -> Option<u64> {
    let avail = crate::sysmem::available_bytes()?;
    (avail < low_memory()).then_some(avail)
}

/// [`LOW_MEMORY`], or `MEMTRAIN_FAULT_LOW_MEMORY_BYTES` (a test hook: any available RAM below it
/// counts as low).
fn low_memory() -> u64 {
    std::env::var("MEMTRAIN_FAULT_LOW_MEMORY_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LOW_MEMORY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn planned(batches: &[&[i64]]) -> State {
        State {
            todo: (0..).zip(batches.iter().map(|b| b.to_vec())).collect(),
            depth: 2,
            ..State::default()
        }
    }

    #[test]
    fn a_step_further_on_in_the_plan_drops_the_skipped_batches() {
        // Two started (one staged, one being made), two still to do.
        let mut s = planned(&[&[3], &[4]]);
        s.started.insert(
            10,
            Slot {
                idx: vec![1],
                staged: Some(Staged::default()),
            },
        );
        s.started.insert(
            11,
            Slot {
                idx: vec![2],
                staged: None,
            },
        );
        assert!(s.skip_to(&[2]), "a started batch");
        assert_eq!(s.started.keys().copied().collect::<Vec<_>>(), [11]);
        assert_eq!(s.free.len(), 1, "the skipped batch's buffer is reused");
        assert!(s.skip_to(&[4]), "a planned batch");
        assert!(s.started.is_empty());
        assert_eq!(s.todo.iter().map(|(_, i)| i.clone()).collect::<Vec<_>>(), [vec![4]]);
        assert!(!s.skip_to(&[9]), "not in the plan: made on the spot, the plan kept");
        assert_eq!(s.todo.len(), 1);
    }
}
