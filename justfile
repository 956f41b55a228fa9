set shell := ["bash", "-euo", "pipefail", "-c"]

# List the recipes.
default:
    @just --list

# The flash-sale demonstration (a throwaway redis-server unless REDIS_URL is set).
demo:
    scripts/with-redis.sh cargo run --quiet --release --example flash_sale

# Every test; each test starts its own redis-server on a free port.
test:
    cargo test

# The benchmark table (starts its own redis-server).
bench:
    cargo bench --bench contention

# What CI runs: formatting, lints, docs, tests, and the crate without its `axum` feature.
ci:
    cargo fmt --all -- --check
    cargo clippy --all-targets -- -D warnings
    RUSTDOCFLAGS="-D warnings" cargo doc --no-deps
    just no-axum
    just test

# The crate for a plain tower/hyper service: builds, lints and passes its unit tests
# without axum, and axum is not among its dependencies.
no-axum:
    cargo build --no-default-features
    cargo clippy --all-targets --no-default-features -- -D warnings
    cargo test --no-default-features --lib
    deps="$(cargo tree --no-default-features --edges normal --prefix none)"; ! grep -q '^axum ' <<< "$deps"
