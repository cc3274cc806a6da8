//! `POST /v1/embeddings`: the same tasks, chains, health and metrics as chat,
//! failing over only within one embedding space (a chain mixing spaces is
//! refused), with answers held to their shape.

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

fn vectors(model: &str, n: usize) -> Reply {
    let data: Vec<serde_json::Value> = (0..n)
        .map(|i| serde_json::json!({"object": "embedding", "index": i, "embedding": [0.1, 0.2, 0.3, 0.4]}))
        .collect();
    fake::json(
        200,
        &serde_json::json!({"object": "list", "model": model, "data": data,
            "usage": {"prompt_tokens": 7, "total_tokens": 7}})
        .to_string(),
    )
}

/// Two embeddings targets of one space (`te3s`/4), on their own providers,
/// then `extra` more targets (YAML lines) and a chat task over `chat`.
fn config(a: &str, b: &str, extra_targets: &str, chain: &str) -> String {
    format!(
        "version: 1
providers:
  pa: {{ base_url: '{a}', retry: {{ max: 0 }} }}
  pb: {{ base_url: '{b}', retry: {{ max: 0 }} }}
targets:
  e1: {{ provider: pa, model: te3s-primary, embedding: {{ model_family: te3s, dimensions: 4 }} }}
  e2: {{ provider: pb, model: te3s-backup, embedding: {{ model_family: te3s, dimensions: 4 }} }}
  chat-a: {{ provider: pa, model: gpt }}
{extra_targets}
tasks:
  embed: {{ aliases: [text-embedding-3-small], chain: [{chain}] }}
  chat: {{ aliases: [gpt-4o], chain: [chat-a] }}
"
    )
}

fn embed(input: serde_json::Value) -> serde_json::Value {
    serde_json::json!({"model": "text-embedding-3-small", "input": input, "encoding_format": "float"})
}

async fn post_embeddings(gw: &Gw, body: serde_json::Value) -> Answer {
    post_raw(gw.addr, "/v1/embeddings", body.to_string(), &[]).await
}

#[tokio::test]
async fn embeddings_fail_over_within_their_space() {
    let a = Fake::always(fake::error(500, "embedding backend down")).await;
    let b = Fake::always(vectors("te3s-backup", 2)).await;
    let gw = gateway(&config(&a.url(), &b.url(), "", "e1, e2")).await;
    let ans = post_embeddings(&gw, embed(serde_json::json!(["one", "two"]))).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "e2");
    assert_eq!(ans.header("x-switchyard-failovers"), "1");
    let v = ans.json();
    assert_eq!(v["data"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["model"], "te3s-backup");

    let seen = &b.seen()[0];
    assert_eq!(seen.uri, "/v1/embeddings");
    assert_eq!(
        seen.body["model"], "te3s-backup",
        "the model is the target's"
    );
    assert_eq!(seen.body["input"], serde_json::json!(["one", "two"]));
    assert_eq!(
        seen.body["encoding_format"], "float",
        "the rest goes as sent"
    );
    assert_eq!(a.seen()[0].uri, "/v1/embeddings");
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_upstream_attempts_total{target="e1",outcome="5xx"}"#
        )
        .await,
        1.0
    );
    assert_eq!(
        metric(&gw, r#"switchyard_tokens_total{target="e2",kind="prompt"}"#).await,
        7.0,
        "the answer's usage is booked"
    );
}

#[tokio::test]
async fn an_answer_without_vectors_is_not_an_answer() {
    let a = Fake::always(fake::json(200, r#"{"object":"list","data":[]}"#)).await;
    let b = Fake::always(vectors("te3s-backup", 1)).await;
    let gw = gateway(&config(&a.url(), &b.url(), "", "e1, e2")).await;
    let ans = post_embeddings(&gw, embed(serde_json::json!("hello"))).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "e2");
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_upstream_attempts_total{target="e1",outcome="invalid_answer"}"#
        )
        .await,
        1.0
    );

    // With nowhere to fail over, the client hears a 502, never the empty 200.
    let gw = gateway(&config(&a.url(), &b.url(), "", "e1")).await;
    let ans = post_embeddings(&gw, embed(serde_json::json!("hello"))).await;
    assert_eq!(ans.status, 502, "{}", ans.text());
}

#[tokio::test]
async fn chat_and_embeddings_go_only_to_their_own_tasks() {
    let a = Fake::always(vectors("te3s-primary", 1)).await;
    let gw = gateway(&config(&a.url(), &a.url(), "", "e1, e2")).await;
    let ans = post_embeddings(&gw, serde_json::json!({"model": "gpt-4o", "input": "hi"})).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert!(
        ans.text().contains("serves chat completions"),
        "{}",
        ans.text()
    );
    let ans = chat(gw.addr, hello("text-embedding-3-small")).await;
    assert_eq!(ans.status, 400, "{}", ans.text());
    assert!(ans.text().contains("/v1/embeddings"), "{}", ans.text());
    assert_eq!(a.calls(), 0);
}

#[tokio::test]
async fn a_malformed_embeddings_request_names_its_field() {
    let a = Fake::always(vectors("te3s-primary", 1)).await;
    let gw = gateway(&config(&a.url(), &a.url(), "", "e1, e2")).await;
    for (body, param) in [
        (
            serde_json::json!({"model": "text-embedding-3-small"}),
            "input",
        ),
        (embed(serde_json::json!([])), "input"),
        (embed(serde_json::json!({"text": "x"})), "input"),
        (serde_json::json!({"model": 5, "input": "x"}), "model"),
    ] {
        let ans = post_embeddings(&gw, body.clone()).await;
        assert_eq!(ans.status, 400, "{body}: {}", ans.text());
        assert_eq!(ans.json()["error"]["param"], param, "{body}");
    }
    assert_eq!(a.calls(), 0);
}

#[test]
fn a_chain_mixing_embedding_spaces_is_refused() {
    let other_family =
        "  e3: { provider: pb, model: other, embedding: { model_family: bge-m3, dimensions: 4 } }";
    let other_dims =
        "  e3: { provider: pb, model: other, embedding: { model_family: te3s, dimensions: 1536 } }";
    for (extra, says) in [
        (other_family, "bge-m3/4"),
        (other_dims, "te3s/1536"),
        (
            "  e3: { provider: pb, model: chatty }",
            "chat (no `embedding`)",
        ),
    ] {
        let errors = compile_errors(&config(
            "http://127.0.0.1:9/v1",
            "http://127.0.0.1:10/v1",
            extra,
            "e1, e2, e3",
        ));
        assert!(
            errors.iter().any(|d| d.path == "tasks.embed.chain[2]"
                && d.message.contains(says)
                && d.message.contains("one embedding space")),
            "{extra}: {errors:?}"
        );
    }
}

#[test]
fn an_embedding_target_needs_a_protocol_with_embeddings() {
    let text = "version: 1
providers:
  claude: { base_url: 'http://127.0.0.1:9/v1', protocol: anthropic }
targets:
  e: { provider: claude, model: m, embedding: { model_family: f, dimensions: 8 } }
tasks:
  embed: { chain: [e] }
";
    let errors = compile_errors(text);
    assert!(
        errors
            .iter()
            .any(|d| d.path == "targets.e.embedding" && d.message.contains("no embeddings")),
        "{errors:?}"
    );
}

#[tokio::test]
async fn an_embeddings_task_has_no_contract_violation_series() {
    let a = Fake::always(vectors("te3s-primary", 1)).await;
    let gw = gateway(&config(&a.url(), &a.url(), "", "e1, e2")).await;
    let ans = post_embeddings(&gw, embed(serde_json::json!("hi"))).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    let page = metrics_page(&gw).await;
    assert!(
        !page.contains(r#"switchyard_contract_violations_total{task="embed""#),
        "{page}"
    );
    assert!(
        page.contains(r#"switchyard_contract_violations_total{task="chat",target="chat-a"}"#),
        "the chat task keeps its series: {page}"
    );
}
