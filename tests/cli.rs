//! The real binary: `validate` (one line per problem, located, exit codes,
//! `--strict`) and `serve` (answers, exits 0 on SIGTERM).

use std::path::Path;
use std::time::Duration;

use crate::binary::{self, Served};
use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

const GOOD: &str = "version: 1
providers:
  p1: { base_url: 'http://127.0.0.1:9/v1', timeout: 2s }
targets:
  t1: { provider: p1, model: m1 }
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [t1]
";

/// Four semantic problems (missing version, bad duration, unknown target,
/// duplicate alias), no structural one. Line numbers are 1-based.
const SEMANTIC: &str = "providers:
  p1:
    base_url: http://127.0.0.1:9/v1
    timeout: soon
targets:
  t1: { provider: p1, model: m1 }
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [t1, t9]
  other:
    aliases: [gpt-4o]
    chain: [t1]
";

/// The same four problems plus an unknown key (`colour`, line 5).
const ALL_FIVE: &str = "providers:
  p1:
    base_url: http://127.0.0.1:9/v1
    timeout: soon
    colour: red
targets:
  t1: { provider: p1, model: m1 }
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [t1, t9]
  other:
    aliases: [gpt-4o]
    chain: [t1]
";

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    path.display().to_string()
}

fn stdout(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn describe(out: &std::process::Output) -> String {
    format!(
        "status {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        stdout(out),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// 1-based (line, column) of the first occurrence of `needle` in `text`.
fn locate(text: &str, needle: &str) -> (usize, usize) {
    for (i, line) in text.lines().enumerate() {
        if let Some(col) = line.find(needle) {
            return (i + 1, col + 1);
        }
    }
    panic!("`{needle}` not in fixture");
}

/// The problem lines (`PATH:LINE:COLUMN: ...`) of a validate run; panics on
/// any other stdout line that mentions `path`.
fn problem_lines<'a>(out: &'a str, path: &str) -> Vec<&'a str> {
    let prefix = format!("{path}:");
    out.lines()
        .filter(|l| l.starts_with(&prefix) && !l.contains(": ok ("))
        .inspect(|l| {
            let rest = &l[prefix.len()..];
            let mut parts = rest.splitn(3, ':');
            let line = parts.next().unwrap_or_default();
            let col = parts.next().unwrap_or_default();
            assert!(
                line.parse::<usize>().is_ok_and(|n| n > 0)
                    && col.parse::<usize>().is_ok_and(|n| n > 0)
                    && parts.next().is_some_and(|m| m.starts_with(' ')),
                "not PATH:LINE:COLUMN: message: {l}"
            );
        })
        .collect()
}

fn assert_located(lines: &[&str], path: &str, at: (usize, usize), needle: &str) {
    let want = format!("{path}:{}:{}: ", at.0, at.1);
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with(&want) && l.contains(needle)),
        "no line `{want}...{needle}...` in:\n{}",
        lines.join("\n")
    );
}

#[test]
fn validate_good_file_prints_one_ok_line() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "good.yaml", GOOD);
    let out = binary::run(&["validate", &good], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let text = stdout(&out);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 1, "{}", describe(&out));
    assert!(lines[0].starts_with(&format!("{good}: ")), "{}", lines[0]);
    assert!(lines[0].contains("ok"), "{}", lines[0]);
}

#[test]
fn validate_bad_file_lists_every_semantic_problem_located() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "bad.yaml", SEMANTIC);
    let out = binary::run(&["validate", &bad], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = stdout(&out);
    let lines = problem_lines(&text, &bad);
    assert_eq!(lines.len(), 4, "one line per problem:\n{}", describe(&out));
    for needle in [
        "missing `version`",
        "bad duration `soon`",
        "unknown target `t9`",
        "alias `gpt-4o` is already used",
    ] {
        assert!(text.contains(needle), "{needle} missing:\n{text}");
    }
    // `timeout: soon` is line 4; the value starts at column 14.
    assert_eq!(locate(SEMANTIC, "soon"), (4, 14));
    assert_located(&lines, &bad, (4, 14), "bad duration");
    // `chain: [t1, t9]` is line 10; `t9` at column 17.
    assert_eq!(locate(SEMANTIC, "t9"), (10, 17));
    assert_located(&lines, &bad, (10, 17), "unknown target `t9`");
    // The second `aliases: [gpt-4o]` is line 12; `gpt-4o` at column 15.
    assert_located(&lines, &bad, (12, 15), "alias `gpt-4o`");
}

#[test]
fn validate_unknown_key_is_located_at_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let text = GOOD.replace("timeout: 2s }", "timeout: 2s, colour: red }");
    let bad = write(dir.path(), "bad.yaml", &text);
    let out = binary::run(&["validate", &bad], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let stdout = stdout(&out);
    let lines = problem_lines(&stdout, &bad);
    assert_eq!(lines.len(), 1, "{}", describe(&out));
    assert_eq!(locate(&text, "colour"), (3, 57));
    assert_located(&lines, &bad, (3, 57), "unknown field `colour`");
}

#[test]
fn validate_bad_file_lists_all_five_problems_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "bad.yaml", ALL_FIVE);
    let out = binary::run(&["validate", &bad], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = stdout(&out);
    let lines = problem_lines(&text, &bad);
    assert_eq!(lines.len(), 5, "one line per problem:\n{}", describe(&out));
    assert_located(&lines, &bad, (5, 5), "colour");
    assert_located(&lines, &bad, (4, 14), "bad duration");
    assert_located(&lines, &bad, (11, 17), "unknown target `t9`");
    assert_located(&lines, &bad, (13, 15), "alias `gpt-4o`");
    assert!(text.contains("missing `version`"), "{text}");
}

#[test]
fn validate_unknown_key_names_its_path_once() {
    let dir = tempfile::tempdir().unwrap();
    let text = GOOD.replace("timeout: 2s }", "timeout: 2s, colour: red }");
    let bad = write(dir.path(), "bad.yaml", &text);
    let out = binary::run(&["validate", &bad], &[]);
    let text = stdout(&out);
    assert!(
        text.trim_end().ends_with("(at providers.p1.colour)"),
        "{text}"
    );
}

#[test]
fn validate_missing_version_is_located_at_the_top() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "bad.yaml", SEMANTIC);
    let out = binary::run(&["validate", &bad], &[]);
    let text = stdout(&out);
    let lines = problem_lines(&text, &bad);
    assert_located(&lines, &bad, (1, 1), "missing `version`");
}

#[test]
fn validate_many_paths_reports_each_and_fails_if_any_is_bad() {
    let dir = tempfile::tempdir().unwrap();
    let good = write(dir.path(), "good.yaml", GOOD);
    let bad = write(dir.path(), "bad.yaml", SEMANTIC);
    let out = binary::run(&["validate", &good, &bad], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let text = stdout(&out);
    let ok: Vec<&str> = text.lines().filter(|l| l.contains("ok")).collect();
    assert_eq!(ok.len(), 1, "{}", describe(&out));
    assert!(ok[0].starts_with(&format!("{good}: ok")), "{}", ok[0]);
    assert_eq!(problem_lines(&text, &bad).len(), 4, "{}", describe(&out));
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with(&format!("{good}:")) && l.contains("error")),
        "{text}"
    );
    // Order does not matter: bad first gives the same verdict.
    let out = binary::run(&["validate", &bad, &good], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    assert!(stdout(&out).contains(&format!("{good}: ok")));
}

#[test]
fn relative_secret_files_are_read_from_the_configs_directory() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("secrets")).unwrap();
    for name in ["key", "admin", "redis"] {
        std::fs::write(
            dir.path().join("secrets").join(name),
            "s3cret-value-0123456789",
        )
        .unwrap();
    }
    std::fs::write(dir.path().join("secrets/redis"), "redis://127.0.0.1:9/0").unwrap();
    let text = GOOD
        .replace(
            "timeout: 2s }",
            "timeout: 2s, keys: [{ name: k, file: secrets/key }] }",
        )
        .replace(
            "version: 1\n",
            "version: 1\nadmin_token_file: secrets/admin\nshared_state: { redis: { url_file: secrets/redis } }\n",
        );
    let path = write(dir.path(), "routes.yaml", &text);
    // Run from elsewhere: the paths are the file's, not the shell's.
    let out = binary::run(&["validate", &path], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let out = stdout(&out);
    assert!(!out.contains("warning"), "{out}");
}

#[test]
fn json_mode_on_an_anthropic_target_is_a_warning_where_it_is_written() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("key"), "sk-ant-test-0123456789").unwrap();
    let text = GOOD
        .replace(
            "timeout: 2s }",
            "timeout: 2s, protocol: anthropic, api_key_file: key }",
        )
        .replace("model: m1 }", "model: m1, capabilities: [json_mode] }");
    let path = write(dir.path(), "json.yaml", &text);
    let out = binary::run(&["validate", &path], &[]);
    assert_eq!(out.status.code(), Some(0), "{}", describe(&out));
    let out = stdout(&out);
    let warn: Vec<&str> = out.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warn.len(), 1, "{out}");
    assert!(warn[0].contains("no JSON mode"), "{out}");
    let at = locate(&text, "capabilities");
    assert!(
        warn[0].starts_with(&format!("{path}:{}:{}: ", at.0, at.1)),
        "{out}"
    );
}

#[test]
fn validate_strict_turns_an_unset_key_warning_into_failure() {
    let dir = tempfile::tempdir().unwrap();
    let var = "SWITCHYARD_CLI_TEST_UNSET_KEY_VAR";
    let text = GOOD.replace(
        "timeout: 2s }",
        &format!("timeout: 2s, api_key_env: {var} }}"),
    );
    let path = write(dir.path(), "warn.yaml", &text);

    let lenient = run_without(&["validate", &path], var);
    assert_eq!(lenient.status.code(), Some(0), "{}", describe(&lenient));
    let out = stdout(&lenient);
    let warn: Vec<&str> = out.lines().filter(|l| l.contains("warning")).collect();
    assert_eq!(warn.len(), 1, "{out}");
    assert!(warn[0].contains(var), "{out}");
    let at = locate(&text, var);
    assert!(
        warn[0].starts_with(&format!("{path}:{}:{}: ", at.0, at.1)),
        "{out}"
    );
    assert!(out.contains(&format!("{path}: ok")), "{out}");

    let strict = run_without(&["validate", "--strict", &path], var);
    assert_eq!(strict.status.code(), Some(1), "{}", describe(&strict));
    let out = stdout(&strict);
    assert!(!out.contains(": ok"), "{out}");
    assert_eq!(problem_lines(&out, &path).len(), 1, "{out}");
    assert!(out.contains(var), "{out}");

    // With the variable set, --strict passes.
    let set = binary::run(&["validate", "--strict", &path], &[(var, "sk-test")]);
    assert_eq!(set.status.code(), Some(0), "{}", describe(&set));
}

/// Runs the binary with `var` removed from its environment.
fn run_without(args: &[&str], var: &str) -> std::process::Output {
    std::process::Command::new(binary::BIN)
        .args(args)
        .env_remove(var)
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run switchyard")
}

#[test]
fn validate_without_paths_is_a_usage_error() {
    let out = binary::run(&["validate"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", describe(&out));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_answers_healthz_and_exits_zero_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, GOOD).unwrap();
    let mut served = Served::start(&config, dir.path(), &[]);
    let ans = get(served.addr, "/healthz").await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.json()["status"], "ok");
    let ans = get(served.addr, "/readyz").await;
    assert_eq!(ans.status, 200, "{}", ans.text());

    let status = served.terminate(Duration::from_secs(5));
    assert_eq!(status.code(), Some(0), "{}", served.log());
    assert!(
        std::net::TcpStream::connect_timeout(&served.addr, Duration::from_millis(200)).is_err(),
        "still listening after exit"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_request_finish() {
    let a = Fake::always(Reply::Delay(
        Duration::from_millis(400),
        Box::new(fake::completion("model-a", "slow but sure")),
    ))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, chain_config(&[("a", &a.url())], "", "")).unwrap();
    let mut served = Served::start(&config, dir.path(), &[]);
    let addr = served.addr;
    let pending = tokio::spawn(async move { chat(addr, hello("gpt-4o")).await });
    assert!(
        wait_for(Duration::from_secs(1), || a.calls() == 1).await,
        "the request reached the upstream"
    );
    let status = tokio::task::block_in_place(|| served.terminate(Duration::from_secs(5)));
    let ans = pending.await.unwrap();
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(
        ans.json()["choices"][0]["message"]["content"],
        "slow but sure"
    );
    assert_eq!(status.code(), Some(0), "{}", served.log());
}

#[test]
fn serve_with_an_invalid_config_exits_one_with_located_problems() {
    let dir = tempfile::tempdir().unwrap();
    let bad = write(dir.path(), "bad.yaml", SEMANTIC);
    let addr = binary::free_addr().to_string();
    let out = binary::run(&["serve", "--config", &bad, "--listen", &addr], &[]);
    assert_eq!(out.status.code(), Some(1), "{}", describe(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains(&format!("{bad}:10:17: ")), "{err}");
}

/// A log collector that stops reading (a full stderr pipe) never holds up a
/// request: log lines are written by a thread of their own and dropped when
/// its queue is full. Before, the first write to the full pipe blocked the
/// thread serving requests, and every request after the ~250th line hung.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_stderr_never_holds_up_requests() {
    let a = Fake::always(fake::completion("model-a", "fine")).await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, chain_config(&[("a", &a.url())], "", "")).unwrap();
    let addr = binary::free_addr();
    // stderr is a pipe nobody reads: it fills after 64 KiB (a few hundred
    // access-log lines at debug level) and every write after that blocks.
    let child = std::process::Command::new(binary::BIN)
        .args(["serve", "--config"])
        .arg(&config)
        .args(["--listen", &addr.to_string()])
        .env("RUST_LOG", "debug")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Killed however the test ends (a hung request panics before the end).
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _child = KillOnDrop(child);
    let up = wait_for(Duration::from_secs(10), || {
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
    })
    .await;
    assert!(up, "switchyard did not listen on {addr}");
    let all = async {
        for i in 0..1_500 {
            let ans = chat(addr, hello("gpt-4o")).await;
            assert_eq!(ans.status, 200, "request {i}: {}", ans.text());
        }
    };
    let finished = tokio::time::timeout(Duration::from_secs(60), all).await;
    assert!(finished.is_ok(), "requests hung behind a full stderr pipe");
}
