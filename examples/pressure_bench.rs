//! A storm on one provider: its account allows `LIMIT` requests a minute
//! (the fake answers 429 beyond it), and three tasks share it: `core`
//! (critical, that provider only), `chat` (normal, with a fallback) and
//! `nightly` (batch, that provider only). Run once with priorities (a 40 %
//! reserve, shedding after a 429, a queue for the batch task) and once
//! without, side by side. Prints, per run: critical requests served by the
//! provider, normal requests served (and by the fallback), batch requests
//! completed with their waits, and whether the provider was ever called over
//! its limit.
//!
//! Run: `cargo run --release --example pressure_bench [SECONDS]` (default 60
//! per run; in-process fakes on 127.0.0.1).
// A bench tool, not the gateway: it may stop on a broken invariant.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "support/fake.rs"]
mod fake;
#[path = "support/gateway.rs"]
mod gateway;

use gateway::start;

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use bytes::Bytes;
use fake::Fake;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

/// The provider's requests per minute.
const LIMIT: usize = 120;
/// switchyard's bucket for it: a little under, so its burst never overdraws
/// the provider's minute.
const RPM: usize = 110;

fn routes(limited: &str, fallback: &str, with_priorities: bool) -> String {
    let (reserve, shed, core, nightly) = if with_priorities {
        (
            ", reserve: 0.4",
            ", shed_after_429: 30s",
            ", priority: critical",
            ", priority: batch, queue: { max_wait: 120s, max_depth: 1000 }",
        )
    } else {
        ("", "", "", "")
    };
    format!(
        "version: 1
providers:
  limited: {{ base_url: '{limited}', retry: {{ max: 0 }}, rate_limit: {{ rpm: {RPM}, burst: 5{reserve} }}{shed} }}
  fallback: {{ base_url: '{fallback}' }}
targets:
  a: {{ provider: limited, model: m }}
  b: {{ provider: fallback, model: m }}
tasks:
  core: {{ chain: [a]{core} }}
  chat: {{ chain: [a, b] }}
  nightly: {{ chain: [a], budget: {{ total_timeout: 150s }}{nightly} }}
"
    )
}

/// What one class of traffic got.
#[derive(Default)]
struct Tally {
    sent: AtomicUsize,
    ok: AtomicUsize,
    by_limited: AtomicUsize,
    waits: Mutex<Vec<Duration>>,
}

type Http = Client<HttpConnector, Full<Bytes>>;

async fn one(client: &Http, addr: std::net::SocketAddr, task: &str, tally: &Tally) {
    let body = format!(r#"{{"model":"{task}","messages":[{{"role":"user","content":"hi"}}]}}"#);
    let req = Request::post(format!("http://{addr}/v1/chat/completions"))
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    tally.sent.fetch_add(1, Ordering::Relaxed);
    let started = Instant::now();
    let Ok(resp) = client.request(req).await else {
        return;
    };
    let ok = resp.status().is_success();
    let by_limited = resp
        .headers()
        .get("x-switchyard-target")
        .is_some_and(|t| t == "a");
    let _ = resp.into_body().collect().await;
    if ok {
        tally.ok.fetch_add(1, Ordering::Relaxed);
        tally.waits.lock().push(started.elapsed());
        if by_limited {
            tally.by_limited.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Sends `task` requests every `every` for `seconds`, each on its own task.
fn drive(
    client: &Arc<Http>,
    addr: std::net::SocketAddr,
    task: &'static str,
    every: Duration,
    seconds: u64,
    tally: &Arc<Tally>,
) -> tokio::task::JoinHandle<()> {
    let (client, tally) = (Arc::clone(client), Arc::clone(tally));
    tokio::spawn(async move {
        let end = Instant::now() + Duration::from_secs(seconds);
        let mut tick = tokio::time::interval(every);
        let mut sent = Vec::new();
        while Instant::now() < end {
            tick.tick().await;
            let (client, tally) = (Arc::clone(&client), Arc::clone(&tally));
            sent.push(tokio::spawn(async move {
                one(&client, addr, task, &tally).await
            }));
        }
        for s in sent {
            let _ = s.await;
        }
    })
}

fn line(name: &str, t: &Tally) -> String {
    let sent = t.sent.load(Ordering::Relaxed);
    let ok = t.ok.load(Ordering::Relaxed);
    let by = t.by_limited.load(Ordering::Relaxed);
    let mut waits = t.waits.lock().clone();
    waits.sort();
    let p = |q: f64| {
        waits
            .get(((waits.len().max(1) - 1) as f64 * q).round() as usize)
            .map_or(0.0, Duration::as_secs_f64)
    };
    format!(
        "{name}: {ok}/{sent} served ({by} by the limited provider), wait p50 {:.2} s, max {:.2} s",
        p(0.5),
        p(1.0)
    )
}

async fn run(with_priorities: bool, seconds: u64) {
    // The account's own limit: a sliding minute of LIMIT calls, 429 beyond it.
    let window: Arc<Mutex<VecDeque<Instant>>> = Arc::default();
    let over = Arc::new(AtomicUsize::new(0));
    let (w, o) = (Arc::clone(&window), Arc::clone(&over));
    let limited = Fake::start(move |_, _| {
        let now = Instant::now();
        let mut calls = w.lock();
        while calls
            .front()
            .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(60))
        {
            calls.pop_front();
        }
        calls.push_back(now);
        if calls.len() > LIMIT {
            o.fetch_add(1, Ordering::Relaxed);
            fake::error(429, "rate limit reached")
        } else {
            fake::completion("m", "ok")
        }
    })
    .await;
    let fallback = Fake::always(fake::completion("m", "ok")).await;
    let dir = tempfile::tempdir().unwrap();
    let yaml = routes(&limited.url(), &fallback.url(), with_priorities);
    let addr = start(&yaml, dir.path()).await;
    let client = Arc::new(Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>());
    let (core, chat, nightly) = (Arc::default(), Arc::default(), Arc::default());
    // Offered: 1/s critical, 3/s normal, 0.25/s batch against 2/s allowed.
    let runs = [
        drive(
            &client,
            addr,
            "core",
            Duration::from_millis(1000),
            seconds,
            &core,
        ),
        drive(
            &client,
            addr,
            "chat",
            Duration::from_millis(333),
            seconds,
            &chat,
        ),
        drive(
            &client,
            addr,
            "nightly",
            Duration::from_millis(4000),
            seconds,
            &nightly,
        ),
    ];
    for r in runs {
        r.await.unwrap();
    }
    let title = if with_priorities {
        "with priorities"
    } else {
        "without priorities"
    };
    println!("== {title} ({seconds} s, the provider allows {LIMIT} rpm)");
    println!("{}", line("critical (core)", &core));
    println!("{}", line("normal (chat)", &chat));
    println!("{}", line("batch (nightly)", &nightly));
    println!(
        "provider: {} calls, {} of them over its limit (answered 429)",
        limited.calls(),
        over.load(Ordering::Relaxed)
    );
}

#[tokio::main]
async fn main() {
    let seconds: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(60);
    run(true, seconds).await;
    run(false, seconds).await;
}
