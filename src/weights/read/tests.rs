use super::*;

/// A safetensors file written by hand: the header (8-byte little-endian length, then JSON) and
/// the tensors' bytes, in the given order.
fn write(path: &Path, tensors: &[(&str, &str, Vec<i64>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = vec![];
    for (name, dtype, shape, bytes) in tensors {
        let begin = data.len();
        data.extend_from_slice(bytes);
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, data.len()]}),
        );
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let text = serde_json::to_vec(&header).unwrap();
    let mut file = (text.len() as u64).to_le_bytes().to_vec();
    file.extend(text);
    file.extend(data);
    fs::write(path, file).unwrap();
}

fn bytes_of<T: Copy>(v: &[T]) -> Vec<u8> {
    // SAFETY: plain numbers viewed as their bytes.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)).to_vec() }
}

#[test]
fn each_tensor_is_made_in_its_own_type_from_the_mapped_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("m.safetensors");
    let halves: Vec<u16> = [1.5f32, -2.0, 0.25].iter().map(|&x| half_bits(x)).collect();
    let bf16: Vec<u16> = [3.0f32, -0.5].iter().map(|x| (x.to_bits() >> 16) as u16).collect();
    write(
        &f,
        &[
            ("w", "F32", vec![2, 2], bytes_of(&[1.0f32, 2.0, 3.0, 4.0])),
            ("h", "F16", vec![3], bytes_of(&halves)),
            ("b", "BF16", vec![1, 2], bytes_of(&bf16)),
            ("n", "I64", vec![], bytes_of(&[7i64])),
        ],
    );
    let mut ck = Checkpoint::headers(&f).unwrap();
    assert_eq!(
        ck.entries.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
        ["w", "h", "b", "n"],
        "file order"
    );
    assert_eq!(ck.largest_bytes(), 16);
    ck.map().unwrap();
    let mut staging = Staging::new(ck.largest_bytes()).unwrap();
    let read = |ck: &Checkpoint, staging: &mut Staging, name: &str| {
        let t = ck.tensor(ck.by_name()[name], staging).unwrap();
        (
            t.kind(),
            t.size(),
            Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).unwrap(),
        )
    };
    assert_eq!(
        read(&ck, &mut staging, "w"),
        (Kind::Float, vec![2, 2], vec![1.0, 2.0, 3.0, 4.0])
    );
    assert_eq!(
        read(&ck, &mut staging, "h"),
        (Kind::Half, vec![3], vec![1.5, -2.0, 0.25])
    );
    assert_eq!(
        read(&ck, &mut staging, "b"),
        (Kind::BFloat16, vec![1, 2], vec![3.0, -0.5])
    );
    assert_eq!(read(&ck, &mut staging, "n"), (Kind::Int64, vec![], vec![7.0]));
}

/// IEEE half-precision bits of a value exactly representable in it.
fn half_bits(x: f32) -> u16 {
    let b = x.to_bits();
    let sign = ((b >> 16) & 0x8000) as u16;
    let exp = ((b >> 23) & 0xff) as i32 - 127 + 15;
    let mant = ((b >> 13) & 0x3ff) as u16;
    sign | ((exp as u16) << 10) | mant
}

#[test]
fn a_sharded_index_and_a_model_directory_are_read_through() {
    let dir = tempfile::tempdir().unwrap();
    write(
        &dir.path().join("a.safetensors"),
        &[("x", "F32", vec![1], bytes_of(&[1.0f32]))],
    );
    write(
        &dir.path().join("b.safetensors"),
        &[("y", "F32", vec![1], bytes_of(&[2.0f32]))],
    );
    let index = dir.path().join("model.safetensors.index.json");
    fs::write(
        &index,
        r#"{"metadata": {}, "weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}"#,
    )
    .unwrap();
    fs::write(dir.path().join("config.json"), "{}").unwrap();
    for p in [index.as_path(), dir.path()] {
        let ck = Checkpoint::headers(p).unwrap();
        let names: Vec<&str> = ck.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["x", "y"]);
        assert_eq!(ck.config.is_some(), p.is_dir(), "a directory's config.json");
    }
    fs::write(&index, r#"{"weight_map": {"x": "gone.safetensors"}}"#).unwrap();
    let e = format!("{:#}", Checkpoint::headers(&index).err().unwrap());
    assert!(e.contains("names the shard") && e.contains("gone.safetensors"), "{e}");
}

#[test]
fn pickles_and_files_that_are_not_safetensors_are_refused_with_why() {
    let dir = tempfile::tempdir().unwrap();
    let pth = dir.path().join("m.pth");
    fs::write(&pth, b"PK\x03\x04").unwrap();
    let e = format!("{:#}", Checkpoint::headers(&pth).err().unwrap());
    assert!(e.contains("loading a pickle can run any code"), "{e}");
    // The paths as given, so that the line works from where memtrain ran.
    assert!(
        e.contains(&format!(
            "sd = torch.load('{}', map_location='cpu', weights_only=True); save_file({{k: v.contiguous().clone() for k, v in sd.items()}}, '{}')",
            pth.display(),
            dir.path().join("m.safetensors").display()
        )),
        "{e}"
    );
    let hf = dir.path().join("hf");
    fs::create_dir(&hf).unwrap();
    fs::write(hf.join("pytorch_model.bin"), b"\x80\x02").unwrap();
    let e = format!("{:#}", Checkpoint::headers(&hf).err().unwrap());
    assert!(e.contains("pytorch_model.bin is a PyTorch pickle"), "{e}");

    // A pickle under a safetensors name is told by its first bytes.
    let renamed = dir.path().join("renamed.safetensors");
    fs::write(&renamed, b"PK\x03\x04 and the rest of a zip").unwrap();
    let e = format!("{:#}", Checkpoint::headers(&renamed).err().unwrap());
    assert!(e.contains("is a PyTorch pickle"), "{e}");

    let notes = dir.path().join("notes.safetensors");
    fs::write(&notes, "just some notes\n").unwrap();
    let e = format!("{:#}", Checkpoint::headers(&notes).err().unwrap());
    assert!(e.contains("not a safetensors file"), "{e}");
    let cut = dir.path().join("cut.safetensors");
    write(&cut, &[("x", "F32", vec![4], bytes_of(&[1.0f32; 4]))]);
    let whole = fs::read(&cut).unwrap();
    fs::write(&cut, &whole[..whole.len() - 4]).unwrap();
    let e = format!("{:#}", Checkpoint::headers(&cut).err().unwrap());
    assert!(e.contains("cut short"), "{e}");
}
