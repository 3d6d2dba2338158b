//! `model.init_from` as the presets see it: a Hugging Face directory's `config.json` filling the
//! vit preset's sizes (spec → plan → components: it happens while the spec is validated, so
//! `check` and `run` see the same model).
use super::vit;
use crate::spec::schema::Model;
use crate::weights::{self, Checkpoint};

/// The checkpoint's header can be read (a pickle is refused here, at the spec's line), and a
/// vit preset takes the sizes its `config.json` gives where the spec leaves them out; a size the
/// spec sets otherwise is a problem naming the option and the file.
pub fn follow_checkpoint(m: &mut Model) -> Vec<(String, String)> {
    let Some(path) = m.init_from.clone().filter(|p| p.exists()) else {
        return vec![];
    };
    let ck = match Checkpoint::headers(&path) {
        Ok(ck) => ck,
        Err(e) => return vec![at_init_from(&format!("{e:#}"))],
    };
    let Some(config) = ck.config.as_ref().filter(|_| m.preset == "vit") else {
        return vec![];
    };
    let projection = ck.entries.iter().any(|e| e.name == "visual_projection.weight");
    let given = match weights::config::vit_options(config, projection) {
        Ok(g) => g,
        Err(msg) => return vec![at_init_from(&msg)],
    };
    let known: Vec<String> = match toml::Value::try_from(vit::VitOptions::default()) {
        Ok(toml::Value::Table(t)) => t.keys().cloned().collect(),
        _ => vec![],
    };
    let table = match m
        .options
        .entry("vit".to_owned())
        .or_insert_with(|| toml::Value::Table(Default::default()))
    {
        toml::Value::Table(t) => t,
        _ => return vec![],
    };
    weights::config::follow(table, &known, &given, config)
        .into_iter()
        .map(|(k, msg)| (format!("model.vit.{k}"), msg))
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
