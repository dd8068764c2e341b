//! Assertions on text a program printed or wrote.

/// Asserts that `text` contains `needle`, showing the whole text where it does not.
#[track_caller]
pub fn assert_contains(text: &str, needle: &str) {
    assert!(text.contains(needle), "{text}");
}
