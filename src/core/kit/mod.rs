//! The store kit: what every store's builder and backend take from the core besides the
//! engine itself.
//!
//! - `settings.rs`: the settings every builder shares, their one validation, and the
//!   setters each builder expands.

pub(crate) mod settings;
