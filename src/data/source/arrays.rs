//! What the array-file sources (npz, safetensors) share: a file and its validation file,
//! each read in place through a memory map where it can be, else read whole after checking that
//! it fits in memory.
use std::path::Path;

use anyhow::{bail, Result};
use tch::Tensor;

use super::{label_range, DataClasses};
use super::{Opened, Part, Want};
use crate::data::check::{check_whole_file, required_path, stored};
use crate::data::mapped::Xy;
use crate::spec::schema::Data;

/// How one array-file format is read.
pub(super) struct Format {
    /// `x` mapped and `y` in memory, where the file allows.
    pub mapped: fn(&Path) -> Option<Xy>,
    /// `x` and `y` read whole.
    pub whole: fn(&Path, &str) -> Result<(Tensor, Tensor)>,
}

/// The file at `data.path` (and `data.val_path`): mapped where it can be, else read whole.
pub(super) fn open(want: &Want, format: &Format) -> Result<Opened> {
    let data = want.data;
    let read = |key: &str, p: &Path| -> Result<Part> {
        let what = format!("{key} {}", p.display());
        if let Some(m) = data.memory_map.then(|| (format.mapped)(p)).flatten() {
            return Ok(Part::new(m.x, m.y, what));
        }
        check_whole_file(p, data, &what)?;
        let (x, y) = (format.whole)(p, &what)?;
        Ok(Part::new(stored(x, &what)?, y, what))
    };
    let train = read("data.path", required_path(data)?)?;
    let val = data.val_path.as_deref().map(|v| read("data.val_path", v)).transpose()?;
    Ok(Opened { train, val })
}

/// The labels' range over `data.path` and `data.val_path`: `y` read alone where the file maps,
/// else the file read whole (where it fits in memory, as loading checks).
pub(super) fn classes(data: &Data, path: &Path, format: &Format) -> Result<Option<DataClasses>> {
    let mut top = None;
    for (key, p) in [("data.path", Some(path)), ("data.val_path", data.val_path.as_deref())] {
        let Some(p) = p else { continue };
        let y = match (format.mapped)(p) {
            Some(m) => m.y,
            None => {
                // Read whole only where loading would read it whole too.
                let what = format!("{key} {}", p.display());
                check_whole_file(p, data, &what)?;
                (format.whole)(p, &what)?.1
            }
        };
        let y = Vec::<i64>::try_from(&y.to_kind(tch::Kind::Int64).flatten(0, -1))?;
        top = top.max(label_range(y));
    }
    Ok(top.map(DataClasses::Range))
}

/// How `check` says an array file is read.
pub(super) fn how_read(memory_map: bool) -> &'static str {
    match memory_map {
        true => "read in place through a memory map (uncompressed npz, safetensors), else whole",
        false => "read whole into memory",
    }
}

/// Finds `x` and `y` among named tensors, or says what the file has.
pub(super) fn take_xy(named: Vec<(String, Tensor)>, what: &str, how: &str) -> Result<(Tensor, Tensor)> {
    let names: Vec<String> = named.iter().map(|(n, _)| n.clone()).collect();
    let mut x = None;
    let mut y = None;
    for (name, t) in named {
        match name.as_str() {
            "x" => x = Some(t),
            "y" => y = Some(t),
            _ => {}
        }
    }
    let missing: Vec<&str> = [("x", x.is_none()), ("y", y.is_none())]
        .iter()
        .filter(|m| m.1)
        .map(|m| m.0)
        .collect();
    match (x, y) {
        (Some(x), Some(y)) => Ok((x, y)),
        _ => bail!(
            "{what}: has no {} named {}; it has {}; it must hold x (samples) and y (class indices), {how}",
            if missing.len() == 1 { "array" } else { "arrays" },
            missing
                .iter()
                .map(|m| format!("\"{m}\""))
                .collect::<Vec<_>>()
                .join(" or "),
            if names.is_empty() {
                "none".to_owned()
            } else {
                format!("{names:?}")
            }
        ),
    }
}
