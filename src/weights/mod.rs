//! Other libraries' checkpoints as `model.init_from` reads them: safetensors files (one, a
//! sharded index, or a Hugging Face model directory) read tensor by tensor from a memory map
//! (`read`), their names in torchvision's, timm's, Hugging Face's or open_clip's scheme mapped to
//! memtrain's (`format`), the plan of which tensor fills which variable (`plan`) and carrying it
//! out (`load`). A Hugging Face directory's `config.json` gives the vit preset's sizes
//! (`config`). This module reads only `[model]`'s `init_*` keys and knows no preset: the caller
//! gives the model's variables and which of them are its head.
pub mod config;
mod format;
mod load;
pub mod plan;
mod read;
mod resample;

use std::collections::HashMap;
use std::path::Path;

use anyhow::Result;
use tch::Tensor;

use crate::exit::UsageError;
use crate::human::few;
use crate::spec::Model;

pub use format::How;
pub use plan::{glob, LoadPlan, Mismatch, Shaped};
pub use read::{pickle_refused, Checkpoint};
pub use resample::pos_embed as resample_pos_embed;

/// The plan for a model's variables (names and shapes) and head from the checkpoint's header
/// alone, as `model`'s `init_format` and `init_skip` say.
pub fn plan_for(ck: &Checkpoint, vars: &[Shaped], head: &[String], model: &Model) -> Result<LoadPlan, UsageError> {
    let checkpoint: Vec<Shaped> = ck.entries.iter().map(|e| (e.name.clone(), e.shape.clone())).collect();
    let names: Vec<&str> = checkpoint.iter().map(|(n, _)| n.as_str()).collect();
    let format = format::pick(model.init_format, &names);
    plan::plan(&plan::Inputs {
        checkpoint: &checkpoint,
        vars,
        head,
        skip: &model.init_skip,
        format,
    })
    .map_err(|m| {
        let mut msg = m.message(&format!("model.init_from {} ({} names)", ck.shown, format.name()));
        if let Some(hint) = sizes_hint(ck, model) {
            msg += &format!("\n  {hint}");
        }
        UsageError(msg)
    })
}

/// Why a vit or llama may have other sizes than its checkpoint: they came from no
/// `config.json`, so they are the spec's (the preset's defaults where unset).
fn sizes_hint(ck: &Checkpoint, model: &Model) -> Option<String> {
    let preset = model.preset.as_str();
    if ck.config.is_some() || !["vit", "llama"].contains(&preset) {
        return None;
    }
    let path = model.init_from.as_deref()?;
    let dir = match path.parent() {
        Some(d) if d.as_os_str().is_empty() => Path::new("."),
        Some(d) => d,
        None => Path::new("."),
    };
    let beside = !path.is_dir() && dir.join("config.json").is_file();
    Some(match beside {
        true => format!(
            "the sizes are the spec's [model.{preset}] (the preset's defaults where unset), as a file names none; init_from = \"{}\", the directory, takes them from its config.json",
            dir.display()
        ),
        false => format!(
            "the sizes are the spec's [model.{preset}] (the preset's defaults where unset): {} has no config.json to take them from; set the checkpoint's sizes and options in [model.{preset}]",
            path.display()
        ),
    })
}

/// `model.init_from` into the variables: the plan made from the header, then each tensor read
/// and put in its variable. The plan says what was kept, created, dropped and resampled.
pub fn load(vars: &HashMap<String, Tensor>, head: &[String], model: &Model, path: &Path) -> Result<Loaded> {
    let mut ck = Checkpoint::headers(path)?;
    let shaped = shapes(vars);
    let plan = plan_for(&ck, &shaped, head, model)?;
    ck.map()?;
    let peak_host_bytes = load::fill(vars, &ck, &plan)?;
    let largest_bytes = ck.largest_bytes() as u64;
    Ok(Loaded {
        plan,
        peak_host_bytes,
        largest_bytes,
    })
}

/// A load done: its plan, and the host memory it took.
pub struct Loaded {
    pub plan: LoadPlan,
    /// The most anonymous host memory the load held above the process's before it.
    pub peak_host_bytes: u64,
    /// The checkpoint's largest tensor.
    pub largest_bytes: u64,
}

/// A memtrain checkpoint's tensors into the variables, names and shapes matching exactly.
pub fn copy_exact(vars: &HashMap<String, Tensor>, tensors: &[(String, Tensor)], what: &str) -> Result<()> {
    load::exact(vars, tensors, what)
}

/// Every variable's name and shape, in name order.
pub fn shapes(vars: &HashMap<String, Tensor>) -> Vec<Shaped> {
    let mut v: Vec<Shaped> = vars.iter().map(|(n, t)| (n.clone(), t.size())).collect();
    v.sort();
    v
}

impl Mismatch {
    /// The error: what the model lacks, what is shaped otherwise, and what the file had unused.
    pub fn message(&self, what: &str) -> String {
        let mut msg = format!("{what} does not match the model:");
        if !self.missing.is_empty() {
            msg += &format!(
                "\n  missing (in the model, not in the file): {}",
                few(&self.missing, ", ")
            );
        }
        if !self.misshaped.is_empty() {
            msg += &format!("\n  mis-shaped: {}", few(&self.misshaped, "; "));
        }
        if !self.missing.is_empty() && !self.unused.is_empty() {
            msg += &format!(
                "\n  unused (in the file, taken by no variable): {}",
                few(&self.unused, ", ")
            );
        }
        msg += "\n  A head that differs is created fresh; model.init_skip leaves more variables as built, and model.init_format names the checkpoint's library if it was told wrong";
        msg
    }
}

impl LoadPlan {
    /// One line of counts, as the run prints and `check` shows.
    pub fn counts_line(&self) -> String {
        format!(
            "{} kept, {} created, {} dropped, 0 missing, {} resampled ({} names)",
            self.kept.len(),
            self.created.len(),
            self.dropped.len(),
            self.resampled.len(),
            self.format
        )
    }

    /// The counts line and, below it, which variables are created, which tensors dropped, and
    /// which embeddings resampled from which grid.
    pub fn describe(&self) -> String {
        let mut s = self.counts_line();
        if !self.created.is_empty() {
            s += &format!("\n  created (initialised as built): {}", few(&self.created, ", "));
        }
        if !self.dropped.is_empty() {
            s += &format!("\n  dropped (in the file, not loaded): {}", few(&self.dropped, ", "));
        }
        for step in self.steps.iter().filter(|s| s.resample.is_some()) {
            let (from, to) = step.resample.unwrap_or_default();
            s += &format!(
                "\n  resampled: {} from a {from}×{from} grid to {to}×{to} (bicubic, as timm's resample_abs_pos_embed)",
                step.var
            );
        }
        s
    }
}
