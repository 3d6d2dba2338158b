use tch::{Device, Kind, Reduction, Tensor};

use super::*;

/// Hidden states `[2, 9, 6]` and a projection `[11, 6]`, both leaves needing gradients, and
/// targets with some ignored.
fn case(kind: Kind) -> (Tensor, Tensor, Tensor) {
    tch::manual_seed(3);
    let h = Tensor::randn([2, 9, 6], (Kind::Float, Device::Cpu))
        .to_kind(kind)
        .set_requires_grad(true);
    let w = (Tensor::randn([11, 6], (Kind::Float, Device::Cpu)) * 0.5)
        .to_kind(kind)
        .set_requires_grad(true);
    let y = Tensor::randint(11, [2, 9], (Kind::Int64, Device::Cpu));
    let y = y.index_fill(1, &Tensor::from_slice(&[0i64, 4, 8]), IGNORE);
    (h, w, y)
}

/// The plain computation: whole logits, PyTorch's cross-entropy; loss and the two gradients of
/// `loss * scale`.
fn plain(h: &Tensor, w: &Tensor, y: &Tensor, scale: f64) -> (f64, Tensor, Tensor) {
    let logits = h.matmul(&w.tr()).to_kind(Kind::Float).reshape([-1, w.size()[0]]);
    let loss = logits.cross_entropy_loss::<Tensor>(&y.reshape([-1]), None, Reduction::Sum, IGNORE, 0.0);
    (&loss * scale).backward();
    let out = (loss.double_value(&[]), h.grad().copy(), w.grad().copy());
    let _ = h.grad().zero_();
    let _ = w.grad().zero_();
    out
}

fn close(a: &Tensor, b: &Tensor, tol: f64) {
    let a = a.to_kind(Kind::Double);
    let b = b.to_kind(Kind::Double);
    let err = (&a - &b).abs().max().double_value(&[]);
    let scale = b.abs().max().double_value(&[]).max(1e-30);
    assert!(
        err <= tol * scale,
        "max difference {err} against a largest value {scale}"
    );
}

#[test]
fn chunked_loss_and_gradients_equal_plain_cross_entropy() {
    let (h, w, y) = case(Kind::Float);
    let (want, want_gh, want_gw) = plain(&h, &w, &y, 1.0);
    // Chunks that do and do not divide the 18 tokens, and one chunk for all.
    for chunk in [1, 4, 7, 18, 100] {
        let t = next_token_loss(&h, &w, &y, None, chunk);
        let got = t.loss.double_value(&[]);
        assert!(
            ((got - want) / want).abs() <= 1e-6,
            "chunk {chunk}: {got} against {want}"
        );
        assert_eq!(t.tokens.int64_value(&[]), 12);
        t.loss.backward();
        close(&h.grad(), &want_gh, 1e-6);
        close(&w.grad(), &want_gw, 1e-6);
        let _ = h.grad().zero_();
        let _ = w.grad().zero_();
    }
}

/// A masked token (a prompt's) carries nothing back: its hidden state gets exactly zero gradient
/// through the loss, while every counted token's gets some.
#[test]
fn an_ignored_token_gets_exactly_no_gradient() {
    let (h, w, y) = case(Kind::Float);
    for chunk in [1, 4, 18] {
        let t = next_token_loss(&h, &w, &y, None, chunk);
        t.loss.backward();
        let gh = h.grad().copy();
        for p in 0..9i64 {
            let largest = gh.select(1, p).abs().max().double_value(&[]);
            match p {
                0 | 4 | 8 => assert_eq!(largest, 0.0, "chunk {chunk}: the masked position {p}"),
                _ => assert!(largest > 0.0, "chunk {chunk}: the counted position {p}"),
            }
        }
        let _ = h.grad().zero_();
        let _ = w.grad().zero_();
    }
}

#[test]
fn the_gradient_follows_the_scale_backward_starts_from() {
    // A step divides by the group's token count and multiplies by fp16's loss scale.
    let (h, w, y) = case(Kind::Float);
    let scale = 1024.0 / 12.0;
    let (_, want_gh, want_gw) = plain(&h, &w, &y, scale);
    let t = next_token_loss(&h, &w, &y, None, 5);
    (&t.loss / 12.0 * 1024.0).backward();
    close(&h.grad(), &want_gh, 1e-6);
    close(&w.grad(), &want_gw, 1e-6);
}

#[test]
fn correct_counts_the_targets_whose_logit_is_largest() {
    let (h, w, y) = case(Kind::Float);
    let logits = h.matmul(&w.tr());
    let want = logits.argmax(-1, false).eq_tensor(&y).sum(Kind::Int64).int64_value(&[]);
    let t = tch::no_grad(|| next_token_loss(&h, &w, &y, None, 3));
    assert_eq!(t.correct.int64_value(&[]), want);
    assert!(!t.loss.requires_grad(), "no graph is built under no_grad");
}

#[test]
fn a_frozen_projection_gets_no_gradient_and_the_hidden_states_theirs() {
    let (h, w, y) = case(Kind::Float);
    let (_, want_gh, _) = plain(&h, &w, &y, 1.0);
    let frozen = w.detach();
    let t = next_token_loss(&h, &frozen, &y, None, 4);
    t.loss.backward();
    close(&h.grad(), &want_gh, 1e-6);
    assert!(!frozen.grad().defined());
}

#[test]
fn bf16_weights_get_bf16_gradients_close_to_the_plain_ones() {
    let (h, w, y) = case(Kind::BFloat16);
    let (want, want_gh, want_gw) = plain(&h, &w, &y, 1.0);
    let t = next_token_loss(&h, &w, &y, None, 4);
    let got = t.loss.double_value(&[]);
    assert!(((got - want) / want).abs() <= 1e-2, "{got} against {want}");
    t.loss.backward();
    assert_eq!(h.grad().kind(), Kind::BFloat16);
    assert_eq!(w.grad().kind(), Kind::BFloat16);
    close(&h.grad(), &want_gh, 2e-2);
    close(&w.grad(), &want_gw, 2e-2);
}

#[test]
fn a_chunk_holds_at_most_its_byte_budget_of_logits() {
    assert_eq!(chunk_tokens(128_256), (64 << 20) / (4 * 128_256));
    assert_eq!(chunk_tokens(1 << 40), 1);
}
