//! Separate OS processes for the fault tests: the test binary runs itself again with
//! `--exact ENTRY --ignored`, and the ignored entry test plays the role named in the
//! environment. No extra binary has to be built, so this works in a plain `cargo test`.

use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader, Lines};
use tokio::process::{Child, ChildStdout, Command};

const ROLE_VAR: &str = "TOWER_LOCK_TEST_CHILD_ROLE";
/// Marks the lines a child reports, among whatever the test harness prints.
const REPORT_PREFIX: &str = "@child ";

/// The role this process was started to play, if it is a child.
pub fn role() -> Option<String> {
    std::env::var(ROLE_VAR).ok()
}

/// Reads a setting the parent passed to this child.
pub fn setting(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("child setting {name} is missing"))
}

/// Tells the parent something (one line).
pub fn report(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{REPORT_PREFIX}{line}").expect("stdout");
    out.flush().expect("stdout");
}

/// A child process of the test, killed when dropped.
pub struct ChildProcess {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl ChildProcess {
    /// Runs the ignored test `entry` of this binary as `role`, with `settings` in its
    /// environment.
    pub fn spawn(entry: &str, role: &str, settings: &[(&str, String)]) -> Self {
        let exe = std::env::current_exe().expect("test binary path");
        Self::spawn_with(Command::new(exe), entry, role, settings)
    }

    /// [`spawn`](Self::spawn) inside the network namespace `netns` (see `netns.rs`).
    /// `ip netns exec` execs the binary, so [`pid`](Self::pid) is the child's own.
    pub fn spawn_in(netns: &str, entry: &str, role: &str, settings: &[(&str, String)]) -> Self {
        let exe = std::env::current_exe().expect("test binary path");
        let mut command = Command::new("ip");
        command.args(["netns", "exec", netns]).arg(exe);
        Self::spawn_with(command, entry, role, settings)
    }

    fn spawn_with(
        mut command: Command,
        entry: &str,
        role: &str,
        settings: &[(&str, String)],
    ) -> Self {
        let mut child = command
            .args([
                "--exact",
                entry,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_VAR, role)
            .envs(settings.iter().map(|(k, v)| (*k, v.as_str())))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the test binary as a child");
        let stdout = child.stdout.take().expect("piped stdout");
        ChildProcess {
            child,
            lines: BufReader::new(stdout).lines(),
        }
    }

    /// The next line the child reported, waiting generously (a hang fails the test).
    /// `None` once the child has exited.
    pub async fn next_report(&mut self) -> Option<String> {
        tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = self.lines.next_line().await.expect("child stdout") {
                // The harness prints `test NAME ... ` without a line break before the
                // test runs, so the first report shares its line.
                if let Some((_, report)) = line.split_once(REPORT_PREFIX) {
                    return Some(report.to_owned());
                }
            }
            None
        })
        .await
        .expect("the child reports within 60 s")
    }

    /// The number in the next report, which must read `{word} {number}` (`held 42`).
    pub async fn next_number(&mut self, word: &str) -> u64 {
        let report = self.next_report().await;
        report
            .as_deref()
            .and_then(|r| r.strip_prefix(word)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("expected `{word} <number>` from the child: {report:?}"))
    }

    /// Every remaining report, until the child exits.
    pub async fn remaining_reports(&mut self) -> Vec<String> {
        let mut reports = Vec::new();
        while let Some(report) = self.next_report().await {
            reports.push(report);
        }
        reports
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("child still running")
    }

    /// SIGKILL, as a crash would, and reap it.
    pub async fn kill(&mut self) {
        self.child.kill().await.expect("kill child");
    }

    /// SIGSTOP: the process keeps its connections but runs nothing. Returns once every
    /// thread of it is seen stopped (`T` in `/proc/PID/task/*/stat`): the signal is
    /// delivered asynchronously, and a test that acts right after must not race a child
    /// still running on another core.
    pub fn pause(&self) {
        let pid = self.pid();
        super::send_signal(pid, "-STOP");
        let stopped = || {
            std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|tasks| {
                    tasks.filter_map(Result::ok).all(|task| {
                        std::fs::read_to_string(task.path().join("stat"))
                            .ok()
                            .and_then(|stat| stat.rsplit(')').next().map(str::to_owned))
                            .is_some_and(|rest| rest.trim_start().starts_with('T'))
                    })
                })
                .unwrap_or(true)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !stopped() {
            assert!(
                std::time::Instant::now() < deadline,
                "child {pid} never stopped"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// SIGCONT after `pause`.
    pub fn resume(&self) {
        super::send_signal(self.pid(), "-CONT");
    }

    /// Waits for the child to exit and asserts it succeeded.
    pub async fn assert_success(&mut self) {
        let status = tokio::time::timeout(Duration::from_secs(60), self.child.wait())
            .await
            .expect("child exits within 60 s")
            .expect("wait for child");
        assert!(status.success(), "child failed: {status}");
    }
}
