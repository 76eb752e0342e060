//! How messages write what they say: a count of things in the right number ("1 epoch",
//! "2 epochs"), and what a user typed echoed back cut short and with its control
//! characters escaped, so that an error stays one readable line whatever the input was
//! (a 100 kB token, a terminal escape sequence).

/// Characters of a user's input an error shows before it cuts the rest.
pub const ECHO_CHARS: usize = 60;

/// `n` and the noun, plural unless `n` is 1: `plural(1, "epoch")` is "1 epoch".
pub fn plural(n: usize, noun: &str) -> String {
    match n {
        1 => format!("1 {noun}"),
        _ => format!("{n} {noun}s"),
    }
}

/// What a user typed, as an error shows it: control characters (newlines, tabs, terminal
/// escapes) escaped (`\n`, `\u{1b}`), and cut after [`ECHO_CHARS`] characters with how many
/// more there were.
pub fn echo(input: &str) -> String {
    let mut shown = String::new();
    let mut chars = input.chars();
    for c in chars.by_ref().take(ECHO_CHARS) {
        match c.is_control() {
            true => shown.extend(c.escape_default()),
            false => shown.push(c),
        }
    }
    match chars.count() {
        0 => shown,
        more => format!("{shown}… ({})", plural(more, "more character")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_take_their_number() {
        assert_eq!(plural(1, "epoch"), "1 epoch");
        assert_eq!(plural(0, "epoch"), "0 epochs");
        assert_eq!(plural(12, "symbol"), "12 symbols");
    }

    #[test]
    fn echoed_input_is_short_and_escaped() {
        assert_eq!(echo("3 1 4"), "3 1 4");
        assert_eq!(echo("a\x1b[31mb\n"), "a\\u{1b}[31mb\\n");
        let long = "7".repeat(120_000);
        let shown = echo(&long);
        assert!(shown.starts_with(&"7".repeat(ECHO_CHARS)), "{shown}");
        assert!(shown.ends_with("7… (119940 more characters)"), "{shown}");
        assert!(shown.chars().count() < ECHO_CHARS + 40, "{shown}");
    }
}
