//! Copy: the output is the input.

use super::{TaskRules, tokens};

/// The output is the input.
pub struct CopyTask;

impl TaskRules for CopyTask {
    fn name(&self) -> &'static str {
        "copy"
    }

    fn output(&self, symbols: &[usize]) -> Vec<usize> {
        tokens(symbols)
    }
}
