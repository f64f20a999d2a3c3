//! The two ways the pipeline can run.

use serde::Serialize;

/// How reads are ordered against compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Reads overlap compute: trunk read-ahead, a layer's experts computed as each arrives,
    /// the next layer's experts predicted and read early.
    #[default]
    Pipelined,
    /// The public C engine's order: a trunk unit is read when it is needed, a layer's expert
    /// reads are all waited for before any of them is computed, nothing is predicted.
    Serial,
}

impl Mode {
    pub fn parse(s: &str) -> Option<Mode> {
        match s {
            "pipelined" => Some(Mode::Pipelined),
            "serial" => Some(Mode::Serial),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Mode::Pipelined => "pipelined",
            Mode::Serial => "serial",
        }
    }

    /// Streamed trunk units read ahead of the one computing, given what was asked.
    pub fn readahead(self, asked: usize) -> usize {
        match self {
            Mode::Pipelined => asked,
            Mode::Serial => 0,
        }
    }

    /// Whether experts may be read before a layer's routing asks for them.
    pub fn predicts(self) -> bool {
        self == Mode::Pipelined
    }

    /// Whether a layer waits for all of its expert reads before computing any expert.
    pub fn waits_for_every_read(self) -> bool {
        self == Mode::Serial
    }
}
