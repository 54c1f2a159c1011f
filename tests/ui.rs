//! UI tests of the precision DSL (trybuild): every misuse in `tests/ui/{full_precision,mixed_step,
//! autocast,boundary,precision}` must fail to compile with the message pinned in its `.stderr`; the accepted forms in
//! `tests/ui/pass` must compile and run.
//!
//! Regenerate the snapshots after a deliberate change with `TRYBUILD=overwrite cargo test --test ui`
//! and read every diff.
//!
//! The `.stderr` snapshots were written with [`SNAPSHOT_RUSTC`]. Compiler diagnostics change
//! wording between releases, so on another compiler a mismatch may be the compiler's, not ours:
//! the test says so before it runs.

/// The compiler the `.stderr` snapshots were written with (`rustc --version`).
const SNAPSHOT_RUSTC: &str = "rustc 1.95.0 (59807616e 2026-04-14)";

/// `rustc --version` of the compiler cargo uses (`$RUSTC`, else `rustc`), if it can be run.
fn rustc_version() -> Option<String> {
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let out = std::process::Command::new(rustc)
        .arg("--version")
        .output()
        .ok()?;
    Some(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn ui() {
    match rustc_version() {
        Some(v) if v == SNAPSHOT_RUSTC => {}
        found => eprintln!(
            "note: the UI snapshots were written with `{SNAPSHOT_RUSTC}`, this is `{}`; a \
             mismatch in a compiler-written part of a message may come from the compiler version",
            found.as_deref().unwrap_or("an unknown rustc")
        ),
    }
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/full_precision/*.rs");
    t.compile_fail("tests/ui/mixed_step/*.rs");
    t.compile_fail("tests/ui/autocast/*.rs");
    t.compile_fail("tests/ui/boundary/*.rs");
    t.compile_fail("tests/ui/precision/*.rs");
    t.compile_fail("tests/ui/half_layers/*.rs");
    t.pass("tests/ui/pass/*.rs");
}
