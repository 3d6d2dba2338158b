//! `memtrain eval`: a run's weights on its validation data (the same loss and accuracy the run
//! recorded), on another folder matched by class name, and bad input refused with nothing
//! written; a run whose parameters streamed from host memory, evaluated streaming them under its
//! cap.
use std::path::{Path, PathBuf};

use crate::common::*;
use memtrain::eval::EvalReport;

/// `n` PNG images of `size`² in the class directories `classes` under `dir/name`.
fn folder(dir: &Path, name: &str, classes: &[&str], n: usize, size: u32) -> PathBuf {
    let root = dir.join(name);
    let mut state = 3u64;
    for i in 0..n {
        let class = i % classes.len();
        let sub = root.join(classes[class]);
        std::fs::create_dir_all(&sub).unwrap();
        let tint = classes[class].bytes().map(u32::from).sum::<u32>() as u8;
        let img = image::RgbImage::from_fn(size, size, |x, y| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let noise = (state >> 59) as u8;
            image::Rgb([tint.wrapping_add(noise), (x * 9) as u8, (y * 9) as u8 ^ noise])
        });
        img.save(sub.join(format!("{i:04}.png"))).unwrap();
    }
    root
}

fn eval(t: &Test, args: &[&str]) -> Test {
    t.clone().command("eval").no_spec().args(args)
}

fn report(path: &Path) -> EvalReport {
    typed(path)
}

/// The figures of the run's validation at the epoch `last`: the loss to rounding (the run sums
/// each micro-batch's losses in fp32 on the device, eval each sample's in f64 on the host).
#[track_caller]
fn assert_the_runs_figures(r: &EvalReport, last: &EpochEvent) {
    assert!(
        (r.loss - last.val_loss.unwrap()).abs() < 1e-5,
        "{} vs {:?}",
        r.loss,
        last.val_loss
    );
    assert!(
        (r.accuracy - last.val_acc.unwrap()).abs() < 1e-9,
        "{} vs {:?}",
        r.accuracy,
        last.val_acc
    );
}

#[test]
fn eval_gives_the_runs_own_validation_figures_and_top5() {
    // digits: 10 classes, so top-5 too.
    let t = Test::new();
    let run = t.clone().name("digits").set("train.epochs", 2).run();
    let last = run.epochs().pop().expect("an epoch record");
    let newest = final_model(&run.out);
    let dir = run.out.display().to_string();
    let o = eval(&t, &[&dir, "--checkpoint", newest.to_str().unwrap()]).run();
    let r = report(&run.out.join("eval.json"));
    assert_eq!(r.samples, 359, "the held-out fifth of 1,797");
    assert_the_runs_figures(&r, &last);
    assert!(r.top5.is_some_and(|t| t >= r.accuracy), "{:?}", r.top5);
    assert_eq!(r.classes.len(), 10);
    assert_eq!(r.classes.iter().map(|c| c.count).sum::<i64>(), 359);
    assert!(
        o.stdout.contains("accuracy") && o.stdout.contains("top-5"),
        "{}",
        o.stdout
    );
    // Out of memory in the first micro-batch (a real allocation failure under the lowered CPU
    // cap): halved, and the same figures.
    let squeezed = t.dir().join("squeezed.json");
    let newest = newest.to_str().unwrap();
    eval(
        &t,
        &[&dir, "--checkpoint", newest, "--json", squeezed.to_str().unwrap()],
    )
    .env("MEMTRAIN_FAULT_OOM_IN", "validation")
    .stderr_has("eval: out of memory at a micro-batch of 32")
    .stderr_has("going on at 16")
    .run();
    let s = report(&squeezed);
    assert_eq!((r.micro_batch, s.micro_batch), (32, 16));
    assert!((s.loss - r.loss).abs() < 1e-6 && s.accuracy == r.accuracy, "{s:?}");
    // Without --checkpoint: the best one, which is one of the run's.
    eval(&t, &[&dir, "--json", t.dir().join("best.json").to_str().unwrap()]).run();
    let best = report(&t.dir().join("best.json"));
    assert!(
        best.checkpoint.starts_with(run.out.join("checkpoints")),
        "{:?}",
        best.checkpoint
    );
}

#[test]
fn another_folder_is_matched_by_class_name_and_bad_input_writes_nothing() {
    let t = Test::new();
    let pets = folder(t.dir(), "pets", &["cat", "dog", "fish"], 24, 16);
    let run = t
        .clone()
        .name("pets-run")
        .spec(table(&format!(
            "[job]\nthreads = 1\ndevice = \"cpu\"\n[model]\npreset = \"resnet18\"\n[model.resnet18]\nimage_size = 16\nsmall_stem = true\n\
             [data]\nsource = \"imagefolder\"\npath = \"{}\"\n[train]\nepochs = 1\nbatch_size = 6\noptimizer = \"sgd\"\nlr = 0.01\n[log]\nprogress = \"off\"\n",
            pets.display()
        )))
        .run();
    let dir = run.out.display().to_string();
    // Two of the run's classes, in another order: counted under the run's names.
    let test = folder(t.dir(), "test", &["fish", "cat"], 10, 24);
    let out = t.dir().join("test-eval.json");
    eval(
        &t,
        &[&dir, "--data", test.to_str().unwrap(), "--json", out.to_str().unwrap()],
    )
    .run();
    let r = report(&out);
    assert_eq!(r.samples, 10);
    assert_eq!(r.top5, None, "3 classes have no top-5");
    let counts: Vec<(&str, i64)> = r.classes.iter().map(|c| (c.name.as_str(), c.count)).collect();
    assert_eq!(counts, [("cat", 5), ("dog", 0), ("fish", 5)]);
    assert_eq!(r.classes[1].accuracy, None);
    // A class the run does not have.
    let cows = folder(t.dir(), "cows", &["cat", "cow"], 4, 16);
    let refused = t.dir().join("refused.json");
    let bad = |args: &[&str], needle: &str| {
        let mut a = vec![dir.as_str()];
        a.extend_from_slice(args);
        a.extend_from_slice(&["--json", refused.to_str().unwrap()]);
        eval(&t, &a).exit(2).stderr_has(needle).run();
        assert!(!refused.exists(), "nothing written for {args:?}");
    };
    bad(
        &["--data", cows.to_str().unwrap()],
        "class cow not among the run's classes (classes.json: cat, dog, fish)",
    );
    // Weights of another architecture.
    let mlp = t.dir().join("mlp.safetensors");
    tch::Tensor::write_safetensors(&[("0.weight", tch::Tensor::zeros([2, 2], tch::kind::FLOAT_CPU))], &mlp).unwrap();
    bad(&["--checkpoint", mlp.to_str().unwrap()], "does not match the model");
    bad(&["--checkpoint", "/no/such/model.safetensors"], "no such file");
    // export reads weights the same way: the other architecture's are refused, nothing written.
    let out = t.dir().join("exported");
    t.clone()
        .command("export")
        .no_spec()
        .args(&[
            dir.as_str(),
            "--checkpoint",
            mlp.to_str().unwrap(),
            "--format",
            "timm",
            out.to_str().unwrap(),
        ])
        .exit(2)
        .stderr_has("does not match the model")
        .run();
    assert!(!out.exists(), "export wrote {}", out.display());
    eval(&t, &[t.dir().to_str().unwrap()])
        .exit(2)
        .stderr_has("is not a run directory")
        .run();
}

/// A run whose encoder layers streamed from host memory (`memory.parameters = "host"`) under a
/// cap smaller than its weights (8 layers of width 128: 4.14 MiB of fp32 weights, a 3 MiB
/// cap): eval streams them the same way under that cap (also where only the checkpoint's state
/// says the run streamed), with the run's figures, and those of the whole model evaluated
/// without the cap, bit for bit.
#[test]
fn a_streamed_run_is_evaluated_under_its_cap_as_the_whole_model() {
    let t = Test::new();
    let run = t
        .clone()
        .name("streamed")
        .spec(table(
            "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\npreset = \"vit\"\n\
             [model.vit]\nimage_size = 16\npatch_size = 8\nlayers = 8\nheads = 4\nhidden_dim = 128\nmlp_dim = 256\nnum_classes = 4\n\
             [data]\nsource = \"synthetic\"\nsamples = 24\nval_fraction = 0.25\n\
             [train]\nepochs = 1\nbatch_size = 2\noptimizer = \"adamw\"\nlr = 0.001\n\
             [memory]\nparameters = \"host\"\nlimit = \"3MiB\"\n[log]\nprogress = \"off\"\n",
        ))
        .run();
    let last = run.epochs().pop().expect("an epoch record");
    let dir = run.out.display().to_string();
    let newest = final_model(&run.out);
    let newest = newest.to_str().unwrap();
    eval(&t, &[&dir, "--checkpoint", newest]).run();
    let r = report(&run.out.join("eval.json"));
    assert_eq!(r.samples, 6, "a quarter of 24");
    assert_the_runs_figures(&r, &last);

    // The same weights read by a run directory whose spec keeps them on the device.
    let elsewhere = |name: &str, drop: &[&str]| respecced(&run.out, &t.dir().join(name), drop);
    let whole = elsewhere("whole", &["parameters =", "limit ="]);
    let whole_json = t.dir().join("whole.json");
    eval(
        &t,
        &[&whole, "--checkpoint", newest, "--json", whole_json.to_str().unwrap()],
    )
    .run();
    let w = report(&whole_json);
    assert_eq!(r.loss.to_bits(), w.loss.to_bits(), "{} vs {}", r.loss, w.loss);
    assert_eq!(r.classes, w.classes);

    // A spec that does not say to stream, with the checkpoint's state naming the lever (as a
    // run whose memory policy engaged it records): streamed under the cap all the same.
    let capped = elsewhere("capped", &["parameters ="]);
    let capped_json = t.dir().join("capped.json");
    eval(
        &t,
        &[&capped, "--checkpoint", newest, "--json", capped_json.to_str().unwrap()],
    )
    .run();
    assert_eq!(report(&capped_json).loss.to_bits(), r.loss.to_bits());
    // The weights alone, under the same cap: the whole model does not fit, and streaming is
    // what keeps it under.
    let alone = t.dir().join("model.safetensors");
    std::fs::copy(newest, &alone).unwrap();
    eval(&t, &[&capped, "--checkpoint", alone.to_str().unwrap()])
        .exit(3)
        .stderr_has("out of memory")
        .run();
}
