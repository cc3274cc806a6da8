//! The degraded-answer contract: tool calls from a fallback are validated;
//! a violation fails over once, then answers 502, never a broken 200.

use std::time::Duration;

use crate::support::fake::{self, Fake, Reply};
use crate::support::*;

fn weather_request(extra: serde_json::Value) -> serde_json::Value {
    let mut v = serde_json::json!({
        "model": "gpt-4o",
        "messages": [{"role": "user", "content": "weather in Oslo?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    });
    if let (Some(o), Some(e)) = (v.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    v
}

fn tool_answer(model: &str, name: &str, args: &str) -> Reply {
    fake::json(
        200,
        &serde_json::json!({"id": "x", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": name, "arguments": args}}]}}]})
        .to_string(),
    )
}

fn tool_stream(model: &str, name: &str, arg_pieces: &[&str], text_first: Option<&str>) -> Reply {
    let chunk = |delta, finish| fake::chunk_event(model, delta, finish);
    let mut pieces = vec![chunk(
        serde_json::json!({"role": "assistant", "content": ""}),
        None,
    )];
    if let Some(t) = text_first {
        pieces.push(chunk(serde_json::json!({"content": t}), None));
    }
    pieces.push(chunk(
        serde_json::json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": name, "arguments": ""}}]}),
        None,
    ));
    for p in arg_pieces {
        pieces.push(chunk(
            serde_json::json!({"tool_calls": [{"index": 0, "function": {"arguments": p}}]}),
            None,
        ));
    }
    pieces.push(chunk(serde_json::json!({}), Some("tool_calls")));
    pieces.push(fake::SSE_DONE.to_owned());
    Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: false,
    }
}

async fn three(a: Reply, b: Reply, c: Reply, task_extra: &str) -> (Fake, Fake, Fake, Gw) {
    let (a, b, c) = (
        Fake::always(a).await,
        Fake::always(b).await,
        Fake::always(c).await,
    );
    let gw = gateway(&with_tools(chain_config(
        &[("a", &a.url()), ("b", &b.url()), ("c", &c.url())],
        "",
        task_extra,
    )))
    .await;
    (a, b, c, gw)
}

/// Gives every target the `tools` and `json_mode` capabilities (requests
/// with tools, or asking for JSON, need them).
fn with_tools(cfg: String) -> String {
    ["a", "b", "c"].iter().fold(cfg, |cfg, n| {
        cfg.replace(
            &format!("model: upstream-{n} }}"),
            &format!("model: upstream-{n}, capabilities: [tools, json_mode] }}"),
        )
    })
}

#[tokio::test]
async fn a_degraded_call_to_an_unoffered_tool_fails_over_once() {
    let (a, b, c, gw) = three(
        fake::error(503, "down"),
        tool_answer("model-b", "delete_everything", "{}"),
        tool_answer("model-c", "get_weather", r#"{"city":"Oslo"}"#),
        "",
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "c");
    assert_eq!(
        ans.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "get_weather"
    );
    assert_eq!((a.calls(), b.calls(), c.calls()), (2, 1, 1));
    assert_eq!(
        metric(
            &gw,
            r#"switchyard_failovers_total{task="chat",from="b",to="c",reason="contract_violation"}"#
        )
        .await,
        1.0,
        "{}",
        metrics_page(&gw).await
    );
}

/// A request that offers no tool (or says `tool_choice: "none"`) holds a
/// degraded answer to that: a call in it is a violation, plain or streamed,
/// and the next target serves.
#[tokio::test]
async fn a_degraded_call_when_none_was_offered_or_allowed_is_a_violation() {
    let bare = serde_json::json!({"model": "gpt-4o",
        "messages": [{"role": "user", "content": "hi"}]});
    let mut none = weather_request(serde_json::json!({}));
    none["tool_choice"] = "none".into();
    for (request, stream) in [(bare.clone(), false), (bare, true), (none, false)] {
        let b_reply = if stream {
            tool_stream("model-b", "rm_rf", &["{}"], None)
        } else {
            tool_answer("model-b", "rm_rf", "not json")
        };
        let c_reply = if stream {
            fake::stream("model-c", &["fine"])
        } else {
            fake::completion("model-c", "fine")
        };
        let (_a, b, c, gw) = three(fake::error(503, "down"), b_reply, c_reply, "").await;
        let mut request = request;
        request["stream"] = stream.into();
        let ans = chat(gw.addr, request.clone()).await;
        assert_eq!(ans.status, 200, "{request}: {}", ans.text());
        assert_eq!(
            ans.header("x-switchyard-target"),
            "c",
            "{request}: {}",
            ans.text()
        );
        assert!(!ans.text().contains("rm_rf"), "{}", ans.text());
        assert_eq!((b.calls(), c.calls()), (1, 1), "{request}");
    }
}

#[tokio::test]
async fn two_violations_answer_502_naming_tool_and_schema_path() {
    let (_a, b, c, gw) = three(
        fake::error(503, "down"),
        tool_answer("model-b", "get_weather", "{city: Oslo"),
        tool_answer("model-c", "get_weather", r#"{"town":"Oslo"}"#),
        "",
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.status, 502);
    let err = &ans.json()["error"];
    assert_eq!(err["type"], "degraded_contract_violation");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("get_weather") && msg.contains("/required"),
        "{msg}"
    );
    assert_eq!((b.calls(), c.calls()), (1, 1));
}

#[tokio::test]
async fn a_required_call_answered_with_prose_is_a_violation() {
    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        fake::completion("model-b", "It is sunny in Oslo."),
        tool_answer("model-c", "get_weather", r#"{"city":"Oslo"}"#),
        "",
    )
    .await;
    let ans = chat(
        gw.addr,
        weather_request(serde_json::json!({"tool_choice": "required"})),
    )
    .await;
    assert_eq!(ans.header("x-switchyard-target"), "c");
    assert_eq!(c.calls(), 1);
}

#[tokio::test]
async fn first_choice_is_trusted_under_degraded_and_checked_under_always() {
    let (_a, b, _c, gw) = three(
        tool_answer("model-a", "get_weather", "{bad"),
        fake::completion("b", "x"),
        fake::completion("c", "x"),
        "",
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(
        ans.header("x-switchyard-target"),
        "a",
        "the first choice is not validated by default"
    );
    assert_eq!(b.calls(), 0);

    let (_a, b, _c, gw) = three(
        tool_answer("model-a", "get_weather", "{bad"),
        tool_answer("model-b", "get_weather", r#"{"city":"Oslo"}"#),
        fake::completion("c", "x"),
        "    validate_tool_calls: always\n",
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(b.calls(), 1);

    let (_a, b, _c, gw) = three(
        fake::error(503, "down"),
        tool_answer("model-b", "get_weather", "{bad"),
        fake::completion("c", "x"),
        "    validate_tool_calls: never\n",
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.status, 200, "never: passed through");
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(b.calls(), 1);
}

#[tokio::test]
async fn a_streamed_invalid_call_fails_over_invisibly() {
    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        tool_stream("model-b", "get_weather", &["{\"town\":", "\"Oslo\"}"], None),
        tool_stream("model-c", "get_weather", &["{\"city\":", "\"Oslo\"}"], None),
        "",
    )
    .await;
    let mut body = weather_request(serde_json::json!({}));
    body["stream"] = true.into();
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 200);
    assert_eq!(ans.header("x-switchyard-target"), "c");
    let text = ans.text();
    assert!(
        !text.contains("model-b") && !text.contains("town"),
        "nothing of b reached the client: {text}"
    );
    assert!(text.contains("\\\"city\\\":"), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(c.calls(), 1);
}

#[tokio::test]
async fn a_held_valid_streamed_call_is_released_in_order() {
    let (_a, _b, _c, gw) = three(
        fake::error(503, "down"),
        tool_stream("model-b", "get_weather", &["{\"city\":", "\"Oslo\"}"], None),
        fake::completion("c", "x"),
        "",
    )
    .await;
    let mut body = weather_request(serde_json::json!({}));
    body["stream"] = true.into();
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.header("x-switchyard-target"), "b");
    let Reply::Stream { pieces, .. } =
        tool_stream("model-b", "get_weather", &["{\"city\":", "\"Oslo\"}"], None)
    else {
        unreachable!("tool_stream builds a stream")
    };
    let expected = pieces.concat();
    assert_eq!(ans.text(), expected, "byte for byte, once validated");
}

#[tokio::test]
async fn text_then_invalid_call_is_an_interrupt_not_a_broken_call() {
    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        tool_stream(
            "model-b",
            "get_weather",
            &["{\"town\":\"Oslo\"}"],
            Some("Let me check."),
        ),
        fake::completion("c", "x"),
        "",
    )
    .await;
    let mut body = weather_request(serde_json::json!({}));
    body["stream"] = true.into();
    let ans = chat(gw.addr, body).await;
    let text = ans.text();
    assert!(text.contains("Let me check."), "{text}");
    assert!(
        !text.contains("town"),
        "the broken call never reaches the client: {text}"
    );
    assert!(
        text.contains("stream_interrupted") && text.contains("contract_violation"),
        "{text}"
    );
    assert!(text.ends_with("data: [DONE]\n\n"));
    assert_eq!(c.calls(), 0, "text was sent: no invisible failover");
}

#[tokio::test]
async fn schema_override_file_is_used() {
    let a = Fake::always(fake::error(503, "down")).await;
    let b = Fake::always(tool_answer("model-b", "get_weather", r#"{"city":"Oslo"}"#)).await;
    let cfg = with_tools(chain_config(
        &[("a", &a.url()), ("b", &b.url())],
        "",
        "    tool_schemas: { get_weather: schemas/weather.json }\n",
    ));
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("schemas")).unwrap();
    std::fs::write(
        dir.path().join("schemas/weather.json"),
        r#"{"type":"object","required":["city","unit"],"properties":{"unit":{"enum":["C","F"]}}}"#,
    )
    .unwrap();
    let config = dir.path().join("routes.yaml");
    std::fs::write(&config, cfg).unwrap();
    let gw = switchyard::server::Gateway::bind(
        &config,
        Some("127.0.0.1:0".parse().unwrap()),
        Default::default(),
    )
    .await
    .unwrap();
    let addr = gw.local_addr().unwrap();
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(gw.run(async {
        let _ = stopped.await;
    }));
    let ans = chat(addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(
        ans.status,
        502,
        "the override requires `unit`: {}",
        ans.text()
    );
    assert!(ans.text().contains("/required"));
}

const REPAIR: &str = "    contract: { repair: [syntax] }\n";

/// The arguments of the call in a non-streamed answer.
fn call_arguments(ans: &Answer) -> serde_json::Value {
    let args = ans.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
        .as_str()
        .unwrap_or_else(|| panic!("no call: {}", ans.text()))
        .to_owned();
    serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args}: {e}"))
}

/// `parallel_tool_calls: false` allows one call, and a named `tool_choice`
/// that tool only: a degraded answer that makes more, or another, fails over.
#[tokio::test]
async fn a_degraded_answer_keeps_to_one_call_and_to_the_named_tool() {
    let two_calls = fake::json(200, &serde_json::json!({"id": "x", "object": "chat.completion",
        "created": 1, "model": "model-b", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": r#"{"city":"Oslo"}"#}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}}]}).to_string());
    let time_tool = serde_json::json!({"type": "function", "function": {"name": "get_time",
        "parameters": {"type": "object"}}});
    let with_time = |extra: serde_json::Value| {
        let mut request = weather_request(extra);
        request["tools"]
            .as_array_mut()
            .unwrap()
            .push(time_tool.clone());
        request
    };
    for request in [
        with_time(serde_json::json!({"parallel_tool_calls": false})),
        with_time(
            serde_json::json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        ),
    ] {
        let (_a, b, c, gw) = three(
            fake::error(503, "down"),
            two_calls.clone(),
            tool_answer("model-c", "get_weather", r#"{"city":"Oslo"}"#),
            "",
        )
        .await;
        let ans = chat(gw.addr, request.clone()).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(
            ans.header("x-switchyard-target"),
            "c",
            "{request}: {}",
            ans.text()
        );
        assert_eq!((b.calls(), c.calls()), (1, 1));
    }
}

/// A custom (freeform) tool's call carries free text as its `input`, not
/// JSON `arguments`: a degraded answer that calls it keeps the contract.
#[tokio::test]
async fn a_call_of_an_offered_custom_tool_keeps_the_contract() {
    let custom = fake::json(
        200,
        &serde_json::json!({"id": "x", "object": "chat.completion",
        "created": 1, "model": "model-b", "choices": [{"index": 0, "finish_reason": "tool_calls",
        "message": {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1",
            "type": "custom", "custom": {"name": "py", "input": "print(1)"}}]}}]})
        .to_string(),
    );
    let (_a, b, c, gw) = three(
        fake::error(503, "down"),
        custom,
        fake::completion("model-c", "never"),
        "",
    )
    .await;
    let mut request = weather_request(serde_json::json!({}));
    request["tools"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"type": "custom", "custom": {"name": "py"}}));
    let ans = chat(gw.addr, request).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    assert_eq!((b.calls(), c.calls()), (1, 0));
}

/// Arguments the token limit cut (`finish_reason: length`) are unfinished,
/// not mistyped: `syntax` does not close them into a plausible call; the
/// answer fails over, plain and streamed.
#[tokio::test]
async fn arguments_cut_by_the_token_limit_are_never_repaired_into_a_call() {
    let cut_answer =
        |reply: String| fake::json(200, &reply.replace("\"tool_calls\",", "\"length\","));
    let plain = serde_json::json!({"id": "x", "object": "chat.completion", "created": 1, "model": "model-b",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Par"}}]}}]})
        .to_string();
    let Reply::Stream { mut pieces, .. } =
        tool_stream("model-b", "get_weather", &["{\"city\": \"Par"], None)
    else {
        unreachable!()
    };
    let finish = pieces.len() - 2;
    pieces[finish] = fake::chunk_event("model-b", serde_json::json!({}), Some("length"));
    let streamed = Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: false,
    };
    for (reply, stream) in [(cut_answer(plain), false), (streamed, true)] {
        let c_reply = if stream {
            tool_stream("model-c", "get_weather", &[r#"{"city":"Paris"}"#], None)
        } else {
            tool_answer("model-c", "get_weather", r#"{"city":"Paris"}"#)
        };
        let (_a, b, c, gw) = three(fake::error(503, "down"), reply, c_reply, REPAIR).await;
        let mut request = weather_request(serde_json::json!({}));
        request["stream"] = stream.into();
        let ans = chat(gw.addr, request).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(
            ans.header("x-switchyard-target"),
            "c",
            "stream {stream}: {}",
            ans.text()
        );
        assert_eq!(ans.header("x-switchyard-repaired"), "");
        assert_eq!((b.calls(), c.calls()), (1, 1));
    }
}

/// A fallback's call whose arguments are fenced, with a trailing comma and
/// single quotes, is repaired in place without another call, says so, and is
/// counted; the same answer without `contract.repair` still fails over.
#[tokio::test]
async fn a_syntax_repair_fixes_broken_arguments_without_another_call() {
    let broken = "```json\n{'city': 'Oslo',}\n```";
    let (_a, b, c, gw) = three(
        fake::error(503, "down"),
        tool_answer("model-b", "get_weather", broken),
        tool_answer("model-c", "get_weather", r#"{"city":"Bergen"}"#),
        REPAIR,
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(ans.header("x-switchyard-repaired"), "syntax");
    assert_eq!(call_arguments(&ans), serde_json::json!({"city": "Oslo"}));
    assert_eq!(
        ans.json()["choices"][0]["message"]["tool_calls"][0]["id"],
        "call_1"
    );
    assert_eq!(
        (b.calls(), c.calls()),
        (1, 0),
        "no second call, no failover"
    );
    let page = metrics_page(&gw).await;
    let series = r#"switchyard_contract_repairs_total{task="chat",target="b",method="syntax",result="repaired"}"#;
    assert_eq!(series_value(&page, series), Some(1.0), "{page}");
    let violations = r#"switchyard_contract_violations_total{task="chat",target="b"}"#;
    assert_eq!(
        series_value(&page, violations).unwrap_or(0.0),
        0.0,
        "{page}"
    );

    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        tool_answer("model-b", "get_weather", broken),
        tool_answer("model-c", "get_weather", r#"{"city":"Bergen"}"#),
        "",
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(
        ans.header("x-switchyard-target"),
        "c",
        "no repair without the key"
    );
    assert!(ans.headers.get("x-switchyard-repaired").is_none());
    assert_eq!(c.calls(), 1);
}

/// What syntax cannot fix is not passed off as fixed: a schema error, or
/// prose instead of arguments, still fails over (counted as a failed repair).
#[tokio::test]
async fn a_repair_that_cannot_make_the_answer_valid_still_fails_over() {
    // Only broken JSON is a syntax repair's to try (and count): valid JSON
    // that fails the schema, and prose, are nothing it could fix.
    for (broken, tried) in [
        (r#"{"town": "Oslo"}"#, None),
        (r#"{"city": 7,}"#, Some(1.0)),
        ("Oslo, I think", None),
    ] {
        let (_a, b, c, gw) = three(
            fake::error(503, "down"),
            tool_answer("model-b", "get_weather", broken),
            tool_answer("model-c", "get_weather", r#"{"city":"Bergen"}"#),
            REPAIR,
        )
        .await;
        let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
        assert_eq!(
            ans.header("x-switchyard-target"),
            "c",
            "{broken}: {}",
            ans.text()
        );
        assert!(ans.headers.get("x-switchyard-repaired").is_none());
        assert_eq!(call_arguments(&ans), serde_json::json!({"city": "Bergen"}));
        assert_eq!((b.calls(), c.calls()), (1, 1));
        let page = metrics_page(&gw).await;
        let series = r#"switchyard_contract_repairs_total{task="chat",target="b",method="syntax",result="failed"}"#;
        assert_eq!(series_value(&page, series), tried, "{broken}: {page}");
    }
}

/// The streamed call assembled from the client's chunks.
fn streamed_call(text: &str) -> (String, serde_json::Value) {
    let (mut id, mut args) = (String::new(), String::new());
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
            continue;
        };
        for call in v["choices"][0]["delta"]["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
        {
            if let Some(i) = call["id"].as_str() {
                id = i.to_owned();
            }
            args.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
        }
    }
    let args = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args}: {e}\n{text}"));
    (id, args)
}

/// A streamed call with broken arguments is repaired before anything goes
/// out (tool calls only: the header says so), and also after text was sent
/// (no header then), instead of failing over or interrupting the stream.
#[tokio::test]
async fn a_streamed_call_is_repaired_before_or_after_text() {
    let pieces = ["{'city':", " 'Oslo',"];
    for text_first in [None, Some("Let me check.")] {
        let (_a, b, c, gw) = three(
            fake::error(503, "down"),
            tool_stream("model-b", "get_weather", &pieces, text_first),
            tool_stream(
                "model-c",
                "get_weather",
                &["{\"city\":", "\"Bergen\"}"],
                None,
            ),
            REPAIR,
        )
        .await;
        let mut body = weather_request(serde_json::json!({}));
        body["stream"] = true.into();
        let ans = chat(gw.addr, body).await;
        let text = ans.text();
        assert_eq!(ans.header("x-switchyard-target"), "b", "{text}");
        let expected_header = if text_first.is_none() { "syntax" } else { "" };
        assert_eq!(ans.header("x-switchyard-repaired"), expected_header);
        assert_eq!(
            streamed_call(&text),
            ("call_1".to_owned(), serde_json::json!({"city": "Oslo"}))
        );
        assert!(!text.contains("stream_interrupted"), "{text}");
        assert!(text.contains("\"finish_reason\":\"tool_calls\""), "{text}");
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        if let Some(t) = text_first {
            assert!(text.contains(t), "{text}");
        }
        assert_eq!((b.calls(), c.calls()), (1, 0));
        let page = metrics_page(&gw).await;
        let series = r#"switchyard_contract_repairs_total{task="chat",target="b",method="syntax",result="repaired"}"#;
        assert_eq!(series_value(&page, series), Some(1.0), "{page}");
    }
}

const REASK: &str = "    contract: { repair: [syntax, reask] }\n";

/// `b` answers `first`, then `then` to every later call.
fn first_then(
    first: Reply,
    then: Reply,
) -> impl FnMut(usize, &fake::Seen) -> Reply + Send + 'static {
    let (mut first, then) = (Some(first), then);
    move |_, _| first.take().unwrap_or_else(|| then.clone())
}

async fn reask_chain(b: Fake, task_extra: &str) -> (Fake, Fake, Gw) {
    let c = Fake::always(tool_answer(
        "model-c",
        "get_weather",
        r#"{"city":"Bergen"}"#,
    ))
    .await;
    let a = Fake::always(fake::error(503, "down")).await;
    let gw = gateway(&with_tools(chain_config(
        &[("a", &a.url()), ("b", &b.url()), ("c", &c.url())],
        "",
        task_extra,
    )))
    .await;
    (b, c, gw)
}

/// A schema error syntax cannot fix gets one re-ask of the same target,
/// quoting the broken answer and the violation; its valid answer is served.
#[tokio::test]
async fn a_reask_quotes_the_violation_and_serves_the_corrected_call() {
    let b = Fake::start(first_then(
        tool_answer("model-b", "get_weather", r#"{"town":"Oslo"}"#),
        tool_answer("model-b", "get_weather", r#"{"city":"Oslo"}"#),
    ))
    .await;
    let (b, c, gw) = reask_chain(b, REASK).await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(ans.header("x-switchyard-repaired"), "reask");
    assert_eq!(call_arguments(&ans), serde_json::json!({"city": "Oslo"}));
    assert_eq!(
        ans.header("x-switchyard-attempts"),
        "4",
        "a and its retry, b, b's re-ask"
    );
    assert_eq!((b.calls(), c.calls()), (2, 0));
    let reask = &b.seen()[1].body;
    let messages = reask["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 3, "{reask}");
    assert_eq!(messages[0]["content"], "weather in Oslo?");
    assert_eq!(messages[1]["role"], "assistant");
    let quoted = messages[1]["content"].as_str().unwrap();
    assert!(
        quoted.contains(r#"Called `get_weather` with arguments: {"town":"Oslo"}"#),
        "{quoted}"
    );
    let asked = messages[2]["content"].as_str().unwrap();
    assert!(
        asked.contains("tool `get_weather`") && asked.contains("city"),
        "{asked}"
    );
    assert!(asked.contains("schema path"), "{asked}");
    assert_eq!(reask["model"], "upstream-b", "encoded for its target");
    let page = metrics_page(&gw).await;
    let series = |result: &str| {
        format!(
            r#"switchyard_contract_repairs_total{{task="chat",target="b",method="{}",result="{result}"}}"#,
            "reask"
        )
    };
    assert_eq!(
        series_value(&page, &series("repaired")),
        Some(1.0),
        "{page}"
    );
}

/// A re-ask that breaks the contract again fails over; so does a task
/// without `reask` at once, with no second call.
#[tokio::test]
async fn a_failed_reask_fails_over_and_none_is_made_unasked() {
    let broken = tool_answer("model-b", "get_weather", r#"{"town":"Oslo"}"#);
    let (b, c, gw) = reask_chain(Fake::always(broken.clone()).await, REASK).await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.header("x-switchyard-target"), "c", "{}", ans.text());
    assert!(ans.headers.get("x-switchyard-repaired").is_none());
    assert_eq!((b.calls(), c.calls()), (2, 1));
    let page = metrics_page(&gw).await;
    let failed = r#"switchyard_contract_repairs_total{task="chat",target="b",method="reask",result="failed"}"#;
    assert_eq!(series_value(&page, failed), Some(1.0), "{page}");

    let (b, c, gw) = reask_chain(Fake::always(broken).await, REPAIR).await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(ans.header("x-switchyard-target"), "c");
    assert_eq!((b.calls(), c.calls()), (1, 1));
}

/// A streamed answer whose held calls break the contract is re-asked as a
/// stream before any byte goes out.
#[tokio::test]
async fn a_held_stream_is_reasked_before_anything_goes_out() {
    let b = Fake::start(first_then(
        tool_stream("model-b", "get_weather", &["{\"town\":", "\"Oslo\"}"], None),
        tool_stream("model-b", "get_weather", &["{\"city\":", "\"Oslo\"}"], None),
    ))
    .await;
    let (b, c, gw) = reask_chain(b, REASK).await;
    let mut body = weather_request(serde_json::json!({}));
    body["stream"] = true.into();
    let ans = chat(gw.addr, body).await;
    let text = ans.text();
    assert_eq!(ans.header("x-switchyard-target"), "b", "{text}");
    assert_eq!(ans.header("x-switchyard-repaired"), "reask");
    assert!(
        !text.contains("town"),
        "nothing of the broken answer: {text}"
    );
    assert_eq!(streamed_call(&text).1, serde_json::json!({"city": "Oslo"}));
    assert_eq!((b.calls(), c.calls()), (2, 0));
    assert_eq!(b.seen()[1].body["stream"], true);
}

/// A re-ask never outlives the task's deadline.
#[tokio::test]
async fn a_reask_never_runs_past_the_deadline() {
    let slow_broken = Reply::Delay(
        Duration::from_millis(200),
        Box::new(tool_answer("model-b", "get_weather", r#"{"town":"Oslo"}"#)),
    );
    let budget = format!("{REASK}    budget: {{ total_timeout: 300ms }}\n");
    let (b, _c, gw) = reask_chain(Fake::always(slow_broken).await, &budget).await;
    let started = tokio::time::Instant::now();
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    let took = started.elapsed();
    // The deadline, reached during the re-ask, ended the request.
    assert_eq!(ans.status, 504, "{}", ans.text());
    assert!(took < Duration::from_millis(600), "{took:?}");
    assert_eq!(
        b.calls(),
        2,
        "the re-ask started in time and was cut at the deadline"
    );
}

fn prose(model: &str, text: &str) -> Reply {
    fake::json(
        200,
        &serde_json::json!({"id": "chatcmpl-prose", "object": "chat.completion", "created": 1, "model": model,
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}})
        .to_string(),
    )
}

/// Chain [a (down), b, c] plus a repair target `r`; the task's contract says `contract`.
async fn to_tool_chain(b: Reply, r: Reply, contract: &str) -> (Fake, Fake, Fake, Gw) {
    let a = Fake::always(fake::error(503, "down")).await;
    let (b, c, r) = (
        Fake::always(b).await,
        Fake::always(tool_answer(
            "model-c",
            "get_weather",
            r#"{"city":"Bergen"}"#,
        ))
        .await,
        Fake::always(r).await,
    );
    let cfg = with_tools(chain_config(
        &[("a", &a.url()), ("b", &b.url()), ("c", &c.url())],
        "",
        contract,
    ))
    .replace(
        "targets:\n",
        &format!(
            "  p-r: {{ base_url: '{}' }}\ntargets:\n  r: {{ provider: p-r, model: repairer, capabilities: [tools] }}\n",
            r.url()
        ),
    );
    (b, c, r, gateway(&cfg).await)
}

const TO_TOOL: &str = "    contract: { repair: [syntax, to_tool], repair_target: r }\n";

/// Prose where the request required a call is turned into that call by the
/// repair target; the answer stays b's, its message now the call.
#[tokio::test]
async fn to_tool_turns_prose_into_the_required_call_by_the_repair_target() {
    let (b, c, r, gw) = to_tool_chain(
        prose("model-b", "The weather in Oslo: call get_weather for Oslo."),
        tool_answer("repairer", "get_weather", r#"{"city":"Oslo"}"#),
        TO_TOOL,
    )
    .await;
    let body = weather_request(serde_json::json!({"tool_choice": "required"}));
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.status, 200, "{}", ans.text());
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(ans.header("x-switchyard-repaired"), "to_tool");
    assert_eq!(call_arguments(&ans), serde_json::json!({"city": "Oslo"}));
    let v = ans.json();
    assert_eq!(v["id"], "chatcmpl-prose", "still b's answer");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
    assert_eq!((b.calls(), r.calls(), c.calls()), (1, 1, 0));
    let asked = &r.seen()[0].body;
    assert_eq!(asked["model"], "repairer");
    assert_eq!(asked["tool_choice"], "required");
    assert_eq!(asked["tools"][0]["function"]["name"], "get_weather");
    let user = asked["messages"][1]["content"].as_str().unwrap();
    assert!(user.contains("call get_weather for Oslo"), "{asked}");
    let page = metrics_page(&gw).await;
    let series = r#"switchyard_contract_repairs_total{task="chat",target="b",method="to_tool",result="repaired"}"#;
    assert_eq!(series_value(&page, series), Some(1.0), "{page}");
}

/// A stream's prose where the request required a call is held, never
/// sent, and turned into that call by the repair target: the client gets
/// the stream that carries the call.
#[tokio::test]
async fn to_tool_turns_a_streams_held_prose_into_the_required_call() {
    // Prose, its finish, then its usage and [DONE].
    let mut pieces = fake::sse_events("model-b", &["Call ", "get_weather ", "for ", "Oslo."]);
    let usage = serde_json::json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
        "created": 1, "model": "model-b", "choices": [],
        "usage": {"prompt_tokens": 7, "completion_tokens": 4, "total_tokens": 11}});
    pieces.insert(pieces.len() - 1, format!("data: {usage}\n\n"));
    let prose = Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: false,
    };
    let (b, c, r, gw) = to_tool_chain(
        prose,
        tool_answer("repairer", "get_weather", r#"{"city":"Oslo"}"#),
        TO_TOOL,
    )
    .await;
    let body = weather_request(
        serde_json::json!({"tool_choice": "required", "stream": true,
        "stream_options": {"include_usage": true}}),
    );
    let ans = chat(gw.addr, body).await;
    let text = ans.text();
    assert_eq!(ans.status, 200, "{text}");
    assert_eq!(ans.header("content-type"), "text/event-stream");
    assert_eq!(ans.header("x-switchyard-target"), "b");
    assert_eq!(ans.header("x-switchyard-repaired"), "to_tool");
    assert!(
        !text.contains("Oslo."),
        "none of the prose went out: {text}"
    );
    assert_eq!(streamed_call(&text).1, serde_json::json!({"city": "Oslo"}));
    assert!(text.contains(r#""finish_reason":"tool_calls""#), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert!(
        text.contains(r#""total_tokens":11"#),
        "b's usage, as asked: {text}"
    );
    assert_eq!((b.calls(), r.calls(), c.calls()), (1, 1, 0));
    let asked = &r.seen()[0].body;
    let user = asked["messages"][1]["content"].as_str().unwrap();
    assert!(user.contains("Call get_weather for Oslo."), "{asked}");
}

/// A held stream of several choices is repaired whole or not at all: never
/// a 200 that lost a choice.
#[tokio::test]
async fn to_tool_never_drops_a_choice_of_a_held_stream() {
    let chunk = |index: u64, delta: serde_json::Value, finish: Option<&str>| {
        let v = serde_json::json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
            "created": 1, "model": "model-b",
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}]});
        format!("data: {v}\n\n")
    };
    let pieces = vec![
        chunk(
            0,
            serde_json::json!({"role": "assistant", "content": "Oslo, "}),
            None,
        ),
        chunk(
            1,
            serde_json::json!({"role": "assistant", "content": "Bergen, "}),
            None,
        ),
        chunk(0, serde_json::json!({}), Some("stop")),
        chunk(1, serde_json::json!({}), Some("stop")),
        "data: [DONE]\n\n".to_owned(),
    ];
    let two = Reply::Stream {
        pieces,
        delay: Duration::ZERO,
        cut: false,
    };
    let (_b, _c, _r, gw) = to_tool_chain(
        two,
        tool_answer("repairer", "get_weather", r#"{"city":"Oslo"}"#),
        TO_TOOL,
    )
    .await;
    let body =
        weather_request(serde_json::json!({"tool_choice": "required", "stream": true, "n": 2}));
    let ans = chat(gw.addr, body).await;
    let text = ans.text();
    assert!(ans.headers.get("x-switchyard-repaired").is_none(), "{text}");
    assert!(
        ans.status != 200 || text.contains(r#""index":1"#),
        "a 200 with a choice lost: {text}"
    );
}

/// Without a repair, a stream's prose where a call was required breaks the
/// contract before anything goes out: the walk fails over.
#[tokio::test]
async fn a_streams_prose_where_a_call_was_required_fails_over_unsent() {
    // Longer than the 64 events an ordinary hold keeps.
    let mut words = vec!["It is sunny. "];
    words.extend(std::iter::repeat_n("Still sunny. ", 100));
    let b = Fake::always(fake::stream("model-b", &words)).await;
    let c = Fake::always(tool_stream(
        "model-c",
        "get_weather",
        &["{\"city\":\"Oslo\"}"],
        None,
    ))
    .await;
    let a = Fake::always(fake::error(503, "down")).await;
    let gw = gateway(&with_tools(chain_config(
        &[("a", &a.url()), ("b", &b.url()), ("c", &c.url())],
        "",
        "",
    )))
    .await;
    let body = weather_request(serde_json::json!({"tool_choice": "required", "stream": true}));
    let ans = chat(gw.addr, body).await;
    let text = ans.text();
    assert_eq!(ans.header("x-switchyard-target"), "c", "{text}");
    assert!(!text.contains("sunny"), "{text}");
    assert_eq!(streamed_call(&text).1, serde_json::json!({"city": "Oslo"}));
    assert_eq!((b.calls(), c.calls()), (1, 1));
    // b billed its prose all the same: booked, estimated from its text.
    let page = metrics_page(&gw).await;
    let booked = series_value(
        &page,
        r#"switchyard_tokens_total{target="b",kind="completion"}"#,
    );
    assert!(booked.is_some_and(|n| n > 100.0), "{page}");
}

/// A repair target whose call breaks the contract too leaves the answer
/// broken: the walk fails over.
#[tokio::test]
async fn a_to_tool_repair_that_fails_fails_over() {
    let (b, c, r, gw) = to_tool_chain(
        prose("model-b", "It is sunny in Oslo."),
        tool_answer("repairer", "get_weather", r#"{"town":"Oslo"}"#),
        TO_TOOL,
    )
    .await;
    let body = weather_request(serde_json::json!({"tool_choice": "required"}));
    let ans = chat(gw.addr, body).await;
    assert_eq!(ans.header("x-switchyard-target"), "c", "{}", ans.text());
    assert!(ans.headers.get("x-switchyard-repaired").is_none());
    assert_eq!((b.calls(), r.calls(), c.calls()), (1, 1, 1));
}

/// `to_tool` needs a repair target that exists and can make tool calls.
#[test]
fn to_tool_needs_a_repair_target_that_makes_tool_calls() {
    let base = "version: 1
providers:
  p: { base_url: 'http://127.0.0.1:9/v1' }
targets:
  t: { provider: p, model: m, capabilities: [tools] }
  plain: { provider: p, model: m2 }
tasks:
  chat:
    chain: [t]
";
    for (contract, words) in [
        ("{ repair: [to_tool] }", "`to_tool` needs a `repair_target`"),
        (
            "{ repair: [to_tool], repair_target: nobody }",
            "unknown target or task `nobody`",
        ),
        (
            "{ repair: [to_tool], repair_target: plain }",
            "does not declare the `tools` capability",
        ),
        (
            "{ repair: [syntax], repair_target: t }",
            "only used by the `to_tool` repair",
        ),
    ] {
        let text = format!("{base}    contract: {contract}\n");
        let errs = compile_errors(&text);
        assert!(
            errs.iter().any(|d| d.message.contains(words)),
            "{contract}: {errs:?}"
        );
    }
}

/// `arguments` must be JSON text holding an object: an object sent as
/// such, a number, a missing field or `"5"` is never a 200 (found by an
/// adversarial run); syntax repair turns an object sent as such into its
/// text, and fixes a legacy `function_call` too.
#[tokio::test]
async fn arguments_must_be_json_text_of_an_object() {
    let answer_with = |function: serde_json::Value| {
        fake::json(
            200,
            &serde_json::json!({"id": "x", "object": "chat.completion", "created": 1, "model": "model-b",
                "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant", "content": null,
                    "tool_calls": [{"id": "call_1", "type": "function", "function": function}]}}]})
            .to_string(),
        )
    };
    for function in [
        serde_json::json!({"name": "get_weather", "arguments": 5}),
        serde_json::json!({"name": "get_weather"}),
        serde_json::json!({"name": "get_weather", "arguments": "5"}),
        serde_json::json!({"name": "get_weather", "arguments": {"city": "Oslo"}}),
    ] {
        let (_a, _b, c, gw) = three(
            fake::error(503, "down"),
            answer_with(function.clone()),
            tool_answer("model-c", "get_weather", r#"{"city":"Bergen"}"#),
            "",
        )
        .await;
        let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
        assert_eq!(
            ans.header("x-switchyard-target"),
            "c",
            "{function}: {}",
            ans.text()
        );
        assert_eq!(c.calls(), 1);
    }
    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        answer_with(serde_json::json!({"name": "get_weather", "arguments": {"city": "Oslo"}})),
        tool_answer("model-c", "get_weather", r#"{"city":"Bergen"}"#),
        REPAIR,
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(
        ans.header("x-switchyard-repaired"),
        "syntax",
        "{}",
        ans.text()
    );
    assert_eq!(call_arguments(&ans), serde_json::json!({"city": "Oslo"}));
    assert_eq!(c.calls(), 0);

    let legacy = fake::json(
        200,
        &serde_json::json!({"id": "x", "object": "chat.completion", "created": 1, "model": "model-b",
            "choices": [{"index": 0, "finish_reason": "function_call", "message": {"role": "assistant", "content": null,
                "function_call": {"name": "get_weather", "arguments": "{'city': 'Oslo'}"}}}]})
        .to_string(),
    );
    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        legacy,
        fake::completion("c", "x"),
        REPAIR,
    )
    .await;
    let ans = chat(gw.addr, weather_request(serde_json::json!({}))).await;
    assert_eq!(
        ans.header("x-switchyard-repaired"),
        "syntax",
        "{}",
        ans.text()
    );
    let args = ans.json()["choices"][0]["message"]["function_call"]["arguments"].clone();
    assert_eq!(args, r#"{"city": "Oslo"}"#);
    assert_eq!(c.calls(), 0);
}

/// Two streamed choices, each with its call at tool index 0, are two calls,
/// not one with the names joined; and the usage held with a repaired call's
/// last delta goes on (found by an adversarial run).
#[tokio::test]
async fn streamed_calls_are_kept_apart_by_choice_and_a_repair_keeps_the_usage() {
    let call = |choice: u64, id: &str, args: &str| {
        raw_event(
            &serde_json::json!({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1, "model": "model-b",
            "choices": [{"index": choice, "delta": {"tool_calls": [{"index": 0, "id": id, "type": "function",
                "function": {"name": "get_weather", "arguments": args}}]}, "finish_reason": null}]}),
        )
    };
    let finish = |usage: bool| {
        let mut v = serde_json::json!({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 1, "model": "model-b",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]});
        if usage {
            v["usage"] =
                serde_json::json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10});
        }
        raw_event(&v)
    };
    let two_choices = Reply::Stream {
        pieces: vec![
            call(0, "call_A", r#"{"city":"Oslo"}"#),
            call(1, "call_B", r#"{"city":"Rome"}"#),
            finish(false),
            fake::SSE_DONE.to_owned(),
        ],
        delay: Duration::ZERO,
        cut: false,
    };
    let (_a, b, c, gw) = three(
        fake::error(503, "down"),
        two_choices,
        fake::completion("c", "x"),
        "",
    )
    .await;
    let mut body = weather_request(serde_json::json!({"n": 2}));
    body["stream"] = true.into();
    let ans = chat(gw.addr, body.clone()).await;
    assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
    assert!(
        !ans.text().contains("get_weatherget_weather"),
        "{}",
        ans.text()
    );
    assert_eq!((b.calls(), c.calls()), (1, 0));

    let broken_with_usage = Reply::Stream {
        pieces: vec![
            call(0, "call_A", "{'city': 'Oslo',}"),
            finish(true),
            fake::SSE_DONE.to_owned(),
        ],
        delay: Duration::ZERO,
        cut: false,
    };
    let (_a, _b, _c, gw) = three(
        fake::error(503, "down"),
        broken_with_usage,
        fake::completion("c", "x"),
        REPAIR,
    )
    .await;
    body["n"] = 1.into();
    body["stream_options"] = serde_json::json!({"include_usage": true});
    let ans = chat(gw.addr, body).await;
    let text = ans.text();
    assert_eq!(ans.header("x-switchyard-repaired"), "syntax", "{text}");
    assert!(
        text.contains(r#""completion_tokens":3"#),
        "the usage goes on: {text}"
    );
}

fn raw_event(v: &serde_json::Value) -> String {
    format!("data: {v}\n\n")
}

fn json_request(format: serde_json::Value) -> serde_json::Value {
    serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "weather in Oslo as JSON"}],
        "response_format": format})
}

fn weather_schema() -> serde_json::Value {
    serde_json::json!({"type": "json_schema", "json_schema": {"name": "weather", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

/// A refusal is structured outputs' own answer: a degraded target that
/// declines a JSON request is served as it answered, plain and streamed.
#[tokio::test]
async fn a_refusal_to_a_json_request_is_an_answer_not_a_violation() {
    let refusal = fake::json(
        200,
        &serde_json::json!({"id": "r", "object": "chat.completion",
        "created": 1, "model": "model-b", "choices": [{"index": 0, "finish_reason": "stop",
        "message": {"role": "assistant", "content": null, "refusal": "I can't help with that."}}]})
        .to_string(),
    );
    let streamed = Reply::Stream {
        pieces: vec![
            raw_event(
                &serde_json::json!({"id": "r", "object": "chat.completion.chunk", "created": 1,
                "model": "model-b", "choices": [{"index": 0, "delta": {"role": "assistant", "refusal": "I can't"}}]}),
            ),
            raw_event(
                &serde_json::json!({"id": "r", "object": "chat.completion.chunk", "created": 1,
                "model": "model-b", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            ),
            fake::SSE_DONE.to_owned(),
        ],
        delay: Duration::ZERO,
        cut: false,
    };
    for (reply, stream) in [(refusal, false), (streamed, true)] {
        let (_a, b, c, gw) = three(
            fake::error(503, "down"),
            reply,
            fake::completion("model-c", r#"{"city": "Oslo"}"#),
            "",
        )
        .await;
        let mut request = json_request(weather_schema());
        request["stream"] = stream.into();
        let ans = chat(gw.addr, request).await;
        assert_eq!(ans.status, 200, "{}", ans.text());
        assert_eq!(ans.header("x-switchyard-target"), "b", "{}", ans.text());
        assert!(ans.text().contains("I can't"), "{}", ans.text());
        assert_eq!((b.calls(), c.calls()), (1, 0));
    }
}

/// A degraded answer to a request for JSON (`json_object`, `json_schema`)
/// is held to it: text that is not that JSON fails over (never a 200), and
/// the repairs fix what they can.
#[tokio::test]
async fn a_json_response_format_is_part_of_the_contract() {
    let cases = [
        (
            serde_json::json!({"type": "json_object"}),
            "Sure! Here it is: sunny.",
        ),
        (serde_json::json!({"type": "json_object"}), "[1, 2]"),
        (weather_schema(), r#"{"town": "Oslo"}"#),
    ];
    for (format, answer) in cases {
        let (_a, b, c, gw) = three(
            fake::error(503, "down"),
            fake::completion("model-b", answer),
            fake::completion("model-c", r#"{"city": "Oslo"}"#),
            "",
        )
        .await;
        let ans = chat(gw.addr, json_request(format.clone())).await;
        assert_eq!(
            ans.header("x-switchyard-target"),
            "c",
            "{format} / {answer}: {}",
            ans.text()
        );
        assert_eq!((b.calls(), c.calls()), (1, 1));
    }
    // Fenced JSON with a trailing comma: syntax repair, no second call.
    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        fake::completion("model-b", "```json\n{\"city\": \"Oslo\",}\n```"),
        fake::completion("model-c", r#"{"city": "Bergen"}"#),
        REPAIR,
    )
    .await;
    let ans = chat(gw.addr, json_request(weather_schema())).await;
    assert_eq!(
        ans.header("x-switchyard-repaired"),
        "syntax",
        "{}",
        ans.text()
    );
    let text = ans.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&text).unwrap(),
        serde_json::json!({"city": "Oslo"})
    );
    assert_eq!(c.calls(), 0);
    // A schema mismatch gets the re-ask, which asks for the JSON again.
    let b = Fake::start(first_then(
        fake::completion("model-b", r#"{"town": "Oslo"}"#),
        fake::completion("model-b", r#"{"city": "Oslo"}"#),
    ))
    .await;
    let (b, c, gw) = reask_chain(b, REASK).await;
    let ans = chat(gw.addr, json_request(weather_schema())).await;
    assert_eq!(
        ans.header("x-switchyard-repaired"),
        "reask",
        "{}",
        ans.text()
    );
    assert_eq!((b.calls(), c.calls()), (2, 0));
    let asked = b.seen()[1].body["messages"][2]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        asked.contains("response_format") && asked.contains("city"),
        "{asked}"
    );
}

/// A streamed degraded answer to a request for JSON is held until it is
/// complete and checked: text that is not that JSON fails over before a
/// byte goes out, and syntax repair fixes what it can, in the stream.
#[tokio::test]
async fn a_streamed_json_answer_is_held_to_its_format() {
    let streamed = |format: serde_json::Value| {
        let mut body = json_request(format);
        body["stream"] = true.into();
        body
    };
    let (_a, b, c, gw) = three(
        fake::error(503, "down"),
        fake::stream("model-b", &["{\"town\": ", "\"Oslo\"}"]),
        fake::stream("model-c", &["{\"city\": ", "\"Oslo\"}"]),
        "",
    )
    .await;
    let ans = chat(gw.addr, streamed(weather_schema())).await;
    let text = ans.text();
    assert_eq!(ans.header("x-switchyard-target"), "c", "{text}");
    assert!(!text.contains("town"), "nothing of b's answer: {text}");
    assert_eq!(sse_text(&text), r#"{"city": "Oslo"}"#);
    assert_eq!((b.calls(), c.calls()), (1, 1));
    // Fenced JSON with a trailing comma: repaired in the stream, no second call.
    let (_a, _b, c, gw) = three(
        fake::error(503, "down"),
        fake::stream("model-b", &["```json\n{\"city\": ", "\"Oslo\",}\n```"]),
        fake::stream("model-c", &["{\"city\": \"Bergen\"}"]),
        REPAIR,
    )
    .await;
    let ans = chat(gw.addr, streamed(weather_schema())).await;
    let text = ans.text();
    assert_eq!(ans.header("x-switchyard-repaired"), "syntax", "{text}");
    let answer: serde_json::Value = serde_json::from_str(&sse_text(&text)).unwrap();
    assert_eq!(answer, serde_json::json!({"city": "Oslo"}));
    assert!(text.contains(r#""finish_reason":"stop""#), "{text}");
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(c.calls(), 0);
}
