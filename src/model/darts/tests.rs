use super::*;
use tch::{nn::VarStore, Device};

fn opts(ops: &[&str]) -> DartsOptions {
    DartsOptions {
        in_channels: 2,
        input_length: 32,
        num_classes: 3,
        init_channels: 8,
        num_cells: 3,
        num_nodes: 2,
        ops: ops.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

#[test]
fn genotype_from_hand_set_alpha() {
    let ops = strings(&["none", "skip_connect", "conv_3"]);
    // 2 nodes: node 0 has edges 0 (s0), 1 (s1); node 1 has edges 2 (s0), 3 (s1), 4 (node 0).
    #[rustfmt::skip]
    let alpha = Tensor::from_slice(&[
        // none  skip  conv
        5.0f32, 1.0, 2.0, // e0: "none" strongest (ignored); conv 2.0
        0.0,   3.0, 0.0,  // e1: skip 3.0 (strongest)
        0.0,   0.5, 0.0,  // e2: skip, weak
        9.0,   0.0, 1.0,  // e3: "none" dominates; conv, but its softmax share is tiny
        0.0,   0.0, 4.0,  // e4: conv 4.0
    ])
    .view([5, 3]);
    let g = derive_genotype(&alpha, &ops, 2);
    // Node 0: e1 (skip, p≈0.9) then e0 (conv, p≈0.26).
    // Node 1: e4 (conv, p≈0.96), e2 (skip, p≈0.45) over e3 (conv, p≈0.0003).
    assert_eq!(
        g,
        vec![
            vec![("skip_connect".to_string(), 1), ("conv_3".to_string(), 0)],
            vec![("conv_3".to_string(), 2), ("skip_connect".to_string(), 0)],
        ]
    );
    // One node: two edges, both kept, strongest first.
    let alpha = Tensor::from_slice(&[0.0f32, 1.0, 0.0, 0.0, 0.0, 2.0]).view([2, 3]);
    assert_eq!(
        derive_genotype(&alpha, &ops, 1),
        vec![vec![("conv_3".to_string(), 1), ("skip_connect".to_string(), 0)]]
    );
}

fn check_forward_backward(ops: &[&str], batch: i64) {
    let vs = VarStore::new(Device::Cpu);
    let o = opts(ops);
    let net = Darts::new(&vs.root(), &o).unwrap();
    let x = Tensor::randn([batch, o.in_channels, o.input_length], (Kind::Float, Device::Cpu));
    let logits = net.forward_t(&x, true);
    assert_eq!(logits.size(), [batch, o.num_classes], "ops {ops:?}, batch {batch}");
    assert!(
        bool::try_from(logits.isfinite().all()).unwrap(),
        "ops {ops:?}: non-finite logits"
    );
    let target = Tensor::zeros([batch], (Kind::Int64, Device::Cpu));
    logits.cross_entropy_for_logits(&target).backward();
    for a in [&net.alpha_normal, &net.alpha_reduce] {
        let g = a.grad();
        assert!(g.defined(), "ops {ops:?}: no gradient on alpha");
        assert!(
            bool::try_from(g.isfinite().all()).unwrap(),
            "ops {ops:?}: non-finite alpha gradient"
        );
    }
    let eval = tch::no_grad(|| net.forward_t(&x, false));
    assert_eq!(eval.size(), [batch, o.num_classes]);
    assert!(bool::try_from(eval.isfinite().all()).unwrap());
    assert!(net.genotype().is_some());
}

#[test]
fn every_op_forward_and_backward() {
    for op in KNOWN_OPS.iter().filter(|o| **o != "none") {
        for batch in [2, 1] {
            check_forward_backward(&["none", op], batch);
        }
    }
}

#[test]
fn all_ops_together_and_odd_lengths() {
    let vs = VarStore::new(Device::Cpu);
    for (cells, len) in [(1, 9), (2, 11), (4, 13), (5, 17)] {
        let o = DartsOptions {
            num_cells: cells,
            input_length: len,
            ops: KNOWN_OPS.iter().map(|s| s.to_string()).collect(),
            ..opts(&[])
        };
        let net = Darts::new(&(vs.root() / format!("net{cells}")), &o).unwrap();
        let x = Tensor::randn([1, o.in_channels, len], (Kind::Float, Device::Cpu));
        assert_eq!(net.forward_t(&x, true).size(), [1, o.num_classes]);
    }
}

#[test]
fn arch_variable_names() {
    let vs = VarStore::new(Device::Cpu);
    let o = opts(&["none", "skip_connect", "sep_conv_3", "attention_light"]);
    let _net = Darts::new(&vs.root(), &o).unwrap();
    let vars = vs.variables();
    let arch: Vec<&String> = vars.keys().filter(|k| k.starts_with("arch.")).collect();
    assert_eq!(arch.len(), 2, "{arch:?}");
    for name in ["arch.alpha_normal", "arch.alpha_reduce"] {
        assert_eq!(vars[name].size(), [5, 4], "{name}");
        assert!(vars[name].requires_grad());
    }
    assert!(
        vars.keys().all(|k| !k.contains("__")),
        "duplicate names: {:?}",
        vars.keys()
    );
}

#[test]
fn deterministic_build() {
    let o = opts(&[
        "none",
        "skip_connect",
        "sep_conv_3",
        "dil_conv_3",
        "lstm",
        "attention",
        "disjoint_cnn_3x1",
    ]);
    let build = || {
        tch::manual_seed(0);
        let vs = VarStore::new(Device::Cpu);
        let _net = Darts::new(&vs.root(), &o).unwrap();
        vs
    };
    // The global RNG may be drawn from by tests running in parallel threads; retry a few times
    // before calling the build nondeterministic.
    let same = |a: &VarStore, b: &VarStore| {
        let (va, vb) = (a.variables(), b.variables());
        va.len() == vb.len() && va.iter().all(|(k, t)| vb.get(k).is_some_and(|u| t.equal(u)))
    };
    let ok = (0..5).any(|_| same(&build(), &build()));
    assert!(ok, "two builds after manual_seed(0) differ");
    let a = build();
    let mut names: Vec<String> = a.variables().into_keys().collect();
    names.sort();
    assert!(
        names.contains(&"cells.0.edges.0.sep_conv_3.dw1.weight".to_string()),
        "{names:?}"
    );
    assert!(names.contains(&"stem.conv.weight".to_string()));
    assert!(names.contains(&"classifier.weight".to_string()));
}

#[test]
fn bad_options_are_errors() {
    let vs = VarStore::new(Device::Cpu);
    for (o, needle) in [
        (opts(&["none"]), "besides"),
        (opts(&["none", "bogus"]), "unknown"),
        (opts(&["none", "conv_3", "conv_3"]), "twice"),
        (
            DartsOptions {
                init_channels: 6,
                ..opts(&["none", "attention"])
            },
            "heads",
        ),
        (
            DartsOptions {
                input_length: 2,
                ..opts(&["none", "conv_3"])
            },
            "too short",
        ),
        (
            DartsOptions {
                num_nodes: 0,
                ..opts(&["none", "conv_3"])
            },
            "num_nodes",
        ),
    ] {
        let e = Darts::new(&vs.root(), &o).unwrap_err().to_string();
        assert!(e.contains(needle), "{e}");
    }
}
