//! open_clip's visual tower (`visual.*`): `conv1`, `class_embedding`, `positional_embedding`,
//! `ln_pre`, `transformer.resblocks.N.{ln_1, attn.in_proj_*, attn.out_proj, ln_2, mlp.c_fc,
//! mlp.c_proj}`, `ln_post` and `proj`, which is `[d, p]`: the transpose of memtrain's
//! `projection.weight`. The text tower maps to nothing.
use super::{by_module, in_block, numbered, Format, How, Target};

pub struct OpenClip;

const BLOCK: &[(&str, &str, How)] = &[
    ("ln_1.", "ln_1", How::Whole),
    ("attn.in_proj_weight", "self_attention.in_proj_weight", How::Whole),
    ("attn.in_proj_bias", "self_attention.in_proj_bias", How::Whole),
    ("attn.out_proj.", "self_attention.out_proj", How::Whole),
    ("ln_2.", "ln_2", How::Whole),
    ("mlp.c_fc.", "mlp.0", How::Whole),
    ("mlp.c_proj.", "mlp.3", How::Whole),
];

const OUTSIDE: &[(&str, &str)] = &[("conv1", "conv_proj"), ("ln_pre", "ln_pre"), ("ln_post", "encoder.ln")];

impl Format for OpenClip {
    fn name(&self) -> &'static str {
        "open_clip"
    }

    fn claims(&self, names: &[&str]) -> bool {
        names.iter().any(|n| n.starts_with("visual."))
    }

    fn map(&self, name: &str) -> Option<Target> {
        let name = name.strip_prefix("visual.")?;
        match name {
            "class_embedding" => Some(Target::whole("class_token")),
            "positional_embedding" => Some(Target::whole("encoder.pos_embedding")),
            "proj" => Some(Target {
                var: "projection.weight".into(),
                how: How::Transposed,
            }),
            _ => match numbered(name, "transformer.resblocks.") {
                Some((n, rest)) => in_block(n, rest, BLOCK),
                None => by_module(name, OUTSIDE),
            },
        }
    }
}
