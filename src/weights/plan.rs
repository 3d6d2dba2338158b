//! Which checkpoint tensor fills which memtrain variable: decided from names and shapes alone,
//! so `check` (from the checkpoint's header) and `run` (before reading a byte of data) decide
//! the same. The head the checkpoint lacks or sizes differently is left as the build made it;
//! any other variable the checkpoint lacks, or has at another shape, is an error.
use std::collections::{BTreeMap, BTreeSet};

use super::format::{Format, How};

/// A variable or a checkpoint tensor: its name and shape.
pub type Shaped = (String, Vec<i64>);

/// What a load does.
#[derive(Debug, Clone, PartialEq)]
pub struct LoadPlan {
    pub format: &'static str,
    /// In checkpoint order: each tensor read and where it goes.
    pub steps: Vec<Step>,
    /// memtrain variables filled from the checkpoint.
    pub kept: Vec<String>,
    /// memtrain variables left as the build initialised them (the head, `init_skip`).
    pub created: Vec<String>,
    /// Checkpoint tensors no variable takes.
    pub dropped: Vec<String>,
    /// Position embeddings read at another grid and resampled to the model's.
    pub resampled: Vec<String>,
}

/// One checkpoint tensor into (part of) one variable.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    pub tensor: String,
    pub var: String,
    pub how: How,
    /// The checkpoint's position grid side and the model's: resampled between them.
    pub resample: Option<(i64, i64)>,
}

/// What the plan is made from.
pub struct Inputs<'a> {
    pub checkpoint: &'a [Shaped],
    pub vars: &'a [Shaped],
    /// Prefixes of the variables a checkpoint may lack or size otherwise (`heads.head`, LoRA's
    /// adapters), each one unit: a unit the checkpoint does not fill whole, at its shapes, is
    /// left as built, all of it.
    pub head: &'a [String],
    /// `model.init_skip`: patterns of variables left as built.
    pub skip: &'a [String],
    pub format: &'a dyn Format,
}

/// Why a checkpoint cannot fill the model: the variables it lacks and the shapes that differ.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Mismatch {
    pub missing: Vec<String>,
    pub misshaped: Vec<String>,
    /// The checkpoint tensors nothing took, which may be the missing ones under other names.
    pub unused: Vec<String>,
}

pub fn plan(i: &Inputs) -> Result<LoadPlan, Mismatch> {
    let vars: BTreeMap<&str, &[i64]> = i.vars.iter().map(|(n, s)| (n.as_str(), s.as_slice())).collect();
    // The head unit (one of `head`'s prefixes) a variable belongs to.
    let unit = |v: &str| -> Option<usize> {
        i.head
            .iter()
            .position(|h| v == h || v.strip_prefix(h.as_str()).is_some_and(|r| r.starts_with('.')))
    };
    let skipped = |v: &str| i.skip.iter().any(|p| glob(p, v));
    let mut steps = vec![];
    let mut dropped = vec![];
    let mut misshaped = vec![];
    // Head units a checkpoint tensor does not fit: made fresh, every variable of the unit.
    let mut misfit = BTreeSet::new();
    // Variables a mis-shaped tensor was meant for: said once, as mis-shaped, not also missing.
    let mut wrong = BTreeSet::new();
    for (name, shape) in i.checkpoint {
        let Some(t) = i.format.map(name) else {
            dropped.push(name.clone());
            continue;
        };
        let Some(&want) = vars.get(t.var.as_str()) else {
            dropped.push(name.clone());
            continue;
        };
        if skipped(&t.var) {
            dropped.push(name.clone());
            continue;
        }
        let resample = match fits(shape, want, t.how) {
            Fit::Yes => None,
            Fit::Resample(from, to) if t.var.ends_with("pos_embedding") => Some((from, to)),
            _ if unit(&t.var).is_some() => {
                misfit.extend(unit(&t.var));
                None
            }
            _ => {
                misshaped.push(misshape(name, shape, &t.var, want));
                wrong.insert(t.var);
                continue;
            }
        };
        steps.push(Step {
            tensor: name.clone(),
            var: t.var,
            how: t.how,
            resample,
        });
    }
    let mut by_var: BTreeMap<&str, Vec<How>> = BTreeMap::new();
    for s in &steps {
        by_var.entry(s.var.as_str()).or_default().push(s.how);
    }
    let complete = |v: &str| complete(by_var.get(v).map_or(&[][..], Vec::as_slice));
    // A unit the checkpoint lacks a variable of is made fresh whole too.
    misfit.extend(vars.keys().filter(|v| !complete(v)).filter_map(|v| unit(v)));
    let mut created = BTreeSet::new();
    let mut missing = vec![];
    for v in vars.keys() {
        if skipped(v) || unit(v).is_some_and(|u| misfit.contains(&u)) {
            created.insert(v.to_string());
        } else if !complete(v) && !wrong.contains(*v) {
            missing.push(v.to_string());
        }
    }
    let (used, unused): (Vec<Step>, Vec<Step>) = steps.into_iter().partition(|s| !created.contains(&s.var));
    dropped.extend(unused.into_iter().map(|s| s.tensor));
    if !missing.is_empty() || !misshaped.is_empty() {
        misshaped.sort();
        dropped.sort();
        return Err(Mismatch {
            missing,
            misshaped,
            unused: dropped,
        });
    }
    dropped.sort();
    let kept: BTreeSet<String> = used.iter().map(|s| s.var.clone()).collect();
    let resampled: BTreeSet<String> = used
        .iter()
        .filter(|s| s.resample.is_some())
        .map(|s| s.var.clone())
        .collect();
    Ok(LoadPlan {
        format: i.format.name(),
        steps: used,
        kept: kept.into_iter().collect(),
        created: created.into_iter().collect(),
        dropped,
        resampled: resampled.into_iter().collect(),
    })
}

/// Whether tensors put as `hows` fill a variable: one whole tensor, or every part of a packed
/// one, each once.
fn complete(hows: &[How]) -> bool {
    match hows.first() {
        Some(How::Part { of, .. }) => {
            let parts: BTreeSet<i64> = hows
                .iter()
                .filter_map(|h| match h {
                    How::Part { index, of: o } if o == of => Some(*index),
                    _ => None,
                })
                .collect();
            hows.len() as i64 == *of && parts.len() as i64 == *of
        }
        Some(_) => hows.len() == 1,
        None => false,
    }
}

enum Fit {
    Yes,
    No,
    /// A position embedding `[1 + from², d]` for a model's `[1 + to², d]`.
    Resample(i64, i64),
}

/// Whether a checkpoint tensor of `shape` fills a variable of `want` as `how` says.
fn fits(shape: &[i64], want: &[i64], how: How) -> Fit {
    let ok = match how {
        How::Whole => strip(shape) == strip(want),
        How::Part { of, .. } => {
            !want.is_empty() && want[0] % of == 0 && shape.first() == Some(&(want[0] / of)) && shape[1..] == want[1..]
        }
        How::Transposed => shape.len() == 2 && want.len() == 2 && shape[0] == want[1] && shape[1] == want[0],
    };
    if ok {
        return Fit::Yes;
    }
    match (how, strip(shape), strip(want)) {
        (How::Whole, [n, d], [m, e]) if d == e => match (grid(*n), grid(*m)) {
            (Some(from), Some(to)) => Fit::Resample(from, to),
            _ => Fit::No,
        },
        _ => Fit::No,
    }
}

/// The side of a square grid of `n - 1` patches after one class token.
fn grid(n: i64) -> Option<i64> {
    let side = ((n - 1).max(0) as f64).sqrt().round() as i64;
    (side >= 1 && side * side == n - 1).then_some(side)
}

/// A shape without its leading 1s: `[1, 1, d]` and `[d]` are one class token.
fn strip(shape: &[i64]) -> &[i64] {
    let ones = shape.iter().take_while(|&&d| d == 1).count();
    &shape[ones.min(shape.len().saturating_sub(1))..]
}

fn misshape(name: &str, shape: &[i64], var: &str, want: &[i64]) -> String {
    match name == var {
        true => format!("{name}: file {shape:?}, model {want:?}"),
        false => format!("{name}: file {shape:?}, model's {var} {want:?}"),
    }
}

/// `*` matches any run of characters (dots too), `?` any one; the rest match themselves.
pub fn glob(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    // Classic two-pointer match with backtracking to the last star.
    let (mut pi, mut ni, mut star, mut mark) = (0, 0, None, 0);
    while ni < n.len() {
        if pi < p.len() && (p[pi] == '?' || p[pi] == n[ni]) {
            pi += 1;
            ni += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some(pi);
            mark = ni;
            pi += 1;
        } else if let Some(s) = star {
            pi = s + 1;
            mark += 1;
            ni = mark;
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

#[cfg(test)]
mod tests;
