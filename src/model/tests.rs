use super::*;

fn images(sample: &[i64]) -> DataImages<'_> {
    DataImages {
        sample,
        source: "data.source = \"cifar10\"".into(),
    }
}

fn option(m: &Model, preset: &str, key: &str) -> Option<i64> {
    m.options[preset].get(key).and_then(toml::Value::as_integer)
}

#[test]
fn classifiers_follow_the_datas_classes_unless_told_otherwise() {
    let three = DataClasses::Named(vec!["a".into(), "b".into(), "c".into()]);
    let data = Data::default();
    let mut m = model("resnet18", "image_size = 32");
    assert!(follow_classes("resnet18", &mut m, &three, "here").is_empty());
    assert_eq!(option(&m, "resnet18", "num_classes"), Some(3));
    assert_eq!(class_notice(&m, &three, &data), None);
    // Set above the data's: kept, and said.
    let mut m = model("vit", "num_classes = 1000");
    assert!(follow_classes("vit", &mut m, &three, "here").is_empty());
    let notice = class_notice(&m, &three, &data).unwrap();
    assert!(
        notice.contains("997 of the head's outputs belong to no sample"),
        "{notice}"
    );
    // Set below: refused, naming both.
    let mut m = model("mlp", "num_classes = 2");
    let p = follow_classes("mlp", &mut m, &DataClasses::Range(10), "here");
    assert_eq!(p[0].0, "model.mlp.num_classes");
    assert!(p[0].1.contains("is 2, but the data has labels 0 to 9"), "{p:?}");
    // One class cannot make a classifier; a value of the wrong type is the preset's to say.
    let mut m = model("mlp", "");
    assert_eq!(follow_classes("mlp", &mut m, &DataClasses::Range(1), "here").len(), 1);
    let mut m = model("mlp", "num_classes = \"x\"");
    assert!(follow_classes("mlp", &mut m, &three, "here").is_empty());
    // A TorchScript module's width is its own.
    let m = model("torchscript", "num_classes = 1000");
    assert_eq!(class_notice(&m, &three, &data), None);
}

#[test]
fn image_models_follow_the_data_unless_told_otherwise() {
    // Left out: taken from the data, channels too.
    let mut m = model("resnet18", "num_classes = 10");
    assert!(follow_data("resnet18", &mut m, &images(&[3, 32, 32])).is_empty());
    assert_eq!(option(&m, "resnet18", "image_size"), Some(32));
    assert_eq!(option(&m, "resnet18", "in_channels"), Some(3));
    assert!(validate(&mut m, &Data::default()).is_empty());
    // No [model.resnet18] table at all.
    let mut bare = Model {
        preset: "resnet18".into(),
        init_from: None,
        init_format: Default::default(),
        init_skip: vec![],
        options: Default::default(),
    };
    assert!(follow_data("resnet18", &mut bare, &images(&[1, 28, 28])).is_empty());
    assert_eq!(option(&bare, "resnet18", "in_channels"), Some(1));
    // An imagefolder tree decodes to the model's channels: only the size follows.
    let mut m = model("resnet18", "in_channels = 1");
    assert!(follow_data("resnet18", &mut m, &images(&[0, 64, 64])).is_empty());
    assert_eq!(option(&m, "resnet18", "in_channels"), Some(1));
    assert_eq!(option(&m, "resnet18", "image_size"), Some(64));
    // Set and agreeing: fine; set and disagreeing: both sizes and the key to change.
    let mut m = model("resnet34", "image_size = 32");
    assert!(follow_data("resnet34", &mut m, &images(&[3, 32, 32])).is_empty());
    let mut m = model("resnet50", "image_size = 224");
    let p = follow_data("resnet50", &mut m, &images(&[3, 32, 32]));
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].0, "model.resnet50.image_size");
    assert!(p[0].1.contains("is 224, but the data's images are 32×32"), "{p:?}");
    assert!(p[0].1.contains("set it to 32"), "{p:?}");
    let mut m = model("vit", "in_channels = 1");
    let p = follow_data("vit", &mut m, &images(&[3, 32, 32]));
    assert_eq!(p[0].0, "model.vit.in_channels", "{p:?}");
    // A ViT's patches must tile the data's images.
    let mut m = model("vit", "patch_size = 8");
    assert!(follow_data("vit", &mut m, &images(&[3, 32, 32])).is_empty());
    let mut m = model("vit", "patch_size = 5");
    let p = follow_data("vit", &mut m, &images(&[3, 32, 32]));
    assert_eq!(p[0].0, "model.vit.patch_size");
    assert!(p[0].1.contains("does not tile the data's 32×32 images"), "{p:?}");
    assert!(p[0].1.contains("(2, 4, 8, 16)"), "{p:?}");
    // The default patch (16) does not tile 28×28.
    let mut m = model("vit", "");
    assert_eq!(
        follow_data("vit", &mut m, &images(&[1, 28, 28]))[0].0,
        "model.vit.patch_size"
    );
    // Samples that are not square images leave the model as configured.
    let mut m = model("resnet18", "");
    assert!(follow_data("resnet18", &mut m, &images(&[64])).is_empty());
    assert_eq!(option(&m, "resnet18", "image_size"), None);
    let p = follow_data("resnet18", &mut m, &images(&[3, 32, 48]));
    assert!(p[0].1.contains("32×48"), "{p:?}");
}

fn model(preset: &str, options: &str) -> Model {
    let mut m = Model {
        preset: preset.into(),
        init_from: None,
        init_format: Default::default(),
        init_skip: vec![],
        options: Default::default(),
    };
    m.options
        .insert(preset.into(), toml::Value::Table(options.parse().unwrap()));
    m
}

/// torchvision's published parameter counts (torchvision.models docs, `num_params`).
#[test]
fn parameter_counts_equal_torchvision() {
    for (preset, options, params) in [
        ("resnet18", "num_classes = 1000", 11_689_512),
        ("resnet34", "num_classes = 1000", 21_797_672),
        ("resnet50", "num_classes = 1000", 25_557_032),
        ("vit", "num_classes = 1000", 86_567_656), // vit_b_16
    ] {
        let c = counts(&model(preset, options), &Default::default()).unwrap();
        assert_eq!(c.weights, params, "{preset}");
        assert_eq!(c.arch_weights, 0);
    }
    // The small stem is a 3×3 instead of a 7×7 convolution: 64·3·(49 − 9) fewer weights.
    let c = counts(
        &model("resnet18", "num_classes = 1000\nsmall_stem = true"),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(c.weights, 11_689_512 - 64 * 3 * 40);
    // resnet18's BatchNorm buffers: running mean and variance per channel plus one counter
    // per BatchNorm (20 of them).
    let c = counts(&model("resnet18", "num_classes = 10"), &Default::default()).unwrap();
    assert_eq!(c.buffers, 2 * 4800 + 20);
}

#[test]
fn chains_cover_every_residual_and_encoder_block() {
    let vs = nn::VarStore::new(Device::Cpu);
    let b = build(&vs.root(), &model("resnet50", "num_classes = 10\nimage_size = 32")).unwrap();
    assert_eq!(b.net.chain().unwrap().blocks(), 3 + 4 + 6 + 3 + 2);
    assert_eq!(b.input_shape, vec![3, 32, 32]);
    let vs = nn::VarStore::new(Device::Cpu);
    let b = build(
        &vs.root(),
        &model(
            "vit",
            "image_size = 32\npatch_size = 8\nlayers = 3\nheads = 2\nhidden_dim = 8\nmlp_dim = 16\nnum_classes = 5",
        ),
    )
    .unwrap();
    assert_eq!(b.net.chain().unwrap().blocks(), 3 + 2);
    let logits = b
        .net
        .forward_t(&tch::Tensor::zeros([2, 3, 32, 32], tch::kind::FLOAT_CPU), false);
    assert_eq!(logits.size(), vec![2, 5]);
    let names: Vec<String> = vs.variables().into_keys().collect();
    for n in [
        "conv_proj.weight",
        "class_token",
        "encoder.pos_embedding",
        "encoder.layers.encoder_layer_2.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_0.mlp.3.bias",
        "encoder.ln.weight",
        "heads.head.weight",
    ] {
        assert!(names.iter().any(|k| k == n), "{n} missing from {names:?}");
    }
}

/// Each block's variables are exactly those its forward uses: running block i alone with
/// the graph gives gradients to its own parameters and to no other block's, and in training
/// it changes only its own buffers.
#[test]
fn every_variable_belongs_to_the_one_block_that_uses_it() {
    for (preset, opts, shape) in [
        ("resnet18", "num_classes = 4\nimage_size = 16", [2, 3, 16, 16]),
        (
            "vit",
            "image_size = 16\npatch_size = 8\nlayers = 2\nheads = 2\nhidden_dim = 8\nmlp_dim = 16\nnum_classes = 4",
            [2, 3, 16, 16],
        ),
    ] {
        let vs = nn::VarStore::new(Device::Cpu);
        let b = build(&vs.root(), &model(preset, opts)).unwrap();
        let chain = b.net.chain().unwrap();
        let blocks = block_vars(chain, &vs).unwrap();
        assert_eq!(blocks.len(), chain.blocks());
        assert_eq!(blocks.iter().map(Vec::len).sum::<usize>(), vs.variables().len());
        let mut state = vec![tch::Tensor::randn(shape, tch::kind::FLOAT_CPU)];
        for (i, own) in blocks.iter().enumerate() {
            let before: Vec<(String, tch::Tensor)> = vs.variables().into_iter().map(|(n, t)| (n, t.copy())).collect();
            let ins: Vec<tch::Tensor> = state.iter().map(|t| t.detach()).collect();
            let outs = chain.block(i, &ins, true);
            outs.iter()
                .map(|o| o.sum(tch::Kind::Float))
                .sum::<tch::Tensor>()
                .backward();
            let own: Vec<&str> = own.iter().map(|(n, _)| n.as_str()).collect();
            for (n, t) in vs.variables() {
                let mine = own.contains(&n.as_str());
                if t.requires_grad() {
                    assert_eq!(t.grad().defined(), mine, "{preset} block {i}: {n}");
                    crate::shim::drop_grads(std::iter::once(&t)).unwrap();
                } else {
                    let old = &before.iter().find(|(m, _)| *m == n).unwrap().1;
                    if !mine {
                        assert!(t.equal(old), "{preset} block {i} changed {n}");
                    }
                }
            }
            state = outs.iter().map(|t| t.detach()).collect();
        }
    }
    let vs = nn::VarStore::new(Device::Cpu);
    let b = build(&vs.root(), &model("mlp", "inputs = 4\nnum_classes = 2")).unwrap();
    assert!(!blockwise(b.net.as_ref(), &vs), "the MLP has no blocks");
}

#[test]
fn vit_option_checks() {
    let m = model(
        "vit",
        "image_size = 30\npatch_size = 8\nheads = 5\nhidden_dim = 16\ndropout = 1.0",
    );
    let p = preset_named("vit").unwrap().validate(&m);
    let keys: Vec<&str> = p.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        ["model.vit.image_size", "model.vit.hidden_dim", "model.vit.dropout"],
        "{p:?}"
    );
}

/// A shape scope leaves the thread as it found it: once it closes, tensors are made on the CPU
/// again and ops on them run there (a multiply by a number, an add, a product), even when the
/// scope was the first to run them.
#[test]
fn a_shape_scope_leaves_the_threads_ops_on_the_cpu() {
    // A thread of its own: the first multiply by a number this thread runs is the meta one.
    std::thread::spawn(|| {
        {
            let _shapes = crate::shim::ShapeScope::enter().unwrap();
            let m = tch::Tensor::randn([2], (tch::Kind::Float, Device::Cpu));
            assert!(!matches!((&m * 0.02).device(), Device::Cpu), "inside: shapes only");
        }
        let r = tch::Tensor::randn([2], (tch::Kind::Float, Device::Cpu));
        for t in [&r * 0.02, &r + 0.5, &r * &r, r.to_kind(tch::Kind::BFloat16)] {
            assert_eq!(t.device(), Device::Cpu);
        }
    })
    .join()
    .unwrap();
}

/// Counting builds the model as meta tensors; the counts, the variables' shapes and the head
/// equal a plain build's for every preset, with adapters, frozen and streamed-resident parts.
#[test]
fn a_shapes_only_build_counts_what_a_plain_build_holds() {
    let llama = "vocab_size = 96\nhidden_size = 32\nintermediate_size = 48\nnum_hidden_layers = 2\n\
                 num_attention_heads = 4\nnum_key_value_heads = 2\nmax_position_embeddings = 64\nseq_len = 16";
    let mut cases = vec![
        model("mlp", "num_classes = 4"),
        model("resnet18", "num_classes = 3\nsmall_stem = true\nimage_size = 32"),
        model("resnet50", "num_classes = 10\nimage_size = 32"),
        model(
            "vit",
            "image_size = 32\npatch_size = 8\nlayers = 2\nheads = 2\nhidden_dim = 16\nmlp_dim = 32",
        ),
        model(
            "vit",
            "image_size = 32\npatch_size = 8\nlayers = 2\nheads = 2\nhidden_dim = 16\nmlp_dim = 32\n\
             pre_norm = true\nactivation = \"quick_gelu\"\npatch_bias = false\nprojection_dim = 8",
        ),
        model(
            "darts",
            "in_channels = 1\ninput_length = 64\nnum_classes = 5\ninit_channels = 4\nnum_cells = 3\nnum_nodes = 2",
        ),
        model("llama", llama),
        model(
            "llama",
            &format!("{llama}\ntie_word_embeddings = true\nqkv_bias = true"),
        ),
    ];
    for (i, targets) in [
        (6, "[\"q\", \"v\", \"down\"]"),
        (3, "[\"encoder_layer_0.self_attention.in_proj_q\", \"mlp.0\"]"),
    ] {
        let mut m = cases[i].clone();
        m.options.insert(
            lora::TABLE.into(),
            toml::Value::Table(format!("rank = 2\nalpha = 4.0\ntargets = {targets}").parse().unwrap()),
        );
        cases.push(m);
    }
    let train: crate::spec::schema::Train =
        toml::from_str("frozen_dtype = \"bf16\"\nprecision = \"bf16-mixed\"").unwrap();
    for m in &cases {
        let vs = nn::VarStore::new(Device::Cpu);
        let built = tch::no_grad(|| build(&vs.root(), m)).unwrap();
        let plain_vars = crate::weights::shapes(&vs.variables());
        let plain_head = built.head.clone();
        // Each tensor's count comes in the VarStore's (hash) order.
        let sorted = |mut c: Counts| {
            c.weight_sizes.sort();
            c
        };
        let plain = sorted(counts_of(vs, built, m, &train).unwrap());
        assert_eq!(
            sorted(counts(m, &train).unwrap()),
            plain,
            "{}: {:?}",
            m.preset,
            m.options
        );
        let (vars, head) = variables(m).unwrap();
        assert_eq!((vars, head), (plain_vars, plain_head), "{}", m.preset);
    }
    // Nothing was stored: a Llama-8B shape counts in a moment with no memory to speak of.
    let before = crate::shim::cpu_alloc_stats().allocated;
    let big = model(
        "llama",
        "vocab_size = 128256\nhidden_size = 4096\nintermediate_size = 14336\nnum_hidden_layers = 32\n\
         num_attention_heads = 32\nnum_key_value_heads = 8\nmax_position_embeddings = 131072\nseq_len = 2048",
    );
    let c = counts(&big, &Default::default()).unwrap();
    assert_eq!(c.weights, 8_030_261_248);
    assert!(crate::shim::cpu_alloc_stats().allocated < before + (64 << 20));
}
