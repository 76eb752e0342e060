//! Reverse: the output is the input reversed.

use super::{TaskRules, tokens};

/// The output is the input reversed.
pub struct ReverseTask;

impl TaskRules for ReverseTask {
    fn name(&self) -> &'static str {
        "reverse"
    }

    fn output(&self, symbols: &[usize]) -> Vec<usize> {
        let mut output = tokens(symbols);
        output.reverse();
        output
    }
}
