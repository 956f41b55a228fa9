//! Which stores this machine can test. A store's tests need its server installed (and
//! etcd's also the crate's `etcd` feature, whose client needs `protoc` to build); a test of
//! a store that cannot be tested here returns at once ([`skip`]), the run ends by naming
//! each such store with the command that brings what is missing (`stores.rs` in the test
//! binary), and a strict run ([`strict`]: CI) fails instead, so that CI can never pass by
//! skipping.

use std::path::Path;
use std::sync::OnceLock;

/// A store whose tests need a server of its own kind. (`MemoryBackend` needs none.)
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    Redis,
    Postgres,
    MariaDb,
    Etcd,
    ZooKeeper,
}

/// What keeps a store's tests from running here, and the command that brings it.
#[derive(Clone, Debug)]
pub struct Missing {
    pub what: String,
    pub fix: &'static str,
}

impl Store {
    pub const ALL: [Store; 5] = [
        Store::Redis,
        Store::Postgres,
        Store::MariaDb,
        Store::Etcd,
        Store::ZooKeeper,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Store::Redis => "Redis",
            Store::Postgres => "PostgreSQL",
            Store::MariaDb => "MySQL/MariaDB",
            Store::Etcd => "etcd",
            Store::ZooKeeper => "ZooKeeper",
        }
    }

    /// What is missing to test this store here, if anything (looked up once per run).
    pub fn missing(self) -> Option<&'static Missing> {
        static FOUND: OnceLock<Vec<Option<Missing>>> = OnceLock::new();
        let found = FOUND.get_or_init(|| Store::ALL.iter().map(|s| s.look_up()).collect());
        let index = Store::ALL.iter().position(|s| *s == self)?;
        found[index].as_ref()
    }

    fn look_up(self) -> Option<Missing> {
        let missing = |what: &str, fix| {
            Some(Missing {
                what: what.to_owned(),
                fix,
            })
        };
        match self {
            Store::Redis if !on_path("redis-server") || !on_path("redis-cli") => missing(
                "redis-server is not on PATH",
                "apt-get install redis-server",
            ),
            Store::Postgres => match super::postgres::bindir() {
                Ok(_) => None,
                Err(_) => missing(
                    "initdb is not found (pg_config, /usr/lib/postgresql/*/bin, PATH)",
                    "apt-get install postgresql",
                ),
            },
            Store::MariaDb
                if !["mariadbd", "mariadb-install-db"]
                    .iter()
                    .all(|p| super::mariadb::program(p).is_file() || on_path(p))
                    || !on_path("mariadb") =>
            {
                missing(
                    "mariadbd, mariadb-install-db or the mariadb client is not installed",
                    "apt-get install mariadb-server mariadb-client",
                )
            }
            Store::Etcd if cfg!(not(feature = "etcd")) => missing(
                "the crate's `etcd` feature is off (its client's build needs protoc)",
                if on_path("protoc") && on_path("etcd") {
                    "cargo test --all-features"
                } else {
                    "apt-get install protobuf-compiler etcd-server, then cargo test --all-features"
                },
            ),
            Store::Etcd if !on_path("etcd") => {
                missing("etcd is not on PATH", "apt-get install etcd-server")
            }
            Store::ZooKeeper
                if !Path::new(super::zookeeper::CLASSPATH).is_file() || !on_path("java") =>
            {
                missing(
                    "java or /usr/share/java/zookeeper.jar is not installed",
                    "apt-get install zookeeper",
                )
            }
            _ => None,
        }
    }
}

/// Whether a missing server fails the run rather than skipping its store's tests: with
/// `CI=true` (as CI sets it) or `TOWER_LOCK_TEST_STRICT=1`.
pub fn strict() -> bool {
    let set = |name| std::env::var(name).is_ok_and(|v| matches!(v.as_str(), "1" | "true" | "yes"));
    set("CI") || set("TOWER_LOCK_TEST_STRICT")
}

/// Whether a test of `store` returns at once: when the store cannot be tested on this
/// machine. In a [`strict`] run that panics instead, naming what is missing.
pub fn skip(store: Store) -> bool {
    let Some(missing) = store.missing() else {
        return false;
    };
    if strict() {
        panic!(
            "{} cannot be tested here: {} ({}); a strict run (CI) tests every store",
            store.name(),
            missing.what,
            missing.fix
        );
    }
    true
}

/// Returns from the test at once when `store` cannot be tested here (see [`skip`]).
#[macro_export]
macro_rules! needs {
    ($($store:ident),+) => {
        $(
            if $crate::support::stores::skip($crate::support::stores::Store::$store) {
                return;
            }
        )+
    };
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .any(|dir| dir.join(program).is_file())
}
