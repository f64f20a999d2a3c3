//! Weight handles: every tensor the forward pass reads, resolved once at load into ids, plus the
//! store interface that turns ids into bytes.
//!
//! The math never sees a file or a buffer, only [`WeightSource`]: the in-memory store hands out
//! views of mapped shards, and the streaming store hands out slots it keeps alive for as long as
//! the guard lives. Resolution happens once, so the per-token path formats no names and does no
//! lookups.

use crate::checkpoint::{CheckpointError, CheckpointIndex, Dtype, ExpertPart, EXPERT_PARTS, LM_HEAD, MODEL_PREFIX};
use crate::config::{AttnKind, Config, FfnKind};
use crate::exit::{Classify, ExitCode};

/// Position of a tensor in the checkpoint index.
pub type TensorId = usize;

/// A bf16 matrix [rows, cols], row-major.
#[derive(Clone, Copy, Debug)]
pub struct Mat {
    pub id: TensorId,
    pub rows: usize,
    pub cols: usize,
}

/// A vector of `len` elements stored as bf16 or f32.
#[derive(Clone, Copy, Debug)]
pub struct Vector {
    pub id: TensorId,
    pub len: usize,
    pub dtype: Dtype,
}

/// KDA weights of one layer (`layers.{l}.self_attn.`).
#[derive(Clone, Debug)]
pub struct KdaWeights {
    pub q_proj: Mat,      // [W, D]
    pub k_proj: Mat,      // [W, D]
    pub v_proj: Mat,      // [W, D]
    pub q_conv1d: Vector, // [W, 1, conv] f32
    pub k_conv1d: Vector, // [W, 1, conv] f32
    pub v_conv1d: Vector, // [W, 1, conv] f32
    pub f_a_proj: Mat,    // [head_dim, D]
    pub f_b_proj: Mat,    // [W, head_dim]
    pub a_log: Vector,    // [>= heads] f32, one per HEAD
    pub dt_bias: Vector,  // [W] f32
    pub b_proj: Mat,      // [heads, D]
    pub g_proj: Mat,      // [W, D]
    pub o_norm: Vector,   // [head_dim] f32
    pub o_proj: Mat,      // [D, W]
}

/// Gated MLA weights of one layer.
#[derive(Clone, Debug)]
pub struct MlaWeights {
    pub q_a_proj: Mat,           // [q_lora, D]
    pub q_a_layernorm: Vector,   // [q_lora]
    pub q_b_proj: Mat,           // [heads * (nope + rope), q_lora]
    pub kv_a_proj_with_mqa: Mat, // [kv_lora + rope, D]
    pub kv_a_layernorm: Vector,  // [kv_lora]
    pub kv_b_proj: Mat,          // [heads * (nope + v), kv_lora]
    pub g_proj: Mat,             // [heads * v, D]
    pub o_proj: Mat,             // [D, heads * v]
}

/// Dense SiTU-GLU MLP (layer 0).
#[derive(Clone, Debug)]
pub struct DenseWeights {
    pub gate_proj: Mat, // [I, D]
    pub up_proj: Mat,   // [I, D]
    pub down_proj: Mat, // [D, I]
}

/// Latent MoE weights of one layer, without the routed experts (they come from the store).
#[derive(Clone, Debug)]
pub struct MoeWeights {
    pub gate: Mat,                       // [E, D] router
    pub e_score_correction_bias: Vector, // [E] f32, selection only
    pub routed_expert_down_proj: Mat,    // [LAT, D]
    pub routed_expert_norm: Vector,      // [LAT]
    pub routed_expert_up_proj: Mat,      // [D, LAT]
    /// Fused shared experts (gate, up, down), absent when the config has none.
    pub shared: Option<DenseWeights>,
}

#[derive(Clone, Debug)]
pub enum AttnWeights {
    Kda(KdaWeights),
    Mla(MlaWeights),
}

#[derive(Clone, Debug)]
pub enum FfnWeights {
    Dense(DenseWeights),
    Moe(MoeWeights),
}

/// One attention-residual read: RMS-normalised candidates scored by norm weight x projection.
#[derive(Clone, Copy, Debug)]
pub struct ResWeights {
    pub norm: Vector, // [D] bf16 (g)
    pub proj: Vector, // [1, D] bf16 (w)
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_res: ResWeights,
    pub input_layernorm: Vector,
    pub attn: AttnWeights,
    pub mlp_res: ResWeights,
    pub post_attention_layernorm: Vector,
    pub ffn: FfnWeights,
}

/// Embedding, head and the final norms.
#[derive(Clone, Debug)]
pub struct GlobalWeights {
    pub embed_tokens: Mat, // [V, D]
    pub output_res: ResWeights,
    pub norm: Vector, // [D]
    pub lm_head: Mat, // [V, D]
}

/// Every trunk tensor of the model, resolved to ids.
#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub globals: GlobalWeights,
    pub layers: Vec<LayerWeights>,
}

/// The six tensors of one expert as byte slices (MXFP4 packed + E8M0 scales).
#[derive(Clone, Copy, Debug)]
pub struct ExpertBytes<'a> {
    pub w1_packed: &'a [u8], // [F, LAT/2] gate
    pub w1_scale: &'a [u8],  // [F, LAT/32]
    pub w3_packed: &'a [u8], // [F, LAT/2] up
    pub w3_scale: &'a [u8],  // [F, LAT/32]
    pub w2_packed: &'a [u8], // [LAT, F/2] down
    pub w2_scale: &'a [u8],  // [LAT, F/32]
}

impl<'a> ExpertBytes<'a> {
    /// Builds from the parts in [`EXPERT_PARTS`] order.
    pub fn from_parts(parts: [&'a [u8]; 6]) -> ExpertBytes<'a> {
        debug_assert_eq!(EXPERT_PARTS[0], ExpertPart::W1Packed);
        let [w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale] = parts;
        ExpertBytes { w1_packed, w1_scale, w3_packed, w3_scale, w2_packed, w2_scale }
    }

    /// The parts in [`EXPERT_PARTS`] order.
    pub fn parts(self) -> [&'a [u8]; 6] {
        [self.w1_packed, self.w1_scale, self.w3_packed, self.w3_scale, self.w2_packed, self.w2_scale]
    }
}

/// Failure to produce weight bytes: a failed read, corrupt data, or an engine bug.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    /// A read failed; `exit_code` is the storage layer's classification of `source` (4 I/O, 3 a
    /// file shorter than its index, 1 a read the engine built wrongly). The model cannot name the
    /// storage error types (storage depends on the model, not the reverse), so the store
    /// classifies the error when it builds this variant.
    #[error("reading {what}: {source}")]
    Read { what: String, exit_code: ExitCode, source: std::sync::Arc<dyn std::error::Error + Send + Sync> },
    #[error("{what}: {message}")]
    Corrupt { what: String, message: String },
    #[error("internal error in the weight store: {0}")]
    Internal(String),
}

impl Classify for SourceError {
    fn exit_code(&self) -> ExitCode {
        match self {
            SourceError::Read { exit_code, .. } => *exit_code,
            SourceError::Corrupt { .. } => ExitCode::Data,
            SourceError::Internal(_) => ExitCode::Internal,
        }
    }
}

/// A trunk matrix as the forward pass consumes it: row blocks must be whole multiples of `granule` rows
/// (except the matrix's last block), so that a block never splits what one computation needs.
#[derive(Clone, Copy, Debug)]
pub struct Streamed {
    pub mat: Mat,
    pub granule: usize,
}

/// Bytes of the trunk tensors of one unit (a layer or the globals), alive while the guard lives.
///
/// The unit's vectors are read whole with [`TrunkView::bytes`]; its bf16 matrices (those
/// [`LayerWeights::streamed`] and [`GlobalWeights::head_streamed`] list) only through
/// [`TrunkView::row_blocks`], so that a store may hold a matrix in pieces and never whole.
pub trait TrunkView {
    /// The bytes of tensor `id`; only ids of this unit are valid.
    fn bytes(&self, id: TensorId) -> &[u8];
    /// Runs `f` on consecutive row blocks of `mat`, in increasing row order, covering all rows once:
    /// `f(rows, bytes_of_those_rows)`. Default: one block, the whole matrix from `bytes`.
    fn row_blocks(&self, mat: &Mat, f: &mut dyn FnMut(std::ops::Range<usize>, &[u8])) -> Result<(), SourceError> {
        f(0..mat.rows, self.bytes(mat.id));
        Ok(())
    }
}

/// Checks the blocks of one `row_blocks` call against its contract as they come: consecutive
/// from row 0, each a whole number of granules (but the last), each `rows * cols * 2` bytes.
/// A block that breaks it is not computed, and [`BlockCheck::finish`] reports it: a store bug
/// must be an error, not a panic in a kernel nor, worse, output rows silently left stale.
pub(crate) struct BlockCheck {
    mat: Mat,
    granule: usize,
    next: usize,
    bad: Option<String>,
}

impl BlockCheck {
    pub(crate) fn new(s: Streamed) -> BlockCheck {
        BlockCheck { mat: s.mat, granule: s.granule.max(1), next: 0, bad: None }
    }

    /// Whether the block `rows` with `bytes` may be computed (records why not otherwise).
    pub(crate) fn admit(&mut self, rows: &std::ops::Range<usize>, bytes: &[u8]) -> bool {
        if self.bad.is_some() {
            return false;
        }
        let m = self.mat;
        let why = if rows.start != self.next || rows.end <= rows.start || rows.end > m.rows {
            Some(format!("rows {rows:?} where rows {}.. of {} were due", self.next, m.rows))
        } else if rows.end < m.rows && !rows.len().is_multiple_of(self.granule) {
            Some(format!("rows {rows:?}: not a whole number of {}-row granules", self.granule))
        } else if Some(bytes.len()) != rows.len().checked_mul(m.cols).and_then(|n| n.checked_mul(2)) {
            Some(format!("rows {rows:?} came as {} bytes, not {} x {} x 2", bytes.len(), rows.len(), m.cols))
        } else {
            None
        };
        match why {
            Some(w) => {
                self.bad = Some(w);
                false
            }
            None => {
                self.next = rows.end;
                true
            }
        }
    }

    /// Ok when every row came once, in order, in admissible blocks.
    pub(crate) fn finish(self) -> Result<(), SourceError> {
        let m = self.mat;
        match self.bad {
            Some(w) => Err(SourceError::Internal(format!("row blocks of tensor {}: {w}", m.id))),
            None if self.next != m.rows => Err(SourceError::Internal(format!(
                "row blocks of tensor {}: stopped at row {} of {}",
                m.id, self.next, m.rows
            ))),
            None => Ok(()),
        }
    }
}

/// Bytes of one routed expert, alive while the guard lives.
pub trait ExpertView {
    fn parts(&self) -> ExpertBytes<'_>;

    /// Whether the bytes are still to be checked against their checksum (only from
    /// [`WeightSource::expert_unchecked`]): no result computed from them may be used before
    /// [`ExpertView::confirm`] accepts the checksum the products hashed
    /// ([`ProductChecksum`](super::expert_check::ProductChecksum)).
    fn unchecked(&self) -> bool {
        false
    }

    /// Settles an unchecked expert's check with `sum`, its bytes' checksum, whose hashing added
    /// `hashing_seconds` to the products. `Ok(true)`: the bytes match and the expert
    /// is checked. `Ok(false)`: they do not; the expert has left the source, every result
    /// computed from it must be dropped, and [`WeightSource::expert`] reads it again. `Err`: its
    /// previous read failed too, and the run stops. A checked expert's view accepts any sum.
    fn confirm(self, _sum: u64, _hashing_seconds: f64) -> Result<bool, SourceError>
    where
        Self: Sized,
    {
        Ok(true)
    }
}

/// Which trunk unit to make resident. The embedding is not a unit: it is read by rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TrunkUnit {
    /// Output aggregator, final norm and lm_head.
    Head,
    Layer(usize),
}

/// The one interface between the math and where weight bytes live.
pub trait WeightSource: Sync {
    type Trunk<'a>: TrunkView + Sync
    where
        Self: 'a;
    type Expert<'a>: ExpertView + Send + Sync
    where
        Self: 'a;

    /// Makes a trunk unit resident and returns its bytes.
    fn trunk(&self, unit: TrunkUnit) -> Result<Self::Trunk<'_>, SourceError>;

    /// Copies the bf16 rows `ids` of the embedding table `table` into `out`
    /// (`ids.len() * table.cols * 2` bytes). Every id is below `table.rows` (checked by the caller).
    fn embed_rows(&self, table: &Mat, ids: &[u32], out: &mut [u8]) -> Result<(), SourceError>;

    /// The distinct experts `layer` needs for the chunk being computed, as soon as its routing
    /// has chosen them. A streaming store starts their reads here and may reorder `experts`
    /// into the order their bytes will arrive; the model computes them in that order (each
    /// token still sums in its own top-k order, so the result does not depend on it). The
    /// default does nothing.
    fn request(&self, _layer: usize, _experts: &mut [usize]) {}

    /// Makes one routed expert resident and returns its bytes.
    fn expert(&self, layer: usize, expert: usize) -> Result<Self::Expert<'_>, SourceError>;

    /// [`WeightSource::expert`], except that a source that checks the bytes it reads may leave
    /// the check to the products that read them ([`ExpertView::unchecked`]), which hash them in
    /// cache. The default is [`WeightSource::expert`].
    fn expert_unchecked(&self, layer: usize, expert: usize) -> Result<Self::Expert<'_>, SourceError> {
        self.expert(layer, expert)
    }
}

/// Resolves names to ids; every lookup has been validated against the config by
/// [`CheckpointIndex::validate`], but a missing name is still an error, not a panic.
struct Resolver<'a> {
    index: &'a CheckpointIndex,
}

impl Resolver<'_> {
    fn id(&self, name: &str) -> Result<TensorId, CheckpointError> {
        self.index.position(name).ok_or_else(|| CheckpointError::Schema {
            tensor: name.to_owned(),
            message: "missing from the checkpoint".to_owned(),
        })
    }

    fn mat(&self, name: &str) -> Result<Mat, CheckpointError> {
        let id = self.id(name)?;
        let t = &self.index.tensors[id];
        let bad = || CheckpointError::Schema {
            tensor: name.to_owned(),
            message: format!("expected a BF16 matrix, found {} {:?}", t.dtype.name(), t.shape),
        };
        if t.dtype != Dtype::Bf16 || t.shape.len() != 2 {
            return Err(bad());
        }
        Ok(Mat { id, rows: t.shape[0] as usize, cols: t.shape[1] as usize })
    }

    fn vector(&self, name: &str) -> Result<Vector, CheckpointError> {
        let id = self.id(name)?;
        let t = &self.index.tensors[id];
        if t.dtype != Dtype::Bf16 && t.dtype != Dtype::F32 {
            return Err(CheckpointError::Schema {
                tensor: name.to_owned(),
                message: format!("expected BF16 or F32, found {}", t.dtype.name()),
            });
        }
        Ok(Vector { id, len: t.elements() as usize, dtype: t.dtype })
    }

    fn res(&self, prefix: &str) -> Result<ResWeights, CheckpointError> {
        Ok(ResWeights {
            norm: self.vector(&format!("{prefix}_norm.weight"))?,
            proj: self.vector(&format!("{prefix}_proj.weight"))?,
        })
    }

    fn dense(&self, p: &str) -> Result<DenseWeights, CheckpointError> {
        Ok(DenseWeights {
            gate_proj: self.mat(&format!("{p}gate_proj.weight"))?,
            up_proj: self.mat(&format!("{p}up_proj.weight"))?,
            down_proj: self.mat(&format!("{p}down_proj.weight"))?,
        })
    }

    fn kda(&self, a: &str) -> Result<KdaWeights, CheckpointError> {
        let m = |s: &str| self.mat(&format!("{a}{s}.weight"));
        let v = |s: &str| self.vector(&format!("{a}{s}"));
        Ok(KdaWeights {
            q_proj: m("q_proj")?,
            k_proj: m("k_proj")?,
            v_proj: m("v_proj")?,
            q_conv1d: v("q_conv1d.weight")?,
            k_conv1d: v("k_conv1d.weight")?,
            v_conv1d: v("v_conv1d.weight")?,
            f_a_proj: m("f_a_proj")?,
            f_b_proj: m("f_b_proj")?,
            a_log: v("A_log")?,
            dt_bias: v("dt_bias")?,
            b_proj: m("b_proj")?,
            g_proj: m("g_proj")?,
            o_norm: v("o_norm.weight")?,
            o_proj: m("o_proj")?,
        })
    }

    fn mla(&self, a: &str) -> Result<MlaWeights, CheckpointError> {
        let m = |s: &str| self.mat(&format!("{a}{s}.weight"));
        let v = |s: &str| self.vector(&format!("{a}{s}.weight"));
        Ok(MlaWeights {
            q_a_proj: m("q_a_proj")?,
            q_a_layernorm: v("q_a_layernorm")?,
            q_b_proj: m("q_b_proj")?,
            kv_a_proj_with_mqa: m("kv_a_proj_with_mqa")?,
            kv_a_layernorm: v("kv_a_layernorm")?,
            kv_b_proj: m("kv_b_proj")?,
            g_proj: m("g_proj")?,
            o_proj: m("o_proj")?,
        })
    }

    fn moe(&self, b: &str, cfg: &Config) -> Result<MoeWeights, CheckpointError> {
        Ok(MoeWeights {
            gate: self.mat(&format!("{b}gate.weight"))?,
            e_score_correction_bias: self.vector(&format!("{b}gate.e_score_correction_bias"))?,
            routed_expert_down_proj: self.mat(&format!("{b}routed_expert_down_proj.weight"))?,
            routed_expert_norm: self.vector(&format!("{b}routed_expert_norm.weight"))?,
            routed_expert_up_proj: self.mat(&format!("{b}routed_expert_up_proj.weight"))?,
            shared: if cfg.moe.shared_hidden() > 0 { Some(self.dense(&format!("{b}shared_experts."))?) } else { None },
        })
    }

    fn layer(&self, cfg: &Config, l: usize) -> Result<LayerWeights, CheckpointError> {
        let p = format!("{MODEL_PREFIX}layers.{l}.");
        let plan = cfg.layers[l];
        let a = format!("{p}self_attn.");
        Ok(LayerWeights {
            attn_res: self.res(&format!("{p}self_attention_res"))?,
            input_layernorm: self.vector(&format!("{p}input_layernorm.weight"))?,
            attn: match plan.attn {
                AttnKind::Kda => AttnWeights::Kda(self.kda(&a)?),
                AttnKind::Mla => AttnWeights::Mla(self.mla(&a)?),
            },
            mlp_res: self.res(&format!("{p}mlp_res"))?,
            post_attention_layernorm: self.vector(&format!("{p}post_attention_layernorm.weight"))?,
            ffn: match plan.ffn {
                FfnKind::Dense => FfnWeights::Dense(self.dense(&format!("{p}mlp."))?),
                FfnKind::Moe => FfnWeights::Moe(self.moe(&format!("{p}block_sparse_moe."), cfg)?),
            },
        })
    }
}

/// The granule of a matrix consumed by row-wise products: the kernels' block, so that a piece
/// splits over the threads exactly as the whole matrix does.
const PRODUCT_GRANULE: usize = kernels::ROWS_PER_BLOCK;

impl Streamed {
    /// A matrix of a row-wise product (`y = W x`): any block of whole kernel blocks will do.
    pub(crate) fn product(mat: Mat) -> Streamed {
        Streamed { mat, granule: PRODUCT_GRANULE }
    }

    /// MLA's `kv_b_proj`: the attention slices it per head (W_kb then W_vb), so a block must
    /// hold whole heads.
    pub(crate) fn kv_b(cfg: &Config, mat: Mat) -> Streamed {
        Streamed { mat, granule: cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim }
    }
}

fn product(mat: Mat) -> Streamed {
    Streamed::product(mat)
}

impl DenseWeights {
    /// gate, up, down: the order of [`super::dense::glu_mlp`].
    fn streamed_into(&self, out: &mut Vec<Streamed>) {
        out.extend([self.gate_proj, self.up_proj, self.down_proj].map(product));
    }
}

impl LayerWeights {
    /// Every matrix of the layer's trunk unit, in the exact order the forward pass first reads it
    /// (the same for one token, a prefill chunk and a batch step), with its granule.
    pub fn streamed(&self, cfg: &Config) -> Vec<Streamed> {
        let mut out = Vec::with_capacity(16);
        match &self.attn {
            // kda::project (q, k, v, f_a, f_b, b, g), then kda::output (o).
            AttnWeights::Kda(w) => out.extend(
                [w.q_proj, w.k_proj, w.v_proj, w.f_a_proj, w.f_b_proj, w.b_proj, w.g_proj, w.o_proj].map(product),
            ),
            // mla::project (q_a, q_b, kv_a, g), mla::attend_all (kv_b), mla::output (o).
            AttnWeights::Mla(w) => {
                out.extend([w.q_a_proj, w.q_b_proj, w.kv_a_proj_with_mqa, w.g_proj].map(product));
                out.push(Streamed::kv_b(cfg, w.kv_b_proj));
                out.push(product(w.o_proj));
            }
        }
        match &self.ffn {
            FfnWeights::Dense(w) => w.streamed_into(&mut out),
            // moe::forward: the router, the shared experts, the latent down then up projection.
            FfnWeights::Moe(w) => {
                out.push(product(w.gate));
                if let Some(shared) = &w.shared {
                    shared.streamed_into(&mut out);
                }
                out.extend([w.routed_expert_down_proj, w.routed_expert_up_proj].map(product));
            }
        }
        out
    }
}

impl GlobalWeights {
    /// The head unit's matrices (lm_head) in the order the head reads them. The embedding is not part of it.
    pub fn head_streamed(&self) -> Vec<Streamed> {
        vec![product(self.lm_head)]
    }
}

impl ModelWeights {
    /// Resolves every trunk tensor of `cfg` in `index`.
    pub fn resolve(cfg: &Config, index: &CheckpointIndex) -> Result<ModelWeights, CheckpointError> {
        let r = Resolver { index };
        let globals = GlobalWeights {
            embed_tokens: r.mat(&format!("{MODEL_PREFIX}embed_tokens.weight"))?,
            output_res: r.res(&format!("{MODEL_PREFIX}output_attn_res"))?,
            norm: r.vector(&format!("{MODEL_PREFIX}norm.weight"))?,
            lm_head: r.mat(LM_HEAD)?,
        };
        let layers = (0..cfg.n_layers).map(|l| r.layer(cfg, l)).collect::<Result<_, _>>()?;
        Ok(ModelWeights { globals, layers })
    }
}

/// Reads element `i` of an f32 vector stored as raw little-endian bytes.
#[inline]
pub fn f32_at(bytes: &[u8], i: usize) -> f32 {
    let b = &bytes[4 * i..4 * i + 4];
    f32::from_le_bytes([b[0], b[1], b[2], b[3]])
}

/// Reads element `i` of a vector stored as bf16 or f32 bytes.
#[inline]
pub fn vector_at(bytes: &[u8], dtype: Dtype, i: usize) -> f32 {
    match dtype {
        Dtype::F32 => f32_at(bytes, i),
        _ => f32::from_bits(u32::from(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])) << 16),
    }
}

/// Expands a bf16 or f32 vector into `out` (norm weights used by f32 kernels).
pub fn vector_into(bytes: &[u8], dtype: Dtype, out: &mut [f32]) {
    for (i, o) in out.iter_mut().enumerate() {
        *o = vector_at(bytes, dtype, i);
    }
}
