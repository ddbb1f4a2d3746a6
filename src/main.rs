//! The `pagedweight` command-line tool.
fn main() {}
