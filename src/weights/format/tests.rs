use super::*;
use crate::spec::InitFormat;

fn target(var: &str, how: How) -> Option<Target> {
    Some(Target { var: var.into(), how })
}

#[test]
fn each_format_is_told_from_its_names() {
    let pick_name = |names: &[&str]| pick(InitFormat::Auto, names).name();
    assert_eq!(pick_name(&["conv1.weight", "fc.weight"]), "torchvision");
    assert_eq!(pick_name(&["cls_token", "blocks.0.attn.qkv.weight"]), "timm");
    assert_eq!(pick_name(&["vit.embeddings.cls_token"]), "huggingface");
    assert_eq!(pick_name(&["vision_model.embeddings.class_embedding"]), "huggingface");
    assert_eq!(pick_name(&["visual.conv1.weight"]), "open_clip");
    assert_eq!(pick(InitFormat::Timm, &["conv1.weight"]).name(), "timm");
}

#[test]
fn names_map_to_the_vit_presets_variables() {
    let b = "encoder.layers.encoder_layer_3";
    let timm = pick(InitFormat::Timm, &[]);
    assert_eq!(
        timm.map("blocks.3.attn.qkv.weight"),
        target(&format!("{b}.self_attention.in_proj_weight"), How::Whole)
    );
    assert_eq!(
        timm.map("blocks.3.norm1.bias"),
        target(&format!("{b}.ln_1.bias"), How::Whole)
    );
    assert_eq!(
        timm.map("blocks.3.mlp.fc2.weight"),
        target(&format!("{b}.mlp.3.weight"), How::Whole)
    );
    assert_eq!(timm.map("norm.weight"), target("encoder.ln.weight", How::Whole));
    assert_eq!(timm.map("norm_pre.bias"), target("ln_pre.bias", How::Whole));
    assert_eq!(timm.map("head.bias"), target("heads.head.bias", How::Whole));
    assert_eq!(
        timm.map("layer1.0.bn1.running_mean"),
        target("layer1.0.bn1.running_mean", How::Whole)
    );

    let hf = pick(InitFormat::Huggingface, &[]);
    assert_eq!(
        hf.map("vit.encoder.layer.3.attention.attention.key.weight"),
        target(
            &format!("{b}.self_attention.in_proj_weight"),
            How::Part { index: 1, of: 3 }
        )
    );
    assert_eq!(
        hf.map("encoder.layer.3.output.dense.bias"),
        target(&format!("{b}.mlp.3.bias"), How::Whole)
    );
    assert_eq!(hf.map("vit.layernorm.weight"), target("encoder.ln.weight", How::Whole));
    assert_eq!(hf.map("classifier.weight"), target("heads.head.weight", How::Whole));
    assert_eq!(hf.map("pooler.dense.weight"), None);
    assert_eq!(
        hf.map("vision_model.encoder.layers.3.self_attn.v_proj.bias"),
        target(
            &format!("{b}.self_attention.in_proj_bias"),
            How::Part { index: 2, of: 3 }
        )
    );
    assert_eq!(
        hf.map("vision_model.pre_layrnorm.weight"),
        target("ln_pre.weight", How::Whole)
    );
    assert_eq!(
        hf.map("vision_model.post_layernorm.bias"),
        target("encoder.ln.bias", How::Whole)
    );
    assert_eq!(hf.map("vision_model.embeddings.position_ids"), None);
    assert_eq!(hf.map("text_model.embeddings.token_embedding.weight"), None);

    let oc = pick(InitFormat::OpenClip, &[]);
    assert_eq!(oc.map("visual.proj"), target("projection.weight", How::Transposed));
    assert_eq!(
        oc.map("visual.transformer.resblocks.3.mlp.c_fc.weight"),
        target(&format!("{b}.mlp.0.weight"), How::Whole)
    );
    assert_eq!(oc.map("visual.conv1.weight"), target("conv_proj.weight", How::Whole));
    assert_eq!(oc.map("token_embedding.weight"), None);
}
