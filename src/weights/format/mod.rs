//! The names other libraries give a model's tensors, each library one file behind `Format`:
//! whether a checkpoint's names are its own, and which memtrain variable each tensor fills.
//! memtrain's vit and resnet presets use torchvision's names, so torchvision is the identity.
mod huggingface;
mod open_clip;
mod timm;
mod torchvision;

use crate::spec::InitFormat;

/// How a checkpoint tensor fills its memtrain variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum How {
    /// The whole variable (shapes may differ by leading 1s: a class token `[d]` for `[1, 1, d]`).
    Whole,
    /// Part `index` of `of` equal parts along the first dimension: a separate query, key or value
    /// joined into the packed in-projection.
    Part { index: i64, of: i64 },
    /// The transpose of the variable: open_clip's `proj` is `[d, p]`, a Linear weight `[p, d]`.
    Transposed,
}

/// The memtrain variable a checkpoint tensor fills, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub var: String,
    pub how: How,
}

impl Target {
    fn whole(var: impl Into<String>) -> Target {
        Target {
            var: var.into(),
            how: How::Whole,
        }
    }
}

pub trait Format {
    fn name(&self) -> &'static str;
    /// Whether these checkpoint names are this library's.
    fn claims(&self, names: &[&str]) -> bool;
    /// The memtrain variable a checkpoint tensor fills; None: none does (a pooler, a text tower).
    fn map(&self, name: &str) -> Option<Target>;
}

/// Most specific first: torchvision claims whatever the others do not.
const DETECTED: [&dyn Format; 4] = [
    &open_clip::OpenClip,
    &huggingface::HuggingFace,
    &timm::Timm,
    &torchvision::Torchvision,
];

/// The format `wanted` names, or the one whose names these are.
pub fn pick(wanted: InitFormat, names: &[&str]) -> &'static dyn Format {
    match wanted {
        InitFormat::Torchvision => &torchvision::Torchvision,
        InitFormat::Timm => &timm::Timm,
        InitFormat::Huggingface => &huggingface::HuggingFace,
        InitFormat::OpenClip => &open_clip::OpenClip,
        InitFormat::Auto => DETECTED
            .into_iter()
            .find(|f| f.claims(names))
            .unwrap_or(&torchvision::Torchvision),
    }
}

/// The prefix of memtrain's vit encoder block `n`.
fn vit_block(n: usize) -> String {
    format!("encoder.layers.encoder_layer_{n}")
}

/// `name` as `{prefix}{N}.{rest}`: the block number and the rest.
fn numbered<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let (n, rest) = name.strip_prefix(prefix)?.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

/// A block's tensor by a table of (their suffix, memtrain's suffix within the block, how); a
/// suffix ending in '.' is a module, and the parameter name after it is kept.
fn in_block(n: usize, rest: &str, table: &[(&str, &str, How)]) -> Option<Target> {
    table.iter().find_map(|&(theirs, ours, how)| {
        let param = match theirs.ends_with('.') {
            true => format!(".{}", rest.strip_prefix(theirs)?),
            false if rest == theirs => String::new(),
            false => return None,
        };
        Some(Target {
            var: format!("{}.{ours}{param}", vit_block(n)),
            how,
        })
    })
}

/// A tensor outside the blocks by a table of (their module, memtrain's module); the parameter
/// name after the module is kept.
fn by_module(name: &str, table: &[(&str, &str)]) -> Option<Target> {
    table.iter().find_map(|&(theirs, ours)| {
        let param = name.strip_prefix(theirs)?.strip_prefix('.')?;
        Some(Target::whole(format!("{ours}.{param}")))
    })
}

#[cfg(test)]
mod tests;
