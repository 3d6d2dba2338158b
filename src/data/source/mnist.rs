//! `mnist`: a directory with the (gunzipped) IDX files `train-images-idx3-ubyte`,
//! `train-labels-idx1-ubyte`, `t10k-images-idx3-ubyte` and `t10k-labels-idx1-ubyte`; pixels are
//! scaled to [0, 1]. The train files are the training split and the t10k files the validation
//! split, so `data.val_fraction` is ignored; `data.val_path`, if set, names another directory
//! whose t10k files are used instead.
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::Tensor;

use super::{label_range, DataClasses};
use super::{pixel_part, val_dir, Opened, Reader, Want};
use crate::data::check::required_path;
use crate::spec::schema::Data;

pub struct Mnist;

impl Reader for Mnist {
    fn sample_shape(&self, _: &Data, _: &Path) -> Result<Option<Vec<i64>>> {
        Ok(Some(vec![28, 28]))
    }

    fn open(&self, want: &Want) -> Result<Opened> {
        let data = want.data;
        let dir = required_path(data)?;
        let (vkey, vdir) = val_dir(data, dir);
        // Look for every file first, so one error lists all that are missing.
        let (train_files, val_files) = if vdir == dir {
            let mut f = mnist_files(dir, &["train", "t10k"], "data.path")?;
            let v = f.split_off(2);
            (f, v)
        } else {
            (
                mnist_files(dir, &["train"], "data.path")?,
                mnist_files(vdir, &["t10k"], vkey)?,
            )
        };
        let part = |files: &[PathBuf], key: &str, what| pixel_part(read_mnist_pair, files, key, what);
        let train = part(
            &train_files,
            "data.path",
            format!("data.path {} (train files)", dir.display()),
        )?;
        let val = part(&val_files, vkey, format!("{vkey} {} (t10k files)", vdir.display()))?;
        Ok(Opened { train, val: Some(val) })
    }

    fn how_read(&self, _: &Data) -> &'static str {
        "read whole into memory"
    }

    /// The labels' range over the train and t10k label files (the image files are not read).
    fn classes(&self, data: &Data, dir: &Path) -> Result<Option<DataClasses>> {
        let (vkey, vdir) = val_dir(data, dir);
        let mut top = None;
        for (key, d, split) in [("data.path", dir, "train"), (vkey, vdir, "t10k")] {
            let [_, labels] = mnist_names(split);
            let Some(file) = [labels.clone(), labels.replacen("-idx", ".idx", 1)]
                .into_iter()
                .map(|n| d.join(n))
                .find(|p| p.is_file())
            else {
                continue; // opening the set names every missing file
            };
            let (_, y) = read_idx(&file, 1, key)?;
            top = top.max(label_range(y.into_iter().map(i64::from)));
        }
        Ok(top.map(DataClasses::Range))
    }
}

/// The canonical IDX file names of a split ("train" or "t10k"): images, labels.
fn mnist_names(split: &str) -> [String; 2] {
    [
        format!("{split}-images-idx3-ubyte"),
        format!("{split}-labels-idx1-ubyte"),
    ]
}

/// Paths of the images and labels files of each split in `splits`, in that order. The dotted
/// names some mirrors use (`train-images.idx3-ubyte`) are accepted too; gzipped files are not.
fn mnist_files(dir: &Path, splits: &[&str], key: &str) -> Result<Vec<PathBuf>> {
    let mut found = vec![];
    let mut missing = vec![];
    let mut gz = vec![];
    for name in splits.iter().flat_map(|s| mnist_names(s)) {
        let dotted = name.replacen("-idx", ".idx", 1);
        let hit = [&name, &dotted].into_iter().map(|n| dir.join(n)).find(|p| p.is_file());
        match hit {
            Some(p) => found.push(p),
            None => {
                gz.extend(
                    [&name, &dotted]
                        .into_iter()
                        .map(|n| format!("{n}.gz"))
                        .filter(|n| dir.join(n).exists()),
                );
                missing.push(name);
            }
        }
    }
    if missing.is_empty() {
        return Ok(found);
    }
    let d = dir.display();
    let needed: Vec<String> = splits.iter().flat_map(|s| mnist_names(s)).collect();
    let mut msg = format!(
        "{key} {d}: the MNIST directory lacks {}; data.source = \"mnist\" reads {}",
        missing.join(", "),
        needed.join(", ")
    );
    if !gz.is_empty() {
        msg.push_str(&format!(
            "; it has {}, which must be gunzipped first (gunzip -k {d}/*.gz)",
            gz.join(", ")
        ));
    }
    bail!(msg)
}

/// Images `[N, rows, cols]` as uint8 and labels `[N]` (uint8) from `[images, labels]` files.
fn read_mnist_pair(files: &[PathBuf], key: &str) -> Result<(Tensor, Tensor)> {
    let (idims, pixels) = read_idx(&files[0], 3, key)?;
    let (ldims, labels) = read_idx(&files[1], 1, key)?;
    if idims[0] != ldims[0] {
        bail!(
            "{key} {}: has {} images but {} has {} labels",
            files[0].display(),
            idims[0],
            files[1].display(),
            ldims[0]
        );
    }
    // Kept as the bytes they are; a batch becomes float32 in [0, 1].
    let x = Tensor::from_slice(&pixels).reshape(&idims);
    let y = Tensor::from_slice(&labels);
    Ok((x, y))
}

/// Reads an IDX file of unsigned bytes with `ndim` dimensions: (dims, data).
fn read_idx(path: &Path, ndim: usize, key: &str) -> Result<(Vec<i64>, Vec<u8>)> {
    let what = format!("{key} {}", path.display());
    let mut bytes = fs::read(path).with_context(|| format!("{what}: cannot read it"))?;
    let header = 4 + 4 * ndim;
    if bytes.len() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b {
        bail!("{what}: is gzip-compressed; gunzip it first");
    }
    if bytes.len() < header || bytes[0] != 0 || bytes[1] != 0 {
        bail!("{what}: is not an MNIST IDX file (bad header)");
    }
    if bytes[2] != 0x08 {
        bail!(
            "{what}: IDX data type 0x{:02x} is not supported; only unsigned bytes (0x08) are",
            bytes[2]
        );
    }
    if bytes[3] as usize != ndim {
        bail!(
            "{what}: has {} dimensions, expected {ndim} (is it the right file?)",
            bytes[3]
        );
    }
    let dims: Vec<i64> = bytes[4..header]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as i64)
        .collect();
    let expected: i64 = dims.iter().product();
    let have = (bytes.len() - header) as i64;
    if have != expected {
        bail!("{what}: header says {dims:?} ({expected} bytes of data) but the file has {have}; is it truncated?");
    }
    bytes.drain(..header);
    Ok((dims, bytes))
}
