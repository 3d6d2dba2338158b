//! Gradient clipping by global norm, as `torch.nn.utils.clip_grad_norm_`.
use tch::Tensor;

/// Clips gradients in place so that their global L2 norm is at most `max_norm`, exactly like
/// `torch.nn.utils.clip_grad_norm_(params, max_norm)` (norm type 2): the total norm is the norm
/// of the stacked per-parameter norms, every grad is multiplied by
/// `min(max_norm / (total_norm + 1e-6), 1)` (computed on the device, so the multiply happens
/// even when it is 1). Parameters without a grad are skipped. Returns the total norm before
/// clipping (0 when no parameter has a grad); reading it makes the host wait for the device.
///
/// On CUDA PyTorch computes the per-parameter norms with a fused multi-tensor kernel whose
/// summation order differs, so there the norm can differ from PyTorch's in the last bits.
pub fn clip_grad_norm(params: &[(String, Tensor)], max_norm: f64) -> f64 {
    clip_grads(
        params.iter().map(|(_, p)| p.grad()).filter(|g| g.defined()).collect(),
        max_norm,
    )
    .map_or(0.0, |total| total.double_value(&[]))
}

/// [`clip_grad_norm`] over the gradients themselves (wherever they live); the total norm stays
/// where it was computed (None without gradients), so clipping never waits on the device.
pub fn clip_grads(mut grads: Vec<Tensor>, max_norm: f64) -> Option<Tensor> {
    tch::no_grad(|| {
        let first = grads.first()?;
        let device = first.device();
        let norms: Vec<Tensor> = grads
            .iter()
            .map(|g| {
                let n = g.norm();
                if n.device() == device {
                    n
                } else {
                    n.to_device(device)
                }
            })
            .collect();
        let total = Tensor::stack(&norms, 0).norm();
        // clip_coef = max_norm / (total_norm + 1e-6), which Python evaluates as
        // (total_norm + 1e-6).reciprocal() * max_norm; then clamp(max=1.0).
        let coef = total
            .g_add_scalar(1e-6)
            .reciprocal()
            .g_mul_scalar(max_norm)
            .clamp_max(1.0);
        for g in grads.iter_mut() {
            if g.device() == device {
                let _ = g.g_mul_(&coef);
            } else {
                let _ = g.g_mul_(&coef.to_device(g.device()));
            }
        }
        Some(total)
    })
}
