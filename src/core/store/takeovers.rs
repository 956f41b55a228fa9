//! Takeovers a store announces (a Sentinel failover), so that a release waiting to retry
//! does so at once (see `Store::takeovers`).

/// See [`Store::takeovers`](crate::core::Store::takeovers): a generation count and its changes.
pub(crate) struct Takeovers(Option<tokio::sync::watch::Receiver<u64>>);

impl Takeovers {
    /// A store that announces no takeovers.
    pub(crate) fn none() -> Self {
        Takeovers(None)
    }

    /// Takeovers announced through `generations`.
    pub(crate) fn from(generations: tokio::sync::watch::Receiver<u64>) -> Self {
        Takeovers(Some(generations))
    }

    /// How many takeovers were announced so far.
    pub(crate) fn generation(&self) -> u64 {
        self.0.as_ref().map_or(0, |g| *g.borrow())
    }

    /// Resolves at the next announced takeover; never, for a store that makes none.
    /// Cancel-safe.
    pub(crate) async fn next(&mut self) {
        if let Some(generations) = &mut self.0
            && generations.changed().await.is_ok()
        {
            return;
        }
        std::future::pending().await
    }
}
