//! Hot reload of routes.yaml: a chain change under live traffic loses no
//! request, a rejected file leaves the old config serving, and an identical
//! rewrite changes nothing.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use crate::support::fake::{self, Fake, Seen};
use crate::support::*;

/// A fake that answers what it is asked: a stream of `from`, ` `, `NAME`, or a
/// completion whose text is `from NAME`.
async fn dual(name: &'static str) -> Fake {
    let model = format!("model-{name}");
    Fake::start(move |_, seen: &Seen| {
        if seen.body["stream"] == true {
            fake::stream(&model, &["from", " ", name])
        } else {
            fake::completion(&model, &format!("from {name}"))
        }
    })
    .await
}

/// Targets `a` and `b` (each on its own provider); task `chat` (alias
/// `gpt-4o`) with the given chain.
fn config(a: &Fake, b: &Fake, chain: &str) -> String {
    format!(
        "version: 1
providers:
  p-a: {{ base_url: '{}', timeout: 2s }}
  p-b: {{ base_url: '{}', timeout: 2s }}
targets:
  a: {{ provider: p-a, model: upstream-a }}
  b: {{ provider: p-b, model: upstream-b }}
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [{chain}]
",
        a.url(),
        b.url()
    )
}

/// The text of an answer, stream or not, and whether it ended properly.
fn answer_text(ans: &Answer, streamed: bool) -> (String, bool) {
    if streamed {
        let text = ans.text();
        let clean = text.ends_with("data: [DONE]\n\n") && !text.contains("stream_interrupted");
        (stream_text(&text), clean)
    } else {
        let v: serde_json::Value = serde_json::from_slice(&ans.body).unwrap_or_default();
        let content = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        (content, true)
    }
}

/// Sends one request (stream or not), checks a 200 answer is whole and
/// consistent with its target, and returns (status, target).
async fn ask(gw: &Gw, streamed: bool) -> (u16, String) {
    let body = if streamed {
        hello_stream("gpt-4o")
    } else {
        hello("gpt-4o")
    };
    let ans = chat(gw.addr, body).await;
    let target = ans.header("x-switchyard-target");
    let (text, clean) = answer_text(&ans, streamed);
    if ans.status == 200 {
        assert_eq!(text, format!("from {target}"), "stream={streamed}");
        assert!(clean, "stream={streamed}: {}", ans.text());
    }
    (ans.status.as_u16(), target)
}

#[derive(Debug)]
struct Sample {
    sent: Duration,
    done: Duration,
    streamed: bool,
    status: u16,
    target: String,
    attempts: String,
    text: String,
    clean: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_change_under_live_traffic_loses_no_request() {
    let a = dual("a").await;
    let b = dual("b").await;
    let gw = gateway(&config(&a, &b, "a")).await;
    let run_for = Duration::from_millis(1900);
    let write_at = Duration::from_millis(600);
    let start = Instant::now();

    let mut loops = Vec::new();
    for i in 0..8usize {
        let addr = gw.addr;
        loops.push(tokio::spawn(async move {
            let mut log = Vec::new();
            for n in 0..10_000usize {
                let sent = start.elapsed();
                if sent >= run_for {
                    break;
                }
                let streamed = (i + n) % 2 == 0;
                let body = if streamed {
                    hello_stream("gpt-4o")
                } else {
                    hello("gpt-4o")
                };
                let ans = chat(addr, body).await;
                let (text, clean) = answer_text(&ans, streamed);
                log.push(Sample {
                    sent,
                    done: start.elapsed(),
                    streamed,
                    status: ans.status.as_u16(),
                    target: ans.header("x-switchyard-target"),
                    attempts: ans.header("x-switchyard-attempts"),
                    text,
                    clean,
                });
            }
            log
        }));
    }

    // The scenario: the chain changes 600 ms into 1.9 s of traffic.
    tokio::time::sleep(write_at.saturating_sub(start.elapsed())).await;
    let written = start.elapsed();
    gw.rewrite(&config(&a, &b, "b"));

    let mut samples = Vec::new();
    for l in loops {
        samples.extend(l.await.unwrap());
    }
    samples.sort_by_key(|s| s.sent);

    let bad: Vec<&Sample> = samples
        .iter()
        .filter(|s| {
            s.status != 200
                || !s.clean
                || s.attempts != "1"
                || (s.target != "a" && s.target != "b")
                || s.text != format!("from {}", s.target)
        })
        .collect();
    assert!(
        bad.is_empty(),
        "{} of {} requests went wrong, e.g. {:#?}",
        bad.len(),
        samples.len(),
        &bad[..bad.len().min(3)]
    );
    assert_eq!(
        a.calls() + b.calls(),
        samples.len(),
        "one upstream call per request: nothing retried or failed over"
    );
    assert!(
        samples.iter().any(|s| s.streamed) && samples.iter().any(|s| !s.streamed),
        "both kinds were sent"
    );
    assert!(
        samples.iter().any(|s| s.done < written && s.target == "a"),
        "a served before the write"
    );

    // Within 1 s of the write every new request goes to b: those the loops
    // sent after that, and a few more now (the loops may have sent none that
    // late on a loaded machine).
    let stale: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.sent >= written + Duration::from_secs(1) && s.target != "b")
        .collect();
    assert!(
        stale.is_empty(),
        "still served by the old chain over 1 s after the write ({written:?}): {stale:#?}"
    );
    assert!(start.elapsed() >= written + Duration::from_secs(1));
    for streamed in [false, true, false, true] {
        assert_eq!(ask(&gw, streamed).await, (200, "b".into()));
    }

    // Once one request has been answered by b, no later request goes back to a.
    let first_b_done = samples
        .iter()
        .filter(|s| s.target == "b")
        .map(|s| s.done)
        .min()
        .expect("b served something");
    let flip_back: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.sent > first_b_done && s.target != "b")
        .collect();
    assert!(flip_back.is_empty(), "{flip_back:#?}");
}

#[tokio::test]
async fn invalid_reload_keeps_the_old_config_until_fixed() {
    let a = dual("a").await;
    let b = dual("b").await;
    let good = config(&a, &b, "a");
    let gw = gateway(&good).await;
    let hash = get(gw.addr, "/readyz").await.json()["config_hash"].clone();
    assert!(hash.is_string());
    assert_eq!(ask(&gw, false).await, (200, "a".into()));

    let broken = [
        ("unknown target", config(&a, &b, "nope")),
        (
            "YAML syntax error",
            config(&a, &b, "b").replace("chain: [b]", "chain: [b"),
        ),
    ];
    for (what, text) in broken {
        let before = reloads(&gw, "error").await;
        gw.rewrite(&text);
        let rejected = eventually(Duration::from_secs(3), || async {
            reloads(&gw, "error").await == before + 1.0
        })
        .await;
        assert!(rejected, "{what}: no reload error counted within 3 s");
        for streamed in [false, true, false] {
            assert_eq!(
                ask(&gw, streamed).await,
                (200, "a".into()),
                "{what}: the old chain keeps serving"
            );
        }
        assert_eq!(
            get(gw.addr, "/readyz").await.json()["config_hash"],
            hash,
            "{what}: the snapshot was not replaced"
        );
    }
    assert_eq!(b.calls(), 0);
    assert_eq!(reloads(&gw, "error").await, 2.0, "each broken file once");
    assert_eq!(reloads(&gw, "ok").await, 1.0, "the first load only");

    // Fixing the file applies it.
    gw.rewrite(&config(&a, &b, "b"));
    let applied = eventually(Duration::from_secs(3), || async {
        ask(&gw, false).await == (200, "b".into())
    })
    .await;
    assert!(applied, "the fixed file was not applied within 3 s");
    assert_eq!(ask(&gw, true).await, (200, "b".into()));
    assert_ne!(get(gw.addr, "/readyz").await.json()["config_hash"], hash);
    assert_eq!(reloads(&gw, "ok").await, 2.0);
    assert_eq!(reloads(&gw, "error").await, 2.0);
}

#[tokio::test]
async fn a_save_that_truncates_then_writes_is_one_reload_not_an_error() {
    let a = dual("a").await;
    let b = dual("b").await;
    let gw = gateway(&config(&a, &b, "a")).await;
    assert_eq!(ask(&gw, false).await, (200, "a".into()));
    // A plain `>` save: the file is empty for a moment, then written.
    std::fs::write(&gw.config, "").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        ask(&gw, false).await,
        (200, "a".into()),
        "the old config serves meanwhile"
    );
    std::fs::write(&gw.config, config(&a, &b, "b")).unwrap();
    let applied = eventually(Duration::from_secs(3), || async {
        ask(&gw, false).await == (200, "b".into())
    })
    .await;
    assert!(applied, "the written file was not applied");
    assert_eq!(
        reloads(&gw, "error").await,
        0.0,
        "a save in progress is no error"
    );
    // A file that stays empty is reported.
    std::fs::write(&gw.config, "").unwrap();
    let rejected = eventually(Duration::from_secs(4), || async {
        reloads(&gw, "error").await == 1.0
    })
    .await;
    assert!(rejected, "an empty file was never reported");
    assert_eq!(ask(&gw, false).await, (200, "b".into()));
}

#[tokio::test]
async fn identical_rewrite_changes_nothing() {
    let a = dual("a").await;
    let b = dual("b").await;
    let text = config(&a, &b, "a");
    let gw = gateway(&text).await;
    let before = gw.app.snapshot.load_full();
    gw.rewrite(&text);
    // No event says "checked, unchanged": watch for longer than the 150 ms
    // debounce, serving all along.
    let started = Instant::now();
    let mut n = 0;
    while started.elapsed() < Duration::from_millis(500) && n < 100 {
        assert_eq!(ask(&gw, n % 2 == 1).await, (200, "a".into()));
        assert!(
            Arc::ptr_eq(&before, &gw.app.snapshot.load_full()),
            "an identical file replaced the snapshot"
        );
        n += 1;
        // Pacing of the watch window above (the scenario, not a wait).
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        !switchyard::reload::reload_now(&gw.app),
        "reload_now applied an unchanged file"
    );
    assert!(Arc::ptr_eq(&before, &gw.app.snapshot.load_full()));
    assert_eq!(b.calls(), 0);
    assert_eq!(reloads(&gw, "ok").await, 1.0, "the first load only");
    assert_eq!(reloads(&gw, "error").await, 0.0);
}

/// Rewrites the file and waits (up to 3 s) until the served config hash changes.
async fn apply(gw: &Gw, text: &str) {
    let before = get(gw.addr, "/readyz").await.json()["config_hash"].clone();
    gw.rewrite(text);
    let changed = eventually(Duration::from_secs(3), || async {
        get(gw.addr, "/readyz").await.json()["config_hash"] != before
    })
    .await;
    assert!(changed, "the new file was not applied within 3 s");
}

#[tokio::test]
async fn reload_keeps_the_health_of_unchanged_targets() {
    let a = Fake::always(fake::error(503, "down")).await;
    let b = dual("b").await;
    let text = config(&a, &b, "a, b").replace(
        "timeout: 2s }",
        "timeout: 2s, retry: { max: 1, backoff: 5ms } }",
    ) + "health: { degraded_after: 1, down_after: 2, open_for: 60s }\n";
    let gw = gateway(&text).await;
    assert_eq!(ask(&gw, false).await, (200, "b".into()));
    assert_eq!(a.calls(), 2, "one try and one retry");
    assert_eq!(admin_target(&gw, "a").await["state"], "down");

    // An edit that leaves target a as it was: a stays DOWN, skipped without a call.
    apply(
        &gw,
        &text.replace("aliases: [gpt-4o]", "aliases: [gpt-4o, gpt-4]"),
    )
    .await;
    assert_eq!(
        admin_target(&gw, "a").await["state"],
        "down",
        "health survived the reload"
    );
    assert_eq!(ask(&gw, true).await, (200, "b".into()));
    assert_eq!(a.calls(), 2, "a DOWN target is not called after a reload");

    // A new identity (another upstream model) starts healthy and is tried.
    apply(
        &gw,
        &text.replace("model: upstream-a", "model: upstream-a2"),
    )
    .await;
    assert_eq!(admin_target(&gw, "a").await["state"], "healthy");
    assert_eq!(ask(&gw, false).await, (200, "b".into()));
    assert_eq!(a.calls(), 4);
}

#[cfg(unix)]
#[tokio::test]
async fn configmap_style_symlink_swap_is_picked_up() {
    use std::os::unix::fs::symlink;
    use switchyard::server::Gateway;
    use switchyard::snapshot::CompileOptions;

    let a = dual("a").await;
    let b = dual("b").await;
    // Kubernetes layout: routes.yaml -> ..data/routes.yaml, ..data -> ..v1.
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    std::fs::create_dir(root.join("..v1")).unwrap();
    std::fs::write(root.join("..v1/routes.yaml"), config(&a, &b, "a")).unwrap();
    symlink("..v1", root.join("..data")).unwrap();
    symlink("..data/routes.yaml", root.join("routes.yaml")).unwrap();
    let gateway = Gateway::bind(
        &root.join("routes.yaml"),
        Some("127.0.0.1:0".parse().unwrap()),
        CompileOptions::default(),
    )
    .await
    .unwrap();
    let addr = gateway.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.run(async {
        let _ = stopped.await;
    }));
    let served_by = |ans: Answer| (ans.status.as_u16(), ans.header("x-switchyard-target"));
    assert_eq!(
        served_by(chat(addr, hello("gpt-4o")).await),
        (200, "a".into())
    );

    // The kubelet's update: a new timestamped dir, a temp symlink to it,
    // renamed over ..data. The file's own path never sees a write.
    std::fs::create_dir(root.join("..v2")).unwrap();
    std::fs::write(root.join("..v2/routes.yaml"), config(&a, &b, "b")).unwrap();
    symlink("..v2", root.join("..data_tmp")).unwrap();
    std::fs::rename(root.join("..data_tmp"), root.join("..data")).unwrap();
    std::fs::remove_dir_all(root.join("..v1")).unwrap();

    let switched = eventually(Duration::from_secs(3), || async {
        served_by(chat(addr, hello("gpt-4o")).await) == (200, "b".into())
    })
    .await;
    assert!(switched, "the swapped ConfigMap was not applied within 3 s");
    let _ = stop.send(());
    tokio::time::timeout(Duration::from_secs(5), server)
        .await
        .expect("gateway stopped")
        .unwrap()
        .unwrap();
}

#[tokio::test]
async fn a_change_written_between_bind_and_run_is_applied() {
    use switchyard::server::Gateway;
    use switchyard::snapshot::CompileOptions;
    let (a, b) = (dual("a").await, dual("b").await);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.yaml");
    std::fs::write(&path, config(&a, &b, "a")).unwrap();
    let gateway = Gateway::bind(
        &path,
        Some("127.0.0.1:0".parse().unwrap()),
        CompileOptions::default(),
    )
    .await
    .unwrap();
    // Written before any watcher exists: `run` must still see it.
    std::fs::write(&path, config(&a, &b, "b")).unwrap();
    let addr = gateway.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(gateway.run(async {
        let _ = stopped.await;
    }));
    let switched = eventually(Duration::from_secs(3), || async {
        chat(addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target")
            == "b"
    })
    .await;
    assert!(switched, "the change made before run() was never applied");
    let _ = stop.send(());
    let _ = tokio::time::timeout(Duration::from_secs(5), server).await;
}

#[tokio::test]
async fn a_reload_drops_the_gauges_of_removed_tasks_targets_and_keys() {
    let a = dual("a").await;
    let b = dual("b").await;
    let keys = tempfile::tempdir().unwrap();
    for name in ["k1", "k2"] {
        std::fs::write(keys.path().join(name), format!("key-{name}")).unwrap();
    }
    let pool = |names: &[&str]| {
        let mut yaml = String::from(", keys: [");
        for n in names {
            yaml.push_str(&format!(
                "{{ name: {n}, file: '{}' }},",
                keys.path().join(n).display()
            ));
        }
        yaml + "] }"
    };
    let base = config(&a, &b, "a, b") + "  other:\n    chain: [b]\n";
    let before = base.replacen(
        "timeout: 2s }",
        &format!("timeout: 2s{}", pool(&["k1", "k2"])),
        1,
    );
    let gw = gateway(&before).await;
    let page = metrics_page(&gw).await;
    for series in [
        r#"switchyard_task_targets_available{task="other"}"#,
        r#"switchyard_target_health{target="b"}"#,
        r#"switchyard_key_state{provider="p-a",key="k2"}"#,
    ] {
        assert!(
            series_value(&page, series).is_some(),
            "{series} missing before:\n{page}"
        );
    }

    // Task `other`, target `b` and key `k2` removed.
    let after = config(&a, &b, "a")
        .replace("  b: { provider: p-b, model: upstream-b }\n", "")
        .replacen("timeout: 2s }", &format!("timeout: 2s{}", pool(&["k1"])), 1);
    apply(&gw, &after).await;
    let page = metrics_page(&gw).await;
    for series in [
        r#"switchyard_task_targets_available{task="other"}"#,
        r#"switchyard_target_health{target="b"}"#,
        r#"switchyard_key_state{provider="p-a",key="k2"}"#,
    ] {
        assert!(
            series_value(&page, series).is_none(),
            "{series} still exported:\n{page}"
        );
    }
    for series in [
        r#"switchyard_task_targets_available{task="chat"}"#,
        r#"switchyard_target_health{target="a"}"#,
        r#"switchyard_key_state{provider="p-a",key="k1"}"#,
    ] {
        assert!(
            series_value(&page, series).is_some(),
            "{series} missing after:\n{page}"
        );
    }
}

/// A keep-alive upstream on raw TCP: answers every request on a connection
/// with a completion, and counts the connections switchyard has closed.
async fn keep_alive_upstream() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let closed = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = Arc::clone(&closed);
    tokio::spawn(async move {
        while let Ok((mut sock, _)) = listener.accept().await {
            let count = Arc::clone(&count);
            tokio::spawn(async move {
                let body = fake::completion_body("upstream-a", "from a");
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                loop {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => seen.extend_from_slice(&buf[..n]),
                    }
                    // One answer per request whose body has arrived.
                    let Some(head_end) = seen.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&seen[..head_end]).to_ascii_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    if seen.len() >= head_end + 4 + len {
                        seen.drain(..head_end + 4 + len);
                        if sock.write_all(answer.as_bytes()).await.is_err() {
                            break;
                        }
                    }
                }
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            });
        }
    });
    (url, closed)
}

/// A provider a reload removed has its pool dropped: its idle keep-alive
/// connection is closed by switchyard (not left open until the upstream
/// gives up on it).
#[tokio::test]
async fn a_provider_removed_by_reload_has_its_idle_connections_closed() {
    let (a_url, a_closed) = keep_alive_upstream().await;
    let b = dual("b").await;
    let with_a = format!(
        "version: 1
providers:
  p-a: {{ base_url: '{a_url}', timeout: 2s }}
  p-b: {{ base_url: '{}', timeout: 2s }}
targets:
  a: {{ provider: p-a, model: upstream-a }}
  b: {{ provider: p-b, model: upstream-b }}
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [a, b]
",
        b.url()
    );
    let gw = gateway(&with_a).await;
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert!(ans.text().contains("from a"), "{}", ans.text());
    // The connection to a sits idle in the pool, open.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(a_closed.load(std::sync::atomic::Ordering::SeqCst), 0);

    let without_a = format!(
        "version: 1
providers:
  p-b: {{ base_url: '{}', timeout: 2s }}
targets:
  b: {{ provider: p-b, model: upstream-b }}
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [b]
",
        b.url()
    );
    apply(&gw, &without_a).await;
    // Pruned at the reload itself: nothing holds the old snapshot then (a
    // request still in flight would, and the 5 s upkeep covers that).
    assert!(
        eventually(Duration::from_millis(1000), || async {
            a_closed.load(std::sync::atomic::Ordering::SeqCst) == 1
        })
        .await,
        "the removed provider's idle connection is still open"
    );
    let ans = chat(gw.addr, hello("gpt-4o")).await;
    assert!(ans.text().contains("from b"), "{}", ans.text());
}

/// Log lines written while `f` runs on this thread.
fn logged(f: impl FnOnce()) -> String {
    #[derive(Clone, Default)]
    struct Buf(Arc<parking_lot::Mutex<Vec<u8>>>);
    impl std::io::Write for Buf {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let buf = Buf::default();
    let writer = buf.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes = buf.0.lock().clone();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[tokio::test]
async fn a_fixed_rejected_reload_says_the_good_config_is_loaded_again() {
    let a = dual("a").await;
    let b = dual("b").await;
    let good = config(&a, &b, "a");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("routes.yaml");
    std::fs::write(&path, &good).unwrap();
    let app = bound(&path).await;
    std::fs::write(&path, good.replace("chain: [a]", "chain: [nope]")).unwrap();
    let log = logged(|| assert!(!switchyard::reload::reload_now(&app)));
    assert!(log.contains("config rejected"), "{log}");

    // The last good text again: nothing to swap, but the fix is logged.
    std::fs::write(&path, &good).unwrap();
    let log = logged(|| assert!(!switchyard::reload::reload_now(&app)));
    assert!(log.contains("loaded again"), "{log}");
    // Once: an unchanged file after that is silent.
    let log = logged(|| assert!(!switchyard::reload::reload_now(&app)));
    assert!(!log.contains("loaded again"), "{log}");

    // A fix that differs from the last good file is a reload, and says so.
    std::fs::write(&path, good.replace("chain: [a]", "chain: [nope]")).unwrap();
    let _ = logged(|| assert!(!switchyard::reload::reload_now(&app)));
    std::fs::write(&path, good.replace("chain: [a]", "chain: [a, b]")).unwrap();
    let log = logged(|| assert!(switchyard::reload::reload_now(&app)));
    assert!(
        log.contains("config reloaded") && log.contains("after_rejection=true"),
        "{log}"
    );
}

/// A reload refused because a key that was read no longer can be is located
/// at the key's setting, not at the top of the file.
#[tokio::test]
async fn a_key_that_can_no_longer_be_read_is_refused_at_its_setting() {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "sk-reload-0123456789").unwrap();
    let path = dir.path().join("routes.yaml");
    let text = format!(
        "version: 1\nproviders:\n  p:\n    base_url: http://127.0.0.1:9/v1\n    api_key_file: '{}'\ntargets:\n  t: {{ provider: p, model: m }}\ntasks:\n  chat: {{ chain: [t] }}\n",
        key.display()
    );
    std::fs::write(&path, &text).unwrap();
    let app = bound(&path).await;
    std::fs::remove_file(&key).unwrap();
    let Err(diags) = switchyard::reload::prepare(&app) else {
        panic!("the reload was not refused")
    };
    let refusal = diags
        .iter()
        .find(|d| d.message.contains("was read and now cannot be"))
        .unwrap_or_else(|| panic!("{diags:?}"));
    assert_eq!((refusal.line, refusal.column), (5, 19), "{refusal:?}");
}

/// A gateway bound to `path`, not run: no watcher races the reloads a test
/// makes by hand.
async fn bound(path: &std::path::Path) -> std::sync::Arc<switchyard::state::App> {
    let gw = switchyard::server::Gateway::bind(
        path,
        Some("127.0.0.1:0".parse().unwrap()),
        switchyard::snapshot::CompileOptions::default(),
    )
    .await
    .unwrap();
    gw.app()
}

/// SIGHUP, an operator's habit for "reload", reloads: the process lives on
/// and a stream open through it ends whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_and_kills_nothing() {
    let words = ["one", " two", " three", " four"];
    let slow = Fake::always(fake::Reply::Stream {
        pieces: fake::sse_events("model-a", &words),
        delay: Duration::from_millis(150),
        cut: false,
    })
    .await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, routes(&[hop("a", &slow.url())], "", "")).unwrap();
    let mut served = crate::binary::Served::start(&config, dir.path(), &[("RUST_LOG", "info")]);
    let addr = served.addr;
    let stream = tokio::spawn(async move { chat(addr, hello_stream("gpt-4o")).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let pid = served.child.id().to_string();
    let sent = std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap();
    assert!(sent.success());
    let ans = stream.await.unwrap();
    assert_eq!(
        stream_text(&ans.text()),
        "one two three four",
        "{}",
        ans.text()
    );
    assert!(ans.text().ends_with("data: [DONE]\n\n"));
    assert!(
        matches!(served.child.try_wait(), Ok(None)),
        "SIGHUP ended the process:\n{}",
        served.log()
    );
    let said = wait_blocking(Duration::from_secs(5), || {
        served.log().contains("SIGHUP received")
    });
    assert!(said, "{}", served.log());
    let status = tokio::task::block_in_place(|| served.terminate(Duration::from_secs(5)));
    assert_eq!(status.code(), Some(0));
}
