//! Text that tandem did not write itself (class names from a data set or a checkpoint, image
//! and file names, metadata values, a worker's error message) as it may reach a terminal:
//! control characters escaped, so that no escape sequence reaches the terminal and no
//! newline starts a line that looks like tandem's own, and the length bounded, so that a
//! name of megabytes prints as a line. JSON output keeps the exact text: JSON escapes it.

/// Prints a line to standard output like `println!`, but a closed output (`tandem ... | head`)
/// does not panic: the line is dropped and the job goes on.
#[macro_export]
macro_rules! say {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stdout().lock(), $($arg)*);
    }};
}

/// Prints a line to standard error like `eprintln!`, but in one write: `eprintln!` writes its
/// pieces one by one to the unbuffered stderr, and the lines of ranks sharing a terminal or
/// pipe (mpirun, srun) would interleave mid-line. A closed stderr drops the line.
#[macro_export]
macro_rules! tell {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let line = format!("{}\n", format_args!($($arg)*));
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }};
}

/// The most characters of a name (a class, a file, a metadata value) printed.
pub const NAME_LIMIT: usize = 200;

/// The most characters of one line of a message (an error and its causes) printed.
pub const LINE_LIMIT: usize = 4000;

/// `text` as a name to print: control characters escaped (`\n`, `\x1b`, `\u{9b}`), and past
/// [`NAME_LIMIT`] characters cut, with an ellipsis and the full length.
pub fn printable(text: &str) -> String {
    escaped_within(text, NAME_LIMIT)
}

/// `text` as one line of a message: as [`printable`], but within [`LINE_LIMIT`] characters.
pub fn printable_line(text: &str) -> String {
    escaped_within(text, LINE_LIMIT)
}

/// A message of several lines, each as [`printable_line`]: the message's own line breaks are
/// kept, so only a message whose untrusted parts are escaped already should be shown so.
pub fn printable_lines(text: &str) -> String {
    text.split('\n')
        .map(printable_line)
        .collect::<Vec<_>>()
        .join("\n")
}

/// `text` with its control characters escaped, cut past `limit` characters of the result.
fn escaped_within(text: &str, limit: usize) -> String {
    let mut shown = String::new();
    let mut shown_chars = 0;
    for character in text.chars() {
        let piece = escaped(character);
        let piece_chars = piece.chars().count();
        if shown_chars + piece_chars > limit {
            let total = text.chars().count();
            shown.push_str(&format!("… ({total} characters in all)"));
            return shown;
        }
        shown.push_str(&piece);
        shown_chars += piece_chars;
    }
    shown
}

/// One character as printed: itself, or an escape when a terminal would act on it.
fn escaped(character: char) -> String {
    match character {
        '\n' => "\\n".to_string(),
        '\r' => "\\r".to_string(),
        '\t' => "\\t".to_string(),
        character if character.is_ascii_control() => format!("\\x{:02x}", u32::from(character)),
        character if acted_on(character) => format!("\\u{{{:x}}}", u32::from(character)),
        character => character.to_string(),
    }
}

/// The characters beyond ASCII that a terminal acts on or that change how the rest of a line
/// reads: the C1 controls (U+0080 to U+009F, CSI among them), the line and paragraph
/// separators, and the bidirectional overrides and isolates that reorder what follows.
fn acted_on(character: char) -> bool {
    character.is_control()
        || matches!(
            character,
            '\u{2028}' | '\u{2029}' | '\u{061c}' | '\u{200e}' | '\u{200f}'
                | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(
            printable("\u{1b}]0;pwned\u{7}cat\ndog\r\t\u{7f}"),
            "\\x1b]0;pwned\\x07cat\\ndog\\r\\t\\x7f"
        );
        assert_eq!(
            printable("\u{9b}31m \u{202e}gpj.exe"),
            "\\u{9b}31m \\u{202e}gpj.exe"
        );
        assert_eq!(printable("chat noir, 猫 \\x1b"), "chat noir, 猫 \\x1b");
        assert_eq!(printable(""), "");
    }

    #[test]
    fn a_long_name_is_cut_with_its_length() {
        let long = "a".repeat(3_000_000);
        assert_eq!(
            printable(&long),
            format!("{}… (3000000 characters in all)", "a".repeat(NAME_LIMIT))
        );
        let exactly = "é".repeat(NAME_LIMIT);
        assert_eq!(printable(&exactly), exactly);
        // An escape is never cut in two: the result stays within the limit.
        let escapes = format!("{}\u{1b}", "b".repeat(NAME_LIMIT - 2));
        assert_eq!(
            printable(&escapes),
            format!(
                "{}… ({} characters in all)",
                "b".repeat(NAME_LIMIT - 2),
                NAME_LIMIT - 1
            )
        );
    }

    #[test]
    fn a_message_keeps_its_lines_and_escapes_within_them() {
        assert_eq!(
            printable_lines("job failed\nroot cause: \u{1b}[2J\n  | x\ty"),
            "job failed\nroot cause: \\x1b[2J\n  | x\\ty"
        );
        let long = "z".repeat(LINE_LIMIT + 1);
        assert_eq!(
            printable_line(&long),
            format!(
                "{}… ({} characters in all)",
                "z".repeat(LINE_LIMIT),
                LINE_LIMIT + 1
            )
        );
    }
}
