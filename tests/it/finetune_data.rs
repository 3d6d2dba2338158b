//! The data side of a fine-tune: the head's classes taken from the data and written as
//! `classes.json`, named normalisation constants, and torchvision's RandomResizedCrop and
//! ColorJitter (their kernels checked against torchvision's, their batches the same at any
//! worker count).
use std::path::{Path, PathBuf};

use crate::common::*;
use memtrain::data::classes::ClassNames;
use memtrain::data::jitter::{self, Adjust};
use memtrain::data::resized_crop::{resized_crop_into, CropBox};

/// `n` PNG images of `size`² in the class directories `classes` under `dir/name`.
fn folder(dir: &Path, name: &str, classes: &[&str], n: usize, size: u32) -> PathBuf {
    let root = dir.join(name);
    let mut state = 7u64;
    for i in 0..n {
        let class = i % classes.len();
        let sub = root.join(classes[class]);
        std::fs::create_dir_all(&sub).unwrap();
        let img = image::RgbImage::from_fn(size, size, |x, y| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = (state >> 59) as u8;
            image::Rgb([(class * 80) as u8 + noise, (x * 9) as u8, (y * 9) as u8 ^ noise])
        });
        img.save(sub.join(format!("{i:04}.png"))).unwrap();
    }
    root
}

/// A small ResNet on the folder at `root`, its head's width left to the data.
fn resnet_on(t: &Test, root: &Path) -> Test {
    t.clone().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 5\n\
         [model]\npreset = \"resnet18\"\n[model.resnet18]\nimage_size = 16\nsmall_stem = true\n\
         [data]\nsource = \"imagefolder\"\npath = \"{}\"\nval_fraction = 0.25\n\
         [train]\nepochs = 1\nbatch_size = 6\noptimizer = \"sgd\"\nlr = 0.01\n\
         [log]\nprogress = \"off\"\n",
        root.display()
    )))
}

fn resolved(run_dir: &Path) -> toml::Table {
    std::fs::read_to_string(run_dir.join("config.resolved.toml"))
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn a_folder_of_three_classes_trains_a_three_way_head_and_says_so() {
    let t = Test::new();
    let root = folder(t.dir(), "pets", &["cat", "dog", "fish"], 24, 16);
    let base = resnet_on(&t, &root);
    let o = base.clone().name("followed").run();
    assert!(!o.stderr.contains("belong to no sample"), "{}", o.stderr);
    assert_eq!(
        resolved(&o.out)["model"]["resnet18"]["num_classes"].as_integer(),
        Some(3)
    );
    let names = ClassNames::read(&o.out).unwrap();
    assert_eq!(names.classes, ["cat", "dog", "fish"]);
    let head = tensors(&o.final_model())
        .into_iter()
        .find(|(n, _)| n == "fc.weight")
        .expect("fc.weight");
    assert_eq!(head.1.size()[0], 3, "the head has the data's classes");
    // check resolves the same value and prints it.
    let c = base.clone().name("checked").command("check").run();
    assert!(c.stdout.contains("num_classes = 3"), "{}", c.stdout);
    // More classes than the data's: allowed, and said by run and check.
    let warn = "model.resnet18.num_classes is 5, but the data has 3 class(es) (cat, dog, fish)";
    base.clone()
        .name("wide")
        .set("model.resnet18.num_classes", 5)
        .stderr_has(warn)
        .stderr_has("2 of the head's outputs belong to no sample")
        .run();
    base.clone()
        .name("wide-check")
        .command("check")
        .set("model.resnet18.num_classes", 5)
        .stderr_has(warn)
        .run();
    // Fewer: refused by both, naming the key, before anything is written.
    for command in ["run", "check"] {
        let o = base
            .clone()
            .name(&format!("narrow-{command}"))
            .command(command)
            .set("model.resnet18.num_classes", 2)
            .exit(2)
            .stderr_has("model.resnet18.num_classes is 2, but the data has 3 class(es) (cat, dog, fish)")
            .stderr_has("set it to 3, or leave it out to follow the data")
            .run();
        assert!(!o.out.join("classes.json").exists());
    }
}

#[test]
fn labels_of_an_array_file_give_the_class_count() {
    // digits.npz has labels 0 to 9: the mlp's head follows them without num_classes.
    let o = Test::new()
        .remove("model.mlp.num_classes")
        .args(&["--max-steps", "1"])
        .run();
    assert_eq!(resolved(&o.out)["model"]["mlp"]["num_classes"].as_integer(), Some(10));
    let names = ClassNames::read(&o.out).unwrap();
    assert_eq!(names.classes, (0..10).map(|i| i.to_string()).collect::<Vec<_>>());
}

#[test]
fn named_normalisation_resolves_to_its_constants() {
    let t = Test::new();
    let root = folder(t.dir(), "pets", &["cat", "dog"], 8, 16);
    let base = resnet_on(&t, &root).command("check");
    let c = base.clone().name("clip-check").set("data.normalize", "clip").run();
    for shown in ["normalize = \"clip\"", "0.48145466,", "0.27577711,"] {
        assert!(c.stdout.contains(shown), "{shown} in {}", c.stdout);
    }
    let o = resnet_on(&t, &root)
        .name("clip")
        .set("data.normalize", "clip")
        .args(&["--max-steps", "1"])
        .run();
    let spec = resolved(&o.out);
    let floats = |k: &str| -> Vec<f64> {
        spec["data"][k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_float().unwrap())
            .collect()
    };
    assert_eq!(floats("mean"), [0.48145466, 0.4578275, 0.40821073]);
    assert_eq!(floats("std"), [0.26862954, 0.26130258, 0.27577711]);
    assert_eq!(spec["data"]["normalize"].as_str(), Some("clip"));
    // The resolved spec, name and numbers both, loads again as it is.
    let again = t.dir().join("again.toml");
    std::fs::copy(o.out.join("config.resolved.toml"), &again).unwrap();
    let r = std::process::Command::new(env!("CARGO_BIN_EXE_memtrain"))
        .arg("check")
        .arg(&again)
        .output()
        .unwrap();
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    base.name("both")
        .set("data.normalize", "imagenet")
        .set("data.mean", toml::Value::Array(vec![0.5.into(); 3]))
        .set("data.std", toml::Value::Array(vec![0.5.into(); 3]))
        .exit(2)
        .stderr_has("data.normalize is set, and so are data.mean and data.std; give the name or the numbers, not both")
        .run();
}

#[test]
fn resized_crops_and_jitter_train_the_same_at_any_worker_count() {
    let t = Test::new();
    let root = folder(t.dir(), "pets", &["cat", "dog", "fish"], 24, 16);
    let base = resnet_on(&t, &root)
        .set("data.normalize", "imagenet")
        .set("data.prefetch", 2)
        .set("data.augment.horizontal_flip", true)
        .set(
            "data.augment.random_resized_crop.scale",
            toml::Value::Array(vec![0.3.into(), 1.0.into()]),
        )
        .set("data.augment.color_jitter.brightness", 0.4)
        .set("data.augment.color_jitter.contrast", 0.4)
        .set("data.augment.color_jitter.saturation", 0.4)
        .set("data.augment.color_jitter.hue", 0.1);
    let one = base.clone().name("one").set("data.workers", 1).run();
    let two = base.clone().name("two").set("data.workers", 2).run();
    assert!(one.final_bytes() == two.final_bytes(), "workers changed the batches");
    // Three threads making three batches ahead, and batches made in the training thread alone.
    for (name, workers, prefetch) in [("three", 3, 3), ("inline", 1, 0)] {
        let other = base
            .clone()
            .name(name)
            .set("data.workers", workers)
            .set("data.prefetch", prefetch)
            .run();
        assert!(
            one.final_bytes() == other.final_bytes(),
            "{workers} worker(s), prefetch {prefetch}, changed the batches"
        );
    }
    let plain = base.name("plain").remove("data.augment").run();
    assert!(
        plain.final_bytes() != one.final_bytes(),
        "augmentation changes what is trained on"
    );
}

/// torchvision's kernels on fixed boxes and factors, and memtrain's on the same images. They
/// differ by at most 1.2e-7 here (a last bit: libtorch fuses some multiply-adds and sums the
/// contrast's mean in another order); the test allows 5e-7.
const TORCHVISION: &str = r#"
import sys, torch, safetensors.torch
import torchvision.transforms.v2.functional as F
torch.manual_seed(0)
rgb = torch.rand(3, 20, 24)
gray = torch.rand(1, 20, 24)
out = {"rgb": rgb, "gray": gray}
for k, (top, left, h, w) in enumerate([(2, 3, 10, 15), (0, 0, 20, 24), (5, 1, 5, 23), (1, 2, 19, 7)]):
    out[f"crop{k}"] = F.resized_crop(rgb, top, left, h, w, [20, 24], antialias=True)
def jitter(img, steps):
    for name, f in steps:
        img = getattr(F, "adjust_" + name)(img, f)
    return img
cases = [[("brightness", 1.3)], [("contrast", 0.6)], [("saturation", 1.7)], [("hue", 0.23)], [("hue", -0.4)],
         [("hue", 0.1), ("contrast", 1.4), ("brightness", 0.7), ("saturation", 0.2)]]
for k, steps in enumerate(cases):
    out[f"jitter{k}"] = jitter(rgb, steps)
    out[f"gray{k}"] = jitter(gray, steps)
safetensors.torch.save_file({k: v.contiguous().clone() for k, v in out.items()}, sys.argv[1])
"#;

#[test]
fn resized_crops_and_jitter_match_torchvision_within_5e_7() {
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("tv.py");
    std::fs::write(&script, TORCHVISION).unwrap();
    let file = dir.path().join("tv.safetensors");
    let o = std::process::Command::new(python())
        .arg(&script)
        .arg(&file)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let t: std::collections::HashMap<String, tch::Tensor> = tensors(&file).into_iter().collect();
    let values = |name: &str| Vec::<f32>::try_from(t[name].flatten(0, -1)).unwrap();
    let worst = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let rgb = values("rgb");
    let boxes = [(2, 3, 10, 15), (0, 0, 20, 24), (5, 1, 5, 23), (1, 2, 19, 7)];
    for (k, (top, left, height, width)) in boxes.into_iter().enumerate() {
        let mut out = vec![0f32; rgb.len()];
        let b = CropBox {
            top,
            left,
            height,
            width,
        };
        resized_crop_into(&rgb, [3, 20, 24], b, &mut out, &mut vec![]);
        let d = worst(&out, &values(&format!("crop{k}")));
        assert!(d <= 5e-7, "box {b:?}: {d}");
    }
    use Adjust::*;
    let cases: [&[Adjust]; 6] = [
        &[Brightness(1.3)],
        &[Contrast(0.6)],
        &[Saturation(1.7)],
        &[Hue(0.23)],
        &[Hue(-0.4)],
        &[Hue(0.1), Contrast(1.4), Brightness(0.7), Saturation(0.2)],
    ];
    for (k, steps) in cases.iter().enumerate() {
        for (image, c, name) in [("rgb", 3, "jitter"), ("gray", 1, "gray")] {
            let mut img = values(image);
            jitter::apply(steps, &mut img, c);
            let d = worst(&img, &values(&format!("{name}{k}")));
            assert!(d <= 5e-7, "{image} {steps:?}: {d}");
        }
    }
}
