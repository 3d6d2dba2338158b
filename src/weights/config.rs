//! A Hugging Face model directory's `config.json` (`ViTConfig`, `CLIPVisionConfig`, or a
//! `CLIPConfig`'s `vision_config`) as the vit preset's options: the sizes a checkpoint was
//! built with fill the options a spec leaves out, and an option the spec sets otherwise is an
//! error that names both.
use std::path::Path;

use toml::Value;

/// One `[model.vit]` option a config gives, and the config's key for it.
#[derive(Debug, Clone, PartialEq)]
pub struct Given {
    pub option: &'static str,
    pub value: Value,
    pub key: &'static str,
}

/// (config key, vit option) pairs of integer sizes.
const SIZES: [(&str, &str); 7] = [
    ("hidden_size", "hidden_dim"),
    ("num_hidden_layers", "layers"),
    ("num_attention_heads", "heads"),
    ("intermediate_size", "mlp_dim"),
    ("image_size", "image_size"),
    ("patch_size", "patch_size"),
    ("num_channels", "in_channels"),
];

/// The options `config` gives. `projection`: whether the checkpoint holds a projection (a
/// `CLIPVisionConfig` names a `projection_dim` whether or not its model has one).
pub fn vit_options(config: &Path, projection: bool) -> Result<Vec<Given>, String> {
    let text = std::fs::read_to_string(config).map_err(|e| format!("cannot read {}: {e}", config.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", config.display()))?;
    let c = json.get("vision_config").unwrap_or(&json);
    let model_type = c["model_type"]
        .as_str()
        .or(json["model_type"].as_str())
        .unwrap_or_default();
    let clip = model_type.starts_with("clip");
    let mut given = vec![];
    for (key, option) in SIZES {
        if let Some(v) = c[key].as_i64() {
            given.push(Given {
                option,
                value: Value::Integer(v),
                key,
            });
        }
    }
    if let Some(eps) = c["layer_norm_eps"].as_f64() {
        given.push(Given {
            option: "layer_norm_eps",
            value: Value::Float(eps),
            key: "layer_norm_eps",
        });
    }
    if let Some(act) = c["hidden_act"].as_str() {
        let ours = match act {
            "gelu" | "quick_gelu" => act,
            other => {
                return Err(format!(
                "{} has hidden_act = \"{other}\", which the vit preset does not compute (it has gelu and quick_gelu)",
                config.display()
            ))
            }
        };
        given.push(Given {
            option: "activation",
            value: Value::String(ours.into()),
            key: "hidden_act",
        });
    }
    if clip {
        given.push(Given {
            option: "pre_norm",
            value: Value::Boolean(true),
            key: "model_type",
        });
        given.push(Given {
            option: "patch_bias",
            value: Value::Boolean(false),
            key: "model_type",
        });
        let dim = c["projection_dim"]
            .as_i64()
            .or(json["projection_dim"].as_i64())
            .filter(|_| projection);
        given.push(Given {
            option: "projection_dim",
            value: Value::Integer(dim.unwrap_or(0)),
            key: "projection_dim",
        });
    }
    Ok(given)
}

/// (config key, llama option) pairs the config gives under the same name.
const LLAMA_SIZES: [&str; 7] = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "head_dim",
];

/// The `[model.llama]` options a `LlamaConfig` or `Qwen2Config` gives (as transformers 4 or 5
/// writes it: `rope_theta` and `rope_scaling`, or `rope_parameters`); a key it leaves out is the
/// config class's default, as transformers reads it. What the preset does not compute (another
/// activation, MLP biases, sliding windows, another rotary scaling) is refused.
pub fn llama_options(config: &Path) -> Result<Vec<Given>, String> {
    let text = std::fs::read_to_string(config).map_err(|e| format!("cannot read {}: {e}", config.display()))?;
    let c: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", config.display()))?;
    let refuse = |what: String| {
        Err(format!(
            "{} has {what}, which the llama preset does not compute",
            config.display()
        ))
    };
    let model_type = c["model_type"].as_str().unwrap_or("llama");
    if !matches!(model_type, "llama" | "qwen2") {
        return refuse(format!("model_type = \"{model_type}\" (it builds llama and qwen2)"));
    }
    let qwen2 = model_type == "qwen2";
    if let Some(act) = c["hidden_act"].as_str().filter(|a| *a != "silu") {
        return refuse(format!("hidden_act = \"{act}\" (it has silu)"));
    }
    if c["mlp_bias"].as_bool() == Some(true) {
        return refuse("mlp_bias = true".into());
    }
    let sliding = c["layer_types"]
        .as_array()
        .is_some_and(|l| l.iter().any(|t| t != "full_attention"));
    if c["use_sliding_window"].as_bool() == Some(true) || sliding {
        return refuse("sliding-window attention".into());
    }
    let int = |key: &'static str, v: i64| Given {
        option: key,
        value: Value::Integer(v),
        key,
    };
    let mut given: Vec<Given> = LLAMA_SIZES
        .iter()
        .filter_map(|&k| c[k].as_i64().map(|v| int(k, v)))
        .collect();
    let heads = c["num_attention_heads"].as_i64();
    if let Some(kv) = c["num_key_value_heads"].as_i64().or(heads) {
        given.push(int("num_key_value_heads", kv));
    }
    let flag = |option: &'static str, key: &'static str, v: bool| Given {
        option,
        value: Value::Boolean(v),
        key,
    };
    given.push(flag(
        "tie_word_embeddings",
        "tie_word_embeddings",
        c["tie_word_embeddings"].as_bool().unwrap_or(false),
    ));
    let (bias, qkv) = match qwen2 {
        true => (false, true),
        false => (c["attention_bias"].as_bool().unwrap_or(false), false),
    };
    given.push(flag("attention_bias", "attention_bias", bias));
    given.push(flag("qkv_bias", "model_type", qkv));
    let eps = c["rms_norm_eps"].as_f64().unwrap_or(1e-6);
    given.push(Given {
        option: "rms_norm_eps",
        value: Value::Float(eps),
        key: "rms_norm_eps",
    });
    given.extend(rope(&c).map_err(|what| {
        format!(
            "{} has {what}, which the llama preset does not compute",
            config.display()
        )
    })?);
    Ok(given)
}

/// `rope_theta` and any Llama 3 `rope_scaling`, from `rope_parameters` (transformers 5) or
/// `rope_theta` and `rope_scaling` (transformers 4).
fn rope(c: &serde_json::Value) -> Result<Vec<Given>, String> {
    let key = if c["rope_parameters"].is_object() {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    let p = &c[key];
    let theta = p["rope_theta"].as_f64().or(c["rope_theta"].as_f64()).unwrap_or(10000.0);
    let mut given = vec![Given {
        option: "rope_theta",
        value: Value::Float(theta),
        key: "rope_theta",
    }];
    if let Some(f) = p["partial_rotary_factor"]
        .as_f64()
        .or(c["partial_rotary_factor"].as_f64())
        .filter(|f| *f != 1.0)
    {
        return Err(format!("partial_rotary_factor = {f}"));
    }
    match p["rope_type"].as_str().or(p["type"].as_str()).unwrap_or("default") {
        "default" => {}
        "llama3" => {
            let mut t = toml::Table::new();
            t.insert("rope_type".into(), Value::String("llama3".into()));
            for k in ["factor", "low_freq_factor", "high_freq_factor"] {
                let v = p[k].as_f64().ok_or_else(|| format!("a llama3 {key} without {k}"))?;
                t.insert(k.into(), Value::Float(v));
            }
            let old = p["original_max_position_embeddings"]
                .as_i64()
                .or(c["max_position_embeddings"].as_i64());
            let old = old.ok_or_else(|| format!("a llama3 {key} without original_max_position_embeddings"))?;
            t.insert("original_max_position_embeddings".into(), Value::Integer(old));
            given.push(Given {
                option: "rope_scaling",
                value: Value::Table(t),
                key,
            });
        }
        other => return Err(format!("rope_type = \"{other}\" (it has the default and llama3)")),
    }
    Ok(given)
}

/// Fills `table`'s options (those in `known`) from `given` where the spec leaves them out; each
/// one it sets otherwise comes back as (option, message). `image_size` may differ: the position
/// embeddings are resampled to the spec's.
pub fn follow(table: &mut toml::Table, known: &[String], given: &[Given], config: &Path) -> Vec<(String, String)> {
    let mut problems = vec![];
    for g in given.iter().filter(|g| known.iter().any(|k| k == g.option)) {
        match table.get(g.option) {
            None => {
                table.insert(g.option.into(), g.value.clone());
            }
            Some(_) if g.option == "image_size" => {}
            Some(ours) if !same(ours, &g.value) => problems.push((
                g.option.to_owned(),
                format!(
                    "is {ours}, but the checkpoint's {} says {} = {}; leave {} out to take the checkpoint's, or use a checkpoint of this size",
                    config.display(),
                    g.key,
                    g.value,
                    g.option
                ),
            )),
            Some(_) => {}
        }
    }
    problems
}

fn same(a: &Value, b: &Value) -> bool {
    if let (Value::Table(x), Value::Table(y)) = (a, b) {
        return x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| same(v, w)));
    }
    match (
        a.as_float().or(a.as_integer().map(|i| i as f64)),
        b.as_float().or(b.as_integer().map(|i| i as f64)),
    ) {
        (Some(x), Some(y)) => (x - y).abs() <= 1e-9 * x.abs().max(y.abs()),
        _ => a == b,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_fills_what_the_spec_leaves_out_and_names_what_it_contradicts() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        std::fs::write(
            &config,
            r#"{"model_type": "vit", "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
                "intermediate_size": 24, "image_size": 32, "patch_size": 8, "num_channels": 3,
                "layer_norm_eps": 1e-12, "hidden_act": "gelu"}"#,
        )
        .unwrap();
        let given = vit_options(&config, false).unwrap();
        let known: Vec<String> = [
            "hidden_dim",
            "layers",
            "heads",
            "mlp_dim",
            "image_size",
            "patch_size",
            "in_channels",
        ]
        .map(String::from)
        .to_vec();
        let mut table: toml::Table = "heads = 4\nimage_size = 64".parse().unwrap();
        let problems = follow(&mut table, &known, &given, &config);
        assert_eq!(table["hidden_dim"].as_integer(), Some(16));
        assert_eq!(
            table["image_size"].as_integer(),
            Some(64),
            "resampled, not contradicted"
        );
        assert!(!table.contains_key("layer_norm_eps"), "not an option the preset knows");
        assert_eq!(problems.len(), 1);
        assert_eq!(problems[0].0, "heads");
        assert!(problems[0].1.contains("num_attention_heads = 2"), "{}", problems[0].1);
        assert!(problems[0].1.contains("config.json"), "{}", problems[0].1);
    }

    #[test]
    fn a_llama_config_gives_hugging_faces_defaults_and_refuses_what_the_preset_lacks() {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("config.json");
        let given = |text: &str| {
            std::fs::write(&config, text).unwrap();
            llama_options(&config)
        };
        // transformers 4's names: rope_theta beside rope_scaling; left-out keys the class's defaults.
        let g = given(
            r#"{"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "rope_theta": 500000.0,
                "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}}"#,
        )
        .unwrap();
        let value = |o: &str| g.iter().find(|x| x.option == o).map(|x| x.value.clone());
        assert_eq!(value("num_key_value_heads"), Some(Value::Integer(8)));
        assert_eq!(value("rms_norm_eps"), Some(Value::Float(1e-6)));
        assert_eq!(value("rope_theta"), Some(Value::Float(500000.0)));
        assert_eq!(value("tie_word_embeddings"), Some(Value::Boolean(false)));
        let scaling = value("rope_scaling").unwrap();
        assert_eq!(scaling["factor"].as_float(), Some(32.0));
        // A spec's table that says the same with integers agrees with it; another factor does not.
        let spec: toml::Table = "rope_type = \"llama3\"\nfactor = 32\nlow_freq_factor = 1\nhigh_freq_factor = 4\noriginal_max_position_embeddings = 8192".parse().unwrap();
        assert!(same(&Value::Table(spec.clone()), &scaling));
        let mut other = spec;
        other.insert("factor".into(), Value::Integer(8));
        assert!(!same(&Value::Table(other), &scaling));
        assert_eq!(scaling["rope_type"].as_str(), Some("llama3"));
        // Qwen2: biases on q, k and v only.
        let g = given(r#"{"model_type": "qwen2", "rope_scaling": null, "use_sliding_window": false}"#).unwrap();
        assert!(g
            .iter()
            .any(|x| x.option == "qkv_bias" && x.value == Value::Boolean(true)));
        assert!(!g.iter().any(|x| x.option == "rope_scaling"));
        for (text, says) in [
            (r#"{"model_type": "vit"}"#, "model_type = \"vit\""),
            (r#"{"hidden_act": "gelu"}"#, "hidden_act = \"gelu\""),
            (
                r#"{"model_type": "qwen2", "use_sliding_window": true}"#,
                "sliding-window",
            ),
            (
                r#"{"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}"#,
                "rope_type = \"yarn\"",
            ),
        ] {
            let e = given(text).unwrap_err();
            assert!(
                e.contains(says) && e.contains("the llama preset does not compute"),
                "{e}"
            );
        }
    }
}
