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

# What CI runs: formatting, lints, docs, tests.
ci:
    cargo fmt --all -- --check
    cargo clippy --all-targets -- -D warnings
    RUSTDOCFLAGS="-D warnings" cargo doc --no-deps
    just test
