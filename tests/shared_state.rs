//! Shared state across replicas: three in-process gateways share one real
//! `redis-server` (started by the test on a free port, stopped after it;
//! `support::redis` finds or provisions the binary).
//! An outage one replica sees reaches the others within a second, a
//! recovering target gets one half-open trial across the three, a shared
//! rpm limit holds under load spread over them, and losing the store fails
//! no request while `switchyard_shared_state_up` says so; when the store
//! comes back, the replicas resynchronise.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use switchyard::health::State;
use tokio::time::Instant;

use crate::support::fake::{self, Fake};
use crate::support::*;

/// A file with providers `pa` (at `a`) and `pb` (at `b`), targets `a`
/// (plus `extra_targets` on `pa`) and `b`, task `chat` = [a, b] and the
/// given extra tasks, quick DOWN, no probes, sharing `redis`.
fn config(a: &str, b: &str, redis: &RedisServer, more: &str, health: &str) -> String {
    format!(
        "version: 1
providers:
  pa: {{ base_url: '{a}', timeout: 2s, retry: {{ max: 0 }} }}
  pb: {{ base_url: '{b}', timeout: 2s, retry: {{ max: 0 }} }}
{more}
health: {{ degraded_after: 1, down_after: 1, probe: {{ interval: 0 }}, {health} }}
shared_state:
  redis: {{ url_file: '{}', key_prefix: test, timeout: 250ms }}
",
        redis.url_file().display()
    )
}

/// `targets:` and `tasks:` with `chat` = [a, b] and, for each `i < n`, a
/// target `a{i}` (model `m{i}` on `pa`) and a task `t{i}` = [a{i}, b].
fn chains(n: usize) -> String {
    let mut targets = String::from(
        "targets:\n  a: { provider: pa, model: ma }\n  b: { provider: pb, model: mb }\n",
    );
    let mut tasks = String::from("tasks:\n  chat: { aliases: [gpt-4o], chain: [a, b] }\n");
    for i in 0..n {
        targets.push_str(&format!("  a{i}: {{ provider: pa, model: m{i} }}\n"));
        tasks.push_str(&format!("  t{i}: {{ chain: [a{i}, b] }}\n"));
    }
    targets + &tasks
}

/// Task `chat` = [a] alone, `pa` limited by `rate_limit`: a request the
/// allowance cannot take is answered 429 (no other target).
fn limited_chain(a: &Fake, b: &Fake, redis: &RedisServer, rate_limit: &str) -> String {
    let more = "targets:\n  a: { provider: pa, model: ma }\n  b: { provider: pb, model: mb }\n\
                tasks:\n  chat: { aliases: [gpt-4o], chain: [a] }\n";
    config(&a.url(), &b.url(), redis, more, "open_for: 60s").replace(
        "retry: { max: 0 } }",
        &format!("retry: {{ max: 0 }}, rate_limit: {rate_limit} }}"),
    )
}

/// Three replicas of one file, each connected to the store.
async fn replicas(yaml: &str) -> Vec<Gw> {
    let mut gws = Vec::new();
    for _ in 0..3 {
        gws.push(gateway(yaml).await);
    }
    for gw in &gws {
        assert!(
            eventually(Duration::from_secs(5), || async { up(gw) == Some(1.0) }).await,
            "a replica did not connect to the store"
        );
    }
    gws
}

/// `switchyard_shared_state_up` of a gateway.
fn up(gw: &Gw) -> Option<f64> {
    series_value(&gw.app.metrics().render(), "switchyard_shared_state_up")
}

/// A target's state on a replica, read in-process (no request in between).
fn state(gw: &Gw, target: &str) -> State {
    gw.app.snapshot.load().targets[target].health.state()
}

/// Polls (every millisecond, at most `within`) until `target` is DOWN on
/// every one of `gws`; how long that took.
async fn down_everywhere(gws: &[&Gw], target: &str, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() < within {
        if gws.iter().all(|gw| state(gw, target) == State::Down) {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outage_seen_by_one_replica_is_skipped_by_the_others_within_a_second() {
    let redis = RedisServer::start();
    let a = Fake::always(fake::error(503, "overloaded")).await;
    let b = Fake::always(fake::completion("mb", "from b")).await;
    const N: usize = 20;
    let yaml = config(&a.url(), &b.url(), &redis, &chains(N), "open_for: 60s");
    let gws = replicas(&yaml).await;
    let mut delays = Vec::new();
    for i in 0..N {
        let target = format!("a{i}");
        assert_eq!(state(&gws[1], &target), State::Healthy);
        // At a random point of the publishing tick, not locked to it.
        tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 60)).await;
        let ans = chat(gws[0].addr, hello(&format!("t{i}"))).await;
        assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
        assert_eq!(
            state(&gws[0], &target),
            State::Down,
            "replica 1 saw the 503"
        );
        let delay = down_everywhere(&[&gws[1], &gws[2]], &target, Duration::from_secs(2))
            .await
            .unwrap_or_else(|| panic!("{target} did not go DOWN on replicas 2 and 3 within 2 s"));
        delays.push(delay);
    }
    // Replicas 2 and 3 skip the target without calling it.
    let calls = a.calls();
    assert_eq!(calls, N, "one call per target, from replica 1");
    for gw in &gws[1..] {
        for i in 0..N {
            let ans = chat(gw.addr, hello(&format!("t{i}"))).await;
            assert_eq!(ans.header("x-switchyard-target"), "b");
            assert_eq!(
                ans.header("x-switchyard-failovers"),
                "0",
                "a skipped, not failed"
            );
        }
    }
    assert_eq!(
        a.calls(),
        calls,
        "a DOWN target got traffic from another replica"
    );
    delays.sort();
    let p50 = delays[N / 2];
    let max = delays[N - 1];
    eprintln!("shared DOWN propagation over {N} transitions: p50 {p50:?}, max {max:?}");
    assert!(max < Duration::from_secs(1), "propagation took {max:?}");
    let applied = series_value(
        &gws[1].app.metrics().render(),
        r#"switchyard_shared_state_updates_total{direction="applied"}"#,
    );
    assert!(applied.unwrap_or(0.0) >= N as f64, "{applied:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_open_trial_happens_once_across_the_replicas() {
    let redis = RedisServer::start();
    let a = Fake::always(fake::error(503, "still down")).await;
    let b = Fake::always(fake::completion("mb", "from b")).await;
    // open_for 2 s (±20 %): the first trial is due 1.6-2.4 s after the
    // outage, and a failed one reopens no sooner than 1.6 s after it.
    let yaml = config(&a.url(), &b.url(), &redis, &chains(0), "open_for: 2s");
    let gws = replicas(&yaml).await;
    let started = Instant::now();
    assert_eq!(
        chat(gws[0].addr, hello("gpt-4o"))
            .await
            .header("x-switchyard-target"),
        "b"
    );
    assert!(
        down_everywhere(&[&gws[1], &gws[2]], "a", Duration::from_secs(1))
            .await
            .is_some()
    );
    assert_eq!(a.calls(), 1);
    // Load on all three until 3.1 s after the outage: past the first
    // reopen, before any second one.
    let mut sent = 0;
    while started.elapsed() < Duration::from_millis(3100) && sent < 600 {
        let gw = &gws[sent % 3];
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        sent += 1;
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(sent > 100, "only {sent} requests in 3 s");
    assert_eq!(
        a.calls() - 1,
        1,
        "half-open trials across three replicas in one open period"
    );
    let won: f64 = gws
        .iter()
        .map(|gw| {
            series_value(
                &gw.app.metrics().render(),
                r#"switchyard_shared_state_trial_leases_total{result="won"}"#,
            )
            .unwrap_or(0.0)
        })
        .sum();
    assert_eq!(won, 1.0, "one replica held the lease");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_rpm_limit_holds_across_three_replicas() {
    let redis = RedisServer::start();
    let a = Fake::always(fake::completion("ma", "from a")).await;
    let b = Fake::always(fake::completion("mb", "unused")).await;
    // 600 requests a minute (10/s), 20 at once, for all three together.
    let yaml = limited_chain(&a, &b, &redis, "{ rpm: 600, burst: 20 }");
    let gws = replicas(&yaml).await;
    // Let each replica take its standing allowance first.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let window = Duration::from_secs(3);
    let started = Instant::now();
    let mut loops = Vec::new();
    for (i, gw) in gws.iter().enumerate() {
        for _ in 0..2 {
            let addr = gw.addr;
            loops.push(tokio::spawn(async move {
                let (mut ok, mut limited) = (0u32, 0u32);
                for _ in 0..3000 {
                    if started.elapsed() >= window {
                        break;
                    }
                    let ans = chat(addr, hello("gpt-4o")).await;
                    match ans.status.as_u16() {
                        200 => ok += 1,
                        429 => limited += 1,
                        other => panic!("replica {i}: status {other}: {}", ans.text()),
                    }
                }
                (ok, limited)
            }));
        }
    }
    let (mut admitted, mut refused) = (0u32, 0u32);
    for l in loops {
        let (ok, limited) = l.await.unwrap();
        admitted += ok;
        refused += limited;
    }
    let elapsed = started.elapsed().as_secs_f64();
    // The bucket's own arithmetic: a full burst, then 10 a second.
    let expected = 20.0 + 10.0 * elapsed;
    let error = (f64::from(admitted) - expected) / expected;
    eprintln!(
        "shared rpm 600 (burst 20) over {elapsed:.2} s on 3 replicas: admitted {admitted}, \
         expected {expected:.1} ({:+.1} %), refused {refused}",
        error * 100.0
    );
    assert!(
        refused > admitted,
        "the load must exceed the limit: {refused} refused"
    );
    assert!(
        error.abs() <= 0.10,
        "admitted {admitted} against {expected:.1}"
    );
    assert_eq!(a.calls(), admitted as usize);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_far_under_a_shared_limit_is_refused_nothing() {
    let redis = RedisServer::start();
    let a = Fake::always(fake::completion("ma", "from a")).await;
    let b = Fake::always(fake::completion("mb", "unused")).await;
    let yaml = limited_chain(&a, &b, &redis, "{ rpm: 6000, burst: 100 }");
    let gw = gateway(&yaml).await;
    assert!(eventually(Duration::from_secs(5), || async { up(&gw) == Some(1.0) }).await);
    tokio::time::sleep(Duration::from_millis(200)).await;
    // About 20 a second against 100 a second, unevenly: pauses of 0 to 110 ms,
    // so some keeper ticks see nothing and others several requests.
    let mut statuses = Vec::new();
    for n in 0..60u64 {
        statuses.push(chat(gw.addr, hello("gpt-4o")).await.status.as_u16());
        tokio::time::sleep(Duration::from_millis((n * 37) % 111)).await;
    }
    let refused = statuses.iter().filter(|&&s| s != 200).count();
    assert_eq!(refused, 0, "{statuses:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_store_fails_no_request_and_its_return_resynchronises() {
    let mut redis = RedisServer::start();
    let a = Fake::always(fake::completion("ma", "from a")).await;
    let b = Fake::always(fake::completion("mb", "from b")).await;
    let c = Fake::always(fake::error(503, "c is down")).await;
    // `chat` carries the load (a limited provider, so its allowance is
    // shared); `t0` = [a0 on pc, b] is where the outage during the store's
    // absence happens.
    let more = format!(
        "  pc: {{ base_url: '{}', timeout: 2s, retry: {{ max: 0 }} }}\n{}",
        c.url(),
        chains(1).replace("a0: { provider: pa", "a0: { provider: pc")
    );
    let yaml = config(&a.url(), &b.url(), &redis, &more, "open_for: 60s").replace(
        "pa: { base_url",
        "pa: { rate_limit: { rpm: 60000 }, base_url",
    );
    let gws = Arc::new(replicas(&yaml).await);
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (gws, stop) = (Arc::clone(&gws), Arc::clone(&stop));
        tokio::spawn(async move {
            let (mut statuses, mut slowest) = (Vec::new(), Duration::ZERO);
            for n in 0..20_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let sent = Instant::now();
                let ans = chat(gws[n % 3].addr, hello("gpt-4o")).await;
                slowest = slowest.max(sent.elapsed());
                statuses.push((sent, ans.status.as_u16()));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            (statuses, slowest)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    redis.kill();
    for gw in gws.iter() {
        assert!(
            eventually(Duration::from_secs(3), || async { up(gw) == Some(0.0) }).await,
            "switchyard_shared_state_up did not drop to 0"
        );
    }
    // While the store is away, an outage stays with the replica that saw it.
    assert_eq!(
        chat(gws[0].addr, hello("t0"))
            .await
            .header("x-switchyard-target"),
        "b"
    );
    assert_eq!(state(&gws[0], "a0"), State::Down);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        state(&gws[1], "a0"),
        State::Healthy,
        "nothing to share it through"
    );
    redis.restart();
    for gw in gws.iter() {
        assert!(
            eventually(Duration::from_secs(6), || async { up(gw) == Some(1.0) }).await,
            "a replica did not reconnect"
        );
    }
    let back = Instant::now();
    // What replica 1 learnt while the store was away reaches the others.
    assert!(
        down_everywhere(&[&gws[1], &gws[2]], "a0", Duration::from_secs(1))
            .await
            .is_some(),
        "replicas did not resynchronise after the store came back"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let (statuses, slowest) = load.await.unwrap();
    // The load went on while the store was away (how much depends on the
    // machine: the loop sends one request at a time).
    let while_away = statuses
        .iter()
        .filter(|(sent, _)| (killed..back).contains(sent))
        .count();
    assert!(
        while_away >= 10,
        "only {while_away} of {} requests were sent while the store was away",
        statuses.len()
    );
    let failed = statuses.iter().filter(|(_, s)| *s != 200).count();
    eprintln!(
        "store killed and restarted under load: {} requests ({while_away} while it was away), {failed} failed, slowest {slowest:?}",
        statuses.len()
    );
    assert_eq!(
        failed, 0,
        "requests failed while the store was away: {failed}"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "a request waited {slowest:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_slower_than_its_timeout_counts_as_down_and_holds_up_nothing() {
    let redis = RedisServer::start();
    let a = Fake::always(fake::completion("ma", "from a")).await;
    let b = Fake::always(fake::completion("mb", "from b")).await;
    let yaml = config(&a.url(), &b.url(), &redis, &chains(0), "open_for: 60s").replace(
        "pa: { base_url",
        "pa: { rate_limit: { rpm: 60000 }, base_url",
    );
    let gws = replicas(&yaml).await;
    redis.freeze(true);
    let frozen = Instant::now();
    for gw in &gws {
        assert!(
            eventually(Duration::from_secs(3), || async { up(gw) == Some(0.0) }).await,
            "a store that answers nothing still counts as up"
        );
    }
    eprintln!(
        "a frozen store counted as down after {:?}",
        frozen.elapsed()
    );
    for n in 0..30 {
        let sent = Instant::now();
        let ans = chat(gws[n % 3].addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert!(
            sent.elapsed() < Duration::from_millis(500),
            "waited {:?}",
            sent.elapsed()
        );
    }
    redis.freeze(false);
    for gw in &gws {
        assert!(
            eventually(Duration::from_secs(6), || async { up(gw) == Some(1.0) }).await,
            "no reconnect after the store thawed"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_url_is_a_secret_and_its_password_is_used() {
    let redis = RedisServer::start_with(Some("s3cret-pw"));
    let a = Fake::always(fake::completion("ma", "from a")).await;
    let yaml = config(&a.url(), &a.url(), &redis, &chains(0), "open_for: 60s");
    let gw = gateway(&yaml).await;
    assert!(
        eventually(Duration::from_secs(5), || async { up(&gw) == Some(1.0) }).await,
        "did not connect with the URL's password"
    );
    for path in ["/metrics", "/admin/targets"] {
        let page = get(gw.addr, path).await.text();
        assert!(!page.contains("s3cret"), "{path} shows the password");
    }
    // A URL that is not one: the error names the setting, not the URL.
    let bad = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(bad.path(), "http://user:s3cret-pw@example").unwrap();
    let text = yaml.replace(
        &redis.url_file().display().to_string(),
        &bad.path().display().to_string(),
    );
    let errors = compile_errors(&text);
    let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert!(
        all.iter()
            .any(|e| e.contains("shared_state.redis.url_file") && e.contains("not a redis://")),
        "{all:#?}"
    );
    assert!(all.iter().all(|e| !e.contains("s3cret")), "{all:#?}");
    // A URL that cannot be read (a Secret not mounted yet) is a warning: the
    // replica starts on local state and says so in the gauge.
    let missing = yaml.replace(
        &redis.url_file().display().to_string(),
        "/nonexistent/redis-url",
    );
    let alone = gateway(&missing).await;
    assert_eq!(up(&alone), Some(0.0));
    assert_eq!(chat(alone.addr, hello("gpt-4o")).await.status, 200);
}

/// `pa` with one key read from `key`, and (when `probe` is set) its own
/// re-probes of revoked keys every `probe`; `rules` under it.
fn keyed_config(
    a: &Fake,
    b: &Fake,
    redis: &RedisServer,
    key: &std::path::Path,
    probe: Option<&str>,
    rules: &str,
) -> String {
    let probe = probe
        .map(|p| format!(", probe: {{ interval: {p} }}"))
        .unwrap_or_default();
    let more = chains(0);
    config(&a.url(), &b.url(), redis, &more, "open_for: 60s").replace(
        "retry: { max: 0 } }",
        &format!(
            "retry: {{ max: 0 }}, api_key_file: '{}'{probe}{rules} }}",
            key.display()
        ),
    )
}

/// A store, a key file, `a` answering one 401 then completions, and `b`.
struct Blip {
    redis: RedisServer,
    _dir: tempfile::TempDir,
    key: std::path::PathBuf,
    a: Fake,
    b: Fake,
}

impl Blip {
    async fn start() -> Blip {
        let redis = RedisServer::start();
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "sk-shared-0123456789").unwrap();
        let a = Fake::start(|n, _| match n {
            0 => fake::error(401, "Incorrect API key provided"),
            _ => fake::completion("model-a", "a"),
        })
        .await;
        let b = Fake::always(fake::completion("model-b", "b")).await;
        Blip {
            redis,
            _dir: dir,
            key,
            a,
            b,
        }
    }
}

fn key_dead(gw: &Gw) -> bool {
    let snapshot = gw.app.snapshot.load();
    let key = &snapshot.providers["pa"].keys[0];
    key.health.state(Instant::now()) == switchyard::health::KeyState::Dead
}

/// One upstream 401 on one replica revokes the key on every replica; the
/// replica that re-probes it finds it accepted again and publishes that, so a
/// replica that never re-probes (no `probe`) gets the key back too (issue 21
/// item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_keys_recovery_reaches_the_replicas_that_do_not_reprobe() {
    let Blip {
        redis,
        _dir,
        key,
        a,
        b,
    } = Blip::start().await;
    let prober = gateway(&keyed_config(&a, &b, &redis, &key, Some("200ms"), "")).await;
    let quiet = gateway(&keyed_config(&a, &b, &redis, &key, None, "")).await;
    for gw in [&prober, &quiet] {
        assert!(eventually(Duration::from_secs(5), || async { up(gw) == Some(1.0) }).await);
    }
    let ans = chat(quiet.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    assert!(key_dead(&quiet));
    assert!(
        eventually(Duration::from_secs(3), || async { key_dead(&prober) }).await,
        "the revocation did not reach the other replica"
    );
    assert!(
        eventually(Duration::from_secs(5), || async { !key_dead(&quiet) }).await,
        "the replica without re-probes never got the recovered key back"
    );
    let ans = chat(quiet.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "a", "{}", ans.text());
}

/// A 429 for one model on one replica holds that model back on the key on
/// every replica, and only that model: the key still serves the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_rate_limit_for_one_model_reaches_every_replica_for_that_model_only() {
    let redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "sk-shared-0123456789").unwrap();
    let a = Fake::start(|_, seen| match seen.body["model"].as_str() {
        Some("ma") => fake::Reply::Json {
            status: 429,
            body: r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#.into(),
            headers: vec![("retry-after".into(), "30".into())],
        },
        _ => fake::completion("model-a0", "a0"),
    })
    .await;
    let b = Fake::always(fake::completion("model-b", "b")).await;
    let yaml = keyed_config(&a, &b, &redis, &key, None, "").replace(
        "targets:\n",
        "targets:\n  a0: { provider: pa, model: m0 }\n",
    );
    let yaml = yaml.replace("tasks:\n", "tasks:\n  t0: { chain: [a0, b] }\n");
    let one = gateway(&yaml).await;
    let other = gateway(&yaml).await;
    let ans = chat(one.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    let state = |gw: &Gw, model: &str| {
        let snapshot = gw.app.snapshot.load();
        let key = &snapshot.providers["pa"].keys[0];
        key.health.state_for(Instant::now(), model)
    };
    let cooling = |s| matches!(s, switchyard::health::KeyState::CoolingDown(_));
    assert!(
        eventually(Duration::from_secs(3), || async {
            cooling(state(&other, "ma"))
        })
        .await,
        "the rate limit did not reach the other replica"
    );
    assert_eq!(state(&other, "m0"), switchyard::health::KeyState::Usable);
    let ans = chat(other.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    let ans = chat(
        other.addr,
        serde_json::json!({"model": "t0",
        "messages": [{"role": "user", "content": "hi"}]}),
    )
    .await;
    assert_eq!(ans.header("x-switchyard-target"), "a0", "{}", ans.text());
    let limited_calls = a.seen().iter().filter(|s| s.body["model"] == "ma").count();
    assert_eq!(
        limited_calls, 1,
        "the limited model was called once, on one replica"
    );
}

/// A `revoke: until_rotation` revocation is shared as such: no replica
/// re-probes the key, so none revives it for the others (issue 21 item 5).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revocation_until_rotation_is_kept_by_every_replica() {
    let Blip {
        redis,
        _dir,
        key,
        a,
        b,
    } = Blip::start().await;
    let rules = ", error_classes: [{ match: { status: 401 }, action: failover, scope: key, cooldown: until_reload, revoke: until_rotation }]";
    let yaml = keyed_config(&a, &b, &redis, &key, Some("100ms"), rules);
    let (one, two) = (gateway(&yaml).await, gateway(&yaml).await);
    for gw in [&one, &two] {
        assert!(eventually(Duration::from_secs(5), || async { up(gw) == Some(1.0) }).await);
    }
    let ans = chat(one.addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    assert!(
        eventually(Duration::from_secs(3), || async { key_dead(&two) }).await,
        "the revocation did not reach the other replica"
    );
    // Many re-probe intervals later, nobody has re-probed or revived it.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(key_dead(&one) && key_dead(&two));
    assert_eq!(
        a.calls(),
        1,
        "a replica re-probed a key revoked until rotation"
    );
}

/// Task `chat` (normal) and `core` (critical), both [a, b], with `pa`'s
/// `provider_extra` (say a `rate_limit` or `shed_after_429`).
fn prioritized(a: &Fake, b: &Fake, redis: &RedisServer, provider_extra: &str) -> String {
    let more = "targets:\n  a: { provider: pa, model: ma }\n  b: { provider: pb, model: mb }\n\
                tasks:\n  chat: { aliases: [gpt-4o], chain: [a, b] }\n  \
                core: { chain: [a, b], priority: critical }\n";
    config(&a.url(), &b.url(), redis, more, "open_for: 60s").replacen(
        "retry: { max: 0 } }",
        &format!("retry: {{ max: 0 }}, {provider_extra} }}"),
        1,
    )
}

/// A bucket's reserve holds for the deployment, not per replica: normal
/// work on three replicas together leaves it, and critical work on any of
/// them spends it (issue 24).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_is_kept_for_critical_work_across_the_replicas() {
    let redis = RedisServer::start();
    let a = Fake::always(fake::completion("ma", "from a")).await;
    let b = Fake::always(fake::completion("mb", "from b")).await;
    // 20 at once, half of it kept; one more every 10 s.
    let yaml = prioritized(
        &a,
        &b,
        &redis,
        "rate_limit: { rpm: 6, burst: 20, reserve: 0.5 }",
    );
    let gws = replicas(&yaml).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut normal_on_a = 0;
    for i in 0..30 {
        let ans = chat(gws[i % 3].addr, hello("gpt-4o")).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        normal_on_a += usize::from(ans.header("x-switchyard-target") == "a");
        // Now and then a keeper tick, so each replica leases again.
        if i % 5 == 4 {
            tokio::time::sleep(Duration::from_millis(120)).await;
        }
    }
    assert!(
        (1..=10).contains(&normal_on_a),
        "normal work got {normal_on_a} of a's 20: the 10 kept are not its"
    );
    for i in 0..9 {
        let ans = chat(gws[i % 3].addr, hello("core")).await;
        assert_eq!(
            ans.header("x-switchyard-target"),
            "a",
            "critical request {i} on replica {}: {}",
            i % 3,
            ans.text()
        );
        tokio::time::sleep(Duration::from_millis(120)).await;
    }
    assert!(a.calls() <= 21, "a was called {} times", a.calls());
}

/// After a 429 on one replica, every replica sheds non-critical work from
/// that provider for `shed_after_429` (issue 24).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_429_on_one_replica_sheds_normal_work_on_all_of_them() {
    let redis = RedisServer::start();
    let a = Fake::start(|n, _| match n {
        0 => fake::error(429, "slow down"),
        _ => fake::completion("ma", "from a"),
    })
    .await;
    let b = Fake::always(fake::completion("mb", "from b")).await;
    let yaml = prioritized(&a, &b, &redis, "shed_after_429: 30s");
    let gws = replicas(&yaml).await;
    let ans = chat(gws[0].addr, hello("gpt-4o")).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    // Past the 429's own 1 s cooldown: only the shedding holds a back.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    for gw in &gws[1..] {
        let ans = chat(gw.addr, hello("gpt-4o")).await;
        assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    }
    let ans = chat(gws[2].addr, hello("core")).await;
    assert_eq!(ans.header("x-switchyard-target"), "a", "{}", ans.text());
    assert_eq!(a.calls(), 2);
}

/// A response stored by one replica is continued and fetched on another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_started_on_one_replica_continues_on_another() {
    let redis = RedisServer::start();
    let a = Fake::start(|n, _| fake::completion("ma", &format!("answer {n}"))).await;
    let b = Fake::always(fake::completion("mb", "b")).await;
    let gws = replicas(&config(
        &a.url(),
        &b.url(),
        &redis,
        &chains(0),
        "open_for: 60s",
    ))
    .await;
    let body = serde_json::json!({"model": "gpt-4o", "input": "hi"}).to_string();
    let first = post_raw(gws[0].addr, "/v1/responses", body, &[]).await;
    assert_eq!(first.status, 200, "{}", first.text());
    let id = first.json()["id"].as_str().unwrap().to_owned();
    let path = format!("/v1/responses/{id}");
    assert!(
        eventually(Duration::from_secs(5), || async {
            get(gws[1].addr, &path).await.status == 200
        })
        .await,
        "replica 1 never saw the response"
    );
    let next = serde_json::json!({"model": "gpt-4o", "input": "more", "previous_response_id": id});
    let second = post_raw(gws[2].addr, "/v1/responses", next.to_string(), &[]).await;
    assert_eq!(second.status, 200, "{}", second.text());
    let sent = &a.seen()[1].body["messages"];
    assert_eq!(
        sent[1],
        serde_json::json!({"role": "assistant", "content": "answer 0"}),
        "{sent}"
    );
    // Deleted on one replica, it is gone from the others' copies too.
    let req = http::Request::delete(gws[0].url(&path))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let deleted = client().request(req).await.unwrap();
    assert_eq!(deleted.status(), 200);
    for gw in &gws[1..] {
        assert!(
            eventually(Duration::from_secs(2), || async {
                get(gw.addr, &path).await.status == 404
            })
            .await,
            "a replica kept a deleted response"
        );
    }
    let gone = post_raw(gws[2].addr, "/v1/responses", next.to_string(), &[]).await;
    assert_eq!(gone.status, 400, "{}", gone.text());
    assert_eq!(gone.json()["error"]["code"], "previous_response_not_found");
    // Continued at once on another replica, before the write behind the
    // first answer could be counted on.
    for i in 0..3 {
        let body = serde_json::json!({"model": "gpt-4o", "input": format!("q{i}")});
        let made = post_raw(gws[0].addr, "/v1/responses", body.to_string(), &[]).await;
        let id = made.json()["id"].as_str().unwrap().to_owned();
        let next = serde_json::json!({"model": "gpt-4o", "input": "x", "previous_response_id": id});
        let went = post_raw(gws[1].addr, "/v1/responses", next.to_string(), &[]).await;
        assert_eq!(went.status, 200, "{}", went.text());
    }
}
