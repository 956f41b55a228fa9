//! The settings every store's builder shares ([`StoreSettings`]): one type, checked in one
//! place with one text per refusal, and one set of documented setters that each builder
//! expands into its own `impl` block ([`store_setters!`]), so that rustdoc shows them on
//! every builder. What only one store takes (a table, a lease TTL, certificates) stays in
//! that store's builder.

use std::time::Duration;

use crate::core::{Parts, Settings};
use crate::error::BuildError;
use crate::key::validate_namespace;
use crate::lock::MAX_DURATION;
use crate::lock::{
    DEFAULT_MAX_KEY_LEN, DEFAULT_MAX_LOCAL_HANDOFF_TIME, DEFAULT_MAX_LOCAL_HANDOFFS,
};
use crate::telemetry::{self, Namespace};

/// The namespace of a backend that was given none.
const DEFAULT_NAMESPACE: &str = "tower-lock";

/// The longest pause of a listening connection between two attempts to reconnect.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// The settings every store's builder takes, as they are set (see [`store_setters!`] for
/// what each means); `build` checks them with [`validate`](Self::validate).
#[derive(Debug, Clone)]
pub(crate) struct StoreSettings {
    /// The prefix of every name the backend keeps in its store.
    pub(crate) namespace: String,
    /// The longest key accepted, in bytes.
    pub(crate) max_key_len: usize,
    /// How long a new connection may take.
    pub(crate) connect_timeout: Duration,
    /// How long one call to the store may take.
    pub(crate) command_timeout: Duration,
    /// The longest pause of a listening connection between two attempts to reconnect.
    pub(crate) max_backoff: Duration,
    /// Connections of the command pool, for the stores that keep one.
    pub(crate) pool_size: u32,
    /// Consecutive handoffs in memory under one hold in the store (0: none).
    pub(crate) max_local_handoffs: u32,
    /// How long one process's tasks may take turns under one hold in the store.
    pub(crate) max_local_handoff_time: Duration,
}

impl StoreSettings {
    /// The defaults, with the store's own `timeout` for connections and calls alike, and a
    /// pool of one connection (a store with a pool sets its own size).
    pub(crate) fn new(timeout: Duration) -> Self {
        StoreSettings {
            namespace: DEFAULT_NAMESPACE.to_owned(),
            max_key_len: DEFAULT_MAX_KEY_LEN,
            connect_timeout: timeout,
            command_timeout: timeout,
            max_backoff: MAX_BACKOFF,
            pool_size: 1,
            max_local_handoffs: DEFAULT_MAX_LOCAL_HANDOFFS,
            max_local_handoff_time: DEFAULT_MAX_LOCAL_HANDOFF_TIME,
        }
    }

    /// These settings with calls bounded by `timeout`, not the connection timeout: for a
    /// store whose calls wait an election out.
    #[cfg(any(feature = "etcd", feature = "zookeeper"))]
    pub(crate) fn with_command_timeout(mut self, timeout: Duration) -> Self {
        self.command_timeout = timeout;
        self
    }

    /// These settings with no handoff in memory: for a store whose tokens it issues itself
    /// (etcd's revisions, ZooKeeper's zxids), none of which can be set aside for a run.
    pub(crate) fn without_handoffs(mut self) -> Self {
        self.max_local_handoffs = 0;
        self
    }

    /// Refuses the settings no store can run with, naming the first: a namespace that
    /// could escape or collide, a zero timeout (every call would fail), a zero key length
    /// (every key would be refused).
    pub(crate) fn validate(&self) -> Result<(), BuildError> {
        validate_namespace(&self.namespace)?;
        refuse_zero("command_timeout", self.command_timeout)?;
        refuse_zero("connect_timeout", self.connect_timeout)?;
        if self.max_key_len == 0 {
            return Err(BuildError::Setting {
                name: "max_key_len",
                reason: "it must be at least one byte",
            });
        }
        Ok(())
    }

    /// What the core needs besides the store, with the metrics described and labelled
    /// with the namespace (`parts.metrics`, for the store's wake-ups too).
    pub(crate) fn parts(&self) -> Parts {
        telemetry::describe_metrics();
        Parts::new(
            Settings {
                command_timeout: self.command_timeout,
                max_local_handoffs: self.max_local_handoffs,
                max_local_handoff_time: self.max_local_handoff_time,
                max_key_len: self.max_key_len,
            },
            Namespace::new(&self.namespace),
        )
    }
}

/// Refuses the duration `value` of the setting `name` if it is zero, which would fail
/// every call it bounds.
pub(crate) fn refuse_zero(name: &'static str, value: Duration) -> Result<(), BuildError> {
    if value.is_zero() {
        return Err(BuildError::Setting {
            name,
            reason: "it must be above zero",
        });
    }
    Ok(())
}

/// Refuses the duration `value` of the setting `name` if it is under a second: what a
/// store that counts it in whole seconds cannot take.
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "zookeeper")),
    expect(
        dead_code,
        reason = "only the SQL stores' fence lease and ZooKeeper's session timeout are refused under a second"
    )
)]
pub(crate) fn refuse_under_a_second(name: &'static str, value: Duration) -> Result<(), BuildError> {
    if value < Duration::from_secs(1) {
        return Err(BuildError::Setting {
            name,
            reason: "it must be at least one second",
        });
    }
    Ok(())
}

/// `timeout` as the builders keep it: at most [`MAX_DURATION`], like every duration of the
/// crate, so that arithmetic on it cannot overflow.
pub(crate) fn clamped(timeout: Duration) -> Duration {
    timeout.min(MAX_DURATION)
}

/// Expands, inside a store builder's `impl` block, to the setters of the settings every
/// builder shares, documented once here. The builder keeps its [`StoreSettings`] in the
/// field named first, and lists the setters it takes in the order its docs show them,
/// each with the store's default where stores differ (`fn connect_timeout = "2 s";`) and,
/// as a doc comment before it, what the setting means on that store besides (appended to
/// the shared docs).
///
/// The setters: `namespace`, `max_key_len`, `connect_timeout` (default), `command_timeout`
/// (default), `pool_size` (default), `max_local_handoffs`, `max_local_handoff_time`.
macro_rules! store_setters {
    (
        $field:ident;
        $(
            $(#[$doc:meta])*
            fn $name:ident $(= $default:literal)?;
        )*
    ) => {
        $(
            $crate::core::kit::settings::store_setters!(
                @$name ($field) ($($default)?) $(#[$doc])*
            );
        )*
    };
    (@namespace ($field:ident) () $(#[$doc:meta])*) => {
        /// The prefix of every name this backend keeps in its store (default `tower-lock`):
        /// backends whose locks must not contend with each other use different namespaces.
        /// Refused at build ([`BuildError::Namespace`](crate::BuildError::Namespace)) if
        /// empty or if it contains `{`, `}` or control characters.
        ///
        $(#[$doc])*
        pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
            self.$field.namespace = namespace.into();
            self
        }
    };
    (@max_key_len ($field:ident) () $(#[$doc:meta])*) => {
        /// The longest key accepted, in bytes (default 1024); longer keys are refused with
        /// [`KeyError::TooLong`](crate::KeyError::TooLong) (400 from the layer), never
        /// truncated. It counts the key as the extractor returns it, a route's prefix
        /// included (`PathParam::new("id").prefix("order")` makes `order:42`, 8 bytes), and
        /// not the namespace. Refused at build if zero.
        ///
        $(#[$doc])*
        pub fn max_key_len(mut self, len: usize) -> Self {
            self.$field.max_key_len = len;
            self
        }
    };
    (@connect_timeout ($field:ident) ($default:literal) $(#[$doc:meta])*) => {
        #[doc = concat!(
            "How long to wait for a new connection to the store (default ", $default, "): ",
            "what `build` waits for a server that does not answer, and what each attempt ",
            "to reconnect takes before the next; a refused connection fails at once. ",
            "Refused at build if zero."
        )]
        ///
        $(#[$doc])*
        pub fn connect_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.$field.connect_timeout = $crate::core::kit::settings::clamped(timeout);
            self
        }
    };
    (@command_timeout ($field:ident) ($default:literal) $(#[$doc:meta])*) => {
        #[doc = concat!(
            "How long one call to the store may take before it counts as failed (default ",
            $default, "): an acquisition fails after it (503 from the layer), a renewal is ",
            "tried again. Waiting for a held lock is not a call: it is bounded by the wait, ",
            "not by this. Refused at build if zero."
        )]
        ///
        $(#[$doc])*
        pub fn command_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.$field.command_timeout = $crate::core::kit::settings::clamped(timeout);
            self
        }
    };
    (@pool_size ($field:ident) ($default:literal) $(#[$doc:meta])*) => {
        #[doc = concat!(
            "Connections of the command pool (default ", $default, "; at least 1)."
        )]
        ///
        $(#[$doc])*
        pub fn pool_size(mut self, size: u32) -> Self {
            self.$field.pool_size = size.max(1);
            self
        }
    };
    (@max_local_handoffs ($field:ident) () $(#[$doc:meta])*) => {
        /// How many times in a row the lock may pass between tasks of this backend under
        /// one hold in the store (default
        /// [`DEFAULT_MAX_LOCAL_HANDOFFS`](crate::lock::DEFAULT_MAX_LOCAL_HANDOFFS)); 0 turns
        /// handoff off.
        ///
        /// When a task releases a key that another task of the same backend waits for, the
        /// lock passes to it in memory, without a call to the store: the store keeps the
        /// hold under the first task's owner while the tasks take turns, each with its own
        /// owner (for re-entry) and a fencing token of its own, taken from a block reserved
        /// in the store when the hold was taken. This happens only while the hold is
        /// confirmed: its last acquisition or renewal was acknowledged less than half a
        /// lease ago (less a margin for clock drift). A run serves the tasks that were
        /// queued when it began, each once: after the last of them, or after `max`
        /// handoffs, or [`max_local_handoff_time`](Self::max_local_handoff_time), whichever
        /// comes first, the release goes to the store, which lets waiting instances in.
        ///
        $(#[$doc])*
        pub fn max_local_handoffs(mut self, max: u32) -> Self {
            self.$field.max_local_handoffs = max;
            self
        }
    };
    (@max_local_handoff_time ($field:ident) () $(#[$doc:meta])*) => {
        /// How long the tasks of this backend may take turns with the lock under one hold
        /// in the store before a release goes to the store, letting waiting instances in
        /// (default
        /// [`DEFAULT_MAX_LOCAL_HANDOFF_TIME`](crate::lock::DEFAULT_MAX_LOCAL_HANDOFF_TIME),
        /// counted from when the store granted the hold; see
        /// [`max_local_handoffs`](Self::max_local_handoffs)).
        ///
        $(#[$doc])*
        pub fn max_local_handoff_time(mut self, time: std::time::Duration) -> Self {
            self.$field.max_local_handoff_time = time;
            self
        }
    };
}

pub(crate) use store_setters;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_names_its_setting() {
        let defaults = StoreSettings::new(Duration::from_secs(1));
        assert!(defaults.validate().is_ok());
        let named = |settings: StoreSettings| match settings.validate() {
            Err(BuildError::Setting { name, .. }) => name,
            other => panic!("refused as a setting: {other:?}"),
        };
        let zero = Duration::ZERO;
        let command = StoreSettings {
            command_timeout: zero,
            ..defaults.clone()
        };
        assert_eq!(named(command), "command_timeout");
        let connect = StoreSettings {
            connect_timeout: zero,
            ..defaults.clone()
        };
        assert_eq!(named(connect), "connect_timeout");
        let key = StoreSettings {
            max_key_len: 0,
            ..defaults.clone()
        };
        assert_eq!(named(key), "max_key_len");
        let namespace = StoreSettings {
            namespace: "a{b}".to_owned(),
            ..defaults
        };
        assert!(matches!(
            namespace.validate(),
            Err(BuildError::Namespace { .. })
        ));
    }
}
