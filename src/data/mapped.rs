//! Files whose samples can be read in place: a safetensors file (the imagefolder cache among
//! them) and an npz whose arrays numpy stored uncompressed (`numpy.savez`). Each is mapped, and
//! `x` becomes a store over its bytes in the map; `y` (small) is copied out. Anything else (a
//! compressed npz, a dtype a batch does not convert from, Fortran order) answers None, and the
//! file is read whole instead.
use std::path::Path;
use std::sync::Arc;

use tch::{Kind, Tensor};

use super::store::{span, Elem, Map, Store};

/// `x` mapped, `y` in memory.
pub struct Xy {
    pub x: Store,
    pub y: Tensor,
}

/// A tensor in a mapped file: its element kind, shape and byte offset.
struct Entry {
    kind: Kind,
    shape: Vec<i64>,
    offset: usize,
}

impl Entry {
    fn bytes(&self) -> Option<usize> {
        span(&self.shape, self.kind.elt_size_in_bytes())
    }

    /// Where the data ends, when the header's numbers add up.
    fn end(&self) -> Option<usize> {
        self.offset.checked_add(self.bytes()?)
    }

    fn tensor(&self, map: &Map) -> Option<Tensor> {
        let b = map.bytes().get(self.offset..self.end()?)?;
        Some(Tensor::from_data_size(b, &self.shape, self.kind))
    }
}

fn pair(path: &Path, find: impl Fn(&Map, &str) -> Option<Entry>) -> Option<Xy> {
    let map = Arc::new(Map::open(path).ok()?);
    let (x, y) = (find(&map, "x")?, find(&map, "y")?);
    let elem = Elem::of(x.kind)?;
    if x.shape.is_empty() {
        return None;
    }
    let y = y.tensor(&map)?;
    let x = Store::mapped(map, x.offset, elem, x.shape).ok()?;
    Some(Xy { x, y })
}

/// `x` and `y` of a safetensors file, `x` mapped.
pub fn safetensors(path: &Path) -> Option<Xy> {
    pair(path, safetensors_entry)
}

fn safetensors_entry(map: &Map, name: &str) -> Option<Entry> {
    let b = map.bytes();
    let len = u64::from_le_bytes(b.get(..8)?.try_into().ok()?) as usize;
    let header: serde_json::Value = serde_json::from_slice(b.get(8..8 + len.min(b.len()))?).ok()?;
    let t = &header[name];
    let kind = match t["dtype"].as_str()? {
        "U8" => Kind::Uint8,
        "I8" => Kind::Int8,
        "I16" => Kind::Int16,
        "I32" => Kind::Int,
        "I64" => Kind::Int64,
        "F16" => Kind::Half,
        "BF16" => Kind::BFloat16,
        "F32" => Kind::Float,
        "F64" => Kind::Double,
        "BOOL" => Kind::Bool,
        _ => return None,
    };
    let shape = t["shape"]
        .as_array()?
        .iter()
        .map(|d| d.as_i64())
        .collect::<Option<Vec<_>>>()?;
    let start = usize::try_from(t["data_offsets"].get(0)?.as_u64()?).ok()?;
    let stop = usize::try_from(t["data_offsets"].get(1)?.as_u64()?).ok()?;
    let e = Entry {
        kind,
        shape,
        offset: 8usize.checked_add(len)?.checked_add(start)?,
    };
    // The offsets must span exactly the shape's bytes, inside the file.
    (stop.checked_sub(start)? == e.bytes()? && e.end()? <= b.len()).then_some(e)
}

/// The tensor `name` of a mapped safetensors file as a store over its bytes, when its dtype is
/// one a store holds.
pub fn safetensors_store(map: &Arc<Map>, name: &str) -> Option<Store> {
    let e = safetensors_entry(map, name)?;
    Store::mapped(map.clone(), e.offset, Elem::of(e.kind)?, e.shape).ok()
}

/// `x` and `y` of an npz whose arrays are stored uncompressed, `x` mapped.
pub fn npz(path: &Path) -> Option<Xy> {
    pair(path, |map, name| {
        let m = zip_member(map.bytes(), &format!("{name}.npy"))?;
        if m.method != 0 {
            return None;
        }
        let npy = map.bytes().get(m.data..)?;
        let h = npy_header(npy)?;
        if h.fortran {
            return None;
        }
        let e = Entry {
            kind: h.kind?,
            shape: h.shape,
            offset: m.data.checked_add(h.len)?,
        };
        // The array lies inside its member, not in the next one.
        let inside = (h.len as u64).checked_add(e.bytes()? as u64)? <= m.size;
        inside.then_some(e)
    })
}

/// A member of a zip archive: how it is stored, where its data starts, its inflated size.
pub struct Member {
    pub method: usize,
    pub data: usize,
    pub size: u64,
}

/// Finds `name` through the zip's central directory (zip64 archives, over 4 GiB, too).
pub fn zip_member(b: &[u8], name: &str) -> Option<Member> {
    let u16_at = |i: usize| Some(u16::from_le_bytes(b.get(i..i + 2)?.try_into().ok()?) as usize);
    let u32_at = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?) as u64);
    // The end of central directory record: 22 bytes and a comment of up to 64 KiB.
    let from = b.len().saturating_sub(22 + 65_535);
    let eocd = (from..b.len().saturating_sub(21))
        .rev()
        .find(|&i| b[i..i + 4] == [0x50, 0x4b, 0x05, 0x06])?;
    let u64_at = |i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
    let (entries, cd) = match u32_at(eocd + 16)? {
        // zip64 (numpy writes it for arrays over 4 GiB): the locator just before the record
        // points at the zip64 end of central directory.
        0xFFFF_FFFF => {
            let loc = eocd.checked_sub(20)?;
            if b.get(loc..loc + 4)? != [0x50, 0x4b, 0x06, 0x07] {
                return None;
            }
            let rec = u64_at(loc + 8)? as usize;
            if b.get(rec..rec + 4)? != [0x50, 0x4b, 0x06, 0x06] {
                return None;
            }
            (u64_at(rec + 32)? as usize, u64_at(rec + 48)?)
        }
        cd => (u16_at(eocd + 10)?, cd),
    };
    let mut at = cd as usize;
    for _ in 0..entries {
        if b.get(at..at + 4)? != [0x50, 0x4b, 0x01, 0x02] {
            return None;
        }
        let method = u16_at(at + 10)?;
        let compressed = u32_at(at + 20)?;
        let size = u32_at(at + 24)?;
        let (n, e, c) = (u16_at(at + 28)?, u16_at(at + 30)?, u16_at(at + 32)?);
        let local = u32_at(at + 42)?;
        let this = b.get(at + 46..at + 46 + n)?;
        at += 46 + n + e + c;
        if this != name.as_bytes() {
            continue;
        }
        let (size, local) = zip64_fields(b.get(at - e - c..at - c)?, [size, compressed, local])?;
        let local = local as usize;
        let data = local + 30 + u16_at(local + 26)? + u16_at(local + 28)?;
        return Some(Member { method, data, size });
    }
    None
}

/// A central directory entry's inflated size and local header offset, from its zip64 extra
/// field where the 32-bit fields hold 0xFFFFFFFF: that field lists, in this order, only those
/// that overflowed of the inflated size, the compressed size and the offset.
fn zip64_fields(extra: &[u8], [size, compressed, local]: [u64; 3]) -> Option<(u64, u64)> {
    const MAX: u64 = 0xFFFF_FFFF;
    if size != MAX && compressed != MAX && local != MAX {
        return Some((size, local));
    }
    let mut at = 0;
    while at + 4 <= extra.len() {
        let id = u16::from_le_bytes(extra[at..at + 2].try_into().ok()?);
        let len = u16::from_le_bytes(extra[at + 2..at + 4].try_into().ok()?) as usize;
        let body = extra.get(at + 4..at + 4 + len)?;
        if id == 1 {
            let mut vals = body
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")));
            let mut next = |v: u64| if v == MAX { vals.next() } else { Some(v) };
            let size = next(size)?;
            next(compressed)?;
            return Some((size, next(local)?));
        }
        at += 4 + len;
    }
    None
}

/// An .npy header: the array's kind (None for a dtype a store does not hold), its order, its
/// shape and the header's length.
pub struct NpyHeader {
    pub kind: Option<Kind>,
    /// NumPy's type string, as `<u2`.
    pub descr: String,
    pub fortran: bool,
    pub shape: Vec<i64>,
    pub len: usize,
}

/// Magic, version, header length, then a Python dict literal.
pub fn npy_header(b: &[u8]) -> Option<NpyHeader> {
    if b.get(..6)? != b"\x93NUMPY" {
        return None;
    }
    let (start, len) = match b.get(6)? {
        1 => (10, u16::from_le_bytes(b.get(8..10)?.try_into().ok()?) as usize),
        _ => (12, u32::from_le_bytes(b.get(8..12)?.try_into().ok()?) as usize),
    };
    let header = std::str::from_utf8(b.get(start..start + len)?).ok()?;
    let rest = &header[header.find("'shape'")?..];
    let inner = &rest[rest.find('(')? + 1..rest.find(')')?];
    let shape = inner
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| d.trim_end_matches('L').parse().ok())
        .collect::<Option<Vec<i64>>>()?;
    let descr = header.split("'descr':").nth(1)?.split('\'').nth(1)?;
    let kind = match descr {
        "|u1" | "<u1" => Some(Kind::Uint8),
        "|i1" | "<i1" => Some(Kind::Int8),
        "<i2" => Some(Kind::Int16),
        "<i4" => Some(Kind::Int),
        "<i8" => Some(Kind::Int64),
        "<f4" => Some(Kind::Float),
        _ => None,
    };
    let fortran = header
        .split("'fortran_order':")
        .nth(1)?
        .trim_start()
        .starts_with("True");
    Some(NpyHeader {
        kind,
        descr: descr.to_owned(),
        fortran,
        shape,
        len: start + len,
    })
}
