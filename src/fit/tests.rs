use super::*;

#[test]
fn margins_are_percentages_or_sizes_below_the_budget() {
    assert_eq!(parse_margin("10%", 1000).unwrap(), 100);
    assert_eq!(parse_margin("0%", 1000).unwrap(), 0);
    assert_eq!(parse_margin("512", 1000).unwrap(), 512);
    assert!(parse_margin("100%", 1000).is_err());
    assert!(parse_margin("2KiB", 1000)
        .unwrap_err()
        .0
        .contains("not below the budget"));
    assert!(parse_margin("lots", 1000).unwrap_err().0.contains("percentage"));
}
