//! Hugging Face transformers' names: `ViTForImageClassification` and `ViTModel` (separate
//! `query`/`key`/`value` joined into memtrain's packed in-projection, q, k, v in that order),
//! as `save_pretrained` writes them and as transformers 5 names them in memory, and
//! `CLIPVisionModel` / `CLIPVisionModelWithProjection` (a CLIP checkpoint's text tower maps to
//! nothing); `LlamaForCausalLM` and `Qwen2ForCausalLM`, whose names are the llama preset's own.
use super::{by_module, in_block, numbered, Format, How, Target};

pub struct HuggingFace;

const Q: How = How::Part { index: 0, of: 3 };
const K: How = How::Part { index: 1, of: 3 };
const V: How = How::Part { index: 2, of: 3 };

const VIT_BLOCK: &[(&str, &str, How)] = &[
    ("layernorm_before.", "ln_1", How::Whole),
    ("attention.attention.query.weight", "self_attention.in_proj_weight", Q),
    ("attention.attention.key.weight", "self_attention.in_proj_weight", K),
    ("attention.attention.value.weight", "self_attention.in_proj_weight", V),
    ("attention.attention.query.bias", "self_attention.in_proj_bias", Q),
    ("attention.attention.key.bias", "self_attention.in_proj_bias", K),
    ("attention.attention.value.bias", "self_attention.in_proj_bias", V),
    ("attention.output.dense.", "self_attention.out_proj", How::Whole),
    ("layernorm_after.", "ln_2", How::Whole),
    ("intermediate.dense.", "mlp.0", How::Whole),
    ("output.dense.", "mlp.3", How::Whole),
    // transformers 5's own names.
    ("attention.q_proj.weight", "self_attention.in_proj_weight", Q),
    ("attention.k_proj.weight", "self_attention.in_proj_weight", K),
    ("attention.v_proj.weight", "self_attention.in_proj_weight", V),
    ("attention.q_proj.bias", "self_attention.in_proj_bias", Q),
    ("attention.k_proj.bias", "self_attention.in_proj_bias", K),
    ("attention.v_proj.bias", "self_attention.in_proj_bias", V),
    ("attention.o_proj.", "self_attention.out_proj", How::Whole),
    ("mlp.fc1.", "mlp.0", How::Whole),
    ("mlp.fc2.", "mlp.3", How::Whole),
];

const VIT_OUTSIDE: &[(&str, &str)] = &[
    ("embeddings.patch_embeddings.projection", "conv_proj"),
    ("layernorm", "encoder.ln"),
];

const CLIP_BLOCK: &[(&str, &str, How)] = &[
    ("layer_norm1.", "ln_1", How::Whole),
    ("self_attn.q_proj.weight", "self_attention.in_proj_weight", Q),
    ("self_attn.k_proj.weight", "self_attention.in_proj_weight", K),
    ("self_attn.v_proj.weight", "self_attention.in_proj_weight", V),
    ("self_attn.q_proj.bias", "self_attention.in_proj_bias", Q),
    ("self_attn.k_proj.bias", "self_attention.in_proj_bias", K),
    ("self_attn.v_proj.bias", "self_attention.in_proj_bias", V),
    ("self_attn.out_proj.", "self_attention.out_proj", How::Whole),
    ("layer_norm2.", "ln_2", How::Whole),
    ("mlp.fc1.", "mlp.0", How::Whole),
    ("mlp.fc2.", "mlp.3", How::Whole),
];

const CLIP_OUTSIDE: &[(&str, &str)] = &[
    ("embeddings.patch_embedding", "conv_proj"),
    ("embeddings.position_embedding", "encoder.pos_embedding"),
    ("pre_layrnorm", "ln_pre"),
    ("post_layernorm", "encoder.ln"),
];

impl Format for HuggingFace {
    fn name(&self) -> &'static str {
        "huggingface"
    }

    fn claims(&self, names: &[&str]) -> bool {
        names.iter().any(|n| {
            [
                "vit.",
                "vision_model.",
                "embeddings.patch_embeddings.",
                "model.embed_tokens.",
            ]
            .iter()
            .any(|p| n.starts_with(p))
        })
    }

    fn map(&self, name: &str) -> Option<Target> {
        if let Some(rest) = name.strip_prefix("vision_model.") {
            return clip(rest);
        }
        if name.starts_with("model.") || name.starts_with("lm_head.") {
            return Some(Target::whole(name));
        }
        match name {
            "visual_projection.weight" => Some(Target::whole("projection.weight")),
            _ if name.starts_with("classifier.") => by_module(name, &[("classifier", "heads.head")]),
            // ViTForImageClassification prefixes the model with `vit.`; ViTModel does not.
            _ => vit(name.strip_prefix("vit.").unwrap_or(name)),
        }
    }
}

fn vit(name: &str) -> Option<Target> {
    match name {
        "embeddings.cls_token" => Some(Target::whole("class_token")),
        "embeddings.position_embeddings" => Some(Target::whole("encoder.pos_embedding")),
        _ => {
            let block = numbered(name, "encoder.layer.").or_else(|| numbered(name, "layers."));
            match block {
                Some((n, rest)) => in_block(n, rest, VIT_BLOCK),
                None => by_module(name, VIT_OUTSIDE),
            }
        }
    }
}

fn clip(name: &str) -> Option<Target> {
    match name {
        "embeddings.class_embedding" => Some(Target::whole("class_token")),
        // `position_embedding` is an Embedding: its table is `[seq, d]`.
        "embeddings.position_embedding.weight" => Some(Target::whole("encoder.pos_embedding")),
        _ => match numbered(name, "encoder.layers.") {
            Some((n, rest)) => in_block(n, rest, CLIP_BLOCK),
            None => by_module(name, CLIP_OUTSIDE),
        },
    }
}
