//! What Redis spends on each operation, in instructions counted by callgrind: a figure that
//! does not move with the machine's load (the same binary and inputs count the same), so
//! a change to the scripts can be measured on a busy machine. The server runs under
//! `valgrind --tool=callgrind`; after each phase of `N` operations the bench has callgrind
//! write out what it counted since the last phase (`callgrind_control --dump`). Skipped,
//! saying so, where valgrind is not installed.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

use tower_lock::RedisBackend;

use super::support::RedisServer;

/// Operations per phase: enough that the server's own timers (its cron, `hz` 10) add
/// under 1%.
const N: u64 = 2000;

pub async fn instructions() -> String {
    let mut out = String::from("### Redis instructions per operation (callgrind)\n\n");
    if Command::new("callgrind_control")
        .arg("-h")
        .output()
        .is_err()
    {
        out += "Skipped: valgrind (callgrind_control) is not installed.\n\n";
        return out;
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let counts = dir.path().join("callgrind.out");
    let out_file = format!("--callgrind-out-file={}", counts.display());
    let server = RedisServer::start_under(&["valgrind", "--tool=callgrind", &out_file], &[]);
    let pid = server.pid().expect("the server runs");
    let mut conn = server.conn().await;
    let backend = server.backend().await;
    let empty = redis::Script::new("return 1");
    // What every call of the acquire script pays before its own first line: it defines the
    // helpers prepended to it (a closure each), as the script's text has them.
    let helpers = redis::Script::new(concat!(
        include_str!("../../src/redis/scripts/helpers/lease.lua"),
        include_str!("../../src/redis/scripts/helpers/holders.lua"),
        include_str!("../../src/redis/scripts/helpers/token.lua"),
        include_str!("../../src/redis/scripts/helpers/guard.lua"),
        include_str!("../../src/redis/scripts/helpers/line.lua"),
        "return 1"
    ));

    // Every script loaded and every connection made before counting starts.
    pair(&backend).await;
    for script in [&empty, &helpers] {
        let _: i64 = script.invoke_async(&mut conn).await.expect("EVALSHA");
    }
    let dump = |phase: &str| dump(pid, phase, dir.path());
    dump("warm-up");
    for _ in 0..N {
        let _: String = redis::cmd("PING")
            .query_async(&mut conn)
            .await
            .expect("PING");
    }
    let ping = dump("ping");
    for _ in 0..N {
        let _: i64 = empty.invoke_async(&mut conn).await.expect("EVALSHA");
    }
    let script = dump("script");
    for _ in 0..N {
        let _: i64 = helpers.invoke_async(&mut conn).await.expect("EVALSHA");
    }
    let defined = dump("helpers");
    for _ in 0..N {
        pair(&backend).await;
    }
    let locked = dump("pair");

    let _ = writeln!(out, "| operation | instructions | PINGs |\n|---|---|---|");
    for (name, count) in [
        ("PING", ping),
        ("EVALSHA of `return 1`", script),
        (
            "EVALSHA of the acquire script's helpers, then `return 1`",
            defined,
        ),
        ("tower-lock `try_once` + `release`", locked),
    ] {
        let _ = writeln!(
            out,
            "| {name} | {count:.0} | {:.2} |",
            count / ping.max(1.0)
        );
    }
    let _ = writeln!(
        out,
        "\n{N} of each, counted in redis-server's process (its network calls' own work in \
         the kernel is not counted). Two `return 1` scripts are the floor of an acquire + \
         release made of one script each; the rest is the scripts' own work.\n"
    );
    out
}

async fn pair(backend: &RedisBackend) {
    let guard = backend
        .lock("bench:counted")
        .try_once()
        .await
        .expect("uncontended");
    guard.release().await.expect("released");
}

/// Has callgrind write out what it counted since the last dump, and returns that per
/// operation of the phase.
fn dump(pid: u32, phase: &str, dir: &Path) -> f64 {
    let done = Command::new("callgrind_control")
        .args(["--dump", phase, &pid.to_string()])
        .output()
        .expect("callgrind_control");
    assert!(done.status.success(), "callgrind_control --dump {phase}");
    let trigger = format!("desc: Trigger: dump {phase}\n");
    let totals = std::fs::read_dir(dir)
        .expect("callgrind's files")
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .find(|text| text.contains(&trigger))
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("totals: "))
                .and_then(|n| n.trim().parse::<f64>().ok())
        })
        .unwrap_or_else(|| panic!("no callgrind dump for {phase}"));
    totals / N as f64
}
