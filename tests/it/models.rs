//! The models people train: torchvision's ResNet and ViT, the user's own TorchScript module, on
//! image data, against PyTorch itself (torch 2.11 and torchvision 0.26 from the bootstrap
//! environment) where there is a reference to compare with.
use crate::common::*;
use toml::Value;

/// A job on `data` (a TOML `[data]` body) for the model `[model]` body, trained with SGD and
/// momentum, accumulation and clipping, one thread, every step recorded.
fn job(model: &str, data: &str) -> Test {
    Test::new().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\n{model}\n[data]\n{data}\n\
         [train]\nepochs = 2\nbatch_size = 2\naccumulation_steps = 2\noptimizer = \"sgd\"\nlr = 0.05\n\
         momentum = 0.9\ngrad_clip_norm = 1.0\n[log]\nevery_steps = 1\nprogress = \"off\"\n"
    )))
}

fn tiny_resnet() -> &'static str {
    "preset = \"resnet18\"\n[model.resnet18]\nnum_classes = 4\nimage_size = 16"
}

fn tiny_vit() -> &'static str {
    "preset = \"vit\"\n[model.vit]\nimage_size = 16\npatch_size = 8\nlayers = 2\nheads = 2\nhidden_dim = 16\n\
     mlp_dim = 32\ndropout = 0.1\nattention_dropout = 0.1\nnum_classes = 4"
}

fn scripted(dir: &std::path::Path) -> String {
    reference(dir, &["script", "--out", "model.pt", "--classes", "4"]);
    format!(
        "preset = \"torchscript\"\n[model.torchscript]\npath = \"{}\"\ninput_shape = [3, 16, 16]\nnum_classes = 4",
        dir.join("model.pt").display()
    )
}

const SYNTHETIC: &str = "source = \"synthetic\"\nsamples = 20\nval_fraction = 0.2";

/// Random images in d.npz (16) and v.npz (4), written by the reference script.
fn npz_data(dir: &std::path::Path, shape: &str) -> String {
    reference(
        dir,
        &[
            "data",
            "--out",
            "d.npz",
            "--n",
            "16",
            "--shape",
            shape,
            "--classes",
            "4",
        ],
    );
    reference(
        dir,
        &[
            "data",
            "--out",
            "v.npz",
            "--n",
            "4",
            "--shape",
            shape,
            "--classes",
            "4",
            "--seed",
            "1",
        ],
    );
    format!(
        "source = \"npz\"\npath = \"{}\"\nval_path = \"{}\"",
        dir.join("d.npz").display(),
        dir.join("v.npz").display()
    )
}

/// The reference training of the same job, as `reference.py train` arguments.
const REFERENCE_TRAIN: &[&str] = &[
    "--train",
    "d.npz",
    "--epochs",
    "2",
    "--batch-size",
    "2",
    "--accumulation-steps",
    "2",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--momentum",
    "0.9",
    "--clip",
    "1.0",
    "--seed",
    "3",
];

/// torchvision's resnet18 `state_dict` names, written out from its layout: stem, four layers of
/// two BasicBlocks (the first block of layers 2–4 with a downsample), fc.
fn torchvision_resnet18_names() -> Vec<String> {
    let bn = |p: &str| {
        ["weight", "bias", "running_mean", "running_var", "num_batches_tracked"]
            .iter()
            .map(|s| format!("{p}.{s}"))
            .collect::<Vec<_>>()
    };
    let mut names = vec!["conv1.weight".to_string()];
    names.extend(bn("bn1"));
    for layer in 1..=4 {
        for block in 0..2 {
            let p = format!("layer{layer}.{block}");
            names.push(format!("{p}.conv1.weight"));
            names.extend(bn(&format!("{p}.bn1")));
            names.push(format!("{p}.conv2.weight"));
            names.extend(bn(&format!("{p}.bn2")));
            if layer > 1 && block == 0 {
                names.push(format!("{p}.downsample.0.weight"));
                names.extend(bn(&format!("{p}.downsample.1")));
            }
        }
    }
    names.push("fc.weight".into());
    names.push("fc.bias".into());
    names
}

#[test]
fn resnet18_loads_a_torchvision_state_dict_and_trains_as_torchvision_does() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let info = torchvision_init(&dir, "resnet18", "4");
    let tv_names: Vec<String> = info["names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        tv_names,
        torchvision_resnet18_names(),
        "torchvision's names are the ones written here"
    );

    let data = npz_data(&dir, "3,16,16");
    let r = job(tiny_resnet(), &data)
        .set("model.init_from", dir.join("init.safetensors").display().to_string())
        .run();
    // The checkpoint holds exactly torchvision's names.
    let mut ours: Vec<String> = tensors(&r.final_model()).into_iter().map(|(n, _)| n).collect();
    let mut theirs = tv_names.clone();
    ours.sort();
    theirs.sort();
    assert_eq!(ours, theirs);

    let mut args = vec!["train", "--model", "torchvision:resnet18:init.safetensors"];
    args.extend_from_slice(REFERENCE_TRAIN);
    // reference.py's output (PyTorch's losses and buffers), JSON from Python, not memtrain's
    // records; so is torchvision_init's.
    let py: serde_json::Value = serde_json::from_str(&reference(&dir, &args)).unwrap();
    let theirs = floats(&py["losses"]);
    assert_eq!(theirs.len(), 8);
    // The same ops on the same values; the last digits differ only in how the loss is summed.
    assert_close(&step_losses(&r), &theirs, 1e-5);
    let final_state = tensors(&r.final_model());
    let get = |n: &str| final_state.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let rm: Vec<f64> = Vec::<f32>::try_from(get("layer1.0.bn1.running_mean"))
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect();
    let prm = floats(&py["buffers"]["layer1.0.bn1.running_mean"]);
    for (a, b) in rm.iter().zip(&prm) {
        assert!((a - b).abs() <= 1e-4 * b.abs().max(1e-3), "running_mean {a} vs {b}");
    }
    assert_eq!(
        get("bn1.num_batches_tracked").int64_value(&[]),
        16,
        "one per micro-batch, as PyTorch counts"
    );
    assert_eq!(py["buffers"]["bn1.num_batches_tracked"][0], 16);
}

/// memtrain's vit preset with the sizes of torchvision's
/// `VisionTransformer(image, patch, layers, heads, hidden, mlp, num_classes=classes)`, built on
/// the CPU, and its variables' names.
fn vit_preset(sizes: [i64; 7]) -> (tch::nn::VarStore, memtrain::model::Built, Vec<String>) {
    let [image_size, patch_size, layers, heads, hidden_dim, mlp_dim, num_classes] = sizes;
    let options = format!(
        "image_size = {image_size}\npatch_size = {patch_size}\nlayers = {layers}\nheads = {heads}\n\
         hidden_dim = {hidden_dim}\nmlp_dim = {mlp_dim}\nnum_classes = {num_classes}"
    );
    let mut model = memtrain::spec::Model {
        preset: "vit".into(),
        init_from: None,
        init_format: Default::default(),
        init_skip: vec![],
        options: Default::default(),
    };
    model
        .options
        .insert("vit".into(), Value::Table(options.parse().unwrap()));
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), &model).unwrap();
    let mut names: Vec<String> = vs.variables().into_keys().collect();
    names.sort();
    (vs, built, names)
}

fn json_names(v: &serde_json::Value) -> Vec<String> {
    let mut n: Vec<String> = v["names"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap().to_owned())
        .collect();
    n.sort();
    n
}

/// Writes torchvision's `VisionTransformer` at `sizes` (image, patch, layers, heads, hidden,
/// mlp, classes) with one input and its logits, loads it into the vit preset through
/// `model.init_from` and checks the names, the parameter count and the logits.
fn torchvision_vit_logits(dir: &std::path::Path, sizes: [&str; 7]) {
    let mut args = vec!["vit"];
    for (flag, v) in [
        "--image-size",
        "--patch-size",
        "--layers",
        "--heads",
        "--hidden",
        "--mlp",
        "--classes",
    ]
    .iter()
    .zip(sizes)
    {
        args.extend([*flag, v]);
    }
    args.extend(["--out", "init.safetensors", "--logits", "io.safetensors"]);
    let info: serde_json::Value = serde_json::from_str(&reference(dir, &args)).unwrap();

    let (vs, built, ours) = vit_preset(sizes.map(|s| s.parse().unwrap()));
    assert_eq!(ours, json_names(&info), "the preset's names are torchvision's");
    let numel: i64 = vs.variables().values().map(|t| t.numel() as i64).sum();
    assert_eq!(numel, info["parameters"].as_i64().unwrap());
    // Every tensor matched: init_from refuses a file with a name missing or mis-shaped, and
    // counts what it created fresh and what it dropped.
    let load = memtrain::run::init_from(&vs, &built.head, &Default::default(), &dir.join("init.safetensors")).unwrap();
    assert_eq!((load.created, load.dropped), (0, 0), "every tensor matched: {load:?}");
    let io = tensors(&dir.join("io.safetensors"));
    let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let theirs = get("logits");
    let logits = tch::no_grad(|| built.net.forward_t(&get("x"), false));
    assert_eq!(logits.size(), theirs.size());
    let gap = (&logits - &theirs).abs().max().double_value(&[]);
    let scale = theirs.abs().max().double_value(&[]);
    eprintln!("vit {sizes:?}: logits differ from torchvision's by at most {gap:e} (largest logit {scale})");
    assert!(scale > 0.1, "the logits are not trivially zero ({scale})");
    assert!(
        gap <= 1e-5 * scale,
        "memtrain's logits differ from torchvision's by {gap} (scale {scale})"
    );
}

/// A state dict of torchvision's `VisionTransformer` (the constructor vit_b_16, vit_l_16 and
/// vit_h_14 call, here at a small size) loads through `model.init_from` into the vit preset with
/// every tensor matched, and the preset's forward then gives torchvision's logits. ViT-L/16's
/// own names (from a meta-device build: nothing allocated) are the same set as the preset's at
/// its depth, and vit_l_16 is that constructor at its sizes: so a torchvision ViT-L/16 checkpoint
/// loads into `configs/vit_l16_4gb.toml`'s model. At full size (304M parameters) the same check
/// is too heavy for the suite.
#[test]
fn vit_loads_a_torchvision_state_dict_and_gives_its_logits() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    torchvision_vit_logits(&dir, ["32", "8", "3", "2", "16", "24", "5"]);

    // ViT-L/16: torchvision's names at 24 layers are the preset's at 24 layers (names do not
    // depend on the width, so a narrow build stands in for the 304M-parameter one).
    let l16: serde_json::Value = serde_json::from_str(&reference(&dir, &["vit-names", "--model", "vit_l_16"])).unwrap();
    assert_eq!(l16["constructor"], serde_json::json!([224, 16, 24, 16, 1024, 4096]));
    assert_eq!(
        l16["same_as_constructor"], true,
        "vit_l_16 is VisionTransformer at its sizes"
    );
    assert_eq!(l16["parameters"], 304_326_632);
    let (_, _, ours) = vit_preset([16, 8, 24, 2, 16, 24, 1000]);
    assert_eq!(ours, json_names(&l16));
}

/// The same at ViT-L/16's full size (304M parameters, about 4 GiB of memory between the two
/// sides, a minute on a 2-core CPU): not in the suite; run it with
/// `cargo test --release --test it -- --ignored models::vit_l16_full_size`.
#[test]
#[ignore = "ViT-L/16 at full size: 304M parameters, too heavy for the suite"]
fn vit_l16_full_size_loads_torchvision_weights_and_gives_their_logits() {
    let t = Test::new();
    torchvision_vit_logits(t.dir(), ["224", "16", "24", "16", "1024", "4096", "1000"]);
}

#[test]
fn torchscript_model_trains_as_plain_pytorch_and_its_batchnorm_survives_a_resume() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let model = scripted(&dir);
    let data = npz_data(&dir, "3,16,16");
    let straight = job(&model, &data).name("straight").run();

    let mut args = vec!["train", "--model", "script:model.pt"];
    args.extend_from_slice(REFERENCE_TRAIN);
    let py: serde_json::Value = serde_json::from_str(&reference(&dir, &args)).unwrap();
    let theirs = floats(&py["losses"]);
    assert_close(&step_losses(&straight), &theirs, 1e-6);

    // Buffers are part of the model: checkpointed, and equal to the eager module's.
    let state = tensors(&straight.final_model());
    for name in ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"] {
        let ours = state
            .iter()
            .find(|(k, _)| k == name)
            .unwrap_or_else(|| panic!("{name} is checkpointed"))
            .1
            .to_kind(tch::Kind::Double);
        let ours: Vec<f64> = Vec::<f64>::try_from(ours.flatten(0, -1)).unwrap();
        let theirs = floats(&py["buffers"][name]);
        assert_eq!(ours.len(), theirs.len());
        for (a, b) in ours.iter().zip(&theirs) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{name}: {a} vs {b}");
        }
    }

    // Interrupted after step 3 of 8 and resumed: byte-identical weights and statistics.
    let first = job(&model, &data)
        .name("resumed")
        .interrupt_after_step(3)
        .exit(130)
        .run();
    let resumed = first.resume().run();
    assert_eq!(resumed.final_bytes(), straight.final_bytes());
}

#[test]
fn torchscript_input_errors_exit_2_before_training() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let model = scripted(&dir);
    std::fs::write(dir.join("junk.pt"), b"not a module").unwrap();
    let junk = model.replace(
        &dir.join("model.pt").display().to_string(),
        &dir.join("junk.pt").display().to_string(),
    );
    job(&junk, SYNTHETIC)
        .name("junk")
        .exit(2)
        .stderr_has("is not a TorchScript module")
        .stderr_has("torch.jit.script(model).save(path)")
        .run();
    job(&model.replace("num_classes = 4", "num_classes = 7"), SYNTHETIC)
        .name("classes")
        .exit(2)
        .stderr_has("forward returned")
        .stderr_has("[2, 7]")
        .run();
    for (flag, says) in [
        ("--pair", "make forward return one tensor of logits"),
        ("--frozen", "the model has no trainable parameters"),
    ] {
        reference(&dir, &["script", "--out", "other.pt", "--classes", "4", flag]);
        let other = job(&model.replace("model.pt", "other.pt"), SYNTHETIC)
            .name(&flag[2..])
            .exit(2)
            .stderr_has(says)
            .run();
        assert!(!other.out.exists(), "{flag}: nothing is written before training");
    }
    job(&model.replace("[3, 16, 16]", "[5, 16, 16]"), SYNTHETIC)
        .name("shape")
        .exit(2)
        .stderr_has("forward failed on a sample batch of shape [2, 5, 16, 16]")
        .run();
    job(&model.replace("path = ", "paths = "), SYNTHETIC)
        .name("key")
        .exit(2)
        .stderr_has("model.torchscript.paths")
        .run();
    for name in ["junk", "classes", "shape", "key"] {
        assert!(!dir.join(name).exists(), "{name}: nothing written for bad input");
    }
    // A scripted module is no chain of blocks: checkpointing is refused with a reason, the run goes on.
    job(&model, SYNTHETIC)
        .name("ckpt")
        .set("train.activation_checkpointing", true)
        .stderr_has("activation checkpointing does not apply")
        .run();
}

fn presets(dir: &std::path::Path) -> Vec<(&'static str, String)> {
    vec![
        ("resnet18", tiny_resnet().to_owned()),
        ("vit", tiny_vit().to_owned()),
        ("torchscript", scripted(dir)),
    ]
}

#[test]
fn new_presets_train_under_every_precision_with_and_without_checkpointing() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    for (preset, model) in presets(&dir) {
        for precision in ["fp32", "fp16-mixed", "bf16-mixed", "bf16"] {
            let mut losses = vec![];
            for ckpt in [false, true] {
                let r = job(&model, SYNTHETIC)
                    .name(&format!("{preset}-{precision}-{ckpt}"))
                    .set("train.epochs", 1)
                    .set("train.precision", precision)
                    .set("train.activation_checkpointing", ckpt)
                    .run();
                let s = r.summary();
                assert_eq!(s.status, Status::Completed, "{preset} {precision} {ckpt}");
                let l = step_losses(&r);
                assert_eq!(l.len(), 4);
                assert!(l.iter().all(|x| x.is_finite()), "{preset} {precision}: {l:?}");
                losses.push(l);
            }
            if preset != "torchscript" && precision == "fp32" {
                // Recomputed blocks (dropout included) compute exactly what the plain forward does.
                assert_eq!(losses[0], losses[1], "{preset}: checkpointed losses differ");
            }
        }
    }
}

/// oneDNN's bf16 backward-weights convolution leaves the gradient of taps that meet only padding
/// unwritten (layer4's stride-2 3×3 convolution on a 1×1 map, at 16 pixels), and with glibc's
/// thresholds warmed its buffer is recycled heap memory. `MALLOC_PERTURB_` fills every block
/// malloc hands out with one byte, so what an unwritten value holds is set from outside: 0x7f
/// (from 128) makes bf16's largest finite value, whose square is inf, 0x5a another number. The
/// runs must agree bit for bit, and stay finite. Without `layers::Conv`'s zeroed taps the first
/// runs to NaN. On CPUs without AVX512-BF16 oneDNN picks another kernel and this passes anyway.
#[test]
fn bf16_resnet_reads_no_unwritten_gradient() {
    for precision in ["bf16-mixed", "bf16"] {
        let runs: Vec<Vec<f64>> = ["128", "165"]
            .into_iter()
            .map(|perturb| {
                let r = job(tiny_resnet(), SYNTHETIC)
                    .name(&format!("{precision}-{perturb}"))
                    .set("train.epochs", 1)
                    .set("train.precision", precision)
                    .env("MALLOC_PERTURB_", perturb)
                    .run();
                step_losses(&r)
            })
            .collect();
        assert!(runs.iter().flatten().all(|x| x.is_finite()), "{precision}: {runs:?}");
        assert_eq!(
            runs[0], runs[1],
            "{precision}: the losses depend on uninitialised memory"
        );
    }
}

/// Preflight peak of a one-epoch run at `micro` samples per micro-batch.
fn peak(t: Test, micro: i64) -> u64 {
    let r = t
        .set("train.batch_size", micro)
        .set("train.accumulation_steps", 1)
        .set("train.epochs", 1)
        .run();
    r.preflights()[0].peak_bytes
}

#[test]
fn new_presets_back_off_under_a_cap() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    // Models whose activations at 16 samples outweigh the optimizer step's transient memory.
    let models = [
        (
            "resnet18",
            tiny_resnet().replace("image_size = 16", "image_size = 32\nsmall_stem = true"),
        ),
        (
            "vit",
            tiny_vit()
                .replace("image_size = 16", "image_size = 32")
                .replace("patch_size = 8", "patch_size = 4"),
        ),
        ("torchscript", scripted(&dir)),
    ];
    for (preset, model) in models {
        let base = job(&model, "source = \"synthetic\"\nsamples = 40\nval_fraction = 0.2");
        let big = peak(base.clone().name(&format!("{preset}-big")), 16);
        let small = peak(base.clone().name(&format!("{preset}-small")), 2);
        assert!(big > small, "{preset}: {big} <= {small}");
        let cap = small + (big - small) / 2;
        let r = base
            .name(&format!("{preset}-capped"))
            .set("train.batch_size", 16)
            .set("train.accumulation_steps", 1)
            .set("train.epochs", 1)
            .set("memory.limit", Value::from(cap as i64))
            .set("memory.on_oom", Value::Array(vec!["backoff".into(), "fail".into()]))
            .run();
        let s = r.summary();
        assert_eq!(s.status, Status::Completed, "{preset}");
        assert!(s.oom.of("backoffs") >= 1, "{preset}: {s:?}");
        assert_eq!(s.batch.effective_batch, 16);
        assert_eq!(s.samples_trained, 32);
    }
}

#[test]
fn augmented_images_resume_exactly() {
    let base = job(tiny_vit(), SYNTHETIC)
        .set(
            "data.augment",
            Value::Table(table("crop_padding = 2\nhorizontal_flip = true")),
        )
        .set("data.mean", Value::Array(vec![0.5.into()]))
        .set("data.std", Value::Array(vec![0.25.into()]));
    let straight = base.clone().name("straight").run();
    let plain = base.clone().name("plain").remove("data.augment").run();
    assert_ne!(
        step_losses(&straight),
        step_losses(&plain),
        "augmentation changes what is trained on"
    );
    let first = base.clone().name("resumed").interrupt_after_step(5).exit(130).run();
    let resumed = first.resume().run();
    assert_eq!(resumed.final_bytes(), straight.final_bytes());
}

/// CIFAR-10's binary layout with two random images per batch file: 10 training and 2
/// validation images of 3×32×32, in `dir/cifar`.
fn tiny_cifar(dir: &std::path::Path) -> String {
    let root = dir.join("cifar");
    std::fs::create_dir_all(&root).unwrap();
    let mut state = 7u64;
    let names = (1..=5)
        .map(|i| format!("data_batch_{i}.bin"))
        .chain(["test_batch.bin".into()]);
    for name in names {
        let mut bytes = vec![];
        for label in 0..2u8 {
            bytes.push(label);
            bytes.extend((0..3072).map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 56) as u8
            }));
        }
        std::fs::write(root.join(name), bytes).unwrap();
    }
    format!("source = \"cifar10\"\npath = \"{}\"", root.display())
}

#[test]
fn image_models_take_their_image_size_from_the_data() {
    let t = Test::new();
    let dir = t.dir().to_path_buf();
    let cifar = tiny_cifar(&dir);
    // No image_size, no in_channels: CIFAR-10's 3×32×32, in the resolved spec too.
    let r = job(
        "preset = \"resnet18\"\n[model.resnet18]\nnum_classes = 10\nsmall_stem = true",
        &cifar,
    )
    .name("resnet18")
    .set("train.epochs", 1)
    .run();
    assert_eq!(r.summary().status, Status::Completed);
    let resolved: toml::Table = std::fs::read_to_string(r.out.join("config.resolved.toml"))
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(resolved["model"]["resnet18"]["image_size"].as_integer(), Some(32));
    assert_eq!(resolved["model"]["resnet18"]["in_channels"].as_integer(), Some(3));
    // check resolves the same way, reading only the data's shape.
    let c = job("preset = \"resnet18\"\n[model.resnet18]\nnum_classes = 10", &cifar)
        .name("check")
        .command("check")
        .out(false)
        .run();
    assert!(c.stdout.contains("image_size = 32"), "{}", c.stdout);

    // A size the spec sets that the data contradicts: exit 2, naming both and the key.
    job(
        "preset = \"resnet18\"\n[model.resnet18]\nnum_classes = 10\nimage_size = 64",
        &cifar,
    )
    .name("disagrees")
    .exit(2)
    .stderr_has("model.resnet18.image_size is 64, but the data's images are 32×32")
    .stderr_has("leave image_size out to follow the data, or set it to 32")
    .run();
    // A ViT whose patches do not tile the data's images: exit 2, naming the patch size.
    job(
        "preset = \"vit\"\n[model.vit]\npatch_size = 5\nlayers = 1\nheads = 2\nhidden_dim = 8\nmlp_dim = 8\nnum_classes = 10",
        &cifar,
    )
    .name("vit-patch")
    .command("check")
    .out(false)
    .exit(2)
    .stderr_has("model.vit.patch_size is 5, which does not tile the data's 32×32 images")
    .run();
    // numpy's .npz, read from its header: a ViT on 16×16 images without image_size.
    let npz = npz_data(&dir, "3,16,16");
    let v = job(&tiny_vit().replace("image_size = 16\n", ""), &npz)
        .name("vit")
        .set("train.epochs", 1)
        .run();
    assert_eq!(v.summary().status, Status::Completed);
}

/// The vit preset with CLIP's options (`pre_norm`, `activation = "quick_gelu"`, `patch_bias =
/// false`, `layer_norm_eps = 1e-5`, `projection_dim`) is Hugging Face's CLIP vision tower: a
/// tiny `CLIPVisionModelWithProjection` with a head on its image embeddings, its weights under
/// the preset's names, gives the same logits through the preset's forward.
#[test]
fn vit_with_clip_options_gives_a_clip_vision_towers_logits() {
    let t = Test::new();
    let dir = t.dir();
    let out = std::process::Command::new(python())
        .arg(repo().join("tests/py/clip_vision.py"))
        .args(["--out", "init.safetensors", "--io", "io.safetensors"])
        .current_dir(dir)
        .env("OMP_NUM_THREADS", "1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let options: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let options: toml::Table = serde_json::from_value(options).unwrap();
    let mut model = memtrain::spec::Model {
        preset: "vit".into(),
        init_from: None,
        init_format: Default::default(),
        init_skip: vec![],
        options: Default::default(),
    };
    model.options.insert("vit".into(), Value::Table(options));
    let vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let built = memtrain::model::build(&vs.root(), &model).unwrap();
    assert!(
        !vs.variables().contains_key("conv_proj.bias"),
        "patch_bias = false leaves the patch embedding without a bias"
    );
    // Every tensor matched: a name missing on either side or a shape that differs is refused.
    let load = memtrain::run::init_from(&vs, &built.head, &Default::default(), &dir.join("init.safetensors")).unwrap();
    assert_eq!((load.created, load.dropped), (0, 0), "every tensor matched: {load:?}");
    let io = tensors(&dir.join("io.safetensors"));
    let get = |n: &str| io.iter().find(|(k, _)| k == n).unwrap().1.shallow_clone();
    let theirs = get("logits");
    let logits = tch::no_grad(|| built.net.forward_t(&get("x"), false));
    let gap = (&logits - &theirs).abs().max().double_value(&[]);
    let scale = theirs.abs().max().double_value(&[]);
    eprintln!("clip vision: logits differ from Hugging Face's by at most {gap:e} (largest logit {scale})");
    assert!(scale > 0.1, "the logits are not trivially zero ({scale})");
    assert!(gap <= 1e-5 * scale, "logits differ by {gap} (scale {scale})");
}
