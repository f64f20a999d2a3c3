//! The CLI edge of error handling: a usage error type for flag checks made after parsing, and the
//! mapping from an `anyhow` chain to the documented exit code. Each library error type classifies
//! itself ([`Classify`], next to its definition); this module only finds the first classified
//! cause in a chain.
#![forbid(unsafe_code)]

use std::error::Error;

use crate::exit::{Classify, ExitCode};

/// A usage error detected after argument parsing (a flag combination, a bad value).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

impl Classify for UsageError {
    fn exit_code(&self) -> ExitCode {
        ExitCode::Usage
    }
}

/// Classifies a cause if it is of one particular error type.
type Classifier = fn(&(dyn Error + 'static)) -> Option<ExitCode>;

/// The [`Classifier`] of `E`.
fn class_of<E: Classify + Error + 'static>(cause: &(dyn Error + 'static)) -> Option<ExitCode> {
    cause.downcast_ref::<E>().map(Classify::exit_code)
}

/// Every error type that can reach the CLI, one line each. A cause is of exactly one type, so the
/// order here does not matter; the order of the chain does (outermost first).
const CLASSIFIERS: &[Classifier] = &[
    class_of::<UsageError>,
    class_of::<crate::config::ConfigError>,
    class_of::<crate::checkpoint::CheckpointError>,
    class_of::<crate::tokenizer::TokenizerError>,
    class_of::<crate::chat::template::TemplateError>,
    class_of::<crate::chat::parse::ParseError>,
    class_of::<crate::chat::constrain::ConstrainError>,
    class_of::<crate::trace::TraceError>,
    class_of::<crate::synth::SynthError>,
    class_of::<crate::engine::OpenError>,
    class_of::<crate::engine::EngineError>,
    class_of::<crate::engine::StateFileError>,
    class_of::<crate::engine::measure::MeasureError>,
    class_of::<crate::pipeline::PlacementError>,
    class_of::<crate::model::ModelError>,
    class_of::<crate::model::weights::SourceError>,
    class_of::<kernels::KernelError>,
    class_of::<crate::storage::mmap::StoreError>,
    class_of::<crate::storage::pack::PackError>,
    class_of::<crate::storage::plan::PlanError>,
    class_of::<crate::storage::stream::StreamError>,
    class_of::<crate::storage::stream::cache_sim::TraceError>,
    class_of::<crate::storage::stream::cache_sim::SimError>,
    class_of::<crate::storage::io::IoError>,
    class_of::<crate::interrupt::Interrupted>,
    class_of::<crate::interrupt::InterruptedBatch>,
    class_of::<crate::serve::ServeError>,
    class_of::<crate::files::OutputError>,
    class_of::<crate::files::InputError>,
    class_of::<std::io::Error>,
];

/// Finds the exit code for an error chain: the first cause of a classified type decides (so a
/// library error wrapped in `.context(...)` keeps its code); an unclassified chain is a bug (1).
pub fn exit_code_for(err: &anyhow::Error) -> ExitCode {
    err.chain().find_map(|cause| CLASSIFIERS.iter().find_map(|classify| classify(cause))).unwrap_or(ExitCode::Internal)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::path::PathBuf;
    use std::sync::Arc;

    use anyhow::Context;

    use super::{exit_code_for, UsageError};
    use crate::checkpoint::CheckpointError;
    use crate::config::ConfigError;
    use crate::engine::{EngineError, OpenError};
    use crate::exit::{Classify, ExitCode};
    use crate::model::weights::SourceError;
    use crate::model::ModelError;
    use crate::storage::io::IoError;
    use crate::storage::pack::PackError;
    use crate::storage::stream::cache_sim::{SimError, TraceError};
    use crate::storage::stream::StreamError;

    fn eio() -> std::io::Error {
        std::io::Error::from_raw_os_error(libc::EIO)
    }

    fn short_read() -> IoError {
        IoError::ShortRead { path: PathBuf::from("/t/trunk.pack"), offset: 8192, wanted: 4096, got: 100 }
    }

    fn bad_op() -> IoError {
        IoError::BadOp { tag: 3, why: "min_len 8192 > len 4096".into() }
    }

    fn read_failed() -> IoError {
        IoError::Read { path: PathBuf::from("/t/trunk.pack"), offset: 0, len: 4096, source: eio() }
    }

    /// What the streaming store builds when a read fails.
    fn source_read(e: IoError) -> SourceError {
        let e = Arc::new(e);
        SourceError::Read { what: "layer 3 expert 7".into(), exit_code: e.exit_code(), source: e }
    }

    fn config_read() -> ConfigError {
        ConfigError::Read { path: PathBuf::from("/m/config.json"), source: eio() }
    }

    fn config_invalid() -> ConfigError {
        ConfigError::Invalid { path: PathBuf::from("/m/config.json"), message: "top-k is 0".into() }
    }

    /// Asserts the code of the error `make` builds: alone, under one `.context(...)` as the CLI
    /// adds them, and under two.
    fn check<E: std::error::Error + Send + Sync + 'static>(make: impl Fn() -> E, want: ExitCode) {
        let text = make().to_string();
        let bare = anyhow::Error::new(make());
        let once = Err::<(), E>(make()).context("opening the model").unwrap_err();
        let twice = Err::<(), E>(make()).context("opening the model").context("k3ring run").unwrap_err();
        for (how, err) in [("bare", bare), ("one context", once), ("two contexts", twice)] {
            assert_eq!(exit_code_for(&err), want, "{how}: {text}");
        }
    }

    #[test]
    fn each_error_type_classifies_itself() {
        assert_eq!(bad_op().exit_code(), ExitCode::Internal);
        assert_eq!(short_read().exit_code(), ExitCode::Data);
        assert_eq!(read_failed().exit_code(), ExitCode::Io);
        assert_eq!(config_read().exit_code(), ExitCode::Io);
        assert_eq!(config_invalid().exit_code(), ExitCode::Usage);
        assert_eq!(UsageError("--gen 0".into()).exit_code(), ExitCode::Usage);
        assert_eq!(StreamError::Mismatch("unknown unit".into()).exit_code(), ExitCode::Data);
        let capacity = SimError::CapacityBelowTopK { capacity: 4, top_k: 8 };
        assert_eq!(capacity.exit_code(), ExitCode::Usage);
        let victim = SimError::BadVictim { policy: "lru", victim: None, batch: 0, why: "missing" };
        assert_eq!(victim.exit_code(), ExitCode::Internal);
        let corrupt = SourceError::Corrupt { what: "layer 3".into(), message: "checksum".into() };
        assert_eq!(corrupt.exit_code(), ExitCode::Data);
        assert_eq!(SourceError::Internal("slot".into()).exit_code(), ExitCode::Internal);
        assert_eq!(ModelError::ContextFull { capacity: 8 }.exit_code(), ExitCode::Usage);
        let scale =
            ModelError::Expert { layer: 1, expert: 2, source: kernels::KernelError::BadScale { row: 0, group: 0 } };
        assert_eq!(scale.exit_code(), ExitCode::Data);
        assert_eq!(EngineError::EmptyPrompt.exit_code(), ExitCode::Usage);
        let threads = EngineError::Threads { threads: 4, message: "no".into() };
        assert_eq!(threads.exit_code(), ExitCode::Internal);
    }

    #[test]
    fn wrapped_read_errors_keep_the_read_layer_class() {
        // A read the engine built wrongly is a bug wherever it surfaces, and a short read is data.
        let cases: [(fn() -> IoError, ExitCode); 3] =
            [(bad_op, ExitCode::Internal), (short_read, ExitCode::Data), (read_failed, ExitCode::Io)];
        for (io, want) in cases {
            assert_eq!(source_read(io()).exit_code(), want, "{}", io());
            assert_eq!(ModelError::Source(source_read(io())).exit_code(), want, "{}", io());
            let engine = EngineError::Model(ModelError::Source(source_read(io())));
            assert_eq!(engine.exit_code(), want, "{}", io());
            assert_eq!(StreamError::Io(io()).exit_code(), want, "{}", io());
            assert_eq!(StreamError::PinnedRead(Arc::new(io())).exit_code(), want, "{}", io());
            assert_eq!(OpenError::Stream(StreamError::PinnedRead(Arc::new(io()))).exit_code(), want, "{}", io());
        }
    }

    #[test]
    fn exit_code_for_finds_each_class_under_context() {
        check(|| UsageError("--gen 0".into()), ExitCode::Usage);
        check(config_read, ExitCode::Io);
        check(config_invalid, ExitCode::Usage);
        check(|| OpenError::Config(config_read()), ExitCode::Io);
        check(|| OpenError::Config(config_invalid()), ExitCode::Usage);
        let checkpoint_io = || CheckpointError::Io { path: PathBuf::from("/m/s"), op: "open", source: eio() };
        check(checkpoint_io, ExitCode::Io);
        check(|| CheckpointError::Schema { tensor: "t".into(), message: "missing".into() }, ExitCode::Data);
        check(bad_op, ExitCode::Internal);
        check(short_read, ExitCode::Data);
        check(read_failed, ExitCode::Io);
        check(|| StreamError::Io(bad_op()), ExitCode::Internal);
        check(|| StreamError::PinnedRead(Arc::new(short_read())), ExitCode::Data);
        check(|| OpenError::Stream(StreamError::PinnedRead(Arc::new(short_read()))), ExitCode::Data);
        check(|| StreamError::Pack(PackError::Stale { dir: PathBuf::from("/t") }), ExitCode::Data);
        check(|| EngineError::Model(ModelError::Source(source_read(bad_op()))), ExitCode::Internal);
        check(|| EngineError::Model(ModelError::Source(source_read(short_read()))), ExitCode::Data);
        check(|| EngineError::Model(ModelError::Source(source_read(read_failed()))), ExitCode::Io);
        check(|| source_read(bad_op()), ExitCode::Internal);
        check(|| EngineError::RouteLog(TraceError::Invalid { reason: "x".into() }), ExitCode::Data);
        check(|| SimError::CapacityBelowTopK { capacity: 4, top_k: 8 }, ExitCode::Usage);
        check(|| crate::storage::plan::PlanError::UnknownPreset("huge".into()), ExitCode::Usage);
        check(|| crate::pipeline::PlacementError::Empty { flag: "--compute-cores" }, ExitCode::Usage);
        check(|| crate::synth::SynthError::Options { flag: "--experts", message: "0".into() }, ExitCode::Usage);
        check(|| crate::tokenizer::TokenizerError::UnknownId(9), ExitCode::Usage);
        check(|| crate::storage::mmap::StoreError::Changed { path: "/m/s".into(), indexed: 1, now: 2 }, ExitCode::Data);
        check(eio, ExitCode::Io);
    }

    #[test]
    fn an_unclassified_chain_is_a_bug() {
        let err = anyhow::anyhow!("generated ids differ between cells").context("k3ring bench");
        assert_eq!(exit_code_for(&err), ExitCode::Internal);
    }
}
