//! The documented exit codes and the mapping from library errors to them.
#![forbid(unsafe_code)]

use crate::checkpoint::CheckpointError;
use crate::config::ConfigError;
use crate::engine::EngineError;
use crate::model::weights::SourceError;
use crate::model::ModelError;
use crate::storage::mmap::StoreError;
use crate::tokenizer::TokenizerError;

/// Process exit codes, documented in the README.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum ExitCode {
    Ok = 0,
    /// A bug: an invariant failed or an error with no better class.
    Internal = 1,
    /// Usage or config refused.
    Usage = 2,
    /// Checkpoint or data invalid.
    Data = 3,
    /// I/O failure.
    Io = 4,
}

/// A usage error detected after argument parsing (a flag combination, a bad value).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

fn source_code(e: &SourceError) -> ExitCode {
    match e {
        SourceError::Read { exit_code: 3, .. } | SourceError::Corrupt { .. } => ExitCode::Data,
        SourceError::Read { .. } => ExitCode::Io,
        SourceError::Internal(_) => ExitCode::Internal,
    }
}

fn model_code(e: &ModelError) -> ExitCode {
    match e {
        ModelError::Source(s) => source_code(s),
        ModelError::Expert { .. } | ModelError::NonFinite { .. } => ExitCode::Data,
        ModelError::ContextFull { .. } | ModelError::TokenOutOfRange { .. } => ExitCode::Usage,
        ModelError::Internal(_) => ExitCode::Internal,
    }
}

fn classify(cause: &(dyn std::error::Error + 'static)) -> Option<ExitCode> {
    if let Some(e) = cause.downcast_ref::<ConfigError>() {
        return Some(match e {
            ConfigError::Read { .. } => ExitCode::Io,
            _ => ExitCode::Usage,
        });
    }
    if cause.is::<UsageError>() {
        return Some(ExitCode::Usage);
    }
    if let Some(e) = cause.downcast_ref::<CheckpointError>() {
        return Some(if e.exit_code() == 4 { ExitCode::Io } else { ExitCode::Data });
    }
    if let Some(e) = cause.downcast_ref::<EngineError>() {
        return Some(match e {
            EngineError::Model(m) => model_code(m),
            EngineError::Memory { .. } | EngineError::EmptyPrompt => ExitCode::Usage,
            EngineError::Threads { .. } => ExitCode::Internal,
            EngineError::RouteLog(t) => {
                if t.exit_code() == 4 {
                    ExitCode::Io
                } else {
                    ExitCode::Data
                }
            }
        });
    }
    if let Some(e) = cause.downcast_ref::<crate::engine::OpenError>() {
        use crate::engine::OpenError as O;
        let inner: &(dyn std::error::Error + 'static) = match e {
            O::Config(e) => e,
            O::Checkpoint(e) => e,
            O::Store(e) => e,
            O::Tokenizer(e) => e,
            O::Engine(e) => e,
            O::Pack(e) => e,
            O::Plan(e) => e,
            O::Stream(e) => e,
        };
        return classify(inner);
    }
    if let Some(e) = cause.downcast_ref::<ModelError>() {
        return Some(model_code(e));
    }
    if let Some(e) = cause.downcast_ref::<SourceError>() {
        return Some(source_code(e));
    }
    if let Some(e) = cause.downcast_ref::<StoreError>() {
        return Some(match e {
            StoreError::Map { .. } => ExitCode::Io,
            StoreError::Changed { .. } => ExitCode::Data,
        });
    }
    if let Some(e) = cause.downcast_ref::<TokenizerError>() {
        return Some(match e {
            TokenizerError::Io { .. } => ExitCode::Io,
            TokenizerError::Vocab { .. } | TokenizerError::Config { .. } => ExitCode::Data,
            TokenizerError::UnknownId(_) => ExitCode::Usage,
            TokenizerError::Regex(_) => ExitCode::Internal,
        });
    }
    if let Some(e) = cause.downcast_ref::<crate::storage::stream::cache_sim::TraceError>() {
        return Some(if e.exit_code() == 4 { ExitCode::Io } else { ExitCode::Data });
    }
    if let Some(e) = cause.downcast_ref::<crate::synth::SynthError>() {
        return Some(match e.exit_code() {
            2 => ExitCode::Usage,
            4 => ExitCode::Io,
            _ => ExitCode::Internal,
        });
    }
    if cause.is::<crate::storage::plan::PlanError>() {
        return Some(ExitCode::Usage);
    }
    if let Some(e) = cause.downcast_ref::<crate::storage::stream::StreamError>() {
        return Some(match e.exit_code() {
            4 => ExitCode::Io,
            1 => ExitCode::Internal,
            _ => ExitCode::Data,
        });
    }
    if let Some(e) = cause.downcast_ref::<crate::storage::pack::PackError>() {
        return Some(if e.exit_code() == 4 { ExitCode::Io } else { ExitCode::Data });
    }
    if cause.is::<std::io::Error>() {
        return Some(ExitCode::Io);
    }
    None
}

/// Finds the exit code for an error chain: the first error of a known class decides.
pub fn exit_code_for(err: &anyhow::Error) -> ExitCode {
    err.chain().find_map(classify).unwrap_or(ExitCode::Internal)
}
