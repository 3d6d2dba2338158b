//! TensorBoard event files (`log.tensorboard = true`): the run's scalars where people already
//! look at their runs. The format is TFRecord framing around `tensorflow.Event` protobufs; the
//! three messages and five fields involved are encoded here by hand rather than pulling in a
//! protobuf toolchain.
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

pub struct EventWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl EventWriter {
    /// A new event file in `dir` (TensorBoard reads every `*tfevents*` file of a directory, so a
    /// resumed run adds a file beside the first).
    pub fn create(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let now = super::clock::unix_time();
        let host = fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "localhost".into());
        let name = format!(
            "events.out.tfevents.{}.{}.{}.memtrain",
            now as u64,
            host.trim(),
            std::process::id()
        );
        let path = dir.join(name);
        let f = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = EventWriter {
            path,
            out: BufWriter::new(f),
        };
        let mut event = vec![];
        double_field(&mut event, 1, now);
        bytes_field(&mut event, 3, b"brain.Event:2");
        w.record(&event)?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One event holding the present `values` as scalars at `step`, flushed so a killed run
    /// keeps it.
    pub fn scalars(&mut self, step: i64, wall_time: f64, values: &[(&str, Option<f64>)]) -> Result<()> {
        let mut summary = vec![];
        for (tag, v) in values.iter().filter_map(|(t, v)| Some((t, (*v)?))) {
            let mut value = vec![];
            bytes_field(&mut value, 1, tag.as_bytes());
            key(&mut value, 2, 5);
            value.extend_from_slice(&(v as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        let mut event = vec![];
        double_field(&mut event, 1, wall_time);
        key(&mut event, 2, 0);
        varint(&mut event, step as u64);
        bytes_field(&mut event, 5, &summary);
        self.record(&event)?;
        self.out
            .flush()
            .with_context(|| format!("writing {}", self.path.display()))
    }

    /// TFRecord framing: length, masked CRC-32C of the length, data, masked CRC-32C of the data.
    fn record(&mut self, data: &[u8]) -> Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc(data).to_le_bytes())?;
        Ok(())
    }
}

fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c::crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A protobuf field key: field number and wire type (0 varint, 1 fixed64, 2 bytes, 5 fixed32).
fn key(out: &mut Vec<u8>, field: u64, wire: u64) {
    varint(out, (field << 3) | wire);
}

fn double_field(out: &mut Vec<u8>, field: u64, v: f64) {
    key(out, field, 1);
    out.extend_from_slice(&v.to_le_bytes());
}

fn bytes_field(out: &mut Vec<u8>, field: u64, b: &[u8]) {
    key(out, field, 2);
    varint(out, b.len() as u64);
    out.extend_from_slice(b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc_and_varints_match_the_reference_values() {
        // CRC-32C of "123456789" is 0xE3069283 (the standard check value).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let mut v = vec![];
        varint(&mut v, 300);
        assert_eq!(v, [0xAC, 0x02]);
    }

    #[test]
    fn records_are_framed_with_lengths_and_checksums() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path()).unwrap();
        w.scalars(
            7,
            1.5,
            &[
                ("train/loss", Some(0.25)),
                ("skipped", None),
                ("diverged", Some(f64::NAN)),
            ],
        )
        .unwrap();
        let bytes = fs::read(w.path()).unwrap();
        let mut at = 0;
        let mut records = vec![];
        while at < bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            let len_crc = u32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
            assert_eq!(len_crc, masked_crc(&bytes[at..at + 8]));
            let data = &bytes[at + 12..at + 12 + len];
            let crc = u32::from_le_bytes(bytes[at + 12 + len..at + 16 + len].try_into().unwrap());
            assert_eq!(crc, masked_crc(data));
            records.push(data.to_vec());
            at += 16 + len;
        }
        assert_eq!(records.len(), 2);
        assert!(records[0].windows(13).any(|w| w == b"brain.Event:2"));
        assert!(records[1].windows(10).any(|w| w == b"train/loss"));
        assert!(
            !records[1].windows(7).any(|w| w == b"skipped"),
            "an absent value is left out"
        );
        assert!(records[1].windows(8).any(|w| w == b"diverged"), "a NaN is written");
        assert!(records[1].windows(4).any(|w| w == 0.25f32.to_le_bytes()));
    }
}
