//! The shard layout, like the release's (spec 1): the embedding opens the first shard, each
//! layer's tensors are contiguous (trunk in forward order, then its experts in a seeded non-id
//! order, each expert's six tensors adjacent), the head closes the last shard. A new shard starts
//! at a layer boundary once the current one holds [`SHARD_BYTES_MIN`], so k3 and small dims get
//! about one shard per layer; a layer whose experts would push a shard past
//! [`super::SHARD_BYTES_MAX`] continues in the next shard, split between two experts.

use crate::checkpoint::{Dtype, ExpectedTensor, MODEL_PREFIX};
use crate::config::Config;
use crate::rng::SplitMix64;

use super::fill::{fill_for, tensor_key, Fill, FillContext};
use super::{SynthError, SynthOptions, SHARD_BYTES_MAX};

/// A shard closes at the next layer boundary once it holds this much (tiny dims share shards).
pub const SHARD_BYTES_MIN: u64 = 512 * 1024;
/// Salt of the expert-order stream.
const EXPERT_ORDER_SALT: u64 = 0x4558_5045_5254_5321;

/// One tensor placed in a shard.
#[derive(Debug)]
pub struct PlannedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub fill: Fill,
    /// Stream key of its values.
    pub key: u64,
    /// Byte offset relative to the shard's data start.
    pub offset: u64,
    pub len: u64,
}

/// One shard file: its header bytes (length prefix included) and tensors in data order.
#[derive(Debug)]
pub struct ShardPlan {
    pub file_name: String,
    pub header: Vec<u8>,
    pub tensors: Vec<PlannedTensor>,
    pub data_len: u64,
}

impl ShardPlan {
    pub fn file_len(&self) -> u64 {
        self.header.len() as u64 + self.data_len
    }
}

fn bytes_of(t: &ExpectedTensor) -> u64 {
    t.shapes[0].iter().product::<u64>() * t.dtype.size()
}

/// Groups shards: a group (one tensor, a layer's trunk, or one expert) never straddles shards.
struct Builder {
    shards: Vec<Vec<ExpectedTensor>>,
    current: Vec<ExpectedTensor>,
    current_bytes: u64,
}

impl Builder {
    fn close(&mut self) {
        if !self.current.is_empty() {
            self.shards.push(std::mem::take(&mut self.current));
            self.current_bytes = 0;
        }
    }

    fn layer_boundary(&mut self) {
        if self.current_bytes >= SHARD_BYTES_MIN {
            self.close();
        }
    }

    fn push_group(&mut self, group: Vec<ExpectedTensor>) {
        let bytes: u64 = group.iter().map(bytes_of).sum();
        if self.current_bytes + bytes > SHARD_BYTES_MAX {
            self.close();
        }
        self.current_bytes += bytes;
        self.current.extend(group);
    }
}

/// The tensors of one layer, split into trunk and experts (by id).
#[derive(Default)]
struct LayerTensors {
    trunk: Vec<ExpectedTensor>,
    experts: Vec<Vec<ExpectedTensor>>,
}

/// The seeded storage order of a layer's experts; never the id order (for 2+ experts).
pub fn expert_order(seed: u64, layer: usize, n_experts: usize) -> Vec<usize> {
    let mut rng = SplitMix64::new(seed ^ EXPERT_ORDER_SALT ^ (layer as u64).wrapping_mul(0x1000_0000_01b3));
    let mut order: Vec<usize> = (0..n_experts).collect();
    rng.shuffle(&mut order);
    if n_experts >= 2 && order.iter().enumerate().all(|(i, &e)| i == e) {
        order.swap(0, 1);
    }
    order
}

/// Places every tensor `cfg` requires into shards and builds their headers.
pub fn plan(cfg: &Config, opts: &SynthOptions) -> Result<Vec<ShardPlan>, SynthError> {
    let embed_name = format!("{MODEL_PREFIX}embed_tokens.weight");
    let mut embed = Vec::new();
    let mut head = Vec::new();
    let mut layers: Vec<LayerTensors> = (0..cfg.n_layers).map(|_| LayerTensors::default()).collect();
    for t in crate::checkpoint::expected_tensors(cfg) {
        match (t.layer, t.expert) {
            (None, _) if t.name == embed_name => embed.push(t),
            (None, _) => head.push(t),
            (Some(l), None) => layers[l].trunk.push(t),
            (Some(l), Some(e)) => {
                let experts = &mut layers[l].experts;
                if experts.len() <= e {
                    experts.resize_with(e + 1, Vec::new);
                }
                experts[e].push(t);
            }
        }
    }
    let mut b = Builder { shards: Vec::new(), current: Vec::new(), current_bytes: 0 };
    b.push_group(embed);
    for (l, layer) in layers.into_iter().enumerate() {
        if l > 0 {
            b.layer_boundary();
        }
        b.push_group(layer.trunk);
        let mut experts: Vec<Option<Vec<ExpectedTensor>>> = layer.experts.into_iter().map(Some).collect();
        for e in expert_order(opts.seed, l, experts.len()) {
            let group = experts[e].take().ok_or_else(|| SynthError::Internal(format!("expert {e} placed twice")))?;
            b.push_group(group);
        }
    }
    b.push_group(head);
    b.close();
    let ctx =
        FillContext { layers: opts.layers, kda_heads: opts.dims.kda_heads, routing_locality: opts.routing_locality };
    let count = b.shards.len();
    b.shards.into_iter().enumerate().map(|(i, list)| shard_plan(i, count, list, &ctx, opts.seed)).collect()
}

fn shard_plan(
    index: usize,
    count: usize,
    list: Vec<ExpectedTensor>,
    ctx: &FillContext,
    seed: u64,
) -> Result<ShardPlan, SynthError> {
    let mut tensors = Vec::with_capacity(list.len());
    let mut offset = 0u64;
    for t in list {
        let len = bytes_of(&t);
        tensors.push(PlannedTensor {
            fill: fill_for(&t, ctx)?,
            key: tensor_key(seed, &t.name),
            name: t.name,
            dtype: t.dtype,
            shape: t.shapes[0].clone(),
            offset,
            len,
        });
        offset += len;
    }
    Ok(ShardPlan {
        file_name: format!("model-{:05}-of-{count:05}.safetensors", index + 1),
        header: header_bytes(&tensors)?,
        tensors,
        data_len: offset,
    })
}

/// The safetensors header: u64 length, then JSON padded with spaces to a multiple of 8 (as
/// [`crate::checkpoint::safetensors::serialize`] writes it), with the release's `__metadata__`.
fn header_bytes(tensors: &[PlannedTensor]) -> Result<Vec<u8>, SynthError> {
    let mut map = serde_json::Map::new();
    map.insert("__metadata__".to_owned(), serde_json::json!({"format": "pt"}));
    for t in tensors {
        map.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [t.offset, t.offset + t.len]}),
        );
    }
    let mut v = serde_json::Value::Object(map);
    v.sort_all_objects();
    let mut json = serde_json::to_vec(&v).map_err(|e| SynthError::Internal(e.to_string()))?;
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}
