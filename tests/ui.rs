//! UI tests of the precision DSL (trybuild): every misuse in `tests/ui/{full_precision,mixed_step,
//! autocast,boundary}` must fail to compile with the message pinned in its `.stderr`; the accepted forms in
//! `tests/ui/pass` must compile and run.
//!
//! Regenerate the snapshots after a deliberate change with `TRYBUILD=overwrite cargo test --test ui`
//! and read every diff. The snapshots are tied to the installed stable compiler (1.95).

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/full_precision/*.rs");
    t.compile_fail("tests/ui/mixed_step/*.rs");
    t.compile_fail("tests/ui/autocast/*.rs");
    t.compile_fail("tests/ui/boundary/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
