# Optional shorthand: every recipe is a plain cargo command or `.ci/run` (see the README's
# "Two commands"); nothing here is needed to build, run the demo or test.
set shell := ["bash", "-euo", "pipefail", "-c"]

# List the recipes.
default:
    @just --list

# The flash-sale demonstration (a throwaway redis-server, or MemoryBackend without one).
demo:
    cargo run --release --example flash_sale

# Every test of every store installed here (the tests start their own servers on free
# ports); `just test-all` adds etcd's, whose client's build needs protoc.
test:
    cargo test

# Every test of every store, etcd's included, each store required (as CI runs them).
test-all:
    CI=true cargo test --all-features

# The benchmark table (starts its own redis-server).
bench:
    cargo bench --bench contention

# What CI runs: installs the servers when missing, then formatting, lints, docs, the
# crate without its `axum` feature, and every store's tests.
ci:
    bash .ci/run

# The crate for a plain tower/hyper service, without axum (part of `ci`).
no-axum:
    bash .ci/run no-axum
