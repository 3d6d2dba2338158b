use super::*;
use crate::spec::InitFormat;
use crate::weights::format::pick;

fn shaped(list: &[(&str, &[i64])]) -> Vec<Shaped> {
    list.iter().map(|(n, s)| (n.to_string(), s.to_vec())).collect()
}

fn plan_of(
    checkpoint: &[(&str, &[i64])],
    vars: &[(&str, &[i64])],
    skip: &[&str],
    format: InitFormat,
) -> Result<LoadPlan, Mismatch> {
    let (checkpoint, vars) = (shaped(checkpoint), shaped(vars));
    let names: Vec<&str> = checkpoint.iter().map(|(n, _)| n.as_str()).collect();
    let skip: Vec<String> = skip.iter().map(|s| s.to_string()).collect();
    plan(&Inputs {
        checkpoint: &checkpoint,
        vars: &vars,
        head: &["fc".to_string()],
        skip: &skip,
        format: pick(format, &names),
    })
}

const MODEL: &[(&str, &[i64])] = &[("conv.weight", &[4, 3]), ("fc.weight", &[3, 4]), ("fc.bias", &[3])];

#[test]
fn a_head_of_another_size_is_created_and_its_tensors_dropped() {
    let p = plan_of(
        &[
            ("conv.weight", &[4, 3]),
            ("fc.weight", &[1000, 4]),
            ("fc.bias", &[1000]),
            ("extra", &[1]),
        ],
        MODEL,
        &[],
        InitFormat::Auto,
    )
    .unwrap();
    assert_eq!(p.kept, ["conv.weight"]);
    assert_eq!(p.created, ["fc.bias", "fc.weight"]);
    assert_eq!(p.dropped, ["extra", "fc.bias", "fc.weight"]);
    assert_eq!(p.steps.len(), 1);
    // No head in the checkpoint at all (CLIP): created too.
    let p = plan_of(&[("conv.weight", &[4, 3])], MODEL, &[], InitFormat::Auto).unwrap();
    assert_eq!(p.created, ["fc.bias", "fc.weight"]);
}

#[test]
fn init_skip_leaves_its_variables_as_built() {
    let ck: &[(&str, &[i64])] = &[("conv.weight", &[4, 3]), ("fc.weight", &[3, 4]), ("fc.bias", &[3])];
    let p = plan_of(ck, MODEL, &["conv.*"], InitFormat::Auto).unwrap();
    assert_eq!(p.kept, ["fc.bias", "fc.weight"]);
    assert_eq!(
        (p.created.as_slice(), p.dropped.as_slice()),
        (&["conv.weight".to_string()][..], &["conv.weight".to_string()][..])
    );
}

#[test]
fn a_missing_or_mis_shaped_body_tensor_is_refused_with_both_shapes() {
    let m = plan_of(
        &[("conv.weight", &[4, 2]), ("fc.weight", &[3, 4]), ("fc.bias", &[3])],
        MODEL,
        &[],
        InitFormat::Auto,
    )
    .unwrap_err();
    assert_eq!(m.misshaped, ["conv.weight: file [4, 2], model [4, 3]"]);
    assert!(m.missing.is_empty(), "said once, as mis-shaped");
    let m = plan_of(&[("renamed", &[4, 3])], MODEL, &[], InitFormat::Auto).unwrap_err();
    assert_eq!(m.missing, ["conv.weight"]);
    assert_eq!(m.unused, ["renamed"]);
}

#[test]
fn query_key_and_value_join_and_a_class_token_drops_its_leading_ones() {
    let b = "encoder.layers.encoder_layer_0.self_attention";
    let vars = shaped(&[(&format!("{b}.in_proj_weight"), &[6, 2]), ("class_token", &[1, 1, 2])]);
    let vars: Vec<(&str, &[i64])> = vars.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    let q = "vision_model.encoder.layers.0.self_attn";
    let ck = shaped(&[
        (&format!("{q}.q_proj.weight"), &[2, 2]),
        (&format!("{q}.k_proj.weight"), &[2, 2]),
        (&format!("{q}.v_proj.weight"), &[2, 2]),
        ("vision_model.embeddings.class_embedding", &[2]),
    ]);
    let ck: Vec<(&str, &[i64])> = ck.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    let p = plan_of(&ck, &vars, &[], InitFormat::Auto).unwrap();
    assert_eq!(p.format, "huggingface");
    assert_eq!(p.kept.len(), 2);
    // Two of three parts: the in-projection is missing.
    let m = plan_of(&ck[1..], &vars, &[], InitFormat::Auto).unwrap_err();
    assert_eq!(m.missing, [format!("{b}.in_proj_weight")]);
}

#[test]
fn a_position_embedding_of_another_grid_is_resampled() {
    let vars: &[(&str, &[i64])] = &[("encoder.pos_embedding", &[1, 37, 8])];
    let p = plan_of(&[("pos_embed", &[1, 17, 8])], vars, &[], InitFormat::Timm).unwrap();
    assert_eq!(p.resampled, ["encoder.pos_embedding"]);
    assert_eq!(p.steps[0].resample, Some((4, 6)));
    // Not a square grid after the class token: refused.
    assert!(plan_of(&[("pos_embed", &[1, 18, 8])], vars, &[], InitFormat::Timm).is_err());
}

#[test]
fn glob_patterns_match_any_run_of_characters() {
    assert!(glob("heads.*", "heads.head.weight"));
    assert!(glob("*.bias", "encoder.ln.bias"));
    assert!(glob(
        "encoder.layers.encoder_layer_?.mlp.*",
        "encoder.layers.encoder_layer_3.mlp.0.weight"
    ));
    assert!(!glob("heads.*", "encoder.heads"));
    assert!(glob("fc", "fc") && !glob("fc", "fc1"));
}

#[test]
fn each_head_unit_is_kept_or_made_fresh_on_its_own() {
    // A LoRA adapter the base checkpoint lacks is made fresh; the head it has, fitting, is kept.
    let vars: &[(&str, &[i64])] = &[
        ("fc.weight", &[3, 4]),
        ("fc.bias", &[3]),
        ("mlp.lora_A.weight", &[2, 4]),
    ];
    let (checkpoint, vars) = (shaped(&[("fc.weight", &[3, 4]), ("fc.bias", &[3])]), shaped(vars));
    let p = plan(&Inputs {
        checkpoint: &checkpoint,
        vars: &vars,
        head: &["fc".to_string(), "mlp.lora_A".to_string()],
        skip: &[],
        format: pick(InitFormat::Torchvision, &[]),
    })
    .unwrap();
    assert_eq!(p.kept, ["fc.bias", "fc.weight"]);
    assert_eq!(p.created, ["mlp.lora_A.weight"]);
}
