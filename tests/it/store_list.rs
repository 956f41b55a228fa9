//! The list of stores is the crate docs' `# Stores` table, mirrored by the README's
//! `## Stores` table that GitHub shows, and the crate's one-line descriptions name every
//! store: each cargo feature is either a store of [`STORES`] or one of [`OTHER_FEATURES`],
//! and every store is in every one of those places, so that the docs cannot drift from the
//! features.

/// A store: the cargo feature it is behind (`None`: always built), its backend type, and
/// the name the one-line descriptions give it.
struct Store {
    feature: Option<&'static str>,
    backend: &'static str,
    name: &'static str,
}

const STORES: &[Store] = &[
    Store {
        feature: None,
        backend: "RedisBackend",
        name: "Redis",
    },
    Store {
        feature: Some("postgres"),
        backend: "PostgresBackend",
        name: "PostgreSQL",
    },
    Store {
        feature: Some("mysql"),
        backend: "MySqlBackend",
        name: "MySQL",
    },
    Store {
        feature: Some("etcd"),
        backend: "EtcdBackend",
        name: "etcd",
    },
    Store {
        feature: Some("zookeeper"),
        backend: "ZooKeeperBackend",
        name: "ZooKeeper",
    },
    Store {
        feature: None,
        backend: "MemoryBackend",
        name: "memory",
    },
];

/// The cargo features that add no store.
const OTHER_FEATURES: &[&str] = &["default", "axum", "tls", "metrics", "grpc"];

fn read(file: &str) -> String {
    let path = format!("{}/{file}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

/// The lines from `heading` to the next heading of its level (`heading` itself excluded).
fn section<'a>(lines: &[&'a str], heading: &str) -> Vec<&'a str> {
    let level = heading.split(' ').next().unwrap_or_default();
    let start = lines
        .iter()
        .position(|line| *line == heading)
        .unwrap_or_else(|| panic!("no `{heading}` heading"));
    lines[start + 1..]
        .iter()
        .take_while(|line| !line.starts_with(&format!("{level} ")))
        .copied()
        .collect()
}

/// The crate docs' lines, without their `//!`.
fn crate_docs() -> Vec<String> {
    read("src/lib.rs")
        .lines()
        .filter_map(|line| line.strip_prefix("//!"))
        .map(|line| line.strip_prefix(' ').unwrap_or(line).to_owned())
        .collect()
}

/// The `[features]` table's names in Cargo.toml.
fn cargo_features(manifest: &str) -> Vec<String> {
    manifest
        .lines()
        .skip_while(|line| line.trim() != "[features]")
        .skip(1)
        .take_while(|line| !line.starts_with('['))
        .filter_map(|line| line.split_once(" = ").map(|(name, _)| name.trim()))
        .filter(|name| !name.is_empty() && !name.starts_with('#'))
        .map(str::to_owned)
        .collect()
}

#[test]
fn every_cargo_feature_is_a_listed_store_or_a_known_other_feature() {
    for feature in cargo_features(&read("Cargo.toml")) {
        assert!(
            OTHER_FEATURES.contains(&feature.as_str())
                || STORES.iter().any(|store| store.feature == Some(&feature)),
            "the cargo feature `{feature}` is neither a store nor a known other feature: \
             a new store goes into STORES here and into the lists of stores"
        );
    }
}

#[test]
fn crate_docs_stores_table_lists_every_store_with_its_feature() {
    let docs = crate_docs();
    let lines: Vec<&str> = docs.iter().map(String::as_str).collect();
    let table = section(&lines, "# Stores").join("\n");
    for store in STORES {
        let row = table
            .lines()
            .find(|line| line.starts_with('|') && line.contains(&format!("`{}`", store.backend)))
            .unwrap_or_else(|| panic!("no row of `{}` in the crate docs' Stores", store.backend));
        let feature = store
            .feature
            .map_or("(always)".to_owned(), |f| format!("`{f}`"));
        assert!(
            row.contains(&format!("| {feature} |")),
            "the crate docs' row of `{}` does not name its feature {feature}: {row}",
            store.backend
        );
    }
}

#[test]
fn readme_stores_table_lists_every_store_with_its_feature() {
    let readme = read("README.md");
    let lines: Vec<&str> = readme.lines().collect();
    let table = section(&lines, "## Stores").join("\n");
    for store in STORES {
        assert!(
            table.contains(store.backend),
            "the README's Stores table has no `{}`",
            store.backend
        );
        if let Some(feature) = store.feature {
            assert!(
                table.contains(&format!("feature `{feature}`")),
                "the README's Stores table does not name the feature `{feature}`"
            );
        }
    }
}

#[test]
fn one_line_descriptions_name_every_store() {
    let manifest = read("Cargo.toml");
    let description = manifest
        .lines()
        .find_map(|line| line.strip_prefix("description = "))
        .expect("Cargo.toml has a description");
    let docs = crate_docs();
    let first_paragraph = docs
        .iter()
        .take_while(|line| !line.is_empty())
        .cloned()
        .collect::<Vec<_>>()
        .join(" ");
    let readme = read("README.md");
    let readme_intro = readme
        .lines()
        .skip_while(|line| line.starts_with('#') || line.is_empty())
        .take_while(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    for (place, text) in [
        ("Cargo.toml's description", description),
        ("the crate docs' first paragraph", &first_paragraph),
        ("the README's first paragraph", &readme_intro),
    ] {
        for store in STORES {
            assert!(
                text.contains(store.name),
                "{place} does not name {}: {text}",
                store.name
            );
        }
    }
}
