//! The run's records: `metrics.jsonl` (one JSON object per line, appended and flushed as they
//! happen, so a killed run keeps everything up to its last line) and `summary.json`.
use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Write};
use std::path::Path;

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::{json, Value};

use crate::memory::MemorySample;

pub struct Metrics {
    out: BufWriter<File>,
}

impl Metrics {
    pub fn open(path: &Path) -> Result<Self> {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        Ok(Metrics { out: BufWriter::new(f) })
    }

    /// Appends `{"type": kind, "time": <unix seconds>, ...fields}`.
    pub fn record(&mut self, kind: &str, fields: Value) -> Result<()> {
        let mut obj = json!({ "type": kind, "time": unix_time() });
        if let (Some(o), Value::Object(f)) = (obj.as_object_mut(), fields) {
            o.extend(f);
        }
        serde_json::to_writer(&mut self.out, &obj)?;
        self.out.write_all(b"\n")?;
        self.out.flush().context("writing metrics.jsonl")
    }
}

pub fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Writes JSON atomically: a temporary file, fsync, rename.
pub fn write_json_atomic<T: Serialize>(path: &Path, value: &T) -> Result<()> {
    let tmp = path.with_extension("json.tmp");
    {
        let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        serde_json::to_writer_pretty(&mut f, value)?;
        f.write_all(b"\n")?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} to {}", tmp.display(), path.display()))
}

/// Memory fields shared by epoch and step records.
pub fn memory_fields(m: &MemorySample) -> Value {
    serde_json::to_value(m).unwrap_or(Value::Null)
}
