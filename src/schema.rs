//! The degraded-answer contract: `tool_calls` must name a tool the request
//! offered, carry arguments that parse as JSON, and validate against that
//! tool's JSON Schema (the request's `parameters`, or an override from
//! `schemas/` named by the task's `tool_schemas`). A request that required a
//! tool (`tool_choice: required` or a named function) and got none breaks it
//! too. The seeds' sharpest warning: a fallback model that answers prose
//! where the workflow expected a call, or a call with broken arguments, must
//! not be passed off as a success.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use jsonschema::Validator;
use serde_json::value::RawValue;
use serde_json::Value;

use crate::request::ChatRequest;

/// When tool calls are validated (`validate_tool_calls` on a task).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Only answers from a target other than the first one chosen (default).
    Degraded,
    /// Every answer.
    Always,
    /// Never.
    Never,
}

impl Mode {
    /// Every mode, for parsing and the JSON Schema.
    pub const ALL: [Mode; 3] = [Mode::Degraded, Mode::Always, Mode::Never];

    /// The `routes.yaml` name.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Degraded => "degraded",
            Mode::Always => "always",
            Mode::Never => "never",
        }
    }

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }
}

/// A repair tried on an answer that breaks the contract, before the
/// failover (`contract: { repair: [...] }` on a task).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Repair {
    /// The arguments' JSON is fixed (code fences, trailing commas, single
    /// quotes, unquoted keys, unclosed brackets) with no model call; the
    /// repaired call must then keep the contract.
    Syntax,
    /// One more call to the same target: the request, its broken answer and
    /// the validation error; the new answer is held to the contract again.
    Reask,
    /// Prose where a call was required is turned into that call by the
    /// task's `repair_target`, asked to produce exactly it.
    ToTool,
}

impl Repair {
    /// Every method, for parsing and the JSON Schema.
    pub const ALL: [Repair; 3] = [Repair::Syntax, Repair::Reask, Repair::ToTool];

    /// The `routes.yaml` name, also the `method` label and `x-switchyard-repaired`.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Repair::Syntax => "syntax",
            Repair::Reask => "reask",
            Repair::ToTool => "to_tool",
        }
    }

    /// Parses a `routes.yaml` name.
    #[must_use]
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|m| m.as_str() == s)
    }

    /// Done on the answer in hand, with no model call.
    #[must_use]
    pub fn is_local(self) -> bool {
        match self {
            Repair::Syntax => true,
            Repair::Reask | Repair::ToTool => false,
        }
    }
}

/// Bytes of streamed tool call deltas held for validation, at most; a larger
/// call is a violation.
pub const HOLD_MAX_TOOL_BYTES: usize = 1024 * 1024;

/// Compiled schema overrides of a task, by function name.
pub type Overrides = BTreeMap<String, Arc<Validator>>;

/// What broke the contract.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The tool concerned, if any.
    pub tool: Option<String>,
    /// What is wrong, in words.
    pub detail: String,
    /// JSON pointer into the schema that failed, for schema violations.
    pub schema_path: Option<String>,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(tool) = &self.tool {
            write!(f, "tool `{tool}`: ")?;
        }
        f.write_str(&self.detail)?;
        if let Some(p) = &self.schema_path {
            write!(f, " (schema path {p})")?;
        }
        Ok(())
    }
}

fn violation(tool: Option<&str>, detail: impl Into<String>) -> Violation {
    Violation {
        tool: tool.map(str::to_owned),
        detail: detail.into(),
        schema_path: None,
    }
}

/// The request's side of the contract.
#[derive(Debug)]
pub struct Contract {
    /// Offered functions and their `parameters` schema (if any).
    offered: HashMap<String, Option<Value>>,
    /// A call the request required: `Some(None)` any tool, `Some(Some(name))` that one.
    required: Option<Option<String>>,
    /// `tool_choice: "none"`: no call may come.
    no_calls: bool,
    /// `parallel_tool_calls: false`: one call at most.
    single_call: bool,
    overrides: Arc<Overrides>,
    /// The JSON an answer's text must be (`response_format`), if any.
    format: Option<Format>,
}

/// What `response_format` asks of an answer's text.
#[derive(Debug)]
enum Format {
    /// `json_object`: a JSON object.
    Object,
    /// `json_schema`: JSON that validates against its `schema`.
    Schema(Value),
}

impl Format {
    /// The format a request's `response_format` asks for, if JSON.
    fn of(raw: Option<&RawValue>) -> Option<Self> {
        let v: Value = serde_json::from_str(raw?.get()).ok()?;
        match v.get("type").and_then(Value::as_str)? {
            "json_object" => Some(Format::Object),
            "json_schema" => Some(match v.pointer("/json_schema/schema") {
                Some(schema) if schema.is_object() => Format::Schema(schema.clone()),
                // No schema to hold it to: JSON is what can be checked.
                _ => Format::Object,
            }),
            _ => None,
        }
    }

    /// Checks an answer's text.
    fn check(&self, text: &str) -> Result<(), Violation> {
        let value: Value = serde_json::from_str(text).map_err(|e| {
            violation(
                None,
                format!("the answer's text is not the JSON `response_format` asks for: {e}"),
            )
        })?;
        match self {
            Format::Object if value.is_object() => Ok(()),
            Format::Object => Err(violation(
                None,
                "the answer's JSON is not an object, as `json_object` asks",
            )),
            Format::Schema(schema) => match jsonschema::validator_for(schema) {
                Ok(validator) => validator.validate(&value).map_err(|e| Violation {
                    tool: None,
                    detail: format!(
                        "the answer's JSON does not match the `response_format` schema: {e}"
                    ),
                    schema_path: Some(e.schema_path.to_string()),
                }),
                // The caller's own schema does not compile: nothing to hold it to.
                Err(_) => Ok(()),
            },
        }
    }
}

impl Contract {
    /// The contract of a request that offers no tool and asks for no JSON:
    /// an answer may not call a tool (it names none the request offered).
    #[must_use]
    pub fn bare(overrides: &Arc<Overrides>) -> Self {
        Self {
            offered: HashMap::new(),
            required: None,
            no_calls: false,
            single_call: false,
            overrides: Arc::clone(overrides),
            format: None,
        }
    }

    /// Reads the contract from a chat request: its tools, and the JSON its
    /// `response_format` asks for; `None` when it has neither.
    #[must_use]
    pub fn from_request(request: &ChatRequest<'_>, overrides: &Arc<Overrides>) -> Option<Self> {
        let parse = |raw: Option<&RawValue>| -> Value {
            raw.and_then(|r| serde_json::from_str(r.get()).ok())
                .unwrap_or(Value::Null)
        };
        let mut offered = HashMap::new();
        for t in parse(request.tools).as_array().into_iter().flatten() {
            // A function tool, or a custom (freeform) one: no JSON arguments.
            let f = t.get("function").or_else(|| t.get("custom")).unwrap_or(t);
            if let Some(name) = f.get("name").and_then(Value::as_str) {
                offered.insert(name.to_owned(), f.get("parameters").cloned());
            }
        }
        for f in parse(request.functions).as_array().into_iter().flatten() {
            if let Some(name) = f.get("name").and_then(Value::as_str) {
                offered.insert(name.to_owned(), f.get("parameters").cloned());
            }
        }
        let format = Format::of(request.response_format);
        if offered.is_empty() && format.is_none() {
            return None;
        }
        let choice = match request.tool_choice {
            Some(raw) => parse(Some(raw)),
            None => parse(request.function_call),
        };
        let no_calls = choice == Value::String("none".into());
        let required = match choice {
            Value::String(s) if s == "required" => Some(None),
            Value::Object(o) => o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .map(|n| Some(n.to_owned())),
            Value::Null
            | Value::Bool(_)
            | Value::Number(_)
            | Value::String(_)
            | Value::Array(_) => None,
        };
        Some(Self {
            offered,
            required,
            no_calls,
            single_call: single_call(request.body()),
            overrides: Arc::clone(overrides),
            format,
        })
    }

    /// Checks a non-streamed `chat.completion` body.
    ///
    /// # Errors
    /// The first violation found.
    pub fn check_completion(&self, body: &[u8]) -> Result<(), Violation> {
        let v: Value =
            serde_json::from_slice(body).map_err(|_| violation(None, "the answer is not JSON"))?;
        let choices = v
            .get("choices")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for choice in &choices {
            let message = choice.get("message").unwrap_or(&Value::Null);
            for f in functions(message) {
                string_arguments(f)?;
            }
            let calls: Vec<(String, String)> = functions(message).map(name_and_arguments).collect();
            self.check_calls(&calls)?;
            if let (Some(format), true) = (&self.format, calls.is_empty()) {
                let text = message.get("content").and_then(Value::as_str).unwrap_or("");
                // A refusal is structured outputs' own answer for a request the
                // model declines: no JSON is owed, and the client's SDK shows it.
                let refused = message
                    .get("refusal")
                    .and_then(Value::as_str)
                    .is_some_and(|r| !r.is_empty());
                if !(refused && text.is_empty()) {
                    format.check(text)?;
                }
            }
        }
        if choices.is_empty() {
            self.check_calls(&[])?;
        }
        Ok(())
    }

    /// Checks assembled calls (name, arguments text).
    ///
    /// # Errors
    /// The first violation found.
    pub fn check_calls(&self, calls: &[(String, String)]) -> Result<(), Violation> {
        match &self.required {
            Some(None) if calls.is_empty() => {
                return Err(violation(
                    None,
                    "the request required a tool call and the answer has none",
                ));
            }
            Some(Some(name)) if !calls.iter().any(|(n, _)| n == name) => {
                return Err(violation(
                    Some(name),
                    "the request required this tool and the answer did not call it",
                ));
            }
            _ => {}
        }
        if let (true, Some((name, _))) = (self.no_calls, calls.first()) {
            return Err(violation(
                Some(name),
                "the request's `tool_choice` was none and the answer called a tool",
            ));
        }
        if let (true, Some((name, _))) = (self.single_call, calls.get(1)) {
            return Err(violation(
                Some(name),
                "the request's `parallel_tool_calls` was false and the answer made several calls",
            ));
        }
        if let Some(Some(named)) = &self.required {
            if let Some((other, _)) = calls.iter().find(|(n, _)| n != named) {
                return Err(violation(
                    Some(other),
                    "the request's `tool_choice` named another tool",
                ));
            }
        }
        for (name, arguments) in calls {
            let Some(parameters) = self.offered.get(name) else {
                return Err(violation(Some(name), "the request did not offer this tool"));
            };
            let args: Value = serde_json::from_str(if arguments.trim().is_empty() {
                "{}"
            } else {
                arguments
            })
            .map_err(|e| violation(Some(name), format!("arguments are not valid JSON: {e}")))?;
            if !args.is_object() {
                return Err(violation(Some(name), "arguments are not a JSON object"));
            }
            let result = match (self.overrides.get(name), parameters) {
                (Some(validator), _) => validator
                    .validate(&args)
                    .map_err(|e| (e.to_string(), e.schema_path.to_string())),
                (None, Some(schema)) => match jsonschema::validator_for(schema) {
                    Ok(validator) => validator
                        .validate(&args)
                        .map_err(|e| (e.to_string(), e.schema_path.to_string())),
                    // The caller's own schema does not compile: nothing to hold the answer to.
                    Err(_) => Ok(()),
                },
                (None, None) => Ok(()),
            };
            if let Err((detail, path)) = result {
                return Err(Violation {
                    tool: Some(name.clone()),
                    detail: format!("arguments do not match the schema: {detail}"),
                    schema_path: Some(path),
                });
            }
        }
        Ok(())
    }
}

impl Contract {
    /// Whether the request offers tools (their deltas are held in streams).
    #[must_use]
    pub fn offers_tools(&self) -> bool {
        !self.offered.is_empty()
    }

    /// The call the request required, if it required one: `Some(None)` any
    /// offered tool, `Some(Some(name))` that one.
    #[must_use]
    pub fn required(&self) -> Option<Option<&str>> {
        self.required.as_ref().map(Option::as_deref)
    }

    /// The offered tools a call may use (`name`: that one only), as
    /// Chat Completions `tools` entries.
    #[must_use]
    pub fn tools(&self, name: Option<&str>) -> Vec<Value> {
        let mut names: Vec<&String> = self
            .offered
            .keys()
            .filter(|n| name.is_none_or(|want| *n == want))
            .collect();
        names.sort();
        names
            .into_iter()
            .map(|n| {
                let mut function = serde_json::json!({ "name": n });
                if let Some(parameters) = self.offered.get(n).and_then(Option::as_ref) {
                    function["parameters"] = parameters.clone();
                }
                serde_json::json!({ "type": "function", "function": function })
            })
            .collect()
    }

    /// Whether an answer's text is held to a JSON `response_format`.
    #[must_use]
    pub fn checks_text(&self) -> bool {
        self.format.is_some()
    }

    /// Checks the text of an answer without calls against `response_format`.
    ///
    /// # Errors
    /// The text is not the JSON the format asks for.
    pub fn check_text(&self, text: &str) -> Result<(), Violation> {
        self.format.as_ref().map_or(Ok(()), |f| f.check(text))
    }

    /// The text with its JSON repaired: `None` when there is nothing to
    /// try (no format, or the text is JSON already), `Some(None)` when the
    /// repaired text still breaks the format.
    #[must_use]
    pub fn repair_text(&self, text: &str) -> Option<Option<String>> {
        let format = self.format.as_ref()?;
        let fixed = repair_json_text(text)?;
        Some(format.check(&fixed).is_ok().then_some(fixed))
    }

    /// The calls with the JSON of their arguments repaired: `None` when no
    /// argument needed it (nothing to try), `Some(None)` when the repaired
    /// calls still break the contract.
    #[must_use]
    pub fn repair_calls(
        &self,
        calls: &[(String, String)],
    ) -> Option<Option<Vec<(String, String)>>> {
        let mut changed = false;
        let fixed: Vec<(String, String)> = calls
            .iter()
            .map(|(name, arguments)| match repair_arguments(arguments) {
                Some(repaired) => {
                    changed = true;
                    (name.clone(), repaired)
                }
                None => (name.clone(), arguments.clone()),
            })
            .collect();
        changed.then(|| self.check_calls(&fixed).is_ok().then_some(fixed))
    }

    /// A non-streamed `chat.completion` whose tool call arguments are
    /// repaired, as [`Contract::repair_calls`] says it.
    #[must_use]
    pub fn repair_completion(&self, body: &[u8]) -> Option<Option<bytes::Bytes>> {
        let mut v: Value = serde_json::from_slice(body).ok()?;
        let mut changed = false;
        for choice in v.get_mut("choices")?.as_array_mut()? {
            if choice.get("finish_reason").is_some_and(|f| f == "length") {
                // Cut by the token limit: closing its brackets would make a
                // plausible call of what the model never finished saying.
                continue;
            }
            let Some(message) = choice.get_mut("message") else {
                continue;
            };
            let Some(fields) = message.as_object_mut() else {
                continue;
            };
            for (key, value) in fields.iter_mut() {
                match (key.as_str(), value) {
                    ("tool_calls", Value::Array(calls)) => {
                        for f in calls.iter_mut().filter_map(|c| c.get_mut("function")) {
                            changed |= repair_function(f);
                        }
                    }
                    ("function_call", f) => changed |= repair_function(f),
                    ("content", Value::String(text)) if self.format.is_some() => {
                        if let Some(fixed) = repair_json_text(text) {
                            *text = fixed;
                            changed = true;
                        }
                    }
                    _ => {}
                }
            }
        }
        if !changed {
            return None;
        }
        let repaired = serde_json::to_vec(&v).ok()?;
        Some(
            self.check_completion(&repaired)
                .is_ok()
                .then(|| repaired.into()),
        )
    }
}

/// Whether a request said `parallel_tool_calls: false` (one call at most).
fn single_call(body: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(body) else {
        return false;
    };
    match crate::sse::scan::fields(text, ["parallel_tool_calls"]) {
        Some([said]) => said == Some("false"),
        // An escaped key or a repeated one: serde reads it.
        None => serde_json::from_str::<Value>(text)
            .is_ok_and(|v| v.get("parallel_tool_calls") == Some(&Value::Bool(false))),
    }
}

/// Whether a `chat.completion` was cut by the token limit (a choice whose
/// `finish_reason` is `length`): its broken JSON is unfinished, not mistyped.
#[must_use]
pub fn cut_by_limit(body: &[u8]) -> bool {
    serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| {
            let choices = v.get("choices")?.as_array()?.clone();
            Some(choices.iter().any(|c| c["finish_reason"] == "length"))
        })
        .unwrap_or(false)
}

/// Repairs the `arguments` of one `function` object in place; whether it did.
fn repair_function(f: &mut Value) -> bool {
    let repaired = match f.get("arguments") {
        Some(Value::String(text)) => repair_arguments(text),
        // Arguments sent as the object itself: the client expects its JSON text.
        Some(object @ Value::Object(_)) => Some(object.to_string()),
        _ => None,
    };
    let Some(repaired) = repaired else {
        return false;
    };
    f["arguments"] = Value::String(repaired);
    true
}

/// What a non-streamed answer said, for a re-ask to quote: each choice's
/// text, then its calls (legacy `function_call` included).
#[must_use]
pub fn quoted_completion(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let choices = v.get("choices").and_then(Value::as_array);
    let quotes: Vec<String> = choices
        .into_iter()
        .flatten()
        .map(|choice| {
            let message = choice.get("message").unwrap_or(&Value::Null);
            let calls: Vec<(String, String)> = functions(message)
                .map(|f| {
                    let arguments = match f.get("arguments") {
                        Some(Value::String(text)) => text.clone(),
                        Some(other) => other.to_string(),
                        None => String::new(),
                    };
                    (name_and_arguments(f).0, arguments)
                })
                .collect();
            let text = message.get("content").and_then(Value::as_str).unwrap_or("");
            quoted(text, &calls)
        })
        .collect();
    quotes.join("\n")
}

/// `completion` with its first choice's message made the calls of
/// `repaired` (another completion): the answer stays the first one's (its
/// `id`, `model`, usage), its text turned into those calls.
#[must_use]
pub fn with_calls_of(completion: &[u8], repaired: &[u8]) -> Option<bytes::Bytes> {
    let mut whole: Value = serde_json::from_slice(completion).ok()?;
    let other: Value = serde_json::from_slice(repaired).ok()?;
    let calls = other.pointer("/choices/0/message/tool_calls")?.clone();
    if calls.as_array().is_none_or(Vec::is_empty) {
        return None;
    }
    let choice = whole.pointer_mut("/choices/0")?;
    choice["message"] =
        serde_json::json!({"role": "assistant", "content": null, "tool_calls": calls});
    choice["finish_reason"] = Value::from("tool_calls");
    serde_json::to_vec(&whole).ok().map(bytes::Bytes::from)
}

/// An answer's text and calls as one text a model can read back.
#[must_use]
pub fn quoted(text: &str, calls: &[(String, String)]) -> String {
    let mut out = text.to_owned();
    for (name, arguments) in calls {
        if !out.is_empty() {
            out.push('\n');
        }
        out.push_str(&format!("Called `{name}` with arguments: {arguments}"));
    }
    out
}

/// An answer's text that is not JSON, repaired into JSON; `None` when it
/// is JSON already or no repair makes it so.
fn repair_json_text(text: &str) -> Option<String> {
    if text.trim().is_empty() || serde_json::from_str::<Value>(text).is_ok() {
        return None;
    }
    let repaired = jsonrepair_rs::jsonrepair(text).ok()?;
    // Prose is not made into a JSON string.
    serde_json::from_str::<Value>(&repaired)
        .is_ok_and(|v| v.is_object() || v.is_array())
        .then_some(repaired)
}

/// Arguments that are not a JSON object, repaired into one; `None` when
/// they are one already or no repair makes them one (prose stays prose).
fn repair_arguments(arguments: &str) -> Option<String> {
    let is_object = |text: &str| serde_json::from_str::<Value>(text).is_ok_and(|v| v.is_object());
    if arguments.trim().is_empty() || is_object(arguments) {
        return None;
    }
    let repaired = jsonrepair_rs::jsonrepair(arguments).ok()?;
    is_object(&repaired).then_some(repaired)
}

/// The `function` objects of a message: its tool calls', then a legacy
/// `function_call`.
fn functions(message: &Value) -> impl Iterator<Item = &Value> {
    message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|c| {
            c.get("function")
                .or_else(|| c.get("custom"))
                .unwrap_or(&Value::Null)
        })
        .chain(message.get("function_call"))
}

/// A call's `arguments` must be JSON text (a string), as every client parses it.
fn string_arguments(f: &Value) -> Result<(), Violation> {
    let name = f.get("name").and_then(Value::as_str);
    if f.get("input").is_some_and(Value::is_string) {
        // A custom tool's call: its input is free text, not JSON.
        return Ok(());
    }
    match f.get("arguments") {
        Some(Value::String(_)) => Ok(()),
        None | Some(Value::Null) => Err(violation(name, "the call has no `arguments`")),
        Some(other) => {
            let kind = match other {
                Value::Object(_) => "an object",
                Value::Array(_) => "a list",
                Value::Number(_) => "a number",
                Value::Bool(_) => "a boolean",
                Value::String(_) | Value::Null => "a value",
            };
            Err(violation(
                name,
                format!("`arguments` must be JSON text (a string), not {kind}"),
            ))
        }
    }
}

/// `(name, arguments)` of a `function` object (a tool call's or a legacy
/// `function_call`); missing fields read as empty.
fn name_and_arguments(f: &Value) -> (String, String) {
    let text = |key: &str| f.get(key).and_then(Value::as_str).unwrap_or("").to_owned();
    (text("name"), text("arguments"))
}

/// Assembles streamed tool call deltas (`delta.tool_calls[i]` with `index`,
/// `function.name` once, `function.arguments` in pieces), per choice.
#[derive(Debug, Default, Clone)]
pub struct CallAssembler {
    /// By (choice index, call index): name and arguments so far.
    calls: BTreeMap<(u64, u64), (String, String)>,
    /// Each call's `id`, as its first delta gave it.
    ids: BTreeMap<(u64, u64), String>,
    /// By choice: which call each fragment belongs to.
    slots: BTreeMap<u64, crate::sse::CallSlots>,
}

impl CallAssembler {
    /// Adds the tool call deltas of one chunk's JSON; returns whether it had
    /// any, and whether it also carried text.
    pub fn push_chunk(&mut self, data: &str) -> (bool, bool) {
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return (false, false);
        };
        let mut any = false;
        let mut text = false;
        for choice in v
            .get("choices")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let at = choice.get("index").and_then(Value::as_u64).unwrap_or(0);
            let delta = choice.get("delta");
            if delta
                .and_then(|d| d.get("content"))
                .and_then(Value::as_str)
                .is_some_and(|t| !t.is_empty())
            {
                text = true;
            }
            for call in delta
                .and_then(|d| d.get("tool_calls"))
                .and_then(Value::as_array)
                .into_iter()
                .flatten()
            {
                any = true;
                let index = call.get("index").and_then(Value::as_u64).unwrap_or(0);
                let id = call.get("id").and_then(Value::as_str);
                let index = u64::from(
                    self.slots
                        .entry(at)
                        .or_default()
                        .slot(u32::try_from(index).unwrap_or(u32::MAX), id),
                );
                if let Some(id) = id {
                    self.ids.entry((at, index)).or_insert_with(|| id.to_owned());
                }
                let entry = self.calls.entry((at, index)).or_default();
                // A custom tool's call streams its name the same way; its
                // free-text `input` is no JSON to hold to a schema.
                if let Some(f) = call.get("function").or_else(|| call.get("custom")) {
                    if let Some(name) = f.get("name").and_then(Value::as_str) {
                        entry.0.push_str(name);
                    }
                    if let Some(args) = f.get("arguments").and_then(Value::as_str) {
                        entry.1.push_str(args);
                    }
                }
            }
        }
        (any, text)
    }

    /// The calls assembled so far, by choice then index.
    #[must_use]
    pub fn calls(&self) -> Vec<(String, String)> {
        self.calls.values().cloned().collect()
    }

    /// What goes out in place of `held`, a stream's held tool call events,
    /// once their calls are repaired into `calls` (in the order
    /// [`CallAssembler::calls`] gave them): one chunk per choice carrying
    /// its calls whole, then the finish (and usage) the held events carried,
    /// in the envelope (`id`, `model`, `created`) of the first of them.
    #[must_use]
    pub fn repaired_events(&self, held: &[u8], calls: &[(String, String)]) -> Option<bytes::Bytes> {
        let parsed = crate::sse::chunks_of(held);
        let template = parsed.first()?;
        let mut by_choice: BTreeMap<u64, Vec<Value>> = BTreeMap::new();
        for (((at, index), _), (name, arguments)) in self.calls.iter().zip(calls) {
            by_choice.entry(*at).or_default().push(serde_json::json!({
                "index": index,
                "id": self.ids.get(&(*at, *index)),
                "type": "function",
                "function": { "name": name, "arguments": arguments },
            }));
        }
        let mut out = Vec::new();
        for (at, tool_calls) in by_choice {
            let choice = serde_json::json!({"index": at, "delta": {"tool_calls": tool_calls}, "finish_reason": null});
            out.extend_from_slice(&event_like(template, vec![choice], None)?);
        }
        let finishes: BTreeMap<u64, String> = parsed
            .iter()
            .flat_map(|v| {
                v.get("choices")
                    .and_then(Value::as_array)
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|c| {
                let reason = c.get("finish_reason")?.as_str()?.to_owned();
                Some((c.get("index").and_then(Value::as_u64).unwrap_or(0), reason))
            })
            .collect();
        let usage = parsed
            .iter()
            .rev()
            .find_map(|v| v.get("usage").filter(|u| u.is_object()).cloned());
        if !finishes.is_empty() || usage.is_some() {
            let choices = finishes
                .into_iter()
                .map(|(at, reason)| serde_json::json!({"index": at, "delta": {}, "finish_reason": reason}))
                .collect();
            out.extend_from_slice(&event_like(template, choices, usage)?);
        }
        Some(out.into())
    }
}

/// An SSE chunk event in `template`'s envelope with `choices` (and `usage`).
fn event_like(template: &Value, choices: Vec<Value>, usage: Option<Value>) -> Option<Vec<u8>> {
    let mut chunk = template.clone();
    let fields = chunk.as_object_mut()?;
    fields.insert("choices".into(), Value::Array(choices));
    match usage {
        Some(usage) => fields.insert("usage".into(), usage),
        None => fields.remove("usage"),
    };
    Some(format!("data: {chunk}\n\n").into_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn contract(extra: Value) -> Contract {
        let mut req = serde_json::json!({
            "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        });
        if let (Some(r), Some(e)) = (req.as_object_mut(), extra.as_object()) {
            r.extend(e.clone());
        }
        let body = req.to_string();
        let view = ChatRequest::parse(body.as_bytes()).unwrap();
        Contract::from_request(&view, &Arc::new(Overrides::new())).unwrap()
    }

    fn answer(calls: Value) -> Vec<u8> {
        serde_json::json!({"choices": [{"message": {"role": "assistant", "content": null, "tool_calls": calls}}]})
            .to_string()
            .into_bytes()
    }

    fn call(name: &str, args: &str) -> Value {
        serde_json::json!([{"id": "c1", "type": "function", "function": {"name": name, "arguments": args}}])
    }

    #[test]
    fn only_broken_syntax_is_repaired_and_only_into_a_valid_call() {
        let c = contract(serde_json::json!({}));
        let weather = |args: &str| vec![("get_weather".to_owned(), args.to_owned())];
        for broken in [
            "```json\n{\"city\": \"Oslo\"}\n```",
            "{\"city\": \"Oslo\",}",
            "{'city': 'Oslo'}",
            "{city: \"Oslo\"}",
            "{\"city\": \"Oslo\"",
        ] {
            let fixed = c
                .repair_calls(&weather(broken))
                .flatten()
                .unwrap_or_else(|| panic!("{broken}"));
            let v: Value = serde_json::from_str(&fixed[0].1).unwrap();
            assert_eq!(v, serde_json::json!({"city": "Oslo"}), "{broken}");
        }
        // Valid JSON is never touched; prose and schema errors stay broken.
        for not_syntax in ["{\"town\": \"Oslo\"}", "{\"city\": 7,}", "Oslo please", ""] {
            assert!(
                c.repair_calls(&weather(not_syntax)).flatten().is_none(),
                "{not_syntax}"
            );
        }
        let body = answer(call("get_weather", "{'city': 'Oslo',}"));
        let fixed = c.repair_completion(&body).flatten().unwrap();
        assert!(c.check_completion(&fixed).is_ok());
        assert_eq!(
            c.repair_completion(&answer(call("get_weather", "{\"city\": 1}")))
                .flatten(),
            None
        );
    }

    #[test]
    fn each_outcome() {
        let c = contract(serde_json::json!({}));
        assert!(c
            .check_completion(&answer(call("get_weather", r#"{"city":"Oslo"}"#)))
            .is_ok());
        let e = c
            .check_completion(&answer(call("delete_db", "{}")))
            .unwrap_err();
        assert!(e.detail.contains("did not offer"));
        let e = c
            .check_completion(&answer(call("get_weather", "{city: Oslo")))
            .unwrap_err();
        assert!(e.detail.contains("not valid JSON"));
        let e = c
            .check_completion(&answer(call("get_weather", r#"{"town":"Oslo"}"#)))
            .unwrap_err();
        assert_eq!(e.schema_path.as_deref(), Some("/required"));
        let prose = br#"{"choices":[{"message":{"role":"assistant","content":"It is sunny."}}]}"#;
        assert!(
            c.check_completion(prose).is_ok(),
            "tools offered but not required: prose is fine"
        );
        let required = contract(serde_json::json!({"tool_choice": "required"}));
        assert!(required
            .check_completion(prose)
            .unwrap_err()
            .detail
            .contains("required a tool call"));
        let named = contract(
            serde_json::json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
        );
        assert!(named.check_completion(prose).is_err());
    }

    #[test]
    fn overrides_win_over_the_request_schema() {
        let strict = jsonschema::validator_for(
            &serde_json::json!({"type": "object", "required": ["city", "unit"]}),
        )
        .unwrap();
        let overrides = Arc::new(Overrides::from([(
            "get_weather".to_owned(),
            Arc::new(strict),
        )]));
        let body = r#"{"messages": [{"role": "user"}], "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]}"#;
        let view = ChatRequest::parse(body.as_bytes()).unwrap();
        let c = Contract::from_request(&view, &overrides).unwrap();
        assert!(c
            .check_calls(&[("get_weather".into(), r#"{"city":"Oslo"}"#.into())])
            .is_err());
        assert!(c
            .check_calls(&[("get_weather".into(), r#"{"city":"Oslo","unit":"C"}"#.into())])
            .is_ok());
    }

    #[test]
    fn streamed_deltas_assemble() {
        let mut a = CallAssembler::default();
        assert!(a.push_chunk(r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c","function":{"name":"get_weather","arguments":""}}]}}]}"#).0);
        assert!(a.push_chunk(r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}}]}"#).0);
        assert!(a.push_chunk(r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\"Oslo\"}"}}]}}]}"#).0);
        assert_eq!(
            a.push_chunk(r#"{"choices":[{"delta":{"content":"x"}}]}"#),
            (false, true)
        );
        assert_eq!(
            a.calls(),
            vec![("get_weather".to_owned(), r#"{"city":"Oslo"}"#.to_owned())]
        );
        // A second call on index 0 with its own id (Ollama's parallel calls).
        a.push_chunk(r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"d","function":{"name":"get_time","arguments":"{}"}}]}}]}"#);
        assert_eq!(
            a.calls(),
            vec![
                ("get_weather".to_owned(), r#"{"city":"Oslo"}"#.to_owned()),
                ("get_time".to_owned(), "{}".to_owned())
            ]
        );
    }
}
