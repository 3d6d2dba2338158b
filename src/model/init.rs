//! `model.init_from` as the presets see it: a Hugging Face directory's `config.json` filling the
//! vit or llama preset's sizes (spec → plan → components: it happens while the spec is validated, so
//! `check` and `run` see the same model).
use super::vit;
use crate::spec::schema::Model;
use crate::weights::{self, Checkpoint};

/// The checkpoint's header can be read (a pickle is refused here, at the spec's line), and a
/// vit or llama preset takes the sizes its `config.json` gives where the spec leaves them out; a size the
/// spec sets otherwise is a problem naming the option and the file.
pub fn follow_checkpoint(m: &mut Model) -> Vec<(String, String)> {
    let Some(path) = m.init_from.clone().filter(|p| p.exists()) else {
        return vec![];
    };
    let ck = match Checkpoint::headers(&path) {
        Ok(ck) => ck,
        Err(e) => return vec![at_init_from(&format!("{e:#}"))],
    };
    let Some(config) = ck
        .config
        .as_ref()
        .filter(|_| ["vit", "llama"].contains(&m.preset.as_str()))
    else {
        return vec![];
    };
    let given = match m.preset.as_str() {
        "llama" => weights::config::llama_options(config),
        _ => {
            let projection = ck.entries.iter().any(|e| e.name == "visual_projection.weight");
            weights::config::vit_options(config, projection)
        }
    };
    let given = match given {
        Ok(g) => g,
        Err(msg) => return vec![at_init_from(&msg)],
    };
    // Every option a llama config gives is the preset's; a vit config also names keys the
    // preset does not have.
    let known: Vec<String> = match m.preset.as_str() {
        "llama" => given.iter().map(|g| g.option.to_owned()).collect(),
        _ => match toml::Value::try_from(vit::VitOptions::default()) {
            Ok(toml::Value::Table(t)) => t.keys().cloned().collect(),
            _ => vec![],
        },
    };
    let preset = m.preset.clone();
    let table = match m
        .options
        .entry(preset.clone())
        .or_insert_with(|| toml::Value::Table(Default::default()))
    {
        toml::Value::Table(t) => t,
        _ => return vec![],
    };
    weights::config::follow(table, &known, &given, config)
        .into_iter()
        .map(|(k, msg)| (format!("model.{preset}.{k}"), msg))
        .collect()
}

/// A message about `model.init_from`, as a problem at that key.
pub fn at_init_from(msg: &str) -> (String, String) {
    let msg = msg
        .strip_prefix("model.init_from: ")
        .or(msg.strip_prefix("model.init_from "))
        .unwrap_or(msg);
    ("model.init_from".into(), msg.to_owned())
}
