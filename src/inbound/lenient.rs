//! Readers for the fields of a chat answer that only describe it (ids,
//! model names, token counts): one of an odd type (`null`, a float count, a
//! number for a name) reads as absent, so an answer the engine accepted is
//! never rendered empty because of a field the client's protocol would
//! have carried anyway.

use std::fmt;

use serde::de::{self, Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;

/// A JSON value read for its scalar, if it is one; containers are skipped
/// without being kept.
enum Scalar {
    Text(String),
    Number(f64),
    Absent,
}

struct ScalarVisitor;

impl<'de> Visitor<'de> for ScalarVisitor {
    type Value = Scalar;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Scalar, E> {
        Ok(Scalar::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Scalar, E> {
        Ok(Scalar::Text(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Scalar, E> {
        #[allow(clippy::cast_precision_loss)] // a count, far below 2^53
        Ok(Scalar::Number(v as f64))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Scalar, E> {
        #[allow(clippy::cast_precision_loss)]
        Ok(Scalar::Number(v as f64))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Scalar, E> {
        Ok(Scalar::Number(v))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<Scalar, E> {
        Ok(Scalar::Absent)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar::Absent)
    }

    fn visit_none<E: de::Error>(self) -> Result<Scalar, E> {
        Ok(Scalar::Absent)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Scalar, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Scalar::Absent)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Scalar::Absent)
    }
}

fn scalar<'de, D: Deserializer<'de>>(d: D) -> Result<Scalar, D::Error> {
    d.deserialize_any(ScalarVisitor)
}

/// A string, or `None` for anything else.
pub(super) fn text<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match scalar(d)? {
        Scalar::Text(text) => Some(text),
        Scalar::Number(_) | Scalar::Absent => None,
    })
}

/// A string, or empty for anything else.
pub(super) fn text_or_empty<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    text(d).map(Option::unwrap_or_default)
}

/// A non-negative number (a float rounded, a numeric string read), or `None`.
pub(super) fn count<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    let number = match scalar(d)? {
        Scalar::Number(n) => n,
        Scalar::Text(text) => text.trim().parse().unwrap_or(f64::NAN),
        Scalar::Absent => f64::NAN,
    };
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)] // checked finite, ≥ 0
    Ok((number.is_finite() && number >= 0.0).then(|| number.round() as u64))
}

/// [`count`], 0 when absent.
pub(super) fn count_or_zero<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
    count(d).map(Option::unwrap_or_default)
}

/// A list, empty when `null` or not a list of `T`.
pub(super) fn list<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(match Value::deserialize(d)? {
        Value::Array(items) => items
            .into_iter()
            .filter_map(|item| T::deserialize(item).ok())
            .collect(),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) | Value::Object(_) => {
            Vec::new()
        }
    })
}

/// A list, empty when `null` (its items read as they are).
pub(super) fn null_as_empty<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<Vec<T>>::deserialize(d).map(Option::unwrap_or_default)
}

/// Message content as text: a string, or the text of an array of parts
/// (`{"type": "text", "text": …}`), joined.
pub(super) fn content<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(text) => Some(text),
        Value::Array(parts) => Some(
            parts
                .iter()
                .filter_map(|p| p.get("text").and_then(Value::as_str))
                .collect(),
        ),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::Object(_) => None,
    })
}

/// A call's arguments as JSON text: a string as it is, any other value
/// written (some servers send the object itself), `None` for `null`.
pub(super) fn arguments<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(text) => Some(text),
        Value::Null => None,
        other @ (Value::Bool(_) | Value::Number(_) | Value::Array(_) | Value::Object(_)) => {
            Some(other.to_string())
        }
    })
}
