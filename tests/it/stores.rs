//! The stores this run could not test, named once, as the binary's last lines: a test of a
//! store whose server is missing here returns at once (`needs!`), and this says so, with
//! the command that installs what is missing. In a strict run (CI) it fails instead.

use std::sync::OnceLock;

use crate::support::stores::{Store, strict};

#[test]
fn every_store_is_tested_here_or_named() {
    let lines: Vec<String> = Store::ALL
        .iter()
        .filter_map(|store| {
            let missing = store.missing()?;
            Some(format!(
                "not tested: {}: {} (to test it: {})",
                store.name(),
                missing.what,
                missing.fix
            ))
        })
        .collect();
    if lines.is_empty() {
        return;
    }
    assert!(
        !strict(),
        "a strict run (CI) tests every store, and this machine cannot:\n{}",
        lines.join("\n")
    );
    print_at_exit(lines.join("\n"));
}

/// Prints `text` on stderr when the process exits, after the harness's summary.
fn print_at_exit(text: String) {
    static TEXT: OnceLock<String> = OnceLock::new();
    extern "C" fn print() {
        use std::io::Write;
        if let Some(text) = TEXT.get() {
            let _ = writeln!(std::io::stderr(), "\n{text}");
        }
    }
    if TEXT.set(text).is_ok() {
        // SAFETY: `print` is a plain function that only reads a static and writes to
        // stderr; registering it has no other effect.
        unsafe {
            libc::atexit(print);
        }
    }
}
