//! The data module's tests through its public face: `load`, `sample_shape`, the sets and the
//! loader.
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::Result;
use tch::{Device, Kind, Tensor};

use super::source::npz::npz_header_shape;
use super::*;
use crate::spec::schema::DataSource;

#[test]
fn the_data_says_its_sample_shape_from_headers() {
    let dir = tempfile::tempdir().unwrap();
    let x = Tensor::zeros([5, 3, 12, 12], (Kind::Float, Device::Cpu));
    let y = Tensor::zeros([5], (Kind::Int64, Device::Cpu));
    let st = dir.path().join("d.safetensors");
    Tensor::write_safetensors(&[("x", &x), ("y", &y)], &st).unwrap();
    let npz = dir.path().join("d.npz");
    Tensor::write_npz(&[("x", &x), ("y", &y)], &npz).unwrap();
    let data = |source, path: &Path| Data {
        source,
        path: Some(path.to_owned()),
        ..Data::default()
    };
    assert_eq!(
        sample_shape(&data(DataSource::Safetensors, &st)).unwrap(),
        Some(vec![3, 12, 12])
    );
    assert_eq!(
        sample_shape(&data(DataSource::Npz, &npz)).unwrap(),
        Some(vec![3, 12, 12])
    );
    // numpy.savez_compressed's (digits: 8×8 grey images, no channel axis) is read whole.
    let digits = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/digits.npz");
    assert_eq!(npz_header_shape(&digits), None, "deflated");
    assert_eq!(sample_shape(&data(DataSource::Npz, &digits)).unwrap(), Some(vec![8, 8]));
    assert_eq!(
        sample_shape(&data(DataSource::Cifar10, dir.path())).unwrap(),
        Some(vec![3, 32, 32])
    );
    let folder = Data {
        image_size: 48,
        ..data(DataSource::Imagefolder, dir.path())
    };
    assert_eq!(sample_shape(&folder).unwrap(), Some(vec![0, 48, 48]));
    assert_eq!(sample_shape(&data(DataSource::Imagefolder, dir.path())).unwrap(), None);
    assert_eq!(
        sample_shape(&Data::default()).unwrap(),
        None,
        "synthetic follows the model"
    );
    let header = "{'descr': '<f4', 'fortran_order': False, 'shape': (10, 3, 32, 32), }\n";
    let mut npy = b"\x93NUMPY\x01\x00".to_vec();
    npy.extend((header.len() as u16).to_le_bytes());
    npy.extend(header.as_bytes());
    assert_eq!(mapped::npy_header(&npy).map(|h| h.shape), Some(vec![10, 3, 32, 32]));
}

#[test]
fn only_small_unaugmented_data_stays_on_a_cuda_device() {
    let set = |n: i64| {
        Dataset::new(
            Tensor::zeros([n, 4], (Kind::Float, Device::Cpu)),
            Tensor::zeros([n], (Kind::Int64, Device::Cpu)),
        )
    };
    // 100 samples of 4 floats and a label: 2400 bytes.
    let s = Splits {
        train: set(80),
        val: set(20),
    };
    assert_eq!(s.train.bytes() + s.val.bytes(), 2400);
    let cuda = Device::Cuda(0);
    assert!(s.stay_resident(cuda, Some(2400 * 16)));
    assert!(
        !s.stay_resident(cuda, Some(2400 * 16 - 1)),
        "over a sixteenth of the budget"
    );
    assert!(!s.stay_resident(cuda, None));
    assert!(
        !s.stay_resident(Device::Cpu, Some(1 << 40)),
        "the CPU has nothing to copy"
    );
    let mut augmented = s;
    augmented.train.set_augment(Some(Augmenter {
        seed: 0,
        padding: 0,
        flip: true,
        fill: vec![0.0],
        samples: 80,
        resized_crop: None,
        jitter: None,
    }));
    assert!(
        !augmented.stay_resident(cuda, Some(1 << 40)),
        "augmentation runs on the host"
    );
}

/// A set of 20 random images [3, 8, 8] as uint8, normalized and augmented as ImageNet
/// images would be, with the tensor pipeline that makes the same batches.
fn augmented_images() -> (Dataset, Tensor, Augmenter, (Tensor, Tensor)) {
    tch::manual_seed(5);
    let x = Tensor::randint(256, [20, 3, 8, 8], (Kind::Uint8, Device::Cpu));
    let y = Tensor::arange(20, (Kind::Int64, Device::Cpu)).remainder(3);
    let (mean, std) = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]);
    let mut d = Dataset::new(x.shallow_clone(), y).divided_by(255.0);
    d.recipe().norm = Some(normalization(&[3, 8, 8], &mean, &std).unwrap());
    let aug = Augmenter {
        seed: 3,
        padding: 2,
        flip: true,
        fill: mean.iter().zip(std).map(|(m, s)| -m / s).collect(),
        samples: 20,
        resized_crop: None,
        jitter: None,
    };
    d.set_augment(Some(aug.clone()));
    let t = |v: &[f64]| Tensor::from_slice(v).to_kind(Kind::Float).view([1, 3, 1, 1]);
    (d, x, aug, (t(&mean), t(&std)))
}

#[test]
fn batches_equal_a_tensor_pipeline_bit_for_bit() {
    let (d, x, aug, (m, s)) = augmented_images();
    let idx = [5i64, 0, 19, 7, 7];
    let (got, y) = d.batch_at(&idx, 2);
    let want = x.index_select(0, &Tensor::from_slice(&idx)).to_kind(Kind::Float) / 255.0;
    let want = aug.apply(&((want - &m) / &s).contiguous(), &idx, 2);
    let bits = |t: &Tensor| {
        Vec::<f32>::try_from(t.flatten(0, -1))
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(&got), bits(&want));
    assert_eq!(Vec::<i64>::try_from(&y).unwrap(), vec![2, 0, 1, 1, 1]);
    // Other stored types convert as to_kind does.
    for kind in [Kind::Int8, Kind::Int16, Kind::Int, Kind::Int64, Kind::Float] {
        let v = (Tensor::randn([6, 5], (Kind::Float, Device::Cpu)) * 1000.0).to_kind(kind);
        let d = Dataset::new(v.shallow_clone(), Tensor::zeros([6], (Kind::Int64, Device::Cpu)));
        let (got, _) = d.batch_at(&[4, 1], 0);
        assert!(
            got.equal(&v.index_select(0, &Tensor::from_slice(&[4i64, 1])).to_kind(Kind::Float)),
            "{kind:?}"
        );
    }
}

#[test]
fn resized_crops_and_jitter_are_the_same_at_any_worker_count() {
    use crate::spec::schema::{ColorJitter, ResizedCrop, Spread};
    let (full, _, mut aug, _) = augmented_images();
    aug.resized_crop = Some(ResizedCrop::default());
    aug.jitter = Some(Jitter::of(&ColorJitter {
        brightness: Some(Spread::By(0.4)),
        contrast: Some(Spread::By(0.4)),
        saturation: Some(Spread::By(0.4)),
        hue: Some(Spread::By(0.1)),
    }));
    let mut d = Dataset::from_source(full.source.clone());
    d.set_augment(Some(aug));
    let plan: Vec<Vec<i64>> = (0..5).map(|i| vec![(3 * i) % 20, (7 * i + 1) % 20, 19 - i]).collect();
    let want: Vec<Tensor> = plan.iter().map(|b| d.batch_at(b, 3).0).collect();
    let plain = full.batch_at(&plan[0], 3).0;
    assert!(!want[0].equal(&plain), "the pixels were augmented");
    for threads in [1, 2, 4] {
        let mut l = Dataset::from_source(d.source.clone());
        l.start_loader(&Data {
            prefetch: 3,
            workers: threads,
            ..Data::default()
        });
        l.plan(3, plan.clone());
        for (b, w) in plan.iter().zip(&want) {
            assert!(l.batch_at(b, 3).0.equal(w), "{threads} workers");
        }
    }
    // Another epoch draws other boxes and factors.
    assert!(!d.batch_at(&plan[0], 4).0.equal(&want[0]));
}

#[test]
fn the_loader_makes_the_same_batches_in_any_order_and_depth() {
    let (full, _, aug, _) = augmented_images();
    let mut d = full.rows(&(0..20).rev().step_by(2).collect::<Vec<i64>>());
    d.set_augment(Some(aug));
    let plan: Vec<Vec<i64>> = (0..5).map(|i| vec![2 * (i % 5), (2 * i + 1) % 10]).collect();
    let want: Vec<Tensor> = plan.iter().map(|b| d.batch_at(b, 1).0).collect();
    for (depth, threads) in [(1, 1), (4, 4), (3, 2)] {
        let mut l = Dataset::from_source(d.source.clone());
        l.set_augment(d.augment().cloned());
        l.start_loader(&Data {
            prefetch: depth,
            workers: threads,
            ..Data::default()
        });
        l.plan(1, plan.clone());
        // Taken in plan order, then one out of order (made on the spot), then on.
        for (b, w) in plan.iter().zip(&want).take(2) {
            assert!(l.batch_at(b, 1).0.equal(w));
        }
        assert!(l.batch_at(&plan[4], 1).0.equal(&want[4]));
        for (b, w) in plan.iter().zip(&want).skip(2) {
            assert!(l.batch_at(b, 1).0.equal(w), "depth {depth}, {threads} threads");
        }
        // Another epoch augments otherwise, whatever was staged.
        assert!(!l.batch_at(&plan[0], 2).0.equal(&want[0]));
    }
}

fn spec(source: DataSource, path: Option<PathBuf>) -> Data {
    Data {
        source,
        path,
        ..Default::default()
    }
}

fn synth(samples: i64, noise: f64) -> Data {
    Data {
        samples: Some(samples),
        noise: Some(noise),
        ..Default::default()
    }
}

fn equal(a: &Tensor, b: &Tensor) -> bool {
    a.size() == b.size() && a.equal(b)
}

fn err_of(r: Result<Splits>) -> String {
    format!("{:#}", r.expect_err("expected an error"))
}

fn digits_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/digits.npz")
}

#[test]
fn synthetic_is_deterministic_by_seed() {
    let d = synth(64, 1.0);
    let a = load(&d, &[2, 32], 4, 7).unwrap();
    let b = load(&d, &[2, 32], 4, 7).unwrap();
    let c = load(&d, &[2, 32], 4, 8).unwrap();
    assert!(equal(&a.train.samples(), &b.train.samples()) && equal(&a.train.labels(), &b.train.labels()));
    assert!(equal(&a.val.samples(), &b.val.samples()) && equal(&a.val.labels(), &b.val.labels()));
    assert!(!equal(&a.train.samples(), &c.train.samples()));
    // Torch's global RNG plays no part.
    tch::manual_seed(1);
    let e = load(&d, &[2, 32], 4, 7).unwrap();
    tch::manual_seed(2);
    let f = load(&d, &[2, 32], 4, 7).unwrap();
    assert!(equal(&e.train.samples(), &f.train.samples()) && equal(&e.train.samples(), &a.train.samples()));
}

#[test]
fn synthetic_shapes_sizes_and_balance() {
    let s = load(&synth(100, 1.0), &[3, 20], 5, 0).unwrap();
    assert_eq!(s.val.len(), 20);
    assert_eq!(s.train.len(), 80);
    assert_eq!(s.train.samples().size(), vec![80, 3, 20]);
    assert_eq!(s.train.samples().kind(), Kind::Float);
    assert_eq!(s.train.labels().kind(), Kind::Int64);
    let counts = Vec::<i64>::try_from(s.train.labels().bincount::<Tensor>(None, 5)).unwrap();
    assert_eq!(counts, vec![16; 5]);
    let counts = Vec::<i64>::try_from(s.val.labels().bincount::<Tensor>(None, 5)).unwrap();
    assert_eq!(counts, vec![4; 5]);
    // Tiny: val is still at least 1 and train keeps at least 1.
    let s = load(
        &Data {
            samples: Some(4),
            val_fraction: 0.01,
            ..synth(4, 1.0)
        },
        &[8],
        2,
        0,
    )
    .unwrap();
    assert_eq!((s.train.len(), s.val.len()), (3, 1));
}

/// Nearest class mean (from train) classifies val well at noise 1.0, for both template kinds.
#[test]
fn synthetic_is_learnable() {
    for shape in [vec![32i64], vec![1, 64]] {
        let k = 4;
        let s = load(&synth(400, 1.0), &shape, k, 3).unwrap();
        let tx = s.train.samples().flatten(1, -1);
        let means = Tensor::stack(
            &(0..k)
                .map(|c| {
                    tx.index_select(0, &s.train.labels().eq(c).nonzero().squeeze_dim(1))
                        .mean_dim(0, false, Kind::Float)
                })
                .collect::<Vec<_>>(),
            0,
        );
        let vx = s.val.samples().flatten(1, -1);
        let dist = (vx.unsqueeze(1) - means.unsqueeze(0))
            .square()
            .sum_dim_intlist(2, false, Kind::Float);
        let pred = dist.argmin(1, false);
        let acc = pred
            .eq_tensor(&s.val.labels())
            .to_kind(Kind::Float)
            .mean(Kind::Float)
            .double_value(&[]);
        assert!(acc > 0.9, "shape {shape:?}: accuracy {acc}");
    }
}

#[test]
fn synthetic_darts_size_has_the_right_shapes() {
    let s = load(&synth(512, 1.0), &[1, 3000], 5, 0).unwrap();
    assert_eq!(s.train.samples().size(), vec![410, 1, 3000]);
    assert_eq!(s.val.samples().size(), vec![102, 1, 3000]);
}

#[test]
fn npz_round_trip_and_holdout() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.npz");
    let x = Tensor::arange(10 * 6, (Kind::Int, tch::Device::Cpu)).reshape([10, 2, 3]);
    let y = Tensor::from_slice(&[0i64, 1, 2, 0, 1, 2, 0, 1, 2, 0]);
    Tensor::write_npz(&[("x", &x), ("y", &y)], &p).unwrap();
    let d = Data {
        val_fraction: 0.3,
        ..spec(DataSource::Npz, Some(p.clone()))
    };
    let s = load(&d, &[2, 3], 3, 0).unwrap();
    assert_eq!((s.train.len(), s.val.len()), (7, 3));
    assert_eq!(s.train.samples().kind(), Kind::Float);
    assert_eq!(s.train.samples().size(), vec![7, 2, 3]);
    // Every sample lands in exactly one split, intact (x[i] starts at 6i, y[i] = i % 3).
    let mut seen: Vec<i64> = vec![];
    for part in [&s.train, &s.val] {
        for i in 0..part.len() {
            let first = part.samples().get(i).flatten(0, -1).get(0).double_value(&[]) as i64;
            assert_eq!(first % 6, 0);
            assert_eq!(part.labels().get(i).int64_value(&[]), (first / 6) % 3);
            seen.push(first / 6);
        }
    }
    seen.sort();
    assert_eq!(seen, (0..10).collect::<Vec<_>>());
    // Same seed, same split; other seeds, other splits.
    assert!(equal(&s.val.samples(), &load(&d, &[2, 3], 3, 0).unwrap().val.samples()));
    assert!((1..20).any(|seed| !equal(&load(&d, &[2, 3], 3, seed).unwrap().val.samples(), &s.val.samples())));
    // A separate validation file replaces the holdout.
    let v = dir.path().join("v.npz");
    Tensor::write_npz(&[("x", &x.narrow(0, 0, 4)), ("y", &y.narrow(0, 0, 4))], &v).unwrap();
    let s = load(
        &Data {
            val_path: Some(v),
            ..d.clone()
        },
        &[6],
        3,
        0,
    )
    .unwrap();
    assert_eq!((s.train.len(), s.val.len()), (10, 4));
    assert_eq!(s.val.samples().size(), vec![4, 6]);
}

#[test]
fn npz_errors() {
    let dir = tempfile::tempdir().unwrap();
    let x = Tensor::zeros([5, 4], (Kind::Float, tch::Device::Cpu));
    let y = Tensor::from_slice(&[0i64, 1, 0, 1, 0]);
    let write = |name: &str, items: &[(&str, &Tensor)]| {
        let p = dir.path().join(name);
        Tensor::write_npz(items, &p).unwrap();
        spec(DataSource::Npz, Some(p))
    };
    let e = err_of(load(&write("noy.npz", &[("x", &x), ("labels", &y)]), &[4], 2, 0));
    assert!(e.contains("no array named \"y\"") && e.contains("labels"), "{e}");
    let e = err_of(load(&write("ok.npz", &[("x", &x), ("y", &y)]), &[100], 2, 0));
    assert!(
        e.contains("[4]") && e.contains("[100]") && e.contains("model.mlp.inputs = 4"),
        "{e}"
    );
    let e = err_of(load(
        &write("short.npz", &[("x", &x), ("y", &y.narrow(0, 0, 3))]),
        &[4],
        2,
        0,
    ));
    assert!(e.contains("5 samples") && e.contains("3 labels"), "{e}");
    let e = err_of(load(&write("range.npz", &[("x", &x), ("y", &(&y * 7))]), &[4], 2, 0));
    assert!(e.contains("up to 7") && e.contains("model.mlp.num_classes = 8"), "{e}");
    let e = err_of(load(
        &write("fy.npz", &[("x", &x), ("y", &y.to_kind(Kind::Float))]),
        &[4],
        2,
        0,
    ));
    assert!(e.contains("integer class indices"), "{e}");
    let p = dir.path().join("junk.npz");
    fs::write(&p, b"not a zip").unwrap();
    let e = err_of(load(&spec(DataSource::Npz, Some(p)), &[4], 2, 0));
    assert!(e.contains("numpy.savez") && e.contains("junk.npz"), "{e}");
}

#[test]
fn safetensors_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.safetensors");
    let x = Tensor::ones([6, 1, 5], (Kind::Double, tch::Device::Cpu));
    let y = Tensor::from_slice(&[0u8, 1, 2, 0, 1, 2]);
    Tensor::write_safetensors(&[("x", &x), ("y", &y)], &p).unwrap();
    let s = load(
        &Data {
            val_fraction: 0.5,
            ..spec(DataSource::Safetensors, Some(p))
        },
        &[1, 5],
        3,
        0,
    )
    .unwrap();
    assert_eq!((s.train.len(), s.val.len()), (3, 3));
    assert_eq!(
        (s.train.samples().kind(), s.train.labels().kind()),
        (Kind::Float, Kind::Int64)
    );
    let p = dir.path().join("nox.safetensors");
    Tensor::write_safetensors(&[("inputs", &x), ("y", &y)], &p).unwrap();
    let e = err_of(load(&spec(DataSource::Safetensors, Some(p)), &[1, 5], 3, 0));
    assert!(e.contains("no array named \"x\"") && e.contains("inputs"), "{e}");
}

#[test]
fn digits_reshape_to_mlp_inputs() {
    let d = spec(DataSource::Npz, Some(digits_path()));
    let s = load(&d, &[64], 10, 0).unwrap();
    assert_eq!(s.train.len() + s.val.len(), 1797);
    assert_eq!(s.val.len(), 359); // round(1797 * 0.2)
    assert_eq!(s.train.samples().size(), vec![1438, 64]);
    for part in [&s.train, &s.val] {
        assert!(part.labels().min().int64_value(&[]) >= 0 && part.labels().max().int64_value(&[]) < 10);
        assert!(part.samples().min().double_value(&[]) >= 0.0 && part.samples().max().double_value(&[]) <= 1.0);
    }
    // Signals the other way round: 8×8 as 8 channels of length 8 works unchanged.
    let s = load(&d, &[8, 8], 10, 0).unwrap();
    assert_eq!(s.val.samples().size(), vec![359, 8, 8]);
    let e = err_of(load(&d, &[100], 10, 0));
    assert!(
        e.contains("samples of shape [8, 8] (64 values)")
            && e.contains("model.mlp.inputs expects [100]")
            && e.contains("set model.mlp.inputs = 64"),
        "{e}"
    );
    let e = err_of(load(&d, &[1, 100], 10, 0));
    assert!(
        e.contains("model.darts.in_channels = 8 and model.darts.input_length = 8"),
        "{e}"
    );
    let e = err_of(load(&d, &[64], 5, 0));
    assert!(e.contains("up to 9") && e.contains("num_classes = 10"), "{e}");
}

#[test]
fn epoch_order_is_a_deterministic_permutation() {
    let a = epoch_order(1000, 5, 0);
    let mut sorted = a.clone();
    sorted.sort();
    assert_eq!(sorted, (0..1000).collect::<Vec<_>>());
    assert_eq!(a, epoch_order(1000, 5, 0));
    assert_ne!(a, epoch_order(1000, 5, 1));
    assert_ne!(a, epoch_order(1000, 6, 0));
    assert_ne!(a, (0..1000).collect::<Vec<_>>());
    assert!(epoch_order(0, 1, 1).is_empty());
    assert_eq!(epoch_order(1, 1, 1), vec![0]);
}

fn write_idx(path: &Path, dims: &[u32], data: &[u8]) {
    let mut b = vec![0, 0, 0x08, dims.len() as u8];
    for d in dims {
        b.extend_from_slice(&d.to_be_bytes());
    }
    b.extend_from_slice(data);
    fs::write(path, b).unwrap();
}

#[test]
fn mnist_idx_fixture() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path();
    let images: Vec<u8> = (0..3 * 4 * 4).map(|i| (i * 5) as u8).collect();
    write_idx(&p.join("train-images-idx3-ubyte"), &[3, 4, 4], &images);
    write_idx(&p.join("train-labels-idx1-ubyte"), &[3], &[7, 0, 9]);
    write_idx(&p.join("t10k-images-idx3-ubyte"), &[2, 4, 4], &[255; 32]);
    write_idx(&p.join("t10k-labels-idx1-ubyte"), &[2], &[1, 2]);
    let d = spec(DataSource::Mnist, Some(p.to_path_buf()));
    let s = load(&d, &[16], 10, 0).unwrap();
    assert_eq!(s.train.samples().size(), vec![3, 16]);
    assert_eq!(Vec::<i64>::try_from(&s.train.labels()).unwrap(), vec![7, 0, 9]);
    assert_eq!(Vec::<i64>::try_from(&s.val.labels()).unwrap(), vec![1, 2]);
    let px = s.train.samples().get(1).get(3).double_value(&[]);
    assert!((px - (19.0 * 5.0) / 255.0).abs() < 1e-6, "{px}");
    assert_eq!(s.val.samples().min().double_value(&[]), 1.0);
    // As images with a channel: [1, 4, 4] has the same 16 values.
    let s = load(&d, &[1, 4, 4], 10, 0).unwrap();
    assert_eq!(s.train.samples().size(), vec![3, 1, 4, 4]);
    // Truncated file.
    fs::write(p.join("t10k-labels-idx1-ubyte"), [0, 0, 8, 1, 0, 0, 0, 2, 1]).unwrap();
    let e = err_of(load(&d, &[16], 10, 0));
    assert!(e.contains("truncated"), "{e}");
    // Gzipped files only.
    let gz = tempfile::tempdir().unwrap();
    for n in ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"] {
        fs::write(gz.path().join(n), [0x1f, 0x8b]).unwrap();
    }
    let e = err_of(load(
        &spec(DataSource::Mnist, Some(gz.path().to_path_buf())),
        &[16],
        10,
        0,
    ));
    assert!(e.contains("train-images-idx3-ubyte.gz") && e.contains("gunzip"), "{e}");
    assert!(
        e.contains("lacks train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte"),
        "{e}"
    );
    // Validation from another directory (dotted names, as some mirrors ship them).
    let v = tempfile::tempdir().unwrap();
    write_idx(&v.path().join("t10k-images.idx3-ubyte"), &[1, 4, 4], &[0; 16]);
    write_idx(&v.path().join("t10k-labels.idx1-ubyte"), &[1], &[3]);
    let s = load(
        &Data {
            val_path: Some(v.path().to_path_buf()),
            ..d.clone()
        },
        &[16],
        10,
        0,
    )
    .unwrap();
    assert_eq!((s.train.len(), s.val.len()), (3, 1));
}
