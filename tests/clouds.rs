//! The cloud protocols' settings: `validate` and the JSON Schema agree on
//! what each protocol needs (a region, a project and location, or a
//! `base_url`) and refuse settings a protocol does not read; the endpoint
//! follows from the place. Their wire behaviour runs against fakes with the
//! real SDKs (tests/sdk/test_clouds.py).

use crate::support::*;

fn schema_errors(text: &str) -> Vec<String> {
    let schema: serde_json::Value =
        serde_json::from_str(include_str!("../schemas/routes.schema.json")).unwrap();
    let doc: serde_json::Value = serde_yaml::from_str(text).unwrap();
    let validator = jsonschema::validator_for(&schema).unwrap();
    validator.iter_errors(&doc).map(|e| e.to_string()).collect()
}

fn compiled(text: &str) -> switchyard::snapshot::Compiled {
    let parsed = switchyard::config::parse(text).unwrap();
    switchyard::snapshot::compile::compile(
        &parsed,
        text,
        &switchyard::snapshot::LiveState::default(),
        switchyard::snapshot::CompileOptions::default(),
    )
    .unwrap_or_else(|e| panic!("{e:?}"))
}

fn with_provider(provider: &str) -> String {
    format!(
        "version: 1
providers:
  p:
{provider}
targets:
  t: {{ provider: p, model: m }}
tasks:
  chat: {{ chain: [t] }}
"
    )
}

#[test]
fn each_protocol_reports_the_setting_it_misses_at_its_provider() {
    let cases = [
        ("    protocol: bedrock", "needs `region`"),
        (
            "    protocol: vertex\n    location: us-central1",
            "needs `project` and `location`",
        ),
        ("    protocol: anthropic", "missing field `base_url`"),
        ("    api_key_env: X", "missing field `base_url`"),
    ];
    for (provider, says) in cases {
        let text = with_provider(provider);
        let errors = compile_errors(&text);
        let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 1, "{provider}: {all:#?}");
        assert_eq!(errors[0].path, "providers.p", "{all:#?}");
        assert_eq!(errors[0].line, 3, "{all:#?}");
        assert!(errors[0].message.contains(says), "{provider}: {all:#?}");
        assert!(
            !schema_errors(&text).is_empty(),
            "the schema lets {provider} pass"
        );
    }
}

#[test]
fn a_setting_of_another_protocol_is_refused_by_both() {
    let cases = [
        (
            "    base_url: http://127.0.0.1:9/v1\n    region: us-east-1",
            "region",
        ),
        (
            "    protocol: bedrock\n    region: us-east-1\n    project: p",
            "project",
        ),
        (
            "    protocol: vertex\n    project: p\n    location: global\n    aws_profile: prod",
            "aws_profile",
        ),
    ];
    for (provider, key) in cases {
        let text = with_provider(provider);
        let errors = compile_errors(&text);
        let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 1, "{provider}: {all:#?}");
        assert_eq!(errors[0].path, format!("providers.p.{key}"), "{all:#?}");
        assert!(
            errors[0].message.contains("is not a setting of"),
            "{all:#?}"
        );
        assert!(
            !schema_errors(&text).is_empty(),
            "the schema lets {provider} pass"
        );
    }
}

#[test]
fn a_credentials_file_that_is_no_service_account_key_is_refused_without_its_text() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sa.json");
    std::fs::write(
        &file,
        r#"{"type":"authorized_user","refresh_token":"1//secret-refresh-token"}"#,
    )
    .unwrap();
    let text = with_provider(&format!(
        "    protocol: vertex\n    project: p\n    location: us-central1\n    credentials_file: {}",
        file.display()
    ));
    let all: Vec<String> = compile_errors(&text)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(all[0].contains("service-account key"), "{all:#?}");
    assert!(!all[0].contains("secret-refresh-token"), "{all:#?}");

    std::fs::write(&file, "{ not json, \"private_key\": \"-----BEGIN").unwrap();
    let all: Vec<String> = compile_errors(&text)
        .iter()
        .map(ToString::to_string)
        .collect();
    assert_eq!(all.len(), 1, "{all:#?}");
    assert!(all[0].contains("is not JSON (line 1"), "{all:#?}");
    assert!(!all[0].contains("BEGIN"), "{all:#?}");
}

#[test]
fn the_endpoint_follows_from_the_place_and_a_url_may_replace_it() {
    let text = "version: 1
providers:
  gem: { protocol: gemini, api_key_env: GEMINI_API_KEY }
  vtx: { protocol: vertex, project: acme, location: europe-west4 }
  vtx-global: { protocol: vertex, project: acme, location: global }
  brk: { protocol: bedrock, region: eu-central-1 }
  brk-url: { protocol: bedrock, base_url: 'https://bedrock-runtime.ap-south-1.amazonaws.com' }
targets:
  a: { provider: gem, model: gemini-2.5-flash }
  b: { provider: vtx, model: gemini-2.5-flash }
  c: { provider: vtx-global, model: gemini-2.5-flash }
  d: { provider: brk, model: 'us.anthropic.claude-sonnet-4-5-20250929-v1:0' }
  e: { provider: brk-url, model: 'us.anthropic.claude-sonnet-4-5-20250929-v1:0' }
tasks:
  chat: { chain: [a, b, c, d, e] }
";
    assert_eq!(schema_errors(text), Vec::<String>::new());
    let compiled = compiled(text);
    let base = |name: &str| compiled.snapshot.providers[name].endpoint.urls.base.clone();
    assert_eq!(
        base("gem"),
        "https://generativelanguage.googleapis.com/v1beta"
    );
    assert_eq!(
        base("vtx"),
        "https://europe-west4-aiplatform.googleapis.com/v1/projects/acme/locations/europe-west4"
    );
    assert_eq!(
        base("vtx-global"),
        "https://aiplatform.googleapis.com/v1/projects/acme/locations/global"
    );
    assert_eq!(
        base("brk"),
        "https://bedrock-runtime.eu-central-1.amazonaws.com"
    );
    // Keyless Bedrock and Vertex providers get a credential source; the
    // region of a Bedrock URL is the one it signs for.
    for name in ["vtx", "vtx-global", "brk", "brk-url"] {
        assert!(
            compiled.snapshot.providers[name].endpoint.auth.is_some(),
            "{name}"
        );
    }
    assert!(compiled.snapshot.providers["gem"].endpoint.auth.is_none());
    let signer = format!("{:?}", compiled.snapshot.providers["brk-url"].endpoint.auth);
    assert!(signer.contains("ap-south-1"), "{signer}");
}

#[test]
fn a_bedrock_provider_with_a_key_sends_it_as_a_bearer_token_and_signs_nothing() {
    std::env::set_var("SWITCHYARD_TEST_BEDROCK_KEY", "bedrock-api-key-for-tests");
    let text = with_provider(
        "    protocol: bedrock\n    region: us-west-2\n    api_key_env: SWITCHYARD_TEST_BEDROCK_KEY",
    );
    let compiled = compiled(&text);
    let provider = &compiled.snapshot.providers["p"];
    assert!(provider.endpoint.auth.is_none());
    let shown = format!("{:?}", provider.keys[0].credential);
    assert!(shown.contains("authorization"), "{shown}");
    assert!(
        !shown.contains("bedrock-api-key"),
        "the key never prints: {shown}"
    );
}

#[test]
fn the_cloud_examples_validate_and_keep_their_roads_in_order() {
    for (text, task, roads) in [
        (
            include_str!("../examples/claude-everywhere/routes.yaml"),
            "claude",
            &["anthropic", "bedrock", "vertex"][..],
        ),
        (
            include_str!("../examples/gemini-everywhere/routes.yaml"),
            "gemini",
            &["gemini", "vertex"][..],
        ),
    ] {
        assert_eq!(schema_errors(text), Vec::<String>::new());
        let compiled = compiled(text);
        let chain: Vec<&str> = compiled.snapshot.tasks[task]
            .chain
            .iter()
            .map(|t| t.provider.endpoint.adapter.name())
            .collect();
        assert_eq!(chain, roads);
    }
}

#[test]
fn a_place_that_is_no_cloud_name_never_becomes_a_host() {
    for (provider, key) in [
        (
            "    protocol: vertex\n    project: p\n    location: '127.0.0.1:9/x'",
            "location",
        ),
        (
            "    protocol: vertex\n    project: 'a/../../b'\n    location: us-central1",
            "project",
        ),
        ("    protocol: bedrock\n    region: ''", "region"),
        ("    protocol: bedrock\n    region: 'us east 1'", "region"),
        (
            "    protocol: bedrock\n    region: 'us-east-1/../evil.com#'",
            "region",
        ),
    ] {
        let text = with_provider(provider);
        let errors = compile_errors(&text);
        let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 1, "{provider}: {all:#?}");
        assert_eq!(errors[0].path, format!("providers.p.{key}"), "{all:#?}");
        assert!(
            errors[0].message.contains(&format!("is not a {key} name")),
            "{all:#?}"
        );
    }
    let text = with_provider(
        "    protocol: bedrock\n    region: us-east-1\n    base_url: https://bedrock-runtime.eu-west-1.amazonaws.com",
    );
    let errors = compile_errors(&text);
    let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
    assert_eq!(errors.len(), 1, "{all:#?}");
    assert_eq!(errors[0].path, "providers.p.region", "{all:#?}");
    assert!(errors[0].message.contains("eu-west-1"), "{all:#?}");
}

#[test]
fn a_service_account_key_the_library_would_refuse_is_refused_at_its_setting() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("sa.json");
    let text = with_provider(&format!(
        "    protocol: vertex\n    project: p\n    location: us-central1\n    credentials_file: {}",
        file.display()
    ));
    let key = |fields: &str| format!(r#"{{"type":"service_account",{fields}}}"#);
    let complete =
        r#""client_email":"a@p.iam.gserviceaccount.com","private_key_id":"k1","project_id":"p""#;
    for (json, says) in [
        (
            key(r#""client_email":"a@b","private_key":"x""#),
            "no `private_key_id`",
        ),
        (
            key(&format!(
                r#"{complete},"private_key":"-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n""#
            )),
            "not a PEM private key",
        ),
        ("[1, 2]".to_owned(), "service-account key"),
    ] {
        std::fs::write(&file, &json).unwrap();
        let errors = compile_errors(&text);
        let all: Vec<String> = errors.iter().map(ToString::to_string).collect();
        assert_eq!(errors.len(), 1, "{json}: {all:#?}");
        assert_eq!(errors[0].path, "providers.p.credentials_file", "{all:#?}");
        assert!(errors[0].message.contains(says), "{json}: {all:#?}");
        assert!(!errors[0].message.contains("bm90IGEga2V5"), "{all:#?}");
    }
}
