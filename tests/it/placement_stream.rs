//! Parameters streamed by block (`memory.parameters = "host"`): the device holds only the blocks
//! in flight. Exact on the CPU (the same losses and final weights, byte for byte, as the run
//! without it), with a lower device peak, and a model whose weights alone exceed the cap trains
//! under it.
use crate::common::*;

/// A job for the `[model]` body on synthetic images, with accumulation and clipping, every
/// step recorded.
fn job(model: &str, optimizer: &str) -> Test {
    Test::new().spec(table(&format!(
        "[job]\nthreads = 1\ndevice = \"cpu\"\nseed = 3\n[model]\n{model}\n[data]\nsource = \"synthetic\"\n\
         samples = 24\nval_fraction = 0.25\n[train]\nepochs = 2\nbatch_size = 2\naccumulation_steps = 2\n\
         {optimizer}\ngrad_clip_norm = 1.0\noptimizer_impl = \"single\"\n[log]\nevery_steps = 1\nprogress = \"off\"\n"
    )))
}

const SGD: &str = "optimizer = \"sgd\"\nlr = 0.05\nmomentum = 0.9";
const ADAM: &str = "optimizer = \"adamw\"\nlr = 0.001\nweight_decay = 0.01";

/// Small, with dropout in every block.
fn vit() -> &'static str {
    "preset = \"vit\"\n[model.vit]\nimage_size = 16\npatch_size = 8\nlayers = 3\nheads = 2\nhidden_dim = 16\n\
     mlp_dim = 32\ndropout = 0.1\nattention_dropout = 0.1\nnum_classes = 4"
}

/// 8 encoder layers of width 128: 4.14 MiB of fp32 weights, most of it in the layers.
fn wide_vit() -> &'static str {
    "preset = \"vit\"\n[model.vit]\nimage_size = 16\npatch_size = 8\nlayers = 8\nheads = 4\nhidden_dim = 128\n\
     mlp_dim = 256\nnum_classes = 4"
}

/// `wide_vit`'s fp32 weights: 8 encoder layers of 132,480 values, the embedding's 25,472 and
/// the head's 772.
const WIDE_VIT_PARAM_BYTES: u64 = (8 * 132_480 + 25_472 + 772) * 4;
const WIDE_VIT_LAYER_BYTES: u64 = 132_480 * 4;

/// BatchNorm: its running statistics stream with their block and keep every update.
fn resnet() -> &'static str {
    "preset = \"resnet18\"\n[model.resnet18]\nnum_classes = 4\nimage_size = 16"
}

/// `resnet` with rank-4 adapters on its convolutions and `fc`, the rest frozen.
fn lora_resnet() -> String {
    format!(
        "{}\n[model.lora]\nrank = 4\nalpha = 8.0\ntargets = [\"conv1\", \"layer*.conv2\", \"downsample.0\", \"fc\"]",
        resnet()
    )
}

pub(crate) fn streamed(t: &Test) -> Test {
    t.clone().name("streamed").set("memory.parameters", "host")
}

pub(crate) fn peak(o: &Outcome) -> u64 {
    o.summary()
        .memory
        .peak_allocated_bytes
        .expect("the CPU's peak is counted")
}

#[test]
fn streamed_parameters_train_exactly_as_resident_ones_with_a_lower_device_peak() {
    for (model, opt) in [(vit(), SGD), (wide_vit(), ADAM), (resnet(), SGD)] {
        let t = job(model, opt);
        let plain = t.clone().name("plain").run();
        let s = streamed(&t).run();
        assert_eq!(step_losses(&s), step_losses(&plain), "{model}");
        assert_eq!(s.final_bytes(), plain.final_bytes(), "{model}: final weights differ");
        let sum = s.summary();
        assert_eq!(
            sum.last.as_ref().unwrap().val_acc,
            plain.summary().last.as_ref().unwrap().val_acc
        );
        assert!(
            sum.memory.peak_host_bytes.unwrap_or(0) > 0,
            "{model}: the parameters rest on the host"
        );
        let (p, q) = (peak(&plain), peak(&s));
        assert!(q < p, "{model}: device peak {q} streamed, {p} resident");
        let state = s.final_state();
        let levers: Vec<&str> = state["levers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(
            levers,
            ["recompute", "host_optimizer_state", "host_gradients", "host_parameters"],
            "{model}: what it comes with"
        );
    }
}

/// The wide ViT's weights are 4.14 MiB; a 3 MiB cap cannot hold them, nor the model being
/// built. Streamed, the device's peak is about two blocks' weights and their activations.
#[test]
fn weights_larger_than_the_cap_train_when_streamed() {
    let t = job(wide_vit(), ADAM).set("train.epochs", 1);
    let free = t.clone().name("free").run();
    let capped = streamed(&t).set("memory.limit", "3MiB").run();
    assert_eq!(capped.final_bytes(), free.final_bytes());
    assert_eq!(step_losses(&capped), step_losses(&free));
    let p = peak(&capped);
    assert!(p <= 3 << 20, "peak {p} under the cap");
    assert!(
        peak(&free) > (4 << 20) + p / 2,
        "resident: weights, gradients and state on the device ({} vs {p})",
        peak(&free)
    );
    t.clone()
        .name("resident")
        .set("memory.limit", "3MiB")
        .exit(3)
        .stderr_has("out of memory while building the model")
        .run();
}

#[test]
fn an_interrupted_streamed_run_resumes_exactly() {
    let t = streamed(&job(resnet(), SGD).set("train.epochs", 3));
    let straight = t.clone().name("straight").run();
    let first = t.clone().name("cut").interrupt_after_step(7).exit(130).run();
    let resumed = first.resume().stderr_has("resuming from").run();
    assert_eq!(resumed.summary().epochs_completed, 3);
    assert_eq!(resumed.final_bytes(), straight.final_bytes());
    // And the same as the run that never streamed.
    let plain = job(resnet(), SGD).set("train.epochs", 3).name("plain").run();
    assert_eq!(plain.final_bytes(), straight.final_bytes());
    // model.init_from loads into the host copies the model is built in.
    let init = plain.final_model().display().to_string();
    let from = job(resnet(), SGD).set("train.epochs", 1).set("model.init_from", init);
    let a = from.clone().name("from-plain").run();
    let b = streamed(&from).name("from-streamed").run();
    assert_eq!(a.final_bytes(), b.final_bytes());
    assert_ne!(a.final_bytes(), plain.final_bytes(), "it trained on from the file");
}

#[test]
fn presets_whose_variables_span_blocks_are_refused_and_check_says_what_it_does() {
    Test::new()
        .set("memory.parameters", "host")
        .exit(2)
        .stderr_has("memory.parameters")
        .stderr_has("the mlp preset cannot")
        .run();
    Test::darts()
        .set("memory.parameters", "host")
        .exit(2)
        .stderr_has("the darts preset cannot")
        .run();
    streamed(&job(vit(), SGD))
        .args(&["--nproc", "2"])
        .exit(2)
        .stderr_has("cannot be data-parallel")
        .stderr_has("train.shard_optimizer_state = true")
        .run();
    let check = job(wide_vit(), ADAM)
        .command("check")
        .set("memory.parameters", "host")
        .run();
    let out = &check.stdout;
    let line = out
        .lines()
        .find(|l| l.trim_start().starts_with("host_parameters"))
        .unwrap_or_else(|| panic!("no host_parameters line in {out}"));
    assert!(line.contains("on from the start (spec)"), "{line}");
    assert!(line.contains("4.14 MiB rest in host memory"), "{line}");
    for brought in ["recompute", "host_optimizer_state", "host_gradients"] {
        let l = out
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{brought} ")))
            .unwrap_or_else(|| panic!("no {brought} line in {out}"));
        assert!(l.contains("on from the start (spec)"), "it comes with streaming: {l}");
    }
}

/// An OOM with the other placements already on the host: "offload" streams the parameters
/// from then on, and the run ends as the one that never ran out of memory.
#[test]
fn an_oom_answered_by_offload_streams_the_parameters_from_then_on() {
    let t = job(wide_vit(), ADAM).set("train.epochs", 1);
    let others = ["optimizer_state", "gradients", "activations"]
        .iter()
        .fold(t.clone(), |t, k| t.set(&format!("memory.{k}"), "host"));
    let resident = others.clone().name("others").run();
    let streaming = streamed(&t).run();
    let (high, low) = (peak(&resident), peak(&streaming));
    // With everything else on the host, streaming takes the parameters off the device but for
    // the blocks in flight: about two encoder layers' weights (and one's gradients, which the
    // resident run has on the device too).
    let drop = high as i64 - low as i64;
    let (params, layer) = (WIDE_VIT_PARAM_BYTES as i64, WIDE_VIT_LAYER_BYTES as i64);
    assert!(
        drop >= params - 3 * layer && drop <= params,
        "device peak {high} -> {low}: dropped {drop}, parameters {params}, a layer {layer}"
    );
    // Room to build the model on the device, not to train it there.
    let setup = resident.starts()[0].setup_peak_allocated_bytes.unwrap();
    assert!(setup < high, "setup {setup}, step {high}");
    let cap = (setup + high) / 2;
    let r = others
        .clone()
        .name("offloaded")
        .set("memory.limit", cap as i64)
        .set(
            "memory.on_oom",
            toml::Value::Array(vec!["offload".into(), "fail".into()]),
        )
        .stderr_has("parameters rest in host memory")
        .run();
    let s = r.summary();
    assert_eq!(s.oom.engaged.get("parameter_offloads"), Some(&1), "{s:?}");
    assert_eq!(r.final_bytes(), resident.final_bytes());
    assert_eq!(step_losses(&r), step_losses(&resident));
}

/// Mixed precision casts each block's weights in a region of its own (its cast cache leaves
/// with the block), and bf16 streams bf16 weights: exact in each.
#[test]
fn streamed_parameters_stay_exact_in_every_precision() {
    for p in ["fp16-mixed", "bf16-mixed", "bf16"] {
        let t = job(vit(), SGD).set("train.precision", p);
        let plain = t.clone().name("plain").run();
        let s = streamed(&t).run();
        assert_eq!(step_losses(&s), step_losses(&plain), "{p}");
        assert_eq!(s.final_bytes(), plain.final_bytes(), "{p}: final weights differ");
    }
}

/// An OOM in the middle of a streamed step: every block goes back to the host as the error
/// unwinds, the step is retried at half the micro-batch, and the run equals one configured at
/// that shape from the start without streaming.
#[test]
fn a_streamed_step_that_runs_out_of_memory_backs_off_exactly() {
    let t = job(wide_vit(), ADAM)
        .set("train.epochs", 1)
        .set("data.samples", 48)
        .set("train.batch_size", 8)
        .set("train.accumulation_steps", 1);
    let (big, small) = (
        peak(&streamed(&t).name("at8").run()),
        peak(&streamed(&t).name("at4").set("train.batch_size", 4).run()),
    );
    assert!(small < big, "micro-batch 4 peaks at {small}, 8 at {big}");
    let r = streamed(&t)
        .name("backed-off")
        .set("memory.limit", ((small + big) / 2) as i64)
        .set(
            "memory.on_oom",
            toml::Value::Array(vec!["backoff".into(), "fail".into()]),
        )
        .run();
    let s = r.summary();
    assert_eq!(s.oom.engaged.get("backoffs"), Some(&1), "{s:?}");
    let plain = t
        .clone()
        .name("plain")
        .set("train.batch_size", 4)
        .set("train.accumulation_steps", 2)
        .run();
    assert_eq!(step_losses(&r), step_losses(&plain));
    assert_eq!(r.final_bytes(), plain.final_bytes());
}

/// "auto" is PyTorch's default where the state is on the device ("single" on the CPU) and
/// "fused" once it is on the host, which streaming brings; PyTorch's fused Adam and AdamW
/// kernels round otherwise than its single-tensor ones. So a streamed ResNet, whole or LoRA over a
/// frozen base, trains the unstreamed run's bytes with one implementation named on both sides,
/// and under "auto" the unstreamed "fused" run's: the forward is the same, the first update
/// differs by a rounding of the update, which a ResNet on two-image batch statistics amplifies.
#[test]
fn a_streamed_resnet_trains_the_bytes_of_the_optimizer_implementation_it_runs() {
    let run = |t: &Test, which: &str, name: &str| t.clone().set("train.optimizer_impl", which).name(name).run();
    for model in [resnet().to_string(), lora_resnet()] {
        let t = job(&model, ADAM);
        let mut plain = Vec::new();
        for which in ["single", "fused"] {
            let p = run(&t, which, &format!("plain-{which}"));
            let s = run(&streamed(&t), which, &format!("streamed-{which}"));
            assert_eq!(step_losses(&s), step_losses(&p), "{model}: {which}");
            assert_eq!(
                s.final_bytes(),
                p.final_bytes(),
                "{model}: {which}: final weights differ"
            );
            plain.push(p);
        }
        let s = run(&streamed(&t), "auto", "streamed-auto");
        let said = "Optimizer: adamw (fused implementation; train.optimizer_impl = \"auto\")";
        assert!(s.stdout.contains(said) || s.stderr.contains(said), "{}", s.stdout);
        assert_eq!(
            s.final_bytes(),
            plain[1].final_bytes(),
            "{model}: auto streamed is fused"
        );
        let p = run(&t, "auto", "plain-auto");
        assert_eq!(
            p.final_bytes(),
            plain[0].final_bytes(),
            "{model}: auto is single on the CPU"
        );
        let (a, b) = (step_losses(&s), step_losses(&p));
        assert_eq!(a[0], b[0], "{model}: the first loss comes before any update");
        assert_ne!(a, b, "{model}: fused and single round apart");
    }
    // One update (4 training samples, 2 x 2 a step): the weights differ by a rounding.
    let t = job(resnet(), ADAM).set("train.epochs", 1).set("data.samples", 5);
    let s = run(&streamed(&t), "auto", "streamed-one");
    let p = run(&t, "auto", "plain-one");
    assert_eq!(s.steps().len(), 1);
    let (a, b) = (tensors(&s.final_model()), tensors(&p.final_model()));
    let gap = a
        .iter()
        .zip(&b)
        .map(|((_, x), (_, y))| (x - y).abs().max().double_value(&[]))
        .fold(0.0, f64::max);
    assert!(gap > 0.0 && gap <= 2.4e-7, "largest weight difference {gap}");
}
