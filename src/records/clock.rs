//! Wall-clock time as records stamp it.

/// Seconds since the Unix epoch (0 if the clock is before it).
pub fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}
