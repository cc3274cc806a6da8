//! README's curl examples run against a live gateway, exactly as written
//! (only the port differs).

use crate::support::fake::{self, Fake};
use crate::support::*;

fn readme_curl_commands() -> Vec<String> {
    let readme = include_str!("../README.md");
    let section = readme
        .split("### With curl")
        .nth(1)
        .expect("README has a `### With curl` section");
    let block = section
        .split("```bash")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a bash block");
    block
        .lines()
        .filter(|l| l.starts_with("curl "))
        .map(str::to_owned)
        .collect()
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
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "`{cmd}` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains(want), "`{cmd}` printed {stdout}");
    }
}
