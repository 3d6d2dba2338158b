//! Formatting shared by every human-facing line.

/// "cpu", "cuda:0": how records and messages name a device.
pub fn device_name(d: tch::Device) -> String {
    match d {
        tch::Device::Cuda(i) => format!("cuda:{i}"),
        _ => "cpu".into(),
    }
}

/// "1.50 GiB", "512.0 MiB", "10 B".
pub fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    match i {
        0 => format!("{b} B"),
        _ if v >= 100.0 => format!("{v:.0} {}", UNITS[i]),
        _ => format!("{v:.2} {}", UNITS[i]),
    }
}

/// Parameter counts as "1.23M", "45.6K", "789".
pub fn human_count(n: u64) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{:.1}K", n as f64 / 1e3),
        _ => format!("{:.2}M", n as f64 / 1e6),
    }
}

pub fn human_duration(secs: f64) -> String {
    if secs < 1.0 {
        format!("{:.0} ms", secs * 1e3)
    } else if secs < 120.0 {
        format!("{secs:.1} s")
    } else {
        format!("{}m{:02}s", (secs / 60.0) as u64, (secs % 60.0) as u64)
    }
}

/// The first few names of a list and how many more: a model has thousands of tensors, and a
/// renamed module would otherwise print all of them.
pub fn few<S: AsRef<str>>(names: &[S], sep: &str) -> String {
    const SHOWN: usize = 8;
    let mut s = names
        .iter()
        .take(SHOWN)
        .map(AsRef::as_ref)
        .collect::<Vec<_>>()
        .join(sep);
    if names.len() > SHOWN {
        s += &format!("{sep}… and {} more ({} in all)", names.len() - SHOWN, names.len());
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes() {
        assert_eq!(human_bytes(10), "10 B");
        assert_eq!(human_bytes(1536 << 20), "1.50 GiB");
        assert_eq!(human_bytes(4 << 30), "4.00 GiB");
        assert_eq!(human_bytes(512 << 20), "512 MiB");
    }

    #[test]
    fn counts() {
        assert_eq!(human_count(789), "789");
        assert_eq!(human_count(45_600), "45.6K");
        assert_eq!(human_count(1_234_567), "1.23M");
    }
}
