//! The optimizer against PyTorch's own numbers, and its state, sharding and clipping.
use super::*;

// Reference numbers from PyTorch, printed by scripts/optim_reference.py (torch 2.11.0):
// 3 steps, lr 0.1, of torch.optim.{SGD, Adam, AdamW} (foreach=False) on PARAM with GRADS.
const SGD_MOMENTUM: [f32; 6] = [0.4906404, -1.2373544, 0.27460745, 2.030573, -0.7709314, 0.15764679];
const SGD_NESTEROV: [f32; 6] = [0.50516343, -1.2499778, 0.28138798, 2.0263546, -0.79152334, 0.20146933];
const ADAM: [f32; 6] = [0.339019, -1.1630648, 0.20731245, 2.0902748, -0.81890184, 0.18155235];
const ADAMW: [f32; 6] = [0.340299, -1.1720663, 0.2084967, 2.0962877, -0.8199715, 0.18159024];
// The same for SGD_MOMENTUM and ADAM with bfloat16 parameters and grads (values widened to f32).
const SGD_MOMENTUM_BF16: [f32; 6] = [0.49023438, -1.234375, 0.27539062, 2.03125, -0.7734375, 0.15820312];
const ADAM_BF16: [f32; 6] = [0.33984375, -1.1640625, 0.20703125, 2.09375, -0.8203125, 0.18066406];
// foreach=True: in float32 the numbers above, bit for bit (the script checks); in bfloat16 these.
const SGD_MOMENTUM_FOREACH_BF16: [f32; 6] = [0.49023438, -1.234375, 0.27539062, 2.03125, -0.7734375, 0.15820312];
const SGD_NESTEROV_FOREACH_BF16: [f32; 6] = [0.50390625, -1.25, 0.28125, 2.03125, -0.7890625, 0.20117188];
const ADAM_FOREACH_BF16: [f32; 6] = [0.33984375, -1.1640625, 0.20703125, 2.09375, -0.8203125, 0.18066406];
const ADAMW_FOREACH_BF16: [f32; 6] = [0.34179688, -1.171875, 0.20996094, 2.09375, -0.82421875, 0.18066406];
// fused=True, in float32 and bfloat16.
const SGD_MOMENTUM_FUSED: [f32; 6] = [0.4906404, -1.2373544, 0.27460745, 2.030573, -0.7709314, 0.15764679];
const SGD_MOMENTUM_FUSED_BF16: [f32; 6] = [0.49023438, -1.234375, 0.27539062, 2.03125, -0.7734375, 0.15820312];
const SGD_NESTEROV_FUSED: [f32; 6] = [0.50516343, -1.2499778, 0.28138798, 2.0263546, -0.79152334, 0.20146933];
const SGD_NESTEROV_FUSED_BF16: [f32; 6] = [0.50390625, -1.25, 0.28125, 2.03125, -0.79296875, 0.20214844];
const ADAM_FUSED: [f32; 6] = [0.339019, -1.1630648, 0.20731245, 2.0902748, -0.81890184, 0.18155235];
const ADAM_FUSED_BF16: [f32; 6] = [0.33984375, -1.1640625, 0.20800781, 2.09375, -0.8203125, 0.18164062];
const ADAMW_FUSED: [f32; 6] = [0.340299, -1.1720663, 0.2084967, 2.0962877, -0.8199715, 0.18159024];
const ADAMW_FUSED_BF16: [f32; 6] = [0.34179688, -1.171875, 0.20898438, 2.09375, -0.8203125, 0.18164062];
// torch.nn.utils.clip_grad_norm_(max_norm=1.0) on CLIP_GRADS (and a param without grad).
const CLIP_TOTAL_NORM: [f32; 1] = [2.7789388];
const CLIP_GRAD0: [f32; 6] = [0.03598495, -0.0719699, 0.10795485, -0.1439398, 0.17992474, -0.2159097];
const CLIP_GRAD1: [f32; 3] = [0.53977424, -0.71969897, 0.26988712];

// The inputs, identical to scripts/optim_reference.py.
const PARAM: [f32; 6] = [0.5, -1.25, 0.3, 2.0, -0.7, 0.05];
const GRADS: [[f32; 6]; 3] = [
    [0.1, -0.2, 0.3, -0.4, 0.5, -0.6],
    [0.05, 0.15, -0.25, 0.35, -0.45, 0.55],
    [-0.3, 0.2, -0.1, 0.0, 0.25, -0.5],
];
const CLIP_GRADS: ([f32; 6], [f32; 3]) = ([0.1, -0.2, 0.3, -0.4, 0.5, -0.6], [1.5, -2.0, 0.75]);
const LR: f64 = 0.1;

fn hyper(kind: OptimizerKind, momentum: f64, nesterov: bool) -> Hyper {
    Hyper {
        kind,
        momentum,
        nesterov,
        weight_decay: 0.01,
        betas: [0.9, 0.999],
        eps: 1e-8,
        state_bits: 32,
        implementation: OptimizerImpl::Single,
    }
}

fn sgd() -> Hyper {
    hyper(OptimizerKind::Sgd, 0.9, false)
}
fn nesterov() -> Hyper {
    hyper(OptimizerKind::Sgd, 0.9, true)
}
fn adam() -> Hyper {
    hyper(OptimizerKind::Adam, 0.0, false)
}
fn adamw() -> Hyper {
    hyper(OptimizerKind::Adamw, 0.0, false)
}
fn with_8bit_state(h: Hyper) -> Hyper {
    Hyper { state_bits: 8, ..h }
}

fn leaf(values: &[f32], shape: &[i64]) -> Tensor {
    Tensor::from_slice(values).reshape(shape).set_requires_grad(true)
}

/// Makes `p.grad()` exactly `g`, through autograd like a real backward pass:
/// d/dp sum(p * g) = g, accumulated into a zeroed (or not yet defined) grad.
fn set_grad(p: &Tensor, g: &[f32]) {
    let g = Tensor::from_slice(g).reshape(p.size());
    (p * g).sum(Kind::Float).backward();
}

fn values(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(&t.detach().flatten(0, -1)).unwrap()
}

/// Largest |got - want|, asserting each is within 2e-7 relative (about one float32 ulp).
fn assert_close(what: &str, got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut max = 0f32;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = (g - w).abs();
        max = max.max(d);
        assert!(
            d <= 2e-7 * w.abs().max(1e-3),
            "{what}[{i}]: got {g:e}, PyTorch {w:e} (diff {d:e})"
        );
    }
    eprintln!("{what}: max abs diff vs PyTorch {max:e}");
    max
}

/// A `forms_of` that picks `forms` whatever the device.
fn forms_as(forms: Forms) -> fn(Device, Kind) -> Forms {
    match forms {
        Forms::Cpu => |_, _| Forms::Cpu,
        Forms::Device => |_, _| Forms::Device,
        Forms::Unfused => |_, _| Forms::Unfused,
    }
}

fn run_three_steps(h: Hyper) -> (Tensor, Optimizer) {
    let p = leaf(&PARAM, &[2, 3]);
    let mut opt = Optimizer::new(h, vec![("w".into(), p.shallow_clone())]);
    for g in &GRADS {
        opt.zero_grad();
        set_grad(&p, g);
        opt.step(LR).unwrap();
    }
    (p, opt)
}

#[test]
fn sgd_momentum_matches_pytorch() {
    let (p, opt) = run_three_steps(sgd());
    assert_eq!(opt.steps_taken(), 3);
    assert_close("sgd momentum", &values(&p), &SGD_MOMENTUM);
}

#[test]
fn sgd_nesterov_matches_pytorch() {
    let (p, _) = run_three_steps(nesterov());
    assert_close("sgd nesterov", &values(&p), &SGD_NESTEROV);
}

#[test]
fn adam_matches_pytorch() {
    let (p, _) = run_three_steps(adam());
    assert_close("adam", &values(&p), &ADAM);
}

#[test]
fn adamw_matches_pytorch() {
    let (p, _) = run_three_steps(adamw());
    assert_close("adamw", &values(&p), &ADAMW);
}

fn with_impl(h: Hyper, implementation: OptimizerImpl) -> Hyper {
    Hyper { implementation, ..h }
}

/// Three steps on PARAM in `kind` (grads, state and parameter in that dtype, as PyTorch).
fn three_steps_in(h: Hyper, kind: Kind) -> Vec<f32> {
    let p = Tensor::from_slice(&PARAM)
        .reshape([2, 3])
        .to_kind(kind)
        .set_requires_grad(true);
    let mut opt = Optimizer::new(h, vec![("w".into(), p.shallow_clone())]);
    assert_eq!(opt.implementation(), h.implementation);
    for g in &GRADS {
        opt.zero_grad();
        let g = Tensor::from_slice(g).reshape([2, 3]).to_kind(kind);
        (&p * g).sum(kind).backward();
        opt.step(LR).unwrap();
    }
    values(&p.to_kind(Kind::Float))
}

/// PyTorch's foreach and fused implementations are deterministic on the CPU, and memtrain's
/// run the same kernels with the same numbers: equal bit for bit, fp32 and bf16 alike (bf16
/// too, unlike the single-tensor forms: the foreach ops take the Python numbers directly).
#[test]
fn foreach_and_fused_match_pytorch_bit_for_bit() {
    let cases = [
        (
            "sgd momentum",
            sgd(),
            [
                SGD_MOMENTUM,
                SGD_MOMENTUM_FOREACH_BF16,
                SGD_MOMENTUM_FUSED,
                SGD_MOMENTUM_FUSED_BF16,
            ],
        ),
        (
            "sgd nesterov",
            nesterov(),
            [
                SGD_NESTEROV,
                SGD_NESTEROV_FOREACH_BF16,
                SGD_NESTEROV_FUSED,
                SGD_NESTEROV_FUSED_BF16,
            ],
        ),
        ("adam", adam(), [ADAM, ADAM_FOREACH_BF16, ADAM_FUSED, ADAM_FUSED_BF16]),
        (
            "adamw",
            adamw(),
            [ADAMW, ADAMW_FOREACH_BF16, ADAMW_FUSED, ADAMW_FUSED_BF16],
        ),
    ];
    for (what, h, [foreach, foreach_bf16, fused, fused_bf16]) in cases {
        let runs = [
            (OptimizerImpl::Foreach, Kind::Float, foreach),
            (OptimizerImpl::Foreach, Kind::BFloat16, foreach_bf16),
            (OptimizerImpl::Fused, Kind::Float, fused),
            (OptimizerImpl::Fused, Kind::BFloat16, fused_bf16),
        ];
        for (imp, kind, want) in runs {
            let got = three_steps_in(with_impl(h, imp), kind);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&got),
                bits(&want),
                "{what} {imp:?} {kind:?}: {got:?} vs PyTorch {want:?}"
            );
        }
    }
}

/// Several parameters of different sizes, so that foreach splits them into groups (capped at
/// the largest parameter) and fused launches one kernel for all: each parameter ends as the
/// single-tensor update leaves it, and the state is the same.
#[test]
fn groups_change_no_value() {
    let shapes: [&[i64]; 5] = [&[7, 5], &[5], &[64], &[3, 4, 2], &[1]];
    let run = |h: Hyper| {
        let params: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n: i64 = s.iter().product();
                let v = Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.01 + 0.1 * i as f64;
                v.reshape(*s).set_requires_grad(true)
            })
            .collect();
        let named = params
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("p{i}"), p.shallow_clone()))
            .collect();
        let mut opt = Optimizer::new(h, named);
        for step in 0..4 {
            opt.zero_grad();
            let loss = params
                .iter()
                .enumerate()
                .map(|(i, p)| (p * p * (0.3 + 0.1 * (i + step) as f64)).sin().sum(Kind::Float))
                .fold(Tensor::zeros([], (Kind::Float, Device::Cpu)), |a, b| a + b);
            loss.backward();
            opt.step(LR).unwrap();
        }
        let mut out: Vec<f32> = params.iter().flat_map(values).collect();
        out.extend(opt.state_tensors().iter().flat_map(|(_, t)| values(t)));
        out
    };
    for h in [
        sgd(),
        nesterov(),
        hyper(OptimizerKind::Sgd, 0.0, false),
        adam(),
        adamw(),
    ] {
        let single = run(h);
        let foreach = run(with_impl(h, OptimizerImpl::Foreach));
        assert_eq!(single, foreach, "{:?}: foreach differs from single", h.kind);
        // The fused kernels compute in another order (within a few float32 ulps of single).
        let fused = run(with_impl(h, OptimizerImpl::Fused));
        for (a, b) in single.iter().zip(&fused) {
            assert!(
                (a - b).abs() <= 1e-6 * a.abs().max(1.0),
                "{:?}: fused {b} vs single {a}",
                h.kind
            );
        }
    }
}

#[test]
fn auto_is_single_on_the_cpu_fused_for_host_state_and_explicit_choices_fall_back_where_they_cannot_run() {
    let p = || vec![("w".to_string(), leaf(&PARAM, &[2, 3]))];
    let mut opt = Optimizer::new(with_impl(adamw(), OptimizerImpl::Auto), p());
    assert_eq!(opt.implementation(), OptimizerImpl::Single);
    opt.place_state(Home::Host);
    assert_eq!(opt.implementation(), OptimizerImpl::Fused);
    let mut opt = Optimizer::new(with_impl(adamw(), OptimizerImpl::Foreach), p());
    assert_eq!(opt.implementation(), OptimizerImpl::Foreach);
    opt.place_state(Home::Host);
    opt.place_grads(Home::Host);
    assert_eq!(
        opt.implementation(),
        OptimizerImpl::Foreach,
        "the host update runs foreach too"
    );
    opt.place_state(Home::Device);
    assert_eq!(
        opt.implementation(),
        OptimizerImpl::Single,
        "gradients on the host, state on the device"
    );
    opt.place_grads(Home::Device);
    assert_eq!(opt.implementation(), OptimizerImpl::Foreach);
    let opt = Optimizer::new(with_impl(with_8bit_state(adamw()), OptimizerImpl::Foreach), p());
    assert_eq!(opt.implementation(), OptimizerImpl::Single);
    let cuda = Device::Cuda(0);
    let on_device = Placement {
        state_bits: 32,
        state_on_host: false,
        grads_on_host: false,
    };
    assert_eq!(resolve(OptimizerImpl::Auto, cuda, on_device), OptimizerImpl::Foreach);
    let host_grads = Placement {
        grads_on_host: true,
        ..on_device
    };
    assert_eq!(resolve(OptimizerImpl::Auto, cuda, host_grads), OptimizerImpl::Single);
    let why = refusal(OptimizerImpl::Fused, host_grads).unwrap();
    assert!(
        why.contains("memory.gradients") && why.contains("\"auto\" or \"single\""),
        "{why}"
    );
}

/// bf16 parameters take the unfused forms (module docs): within one bf16 ulp of PyTorch.
/// The unfused forms (bf16 off the CPU) run on the CPU here too, through the same code.
#[test]
fn bf16_params_stay_within_one_ulp_of_pytorch() {
    let cases = [(sgd(), SGD_MOMENTUM_BF16), (adam(), ADAM_BF16)];
    for ((h, want), forms) in cases.iter().flat_map(|c| [(c, Forms::Cpu), (c, Forms::Unfused)]) {
        let (h, want) = (*h, *want);
        let p = Tensor::from_slice(&PARAM)
            .reshape([2, 3])
            .to_kind(Kind::BFloat16)
            .set_requires_grad(true);
        let mut opt = Optimizer::new(h, vec![("w".into(), p.shallow_clone())]);
        opt.forms_of = forms_as(forms);
        for g in &GRADS {
            opt.zero_grad();
            let g = Tensor::from_slice(g).reshape([2, 3]).to_kind(Kind::BFloat16);
            (&p * g).sum(Kind::BFloat16).backward();
            opt.step(LR).unwrap();
        }
        assert_eq!(p.kind(), Kind::BFloat16);
        assert!(opt.state_tensors().iter().all(|(_, t)| t.kind() == Kind::BFloat16));
        let got = values(&p.to_kind(Kind::Float));
        let mut max = 0f32;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let d = (g - w).abs();
            max = max.max(d);
            // One bf16 ulp is 2^-7 relative at worst.
            assert!(
                d <= w.abs() / 128.0,
                "{:?} {forms:?}[{i}]: got {g}, PyTorch {w}",
                h.kind
            );
        }
        eprintln!("{:?} bf16, {forms:?} forms: max abs diff vs PyTorch {max:e}", h.kind);
    }
}

#[test]
fn params_without_grad_are_skipped() {
    for h in [sgd(), adam(), adamw(), hyper(OptimizerKind::Sgd, 0.0, false)] {
        let a = leaf(&PARAM, &[2, 3]);
        let b = leaf(&[1.0, 2.0, 3.0], &[3]);
        let mut opt = Optimizer::new(
            h,
            vec![("a".into(), a.shallow_clone()), ("b".into(), b.shallow_clone())],
        );
        set_grad(&a, &GRADS[0]);
        opt.step(LR).unwrap();
        assert_eq!(values(&b), vec![1.0, 2.0, 3.0], "{:?}", h.kind);
        assert_ne!(values(&a), PARAM.to_vec(), "{:?}", h.kind);
    }
}

#[test]
fn drop_grads_releases_them_and_the_next_backward_makes_them_again() {
    let p = Tensor::from_slice(&[1.0f32, 2.0]).set_requires_grad(true);
    let mut opt = Optimizer::new(sgd(), vec![("w".into(), p.shallow_clone())]);
    (&p * 3.0).sum(tch::Kind::Float).backward();
    assert!(p.grad().defined());
    opt.drop_grads();
    assert!(!p.grad().defined());
    opt.step(0.1).unwrap();
    assert_eq!(values(&p), vec![1.0, 2.0], "no gradient, no update");
    (&p * 3.0).sum(tch::Kind::Float).backward();
    assert_eq!(values(&p.grad()), vec![3.0, 3.0]);
}

#[test]
fn a_sharded_optimizer_steps_and_keeps_only_its_parameters() {
    let (a, b) = (leaf(&PARAM, &[2, 3]), leaf(&[1.0, 2.0], &[2]));
    let params = vec![("a".into(), a.shallow_clone()), ("b".into(), b.shallow_clone())];
    let shard = Shard {
        rank: 1,
        owners: vec![0, 1],
    };
    let mut opt = Optimizer::sharded(adam(), params, Some(shard));
    let names: Vec<String> = opt.state_tensors().into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["exp_avg/b", "exp_avg_sq/b"]);
    assert_eq!(opt.state_names_of(0), ["exp_avg/a", "exp_avg_sq/a"]);
    set_grad(&a, &GRADS[0]);
    set_grad(&b, &[0.5, 0.5]);
    opt.step(LR).unwrap();
    assert_eq!(values(&a), PARAM.to_vec(), "rank 0's parameter is not stepped here");
    assert_ne!(values(&b), vec![1.0, 2.0]);
    // The whole optimizer's saved state loads: own part copied, the rest checked and skipped.
    let full: Vec<(String, Tensor)> = ["exp_avg/a", "exp_avg_sq/a"]
        .iter()
        .map(|n| (n.to_string(), Tensor::ones([2, 3], (Kind::Float, Device::Cpu))))
        .chain(
            ["exp_avg/b", "exp_avg_sq/b"]
                .iter()
                .map(|n| (n.to_string(), Tensor::full([2], 7.0, (Kind::Float, Device::Cpu)))),
        )
        .collect();
    opt.load_state(&full, 3).unwrap();
    assert_eq!(values(&opt.state_of(1)[0]), vec![7.0, 7.0]);
    assert!(opt.state_of(0).is_empty());
    // A name missing for a parameter another rank owns is still an error.
    let e = opt.load_state(&full[1..], 3).unwrap_err();
    assert!(e.to_string().contains("missing exp_avg/a"), "{e}");
}

#[test]
fn zero_grad_zeroes_in_place() {
    let p = leaf(&PARAM, &[2, 3]);
    let mut opt = Optimizer::new(sgd(), vec![("w".into(), p.shallow_clone())]);
    set_grad(&p, &GRADS[0]);
    let before = p.grad();
    opt.zero_grad();
    assert_eq!(values(&p.grad()), vec![0.0; 6]);
    // Same storage: zeroed in place, not replaced.
    assert_eq!(before.data_ptr(), p.grad().data_ptr());
}

#[test]
fn state_names() {
    let named = |h: Hyper| {
        let opt = Optimizer::new(
            h,
            vec![("a".into(), leaf(&PARAM, &[2, 3])), ("b".into(), leaf(&[1.0], &[1]))],
        );
        opt.state_tensors().into_iter().map(|(n, _)| n).collect::<Vec<_>>()
    };
    assert_eq!(
        named(adam()),
        ["exp_avg/a", "exp_avg_sq/a", "exp_avg/b", "exp_avg_sq/b"]
    );
    assert_eq!(
        named(adamw()),
        ["exp_avg/a", "exp_avg_sq/a", "exp_avg/b", "exp_avg_sq/b"]
    );
    assert_eq!(named(sgd()), ["momentum_buffer/a", "momentum_buffer/b"]);
    assert!(named(hyper(OptimizerKind::Sgd, 0.0, false)).is_empty());
}

#[test]
fn state_round_trip_is_exact() {
    for h in [sgd(), nesterov(), adam(), adamw()] {
        let a = leaf(&PARAM, &[2, 3]);
        let mut opt_a = Optimizer::new(h, vec![("w".into(), a.shallow_clone())]);
        for g in &GRADS[..2] {
            opt_a.zero_grad();
            set_grad(&a, g);
            opt_a.step(LR).unwrap();
        }
        // What a checkpoint holds: deep copies on the CPU.
        let saved: Vec<(String, Tensor)> = opt_a
            .state_tensors()
            .into_iter()
            .map(|(n, t)| (n, t.to_device(Device::Cpu).copy()))
            .collect();
        let b = a.detach().copy().set_requires_grad(true);
        let mut opt_b = Optimizer::new(h, vec![("w".into(), b.shallow_clone())]);
        opt_b.load_state(&saved, opt_a.steps_taken()).unwrap();
        assert_eq!(opt_b.steps_taken(), 2);
        for (p, opt) in [(&a, &mut opt_a), (&b, &mut opt_b)] {
            opt.zero_grad();
            set_grad(p, &GRADS[2]);
            opt.step(LR).unwrap();
        }
        assert!(a.equal(&b), "{:?}: resumed param differs", h.kind);
        for ((na, ta), (nb, tb)) in opt_a.state_tensors().iter().zip(opt_b.state_tensors().iter()) {
            assert_eq!(na, nb);
            assert!(ta.equal(tb), "{:?}: {na} differs", h.kind);
        }
    }
}

#[test]
fn load_state_rejects_missing_and_unexpected_names() {
    let p = leaf(&PARAM, &[2, 3]);
    let mut opt = Optimizer::new(adam(), vec![("w".into(), p.shallow_clone())]);
    set_grad(&p, &GRADS[0]);
    opt.step(LR).unwrap();
    let before = values(&opt.state_tensors()[0].1);
    let saved: Vec<(String, Tensor)> = opt
        .state_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.copy().zero_()))
        .collect();

    let missing: Vec<_> = saved
        .iter()
        .filter(|(n, _)| n != "exp_avg_sq/w")
        .map(|(n, t)| (n.clone(), t.copy()))
        .collect();
    let err = opt.load_state(&missing, 1).unwrap_err().to_string();
    assert!(err.contains("missing exp_avg_sq/w"), "{err}");

    let mut extra: Vec<_> = saved.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
    extra.push((
        "momentum_buffer/w".into(),
        Tensor::zeros([2, 3], (Kind::Float, Device::Cpu)),
    ));
    let err = opt.load_state(&extra, 1).unwrap_err().to_string();
    assert!(err.contains("unexpected momentum_buffer/w"), "{err}");

    let mut wrong_shape: Vec<_> = saved.iter().map(|(n, t)| (n.clone(), t.copy())).collect();
    wrong_shape[0].1 = Tensor::zeros([3, 2], (Kind::Float, Device::Cpu));
    let err = opt.load_state(&wrong_shape, 1).unwrap_err().to_string();
    assert!(err.contains("exp_avg/w has shape [3, 2]"), "{err}");

    // A rejected load leaves the state and step count alone.
    assert_eq!(values(&opt.state_tensors()[0].1), before);
    assert_eq!(opt.steps_taken(), 1);
}

#[test]
fn load_state_converts_kind() {
    let p = leaf(&PARAM, &[2, 3]);
    let mut opt = Optimizer::new(sgd(), vec![("w".into(), p.shallow_clone())]);
    let saved = vec![(
        "momentum_buffer/w".to_string(),
        Tensor::ones([2, 3], (Kind::Double, Device::Cpu)),
    )];
    opt.load_state(&saved, 5).unwrap();
    let (_, buf) = &opt.state_tensors()[0];
    assert_eq!(buf.kind(), Kind::Float);
    assert_eq!(values(buf), vec![1.0; 6]);
    assert_eq!(opt.steps_taken(), 5);
}

#[test]
fn to_device_keeps_state() {
    let p = leaf(&PARAM, &[2, 3]);
    let mut opt = Optimizer::new(adam(), vec![("w".into(), p.shallow_clone())]);
    set_grad(&p, &GRADS[0]);
    opt.step(LR).unwrap();
    let before: Vec<Vec<f32>> = opt.state_tensors().iter().map(|(_, t)| values(t)).collect();
    opt.to_device(Device::Cpu);
    let after: Vec<Vec<f32>> = opt.state_tensors().iter().map(|(_, t)| values(t)).collect();
    assert_eq!(before, after);
}

#[test]
fn clip_grad_norm_matches_pytorch() {
    let a = leaf(&[0.0; 6], &[2, 3]);
    let b = leaf(&[0.0; 3], &[3]);
    let c = leaf(&[0.0; 4], &[4]); // no grad: skipped
    set_grad(&a, &CLIP_GRADS.0);
    set_grad(&b, &CLIP_GRADS.1);
    let params = vec![
        ("a".to_string(), a.shallow_clone()),
        ("b".into(), b.shallow_clone()),
        ("c".into(), c),
    ];
    let total = clip_grad_norm(&params, 1.0);
    assert_close("clip total norm", &[total as f32], &CLIP_TOTAL_NORM);
    assert_close("clip grad a", &values(&a.grad()), &CLIP_GRAD0);
    assert_close("clip grad b", &values(&b.grad()), &CLIP_GRAD1);
    assert!(!params[2].1.grad().defined());
}

#[test]
fn clip_grad_norm_below_max_leaves_grads() {
    let a = leaf(&[0.0; 6], &[2, 3]);
    set_grad(&a, &CLIP_GRADS.0);
    let total = clip_grad_norm(&[("a".into(), a.shallow_clone())], 100.0);
    let want = CLIP_GRADS.0.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    assert!((total - want).abs() < 1e-6, "{total} vs {want}");
    assert_eq!(values(&a.grad()), CLIP_GRADS.0.to_vec());
    assert_eq!(clip_grad_norm(&[("none".into(), leaf(&[1.0], &[1]))], 1.0), 0.0);
}

/// Set in the child process that runs `apply_allocates_nothing_parameter_sized` alone.
const ALONE: &str = "MEMTRAIN_TEST_ALONE";

/// `apply` runs outside the OOM guard, after the ranks agreed that `prepare` succeeded: an
/// allocation there could fail with half the parameters updated. Every rule, on every form
/// (the device ones computed on the CPU), must take its temporaries from the workspace. The
/// counting allocator's peak is process-wide, so the measurement runs in a child process of
/// this test binary with no other test beside it.
#[test]
fn apply_allocates_nothing_parameter_sized() {
    const NAME: &str = "optim::tests::apply_allocates_nothing_parameter_sized";
    if std::env::var_os(ALONE).is_none() {
        let exe = std::env::current_exe().expect("the test binary's path");
        let out = std::process::Command::new(exe)
            .args(["--exact", NAME, "--test-threads=1", "--nocapture"])
            .env(ALONE, "1")
            .output()
            .expect("running the test binary again");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        assert!(out.status.success(), "{stdout}\n{stderr}");
        assert!(stdout.contains("1 passed"), "the child ran the measurement: {stdout}");
        return;
    }
    crate::shim::cpu_alloc_install().unwrap();
    let n = 1 << 16;
    let plain_sgd = hyper(OptimizerKind::Sgd, 0.0, false);
    let adam8 = with_8bit_state(adam());
    let adamw8 = with_8bit_state(adamw());
    let single = [sgd(), nesterov(), plain_sgd, adam(), adamw(), adam8, adamw8];
    let multi = [sgd(), nesterov(), plain_sgd, adam(), adamw()]
        .into_iter()
        .flat_map(|h| [OptimizerImpl::Foreach, OptimizerImpl::Fused].map(|i| with_impl(h, i)));
    for h in single.into_iter().chain(multi) {
        for kind in [Kind::Float, Kind::BFloat16] {
            for forms in [Forms::Cpu, Forms::Device, Forms::Unfused] {
                let p = Tensor::ones([n], (kind, Device::Cpu)).set_requires_grad(true);
                // Two parameters: foreach and fused update them as one group.
                let q = Tensor::ones([n / 2], (kind, Device::Cpu)).set_requires_grad(true);
                let named = vec![("w".into(), p.shallow_clone()), ("v".into(), q.shallow_clone())];
                let mut opt = Optimizer::new(h, named);
                opt.forms_of = forms_as(forms);
                // Two steps: SGD's first copies the gradient into its buffer, the second
                // updates it.
                for step in 0..2 {
                    ((&p * 0.5).sum(kind) + (&q * 0.25).sum(kind)).backward();
                    let prepared = opt.prepare();
                    let before = crate::shim::cpu_alloc_stats().allocated;
                    crate::shim::cpu_alloc_reset_peak();
                    opt.apply(prepared, LR).unwrap();
                    let grew = crate::shim::cpu_alloc_stats().peak_allocated - before;
                    // libtorch's scalar `div_`/`add_` make 0-dim temporaries of a few bytes.
                    assert!(
                        grew < 64,
                        "{:?} {:?} {kind:?} {forms:?} step {step}: apply allocated {grew} bytes",
                        h.kind,
                        h.implementation
                    );
                    opt.drop_grads();
                }
            }
        }
    }
}

// 8-bit Adam/AdamW state (`adam8`, `quant`); the comparison with a Python reference of the
// algorithm is the integration test `optim8`.

/// A parameter of `n` values with `steps` random gradients, all seeded.
fn big_param(n: i64, steps: usize, seed: i64) -> (Tensor, Vec<Tensor>) {
    let g = |s: i64| {
        tch::manual_seed(seed * 1000 + s);
        Tensor::randn([n], (Kind::Float, Device::Cpu))
    };
    let grads = (1..=steps as i64).map(|s| g(s) * 0.1).collect();
    (g(0), grads)
}

/// `steps` updates of a copy of `init` with `grads`; the parameter and its optimizer.
fn run_on(h: Hyper, init: &Tensor, grads: &[Tensor]) -> (Tensor, Optimizer) {
    let p = init.copy().set_requires_grad(true);
    let mut opt = Optimizer::new(h, vec![("w".into(), p.shallow_clone())]);
    for g in grads {
        opt.zero_grad();
        (&p * g).sum(Kind::Float).backward();
        opt.step(LR / 10.0).unwrap();
    }
    (p, opt)
}

mod adam8_fused_host;
