//! Span arguments: [`SpanArgs`] (layer, expert, bytes, slot, kind and one free value) and
//! [`ArgValue`], shown with a span in the trace viewer and serialized as the Chrome `args`
//! object. Plain `Copy` data built on the recording thread; no allocation.

use serde::ser::SerializeMap;
use serde::{Serialize, Serializer};

/// One free-form span argument value.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ArgValue {
    U64(u64),
    I64(i64),
    F64(f64),
    Str(&'static str),
}

impl Serialize for ArgValue {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match *self {
            ArgValue::U64(v) => s.serialize_u64(v),
            ArgValue::I64(v) => s.serialize_i64(v),
            ArgValue::F64(v) => s.serialize_f64(v),
            ArgValue::Str(v) => s.serialize_str(v),
        }
    }
}

impl From<u64> for ArgValue {
    fn from(v: u64) -> Self {
        ArgValue::U64(v)
    }
}
impl From<u32> for ArgValue {
    fn from(v: u32) -> Self {
        ArgValue::U64(u64::from(v))
    }
}
impl From<i64> for ArgValue {
    fn from(v: i64) -> Self {
        ArgValue::I64(v)
    }
}
impl From<f64> for ArgValue {
    fn from(v: f64) -> Self {
        ArgValue::F64(v)
    }
}
impl From<&'static str> for ArgValue {
    fn from(v: &'static str) -> Self {
        ArgValue::Str(v)
    }
}

/// Arguments shown with a span in the trace viewer. Fixed-size and `Copy`, so passing them costs
/// nothing when `detail` is off. Build with `SpanArgs::new().layer(3).expert(17).bytes(n)`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SpanArgs {
    pub layer: Option<u32>,
    pub expert: Option<u32>,
    pub bytes: Option<u64>,
    /// An arena slot or buffer index.
    pub slot: Option<u32>,
    /// Why a read was issued: `"speculative"` or `"demand"`.
    pub kind: Option<&'static str>,
    /// One more named value (queue depth, token index, ...).
    pub extra: Option<(&'static str, ArgValue)>,
}

impl SpanArgs {
    pub const fn new() -> Self {
        SpanArgs { layer: None, expert: None, bytes: None, slot: None, kind: None, extra: None }
    }
    pub const fn layer(mut self, layer: u32) -> Self {
        self.layer = Some(layer);
        self
    }
    pub const fn expert(mut self, expert: u32) -> Self {
        self.expert = Some(expert);
        self
    }
    pub const fn bytes(mut self, bytes: u64) -> Self {
        self.bytes = Some(bytes);
        self
    }
    pub const fn slot(mut self, slot: u32) -> Self {
        self.slot = Some(slot);
        self
    }
    pub const fn kind(mut self, kind: &'static str) -> Self {
        self.kind = Some(kind);
        self
    }
    pub fn extra(mut self, key: &'static str, value: impl Into<ArgValue>) -> Self {
        self.extra = Some((key, value.into()));
        self
    }
}

impl Serialize for SpanArgs {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(None)?;
        if let Some(v) = self.layer {
            map.serialize_entry("layer", &v)?;
        }
        if let Some(v) = self.expert {
            map.serialize_entry("expert", &v)?;
        }
        if let Some(v) = self.bytes {
            map.serialize_entry("bytes", &v)?;
        }
        if let Some(v) = self.slot {
            map.serialize_entry("slot", &v)?;
        }
        if let Some(v) = self.kind {
            map.serialize_entry("kind", v)?;
        }
        if let Some((k, v)) = self.extra {
            map.serialize_entry(k, &v)?;
        }
        map.end()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn trace_span_args_serialize_only_set_fields_in_order() {
        let args = SpanArgs::new().kind("demand").slot(2).bytes(4096).expert(17).layer(3).extra("depth", 1.5);
        let json = serde_json::to_string(&args).unwrap();
        assert_eq!(json, r#"{"layer":3,"expert":17,"bytes":4096,"slot":2,"kind":"demand","depth":1.5}"#);
        assert_eq!(serde_json::to_string(&SpanArgs::new()).unwrap(), "{}");
    }
}
