//! Addition: the input is two numbers of `len` decimal digits each, `a+b`, the output is
//! the `len + 1` digits of their sum, most significant first. The symbols are the digits;
//! `+` is a token of its own.

use super::{FIRST, TaskConfig, TaskRules, tokens};
use crate::fields::N_SYMBOLS;

/// `a+b` -> the digits of the sum.
pub struct AddTask;

impl TaskRules for AddTask {
    fn name(&self) -> &'static str {
        "add"
    }

    fn output(&self, symbols: &[usize]) -> Vec<usize> {
        let (a, b) = symbols.split_at(symbols.len() / 2);
        tokens(&add_digits(a, b))
    }

    fn validate(&self, task: &TaskConfig) -> anyhow::Result<()> {
        anyhow::ensure!(
            task.n_symbols == 10,
            "{} must be 10 for add, whose symbols are the digits, got {}",
            N_SYMBOLS.name(),
            task.n_symbols
        );
        Ok(())
    }

    /// Both operands' digits.
    fn draws(&self, len: usize) -> usize {
        2 * len
    }

    fn base(&self, _task: &TaskConfig) -> usize {
        10
    }

    /// The first operand's digits, `+`, the second's.
    fn input(&self, task: &TaskConfig, symbols: &[usize]) -> Vec<usize> {
        let (a, b) = symbols.split_at(symbols.len() / 2);
        let plus = FIRST + task.n_symbols;
        tokens(a)
            .into_iter()
            .chain([plus])
            .chain(tokens(b))
            .collect()
    }

    fn own_tokens(&self) -> &'static [&'static str] {
        &["+"]
    }

    fn lengths(&self, len: usize) -> [usize; 2] {
        [2 * len + 1, len + 1]
    }

    /// The digits of the sum, unseparated.
    fn format_output(&self, labels: &[String]) -> String {
        labels.concat()
    }

    /// Two operands of as many digits joined by `+` (`123+456`, spaces around the `+`
    /// allowed).
    fn parse(&self, task: &TaskConfig, text: &str) -> anyhow::Result<Vec<usize>> {
        // Operands (a run of digits and where it starts) and `+` signs, in order.
        enum Part {
            Digits(String, usize),
            Plus(usize),
        }
        let mut parts: Vec<Part> = Vec::new();
        for (i, c) in text.chars().enumerate() {
            let at = i + 1;
            match c {
                '0'..='9' => match parts.last_mut() {
                    Some(Part::Digits(digits, start)) if *start + digits.len() == at => {
                        digits.push(c)
                    }
                    _ => parts.push(Part::Digits(c.to_string(), at)),
                },
                '+' => parts.push(Part::Plus(at)),
                c if c.is_whitespace() => {}
                c => anyhow::bail!(
                    "character {at} `{}` is neither a digit nor `+`",
                    crate::text::echo(&c.to_string())
                ),
            }
        }
        let (a, b) = match parts.as_slice() {
            [] => anyhow::bail!("the input is empty; add reads `A+B`, e.g. `123+456`"),
            [Part::Digits(a, _), Part::Plus(_), Part::Digits(b, _)] => (a, b),
            [Part::Plus(at), ..] => anyhow::bail!("`+` at character {at}: expected a digit"),
            [Part::Digits(..), Part::Digits(_, at), ..] => anyhow::bail!(
                "the digits at character {at} continue an operand after a space: write each \
                 operand without spaces"
            ),
            [Part::Digits(..)] => anyhow::bail!("no `+`: add reads `A+B`, e.g. `123+456`"),
            [Part::Digits(..), Part::Plus(at)] => {
                anyhow::bail!("nothing after `+` at character {at}: expected the second operand")
            }
            [_, _, _, Part::Plus(at), ..] | [_, Part::Plus(_), Part::Plus(at), ..] => {
                anyhow::bail!("a second `+` at character {at}: add takes two operands")
            }
            [_, _, _, Part::Digits(_, at), ..] => anyhow::bail!(
                "the digits at character {at} continue the second operand after a space"
            ),
        };
        anyhow::ensure!(
            a.len() == b.len(),
            "the operands have {} and {} digits; add takes two operands of the same length",
            a.len(),
            b.len()
        );
        let digits: Vec<usize> = a
            .chars()
            .chain(b.chars())
            .map(|c| c as usize - '0' as usize)
            .collect();
        Ok(self.input(task, &digits))
    }

    /// Digits per operand.
    fn length_of(&self, tokens: &[usize]) -> usize {
        tokens.len() / 2
    }

    fn count(&self, len: usize) -> String {
        format!("{} per operand", crate::text::plural(len, "digit"))
    }
}

/// Decimal addition, most significant digit first; the result has `len + 1` digits.
fn add_digits(a: &[usize], b: &[usize]) -> Vec<usize> {
    let mut out = vec![0; a.len() + 1];
    let mut carry = 0;
    for i in (0..a.len()).rev() {
        let s = a[i] + b[i] + carry;
        out[i + 1] = s % 10;
        carry = s / 10;
    }
    out[0] = carry;
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tasks::Task;

    #[test]
    fn sums_are_computed_and_parsed_strictly() {
        assert_eq!(add_digits(&[9, 9, 9], &[0, 0, 1]), vec![1, 0, 0, 0]);
        let add = TaskConfig {
            task: Task::Add,
            min_len: 2,
            max_len: 4,
            n_symbols: 10,
            ..TaskConfig::default()
        };
        let sum = add.parse("12 + 34").unwrap();
        assert_eq!(sum, add.parse("12+34").unwrap());
        assert_eq!(add.format_output(&sum), "12+34");
        for (input, wanted) in [
            ("123+", "nothing after `+` at character 4"),
            ("1+2+3", "a second `+` at character 4"),
            ("1234+56", "4 and 2 digits"),
            ("++++", "`+` at character 1"),
            ("12 3+456", "continue an operand"),
            ("12a+45", "character 3 `a`"),
            ("", "empty"),
            ("12345+12345", "at most 4"),
        ] {
            let err = add.parse(input).unwrap_err().to_string();
            assert!(err.contains(wanted), "{input:?}: {err}");
        }
    }
}
