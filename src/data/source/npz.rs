//! `npz`: a NumPy `.npz` with arrays `x` (any float or integer dtype, converted to float32;
//! shape `[N, ..]`) and `y` (integer class indices, shape `[N]`), as written by
//! `numpy.savez(path, x=x, y=y)` or `numpy.savez_compressed`. An uncompressed archive is read in
//! place through a memory map; a compressed one is inflated whole.
use std::path::Path;

use anyhow::{anyhow, Result};
use tch::Tensor;

use super::arrays::{self, take_xy, Format};
use super::DataClasses;
use super::{Opened, Reader, Want};
use crate::data::mapped;
use crate::data::store::Map;
use crate::spec::schema::Data;

pub struct Npz;

const FORMAT: Format = Format {
    mapped: mapped::npz,
    whole: read_npz,
};

impl Reader for Npz {
    fn sample_shape(&self, _: &Data, path: &Path) -> Result<Option<Vec<i64>>> {
        npz_sample_shape(path).map(Some)
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

/// `x`'s shape without N from an .npz: the zip's central directory, then `x.npy`'s header,
/// when numpy stored it uncompressed (`numpy.savez`); a compressed archive
/// (`numpy.savez_compressed`) is read whole.
fn npz_sample_shape(path: &Path) -> Result<Vec<i64>> {
    match npz_header_shape(path) {
        Some(s) => Ok(s.into_iter().skip(1).collect()),
        None => {
            let (x, _) = read_npz(path, &format!("data.path {}", path.display()))?;
            Ok(x.size().into_iter().skip(1).collect())
        }
    }
}

pub(crate) fn npz_header_shape(path: &Path) -> Option<Vec<i64>> {
    let map = Map::open(path).ok()?;
    let m = mapped::zip_member(map.bytes(), "x.npy")?;
    if m.method != 0 {
        return None;
    }
    Some(mapped::npy_header(map.bytes().get(m.data..)?)?.shape)
}

fn read_npz(path: &Path, what: &str) -> Result<(Tensor, Tensor)> {
    const HOW: &str = "as written by numpy.savez(path, x=x, y=y)";
    let named = Tensor::read_npz(path).map_err(|e| {
        let e = e.to_string();
        // tch's reader takes little-endian numeric arrays only, and calls a big-endian one's
        // descriptor ">f4" not little-endian.
        let hint = if e.contains("fortran") {
            " (save C-ordered arrays: numpy.ascontiguousarray)"
        } else if e.contains("little-endian descr >") {
            " (the array is big-endian: save it as x.astype(x.dtype.newbyteorder('<')))"
        } else if e.contains("unrecognized descr") {
            " (an object or string array: save numeric arrays)"
        } else {
            ""
        };
        anyhow!("{what}: cannot read it as an .npz: {e}{hint}; it must be a NumPy .npz with arrays x and y, {HOW}")
    })?;
    take_xy(named, what, HOW)
}
