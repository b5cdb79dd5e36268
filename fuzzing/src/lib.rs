//! Shared pieces of tandem's property-based fuzz tests (stable Rust, proptest). Each crate fuzzes its
//! own input surface through the entry point the product uses; this crate only holds what they share:
//!
//! - [`config`]: the case budget. Small by default so `cargo test` stays fast; `TANDEM_FUZZ_CASES`
//!   (set by `scripts/fuzz.sh`) runs longer. Failures are not persisted to files: a failing input found
//!   by a long run is kept as an explicit regression test next to the code it broke.
//! - [`json`]: arbitrary JSON values and structure-aware mutations of a valid document (a field
//!   removed, retyped, set to an edge value, or a new field added), so inputs get past the first
//!   `serde` check and reach validation.

pub mod json;

use proptest::test_runner::Config;

/// The environment variable that overrides every fuzz test's number of cases.
pub const CASES_ENV: &str = "TANDEM_FUZZ_CASES";

/// `default_cases` cases, or `TANDEM_FUZZ_CASES` when set.
pub fn config(default_cases: u32) -> Config {
    Config { cases: cases(default_cases), failure_persistence: None, ..Config::default() }
}

/// The number of cases a fuzz test runs: `TANDEM_FUZZ_CASES` when set, else `default_cases`.
pub fn cases(default_cases: u32) -> u32 {
    std::env::var(CASES_ENV).ok().and_then(|v| v.trim().parse().ok()).unwrap_or(default_cases)
}

/// Runs `case` over inputs drawn from `strategy` (`default_cases` of them, or `TANDEM_FUZZ_CASES`), and
/// panics with `name` and the shrunk failing input on the first failure.
pub fn run<S: proptest::strategy::Strategy>(
    default_cases: u32,
    name: &str,
    strategy: S,
    case: impl Fn(S::Value) -> Result<(), proptest::test_runner::TestCaseError>,
) where
    S::Value: std::fmt::Debug,
{
    if let Err(e) = proptest::test_runner::TestRunner::new(config(default_cases)).run(&strategy, case) {
        panic!("{name}: {e}");
    }
}

/// Arbitrary bytes, mostly short, sometimes up to `max` long.
pub fn bytes(max: usize) -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
    use proptest::prelude::*;
    prop_oneof![
        4 => proptest::collection::vec(any::<u8>(), 0..64),
        1 => proptest::collection::vec(any::<u8>(), 0..max.max(1)),
    ]
}
