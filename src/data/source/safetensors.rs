//! `safetensors`: the tensors `x` (samples `[N, ..]`, any float or integer dtype) and `y`
//! (integer class indices `[N]`) in a `.safetensors` file, read in place through a memory map
//! where `x`'s dtype allows.
use std::fs;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use tch::Tensor;

use super::arrays::{self, take_xy, Format};
use super::DataClasses;
use super::{Opened, Reader, Want};
use crate::data::mapped;
use crate::spec::schema::Data;

pub struct Safetensors;

const FORMAT: Format = Format {
    mapped: mapped::safetensors,
    whole: read_safetensors,
};

impl Reader for Safetensors {
    fn sample_shape(&self, _: &Data, path: &Path) -> Result<Option<Vec<i64>>> {
        safetensors_sample_shape(path).map(Some)
    }

    fn open(&self, want: &Want) -> Result<Opened> {
        arrays::open(want, &FORMAT)
    }

    fn how_read(&self, data: &Data) -> &'static str {
        arrays::how_read(data.memory_map)
    }

    fn classes(&self, data: &Data, path: &Path) -> Result<Option<DataClasses>> {
        arrays::classes(data, path, &FORMAT)
    }
}

/// `x`'s shape without N from a safetensors file's JSON header.
fn safetensors_sample_shape(path: &Path) -> Result<Vec<i64>> {
    use std::io::Read;
    let what = format!("data.path {}", path.display());
    let mut f = fs::File::open(path).with_context(|| format!("{what}: cannot read it"))?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len)
        .with_context(|| format!("{what}: not a safetensors file"))?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        bail!("{what}: not a safetensors file (a header of {len} bytes)");
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header)
        .with_context(|| format!("{what}: not a safetensors file"))?;
    let v: serde_json::Value =
        serde_json::from_slice(&header).with_context(|| format!("{what}: not a safetensors file"))?;
    let shape = v["x"]["shape"]
        .as_array()
        .ok_or_else(|| anyhow!("{what}: has no tensor x"))?;
    Ok(shape.iter().skip(1).filter_map(|d| d.as_i64()).collect())
}

fn read_safetensors(path: &Path, what: &str) -> Result<(Tensor, Tensor)> {
    const HOW: &str = "as written by safetensors.torch.save_file({\"x\": x, \"y\": y}, path)";
    let named = Tensor::read_safetensors(path).map_err(|e| {
        let e = e.to_string();
        anyhow!(
            "{what}: cannot read it as .safetensors: {e}{}; it must be a safetensors file with tensors x and y, {HOW}",
            crate::checkpoint::safetensors_hint(&e)
        )
    })?;
    take_xy(named, what, HOW)
}
