//! The CUDA caching allocator's segments at an OOM, read from `oom/snapshot.pickle` (the
//! pickle `torch.cuda.memory._snapshot()` returns and PyTorch's memory_viz page loads).
use anyhow::{bail, Context, Result};
use serde_pickle::{DeOptions, HashableValue, Value};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockState {
    /// Holds a tensor.
    Allocated,
    /// Freed by its tensor but still in use by another stream.
    AwaitingFree,
    /// Cached and free for reuse.
    Free,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Block {
    pub size: u64,
    pub state: BlockState,
}

/// One cudaMalloc'd segment and the blocks it is split into, in address order.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub address: u64,
    pub total_size: u64,
    pub stream: i64,
    pub large: bool,
    pub blocks: Vec<Block>,
}

impl Segment {
    pub fn allocated(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state != BlockState::Free)
            .map(|b| b.size)
            .sum()
    }

    pub fn largest_free(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state == BlockState::Free)
            .map(|b| b.size)
            .max()
            .unwrap_or(0)
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct SegmentMap {
    pub segments: Vec<Segment>,
    /// The allocation that failed: the snapshot's last "oom" trace entry, else the size the
    /// error message names ("Tried to allocate 2.00 GiB").
    pub request: Option<u64>,
}

impl SegmentMap {
    pub fn from_pickle(bytes: &[u8], error: &str) -> Result<Self> {
        let root = serde_pickle::value_from_slice(bytes, DeOptions::new().replace_unresolved_globals())
            .context("not a pickle")?;
        let Some(segs) = get(&root, "segments") else {
            bail!("the pickle has no \"segments\"; is it a torch.cuda.memory._snapshot()?")
        };
        let mut segments = vec![];
        for s in items(segs) {
            let blocks = get(s, "blocks").map(items).unwrap_or_default();
            segments.push(Segment {
                address: int(get(s, "address")).unwrap_or(0) as u64,
                total_size: int(get(s, "total_size")).context("a segment without total_size")? as u64,
                stream: int(get(s, "stream")).unwrap_or(0),
                large: text(get(s, "segment_type")) != Some("small"),
                blocks: blocks
                    .into_iter()
                    .map(|b| Block {
                        size: int(get(b, "size")).unwrap_or(0) as u64,
                        state: match text(get(b, "state")) {
                            Some("active_allocated") => BlockState::Allocated,
                            Some("active_pending_free" | "active_awaiting_free") => BlockState::AwaitingFree,
                            _ => BlockState::Free,
                        },
                    })
                    .collect(),
            });
        }
        let traced = get(&root, "device_traces")
            .map(items)
            .unwrap_or_default()
            .into_iter()
            .flat_map(items)
            .filter(|e| text(get(e, "action")) == Some("oom"))
            .filter_map(|e| int(get(e, "size")))
            .next_back();
        Ok(SegmentMap {
            segments,
            request: traced.map(|s| s as u64).or_else(|| requested_in(error)),
        })
    }

    pub fn reserved(&self) -> u64 {
        self.segments.iter().map(|s| s.total_size).sum()
    }

    pub fn allocated(&self) -> u64 {
        self.segments.iter().map(Segment::allocated).sum()
    }

    pub fn largest_free(&self) -> u64 {
        self.segments.iter().map(Segment::largest_free).max().unwrap_or(0)
    }
}

/// "Tried to allocate 20.00 MiB" in a CUDA OOM message.
fn requested_in(error: &str) -> Option<u64> {
    let rest = error.split("Tried to allocate ").nth(1)?;
    let mut words = rest.split_whitespace();
    let size = format!("{} {}", words.next()?, words.next()?.trim_end_matches([',', '.', ';']));
    parse_size::Config::new().with_binary().parse_size(size).ok()
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    match v {
        Value::Dict(d) => d.get(&HashableValue::String(key.to_owned())),
        _ => None,
    }
}

fn items(v: &Value) -> Vec<&Value> {
    match v {
        Value::List(l) | Value::Tuple(l) => l.iter().collect(),
        _ => vec![],
    }
}

fn int(v: Option<&Value>) -> Option<i64> {
    match v? {
        Value::I64(i) => Some(*i),
        Value::Int(b) => b.to_string().parse().ok(),
        _ => None,
    }
}

fn text(v: Option<&Value>) -> Option<&str> {
    match v? {
        Value::String(s) => Some(s),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn dict(pairs: Vec<(&str, Value)>) -> Value {
        Value::Dict(
            pairs
                .into_iter()
                .map(|(k, v)| (HashableValue::String(k.into()), v))
                .collect::<BTreeMap<_, _>>(),
        )
    }

    fn block(size: i64, state: &str) -> Value {
        dict(vec![("size", Value::I64(size)), ("state", Value::String(state.into()))])
    }

    #[test]
    fn reads_segments_blocks_and_the_failed_request() {
        let snap = dict(vec![
            (
                "segments",
                Value::List(vec![dict(vec![
                    ("address", Value::I64(1 << 20)),
                    ("total_size", Value::I64(6 << 20)),
                    ("stream", Value::I64(0)),
                    ("segment_type", Value::String("large".into())),
                    (
                        "blocks",
                        Value::List(vec![
                            block(2 << 20, "active_allocated"),
                            block(1 << 20, "inactive"),
                            block(2 << 20, "active_allocated"),
                            block(1 << 20, "inactive"),
                        ]),
                    ),
                ])]),
            ),
            (
                "device_traces",
                Value::List(vec![Value::List(vec![dict(vec![
                    ("action", Value::String("oom".into())),
                    ("size", Value::I64(3 << 20)),
                ])])]),
            ),
        ]);
        let bytes = serde_pickle::value_to_vec(&snap, Default::default()).unwrap();
        let m = SegmentMap::from_pickle(&bytes, "").unwrap();
        assert_eq!(m.segments.len(), 1);
        assert_eq!(m.reserved(), 6 << 20);
        assert_eq!(m.allocated(), 4 << 20);
        assert_eq!(m.largest_free(), 1 << 20, "2 MiB free in all, but in two pieces");
        assert_eq!(m.request, Some(3 << 20));
    }

    #[test]
    fn the_request_comes_from_the_message_without_a_trace() {
        assert_eq!(
            requested_in("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has"),
            Some(20 << 20)
        );
        assert_eq!(requested_in("CPU cap"), None);
        let e = SegmentMap::from_pickle(b"not a pickle", "").unwrap_err();
        assert!(format!("{e:#}").contains("not a pickle"));
    }
}
