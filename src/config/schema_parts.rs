//! Schema-only types and patterns: how the JSON Schema of routes.yaml
//! (`switchyard schema`) says what `validate` says, where JSON Schema can.
//!
//! Nothing here is deserialized; the raw types name these with
//! `#[schemars(with = ...)]`. The sets of names (`protocol`, `strategy`,
//! `action`, ...) are listed from the types that parse them, and the
//! protocols from the adapter registry, so the schema cannot drift from what
//! the code accepts.

use std::borrow::Cow;
use std::marker::PhantomData;

use schemars::{json_schema, JsonSchema, Schema, SchemaGenerator};

use super::Strategy;
use crate::classify::{Action, NetworkKind};
use crate::health::AllDown;
use crate::schema::Mode;
use crate::upstream::{Place, ADAPTERS};

/// Units humantime reads, longest spelling first.
const UNITS: &str = "nanos|nsec|ns|usec|us|µs|millis|msec|ms|seconds|second|secs|sec|s|minutes|minute|mins|min|m|hours|hour|hrs|hr|h|days|day|d|weeks|week|wks|wk|w|months|month|M|years|year|yrs|yr|y";

/// A humantime duration: one or more `<number>[.<fraction>] <unit>` spans
/// (`250ms`, `1.5s`, `1h 30m`), as `humantime::parse_duration` reads them.
fn humantime() -> String {
    format!(r"^\s*([0-9]+(\.[0-9]+)?\s*({UNITS})\s*)+$")
}

/// A humantime duration that is zero (`0s`, `0 ms`, `0h 0m`).
fn zero() -> String {
    format!(r"^\s*(0+(\.0+)?\s*({UNITS})\s*)+$")
}

/// `IP:PORT` as `SocketAddr` parses it: IPv4, or IPv6 in brackets.
pub const SOCKET_ADDR: &str = r"^([0-9]{1,3}(\.[0-9]{1,3}){3}|\[[0-9A-Fa-f:.%]+\]):[0-9]{1,5}$";

/// An absolute `http://` or `https://` URL with a host and no query string
/// (the scheme in any case, as `http::Uri` reads it).
pub const HTTP_URL: &str = r"^[hH][tT][tT][pP][sS]?://[^/?#\s]+(/[^?#\s]*)?$";

/// An HTTP header name (an RFC 9110 token).
pub const HEADER_NAME: &str = r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$";

/// An HTTP header value: visible ASCII, spaces and tabs.
pub const HEADER_VALUE: &str = r"^[\t -~]*$";

/// A status as text: a code 100-599 or a class `1xx`-`5xx`.
const STATUS_TEXT: &str = r"^\s*[1-5]([0-9]{2}|xx|XX)\s*$";

/// An HTTP error status (400-599), as a key of `sanitize.messages`.
pub const ERROR_STATUS: &str = "^[45][0-9]{2}$";

/// A `shared_state.redis.key_prefix`: 1-64 letters, digits and `_ . : -`.
pub const KEY_PREFIX: &str = r"^[A-Za-z0-9_.:-]{1,64}$";

/// Text with something other than whitespace in it.
pub const NOT_BLANK: &str = r"\S";

/// A fixed set of names that validate accepts for one key.
pub trait NameSet {
    /// The set's name (schemars keeps inline schemas apart by it).
    const NAME: &'static str;
    /// Every name, in the order messages list them.
    fn names() -> Vec<&'static str>;
}

/// Schema of one name of the set `S`.
pub struct Names<S>(PhantomData<S>);

impl<S: NameSet> JsonSchema for Names<S> {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed(S::NAME)
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "enum": S::names() })
    }
}

/// `providers.*.protocol`: the adapters of this build.
pub struct Protocols;

impl NameSet for Protocols {
    const NAME: &'static str = "Protocol";
    fn names() -> Vec<&'static str> {
        ADAPTERS.iter().map(|a| a.name()).collect()
    }
}

/// The description of `protocol`, from the registry: each protocol and the
/// path under `base_url` its requests go to.
#[must_use]
pub fn protocol_description() -> String {
    let each: Vec<String> = ADAPTERS
        .iter()
        .map(|a| format!("`{}` (`{{base_url}}/{}`)", a.name(), a.chat_path()))
        .collect();
    format!(
        "Wire protocol, one of {} (default `{}`); it sets the path requests go to and the header that carries the key.",
        each.join(", "),
        ADAPTERS.first().map_or("openai", |a| a.name())
    )
}

/// What each protocol requires of a provider, and which settings only some
/// protocols read, as the JSON Schema's conditions (from the registry, as
/// `validate` checks them): `base_url` unless the protocol has a default
/// (Gemini's) or the place settings that make one (Bedrock's `region`,
/// Vertex AI's `project` and `location`).
pub fn provider_rules(schema: &mut Schema) {
    let is = |names: Vec<&str>| json_schema!({ "required": ["protocol"], "properties": { "protocol": { "enum": names } } });
    let mut rules = Vec::new();
    for adapter in ADAPTERS {
        let then = if adapter.default_base_url(&Place::default()).is_ok() {
            continue;
        } else if adapter.place_required().is_empty() {
            json_schema!({ "required": ["base_url"] })
        } else {
            json_schema!({ "anyOf": [{ "required": ["base_url"] }, { "required": adapter.place_required() }] })
        };
        let when = if ADAPTERS
            .first()
            .is_some_and(|first| first.name() == adapter.name())
        {
            json_schema!({ "anyOf": [{ "not": { "required": ["protocol"] } }, is(vec![adapter.name()])] })
        } else {
            is(vec![adapter.name()])
        };
        rules.push(json_schema!({ "if": when, "then": then }));
    }
    let mut keys: Vec<&str> = ADAPTERS
        .iter()
        .flat_map(|a| a.place_keys())
        .copied()
        .collect();
    keys.sort_unstable();
    keys.dedup();
    for key in keys {
        let readers = ADAPTERS
            .iter()
            .filter(|a| a.place_keys().contains(&key))
            .map(|a| a.name())
            .collect();
        rules.push(json_schema!({ "if": { "required": [key] }, "then": is(readers) }));
    }
    schema.insert("allOf".into(), rules.into());
}

/// `tasks.*.strategy`.
pub struct Strategies;

impl NameSet for Strategies {
    const NAME: &'static str = "Strategy";
    fn names() -> Vec<&'static str> {
        Strategy::ALL.iter().map(|s| s.as_str()).collect()
    }
}

/// `error_classes[*].action`.
pub struct Actions;

impl NameSet for Actions {
    const NAME: &'static str = "Action";
    fn names() -> Vec<&'static str> {
        Action::ALL.iter().map(|a| a.as_str()).collect()
    }
}

/// `tasks.*.validate_tool_calls`.
pub struct Modes;

impl NameSet for Modes {
    const NAME: &'static str = "ValidateToolCalls";
    fn names() -> Vec<&'static str> {
        Mode::ALL.iter().map(|m| m.as_str()).collect()
    }
}

/// `tasks.*.priority`.
pub struct Priorities;

impl NameSet for Priorities {
    const NAME: &'static str = "Priority";
    fn names() -> Vec<&'static str> {
        crate::config::Priority::ALL
            .iter()
            .map(|p| p.as_str())
            .collect()
    }
}

/// `tasks.*.contract.repair[*]`.
pub struct Repairs;

impl NameSet for Repairs {
    const NAME: &'static str = "Repair";
    fn names() -> Vec<&'static str> {
        crate::schema::Repair::ALL
            .iter()
            .map(|m| m.as_str())
            .collect()
    }
}

/// `health.all_down`.
pub struct AllDownChoices;

impl NameSet for AllDownChoices {
    const NAME: &'static str = "AllDown";
    fn names() -> Vec<&'static str> {
        AllDown::ALL.iter().map(|a| a.as_str()).collect()
    }
}

/// `error_classes[*].match.network[*]`.
pub struct NetworkKinds;

impl NameSet for NetworkKinds {
    const NAME: &'static str = "NetworkKind";
    fn names() -> Vec<&'static str> {
        NetworkKind::ALL.iter().map(|k| k.as_str()).collect()
    }
}

/// `tasks.*.cache.mode`.
pub struct CacheModes;

impl NameSet for CacheModes {
    const NAME: &'static str = "CacheMode";
    fn names() -> Vec<&'static str> {
        crate::cache::MODES.to_vec()
    }
}

/// Schema of a size in bytes: a count, or a number and a unit.
pub struct ByteSizeText;

impl JsonSchema for ByteSizeText {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed("ByteSize")
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "Bytes, or a number and a unit: `64MiB`, `500KB`, `1GiB`.",
            "type": ["string", "integer"],
            "pattern": r"^\s*[0-9]+(\.[0-9]+)?\s*([KMGT]i?B|[kKMGT]|B)?\s*$",
            "minimum": 1
        })
    }
}

/// Schema of a duration that must be more than zero: humantime text.
pub struct DurationText;

impl JsonSchema for DurationText {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed("Duration")
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A humantime duration greater than zero: `250ms`, `30s`, `1m 30s`.",
            "type": "string",
            "pattern": humantime(),
            // Typed, so that the `null` an optional key may hold is not refused.
            "not": { "type": "string", "pattern": zero() }
        })
    }
}

/// Schema of a duration where zero means "off": humantime text, or `0`.
pub struct DurationOrOff;

impl JsonSchema for DurationOrOff {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed("DurationOrOff")
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "description": "A humantime duration (`60s`), or `0` for off.",
            "anyOf": [
                { "type": "string", "pattern": humantime() },
                { "enum": [0, "0"] }
            ]
        })
    }
}

/// Schema of a cooldown: a duration, or `retry_after`.
pub struct CooldownText;

impl JsonSchema for CooldownText {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed("Cooldown")
    }

    fn json_schema(generator: &mut SchemaGenerator) -> Schema {
        json_schema!({
            "anyOf": [
                DurationText::json_schema(generator),
                { "enum": ["retry_after", "until_reload"] }
            ]
        })
    }
}

/// Schema of a rule's `status` test: a code, a class, or a non-empty list of them.
pub struct StatusTests;

impl JsonSchema for StatusTests {
    fn inline_schema() -> bool {
        true
    }

    fn schema_name() -> Cow<'static, str> {
        Cow::Borrowed("StatusTests")
    }

    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        let one = json_schema!({
            "anyOf": [
                { "type": "integer", "minimum": 100, "maximum": 599 },
                { "type": "string", "pattern": STATUS_TEXT }
            ]
        });
        json_schema!({
            "anyOf": [
                one.clone(),
                { "type": "array", "items": one, "minItems": 1 }
            ]
        })
    }
}
