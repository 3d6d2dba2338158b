//! 8-bit Adam state, the fused kernels' loss scale and the host update by block.
use super::*;

#[test]
fn adam8_state_layout() {
    let opt = Optimizer::new(
        with_8bit_state(adamw()),
        vec![
            ("a".into(), Tensor::zeros([64, 65], (Kind::Float, Device::Cpu))),
            ("b".into(), Tensor::zeros([64, 63], (Kind::Float, Device::Cpu))),
        ],
    );
    let named: Vec<(String, Vec<i64>, Kind)> = opt
        .state_tensors()
        .into_iter()
        .map(|(n, t)| (n, t.size(), t.kind()))
        .collect();
    let u8s = Kind::Uint8;
    let f = Kind::Float;
    // 64 * 65 = 4160 values: 16 full blocks of 256 and one of 64.
    assert_eq!(
        named,
        [
            ("exp_avg_q8/a".into(), vec![64, 65], u8s),
            ("exp_avg_absmax/a".into(), vec![17], f),
            ("exp_avg_sq_q8/a".into(), vec![64, 65], u8s),
            ("exp_avg_sq_absmax/a".into(), vec![17], f),
            // 4032 values, under min_8bit_size: fp32 state.
            ("exp_avg/b".into(), vec![64, 63], f),
            ("exp_avg_sq/b".into(), vec![64, 63], f),
        ]
    );
    assert_eq!(opt.state_names_of(0)[3], "exp_avg_sq_absmax/a");
}

/// Parameters under min_8bit_size are the fp32 rule, bit for bit.
#[test]
fn adam8_small_parameters_are_the_fp32_rule() {
    for h in [adam(), adamw()] {
        let (p32, _) = run_three_steps(h);
        let (p8, _) = run_three_steps(with_8bit_state(h));
        assert!(p32.equal(&p8), "{:?}", h.kind);
    }
}

/// The first step starts from zero moments, which quantize exactly: it equals the fp32 rule's
/// bit for bit. Later steps read rounded moments and stay close to the fp32 run.
#[test]
fn adam8_tracks_the_fp32_rule() {
    let (init, grads) = big_param(5000, 20, 1);
    for h in [adam(), adamw()] {
        let (p32, _) = run_on(h, &init, &grads[..1]);
        let (p8, _) = run_on(with_8bit_state(h), &init, &grads[..1]);
        assert!(p32.equal(&p8), "{:?}: the first step differs", h.kind);
        let (p32, _) = run_on(h, &init, &grads);
        let (p8, _) = run_on(with_8bit_state(h), &init, &grads);
        // 20 steps of lr 0.01 moved each value by up to 0.2; 8-bit moments change that by a
        // few percent at most.
        let moved = (&p32 - &init).abs().max().double_value(&[]);
        let apart = (&p32 - &p8).abs().max().double_value(&[]);
        assert!(
            apart < 0.05 * moved,
            "{:?}: 8-bit is {apart} from fp32 after moving {moved}",
            h.kind
        );
    }
}

#[test]
fn adam8_state_round_trip_is_exact() {
    let (init, grads) = big_param(4096 + 300, 6, 2);
    let h = with_8bit_state(adamw());
    let (a, mut opt_a) = run_on(h, &init, &grads[..4]);
    let saved: Vec<(String, Tensor)> = opt_a.state_tensors().into_iter().map(|(n, t)| (n, t.copy())).collect();
    let b = a.detach().copy().set_requires_grad(true);
    let mut opt_b = Optimizer::new(h, vec![("w".into(), b.shallow_clone())]);
    opt_b.load_state(&saved, opt_a.steps_taken()).unwrap();
    for g in &grads[4..] {
        for (p, opt) in [(&a, &mut opt_a), (&b, &mut opt_b)] {
            opt.zero_grad();
            (p * g).sum(Kind::Float).backward();
            opt.step(LR / 10.0).unwrap();
        }
    }
    assert!(a.equal(&b), "resumed param differs");
    for ((na, ta), (nb, tb)) in opt_a.state_tensors().iter().zip(opt_b.state_tensors().iter()) {
        assert_eq!(na, nb);
        assert!(ta.equal(tb), "{na} differs");
    }
    // fp32 state does not load into 8-bit slots (nor the reverse): the names differ.
    let (_, opt32) = run_on(adamw(), &init, &grads[..1]);
    let err = opt_b.load_state(&opt32.state_tensors(), 1).unwrap_err().to_string();
    assert!(
        err.contains("missing exp_avg_q8/w") && err.contains("unexpected exp_avg/w"),
        "{err}"
    );
}

/// fp16-mixed with a fused optimizer: gradients still multiplied by a power-of-two loss scale,
/// divided out in the kernel (`grad_scale`), give the parameters and state of the unscaled
/// gradients, bit for bit (the division by a power of two is exact in f32).
#[test]
fn fused_kernels_divide_the_loss_scale_out() {
    let scale = 65536.0;
    for h in [sgd(), nesterov(), adam(), adamw()] {
        let h = with_impl(h, OptimizerImpl::Fused);
        let run = |scaled: bool| {
            let p = leaf(&PARAM, &[2, 3]);
            let mut opt = Optimizer::new(h, vec![("w".into(), p.shallow_clone())]);
            assert!(opt.folds_unscale());
            for g in &GRADS {
                opt.zero_grad();
                let g: Vec<f32> = g.iter().map(|v| if scaled { v * scale as f32 } else { *v }).collect();
                set_grad(&p, &g);
                let prepared = opt.prepare();
                let prepared = match scaled {
                    true => prepared.with_grad_scale(&opt, scale),
                    false => prepared,
                };
                opt.apply(prepared, LR).unwrap();
            }
            let mut v = values(&p);
            v.extend(opt.state_tensors().iter().flat_map(|(_, t)| values(t)));
            v
        };
        assert_eq!(run(true), run(false), "{:?}", h.kind);
    }
}

#[test]
fn a_host_update_by_block_finishes_in_block_order_with_the_values_of_one_at_once() {
    // Three parameters in two blocks, listed out of block order: block 1, block 0, block 1.
    let blocks = vec![1, 0, 1];
    let make = || -> Vec<Tensor> {
        (0..3)
            .map(|i| leaf(&PARAM, &[2, 3]) * (1.0 + i as f64))
            .map(|t| t.detach().set_requires_grad(true))
            .collect()
    };
    let run = |by_block: bool| {
        let params = make();
        let named = params
            .iter()
            .enumerate()
            .map(|(i, p)| (format!("p{i}"), p.shallow_clone()))
            .collect();
        let mut opt = Optimizer::placed(with_impl(adamw(), OptimizerImpl::Fused), named, None, Home::Host);
        if by_block {
            opt.update_by_block(blocks.clone());
        }
        let mut seen = Vec::new();
        for g in &GRADS {
            opt.drop_grads();
            for p in &params {
                set_grad(p, g);
            }
            let before: Vec<Vec<f32>> = params.iter().map(values).collect();
            opt.step(LR).unwrap();
            assert_eq!(opt.is_pending(), by_block, "only an update by block is left pending");
            if by_block {
                assert_eq!(
                    params.iter().map(values).collect::<Vec<_>>(),
                    before,
                    "nothing written before its block comes"
                );
                opt.finish_block(0).unwrap();
                assert_ne!(
                    values(&params[1]),
                    before[1],
                    "block 0's parameter is updated when block 0 comes"
                );
                assert_eq!(values(&params[0]), before[0], "block 1's are not yet");
                assert_eq!(values(&params[2]), before[2], "block 1's are not yet");
                opt.finish_block(1).unwrap();
                opt.settle().unwrap();
                assert!(!opt.is_pending());
            }
            seen.push(params.iter().flat_map(values).collect::<Vec<f32>>());
        }
        seen.push(opt.state_tensors().iter().flat_map(|(_, t)| values(t)).collect());
        seen
    };
    assert_eq!(run(true), run(false), "the same values as an update done at once");
}

#[test]
#[should_panic(expected = "settle first")]
fn state_read_while_an_update_is_pending_panics() {
    let p = leaf(&PARAM, &[2, 3]);
    let mut opt = Optimizer::placed(adamw(), vec![("w".into(), p.shallow_clone())], None, Home::Host);
    opt.update_by_block(vec![0]);
    set_grad(&p, &GRADS[0]);
    opt.step(LR).unwrap();
    let _ = opt.state_tensors();
}
