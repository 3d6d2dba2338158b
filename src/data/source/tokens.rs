//! `tokens`: a flat file of token ids (nanoGPT's `train.bin`: uint16 or uint32, little-endian,
//! no header, `data.token_dtype` says which) or a 1-D `.npy` array of them, read in place
//! through a memory map whatever its size. The ids are cut into windows of `data.seq_len + 1`
//! tokens, one after the other (a tail shorter than a window is left out): a sample's `x` is a
//! window's first `seq_len` ids and its `y` the last `seq_len`, each token's next one.
use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};

use super::DataClasses;
use super::{Opened, Part, Reader, Want};
use crate::data::check::required_path;
use crate::data::gather::Targets;
use crate::data::mapped::npy_header;
use crate::data::store::{Elem, Map, Store};
use crate::spec::schema::{Data, TokenDtype};

pub struct Tokens;

impl Reader for Tokens {
    fn sample_shape(&self, data: &Data, _: &Path) -> Result<Option<Vec<i64>>> {
        Ok(data.seq_len.map(|n| vec![n]))
    }

    fn open(&self, want: &Want) -> Result<Opened> {
        let data = want.data;
        let seq_len = seq_len(data)?;
        let part = |key: &str, path: &Path| -> Result<Part> {
            let what = format!("{key} {}", path.display());
            let x = windows(path, data.token_dtype, seq_len, &what)?;
            Ok(Part::tokens(x, Targets::Next, what))
        };
        Ok(Opened {
            train: part("data.path", required_path(data)?)?,
            val: data.val_path.as_deref().map(|v| part("data.val_path", v)).transpose()?,
        })
    }

    fn how_read(&self, _: &Data) -> &'static str {
        "is read in place through a memory map (token ids, int64 batches)"
    }

    /// Token ids are checked against the model's vocabulary when the set is opened.
    fn classes(&self, _: &Data, _: &Path) -> Result<Option<DataClasses>> {
        Ok(None)
    }

    fn extent(&self, data: &Data) -> Option<String> {
        let seq_len = data.seq_len?;
        let count = |p: &Path| {
            let what = p.display().to_string();
            windows(p, data.token_dtype, seq_len, &what).ok().map(|s| s.shape[0])
        };
        let train = count(data.path.as_deref()?)?;
        Some(match data.val_path.as_deref() {
            Some(v) => format!(
                "{train} training and {} validation windows of {seq_len} tokens",
                count(v)?
            ),
            None => format!("{train} windows of {seq_len} tokens before the held-out split"),
        })
    }
}

/// `data.seq_len`, which token sources need.
pub(super) fn seq_len(data: &Data) -> Result<i64> {
    match data.seq_len {
        Some(n) if n >= 1 => Ok(n),
        Some(n) => bail!("data.seq_len = {n}: a window needs at least 1 token"),
        None => {
            bail!("data.seq_len is required for token data: the tokens a sample holds (the model's context length)")
        }
    }
}

/// The token file at `path`, mapped, as windows `[N, seq_len + 1]`.
fn windows(path: &Path, dtype: Option<TokenDtype>, seq_len: i64, what: &str) -> Result<Store> {
    let map = Arc::new(Map::open(path).map_err(|e| anyhow!("{what}: {e:#}"))?);
    let (elem, offset, count) = layout(map.bytes(), dtype, what)?;
    let w = seq_len + 1;
    let n = count / w;
    if n < 1 {
        bail!(
            "{what}: holds {count} token(s), fewer than one window of data.seq_len + 1 = {w} tokens; use a longer file or a smaller data.seq_len"
        );
    }
    Store::mapped(map, offset, elem, vec![n, w]).map_err(|e| anyhow!("{what}: {e:#}"))
}

/// The ids' type, where they start and how many there are: from an `.npy` header, else the
/// whole file as `dtype`.
fn layout(b: &[u8], dtype: Option<TokenDtype>, what: &str) -> Result<(Elem, usize, i64)> {
    let elem_of = |t: TokenDtype| match t {
        TokenDtype::Uint16 => Elem::U16,
        TokenDtype::Uint32 => Elem::U32,
    };
    if b.starts_with(b"\x93NUMPY") {
        let h = npy_header(b).ok_or_else(|| anyhow!("{what}: not a readable .npy file (its header is damaged)"))?;
        let elem = match h.descr.as_str() {
            "<u2" => Elem::U16,
            "<u4" => Elem::U32,
            "<i4" => Elem::I32,
            "<i8" => Elem::I64,
            d => bail!("{what}: holds dtype {d}; token ids must be uint16, uint32, int32 or int64"),
        };
        if let Some(t) = dtype.filter(|&t| elem_of(t) != elem) {
            bail!("{what}: data.token_dtype = {t:?} but the .npy file holds {}; remove data.token_dtype (an .npy file says its own)", h.descr);
        }
        let [count] = h.shape[..] else {
            bail!(
                "{what}: holds an array of shape {:?}; token ids must be one flat array (numpy.ravel it)",
                h.shape
            );
        };
        if h.fortran && h.shape.len() > 1 {
            bail!("{what}: is in Fortran order; save it in C order");
        }
        return Ok((elem, h.len, count));
    }
    let Some(t) = dtype else {
        bail!("{what}: a flat token file does not say its ids' type; set data.token_dtype = \"uint16\" or \"uint32\" (nanoGPT's train.bin is uint16)");
    };
    let elem = elem_of(t);
    if !b.len().is_multiple_of(elem.size()) {
        bail!(
            "{what}: is {} bytes, not a whole number of {}-byte ids; is data.token_dtype right?",
            b.len(),
            elem.size()
        );
    }
    Ok((elem, 0, (b.len() / elem.size()) as i64))
}
