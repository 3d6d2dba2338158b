//! The next-token loss of a language model without its whole logits.
//!
//! A language model's logits `[tokens, vocab]` in fp32 are the largest tensor of its step (2048
//! tokens of a 128k vocabulary: 1 GiB, and its softmax and gradient as much again). Here the
//! hidden states go through the output projection a chunk of tokens at a time, in forward and in
//! backward: per chunk, without a graph, the logits, their log-softmax, the loss, the correct
//! count and the analytic gradient (softmax − one-hot, zero for ignored targets) are computed and
//! the chunk's logits dropped; the gradients reach the hidden states and the projection through
//! a surrogate whose backward is exactly them (tch has no custom autograd function).
use tch::{Kind, Tensor};

use super::preset::Net;
use crate::shim;

/// Targets of this value are ignored, as PyTorch's `ignore_index` default has it.
pub const IGNORE: i64 = -100;

/// Bytes of fp32 logits one chunk may hold; a chunk's softmax and gradient reuse them.
pub const CHUNK_LOGIT_BYTES: i64 = 64 << 20;

/// A batch's next-token loss, summed over its counted targets.
pub struct TokenLoss {
    /// Sum-reduced cross-entropy (fp32 scalar); its backward gives the hidden states and the
    /// projection the gradient of the plain computation.
    pub loss: Tensor,
    /// Targets whose largest logit is the target (int64 scalar).
    pub correct: Tensor,
    /// Targets not ignored (int64 scalar).
    pub tokens: Tensor,
}

/// Tokens per chunk for a vocabulary of `vocab`: as many as `CHUNK_LOGIT_BYTES` of fp32 logits
/// hold, at least one.
pub fn chunk_tokens(vocab: i64) -> i64 {
    (CHUNK_LOGIT_BYTES / (4 * vocab.max(1))).max(1)
}

/// Logits from a model's output: the output itself, or a language model's hidden states through
/// its output projection (`Net::output_head`).
pub fn logits(net: &dyn Net, out: &Tensor) -> Tensor {
    logits_in(net, out, None)
}

/// [`logits`] with the projection in `compute` (a mixed run's autocast dtype; None: `out`'s
/// own), as [`next_token_loss`] computes it in training.
pub fn logits_in(net: &dyn Net, out: &Tensor, compute: Option<Kind>) -> Tensor {
    match net.output_head() {
        Some(w) => {
            let kind = compute.unwrap_or(out.kind());
            out.to_kind(kind).matmul(&w.to_kind(kind).tr())
        }
        None => out.shallow_clone(),
    }
}

/// The projection's gradient, accumulated chunk by chunk, and the hidden states' (row blocks).
struct Grads {
    h: Option<Tensor>,
    w: Option<Tensor>,
}

/// Sum-reduced cross-entropy of `h · wᵀ` against `y` (targets `IGNORE` left out), for hidden
/// states `h` `[.., hidden]`, the projection `w` `[vocab, hidden]` and targets `y` `[..]`, `chunk`
/// tokens at a time. The matrix products run in `compute` (the autocast dtype of a mixed run;
/// None: `h`'s own), the softmax and loss in fp32. With grad mode on, the loss's backward gives
/// `h` and `w` the gradient the plain `cross_entropy(h · wᵀ, y, reduction = sum)` would.
pub fn next_token_loss(h: &Tensor, w: &Tensor, y: &Tensor, compute: Option<Kind>, chunk: i64) -> TokenLoss {
    let hidden = *h.size().last().expect("hidden states have a hidden dimension");
    let hf = h.reshape([-1, hidden]);
    let yf = y.reshape([-1]).to_device(h.device());
    let n = hf.size()[0];
    let compute = compute.unwrap_or(h.kind());
    let graph = shim::grad_enabled();
    let mut g = Grads {
        h: (graph && h.requires_grad()).then(|| Tensor::zeros([n, hidden], (Kind::Float, h.device()))),
        w: (graph && w.requires_grad()).then(|| Tensor::zeros(w.size(), (Kind::Float, w.device()))),
    };
    let (loss, correct) = tch::no_grad(|| {
        let hd = hf.detach();
        let wd = w.detach().to_kind(compute);
        let mut loss = Tensor::zeros([], (Kind::Float, h.device()));
        let mut correct = Tensor::zeros([], (Kind::Int64, h.device()));
        let mut start = 0;
        while start < n {
            let c = chunk.max(1).min(n - start);
            let (l, k) = one_chunk(
                &hd.narrow(0, start, c),
                &wd,
                &yf.narrow(0, start, c),
                compute,
                start,
                &mut g,
            );
            loss += l;
            correct += k;
            start += c;
        }
        (loss, correct)
    });
    let tokens = yf.ne(IGNORE).sum(Kind::Int64);
    let loss = match surrogate(&hf, w, &g) {
        Some(s) => loss + (&s - s.detach()),
        None => loss,
    };
    TokenLoss { loss, correct, tokens }
}

/// One chunk's loss sum and correct count; its gradients go into `g` (rows `start..` of the
/// hidden states', added to the projection's).
fn one_chunk(h: &Tensor, w: &Tensor, y: &Tensor, compute: Kind, start: i64, g: &mut Grads) -> (Tensor, Tensor) {
    let hc = h.to_kind(compute);
    let logits = hc.matmul(&w.tr()).to_kind(Kind::Float);
    let correct = logits.argmax(-1, false).eq_tensor(y).sum(Kind::Int64);
    let mut logp = logits.log_softmax(-1, Kind::Float);
    drop(logits);
    let loss = logp.g_nll_loss::<Tensor>(y, None, tch::Reduction::Sum, IGNORE);
    if g.h.is_none() && g.w.is_none() {
        return (loss, correct);
    }
    // d loss / d logits = softmax − one-hot, on counted rows only.
    let counted = y.ne(IGNORE).to_kind(Kind::Float).unsqueeze(1);
    let target = y.clamp_min(0).unsqueeze(1);
    let mut d = logp.exp_();
    let _ = d.scatter_add_(1, &target, &(-&counted));
    let _ = d.g_mul_(&counted);
    let d = d.to_kind(compute);
    if let Some(gh) = &g.h {
        gh.narrow(0, start, h.size()[0]).copy_(&d.matmul(w));
    }
    if let Some(gw) = &mut g.w {
        match compute {
            Kind::Float => {
                let _ = gw.addmm_(&d.tr(), &hc);
            }
            _ => *gw += d.tr().matmul(&hc),
        }
    }
    (loss, correct)
}

/// `Σ h·gh + Σ w·gw` with the gradients as constants: its backward gives `h` exactly `gh` and
/// `w` exactly `gw` (in their own dtypes), times whatever scale backward starts from. None when
/// neither needs a gradient.
fn surrogate(h: &Tensor, w: &Tensor, g: &Grads) -> Option<Tensor> {
    let part = |x: &Tensor, gx: &Tensor| (x.to_kind(Kind::Float) * gx).sum(Kind::Float);
    match (&g.h, &g.w) {
        (Some(gh), Some(gw)) => Some(part(h, gh) + part(w, gw)),
        (Some(gh), None) => Some(part(h, gh)),
        (None, Some(gw)) => Some(part(w, gw)),
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests;
