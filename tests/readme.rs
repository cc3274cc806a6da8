//! README's commands run as written (only the ports differ): the curl
//! examples against a live gateway, and the offline sidecar path on the
//! shipped fake upstream and `examples/local/routes.yaml`.

use clap::Parser;

use crate::fake_upstream::{Args, Behaviour, Upstream};
use crate::support::fake::{self, Fake};
use crate::support::*;

/// The lines of the first bash block after `heading` that start with `prefix`.
fn readme_lines(heading: &str, prefix: &str) -> Vec<String> {
    let readme = include_str!("../README.md");
    let section = readme
        .split(heading)
        .nth(1)
        .unwrap_or_else(|| panic!("README has a `{heading}` section"));
    let block = section
        .split("```bash")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a bash block");
    block
        .lines()
        .filter(|l| l.starts_with(prefix))
        .map(str::to_owned)
        .collect()
}

fn readme_curl_commands() -> Vec<String> {
    readme_lines("### With curl", "curl ")
}

/// Runs one README command line with `sh`; its stdout.
async fn run_shell(cmd: String) -> String {
    let run = cmd.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(&run)
            .output()
    })
    .await
    .unwrap()
    .expect("sh runs");
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_curl_examples_work() {
    let commands = readme_curl_commands();
    assert_eq!(commands.len(), 4, "{commands:#?}");
    let a = Fake::start(|_, seen| {
        if seen.body["stream"] == true {
            fake::stream("model-a", &["hello", " there"])
        } else {
            fake::completion("model-a", "hello there")
        }
    })
    .await;
    let gw = gateway(&chain_config(&[("a", &a.url())], "", "")).await;
    let expected = [
        "\"object\":\"list\"",
        "\"chat.completion\"",
        "data: [DONE]",
        "x-switchyard-target: a",
    ];
    for (cmd, want) in commands.iter().zip(expected) {
        let cmd = cmd.replace("127.0.0.1:8080", &gw.addr.to_string());
        let stdout = run_shell(cmd.clone()).await;
        assert!(stdout.contains(want), "`{cmd}` printed {stdout}");
    }
}

/// "Run it as a sidecar", offline: the fakes started with README's own
/// arguments, the shipped local config pointed at them, and the curl
/// examples answered 200 by one of the two, never by an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readme_offline_sidecar_path_serves_the_curl_examples() {
    let build = readme_lines("## Run it as a sidecar", "cargo build");
    assert_eq!(
        build,
        ["cargo build --release --bin switchyard --example fake_upstream"]
    );
    let serve = readme_lines(
        "## Run it as a sidecar",
        "./target/release/switchyard serve",
    );
    assert_eq!(
        serve,
        ["./target/release/switchyard serve --config examples/local/routes.yaml"]
    );
    let mut config = include_str!("../examples/local/routes.yaml").to_owned();
    let mut fakes = Vec::new();
    for line in readme_lines(
        "## Run it as a sidecar",
        "./target/release/examples/fake_upstream",
    ) {
        let words = line.trim_end_matches('&').split_whitespace();
        let mut args = Args::try_parse_from(words).unwrap_or_else(|e| panic!("`{line}`: {e}"));
        let documented = args.listen;
        let base_url = format!("http://{documented}/v1");
        assert!(config.contains(&base_url), "no provider at {base_url}");
        args.listen = "127.0.0.1:0".parse().unwrap();
        let up = Upstream::start(args.listen, Behaviour::from_args(&args).unwrap())
            .await
            .unwrap();
        config = config.replace(&base_url, &format!("http://{}/v1", up.addr));
        fakes.push(up);
    }
    assert_eq!(
        fakes.len(),
        2,
        "README starts a primary and a fallback fake"
    );
    let gw = gateway(&config).await;
    let expected = [
        "\"object\":\"list\"",
        "\"chat.completion\"",
        "data: [DONE]",
        "HTTP/1.1 200",
    ];
    for _round in 0..5 {
        for (cmd, want) in readme_curl_commands().iter().zip(expected) {
            let cmd = cmd.replace("127.0.0.1:8080", &gw.addr.to_string());
            let stdout = run_shell(cmd.clone()).await;
            assert!(stdout.contains(want), "`{cmd}` printed {stdout}");
            assert!(!stdout.contains("\"error\""), "`{cmd}` printed {stdout}");
        }
    }
    let served: u64 = fakes.iter().map(|f| f.stats().requests).sum();
    assert!(
        served >= 15,
        "the fakes answered the chat requests: {served}"
    );
}

/// Every file under `dir`, recursively.
fn files_under(dir: &std::path::Path, found: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files_under(&path, found);
        } else {
            found.push(path);
        }
    }
}

/// A clone of the repository is all a user has: what README, BENCHMARKS and
/// the examples run or cite lives in it, never beside it.
#[test]
fn nothing_a_user_runs_points_outside_the_repository() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![root.join("README.md"), root.join("BENCHMARKS.md")];
    files_under(&root.join("examples"), &mut files);
    let outside: Vec<String> = files
        .iter()
        .filter_map(|f| Some((f, std::fs::read_to_string(f).ok()?)))
        .flat_map(|(f, text)| {
            text.lines()
                .enumerate()
                .filter(|(_, l)| l.contains("../shared") || l.contains("shared/peers"))
                .map(|(n, l)| format!("{}:{}: {l}", f.display(), n + 1))
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(outside.is_empty(), "{outside:#?}");
    assert!(root.join("examples/peers/peers.sh").exists());
}
