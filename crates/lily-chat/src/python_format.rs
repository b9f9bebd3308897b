//! Python's `json.dumps` and `str()` over template values, so that rendered prompts match Hugging Face's
//! Jinja2 environment byte for byte (Python prints `True`, `None`, `1e+16` where Rust would print `true`, `none`,
//! `1e16`).

use minijinja::value::{Value, ValueKind};

/// Options of Python's `json.dumps` as HF's `tojson` filter passes them.
pub struct JsonDumpsOptions {
    pub ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: a newline before each item, indented by `s` per level.
    pub indent: Option<String>,
    pub item_separator: String,
    pub key_separator: String,
    pub sort_keys: bool,
}

impl JsonDumpsOptions {
    /// Python's defaults for the separators depend on whether an indent is given.
    pub fn new(
        ensure_ascii: bool,
        indent: Option<String>,
        separators: Option<(String, String)>,
        sort_keys: bool,
    ) -> Self {
        let (item_separator, key_separator) = separators.unwrap_or_else(|| {
            let item = if indent.is_some() { "," } else { ", " };
            (item.to_string(), ": ".to_string())
        });
        Self {
            ensure_ascii,
            indent,
            item_separator,
            key_separator,
            sort_keys,
        }
    }
}

/// `json.dumps(value, ...)`. Fails, as Python does, on values JSON cannot hold (undefined, objects).
pub fn json_dumps(value: &Value, options: &JsonDumpsOptions) -> Result<String, String> {
    let mut out = String::new();
    write_json(&mut out, value, options, 0)?;
    Ok(out)
}

fn write_json(out: &mut String, value: &Value, options: &JsonDumpsOptions, depth: usize) -> Result<(), String> {
    match value.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&json_number(value)),
        ValueKind::String => write_json_string(out, value.as_str().unwrap_or_default(), options.ensure_ascii),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter().map_err(|error| error.to_string())?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (position, item) in items.iter().enumerate() {
                if position > 0 {
                    out.push_str(&options.item_separator);
                }
                write_newline_indent(out, options, depth + 1);
                write_json(out, item, options, depth + 1)?;
            }
            write_newline_indent(out, options, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter().map_err(|error| error.to_string())? {
                let item = value.get_item(&key).map_err(|error| error.to_string())?;
                entries.push((json_key(&key)?, item));
            }
            if options.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (position, (key, item)) in entries.iter().enumerate() {
                if position > 0 {
                    out.push_str(&options.item_separator);
                }
                write_newline_indent(out, options, depth + 1);
                write_json_string(out, key, options.ensure_ascii);
                out.push_str(&options.key_separator);
                write_json(out, item, options, depth + 1)?;
            }
            write_newline_indent(out, options, depth);
            out.push('}');
        }
        kind => return Err(format!("Object of type {kind} is not JSON serializable")),
    }
    Ok(())
}

fn write_newline_indent(out: &mut String, options: &JsonDumpsOptions, depth: usize) {
    if let Some(indent) = &options.indent {
        out.push('\n');
        for _ in 0..depth {
            out.push_str(indent);
        }
    }
}

/// JSON object keys as Python converts them: strings as they are, `True` -> "true", `None` -> "null", numbers as repr.
fn json_key(key: &Value) -> Result<String, String> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.to_string()),
        ValueKind::None => Ok("null".to_string()),
        ValueKind::Number => Ok(json_number(key)),
        kind => Err(format!("keys must be str, int, float, bool or None, not {kind}")),
    }
}

fn json_number(value: &Value) -> String {
    if value.is_integer() {
        return value.to_string();
    }
    match f64::try_from(value.clone()) {
        Ok(float) if float.is_nan() => "NaN".to_string(),
        Ok(float) if float.is_infinite() => if float > 0.0 { "Infinity" } else { "-Infinity" }.to_string(),
        Ok(float) => python_float_repr(float),
        Err(_) => value.to_string(),
    }
}

fn write_json_string(out: &mut String, text: &str, ensure_ascii: bool) {
    out.push('"');
    for ch in text.chars() {
        match ch {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ch if (ch as u32) < 0x20 || (ensure_ascii && (ch as u32) >= 0x7f) => {
                let mut units = [0u16; 2];
                for unit in ch.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            ch => out.push(ch),
        }
    }
    out.push('"');
}

/// Python's `repr(float)` (equal to `str(float)`): the shortest digits that round-trip, in positional notation
/// when the decimal exponent is in -5..16, else as `d.ddde+XX`.
pub fn python_float_repr(value: f64) -> String {
    if value.is_nan() {
        return "nan".to_string();
    }
    if value.is_infinite() {
        return if value > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    // Rust's `{:e}` gives the same shortest round-trip digits as Python's repr, only laid out differently.
    let scientific = format!("{value:e}");
    let (mantissa, exponent) = scientific.split_once('e').unwrap_or((&scientific, "0"));
    let exponent: i32 = exponent.parse().unwrap_or(0);
    let (sign, mantissa) = match mantissa.strip_prefix('-') {
        Some(rest) => ("-", rest),
        None => ("", mantissa),
    };
    let digits: String = mantissa.chars().filter(|ch| *ch != '.').collect();
    let point = exponent + 1;
    let body = if !(-4 < point && point <= 16) {
        let (first, rest) = digits.split_at(1);
        let fraction = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let exponent_sign = if exponent < 0 { '-' } else { '+' };
        format!("{first}{fraction}e{exponent_sign}{:02}", exponent.abs())
    } else if point <= 0 {
        format!("0.{}{digits}", "0".repeat(point.unsigned_abs() as usize))
    } else if (point as usize) < digits.len() {
        let (whole, fraction) = digits.split_at(point as usize);
        format!("{whole}.{fraction}")
    } else {
        format!("{digits}{}.0", "0".repeat(point as usize - digits.len()))
    };
    format!("{sign}{body}")
}

/// Python's `str(value)` as Jinja2 prints a value: `None`, `True`, `1.5`, `['a', 1]`, `{'k': 'v'}`.
/// Undefined prints as nothing, as with Jinja2's default `Undefined`.
pub fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        ValueKind::Undefined => String::new(),
        _ => python_repr(value),
    }
}

fn python_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::None => "None".to_string(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.to_string(),
        ValueKind::Number if value.is_integer() => value.to_string(),
        ValueKind::Number => f64::try_from(value.clone())
            .map(python_float_repr)
            .unwrap_or_else(|_| value.to_string()),
        ValueKind::String => python_string_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq => {
            let items: Vec<String> = value
                .try_iter()
                .into_iter()
                .flatten()
                .map(|item| python_repr(&item))
                .collect();
            format!("[{}]", items.join(", "))
        }
        ValueKind::Map => {
            let entries: Vec<String> = value
                .try_iter()
                .into_iter()
                .flatten()
                .map(|key| {
                    let item = value.get_item(&key).unwrap_or_default();
                    format!("{}: {}", python_repr(&key), python_repr(&item))
                })
                .collect();
            format!("{{{}}}", entries.join(", "))
        }
        _ => value.to_string(),
    }
}

/// Python's `repr(str)`: single quotes unless the text holds a single quote and no double quote.
fn python_string_repr(text: &str) -> String {
    let quote = if text.contains('\'') && !text.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(text.len() + 2);
    out.push(quote);
    for ch in text.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            ch if ch == quote => {
                out.push('\\');
                out.push(ch);
            }
            ch if (ch as u32) < 0x20 || ch as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", ch as u32)),
            ch => out.push(ch),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps(json: &str, options: &JsonDumpsOptions) -> String {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        json_dumps(&Value::from_serialize(&value), options).unwrap()
    }

    fn hf_default() -> JsonDumpsOptions {
        JsonDumpsOptions::new(false, None, None, false)
    }

    #[test]
    fn float_repr_matches_python() {
        // Expected strings are Python 3's repr() of the same floats.
        let cases = [
            (0.0, "0.0"),
            (-0.0, "-0.0"),
            (1.0, "1.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (123456789012345680.0, "1.2345678901234568e+17"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (-2.5e300, "-2.5e+300"),
            (3.25, "3.25"),
            (123.456, "123.456"),
            (100.0, "100.0"),
            (1e22, "1e+22"),
            (5e-324, "5e-324"),
        ];
        for (value, expected) in cases {
            assert_eq!(python_float_repr(value), expected, "{value:e}");
        }
    }

    #[test]
    fn dumps_matches_python_defaults() {
        let options = hf_default();
        assert_eq!(
            dumps(r#"{"b": 1, "a": [1, 2.0, true, null]}"#, &options),
            r#"{"b": 1, "a": [1, 2.0, true, null]}"#
        );
        assert_eq!(
            dumps(r#"{"x": "é\n\"\\\u0001\u007f😀</"}"#, &options),
            "{\"x\": \"é\\n\\\"\\\\\\u0001\u{7f}😀</\"}"
        );
        assert_eq!(
            dumps(r#"{"big": 1e20, "small": 1e-7, "empty": {}, "list": []}"#, &options),
            r#"{"big": 1e+20, "small": 1e-07, "empty": {}, "list": []}"#
        );
    }

    #[test]
    fn dumps_with_indent_separators_ascii_and_sorting() {
        let indented = JsonDumpsOptions::new(false, Some("  ".into()), None, false);
        assert_eq!(
            dumps(r#"{"a": [1, {"b": 2}], "c": {}}"#, &indented),
            "{\n  \"a\": [\n    1,\n    {\n      \"b\": 2\n    }\n  ],\n  \"c\": {}\n}"
        );
        let compact = JsonDumpsOptions::new(false, None, Some((",".into(), ":".into())), true);
        assert_eq!(dumps(r#"{"b": 1, "a": 2}"#, &compact), r#"{"a":2,"b":1}"#);
        let ascii = JsonDumpsOptions::new(true, None, None, false);
        assert_eq!(dumps(r#"["é😀\u007f"]"#, &ascii), r#"["\u00e9\ud83d\ude00\u007f"]"#);
    }

    #[test]
    fn undefined_is_not_serializable() {
        assert!(json_dumps(&Value::UNDEFINED, &hf_default()).is_err());
    }

    #[test]
    fn str_matches_python() {
        let value: serde_json::Value = serde_json::json!({"k": ["it's", "a\"b", 1.0, true, null]});
        assert_eq!(
            python_str(&Value::from_serialize(&value)),
            r#"{'k': ["it's", 'a"b', 1.0, True, None]}"#
        );
        assert_eq!(python_str(&Value::from(false)), "False");
        assert_eq!(python_str(&Value::from(())), "None");
        assert_eq!(python_str(&Value::from(2.5e16)), "2.5e+16");
        assert_eq!(python_str(&Value::from(7)), "7");
        assert_eq!(python_str(&Value::UNDEFINED), "");
    }
}
