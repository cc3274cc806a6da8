//! The chaos run, shared by the bounded integration test (`tests/chaos.rs`)
//! and the long manual run (`cargo run --release --example chaos`).
//!
//! In one process: three fake upstreams ([`super::fake_upstream::Upstream`])
//! — `chaos-a` and `chaos-b` fault at random (`fault_rate`, the fake's whole
//! default mix), `chaos-c` never does — and switchyard in front of them with
//! two tasks:
//!
//! - `chaos-safe`, chain `[a, b, c]`: `c` is always healthy, so every request
//!   must succeed (a stream the serving upstream cut *after* its first content
//!   chunk is the one allowed exception: it must end with a well-formed
//!   `stream_interrupted` event, never with replayed text);
//! - `chaos-risky`, chain `[a, b]`: both may fault, so it may fail, but only
//!   with an OpenAI-format error whose status matches its cause; and when an
//!   upstream answered one of its attempts without a fault, it must succeed.
//!
//! `clients` concurrent clients send a mix of streaming and non-streaming
//! requests (each with its own `x-request-id`, which switchyard forwards, so
//! the fakes' journals tell what each attempt of each request met).
//! `routes.yaml` is rewritten every `reload_every`, alternating two valid
//! configs (the chains' order flips). `chaos-a` is killed (listener and every
//! connection closed at once) `kill_at` into the run and restarted on its port
//! `down_for` later. Checked for every request:
//!
//! - success as above (`chaos-safe`: 100 %);
//! - every stream: content chunks carry `[seq 0]`, `[seq 1]`, ... in order,
//!   none repeated or missing, all from one upstream, `[DONE]` last;
//! - latency at most `total_timeout` + 50 ms;
//! - errors: `{"error": {"message", "type", "code"}}`, `application/json`,
//!   502 `all_targets_failed` only after failed attempts (and naming a status
//!   an attempt really got), 504 `deadline_exceeded` only at the deadline;
//! - `x-switchyard-attempts` equals the attempts the fakes saw.
//!
//! Open descriptors and RSS are compared before and after the main phase
//! (each measured with all connections closed, after a warm-up).
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use switchyard::server::Gateway;
use switchyard::snapshot::CompileOptions;

use super::fake_upstream::{self as fu, Behaviour, Served, Upstream, KINDS};

/// What to run.
#[derive(Clone, Debug)]
pub struct Params {
    /// Length of the measured phase.
    pub duration: Duration,
    /// Traffic (with faults and reloads, without the kill) before the start measurements.
    pub warmup: Duration,
    /// Concurrent clients.
    pub clients: usize,
    /// Fault probability of `chaos-a` and `chaos-b`.
    pub fault_rate: f64,
    /// Seed of the fakes' fault draws and the clients' choices.
    pub seed: u64,
    /// Interval of routes.yaml rewrites.
    pub reload_every: Duration,
    /// When `chaos-a` is killed, as a fraction of `duration`.
    pub kill_at: f64,
    /// How long it stays dead.
    pub down_for: Duration,
    /// Content chunks per stream.
    pub chunks: usize,
    /// Pause between chunks.
    pub chunk_delay: Duration,
    /// Share of streaming requests.
    pub stream_share: f64,
    /// Share of requests to `chaos-risky`.
    pub risky_share: f64,
    /// Render the metrics this often, as a Prometheus scrape would (`None`:
    /// never, until the end).
    pub scrape_every: Option<Duration>,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            duration: Duration::from_secs(20),
            warmup: Duration::from_secs(3),
            clients: 8,
            fault_rate: 0.3,
            seed: 7,
            reload_every: Duration::from_millis(200),
            kill_at: 0.4,
            down_for: Duration::from_secs(2),
            chunks: 8,
            chunk_delay: Duration::from_millis(1),
            stream_share: 0.5,
            risky_share: 0.25,
            scrape_every: None,
        }
    }
}

/// `total_timeout` of `chaos-safe` (room for two faulty targets, then `c`).
pub const SAFE_TOTAL: Duration = Duration::from_secs(4);
/// `total_timeout` of `chaos-risky` (short: some requests hit it).
pub const RISKY_TOTAL: Duration = Duration::from_millis(700);
/// Allowed lateness past `total_timeout`.
pub const LATE_SLACK: Duration = Duration::from_millis(50);

const TARGETS: [&str; 3] = ["chaos-a", "chaos-b", "chaos-c"];

/// The routes.yaml of variant 0 or 1 (the chains' order flips).
fn config(urls: &[String; 3], variant: usize) -> String {
    let (first, second) = if variant == 0 {
        ("chaos-a", "chaos-b")
    } else {
        ("chaos-b", "chaos-a")
    };
    let total_safe = humantime::format_duration(SAFE_TOTAL);
    let total_risky = humantime::format_duration(RISKY_TOTAL);
    format!(
        "# chaos run, variant {variant}
version: 1
providers:
  p-a: {{ base_url: '{a}', timeout: 400ms, connect_timeout: 200ms, idle_timeout: 1s, retry: {{ max: 1, backoff: 10ms }} }}
  p-b: {{ base_url: '{b}', timeout: 400ms, connect_timeout: 200ms, idle_timeout: 1s, retry: {{ max: 1, backoff: 10ms }} }}
  p-c: {{ base_url: '{c}', timeout: 3s, connect_timeout: 1s, idle_timeout: 2s, retry: {{ max: 1, backoff: 10ms }} }}
targets:
  chaos-a: {{ provider: p-a, model: model-a }}
  chaos-b: {{ provider: p-b, model: model-b }}
  chaos-c: {{ provider: p-c, model: model-c }}
tasks:
  chaos-safe:
    chain: [{first}, {second}, chaos-c]
    budget: {{ total_timeout: {total_safe}, first_token_timeout: 1s }}
  chaos-risky:
    chain: [{first}, {second}]
    budget: {{ total_timeout: {total_risky}, first_token_timeout: 300ms }}
health: {{ degraded_after: 3, down_after: 5, open_for: 500ms, probe: {{ interval: 300ms }} }}
",
        a = urls[0],
        b = urls[1],
        c = urls[2],
    )
}

/// Open descriptors of this process.
#[must_use]
pub fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, Iterator::count)
}

/// Resident memory of this process, KiB.
#[must_use]
pub fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// How one request ended, as the client saw it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum End {
    /// 200, complete.
    Ok,
    /// 200 stream ended by a `stream_interrupted` event after content.
    Interrupted,
    /// An error status and its `error.code`.
    Error(u16, String),
}

#[derive(Default)]
struct Tally {
    requests: usize,
    by_task: BTreeMap<(&'static str, bool), BTreeMap<End, usize>>,
    /// `chaos-safe`, `chaos-risky`.
    latencies: [Histogram; 2],
    violations: Vec<String>,
    violation_count: usize,
    kill_affected: usize,
    served_by: BTreeMap<String, usize>,
}

impl Tally {
    fn violation(&mut self, v: String) {
        self.violation_count += 1;
        if self.violations.len() < 25 {
            self.violations.push(v);
        }
    }
}

/// When `chaos-a` was down (killed .. restarted).
#[derive(Default, Clone, Copy)]
struct KillWindow {
    from: Option<Instant>,
    to: Option<Instant>,
}

impl KillWindow {
    /// Did a request sent at `sent` and finished at `done` overlap the outage?
    fn overlaps(&self, sent: Instant, done: Instant) -> bool {
        let Some(from) = self.from else { return false };
        let to = self.to.unwrap_or(done);
        sent <= to + Duration::from_millis(100) && done + Duration::from_millis(10) >= from
    }
}

struct Shared {
    upstreams: Mutex<[Option<Upstream>; 3]>,
    /// Stats of `chaos-a` before it was killed.
    killed_stats: Mutex<fu::Stats>,
    kill: Mutex<KillWindow>,
    tally: Mutex<Tally>,
    chunks: usize,
    stop: AtomicBool,
    seq: AtomicUsize,
}

/// The outcome of a chaos run.
pub struct Report {
    /// The summary table (markdown).
    pub table: String,
    /// Violated expectations (first 25) and their count.
    pub violations: Vec<String>,
    /// All violations.
    pub violation_count: usize,
    /// Requests sent in the measured phase.
    pub requests: usize,
    /// Descriptors at the start and end.
    pub fds: (usize, usize),
    /// RSS at the start and end, KiB.
    pub rss_kib: (u64, u64),
}

impl Report {
    /// Every failed expectation, resources included.
    #[must_use]
    pub fn problems(&self) -> Vec<String> {
        let mut p = self.violations.clone();
        if self.violation_count > self.violations.len() {
            p.push(format!("... {} violations in all", self.violation_count));
        }
        let (f0, f1) = self.fds;
        if f1 * 10 > f0 * 11 {
            p.push(format!("open descriptors grew by over 10 %: {f0} -> {f1}"));
        }
        let (r0, r1) = self.rss_kib;
        if r1 * 10 > r0 * 11 {
            p.push(format!("RSS grew by over 10 %: {r0} KiB -> {r1} KiB"));
        }
        if self.requests == 0 {
            p.push("no requests were sent".to_owned());
        }
        p
    }
}

/// Runs the chaos scenario in the current (multi-threaded) runtime.
///
/// # Panics
/// If the gateway or a fake cannot start.
pub async fn run(p: Params) -> Report {
    let mix = fault_mix();
    let any: SocketAddr = "127.0.0.1:0".parse().expect("literal");
    let [a, b, c] = start_upstreams(&p, &mix, any).await;
    let urls = [a.url(), b.url(), c.url()];
    let a_addr = a.addr;

    let dir = tempfile::tempdir().expect("temp dir");
    let config_path: PathBuf = dir.path().join("routes.yaml");
    std::fs::write(&config_path, config(&urls, 0)).expect("write config");
    let gw = RunningGateway::start(&config_path, any).await;

    let shared = Arc::new(Shared {
        upstreams: Mutex::new([Some(a), Some(b), Some(c)]),
        killed_stats: Mutex::new(fu::Stats::default()),
        kill: Mutex::new(KillWindow::default()),
        tally: Mutex::new(Tally::default()),
        chunks: p.chunks,
        stop: AtomicBool::new(false),
        seq: AtomicUsize::new(0),
    });

    // Reloads for the whole run, warm-up included.
    let reloader = Reloader::spawn(config_path.clone(), urls.clone(), p.reload_every);
    let scraper = p
        .scrape_every
        .map(|every| spawn_scraper(Arc::clone(&gw.app), every));

    // Warm-up, then the start measurements with every connection closed.
    clients_phase(&shared, gw.addr, &p, p.warmup, usize::MAX / 2).await;
    let warm_tally = std::mem::take(&mut *shared.tally.lock());
    let (fds0, rss0) = quiesce(&shared).await;
    let metrics0 = gw.app.metrics().render();

    // The measured phase, with the kill.
    let started = Instant::now();
    let restarted_a = behaviour(&p, &mix, "a", p.fault_rate, p.seed.wrapping_add(1));
    let killer = spawn_killer(Arc::clone(&shared), &p, a_addr, restarted_a, started);
    clients_phase(&shared, gw.addr, &p, p.duration, 0).await;
    let (killed_at, restarted_at) = killer.await.expect("killer");
    let elapsed = started.elapsed();
    let reload_writes = reloader.stop().await;
    let (fds1, rss1) = quiesce(&shared).await;

    let metrics = gw.app.metrics().render();
    let stats = upstream_stats(&shared);
    if let Some(s) = scraper {
        s.abort();
    }
    gw.stop().await;

    let tally = std::mem::take(&mut *shared.tally.lock());
    let table = summary(
        &p,
        &tally,
        &warm_tally,
        (&metrics0, &metrics),
        &stats,
        Summary {
            elapsed,
            killed_at,
            restarted_at,
            reload_writes,
            fds: (fds0, fds1),
            rss: (rss0, rss1),
        },
    );
    let mut violations = warm_tally.violations.clone();
    violations.extend(tally.violations.iter().cloned());
    Report {
        table,
        violations,
        violation_count: tally.violation_count + warm_tally.violation_count,
        requests: tally.requests,
        fds: (fds0, fds1),
        rss_kib: (rss0, rss1),
    }
}

/// The fake's whole default mix, but a 429 (which cools the target down for
/// its Retry-After of 1 s) a third as often as the other faults, so that the
/// faulty targets are not cooling down most of the time.
fn fault_mix() -> Vec<fu::Fault> {
    let all = fu::parse_mix(fu::DEFAULT_MIX).expect("default mix");
    let (rate_limits, others): (Vec<_>, Vec<_>) =
        all.into_iter().partition(|f| f.status == Some(429));
    let mut mix: Vec<_> = others
        .iter()
        .chain(&others)
        .chain(&others)
        .cloned()
        .collect();
    mix.extend(rate_limits);
    mix
}

/// How the upstream `chaos-{name}` behaves: faults at `rate` from `mix`.
fn behaviour(p: &Params, mix: &[fu::Fault], name: &str, rate: f64, seed: u64) -> Behaviour {
    Behaviour {
        mix: mix.to_vec(),
        model: format!("model-{name}"),
        chunks: p.chunks,
        chunk_delay: p.chunk_delay,
        fault_rate: rate,
        seed,
        journal: true,
        ..Behaviour::default()
    }
}

/// `chaos-a` and `chaos-b` (faulty) and `chaos-c` (never faults), on `any` port.
async fn start_upstreams(p: &Params, mix: &[fu::Fault], any: SocketAddr) -> [Upstream; 3] {
    let a = Upstream::start(any, behaviour(p, mix, "a", p.fault_rate, p.seed))
        .await
        .expect("start a");
    let b = Upstream::start(any, behaviour(p, mix, "b", p.fault_rate, p.seed ^ 0xb))
        .await
        .expect("start b");
    let c = Upstream::start(any, behaviour(p, mix, "c", 0.0, 0))
        .await
        .expect("start c");
    [a, b, c]
}

/// The gateway under test, serving in a task of its own.
struct RunningGateway {
    addr: SocketAddr,
    app: Arc<switchyard::state::App>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), switchyard::server::StartError>>,
}

impl RunningGateway {
    async fn start(config_path: &Path, listen: SocketAddr) -> Self {
        let gw = Gateway::bind(config_path, Some(listen), CompileOptions::default())
            .await
            .unwrap_or_else(|e| panic!("gateway did not start:\n{e}"));
        let addr = gw.local_addr().expect("gateway address");
        let app = gw.app();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(gw.run(async {
            let _ = stopped.await;
        }));
        RunningGateway {
            addr,
            app,
            stop,
            task,
        }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        let _ = self.task.await;
    }
}

/// Rewrites routes.yaml every `every`, alternating the two variants.
struct Reloader {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<usize>,
}

impl Reloader {
    fn spawn(path: PathBuf, urls: [String; 3], every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let task = tokio::spawn(async move {
            let mut n = 0usize;
            while !stopped.load(Ordering::Relaxed) {
                tokio::time::sleep(every).await;
                n += 1;
                let tmp = path.with_extension("yaml.tmp");
                std::fs::write(&tmp, config(&urls, n % 2)).expect("write config");
                std::fs::rename(&tmp, &path).expect("rename config");
            }
            n
        });
        Reloader { stop, task }
    }

    /// Stops after the current interval; returns how many rewrites there were.
    async fn stop(self) -> usize {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("reloader")
    }
}

/// Renders the metrics every `every`, as a Prometheus scrape would.
fn spawn_scraper(app: Arc<switchyard::state::App>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(every).await;
            let _ = app.metrics().render();
        }
    })
}

/// Kills `chaos-a` `kill_at` into the measured phase (which began at
/// `started`) and restarts it on its port `down_for` later, as `restarted`;
/// the task returns when it was killed and restarted, from `started`.
fn spawn_killer(
    shared: Arc<Shared>,
    p: &Params,
    a_addr: SocketAddr,
    restarted: Behaviour,
    started: Instant,
) -> tokio::task::JoinHandle<(Duration, Duration)> {
    let kill_after = p.duration.mul_f64(p.kill_at.clamp(0.0, 1.0));
    let down_for = p.down_for;
    tokio::spawn(async move {
        tokio::time::sleep(kill_after).await;
        let victim = shared.upstreams.lock()[0].take();
        shared.kill.lock().from = Some(Instant::now());
        if let Some(v) = victim {
            *shared.killed_stats.lock() = v.stats();
            v.kill().await;
        }
        let killed_at = started.elapsed();
        tokio::time::sleep(down_for).await;
        let up = restart(a_addr, restarted).await;
        shared.upstreams.lock()[0] = Some(up);
        shared.kill.lock().to = Some(Instant::now());
        (killed_at, started.elapsed())
    })
}

/// Starts an upstream on the port a killed one had, retrying while the port
/// is not yet free (up to 50 times, 20 ms apart).
async fn restart(addr: SocketAddr, b: Behaviour) -> Upstream {
    let mut tries = 0;
    loop {
        match Upstream::start(addr, b.clone()).await {
            Ok(up) => return up,
            Err(e) if tries < 50 => {
                tries += 1;
                let _ = e;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("cannot restart chaos-a on {addr}: {e}"),
        }
    }
}

/// Each upstream's stats, `chaos-a`'s before the kill included.
fn upstream_stats(shared: &Shared) -> Vec<fu::Stats> {
    let mut stats: Vec<fu::Stats> = shared
        .upstreams
        .lock()
        .iter()
        .map(|u| u.as_ref().map(Upstream::stats).unwrap_or_default())
        .collect();
    let before = shared.killed_stats.lock();
    stats[0].requests += before.requests;
    for (n, b) in stats[0].by_kind.iter_mut().zip(before.by_kind) {
        *n += b;
    }
    stats
}

/// Closes every connection (the fakes drop theirs; the clients are gone), lets
/// the gateway notice, then reads descriptors and RSS. Five times, keeping the
/// fewest descriptors: the gateway's prober and half-open trials may open a
/// connection at any moment, a leak stays in every sample.
async fn quiesce(shared: &Shared) -> (usize, u64) {
    let mut fds = usize::MAX;
    for _ in 0..5 {
        for u in shared.upstreams.lock().iter().flatten() {
            u.drop_connections();
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        fds = fds.min(open_fds());
    }
    (fds, rss_kib())
}

/// `clients` tasks sending requests for `length`.
async fn clients_phase(
    shared: &Arc<Shared>,
    gw: SocketAddr,
    p: &Params,
    length: Duration,
    id_base: usize,
) {
    shared.stop.store(false, Ordering::Relaxed);
    let until = Instant::now() + length;
    let mut tasks = Vec::new();
    for client in 0..p.clients {
        let shared = Arc::clone(shared);
        let p = p.clone();
        tasks.push(tokio::spawn(async move {
            let http: Client<HttpConnector, Full<Bytes>> =
                Client::builder(TokioExecutor::new()).build_http();
            let mut i = 0u64;
            while Instant::now() < until {
                let h = fu::splitmix(p.seed ^ ((client as u64) << 40) ^ i ^ (id_base as u64));
                i += 1;
                let risky = fu::unit(h) < p.risky_share;
                let stream = fu::unit(fu::splitmix(h)) < p.stream_share;
                let n = id_base + shared.seq.fetch_add(1, Ordering::Relaxed);
                one_request(&shared, &http, gw, risky, stream, n).await;
            }
        }));
    }
    for t in tasks {
        t.await.expect("client task");
    }
}

/// What a request's attempts met, by upstream (a, b, c).
type Journal = [Vec<Served>; 3];

async fn one_request(
    shared: &Shared,
    http: &Client<HttpConnector, Full<Bytes>>,
    gw: SocketAddr,
    risky: bool,
    stream: bool,
    n: usize,
) {
    let task: &'static str = if risky { "chaos-risky" } else { "chaos-safe" };
    let total = if risky { RISKY_TOTAL } else { SAFE_TOTAL };
    let id = format!("chaos-{n}");
    let body = format!(
        r#"{{"model":"{task}","stream":{stream},"messages":[{{"role":"user","content":"chaos {n}"}}]}}"#
    );
    let req = Request::post(format!("http://{gw}/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-request-id", &id)
        .body(Full::new(Bytes::from(body)))
        .expect("request");
    let sent = Instant::now();
    let answer = tokio::time::timeout(total + Duration::from_secs(5), async {
        let resp = http.request(req).await.map_err(|e| e.to_string())?;
        let (parts, body) = resp.into_parts();
        let bytes = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok::<_, String>((parts.status.as_u16(), parts.headers, bytes))
    })
    .await;
    let done = Instant::now();
    let elapsed = done - sent;
    let journal: Journal = {
        let ups = shared.upstreams.lock();
        std::array::from_fn(|i| {
            ups[i]
                .as_ref()
                .map(|u| u.journal_take(&id))
                .unwrap_or_default()
        })
    };
    let killed = shared.kill.lock().overlaps(sent, done);

    let mut tally = shared.tally.lock();
    tally.requests += 1;
    tally.latencies[usize::from(risky)].record(elapsed);
    if killed {
        tally.kill_affected += 1;
    }
    let what = format!(
        "{id} ({task}, {}, {elapsed:?})",
        if stream { "stream" } else { "plain" }
    );
    let (status, headers, bytes) = match answer {
        Err(_) => {
            tally.violation(format!("{what}: no answer within total_timeout + 5 s"));
            return;
        }
        Ok(Err(e)) => {
            tally.violation(format!("{what}: transport error {e}"));
            return;
        }
        Ok(Ok(a)) => a,
    };
    if elapsed > total + LATE_SLACK {
        tally.violation(format!(
            "{what}: took {elapsed:?}, over total_timeout {total:?} + {LATE_SLACK:?}"
        ));
    }
    let check = Check {
        stream,
        risky,
        total,
        elapsed,
        killed,
        chunks: shared.chunks,
        journal: &journal,
    };
    match check.answer(status, &headers, &bytes) {
        Ok(end) => {
            let target = header(&headers, "x-switchyard-target");
            if !target.is_empty() {
                *tally.served_by.entry(target).or_default() += 1;
            }
            *tally
                .by_task
                .entry((task, stream))
                .or_default()
                .entry(end)
                .or_default() += 1;
        }
        Err(v) => {
            let text = String::from_utf8_lossy(&bytes);
            let text: String = text.chars().take(400).collect();
            tally.violation(format!(
                "{what}: {v}; status {status}, attempts {}, target {:?}, journal {}, body {text:?}",
                header(&headers, "x-switchyard-attempts"),
                header(&headers, "x-switchyard-target"),
                journal_text(&journal),
            ));
        }
    }
}

fn header(h: &HeaderMap, name: &str) -> String {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

fn journal_text(j: &Journal) -> String {
    let mut out = String::new();
    for (i, entries) in j.iter().enumerate() {
        if entries.is_empty() {
            continue;
        }
        let list: Vec<String> = entries
            .iter()
            .map(|s| match s.status {
                Some(st) => format!("{}={st}", KINDS[s.kind]),
                None => KINDS[s.kind].to_owned(),
            })
            .collect();
        let _ = write!(out, "{}:[{}] ", &TARGETS[i][6..], list.join(","));
    }
    out.trim_end().to_owned()
}

struct Check<'a> {
    stream: bool,
    risky: bool,
    total: Duration,
    elapsed: Duration,
    killed: bool,
    chunks: usize,
    journal: &'a Journal,
}

impl Check<'_> {
    /// Classifies an answer, or says which expectation it broke.
    fn answer(&self, status: u16, headers: &HeaderMap, body: &[u8]) -> Result<End, String> {
        let attempts: Option<usize> = header(headers, "x-switchyard-attempts").parse().ok();
        self.attempts_seen(attempts)?;
        if status == 200 {
            return self.success(headers, body);
        }
        self.failure(status, &header(headers, "content-type"), body, attempts)
    }

    /// Whether an attempt at upstream `i` met no fault.
    fn clean(&self, i: usize) -> bool {
        self.journal[i].iter().any(|s| s.kind == 0)
    }

    /// Whether the request ended at its deadline.
    fn at_deadline(&self) -> bool {
        self.elapsed + Duration::from_millis(30) >= self.total
    }

    /// `x-switchyard-attempts` is what the upstreams saw (unless the kill
    /// took some of them away).
    fn attempts_seen(&self, attempts: Option<usize>) -> Result<(), String> {
        let seen: usize = self.journal.iter().map(Vec::len).sum();
        match attempts {
            Some(a) if !self.killed && a != seen => Err(format!(
                "x-switchyard-attempts {a} but the upstreams saw {seen} attempts"
            )),
            Some(_) | None => Ok(()),
        }
    }

    /// A 200: the serving upstream's whole answer (a stream may be cut after
    /// its commit point by an upstream that cut it), never from an upstream
    /// whose every attempt had a fault.
    fn success(&self, headers: &HeaderMap, body: &[u8]) -> Result<End, String> {
        let content_type = header(headers, "content-type");
        let target = header(headers, "x-switchyard-target");
        let Some(t) = TARGETS.iter().position(|t| *t == target) else {
            return Err(format!("200 from unknown target {target:?}"));
        };
        let model = format!("model-{}", &target[6..]);
        let end = if self.stream {
            self.stream_success(t, &content_type, body, &model)?
        } else {
            self.plain_success(&content_type, body, &model)?
        };
        if end == End::Ok && !self.killed && !self.clean(t) {
            return Err(format!(
                "complete 200 from {target}, whose attempts all had a fault"
            ));
        }
        Ok(end)
    }

    /// A 200 stream from upstream `t`: complete, or interrupted after content.
    fn stream_success(
        &self,
        t: usize,
        content_type: &str,
        body: &[u8],
        model: &str,
    ) -> Result<End, String> {
        if !content_type.starts_with("text/event-stream") {
            return Err(format!(
                "stream answered with content-type {content_type:?}"
            ));
        }
        let text = std::str::from_utf8(body).map_err(|_| "stream is not UTF-8")?;
        if parse_stream(text, self.chunks, model)? {
            return Ok(End::Ok);
        }
        // Cut after the commit point: only an upstream that cut its
        // stream (or died) may cause that, never healthy `chaos-c`.
        let cut = self.journal[t].iter().any(|s| KINDS[s.kind] == "cut-after");
        if t == 2 || !(cut || self.killed || self.at_deadline()) {
            return Err(format!(
                "stream from {} interrupted, but it did not cut it",
                TARGETS[t]
            ));
        }
        Ok(End::Interrupted)
    }

    /// A 200 completion: the upstream's whole text.
    fn plain_success(&self, content_type: &str, body: &[u8], model: &str) -> Result<End, String> {
        if !content_type.starts_with("application/json") {
            return Err(format!("answer with content-type {content_type:?}"));
        }
        let v: Value = serde_json::from_slice(body).map_err(|_| "200 body is not JSON")?;
        let content = v["choices"][0]["message"]["content"].as_str().unwrap_or("");
        let expected: String = (0..self.chunks).map(|i| format!("[seq {i}] ")).collect();
        if content != expected || v["model"] != model {
            return Err("200 body is not the upstream's whole answer".to_owned());
        }
        Ok(End::Ok)
    }

    /// An error: OpenAI format, a status that fits its cause.
    fn failure(
        &self,
        status: u16,
        content_type: &str,
        body: &[u8],
        attempts: Option<usize>,
    ) -> Result<End, String> {
        if !self.risky {
            return Err(format!(
                "chaos-safe request failed ({status}) though chaos-c is always healthy"
            ));
        }
        let any_clean = (0..3).any(|i| self.clean(i));
        if any_clean && !self.killed && !self.at_deadline() {
            return Err("failed though one of its attempts met no fault".to_owned());
        }
        if !content_type.starts_with("application/json") {
            return Err(format!("error with content-type {content_type:?}"));
        }
        let (code, message) = openai_error(body)?;
        let expected_status = match code.as_str() {
            "all_targets_failed" => 502,
            // Every target held back by rate limits (429 cooldowns): the wait is the caller's.
            "rate_limit_exceeded" => 429,
            "no_target_available" => 503,
            "deadline_exceeded" => 504,
            other => return Err(format!("unexpected error code {other:?}")),
        };
        if status != expected_status {
            return Err(format!("code {code} with status {status}"));
        }
        match status {
            502 => self.all_targets_failed(attempts, &message)?,
            429 if attempts.is_some_and(|a| a > 0) && !self.statuses_met().contains(&429) => {
                return Err("429 rate_limit_exceeded after attempts that met no 429".to_owned());
            }
            504 if self.elapsed + Duration::from_millis(5) < self.total => {
                return Err(format!(
                    "504 deadline_exceeded after {:?}, before total_timeout",
                    self.elapsed
                ));
            }
            _ => {}
        }
        Ok(End::Error(status, code))
    }

    /// A 502 `all_targets_failed`: only after a target was tried, before the
    /// deadline, naming a status an attempt really got.
    fn all_targets_failed(&self, attempts: Option<usize>, message: &str) -> Result<(), String> {
        if attempts == Some(0) {
            return Err(
                "502 all_targets_failed, but no target was tried (expected 503 no_target_available)"
                    .to_owned(),
            );
        }
        if self.elapsed >= self.total {
            return Err("502 past the deadline (expected 504)".to_owned());
        }
        let statuses = self.statuses_met();
        let named: Option<u16> = message
            .split("last upstream status ")
            .nth(1)
            .and_then(|r| r.get(..3))
            .and_then(|d| d.parse().ok());
        match named {
            Some(s) if !statuses.contains(&s) && !self.killed => {
                Err(format!("502 names status {s}, which no attempt got"))
            }
            None if !statuses.is_empty() => Err("502 does not name the upstream status".to_owned()),
            _ => Ok(()),
        }
    }

    /// The statuses the attempts got. An in-band error (a 200 whose body is
    /// `{"error": {"code": 503}}`) is named as 200 (plain) or as its code
    /// (stream).
    fn statuses_met(&self) -> Vec<u16> {
        let statuses: Vec<u16> = self
            .journal
            .iter()
            .flatten()
            .filter_map(|s| match KINDS[s.kind] {
                "status" => s.status,
                _ => None,
            })
            .collect();
        let in_band = self
            .journal
            .iter()
            .flatten()
            .any(|s| KINDS[s.kind] == "error-200");
        if in_band {
            statuses.into_iter().chain([200, 503]).collect()
        } else {
            statuses
        }
    }
}

/// `(code, message)` of an OpenAI-format error body.
fn openai_error(body: &[u8]) -> Result<(String, String), String> {
    let v: Value = serde_json::from_slice(body).map_err(|_| "error body is not JSON")?;
    error_object(&v["error"])
}

fn error_object(e: &Value) -> Result<(String, String), String> {
    if !e.is_object() {
        return Err("no `error` object".to_owned());
    }
    let message = e["message"]
        .as_str()
        .filter(|m| !m.is_empty())
        .ok_or("error without a message")?;
    if !e["type"].is_string() {
        return Err("error without a type".to_owned());
    }
    let code = match &e["code"] {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Null | Value::Bool(_) | Value::Array(_) | Value::Object(_) => {
            return Err("error without a code".to_owned())
        }
    };
    Ok((code, message.to_owned()))
}

/// Checks one SSE answer: `Ok(true)` complete, `Ok(false)` interrupted after
/// content by a well-formed `stream_interrupted` event.
fn parse_stream(body: &str, chunks: usize, model: &str) -> Result<bool, String> {
    let mut seqs: Vec<usize> = Vec::new();
    let (mut finished, mut done, mut interrupted) = (false, false, false);
    for event in body.split("\n\n").filter(|e| !e.is_empty()) {
        if done {
            return Err("data after [DONE]".to_owned());
        }
        let data = event
            .strip_prefix("data: ")
            .ok_or_else(|| format!("event without `data: `: {event:?}"))?;
        if data == "[DONE]" {
            done = true;
            continue;
        }
        if interrupted {
            return Err("event after the interruption".to_owned());
        }
        let v: Value =
            serde_json::from_str(data).map_err(|_| format!("event is not JSON: {data:?}"))?;
        if v.get("error").is_some() {
            let (code, _) = error_object(&v["error"])?;
            if code != "stream_interrupted" {
                return Err(format!("in-stream error {code:?} in a 200 stream"));
            }
            interrupted = true;
            continue;
        }
        if v["model"] != model {
            return Err(format!(
                "chunk of model {} in a stream of {model}",
                v["model"]
            ));
        }
        let choice = &v["choices"][0];
        if let Some(text) = choice["delta"]["content"].as_str() {
            let mut rest = text;
            while let Some(i) = rest.find("[seq ") {
                let tail = &rest[i + 5..];
                let end = tail.find(']').ok_or("unterminated sequence marker")?;
                seqs.push(tail[..end].parse().map_err(|_| "bad sequence marker")?);
                rest = &tail[end..];
            }
        }
        if choice["finish_reason"].is_string() {
            finished = true;
        }
    }
    if !done {
        return Err("stream without [DONE]".to_owned());
    }
    if seqs.iter().enumerate().any(|(i, s)| *s != i) {
        return Err(format!("text repeated or out of order: {seqs:?}"));
    }
    if interrupted {
        if seqs.is_empty() {
            return Err("interrupted before any content (should have failed over)".to_owned());
        }
        return Ok(false);
    }
    if !finished || seqs.len() != chunks {
        return Err(format!(
            "stream ended without an error event after {} of {chunks} chunks",
            seqs.len()
        ));
    }
    Ok(true)
}

struct Summary {
    elapsed: Duration,
    killed_at: Duration,
    restarted_at: Duration,
    reload_writes: usize,
    fds: (usize, usize),
    rss: (u64, u64),
}

/// Samples of a counter: label set -> value, for lines of `name{...} value`.
fn samples(metrics: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    metrics
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let (labels, value) = if let Some(r) = rest.strip_prefix('{') {
                let (labels, value) = r.split_once("} ")?;
                (labels, value)
            } else {
                ("", rest.strip_prefix(' ')?)
            };
            let map = labels
                .split(',')
                .filter_map(|kv| {
                    let (k, v) = kv.split_once('=')?;
                    Some((k.to_owned(), v.trim_matches('"').to_owned()))
                })
                .collect();
            Some((map, value.trim().parse().ok()?))
        })
        .collect()
}

/// `samples` of `after` less those of `before` (counters since `before`).
fn delta(before: &str, after: &str, name: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    let before = samples(before, name);
    samples(after, name)
        .into_iter()
        .map(|(l, v)| {
            let base = before
                .iter()
                .find(|(b, _)| *b == l)
                .map_or(0.0, |(_, v)| *v);
            (l, v - base)
        })
        .filter(|(_, v)| *v != 0.0)
        .collect()
}

/// Latencies in 100 µs buckets up to 10 s, allocated once: the run's own
/// bookkeeping must not grow with the number of requests (RSS is checked).
struct Histogram {
    buckets: Vec<u32>,
    count: u64,
    max: Duration,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            buckets: vec![0; 100_000],
            count: 0,
            max: Duration::ZERO,
        }
    }
}

impl Histogram {
    fn record(&mut self, d: Duration) {
        let i = usize::try_from(d.as_micros() / 100).unwrap_or(usize::MAX);
        let last = self.buckets.len() - 1;
        self.buckets[i.min(last)] += 1;
        self.count += 1;
        self.max = self.max.max(d);
    }

    /// The `q` quantile (upper edge of its bucket).
    fn pct(&self, q: f64) -> Duration {
        if self.count == 0 {
            return Duration::ZERO;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((self.count - 1) as f64 * q).round() as u64 + 1;
        let mut seen = 0u64;
        for (i, n) in self.buckets.iter().enumerate() {
            seen += u64::from(*n);
            if seen >= rank {
                return Duration::from_micros(100 * (i as u64 + 1)).min(self.max);
            }
        }
        self.max
    }
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

#[allow(clippy::too_many_lines)]
fn summary(
    p: &Params,
    t: &Tally,
    warm: &Tally,
    (metrics0, metrics): (&str, &str),
    stats: &[fu::Stats],
    s: Summary,
) -> String {
    let mut o = String::new();
    let _ = writeln!(
        o,
        "chaos run: {} clients, {:?} (after a {:?} warm-up of {} requests), fault rate {} on chaos-a and chaos-b, seed {}, reload every {:?}, chaos-a killed at {:.1} s and restarted at {:.1} s",
        p.clients, s.elapsed, p.warmup, warm.requests, p.fault_rate, p.seed, p.reload_every,
        s.killed_at.as_secs_f64(), s.restarted_at.as_secs_f64()
    );
    let _ = writeln!(o);
    let _ = writeln!(o, "| task | kind | requests | ok | interrupted after commit (upstream cut) | errors | success |");
    let _ = writeln!(o, "|---|---|---:|---:|---:|---|---:|");
    for ((task, stream), ends) in &t.by_task {
        let total: usize = ends.values().sum();
        let ok = ends.get(&End::Ok).copied().unwrap_or(0);
        let cut = ends.get(&End::Interrupted).copied().unwrap_or(0);
        let errors: Vec<String> = ends
            .iter()
            .filter_map(|(e, n)| match e {
                End::Error(s, c) => Some(format!("{s} {c}: {n}")),
                End::Ok | End::Interrupted => None,
            })
            .collect();
        #[allow(clippy::cast_precision_loss)]
        let rate = 100.0 * (ok + cut) as f64 / total.max(1) as f64;
        let _ = writeln!(
            o,
            "| {task} | {} | {total} | {ok} | {cut} | {} | {rate:.2} % |",
            if *stream { "stream" } else { "plain" },
            if errors.is_empty() {
                "-".to_owned()
            } else {
                errors.join(", ")
            },
        );
    }
    let _ = writeln!(
        o,
        "\nrequests {} (kill window overlapped {}), violations {}; served by {:?}",
        t.requests, t.kill_affected, t.violation_count, t.served_by
    );
    for (task, h) in ["chaos-safe", "chaos-risky"].iter().zip(&t.latencies) {
        let _ = writeln!(
            o,
            "latency {task}: p50 {} ms, p99 {} ms, max {} ms",
            ms(h.pct(0.5)),
            ms(h.pct(0.99)),
            ms(h.max)
        );
    }

    let mut reasons: BTreeMap<String, f64> = BTreeMap::new();
    for (l, v) in delta(metrics0, metrics, "switchyard_failovers_total") {
        *reasons
            .entry(l.get("reason").cloned().unwrap_or_default())
            .or_default() += v;
    }
    let _ = writeln!(o, "\n| failovers by reason | count |\n|---|---:|");
    for (r, v) in &reasons {
        let _ = writeln!(o, "| {r} | {v} |");
    }
    let mut transitions: BTreeMap<String, f64> = BTreeMap::new();
    for (l, v) in delta(metrics0, metrics, "switchyard_breaker_transitions_total") {
        let key = format!(
            "{} {}→{}",
            l.get("target").map_or("", String::as_str),
            l.get("from").map_or("", String::as_str),
            l.get("to").map_or("", String::as_str)
        );
        *transitions.entry(key).or_default() += v;
    }
    let _ = writeln!(o, "\n| health transitions | count |\n|---|---:|");
    for (k, v) in &transitions {
        let _ = writeln!(o, "| {k} | {v} |");
    }
    let mut other: BTreeMap<String, f64> = BTreeMap::new();
    for (name, key) in [
        ("switchyard_route_exclusions_total", "reason"),
        ("switchyard_stream_interrupts_total", "reason"),
        ("switchyard_probes_total", "result"),
    ] {
        for (l, v) in delta(metrics0, metrics, name) {
            let short = name
                .trim_start_matches("switchyard_")
                .trim_end_matches("_total");
            *other
                .entry(format!("{short} {}", l.get(key).map_or("", String::as_str)))
                .or_default() += v;
        }
    }
    for (l, v) in delta(metrics0, metrics, "switchyard_config_reloads_total") {
        *other
            .entry(format!(
                "config_reloads {}",
                l.get("result").map_or("", String::as_str)
            ))
            .or_default() += v;
    }
    let _ = writeln!(o, "\n| other gateway counters | count |\n|---|---:|");
    for (k, v) in &other {
        let _ = writeln!(o, "| {k} | {v} |");
    }
    let _ = writeln!(o, "(routes.yaml rewritten {} times)", s.reload_writes);
    let _ = writeln!(o, "\n| upstream | requests | {} |", KINDS.join(" | "));
    let _ = writeln!(o, "|---|---:|{}", "---:|".repeat(KINDS.len()));
    for (name, st) in TARGETS.iter().zip(stats) {
        let kinds: Vec<String> = st.by_kind.iter().map(u64::to_string).collect();
        let _ = writeln!(o, "| {name} | {} | {} |", st.requests, kinds.join(" | "));
    }
    let _ = writeln!(
        o,
        "\nopen descriptors {} -> {}, RSS {} KiB -> {} KiB (each with all connections closed)",
        s.fds.0, s.fds.1, s.rss.0, s.rss.1
    );
    o
}
