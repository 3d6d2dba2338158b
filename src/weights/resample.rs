//! A ViT's position embeddings at another image size, resampled as timm's
//! `resample_abs_pos_embed` does: the class token's row kept, the grid of patch rows
//! interpolated bicubically with antialiasing (align_corners false) in float32, the result back
//! in the checkpoint's type.
use anyhow::Result;
use tch::{Kind, Tensor};

/// `pos` is `[1, 1 + from², d]`; the result is `[1, 1 + to², d]`.
pub fn pos_embed(pos: &Tensor, from: i64, to: i64) -> Result<Tensor> {
    let kind = pos.kind();
    let d = *pos.size().last().unwrap_or(&0);
    let pos = pos.f_to_kind(Kind::Float)?;
    let prefix = pos.f_narrow(1, 0, 1)?;
    let grid = pos
        .f_narrow(1, 1, from * from)?
        .f_reshape([1, from, from, d])?
        .f_permute([0, 3, 1, 2])?;
    let grid = grid.f_internal_upsample_bicubic2d_aa([to, to], false, None, None)?;
    let grid = grid.f_permute([0, 2, 3, 1])?.f_reshape([1, to * to, d])?;
    Ok(Tensor::f_cat(&[prefix, grid], 1)?.f_to_kind(kind)?)
}
