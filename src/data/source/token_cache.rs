//! A token cache as its ids are made: each int32 tensor spilled to a temporary file of its own
//! as the values come, so memory stays bounded whatever the text's size; `finish` writes the
//! safetensors file (its header, then each tensor's bytes in order) and renames it into place.
use std::fs;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::Result;

/// One tensor of the cache while it is made.
struct Part {
    name: &'static str,
    path: PathBuf,
    out: Option<BufWriter<fs::File>>,
    values: u64,
}

pub(super) struct Spill {
    dir: PathBuf,
    stem: String,
    parts: Vec<Part>,
}

impl Spill {
    /// Temporary files for the tensors `names`, beside the cache `path` is to be (two runs may
    /// tokenize the same file: each writer has files of its own).
    pub(super) fn new(path: &Path, names: &[&'static str]) -> Result<Spill> {
        let dir = path
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        fs::create_dir_all(&dir)?;
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let stem = format!(".tmp-tokens-{}-{nanos:x}", std::process::id());
        let mut spill = Spill {
            dir,
            stem,
            parts: vec![],
        };
        for name in names {
            let path = spill.dir.join(format!("{}.{name}", spill.stem));
            let file = fs::OpenOptions::new().write(true).create_new(true).open(&path)?;
            spill.parts.push(Part {
                name,
                path,
                out: Some(BufWriter::with_capacity(1 << 20, file)),
                values: 0,
            });
        }
        Ok(spill)
    }

    /// Appends `values` to tensor `i`.
    pub(super) fn push(&mut self, i: usize, values: impl IntoIterator<Item = i32>) -> Result<()> {
        let part = &mut self.parts[i];
        let out = part.out.as_mut().expect("a part is written until finish");
        for v in values {
            out.write_all(&v.to_le_bytes())?;
            part.values += 1;
        }
        Ok(())
    }

    /// The values tensor `i` holds so far.
    pub(super) fn len(&self, i: usize) -> u64 {
        self.parts[i].values
    }

    /// The cache at `path`, each tensor of the shape `shapes` gives it in order: written to a
    /// temporary file, synced, then renamed, so a reader never sees half of one.
    pub(super) fn finish(mut self, path: &Path, shapes: &[Vec<i64>]) -> Result<()> {
        let mut header = serde_json::Map::new();
        let mut at = 0u64;
        for (part, shape) in self.parts.iter_mut().zip(shapes) {
            part.out
                .take()
                .expect("a part is written until finish")
                .into_inner()
                .map_err(|e| e.into_error())?;
            let end = at + part.values * 4;
            header.insert(
                part.name.into(),
                serde_json::json!({"dtype": "I32", "shape": shape, "data_offsets": [at, end]}),
            );
            at = end;
        }
        let header = serde_json::Value::Object(header).to_string();
        let padded = format!("{header:<width$}", width = header.len().div_ceil(8) * 8);
        let tmp = self.dir.join(&self.stem);
        let written = (|| -> Result<()> {
            let file = fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            let mut w = BufWriter::with_capacity(1 << 20, file);
            w.write_all(&(padded.len() as u64).to_le_bytes())?;
            w.write_all(padded.as_bytes())?;
            for part in &self.parts {
                std::io::copy(&mut fs::File::open(&part.path)?, &mut w)?;
            }
            let f = w.into_inner().map_err(|e| e.into_error())?;
            f.sync_all()?;
            fs::rename(&tmp, path)?;
            Ok(())
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written
    }
}

impl Drop for Spill {
    /// The temporary files go, whether the cache was written or tokenizing stopped.
    fn drop(&mut self) {
        for part in &mut self.parts {
            drop(part.out.take());
            let _ = fs::remove_file(&part.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The cache as one buffer: the safetensors layout the spilled writer must reproduce byte
    /// for byte (the token caches written before stay valid, and a cache's bytes do not depend
    /// on how it was made).
    fn whole(tensors: &[(&str, Vec<i64>, Vec<i32>)]) -> Vec<u8> {
        let mut header = serde_json::Map::new();
        let mut at = 0usize;
        for (name, shape, values) in tensors {
            let end = at + values.len() * 4;
            header.insert(
                (*name).into(),
                serde_json::json!({"dtype": "I32", "shape": shape, "data_offsets": [at, end]}),
            );
            at = end;
        }
        let header = serde_json::Value::Object(header).to_string();
        let padded = format!("{header:<width$}", width = header.len().div_ceil(8) * 8);
        let mut out = (padded.len() as u64).to_le_bytes().to_vec();
        out.extend(padded.as_bytes());
        for (_, _, values) in tensors {
            out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        }
        out
    }

    #[test]
    fn a_spilled_cache_is_the_whole_one_byte_for_byte_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sub").join("t.safetensors");
        let x: Vec<i32> = (0..300_001).map(|i| (i * 7919) % 50_000).collect();
        let y: Vec<i32> = x.iter().map(|v| if v % 3 == 0 { -100 } else { *v }).collect();
        let mut spill = Spill::new(&path, &["x", "y"]).unwrap();
        for (a, b) in x.chunks(1000).zip(y.chunks(1000)) {
            spill.push(0, a.iter().copied()).unwrap();
            spill.push(1, b.iter().copied()).unwrap();
        }
        assert_eq!(spill.len(0), x.len() as u64);
        spill
            .finish(&path, &[vec![x.len() as i64], vec![x.len() as i64]])
            .unwrap();
        let want = whole(&[("x", vec![x.len() as i64], x.clone()), ("y", vec![x.len() as i64], y)]);
        assert!(std::fs::read(&path).unwrap() == want, "the same bytes");
        let left: Vec<_> = std::fs::read_dir(path.parent().unwrap()).unwrap().collect();
        assert_eq!(left.len(), 1, "only the cache: {left:?}");

        // Stopped before the end (a bad line): no cache and nothing else either.
        let other = dir.path().join("other.safetensors");
        let mut spill = Spill::new(&other, &["x"]).unwrap();
        spill.push(0, x.iter().copied()).unwrap();
        drop(spill);
        assert!(!other.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "only sub/");
    }
}
