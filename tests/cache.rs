//! A task's cache through the gateway: exact hits and misses, what the
//! client's `Cache-Control` decides, sampling requests left alone, streams
//! cached and replayed, nothing kept from an error or a broken stream, the
//! stale answer when no target answers, other front doors, and two replicas
//! sharing entries through a real `redis-server` (and losing it).

use std::time::Duration;

use serde_json::{json, Value};

use crate::support::fake::{self, Fake};
use crate::support::*;

/// Task `chat` over the given hops, with `cache` (YAML flow map) and more
/// task keys.
fn cached(hops: &[Hop], cache: &str, more: &str) -> String {
    routes(hops, &format!("cache: {cache}\n{more}"), "")
}

fn ask(text: &str) -> Value {
    json!({"model": "gpt-4o", "temperature": 0,
           "messages": [{"role": "user", "content": text}]})
}

async fn send(gw: &Gw, body: &Value, headers: &[(&str, &str)]) -> Answer {
    post_raw(gw.addr, "/v1/chat/completions", body.to_string(), headers).await
}

/// An answer's status and what the cache said of it.
fn said(ans: &Answer) -> (u16, String) {
    (ans.status.as_u16(), ans.header("x-switchyard-cache"))
}

/// Every problem `validate` finds in `yaml`, as `path: message` lines.
fn refusals(yaml: &str) -> String {
    compile_errors(yaml)
        .into_iter()
        .map(|d| format!("{}: {}", d.path, d.message))
        .collect::<Vec<_>>()
        .join("\n")
}

async fn requests(gw: &Gw, result: &str) -> f64 {
    let series = format!("switchyard_cache_requests_total{{task=\"chat\",result=\"{result}\"}}");
    series_value(&metrics_page(gw).await, &series).unwrap_or(0.0)
}

#[tokio::test]
async fn the_same_request_is_answered_from_the_cache_with_a_fresh_id_and_no_upstream_call() {
    let a = Fake::always(fake::completion("model-a", "cached words")).await;
    let gw = gateway(&cached(&[hop("a", &a.url())], "{ ttl: 10m }", "")).await;
    let first = send(&gw, &ask("hi"), &[]).await;
    assert_eq!(first.status, 200, "{}", first.text());
    assert_eq!(first.header("x-switchyard-cache"), "miss");
    // Another spelling of the same request: key order, whitespace, stream
    // options and user do not change the answer.
    let same = r#"{ "messages": [{"content": "hi", "role": "user"}], "user": "u-7",
                    "temperature": 0, "model": "gpt-4o" }"#;
    let second = post_raw(gw.addr, "/v1/chat/completions", same, &[]).await;
    assert_eq!(second.status, 200);
    assert_eq!(second.header("x-switchyard-cache"), "hit");
    assert!(second.header("age").parse::<u64>().is_ok(), "an age header");
    assert_eq!(second.header("x-switchyard-attempts"), "0");
    assert_eq!(a.calls(), 1, "a hit makes no upstream call");
    let (one, two) = (first.json(), second.json());
    assert_eq!(one["choices"], two["choices"]);
    assert_ne!(one["id"], two["id"], "each hit gets its own id");
    // A different question is a miss.
    assert_eq!(
        send(&gw, &ask("hi!"), &[])
            .await
            .header("x-switchyard-cache"),
        "miss"
    );
    assert_eq!(a.calls(), 2);
    assert_eq!(requests(&gw, "hit").await, 1.0);
    assert_eq!(requests(&gw, "miss").await, 2.0);
    let page = metrics_page(&gw).await;
    assert!(series_value(&page, "switchyard_cache_entries{task=\"chat\"}").unwrap_or(0.0) >= 1.0);
    assert!(series_value(&page, "switchyard_cache_bytes{task=\"chat\"}").unwrap_or(0.0) > 0.0);
}

#[tokio::test]
async fn no_cache_skips_the_lookup_and_no_store_skips_the_write() {
    let a = Fake::always(fake::completion("model-a", "words")).await;
    let gw = gateway(&cached(&[hop("a", &a.url())], "{ ttl: 10m }", "")).await;
    let no_store = send(&gw, &ask("q"), &[("cache-control", "no-store")]).await;
    assert_eq!(no_store.header("x-switchyard-cache"), "miss");
    assert_eq!(
        send(&gw, &ask("q"), &[]).await.header("x-switchyard-cache"),
        "miss"
    );
    assert_eq!(a.calls(), 2, "no-store kept nothing");
    let no_cache = send(&gw, &ask("q"), &[("cache-control", "no-cache")]).await;
    assert_eq!(no_cache.header("x-switchyard-cache"), "bypass");
    assert_eq!(a.calls(), 3, "no-cache asked the target");
    assert_eq!(
        send(&gw, &ask("q"), &[]).await.header("x-switchyard-cache"),
        "hit"
    );
    assert_eq!(a.calls(), 3);
}

#[tokio::test]
async fn a_sampling_request_bypasses_the_cache_unless_the_task_caches_them() {
    let a = Fake::always(fake::completion("model-a", "words")).await;
    let sampling = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "q"}]});
    let gw = gateway(&cached(&[hop("a", &a.url())], "{ ttl: 10m }", "")).await;
    for _ in 0..2 {
        let ans = send(&gw, &sampling, &[]).await;
        assert_eq!(ans.header("x-switchyard-cache"), "bypass");
    }
    assert_eq!(a.calls(), 2, "temperature absent: the default samples");
    let seeded = json!({"model": "gpt-4o", "temperature": 0.8, "seed": 3,
                        "messages": [{"role": "user", "content": "q"}]});
    send(&gw, &seeded, &[]).await;
    assert_eq!(
        send(&gw, &seeded, &[]).await.header("x-switchyard-cache"),
        "hit"
    );
    let b = Fake::always(fake::completion("model-b", "words")).await;
    let gw = gateway(&cached(
        &[hop("b", &b.url())],
        "{ ttl: 10m }",
        "cache_nondeterministic: true",
    ))
    .await;
    send(&gw, &sampling, &[]).await;
    assert_eq!(
        send(&gw, &sampling, &[]).await.header("x-switchyard-cache"),
        "hit"
    );
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn a_streamed_answer_is_cached_when_it_completes_and_replayed_as_a_stream() {
    let a = Fake::always(fake::stream("model-a", &["Hello", " there"])).await;
    let gw = gateway(&cached(&[hop("a", &a.url())], "{ ttl: 10m }", "")).await;
    let mut body = ask("stream me");
    body["stream"] = json!(true);
    let first = send(&gw, &body, &[]).await;
    assert_eq!(first.header("x-switchyard-cache"), "miss");
    assert_eq!(sse_text(&first.text()), "Hello there");
    body["stream_options"] = json!({"include_usage": true});
    let replay = send(&gw, &body, &[]).await;
    assert_eq!(replay.header("x-switchyard-cache"), "hit");
    assert!(replay
        .header("content-type")
        .starts_with("text/event-stream"));
    assert_eq!(sse_text(&replay.text()), "Hello there");
    let data = sse_data(&replay.text());
    assert_eq!(data.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let finishes = chunks
        .iter()
        .filter(|c| !c["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(finishes, 1, "one finish: {data:?}");
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk"));
    assert!(
        chunks.last().unwrap().get("usage").is_some(),
        "usage asked for: {data:?}"
    );
    // The same question unstreamed is the same answer, whole.
    body["stream"] = json!(false);
    body.as_object_mut().unwrap().remove("stream_options");
    let whole = send(&gw, &body, &[]).await;
    assert_eq!(whole.header("x-switchyard-cache"), "hit");
    assert_eq!(
        whole.json()["choices"][0]["message"]["content"],
        "Hello there"
    );
    assert_eq!(a.calls(), 1);
}

#[tokio::test]
async fn nothing_is_kept_from_an_error_or_an_interrupted_stream() {
    let a = Fake::always(fake::stream_cut_after(
        "model-a",
        &["one", "two", "three"],
        1,
    ))
    .await;
    let gw = gateway(&cached(&[hop("a", &a.url())], "{ ttl: 10m }", "")).await;
    let mut body = ask("cut");
    body["stream"] = json!(true);
    let cut = send(&gw, &body, &[]).await;
    assert_eq!(cut.status, 200, "committed before the cut");
    a.set(|_, _| fake::stream("model-a", &["whole"]));
    let next = send(&gw, &body, &[]).await;
    assert_eq!(
        next.header("x-switchyard-cache"),
        "miss",
        "the cut stream was not kept"
    );
    assert_eq!(sse_text(&next.text()), "whole");

    let b = Fake::always(fake::error(500, "boom")).await;
    let gw = gateway(&cached(&[hop("b", &b.url())], "{ ttl: 10m }", "")).await;
    assert_eq!(send(&gw, &ask("e"), &[]).await.status, 502);
    b.set(|_, _| fake::completion("model-b", "fine"));
    let after = send(&gw, &ask("e"), &[]).await;
    assert_eq!(said(&after), (200, "miss".to_owned()));
}

#[tokio::test]
async fn when_no_target_answers_a_stale_answer_is_served_but_never_for_the_callers_error() {
    let a = Fake::always(fake::completion("model-a", "yesterday's answer")).await;
    let yaml = cached(
        &[hop("a", &a.url())],
        "{ ttl: 100ms, stale_if_error: 1h }",
        "",
    );
    let gw = gateway(&yaml).await;
    assert_eq!(send(&gw, &ask("q"), &[]).await.status, 200);
    tokio::time::sleep(Duration::from_millis(150)).await;
    a.set(|_, _| fake::error(503, "down"));
    let stale = send(&gw, &ask("q"), &[]).await;
    assert_eq!(stale.status, 200, "{}", stale.text());
    assert_eq!(stale.header("x-switchyard-cache"), "stale");
    assert_eq!(
        stale.json()["choices"][0]["message"]["content"],
        "yesterday's answer"
    );
    assert_ne!(
        stale.header("x-switchyard-attempts"),
        "0",
        "the walk's calls were made"
    );
    assert_eq!(requests(&gw, "stale").await, 1.0);
    // Never asked before: nothing to fall back on.
    assert_eq!(send(&gw, &ask("new"), &[]).await.status, 502);
    // The caller's own error is the caller's.
    a.set(|_, _| fake::error(400, "bad request"));
    assert_eq!(send(&gw, &ask("q"), &[]).await.status, 400);
    // Without stale_if_error, an expired answer is not served.
    let b = Fake::always(fake::completion("model-b", "old")).await;
    let gw = gateway(&cached(&[hop("b", &b.url())], "{ ttl: 100ms }", "")).await;
    send(&gw, &ask("q"), &[]).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    b.set(|_, _| fake::error(503, "down"));
    assert_eq!(send(&gw, &ask("q"), &[]).await.status, 502);
}

#[tokio::test]
async fn a_messages_client_gets_its_hit_in_its_own_protocol() {
    let a = Fake::always(fake::completion("model-a", "bonjour")).await;
    let gw = gateway(&cached(&[hop("a", &a.url())], "{ ttl: 10m }", "")).await;
    let body = json!({"model": "gpt-4o", "max_tokens": 32, "temperature": 0,
                      "messages": [{"role": "user", "content": "hello"}]});
    let first = post_raw(gw.addr, "/v1/messages", body.to_string(), &[]).await;
    assert_eq!(first.header("x-switchyard-cache"), "miss");
    let hit = post_raw(gw.addr, "/v1/messages", body.to_string(), &[]).await;
    assert_eq!(hit.header("x-switchyard-cache"), "hit");
    let message = hit.json();
    assert_eq!(message["type"], "message", "{message}");
    assert_eq!(message["content"][0]["text"], "bonjour");
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let replay = post_raw(gw.addr, "/v1/messages", stream.to_string(), &[]).await;
    assert_eq!(replay.header("x-switchyard-cache"), "hit");
    let text = replay.text();
    assert!(
        text.contains("event: message_start") && text.contains("event: message_stop"),
        "{text}"
    );
    assert!(text.contains("bonjour"));
    // A beta header that goes upstream as sent may change the answer: another entry.
    let beta = post_raw(
        gw.addr,
        "/v1/messages",
        body.to_string(),
        &[("anthropic-beta", "x-2025")],
    )
    .await;
    assert_eq!(beta.header("x-switchyard-cache"), "miss");
    // A chat client asking the same thing is another protocol: its own entry.
    let chat = send(
        &gw,
        &json!({"model": "gpt-4o", "max_tokens": 32, "temperature": 0,
                                 "messages": [{"role": "user", "content": "hello"}]}),
        &[],
    )
    .await;
    assert_eq!(chat.header("x-switchyard-cache"), "miss");
    assert_eq!(a.calls(), 3);
}

/// Two replicas of `yaml` sharing `redis`, each connected.
async fn two_replicas(yaml: &str) -> (Gw, Gw) {
    let up = |gw: &Gw| series_value(&gw.app.metrics().render(), "switchyard_shared_state_up");
    let (one, two) = (gateway(yaml).await, gateway(yaml).await);
    for gw in [&one, &two] {
        let connected = eventually(Duration::from_secs(5), || async { up(gw) == Some(1.0) }).await;
        assert!(connected, "a replica did not connect to the store");
    }
    (one, two)
}

#[tokio::test]
async fn a_replica_serves_what_another_paid_for_and_a_lost_store_is_only_a_miss() {
    let mut redis = RedisServer::start();
    let a = Fake::always(fake::completion("model-a", "shared")).await;
    let top = format!(
        "shared_state:\n  redis: {{ url_file: '{}', key_prefix: cachetest, timeout: 250ms }}\n",
        redis.url_file().display()
    );
    let yaml = routes(&[hop("a", &a.url())], "cache: { ttl: 10m }", &top);
    let (one, two) = two_replicas(&yaml).await;
    assert_eq!(
        send(&one, &ask("q"), &[])
            .await
            .header("x-switchyard-cache"),
        "miss"
    );
    // The first write reaches the store behind the answer: until it lands,
    // the other replica misses and pays for its own call.
    let early_misses = std::sync::atomic::AtomicUsize::new(0);
    let shared = eventually(Duration::from_secs(5), || async {
        let hit = send(&two, &ask("q"), &[])
            .await
            .header("x-switchyard-cache")
            == "hit";
        if !hit {
            early_misses.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        hit
    })
    .await;
    assert!(
        shared,
        "the other replica never found the answer in the store"
    );
    let paid = 1 + early_misses.into_inner();
    assert_eq!(a.calls(), paid, "a hit called the upstream");
    // The store gone: misses, never a failed request.
    redis.kill();
    for i in 0..5 {
        let ans = send(&two, &ask(&format!("new {i}")), &[]).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-cache"), "miss");
    }
    assert_eq!(a.calls(), paid + 5);
}

#[test]
fn a_cache_that_cannot_work_is_refused_with_its_field() {
    let a = "http://127.0.0.1:9";
    let errors = |cache: &str, more: &str| refusals(&cached(&[hop("a", a)], cache, more));
    let e = errors("{ mode: fuzzy }", "");
    assert!(e.contains("tasks.chat.cache.mode"), "{e}");
    let e = errors("{ max_bytes: lots }", "");
    assert!(e.contains("tasks.chat.cache.max_bytes"), "{e}");
    let e = errors("{ ttl: 0s }", "");
    assert!(e.contains("tasks.chat.cache.ttl"), "{e}");
    let e = errors("{ max_bytes: 12 }", "");
    assert!(e.contains("at least 1KiB"), "{e}");
}

/// An embeddings upstream that knows three prompts: two that mean the same,
/// one that does not (3-dimensional vectors).
fn embedder() -> impl FnMut(usize, &fake::Seen) -> fake::Reply + Send + 'static {
    |_, seen| {
        let input = seen.body["input"].as_str().unwrap_or_default().to_owned();
        let vector = if input.contains("capital of France") {
            [1.0, 0.0, 0.0]
        } else if input.contains("France's capital") {
            [0.98, 0.2, 0.0]
        } else {
            [0.1, 0.99, 0.0]
        };
        fake::json(
            200,
            &json!({"object": "list", "model": "emb", "usage": {"prompt_tokens": 3, "total_tokens": 3},
                    "data": [{"object": "embedding", "index": 0, "embedding": vector}]})
            .to_string(),
        )
    }
}

/// Task `chat` = [a] with a semantic cache over task `embed` = [e].
fn semantic_config(a: &Fake, e: &Fake, semantic: &str) -> String {
    format!(
        "version: 1
providers:
  pa: {{ base_url: '{}', retry: {{ max: 0 }} }}
  pe: {{ base_url: '{}', retry: {{ max: 0 }} }}
targets:
  a: {{ provider: pa, model: ma }}
  e: {{ provider: pe, model: me, embedding: {{ model_family: fam, dimensions: 3 }} }}
tasks:
  chat:
    aliases: [gpt-4o]
    chain: [a]
    cache: {{ mode: semantic, ttl: 100ms, stale_if_error: 1h, semantic: {{ embeddings: embed, threshold: 0.95, {semantic} }} }}
  embed: {{ chain: [e] }}
",
        a.url(),
        e.url()
    )
}

#[tokio::test]
async fn a_prompt_that_means_the_same_is_a_semantic_hit_and_one_that_does_not_is_a_miss() {
    let a = Fake::always(fake::completion("model-a", "Paris")).await;
    let e = Fake::start(embedder()).await;
    let gw = gateway(&semantic_config(&a, &e, "max_messages: 2")).await;
    let first = send(&gw, &ask("What is the capital of France?"), &[]).await;
    assert_eq!(first.header("x-switchyard-cache"), "miss");
    assert_eq!((a.calls(), e.calls()), (1, 1), "the prompt was embedded");
    let close = send(&gw, &ask("Tell me France's capital"), &[]).await;
    assert_eq!(
        close.header("x-switchyard-cache"),
        "hit",
        "cos 0.98 is above 0.95"
    );
    let similarity: f64 = close
        .header("x-switchyard-cache-similarity")
        .parse()
        .unwrap();
    assert!(similarity > 0.95 && similarity < 1.0, "{similarity}");
    assert_eq!(close.json()["choices"][0]["message"]["content"], "Paris");
    assert_eq!(a.calls(), 1, "a semantic hit makes no chat call");
    let far = send(&gw, &ask("How tall is Everest?"), &[]).await;
    assert_eq!(far.header("x-switchyard-cache"), "miss", "cos 0.3 is below");
    assert_eq!(a.calls(), 2);
    // A conversation longer than max_messages is looked up exactly only.
    let long = json!({"model": "gpt-4o", "temperature": 0, "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "Tell me France's capital"}]});
    let embedded = e.calls();
    assert_eq!(
        send(&gw, &long, &[]).await.header("x-switchyard-cache"),
        "miss"
    );
    assert_eq!(e.calls(), embedded, "not embedded");
    // Every target down: the exact answer is served stale; a semantic match is not, by default.
    tokio::time::sleep(Duration::from_millis(150)).await;
    a.set(|_, _| fake::error(503, "down"));
    let stale = send(&gw, &ask("What is the capital of France?"), &[]).await;
    assert_eq!(said(&stale), (200, "stale".to_owned()));
    let close = send(&gw, &ask("Tell me France's capital"), &[]).await;
    assert_eq!(
        close.status, 502,
        "a semantic match is no stale answer unless the task says so"
    );
}

#[tokio::test]
async fn a_semantic_match_is_the_stale_answer_when_the_task_says_so_and_a_broken_embedder_only_costs_the_lookup(
) {
    let a = Fake::always(fake::completion("model-a", "Paris")).await;
    let e = Fake::start(embedder()).await;
    let gw = gateway(&semantic_config(&a, &e, "stale: true")).await;
    send(&gw, &ask("What is the capital of France?"), &[]).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    a.set(|_, _| fake::error(503, "down"));
    let close = send(&gw, &ask("Tell me France's capital"), &[]).await;
    assert_eq!(said(&close), (200, "stale".to_owned()));
    assert_eq!(close.json()["choices"][0]["message"]["content"], "Paris");
    // The embeddings task failing: the request goes on, looked up exactly.
    a.set(|_, _| fake::completion("model-a", "fine"));
    e.set(|_, _| fake::error(500, "embedder down"));
    let ans = send(&gw, &ask("Something new"), &[]).await;
    assert_eq!(said(&ans), (200, "miss".to_owned()));
}

#[test]
fn a_semantic_cache_needs_an_embeddings_task() {
    let a = "http://127.0.0.1:9";
    let base = |cache: &str| {
        format!(
            "version: 1
providers:
  pa: {{ base_url: '{a}' }}
targets:
  a: {{ provider: pa, model: ma }}
  e: {{ provider: pa, model: me, embedding: {{ model_family: fam, dimensions: 3 }} }}
tasks:
  chat: {{ chain: [a], cache: {cache} }}
  embed: {{ chain: [e] }}
"
        )
    };
    let errors = |cache: &str| refusals(&base(cache));
    let e = errors("{ mode: semantic }");
    assert!(
        e.contains("tasks.chat.cache.mode") && e.contains("needs `semantic"),
        "{e}"
    );
    let e = errors("{ mode: semantic, semantic: { embeddings: chat } }");
    assert!(
        e.contains("tasks.chat.cache.semantic.embeddings")
            && e.contains("does not serve embeddings"),
        "{e}"
    );
    let e = errors("{ mode: semantic, semantic: { embeddings: nope } }");
    assert!(e.contains("unknown task `nope`"), "{e}");
    let e = errors("{ mode: semantic, semantic: { embeddings: embed, threshold: 1.5 } }");
    assert!(e.contains("tasks.chat.cache.semantic.threshold"), "{e}");
    let e = errors("{ semantic: { embeddings: embed } }");
    assert!(e.contains("only with `mode: semantic`"), "{e}");
}

#[tokio::test]
async fn a_hit_still_passes_the_front_door_and_max_age_bounds_what_the_client_takes() {
    let a = Fake::always(fake::completion("model-a", "words")).await;
    let gw = gateway(&cached(
        &[hop("a", &a.url())],
        "{ ttl: 10m }",
        "rate_limit: { rps: 0.5, burst: 2 }",
    ))
    .await;
    assert_eq!(send(&gw, &ask("q"), &[]).await.status, 200);
    assert_eq!(
        send(&gw, &ask("q"), &[]).await.header("x-switchyard-cache"),
        "hit"
    );
    let limited = send(&gw, &ask("q"), &[]).await;
    assert_eq!(limited.status, 429, "the task's bucket holds for hits too");
    assert!(!limited.header("retry-after").is_empty());
    assert_eq!(a.calls(), 1);

    let b = Fake::always(fake::completion("model-b", "words")).await;
    let gw = gateway(&cached(&[hop("b", &b.url())], "{ ttl: 10m }", "")).await;
    send(&gw, &ask("q"), &[]).await;
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let young = send(&gw, &ask("q"), &[("cache-control", "max-age=1")]).await;
    assert_eq!(
        young.header("x-switchyard-cache"),
        "miss",
        "a 1 s old answer is too old"
    );
    let ok = send(&gw, &ask("q"), &[("cache-control", "max-age=60")]).await;
    assert_eq!(ok.header("x-switchyard-cache"), "hit");
    assert_eq!(b.calls(), 2);
}
