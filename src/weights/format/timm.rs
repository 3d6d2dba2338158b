//! timm's names. Its VisionTransformer (`cls_token`, `pos_embed`, `patch_embed.proj`,
//! `blocks.N.{norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2}`, `norm`, `head`, and a CLIP
//! tower's `norm_pre`) packs query, key and value in one `qkv` as memtrain does; its ResNets use
//! torchvision's names, which pass through unchanged.
use super::{by_module, in_block, numbered, Format, How, Target};

pub struct Timm;

const BLOCK: &[(&str, &str, How)] = &[
    ("norm1.", "ln_1", How::Whole),
    ("attn.qkv.weight", "self_attention.in_proj_weight", How::Whole),
    ("attn.qkv.bias", "self_attention.in_proj_bias", How::Whole),
    ("attn.proj.", "self_attention.out_proj", How::Whole),
    ("norm2.", "ln_2", How::Whole),
    ("mlp.fc1.", "mlp.0", How::Whole),
    ("mlp.fc2.", "mlp.3", How::Whole),
];

const OUTSIDE: &[(&str, &str)] = &[
    ("patch_embed.proj", "conv_proj"),
    ("norm_pre", "ln_pre"),
    ("norm", "encoder.ln"),
    ("head", "heads.head"),
];

impl Format for Timm {
    fn name(&self) -> &'static str {
        "timm"
    }

    fn claims(&self, names: &[&str]) -> bool {
        names
            .iter()
            .any(|n| n.starts_with("patch_embed.") || n.starts_with("blocks."))
    }

    fn map(&self, name: &str) -> Option<Target> {
        let vit = names_vit(name);
        match name {
            "cls_token" => Some(Target::whole("class_token")),
            "pos_embed" => Some(Target::whole("encoder.pos_embedding")),
            _ if name.starts_with("blocks.") => {
                let (n, rest) = numbered(name, "blocks.")?;
                in_block(n, rest, BLOCK)
            }
            // `fc_norm` is an identity with the class-token pool, and other pools are not ViT's.
            _ if name.starts_with("fc_norm.") => None,
            _ if vit => by_module(name, OUTSIDE),
            // A ResNet: torchvision's names.
            _ => Some(Target::whole(name)),
        }
    }
}

/// Whether a name outside the blocks is one of the ViT's (the ResNet's `fc`, `bn1`, ... are not).
fn names_vit(name: &str) -> bool {
    OUTSIDE
        .iter()
        .any(|(m, _)| name.strip_prefix(m).is_some_and(|p| p.starts_with('.')))
}
