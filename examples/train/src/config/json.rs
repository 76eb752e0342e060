//! Reading a configuration from JSON: any subset of the fields, each checked against
//! the known ones (an unknown field names the nearest known one) and their JSON types, no
//! key twice; and comparing two configurations field by field.

use anyhow::Context;
use serde_json::{Map, Value};

use super::TrainConfig;
use crate::fields::{self, DEVICES};
use crate::tasks::{Task, TaskConfig};
use crate::text::echo;

impl TrainConfig {
    /// Parses a configuration: a JSON object with any subset of the fields, the task and
    /// the model given as objects or by name.
    ///
    /// # Errors
    /// When it is not JSON or not an object; naming the field: an unknown one (with the
    /// nearest known field), or a value of the wrong type (with the type it takes).
    pub fn from_json(text: &str) -> anyhow::Result<Self> {
        Self::from_json_as(text, None)
    }

    /// As [`from_json`](Self::from_json), with the task `task` (the `--task` flag, which
    /// overrides the text's as every flag does) or else the one the text names: the
    /// fields left out take that task's defaults ([`defaults`](Self::defaults)).
    ///
    /// # Errors
    /// As [`from_json`](Self::from_json).
    pub fn from_json_as(text: &str, task: Option<Task>) -> anyhow::Result<Self> {
        let mut given: Value =
            serde_json::from_str(text).context("not JSON (a training configuration)")?;
        check_unique_keys(text)?;
        if let Value::Object(fields) = &mut given {
            for (key, inner) in [("task", "task"), ("model", "kind")] {
                if let Some(name @ Value::String(_)) = fields.get_mut(key) {
                    let object = Value::Object(Map::from_iter([(inner.into(), name.take())]));
                    *name = object;
                }
            }
        }
        check_fields(&given, &Self::shape(), "")?;
        let named = lookup(&given, "task.task")
            .cloned()
            .map(serde_json::from_value::<Task>)
            .transpose()
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let flag = task;
        let Some(task) = flag.or(named) else {
            return serde_json::from_value(given).map_err(|e| anyhow::anyhow!("{e}"));
        };
        let mut full = serde_json::to_value(Self::defaults(task)).expect("a config serialises");
        overlay(&mut full, given);
        if flag.is_some() {
            full["task"]["task"] = serde_json::to_value(task).expect("a task serialises");
        }
        serde_json::from_value(full).map_err(|e| anyhow::anyhow!("{e}"))
    }

    /// The configuration as JSON with every optional field given, so that each field's
    /// JSON type can be read off it.
    fn shape() -> Value {
        let config = Self {
            task: TaskConfig {
                data: Some("corpus.txt".into()),
                vocab: Some("ab".into()),
                ..TaskConfig::default()
            },
            warmup_steps: Some(1),
            decay_steps: Some(1),
            fixed_shapes: Some(false),
            ..Self::default()
        };
        serde_json::to_value(config).expect("a config serialises")
    }

    /// The dotted paths of the fields whose values differ between `self` and `other`.
    pub fn changed_fields(&self, other: &Self) -> Vec<String> {
        let [a, b] = [self, other].map(|c| serde_json::to_value(c).expect("a config serialises"));
        let mut changed = Vec::new();
        diff(&a, &b, "", &mut changed);
        changed
    }
}

/// Checks that `given` is an object whose every key is a key of `known` (at the same
/// place), recursively, with a value of the JSON type of `known`'s.
fn check_fields(given: &Value, known: &Value, path: &str) -> anyhow::Result<()> {
    let Value::Object(known) = known else {
        return check_type(given, known, path);
    };
    let Value::Object(given) = given else {
        match path.is_empty() {
            true => anyhow::bail!(
                "a configuration must be a JSON object of fields (`{{\"lr\": 0.001}}`), got {}",
                json_type(given)
            ),
            false => anyhow::bail!("`{path}` must be an object, got {}", json_type(given)),
        }
    };
    for (key, value) in given {
        let full = join(path, key);
        match known.get(key) {
            Some(inner) => check_fields(value, inner, &full)?,
            None => anyhow::bail!(
                "unknown field `{}`{}",
                echo(&full),
                match fields::nearest(key) {
                    Some(field) => format!(" (did you mean `{}`?)", field.path),
                    None => format!("; the fields here are {}", names(known, path)),
                }
            ),
        }
    }
    Ok(())
}

/// Checks that the value of the field at `path` has the JSON type of `known` (an example
/// value); `null` is taken where the default is `null`.
fn check_type(given: &Value, known: &Value, path: &str) -> anyhow::Result<()> {
    if path == DEVICES.path {
        let index = |v: &Value| v.is_u64();
        anyhow::ensure!(
            index(given) || given.as_array().is_some_and(|list| list.iter().all(index)),
            "`{path}` must be a whole number (how many) or an array of them (which), got {}",
            json_type(given)
        );
        return Ok(());
    }
    let defaults = serde_json::to_value(TrainConfig::default()).expect("a config serialises");
    let optional = lookup(&defaults, path).is_some_and(Value::is_null);
    // A whole number past u64 (serde_json reads it as a float); u64::MAX itself, which
    // rounds to 2^64 as a float, is a u64.
    if known.is_u64()
        && !given.is_u64()
        && let Some(big) = given
            .as_f64()
            .filter(|v| *v >= u64::MAX as f64 && v.fract() == 0.0)
    {
        anyhow::bail!(
            "`{path}` = {}: too large, at most {}",
            echo(&format!("{big:.0}")),
            u64::MAX
        );
    }
    let (fits, wanted) = match known {
        Value::Bool(_) => (given.is_boolean(), "true or false"),
        Value::Number(n) if n.is_u64() => (given.is_u64(), "a whole number, 0 or more"),
        Value::Number(_) => (given.is_number(), "a number"),
        Value::String(_) => (given.is_string(), "a string"),
        _ => (true, ""),
    };
    anyhow::ensure!(
        fits || (optional && given.is_null()),
        "`{path}` must be {wanted}{}, got {}",
        match optional {
            true => " or null",
            false => "",
        },
        json_type(given)
    );
    Ok(())
}

/// Refuses a key given twice in one object of the JSON `text` (which a JSON reader would
/// otherwise settle silently, the last one winning), naming it.
fn check_unique_keys(text: &str) -> anyhow::Result<()> {
    use serde::de::{DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
    /// Walks a value, failing on a repeated key; `path` is where it is.
    struct Unique(String);
    impl<'de> DeserializeSeed<'de> for Unique {
        type Value = ();
        fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> Visitor<'de> for Unique {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON value")
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element_seed(Unique(self.0.clone()))?.is_some() {}
            Ok(())
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                let full = join(&self.0, &key);
                if !seen.insert(key) {
                    return Err(serde::de::Error::custom(format!(
                        "`{}` is given twice; give each field once",
                        echo(&full)
                    )));
                }
                map.next_value_seed(Unique(full))?;
            }
            Ok(())
        }
    }
    let mut reader = serde_json::Deserializer::from_str(text);
    Unique(String::new())
        .deserialize(&mut reader)
        .map_err(|e| anyhow::anyhow!("{e}"))
}

/// A JSON value as a message names it: "a string (\"64\")", "an array".
fn json_type(value: &Value) -> String {
    match value {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("{b}"),
        Value::Number(n) => format!("the number {}", echo(&n.to_string())),
        Value::String(text) => format!("a string (\"{}\")", echo(text)),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
    }
}

/// The dotted names of the keys of `object` under `path`.
fn names(object: &Map<String, Value>, path: &str) -> String {
    let names: Vec<String> = object
        .keys()
        .map(|k| format!("`{}`", join(path, k)))
        .collect();
    names.join(", ")
}

pub(super) fn join(path: &str, key: &str) -> String {
    match path.is_empty() {
        true => key.to_string(),
        false => format!("{path}.{key}"),
    }
}

/// Writes the fields of `given` over those of `base`, object by object.
fn overlay(base: &mut Value, given: Value) {
    match (base, given) {
        (Value::Object(base), Value::Object(given)) => {
            for (key, value) in given {
                match base.get_mut(&key) {
                    Some(inner) => overlay(inner, value),
                    None => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, given) => *base = given,
    }
}

/// The value at a dotted `path`.
pub(super) fn lookup<'a>(value: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(value, |v, key| v.get(key))
}

/// Pushes the dotted paths of the leaves that differ between `a` and `b`.
fn diff(a: &Value, b: &Value, path: &str, out: &mut Vec<String>) {
    match (a, b) {
        (Value::Object(a), Value::Object(b)) => {
            for (key, value) in a {
                diff(
                    value,
                    b.get(key).unwrap_or(&Value::Null),
                    &join(path, key),
                    out,
                );
            }
        }
        (a, b) if a != b => out.push(path.to_string()),
        _ => {}
    }
}
