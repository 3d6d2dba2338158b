//! The prefetching loader: background threads make the next training batches while the step
//! runs. The trainer hands it the epoch's micro-batches (their sample indices) in order; a
//! thread takes the next one whenever fewer than `depth` are staged or being made, gathers it
//! into a reused buffer, and the step takes it when it asks for exactly those indices.
//!
//! Timing changes only when a batch is ready, never what it holds: a batch is a function of its
//! indices and epoch alone ([`Source::gather_into`]), and a request that is not the next planned
//! one (a retried step, a changed micro-batch before the plan follows) is gathered on the spot.
//! So the batches, and training, are the same for any number of threads and any depth.
use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::gather::{Source, Staged};

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
        // A worker that panicked left the queue consistent: every change is one statement.
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

/// Below this much available RAM a thread gives up one batch of depth before making another.
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
    pub fn take(&self, idx: &[i64], epoch: i64) -> Staged {
        let mut s = self.shared.lock();
        loop {
            if s.epoch != epoch {
                break;
            }
            if let Some(mut head) = s.started.first_entry() {
                if head.get().idx != idx {
                    break;
                }
                if let Some(staged) = head.get_mut().staged.take() {
                    head.remove();
                    drop(s);
                    self.shared.ready.notify_all();
                    return staged;
                }
                s = self.shared.ready.wait(s).unwrap_or_else(|e| e.into_inner());
                continue;
            }
            // Nothing started: the next planned batch, if this is it, is made here.
            if s.todo.front().is_some_and(|(_, i)| i == idx) {
                s.todo.pop_front();
            }
            break;
        }
        let mut out = s.free.pop().unwrap_or_default();
        drop(s);
        self.shared.source.gather_into(idx, epoch, &mut out);
        out
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

impl Drop for Loader {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
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
                let from = s.depth;
                s.depth -= 1;
                s.shed.push((from, from - 1, avail));
                continue;
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
        shared.source.gather_into(&idx, epoch, &mut out);
        s = shared.lock();
        let current = s.generation == generation;
        match s.started.get_mut(&seq) {
            Some(slot) if current => slot.staged = Some(out),
            _ => s.free.push(out),
        }
        shared.ready.notify_all();
    }
}

/// Available RAM when it is below [`LOW_MEMORY`].
fn memory_is_low() -> Option<u64> {
    let avail = crate::sysmem::host_memory().ok()?.ram_available_bytes;
    (avail > 0 && avail < low_memory()).then_some(avail)
}

/// [`LOW_MEMORY`], or `MEMTRAIN_FAULT_LOW_MEMORY_BYTES` (a test hook: any available RAM below it
/// counts as low).
fn low_memory() -> u64 {
    std::env::var("MEMTRAIN_FAULT_LOW_MEMORY_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(LOW_MEMORY)
}
