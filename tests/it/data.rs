//! Data read in place and made ahead: an imagefolder cache and an npz read through a memory
//! map, the prefetching loader, and the host memory they cost. Whatever the loader's threads,
//! depth or timing, and whether the samples are mapped or in memory, training is the same to
//! the byte.
use std::path::{Path, PathBuf};

use crate::common::*;
use toml::Value;

/// `n` PNG images of `size`² in `classes` class directories under `dir/name`: each a class
/// tint over noise, so that they compress poorly and a model can tell the classes apart.
fn imagefolder(dir: &Path, name: &str, n: usize, size: u32, classes: usize) -> PathBuf {
    let root = dir.join(name);
    let mut state = 11u64;
    for i in 0..n {
        let class = i % classes;
        let sub = root.join(format!("class{class}"));
        std::fs::create_dir_all(&sub).unwrap();
        let img = image::RgbImage::from_fn(size, size, |x, y| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = (state >> 58) as u8;
            let tint = (class * 60) as u8;
            image::Rgb([tint.wrapping_add(noise), (x * 4) as u8 ^ noise, (y * 4) as u8])
        });
        img.save(sub.join(format!("{i:05}.png"))).unwrap();
    }
    root
}

/// A tiny ViT on `root`'s images at `size` px, batch 4 in two micro-batches, augmented and
/// normalized, every step recorded.
fn vit_job(t: &Test, root: &Path, size: u32, patch: u32) -> Test {
    t.clone().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n\
         [model]\npreset = \"vit\"\n[model.vit]\nimage_size = {size}\npatch_size = {patch}\nlayers = 1\nheads = 2\n\
         hidden_dim = 16\nmlp_dim = 32\nnum_classes = 4\n\
         [data]\nsource = \"imagefolder\"\npath = \"{}\"\nval_fraction = 0.25\nmean = [0.5, 0.4, 0.3]\nstd = [0.25, 0.2, 0.3]\n\
         [data.augment]\ncrop_padding = 2\nhorizontal_flip = true\n\
         [train]\nepochs = 2\nbatch_size = 4\naccumulation_steps = 2\noptimizer = \"sgd\"\nlr = 0.05\nmomentum = 0.9\n\
         [log]\nevery_steps = 1\nprogress = \"off\"\n",
        root.display()
    )))
}

/// Where memtrain keeps the decoded images of the tree at `root`: beside it.
fn cache_beside(root: &Path) -> PathBuf {
    root.with_file_name(format!(
        "{}.memtrain-cache",
        root.file_name().unwrap().to_string_lossy()
    ))
}

#[test]
fn training_is_the_same_whatever_the_loader_does() {
    let t = Test::new();
    let root = imagefolder(t.dir(), "images", 48, 20, 4);
    let base = vit_job(&t, &root, 16, 8);
    // The first run decodes into the cache; every other reads it mapped (or whole).
    let first = base.clone().name("first").run();
    let cache: Vec<_> = std::fs::read_dir(cache_beside(&root)).unwrap().collect();
    assert_eq!(cache.len(), 1, "one cache file: {cache:?}");
    // The tree stays torchvision's: the cache beside it is no class.
    let seen: serde_json::Value =
        serde_json::from_str(&reference(t.dir(), &["imagefolder", root.to_str().unwrap()])).unwrap();
    assert_eq!(seen["images"], 48, "{seen}");
    assert_eq!(seen["classes"].as_array().map(Vec::len), Some(4), "{seen}");
    let want = first.final_bytes();
    let variants: &[(&str, &[(&str, i64)])] = &[
        ("one-worker", &[("data.workers", 1), ("data.prefetch", 1)]),
        ("four-workers", &[("data.workers", 4), ("data.prefetch", 4)]),
        ("in-the-step", &[("data.prefetch", 0)]),
    ];
    for (name, keys) in variants {
        let run = keys
            .iter()
            .fold(base.clone().name(name), |r, (k, v)| r.set(k, *v))
            .run();
        assert!(run.final_bytes() == want, "{name} trained otherwise");
    }
    // Host memory low from the start: the loader gives up depth down to one micro-batch, says
    // so in a record each time, and trains the same.
    let pressed = base
        .clone()
        .name("pressed")
        .set("data.prefetch", 4)
        .set("data.workers", 2)
        .env("MEMTRAIN_FAULT_LOW_MEMORY_BYTES", &u64::MAX.to_string())
        .run();
    assert!(
        pressed.final_bytes() == want,
        "the loader under pressure trained otherwise"
    );
    let shed: Vec<(i64, i64)> = pressed
        .run_records()
        .events
        .into_iter()
        .filter_map(|e| match e {
            Event::Prefetch(p) => Some((p.prefetch_before, p.prefetch)),
            _ => None,
        })
        .collect();
    assert_eq!(shed, vec![(4, 3), (3, 2), (2, 1)]);
    let whole = base.clone().name("in-memory").set("data.memory_map", false).run();
    assert!(whole.final_bytes() == want, "the set read whole trained otherwise");
    // Stopped mid-epoch (step 5 of 9) and resumed, with another loader.
    let deep = base.clone().set("data.workers", 4).set("data.prefetch", 4);
    let stopped = deep.name("stopped").interrupt_after_step(5).exit(130).run();
    let resumed = stopped.resume().run();
    assert!(resumed.final_bytes() == want, "the resumed run trained otherwise");
    // The wait is in every step record and summed in the epoch's.
    let steps = first.steps();
    assert!(steps
        .iter()
        .all(|s| s.data_wait_seconds >= 0.0 && s.data_wait_seconds <= s.seconds));
    for e in first.epochs() {
        assert!(e.data_wait_seconds > 0.0 && e.data_wait_seconds < e.seconds, "{e:?}");
    }
    let plain = base.name("plain").remove("data.augment").run();
    assert!(plain.final_bytes() != want, "augmentation changes what is trained on");
}

#[test]
fn an_npz_read_in_place_trains_as_the_compressed_one() {
    let t = Test::new();
    // digits.npz is compressed (read whole); the same arrays stored plainly are mapped.
    let arrays = tch::Tensor::read_npz(repo().join("data/digits.npz")).unwrap();
    let plain = t.dir().join("digits-stored.npz");
    let named: Vec<(&str, &tch::Tensor)> = arrays.iter().map(|(n, a)| (n.as_str(), a)).collect();
    tch::Tensor::write_npz(&named, &plain).unwrap();
    let compressed = t.clone().name("compressed").set("train.epochs", 1).run();
    let mapped = t
        .clone()
        .name("mapped")
        .set("train.epochs", 1)
        .set("data.path", plain.display().to_string())
        .run();
    assert!(mapped.final_bytes() == compressed.final_bytes());
    // A compressed file is inflated whole, and must fit; here it would not fit under a cap.
    t.name("refused")
        .set("memory.limit", "64KiB")
        .exit_in(&[2, 3])
        .stderr_has("a compressed .npz (numpy.savez_compressed) is inflated whole into memory")
        .stderr_has("save it uncompressed with numpy.savez(path, x=x, y=y)")
        .run();
}

#[test]
fn synthetic_keys_set_for_a_file_are_said_to_be_unread() {
    let o = Test::new()
        .set("data.samples", 100)
        .args(&["--max-steps", "1"])
        .stderr_has("data.samples is read only for synthetic data: this run reads every sample of data.path; remove it")
        .run();
    let resolved = std::fs::read_to_string(o.out.join("config.resolved.toml")).unwrap();
    assert!(
        resolved.contains("samples = 100"),
        "the spec as given is kept: {resolved}"
    );
    Test::new()
        .name("checked")
        .command("check")
        .set("data.samples", 100)
        .stderr_has("data.samples is read only for synthetic data")
        .run();
    let o = Test::new().name("unset").args(&["--max-steps", "1"]).run();
    assert!(!o.stderr.contains("read only for synthetic"), "{}", o.stderr);
    let resolved = std::fs::read_to_string(o.out.join("config.resolved.toml")).unwrap();
    assert!(
        !resolved.contains("samples =") && !resolved.contains("noise ="),
        "a file source's resolved spec holds only what it reads: {resolved}"
    );
}

#[test]
fn a_batch_buffer_the_allocator_refuses_sheds_prefetch_depth() {
    let t = Test::new();
    let root = imagefolder(t.dir(), "images", 16, 20, 4);
    let base = vit_job(&t, &root, 16, 8).set("train.epochs", 1);
    let want = base.clone().name("plain").set("data.prefetch", 0).run().final_bytes();
    // The loader's first two batch buffers are refused: it keeps fewer batches ahead, says so,
    // and trains the same.
    let refused = base
        .name("refused")
        .set("data.prefetch", 3)
        .set("data.workers", 1)
        .env("MEMTRAIN_FAULT_LOADER_ALLOC_FAILS", "2")
        .stderr_has("the data loader keeps 1 micro-batch(es) ahead instead of 2")
        .run();
    assert_eq!(refused.summary().status, Status::Completed);
    assert!(
        refused.final_bytes() == want,
        "the loader that shed depth trained otherwise"
    );
    let shed: Vec<(i64, i64)> = refused
        .run_records()
        .events
        .into_iter()
        .filter_map(|e| match e {
            Event::Prefetch(p) => Some((p.prefetch_before, p.prefetch)),
            _ => None,
        })
        .collect();
    assert_eq!(shed, vec![(3, 2), (2, 1)]);
}

/// A directory nothing can be written in while it lives, even by root (which file modes do not
/// stop): read-only by its mode, and immutable where the mode does not hold.
struct ReadOnly(PathBuf);

impl ReadOnly {
    fn new(dir: &Path) -> ReadOnly {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555)).unwrap();
        let probe = dir.join("probe");
        if std::fs::write(&probe, b"").is_ok() {
            std::fs::remove_file(&probe).unwrap();
            let ok = std::process::Command::new("chattr").arg("+i").arg(dir).status();
            assert!(
                ok.is_ok_and(|s| s.success()) && std::fs::write(&probe, b"").is_err(),
                "cannot make {} read-only here",
                dir.display()
            );
        }
        ReadOnly(dir.to_path_buf())
    }
}

impl Drop for ReadOnly {
    fn drop(&mut self) {
        use std::os::unix::fs::PermissionsExt;
        let _ = std::process::Command::new("chattr").arg("-i").arg(&self.0).status();
        let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o755));
    }
}

#[test]
fn data_cache_dir_is_refused_for_a_source_without_an_image_cache() {
    Test::new()
        .command("check")
        .set("data.cache_dir", "/tmp/anywhere")
        .exit(2)
        .stderr_has("data.cache_dir")
        .stderr_has("is only read for data.source = \"imagefolder\"")
        .run();
}

#[test]
fn an_image_tree_whose_parent_is_read_only_keeps_its_cache_in_data_cache_dir() {
    let t = Test::new();
    let parent = t.dir().join("mount");
    let root = imagefolder(&parent, "images", 16, 20, 4);
    let _ro = ReadOnly::new(&parent);
    let base = vit_job(&t, &root, 16, 8).set("train.epochs", 1);
    // Beside the tree nothing can be written: decoded into memory, with the way out named.
    let memory = base
        .clone()
        .name("beside")
        .stderr_has("could not write the image cache")
        .stderr_has("set data.cache_dir")
        .run();
    let cache = t.dir().join("cache");
    let kept = base.clone().name("kept").set("data.cache_dir", cache.to_str().unwrap());
    let first = kept.clone().name("first").run();
    assert!(!first.stderr.contains("could not write"), "{}", first.stderr);
    let files: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(
        files.len() == 1 && files[0].to_string_lossy().starts_with("imagefolder-16px-3ch-"),
        "{files:?}"
    );
    // A later run reads that cache (a tree changed under it would make a new one): the same
    // training, from the same bytes.
    let again = kept.name("again").run();
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 1);
    assert!(again.final_bytes() == first.final_bytes() && first.final_bytes() == memory.final_bytes());
    assert!(!cache_beside(&root).exists());
}

/// A safetensors file of `n` float32 samples of `d` values and uint8 labels 0, whose samples are
/// a hole (zeros, read as such) unless `rows` gives some: made at once whatever its size.
fn sparse_safetensors(path: &Path, n: u64, d: u64, rows: &[(u64, f32)]) {
    use std::io::{Seek, SeekFrom, Write};
    let header = serde_json::json!({
        "y": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]},
        "x": {"dtype": "F32", "shape": [n, d], "data_offsets": [n, n + n * d * 4]},
    })
    .to_string();
    let header = format!("{header:<width$}", width = header.len().div_ceil(8) * 8);
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(&(header.len() as u64).to_le_bytes()).unwrap();
    f.write_all(header.as_bytes()).unwrap();
    f.write_all(&vec![0u8; n as usize]).unwrap();
    let x = 8 + header.len() as u64 + n;
    for &(row, v) in rows {
        f.seek(SeekFrom::Start(x + row * d * 4)).unwrap();
        f.write_all(&v.to_le_bytes()).unwrap();
    }
    f.set_len(x + n * d * 4).unwrap();
}

/// An MLP on `d` values a sample from the safetensors file `path`, validated on `val`.
fn mlp_on(t: &Test, path: &Path, val: &Path, d: u64) -> Test {
    t.clone().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"mlp\"\n[model.mlp]\ninputs = {d}\nhidden = [8]\nnum_classes = 2\n\
         [data]\nsource = \"safetensors\"\npath = \"{}\"\nval_path = \"{}\"\n\
         [train]\nepochs = 1\nbatch_size = 4\noptimizer = \"sgd\"\nlr = 0.1\n[log]\nprogress = \"off\"\n",
        path.display(),
        val.display()
    )))
}

/// The largest resident size of `pid`'s mappings of `file` while it runs, polled.
fn peak_file_rss(pid: i32, file: PathBuf) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let name = file.to_string_lossy().into_owned();
        let mut peak = 0;
        while let Ok(smaps) = std::fs::read_to_string(format!("/proc/{pid}/smaps")) {
            let mut mine = false;
            let mut rss = 0;
            for l in smaps.lines() {
                // A mapping's header line starts with its address range; its fields follow.
                if l.split_whitespace()
                    .next()
                    .is_some_and(|a| a.contains('-') && !a.ends_with(':'))
                {
                    mine = l.ends_with(&name);
                } else if let Some(kb) = l.strip_prefix("Rss:").filter(|_| mine) {
                    rss += kb
                        .split_whitespace()
                        .next()
                        .and_then(|v| v.parse::<u64>().ok())
                        .unwrap_or(0)
                        * 1024;
                }
            }
            peak = peak.max(rss);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        peak
    })
}

#[test]
fn a_mapped_float_set_of_gigabytes_is_checked_as_batches_read_it() {
    let t = Test::new();
    const D: u64 = 1024;
    // 3 GiB of samples; every step reads 4 of them (16 KiB).
    let (big, val) = (t.dir().join("big.safetensors"), t.dir().join("val.safetensors"));
    sparse_safetensors(&big, 3 << 18, D, &[]);
    sparse_safetensors(&val, 8, D, &[]);
    let running = mlp_on(&t, &big, &val, D)
        .name("big")
        .args(&["--max-steps", "3"])
        .spawn();
    let peak = peak_file_rss(running.pid(), big.canonicalize().unwrap());
    let out = running.finish();
    let peak = peak.join().unwrap();
    eprintln!("3 GiB mapped: {} KiB resident at most", peak >> 10);
    assert_eq!(out.summary().status, Status::StepLimit, "{}", out.stderr);
    assert!(
        peak < 16 << 20,
        "3 GiB mapped: {} MiB of it resident by the third step",
        peak >> 20
    );
    // A sample that is not finite is still refused, by its file and its index.
    let bad = t.dir().join("bad.safetensors");
    sparse_safetensors(&bad, 20, D, &[(5, f32::NAN)]);
    mlp_on(&t, &bad, &val, D)
        .name("nan")
        .exit_in(&[1, 2, 3])
        .stderr_has(&format!(
            "data.path {}: x contains NaN or infinite values (sample 5,",
            bad.display()
        ))
        .run();
    // Read whole, the whole file is checked at the start, as before.
    mlp_on(&t, &bad, &val, D)
        .name("whole")
        .set("data.memory_map", false)
        .exit(2)
        .stderr_has("x contains NaN or infinite values")
        .run();
}

/// The largest anonymous RSS (`RssAnon`) of `pid` while it runs, polled.
pub fn peak_rss_anon(pid: i32) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let mut peak = 0;
        while let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) {
            if status.lines().any(|l| l.starts_with("State:") && l.contains('Z')) {
                break;
            }
            let kb = status
                .lines()
                .find_map(|l| l.strip_prefix("RssAnon:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
            peak = peak.max(kb.unwrap_or(0) * 1024);
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        peak
    })
}

#[test]
fn a_set_many_times_a_memory_bound_trains_under_it() {
    let t = Test::new();
    const SIZE: u64 = 64;
    let (small, big): (u64, u64) = (300, 3000);
    let run = |n: u64, extra: &[(&str, Value)]| {
        let root = t.dir().join(format!("set{n}"));
        let root = match root.exists() {
            true => root,
            false => imagefolder(t.dir(), &format!("set{n}"), n as usize, SIZE as u32, 4),
        };
        let job = vit_job(&t, &root, SIZE as u32, 16)
            .name(&format!("n{n}-{}", extra.len()))
            .set("train.epochs", 1)
            .set("train.batch_size", 16)
            .set("train.accumulation_steps", 1)
            .set("data.val_fraction", 0.1)
            .set("log.every_steps", 0);
        let job = extra.iter().fold(job, |j, (k, v)| j.set(k, v.clone()));
        // The first pass writes the cache; the measured run trains from it.
        if !cache_beside(&root).exists() {
            job.clone().name(&format!("decode{n}")).run();
        }
        let running = job.spawn();
        let peak = peak_rss_anon(running.pid());
        let out = running.finish();
        assert_eq!(out.summary().status, Status::Completed);
        peak.join().unwrap()
    };
    let cache = |n: u64| n * 3 * SIZE * SIZE;
    let bound = (cache(big) - cache(small)) / 4;
    let base = run(small, &[]);
    let mapped = run(big, &[]);
    assert!(
        mapped < base + bound,
        "ten times the images ({} MiB more pixels) added {} MiB of anonymous memory, over the bound of {} MiB",
        (cache(big) - cache(small)) >> 20,
        mapped.saturating_sub(base) >> 20,
        bound >> 20
    );
    // The same set read whole costs its pixels: the bound measures what it claims.
    let whole = run(big, &[("data.memory_map", Value::from(false))]);
    eprintln!(
        "peak RssAnon: {} MiB small, {} MiB big mapped, {} MiB big read whole",
        base >> 20,
        mapped >> 20,
        whole >> 20
    );
    assert!(
        whole > base + bound,
        "read whole: {} MiB over {} MiB",
        whole >> 20,
        base >> 20
    );
}

#[test]
fn check_states_the_host_memory_the_loader_takes() {
    let t = Test::new();
    let root = imagefolder(t.dir(), "images", 8, 20, 4);
    // 16×16 RGB float32 samples and an int64 label: 3080 bytes; micro-batch 4.
    let r = vit_job(&t, &root, 16, 8).command("check").set("data.prefetch", 2).run();
    let out = format!("{}{}", r.stdout, r.stderr);
    let line = out
        .lines()
        .find(|l| l.starts_with("data loader"))
        .unwrap_or_else(|| panic!("no loader line:\n{out}"));
    // prefetch 2 + 1 staged, the step's tensor and its pinned copy: 5 × 4 × 3080 bytes.
    assert!(line.contains("5 micro-batch(es) of 4 × 3×16×16"), "{line}");
    assert!(line.contains("= 60.16 KiB of host memory"), "{line}");
}

#[test]
fn images_whose_cache_cannot_be_written_train_from_memory_or_say_why_not() {
    let t = Test::new();
    // 64 images of 3×16×16 bytes: 48 KiB, more than the cap below leaves beside the model.
    let root = imagefolder(t.dir(), "images", 64, 20, 4);
    // A file where the cache directory would go: nothing can be written there.
    std::fs::write(cache_beside(&root), b"not a directory").unwrap();
    let job = vit_job(&t, &root, 16, 8).set("train.epochs", 1);
    let held = job
        .clone()
        .name("held")
        .stderr_has("could not write the image cache")
        .run();
    assert_eq!(held.summary().status, Status::Completed);
    // Where memory cannot hold them either, the refusal names the cache and what to do.
    job.name("refused")
        .set("memory.limit", "40KiB")
        .exit_in(&[2, 3])
        .stderr_has("because their cache could not be written in")
        .stderr_has("free space there or make it writable")
        .run();
}
