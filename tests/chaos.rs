//! The chaos suite, bounded for CI: three fake upstreams with random faults,
//! mixed streaming and non-streaming traffic from concurrent clients,
//! routes.yaml rewritten every 200 ms, one upstream killed and restarted
//! mid-run. The scenario and its checks are in `examples/chaos/harness.rs`
//! (shared with the long manual run, `cargo run --release --example chaos`).
//!
//! A heavy test: `.ci/run` runs it with the other `#[ignore]`d tests, one at a
//! time (`cargo test --test tests -- --ignored --test-threads=1`); run it
//! alone with `cargo test --test tests chaos -- --ignored --nocapture` (the
//! summary table is printed). The run itself happens in a child process of
//! this test binary, so that the descriptors and RSS it checks are its own
//! and not those of other tests in the same process (its gateway's metrics
//! are its own anyway: each gateway has its own registry).

// `harness` reaches it as `super::fake_upstream`.
use crate::fake_upstream;

#[path = "../examples/chaos/harness.rs"]
mod harness;

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::support::wait_blocking;

/// Set in the child process.
const CHILD: &str = "SWITCHYARD_CHAOS_CHILD";
/// The child is killed after this long.
const LIMIT: Duration = Duration::from_secs(170);

#[test]
#[ignore = "heavy (25 s of load); .ci/run runs it alone"]
fn chaos_suite_in_its_own_process() {
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new(exe)
        .args([
            "chaos::chaos_run",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads",
            "1",
        ])
        .env(CHILD, "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the chaos child process");
    let mut out = child.stdout.take().expect("stdout");
    let mut err = child.stderr.take().expect("stderr");
    let out_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = out.read_to_string(&mut s);
        s
    });
    let err_reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    let mut status = None;
    if !wait_blocking(LIMIT, || {
        status = child.try_wait().expect("wait for the chaos child");
        status.is_some()
    }) {
        let _ = child.kill();
        let _ = child.wait();
    }
    let stdout = out_reader.join().unwrap_or_default();
    let stderr = err_reader.join().unwrap_or_default();
    println!("{stdout}");
    eprintln!("{stderr}");
    let status = status.unwrap_or_else(|| panic!("the chaos run took over {LIMIT:?}"));
    assert!(
        stdout.contains("1 passed"),
        "the chaos run did not pass ({status}); its output is above"
    );
}

/// The run itself; started by the test above in a process of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run by chaos_suite_in_its_own_process, in a child process"]
async fn chaos_run() {
    if std::env::var_os(CHILD).is_none() {
        // Not started by the test above (`-- --ignored` runs both): the run
        // belongs in a process of its own.
        eprintln!("chaos_run: skipped here; it runs in the child process of chaos_suite_in_its_own_process");
        return;
    }
    let report = harness::run(harness::Params::default()).await;
    println!("{}", report.table);
    let problems = report.problems();
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
