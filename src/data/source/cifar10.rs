//! `cifar10`: a directory (or its `cifar-10-batches-bin` subdirectory) with `data_batch_1.bin`
//! … `data_batch_5.bin` (training) and `test_batch.bin` (validation). Each record is one label
//! byte and 3072 pixel bytes, the red, green and blue 32×32 planes. The set is read whole, first
//! checked against the host-memory budget; a batch's pixels become float32 in [0, 1].
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use tch::Tensor;

use super::DataClasses;
use super::{pixel_part, val_dir, Opened, Reader, Want};
use crate::data::check::{check_budget, required_path};
use crate::spec::schema::Data;

pub struct Cifar10;

impl Reader for Cifar10 {
    fn sample_shape(&self, _: &Data, _: &Path) -> Result<Option<Vec<i64>>> {
        Ok(Some(vec![3, 32, 32]))
    }

    fn open(&self, want: &Want) -> Result<Opened> {
        let data = want.data;
        let dir = required_path(data)?;
        let (vkey, vdir) = val_dir(data, dir);
        let train_files = cifar10_files(dir, true, "data.path")?;
        let val_files = cifar10_files(vdir, false, vkey)?;
        let part = |files: &[PathBuf], key: &str, what| pixel_part(read_cifar10, files, key, what);
        let train = part(
            &train_files,
            "data.path",
            format!("data.path {} (data_batch files)", dir.display()),
        )?;
        let val = part(&val_files, vkey, format!("{vkey} {} (test_batch.bin)", vdir.display()))?;
        Ok(Opened { train, val: Some(val) })
    }

    fn how_read(&self, _: &Data) -> &'static str {
        "read whole into memory"
    }

    /// CIFAR-10's labels are 0 to 9, whatever the files hold (a label over 9 is refused).
    fn classes(&self, _: &Data, _: &Path) -> Result<Option<DataClasses>> {
        Ok(Some(DataClasses::Range(10)))
    }
}

const CIFAR_RECORD: usize = 1 + 3 * 32 * 32;

fn cifar_dir(dir: &Path) -> PathBuf {
    let sub = dir.join("cifar-10-batches-bin");
    if !dir.join("test_batch.bin").exists() && sub.is_dir() {
        sub
    } else {
        dir.to_path_buf()
    }
}

/// The files of the training (`data_batch_1..5`) or test split, all required.
fn cifar10_files(dir: &Path, train: bool, key: &str) -> Result<Vec<PathBuf>> {
    let dir = cifar_dir(dir);
    let names: Vec<String> = if train {
        (1..=5).map(|i| format!("data_batch_{i}.bin")).collect()
    } else {
        vec!["test_batch.bin".into()]
    };
    let missing: Vec<&str> = names
        .iter()
        .filter(|n| !dir.join(n).is_file())
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        bail!(
            "{key} {}: lacks {}; it must hold CIFAR-10's binary version (cifar-10-binary.tar.gz, extracted: data_batch_1.bin … data_batch_5.bin, test_batch.bin)",
            dir.display(),
            missing.join(", ")
        );
    }
    Ok(names.iter().map(|n| dir.join(n)).collect())
}

/// Pixels `[N, 3, 32, 32]` as uint8 and labels `[N]` as int64.
fn read_cifar10(files: &[PathBuf], key: &str) -> Result<(Tensor, Tensor)> {
    let mut sizes = vec![];
    for f in files {
        let len = fs::metadata(f)
            .with_context(|| format!("{key} {}: cannot read it", f.display()))?
            .len() as usize;
        if len == 0 || !len.is_multiple_of(CIFAR_RECORD) {
            bail!(
                "{key} {}: is {len} bytes, not a whole number of {CIFAR_RECORD}-byte CIFAR-10 records; is it truncated, or the Python version of the data set?",
                f.display()
            );
        }
        sizes.push(len / CIFAR_RECORD);
    }
    let n: usize = sizes.iter().sum();
    check_budget(n as i64, &[3, 32, 32], &format!("{key} (CIFAR-10)"))?;
    let mut pixels = Vec::with_capacity(n * (CIFAR_RECORD - 1));
    let mut labels = Vec::with_capacity(n);
    for f in files {
        let bytes = fs::read(f).with_context(|| format!("{key} {}: cannot read it", f.display()))?;
        for (i, r) in bytes.chunks_exact(CIFAR_RECORD).enumerate() {
            if r[0] > 9 {
                bail!(
                    "{key} {}: record {i} has label {}; CIFAR-10 labels are 0 to 9 (is this CIFAR-100?)",
                    f.display(),
                    r[0]
                );
            }
            labels.push(r[0] as i64);
            pixels.extend_from_slice(&r[1..]);
        }
    }
    Ok((
        Tensor::from_slice(&pixels).reshape([n as i64, 3, 32, 32]),
        Tensor::from_slice(&labels),
    ))
}

#[cfg(test)]
mod tests {
    use crate::data::load;
    use crate::spec::schema::{Data, DataSource};
    use std::fs;

    fn record(label: u8, seed: u8) -> Vec<u8> {
        let mut r = vec![label];
        r.extend((0..3072u32).map(|i| (i as u8).wrapping_mul(seed)));
        r
    }

    #[test]
    fn cifar10_reads_binary_batches() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("cifar-10-batches-bin");
        fs::create_dir(&sub).unwrap();
        for i in 1..=5u8 {
            let mut b = record(i, i);
            b.extend(record(9, 7));
            fs::write(sub.join(format!("data_batch_{i}.bin")), b).unwrap();
        }
        fs::write(sub.join("test_batch.bin"), record(0, 3)).unwrap();
        let d = Data {
            source: DataSource::Cifar10,
            path: Some(dir.path().to_path_buf()),
            ..Default::default()
        };
        let s = load(&d, &[3, 32, 32], 10, 0).unwrap();
        assert_eq!(s.train.samples().size(), vec![10, 3, 32, 32]);
        assert_eq!(
            Vec::<i64>::try_from(&s.train.labels()).unwrap(),
            vec![1, 9, 2, 9, 3, 9, 4, 9, 5, 9]
        );
        assert_eq!(s.val.len(), 1);
        // Planes are R, G, B of 1024 bytes each; pixel (c, r, k) is byte 1024c + 32r + k.
        let px = s.train.samples().double_value(&[2, 1, 0, 5]); // batch 2, record 0: seed 2
        assert!((px - ((1024u32 + 5) as u8).wrapping_mul(2) as f64 / 255.0).abs() < 1e-6);
        // Normalised per channel.
        let n = load(
            &Data {
                mean: vec![0.5, 0.5, 0.5],
                std: vec![0.5, 0.5, 0.5],
                ..d.clone()
            },
            &[3, 32, 32],
            10,
            0,
        )
        .unwrap();
        assert!(n.train.samples().min().double_value(&[]) >= -1.0 && n.train.samples().max().double_value(&[]) <= 1.0);
        assert!(n.train.samples().min().double_value(&[]) < 0.0);
        // Missing and truncated files.
        fs::remove_file(sub.join("data_batch_4.bin")).unwrap();
        let e = format!("{:#}", load(&d, &[3, 32, 32], 10, 0).unwrap_err());
        assert!(
            e.contains("lacks data_batch_4.bin") && e.contains("binary version"),
            "{e}"
        );
        fs::write(sub.join("data_batch_4.bin"), [1u8; 100]).unwrap();
        let e = format!("{:#}", load(&d, &[3, 32, 32], 10, 0).unwrap_err());
        assert!(e.contains("not a whole number of 3073-byte"), "{e}");
    }
}
