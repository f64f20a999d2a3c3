//! What a span is: [`SpanKind`], chosen by the caller when the span opens, and the two things
//! derived from it alone: its [`Stage`] (the Chrome `cat` and half of the track key) and the
//! [`Metric`] it feeds, if any. Metrics never look at a span's name, so renaming a span cannot
//! move it between busy, overlap and stall.
//!
//! Plain data, no threads, no allocation.

use serde::Serialize;

/// The pipeline stage a span belongs to; it is the trace category and half of the track key.
/// Derived from the [`SpanKind`], never passed by callers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    Io,
    Compute,
    Scheduler,
}

impl Stage {
    pub const ALL: [Stage; 3] = [Stage::Io, Stage::Compute, Stage::Scheduler];

    /// The name used as the Chrome `cat` and in track names.
    pub const fn as_str(self) -> &'static str {
        match self {
            Stage::Io => "io",
            Stage::Compute => "compute",
            Stage::Scheduler => "scheduler",
        }
    }

    pub(super) const fn index(self) -> usize {
        self as usize
    }
}

/// The compute a span covers. Its [`ComputeOp::name`] is the span's name in the trace;
/// [`crate::trace::Tracer::span_seconds`] selects spans by op.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ComputeOp {
    /// Attention and the block-residual read before the FFN, one layer.
    Attention,
    /// The router scores and the top-k choice of one MoE layer.
    Router,
    /// The shared experts and the latent down projection of one MoE layer.
    SharedExperts,
    /// One routed expert's compute (its wait for bytes excluded).
    Expert,
    /// The weighted sum of the routed experts, the latent norm and the up projection.
    LatentUp,
    /// The FFN of a dense layer.
    DenseFfn,
    /// The final norm and the output head.
    Head,
    /// The prefetcher's routing guess for a later layer.
    Speculation,
}

impl ComputeOp {
    pub const ALL: [ComputeOp; 8] = [
        ComputeOp::Attention,
        ComputeOp::Router,
        ComputeOp::SharedExperts,
        ComputeOp::Expert,
        ComputeOp::LatentUp,
        ComputeOp::DenseFfn,
        ComputeOp::Head,
        ComputeOp::Speculation,
    ];

    /// The span name shown in the trace viewer.
    pub const fn name(self) -> &'static str {
        match self {
            ComputeOp::Attention => "attention",
            ComputeOp::Router => "router",
            ComputeOp::SharedExperts => "shared experts, latent down",
            ComputeOp::Expert => "expert",
            ComputeOp::LatentUp => "latent norm, up",
            ComputeOp::DenseFfn => "dense ffn",
            ComputeOp::Head => "head",
            ComputeOp::Speculation => "speculation",
        }
    }
}

/// What a span is, chosen when it opens. It fixes the span's stage, its name and the metric
/// it feeds; the free-form names of `Io` and `Scheduler` spans are for the viewer only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpanKind {
    /// A read on the I/O thread ("trunk read", "expert read", ...): I/O busy time.
    Io(&'static str),
    /// Compute on a compute thread: compute busy time.
    Compute(ComputeOp),
    /// The scheduler blocked until the bytes it needs were read: stall time. Named "wait".
    Wait,
    /// Any other scheduler work: shown in the trace, counted in no metric.
    Scheduler(&'static str),
}

impl SpanKind {
    /// The Chrome category and track stage.
    pub const fn stage(self) -> Stage {
        match self {
            SpanKind::Io(_) => Stage::Io,
            SpanKind::Compute(_) => Stage::Compute,
            SpanKind::Wait | SpanKind::Scheduler(_) => Stage::Scheduler,
        }
    }

    /// The span name shown in the trace viewer.
    pub const fn name(self) -> &'static str {
        match self {
            SpanKind::Io(name) | SpanKind::Scheduler(name) => name,
            SpanKind::Compute(op) => op.name(),
            SpanKind::Wait => "wait",
        }
    }

    /// The metric this span's time counts in; decided by the variant alone.
    pub(super) const fn metric(self) -> Option<Metric> {
        match self {
            SpanKind::Io(_) => Some(Metric::Io),
            SpanKind::Compute(_) => Some(Metric::Compute),
            SpanKind::Wait => Some(Metric::Stall),
            SpanKind::Scheduler(_) => None,
        }
    }
}

impl From<ComputeOp> for SpanKind {
    fn from(op: ComputeOp) -> Self {
        SpanKind::Compute(op)
    }
}

/// A metric track: what [`crate::trace::Metrics`] measures a union of. Indexes the per-track
/// arrays of the recorder and the fold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Metric {
    Io,
    Compute,
    Stall,
}

pub(super) const METRIC_COUNT: usize = 3;

impl Metric {
    pub(super) const fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn trace_compute_op_names_are_the_trace_span_names() {
        let names = ComputeOp::ALL.map(ComputeOp::name);
        assert_eq!(
            names,
            [
                "attention",
                "router",
                "shared experts, latent down",
                "expert",
                "latent norm, up",
                "dense ffn",
                "head",
                "speculation"
            ]
        );
    }

    #[test]
    fn trace_metric_follows_the_kind_not_the_name() {
        assert_eq!(SpanKind::Wait.metric(), Some(Metric::Stall));
        assert_eq!(SpanKind::Scheduler("wait").metric(), None);
        assert_eq!(SpanKind::Io("wait").metric(), Some(Metric::Io));
        assert_eq!(SpanKind::Compute(ComputeOp::Expert).metric(), Some(Metric::Compute));
        assert_eq!(SpanKind::Wait.stage(), Stage::Scheduler);
        assert_eq!(SpanKind::Scheduler("plan").stage(), Stage::Scheduler);
        assert_eq!(SpanKind::from(ComputeOp::Head).name(), "head");
        assert_eq!(Metric::Stall.index(), METRIC_COUNT - 1);
    }

    #[test]
    fn trace_stage_serializes_lowercase() {
        assert_eq!(serde_json::to_string(&Stage::Io).unwrap(), "\"io\"");
        assert_eq!(serde_json::to_string(&Stage::Scheduler).unwrap(), "\"scheduler\"");
    }
}
