//! Carrying out a load plan: each checkpoint tensor made on the host in its own type, put into
//! its variable (converted to the variable's type, on the variable's device) and dropped before
//! the next is made.
use std::collections::HashMap;

use anyhow::{Context, Result};
use tch::Tensor;

use super::format::How;
use super::plan::{LoadPlan, Step};
use super::read::{Checkpoint, Staging};
use crate::exit::UsageError;
use crate::human::few;
use crate::sysmem;

/// Fills `vars` as `plan` says from the mapped checkpoint, each tensor made in one staging
/// buffer. Returns the most anonymous host memory the load held above what the process held
/// before it, read while each tensor is held.
pub fn fill(vars: &HashMap<String, Tensor>, ck: &Checkpoint, plan: &LoadPlan) -> Result<u64> {
    let before = sysmem::rss_anon_now();
    let mut staging = Staging::new(ck.largest_bytes())?;
    let mut peak = 0;
    let entries = ck.by_name();
    for step in &plan.steps {
        let entry = entries
            .get(step.tensor.as_str())
            .with_context(|| format!("{} has no tensor {}", ck.shown, step.tensor))?;
        let var = &vars[&step.var];
        let t = ck.tensor(entry, &mut staging)?;
        tch::no_grad(|| put(var, &t, step)).with_context(|| format!("filling {} from {}", step.var, step.tensor))?;
        peak = peak.max(sysmem::rss_anon_now().saturating_sub(before));
    }
    Ok(peak)
}

fn put(var: &Tensor, t: &Tensor, step: &Step) -> Result<()> {
    let mut dst = var.shallow_clone();
    let t = match step.how {
        How::Whole => t.shallow_clone(),
        How::Transposed => t.f_tr()?,
        How::Part { index, of } => {
            let n = var.size()[0] / of;
            dst = var.f_narrow(0, index * n, n)?;
            t.shallow_clone()
        }
    };
    let t = match step.resample {
        Some((from, to)) => super::resample::pos_embed(&t.f_reshape([1, 1 + from * from, -1])?, from, to)?,
        None => t,
    };
    dst.f_copy_(&t.f_reshape(dst.size())?)?;
    Ok(())
}

/// A memtrain checkpoint's tensors into `vars` by name, which must match exactly (a resume).
pub fn exact(vars: &HashMap<String, Tensor>, tensors: &[(String, Tensor)], what: &str) -> Result<()> {
    let mut missing: Vec<&str> = vars
        .keys()
        .map(String::as_str)
        .filter(|k| !tensors.iter().any(|(n, _)| n == k))
        .collect();
    missing.sort();
    let mut unexpected = vec![];
    let mut misshaped = vec![];
    for (name, t) in tensors {
        match vars.get(name) {
            None => unexpected.push(name.as_str()),
            Some(v) if v.size() != t.size() => {
                misshaped.push(format!("{name}: file {:?}, model {:?}", t.size(), v.size()))
            }
            Some(_) => {}
        }
    }
    unexpected.sort();
    misshaped.sort();
    if !missing.is_empty() || !unexpected.is_empty() || !misshaped.is_empty() {
        let mut msg = format!("{what} does not match the model:");
        if !missing.is_empty() {
            msg += &format!("\n  missing (in the model, not in the file): {}", few(&missing, ", "));
        }
        if !unexpected.is_empty() {
            msg += &format!(
                "\n  unexpected (in the file, not in the model): {}",
                few(&unexpected, ", ")
            );
        }
        if !misshaped.is_empty() {
            msg += &format!("\n  mis-shaped: {}", few(&misshaped, "; "));
        }
        return Err(UsageError(msg).into());
    }
    tch::no_grad(|| {
        for (name, t) in tensors {
            let v = &vars[name];
            v.shallow_clone().copy_(&t.to_device(v.device()).to_kind(v.kind()));
        }
    });
    Ok(())
}
