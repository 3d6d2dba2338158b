//! `imagefolder`: `root/<class>/<image>` with JPEG and PNG files; classes are the directory
//! names in sorted order (label 0 is the first), as torchvision's `ImageFolder` numbers them.
//! Images are decoded in parallel, resized to fill `image_size`² and centre-cropped
//! (torchvision's `Resize(s)` + `CenterCrop(s)`), and written a chunk at a time to a cache file
//! beside the tree, `root.memtrain-cache/imagefolder-<size>px-<C>ch-<key>.safetensors` (see
//! [`cache_dir`]; `data.cache_dir` puts it elsewhere), where the key hashes every file's path, size and modification time: a later
//! run with the same files and size starts from the cache; a changed file makes a new one.
//!
//! A batch's pixels become float32 in [0, 1]. The cache is read in place through a memory map;
//! read whole (`data.memory_map = false`) it is first checked against the host-memory budget
//! (available RAM, and the CPU cap on CPU runs).
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use rayon::prelude::*;
use tch::Tensor;

use super::DataClasses;
use super::{Opened, Part, Reader, Want};
use crate::data::check::{check_budget, required_path};
use crate::data::mapped::{self, Xy};
use crate::data::store::{Elem, Store};
use crate::spec::schema::Data;

// ---------------------------------------------------------------------------------------------
// ImageFolder

pub struct ImageFolder;

impl Reader for ImageFolder {
    /// The tree's images are resized to the model's size unless `data.image_size` says one; the
    /// channel count is the model's (it decodes to 1 or 3): 0.
    fn sample_shape(&self, data: &Data, _: &Path) -> Result<Option<Vec<i64>>> {
        Ok((data.image_size > 0).then(|| vec![0, data.image_size, data.image_size]))
    }

    fn open(&self, want: &Want) -> Result<Opened> {
        let (data, input_shape) = (want.data, want.input_shape);
        let root = required_path(data)?;
        let (channels, size) = match input_shape {
            [c, h, w] if h == w => (*c, *h),
            _ => bail!(
                "data.source = \"imagefolder\" needs a model that takes square images [C, S, S], but it takes {input_shape:?}"
            ),
        };
        if data.image_size > 0 && data.image_size != size {
            bail!(
                "data.image_size = {} but the model takes {size}×{size} images; set data.image_size = {size} (or leave it out), or the model's image_size = {}",
                data.image_size,
                data.image_size
            );
        }
        let (imgs, classes) = read_imagefolder(root, size, channels, "data.path", data)?;
        let train = Part::new(imgs.x, imgs.y, format!("data.path {}", root.display())).pixels();
        let Some(v) = &data.val_path else {
            return Ok(Opened { train, val: None });
        };
        let (imgs, vclasses) = read_imagefolder(v, size, channels, "data.val_path", data)?;
        same_classes(v, &vclasses, &classes)?;
        let val = Part::new(imgs.x, imgs.y, format!("data.val_path {}", v.display())).pixels();
        Ok(Opened { train, val: Some(val) })
    }

    fn how_read(&self, data: &Data) -> &'static str {
        match data.memory_map {
            true => "its cache read in place through a memory map",
            false => "read whole into memory",
        }
    }

    /// The class directories' names (`data.val_path` must have the same ones: opening the set
    /// says so when it does not).
    fn classes(&self, _: &Data, root: &Path) -> Result<Option<DataClasses>> {
        Ok(Some(DataClasses::Named(class_dirs(root, "data.path")?)))
    }

    /// What `open` refuses before decoding: a class directory without an image, and a
    /// validation tree of other classes. One image a class is looked for, not every file listed.
    fn check(&self, data: &Data, _: Option<i64>) -> Result<()> {
        let Some(root) = data.path.as_deref() else {
            return Ok(());
        };
        let classes = class_dirs(root, "data.path")?;
        each_has_an_image(root, &classes, "data.path")?;
        if let Some(v) = data.val_path.as_deref() {
            let vclasses = class_dirs(v, "data.val_path")?;
            same_classes(v, &vclasses, &classes)?;
            each_has_an_image(v, &vclasses, "data.val_path")?;
        }
        Ok(())
    }
}

/// The validation tree has the training tree's classes.
fn same_classes(v: &Path, vclasses: &[String], classes: &[String]) -> Result<()> {
    if vclasses != classes {
        bail!(
            "data.val_path {}: has classes {vclasses:?} but data.path has {classes:?}; both need the same class directories",
            v.display()
        );
    }
    Ok(())
}

/// Every class directory holds an image file.
fn each_has_an_image(root: &Path, classes: &[String], key: &str) -> Result<()> {
    for c in classes {
        let found = fs::read_dir(root.join(c))
            .with_context(|| format!("{key} {}: cannot list class directory {c}", root.display()))?
            .filter_map(|e| e.ok())
            .any(|e| is_image(&e.path()));
        if !found {
            return Err(no_images(root, c, key));
        }
    }
    Ok(())
}

/// A `.jpg`, `.jpeg` or `.png` file.
fn is_image(p: &Path) -> bool {
    p.is_file()
        && p.extension()
            .and_then(|x| x.to_str())
            .is_some_and(|x| EXTENSIONS.contains(&x.to_ascii_lowercase().as_str()))
}

fn no_images(root: &Path, c: &str, key: &str) -> anyhow::Error {
    anyhow::anyhow!(
        "{key} {}: class directory {c} has no .jpg, .jpeg or .png files",
        root.display()
    )
}

const EXTENSIONS: &[&str] = &["jpg", "jpeg", "png"];

/// Image files with their labels.
type Labelled = Vec<(PathBuf, i64)>;

/// The class directories of a tree, sorted: hidden ones (a dot first) are not classes.
pub fn class_dirs(root: &Path, key: &str) -> Result<Vec<String>> {
    let mut classes: Vec<String> = fs::read_dir(root)
        .with_context(|| format!("{key} {}: cannot list it", root.display()))?
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_dir())
        .filter_map(|e| e.file_name().into_string().ok())
        .filter(|n| !n.starts_with('.'))
        .collect();
    classes.sort();
    if classes.is_empty() {
        bail!(
            "{key} {}: has no class directories; imagefolder expects root/<class>/<image>.jpg|png, one directory per class",
            root.display()
        );
    }
    Ok(classes)
}

/// Class names (sorted) and (file, label) pairs, sorted by class then file name.
pub fn scan_folder(root: &Path, key: &str) -> Result<(Vec<String>, Labelled)> {
    let classes = class_dirs(root, key)?;
    let mut files = vec![];
    for (label, c) in classes.iter().enumerate() {
        let mut these: Vec<PathBuf> = fs::read_dir(root.join(c))
            .with_context(|| format!("{key} {}: cannot list class directory {c}", root.display()))?
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| is_image(p))
            .collect();
        these.sort();
        if these.is_empty() {
            return Err(no_images(root, c, key));
        }
        files.extend(these.into_iter().map(|p| (p, label as i64)));
    }
    Ok((classes, files))
}

/// FNV-1a, 64 bits: stable across builds and Rust versions, unlike std's hasher.
fn fnv1a(h: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3))
}

fn cache_key(root: &Path, files: &[(PathBuf, i64)], size: i64, channels: i64) -> String {
    let mut h = fnv1a(0xCBF2_9CE4_8422_2325, format!("v1 {size} {channels}").as_bytes());
    for (p, label) in files {
        let rel = p.strip_prefix(root).unwrap_or(p);
        h = fnv1a(h, rel.as_os_str().as_encoded_bytes());
        h = fnv1a(h, &label.to_le_bytes());
        if let Ok(m) = fs::metadata(p) {
            h = fnv1a(h, &m.len().to_le_bytes());
            if let Ok(t) = m
                .modified()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).map_err(std::io::Error::other))
            {
                h = fnv1a(h, &t.as_nanos().to_le_bytes());
            }
        }
    }
    format!("{h:016x}")
}

/// Where the cache of the tree at `root` is kept: `data.cache_dir` where set (for a tree whose
/// parent cannot be written), else beside the tree ([`cache_dir`]).
fn cache_home(root: &Path, data: &Data) -> PathBuf {
    data.cache_dir.clone().unwrap_or_else(|| cache_dir(root))
}

fn cache_name(root: &Path, files: &[(PathBuf, i64)], size: i64, channels: i64) -> String {
    format!(
        "imagefolder-{size}px-{channels}ch-{}.safetensors",
        cache_key(root, files, size, channels)
    )
}

/// Where the decoded images of the tree at `root` are kept: beside the tree, in
/// `<root>.memtrain-cache`, so the tree holds nothing but its classes (torchvision's
/// `ImageFolder` takes every directory in it, a hidden one too, for a class). A root with no
/// parent (`/`) keeps it inside.
pub fn cache_dir(root: &Path) -> PathBuf {
    let abs = root.canonicalize().unwrap_or_else(|_| root.to_path_buf());
    match (abs.parent(), abs.file_name()) {
        (Some(parent), Some(name)) => parent.join(format!("{}.memtrain-cache", name.to_string_lossy())),
        _ => abs.join(IN_TREE_CACHE),
    }
}

/// A cache inside the tree, where a root with no parent keeps it; elsewhere it is still read, and
/// the run says where to move it.
const IN_TREE_CACHE: &str = ".memtrain-cache";

/// A cache inside the tree that matches the files: read, with the advice to move it beside
/// the tree.
fn in_tree_cache(
    root: &Path,
    files: &[(PathBuf, i64)],
    size: i64,
    channels: i64,
    key: &str,
    home: &Path,
) -> Option<Xy> {
    let inside = root.join(IN_TREE_CACHE);
    let beside = home.to_path_buf();
    if inside == beside {
        return None;
    }
    let n = files.len() as i64;
    let xy = open_cache(&inside.join(cache_name(root, files, size, channels)), n, channels, size)?;
    tracing::warn!(
        "{key}: reading the image cache inside the tree, {}; torchvision's ImageFolder takes that directory for a class: move it to {} (where memtrain looks first)",
        inside.display(),
        beside.display()
    );
    Some(xy)
}

/// Reads an ImageFolder tree at `size`×`size` with `channels` (1: grey, 3: RGB) from its cache,
/// decoding it into the cache first when there is none; returns the images (the cache mapped,
/// or read whole with `data.memory_map = false`) and the class names.
pub fn read_imagefolder(root: &Path, size: i64, channels: i64, key: &str, data: &Data) -> Result<(Xy, Vec<String>)> {
    if channels != 1 && channels != 3 {
        bail!("{key} {}: imagefolder decodes to 1 (grey) or 3 (RGB) channels, but the model takes {channels}; set the model's in_channels to 1 or 3", root.display());
    }
    let (classes, files) = scan_folder(root, key)?;
    let n = files.len() as i64;
    let what = format!("{key} {}", root.display());
    if !data.memory_map {
        check_budget(n, &[channels, size, size], &what)?;
    }
    let home = cache_home(root, data);
    let cache = home.join(cache_name(root, &files, size, channels));
    let opened = |xy: Xy| match data.memory_map {
        true => xy,
        false => Xy {
            x: Store::memory(xy.x.tensor()).expect("uint8 pixels"),
            y: xy.y,
        },
    };
    if let Some(xy) = open_cache(&cache, n, channels, size) {
        tracing::info!("{key}: {n} images from the cache {}", cache.display());
        return Ok((opened(xy), classes));
    }
    if let Some(xy) = in_tree_cache(root, &files, size, channels, key, &home) {
        return Ok((opened(xy), classes));
    }
    let t0 = std::time::Instant::now();
    let decoded = |d: std::time::Duration| {
        let per_s = n as f64 / d.as_secs_f64().max(1e-9);
        tracing::info!(
            "{key}: decoded {n} images in {:.1} s ({per_s:.0} images/s)",
            d.as_secs_f64()
        );
    };
    let job = Decode {
        files: &files,
        size,
        channels,
        key,
        workers: data.workers,
    };
    match write_cache(&cache, &job)? {
        Ok(()) => {
            decoded(t0.elapsed());
            let xy = open_cache(&cache, n, channels, size)
                .ok_or_else(|| anyhow!("{what}: cannot read back the image cache {}", cache.display()))?;
            Ok((opened(xy), classes))
        }
        Err(e) => {
            tracing::warn!(
                "{key}: could not write the image cache {} ({e:#}); decoding into memory, and the next run decodes again{}",
                cache.display(),
                match data.cache_dir {
                    None => "; set data.cache_dir to a writable directory to keep the cache there",
                    Some(_) => "",
                }
            );
            check_budget(n, &[channels, size, size], &what).map_err(|refused| {
                anyhow!(
                    "{refused:#}; the images go to memory only because their cache could not be written in {} ({e:#}): free space there or make it writable (or set data.cache_dir to one that is), and the next run writes it",
                    home.display()
                )
            })?;
            let mut pixels = Vec::with_capacity(n as usize * (channels * size * size) as usize);
            job.each_chunk(|chunk| {
                pixels.extend_from_slice(chunk);
                Ok(())
            })?;
            decoded(t0.elapsed());
            let x = Tensor::from_slice(&pixels).reshape([n, channels, size, size]);
            let y = Tensor::from_slice(&files.iter().map(|(_, l)| *l).collect::<Vec<i64>>());
            Ok((
                Xy {
                    x: Store::memory(x).expect("uint8"),
                    y,
                },
                classes,
            ))
        }
    }
}

/// The cache at `path` when it holds `n` images of `channels`×`size`², mapped.
fn open_cache(path: &Path, n: i64, channels: i64, size: i64) -> Option<Xy> {
    let xy = mapped::safetensors(path)?;
    let fits = xy.x.elem == Elem::U8 && xy.x.shape == [n, channels, size, size] && xy.y.size() == [n];
    fits.then_some(xy)
}

/// The first pass: files to decode and how.
struct Decode<'a> {
    files: &'a [(PathBuf, i64)],
    size: i64,
    channels: i64,
    key: &'a str,
    /// Threads; 0: one per core.
    workers: i64,
}

impl Decode<'_> {
    /// Decodes the files in order, a chunk at a time in parallel, handing each chunk's pixel
    /// bytes to `sink`: at most a chunk is held, never the whole set.
    fn each_chunk(&self, mut sink: impl FnMut(&[u8]) -> Result<()>) -> Result<()> {
        let per = (self.channels * self.size * self.size) as usize;
        // Small enough that a chunk is a few MiB whatever the set, large enough to keep every
        // thread busy.
        let chunk = ((4usize << 20) / per.max(1)).clamp(64, 4096);
        let pool = match self.workers {
            0 => None,
            w => Some(rayon::ThreadPoolBuilder::new().num_threads(w as usize).build()?),
        };
        for files in self.files.chunks(chunk) {
            let decode_all = || -> Result<Vec<Vec<u8>>> {
                files
                    .par_iter()
                    .map(|(p, _)| {
                        decode(p, self.size as u32, self.channels)
                            .map_err(|e| anyhow!("{} {}: {e}", self.key, p.display()))
                    })
                    .collect()
            };
            let decoded = match &pool {
                Some(p) => p.install(decode_all)?,
                None => decode_all()?,
            };
            for d in &decoded {
                sink(d)?;
            }
        }
        Ok(())
    }
}

/// Decodes into the cache file, written in chunks as the images are decoded. The outer error is
/// a file that does not decode; the inner one, a cache that could not be written.
fn write_cache(path: &Path, job: &Decode) -> Result<Result<()>> {
    use std::io::Write;
    let dir = path.parent().expect("cache files live in a directory");
    // Unique to this writer: two runs decoding the same tree (in containers, their process ids
    // may be the same) must not write one file, which the rename would install half-mixed.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = dir.join(format!(".tmp-{}-{nanos:x}", std::process::id()));
    let open = || -> Result<std::io::BufWriter<fs::File>> {
        fs::create_dir_all(dir)?;
        let file = fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
        let n = job.files.len() as i64;
        let (c, s) = (job.channels, job.size);
        // Labels first: 8-byte aligned right after the header, as are the pixels after them.
        let header = serde_json::json!({
            "y": {"dtype": "I64", "shape": [n], "data_offsets": [0, 8 * n]},
            "x": {"dtype": "U8", "shape": [n, c, s, s], "data_offsets": [8 * n, 8 * n + n * c * s * s]},
        })
        .to_string();
        let padded = format!("{header:<width$}", width = header.len().div_ceil(8) * 8);
        w.write_all(&(padded.len() as u64).to_le_bytes())?;
        w.write_all(padded.as_bytes())?;
        for (_, l) in job.files {
            w.write_all(&l.to_le_bytes())?;
        }
        Ok(w)
    };
    let mut w = match open() {
        Ok(w) => w,
        Err(e) => return Ok(Err(e)),
    };
    // The first write that fails (a full disk) stops the decoding: the caller decodes again
    // into memory, and need not wait for a pass whose result is thrown away.
    let mut failed = None;
    let decoded = job.each_chunk(|px| match w.write_all(px) {
        Ok(()) => Ok(()),
        Err(e) => {
            failed = Some(e);
            Err(anyhow!("writing the cache stopped"))
        }
    });
    if let Some(e) = failed {
        let _ = fs::remove_file(&tmp);
        return Ok(Err(e.into()));
    }
    decoded.inspect_err(|_| {
        let _ = fs::remove_file(&tmp);
    })?;
    let done = w.into_inner().map_err(|e| e.into_error().into()).and_then(|f| {
        f.sync_all()?;
        fs::rename(&tmp, path)?;
        Ok(())
    });
    if done.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    Ok(done)
}

/// One image as `channels` planes of `size`×`size` bytes.
fn decode(path: &Path, size: u32, channels: i64) -> Result<Vec<u8>> {
    let img = image::ImageReader::open(path)?
        .with_guessed_format()?
        .decode()
        .map_err(|e| anyhow!("cannot decode it as an image ({e})"))?;
    let img = img.resize_to_fill(size, size, image::imageops::FilterType::Triangle);
    let plane = (size * size) as usize;
    if channels == 1 {
        return Ok(img.to_luma8().into_raw());
    }
    let rgb = img.to_rgb8().into_raw();
    let mut out = vec![0u8; 3 * plane];
    for (i, px) in rgb.chunks_exact(3).enumerate() {
        out[i] = px[0];
        out[plane + i] = px[1];
        out[2 * plane + i] = px[2];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::load;
    use crate::spec::schema::{Data, DataSource};
    use tch::Kind;

    fn cache_path(root: &Path, files: &[(PathBuf, i64)], size: i64, channels: i64) -> PathBuf {
        cache_dir(root).join(cache_name(root, files, size, channels))
    }

    /// Pixel bytes and labels, as tensors.
    #[derive(Debug)]
    struct Images {
        x: Tensor,
        y: Tensor,
    }

    fn write_image(path: &Path, w: u32, h: u32, v: u8) {
        let img = image::RgbImage::from_fn(w, h, |x, _| image::Rgb([v, (x * 10) as u8, 255 - v]));
        img.save(path).unwrap();
    }

    /// The images (read whole) and class names of a tree, as tensors.
    fn read(root: &Path, size: i64, channels: i64) -> Result<(Images, Vec<String>)> {
        let (xy, classes) = read_imagefolder(root, size, channels, "data.path", &Data::default())?;
        Ok((
            Images {
                x: xy.x.tensor(),
                y: xy.y,
            },
            classes,
        ))
    }

    #[test]
    fn imagefolder_decodes_labels_by_class_and_caches() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("train");
        for (c, v) in [("b_dog", 200u8), ("a_cat", 20)] {
            fs::create_dir_all(root.join(c)).unwrap();
            write_image(&root.join(c).join("1.png"), 12, 8, v);
            write_image(&root.join(c).join("2.JPG"), 8, 12, v);
            fs::write(root.join(c).join("notes.txt"), "ignored").unwrap();
        }
        let (imgs, classes) = read(&root, 6, 3).unwrap();
        assert_eq!(classes, vec!["a_cat", "b_dog"]);
        assert_eq!(imgs.x.size(), vec![4, 3, 6, 6]);
        assert_eq!(Vec::<i64>::try_from(&imgs.y).unwrap(), vec![0, 0, 1, 1]);
        // Red plane is the class's constant (JPEG within a few levels).
        let red = imgs
            .x
            .get(2)
            .get(0)
            .to_kind(Kind::Float)
            .mean(Kind::Float)
            .double_value(&[]);
        assert!((red - 200.0).abs() < 4.0, "{red}");
        let files = scan_folder(&root, "k").unwrap().1;
        let cache = cache_path(&root, &files, 6, 3);
        assert!(cache.exists(), "the decoded bytes are cached");
        // The cache answers while the files are unchanged: make it distinguishable and read again.
        let marked = imgs.x.copy();
        let _ = marked.get(0).get(0).get(0).get(0).fill_(7);
        Tensor::write_safetensors(&[("x", &marked), ("y", &imgs.y)], &cache).unwrap();
        let (again, _) = read(&root, 6, 3).unwrap();
        assert_eq!(again.x.int64_value(&[0, 0, 0, 0]), 7);
        assert!(!root.join(IN_TREE_CACHE).exists(), "nothing but classes in the tree");
        // A cache inside the tree is still read (with advice to move it), not decoded again.
        fs::create_dir_all(root.join(IN_TREE_CACHE)).unwrap();
        let inside = root.join(IN_TREE_CACHE).join(cache.file_name().unwrap());
        fs::rename(&cache, &inside).unwrap();
        let (moved, _) = read(&root, 6, 3).unwrap();
        assert_eq!(
            moved.x.int64_value(&[0, 0, 0, 0]),
            7,
            "the cache inside the tree answers"
        );
        assert!(!cache.exists(), "and no second cache is written");
        fs::rename(&inside, &cache).unwrap();
        // Another size, or a changed file, decodes afresh.
        let (gray, _) = read(&root, 4, 1).unwrap();
        assert_eq!(gray.x.size(), vec![4, 1, 4, 4]);
        std::thread::sleep(std::time::Duration::from_millis(20));
        write_image(&root.join("a_cat").join("1.png"), 12, 9, 20);
        let (fresh, _) = read(&root, 6, 3).unwrap();
        assert_ne!(fresh.x.int64_value(&[0, 0, 0, 0]), 7);
        // Through load: holdout split, floats in [0, 1], the model's size.
        let d = Data {
            source: DataSource::Imagefolder,
            path: Some(root.clone()),
            val_fraction: 0.25,
            ..Default::default()
        };
        let s = load(&d, &[3, 6, 6], 2, 0).unwrap();
        assert_eq!((s.train.len(), s.val.len()), (3, 1));
        assert!(s.train.samples().max().double_value(&[]) <= 1.0);
        let e = format!(
            "{:#}",
            load(
                &Data {
                    image_size: 8,
                    ..d.clone()
                },
                &[3, 6, 6],
                2,
                0
            )
            .unwrap_err()
        );
        assert!(e.contains("data.image_size = 8 but the model takes 6×6"), "{e}");
        // A broken image names its file.
        fs::write(root.join("a_cat").join("3.png"), b"not a png").unwrap();
        let e = format!("{:#}", read(&root, 6, 3).unwrap_err());
        assert!(e.contains("3.png") && e.contains("cannot decode"), "{e}");
    }
}
