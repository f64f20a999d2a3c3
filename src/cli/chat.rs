//! `k3ring chat`: a REPL over the K3 chat template that keeps the model state between turns.
//!
//! Reads one turn per line from stdin (a terminal or a pipe, so tests can drive it); a line
//! starting with `/` is a command. Replies stream to stdout as they are generated (reasoning
//! dimmed on a terminal, or hidden); everything else goes to stderr, so stdout holds only the
//! replies. After every turn the transcript (`--history`) and the state (`--save-state`) are
//! written atomically.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::budget::name_budget_flag;
use super::run::{streaming_run, typed_budget_flag};
use super::startup::{start_up, startup_flags, Started};
use super::{parse_chunk, parse_probability, parse_temperature, StorageArgs};
use crate::chat::parse::{Channel, Event};
use crate::chat::template::{Effort, Specials, Thinking};
use crate::chat::Conversation;
use crate::engine::{open_resident, open_streaming, ChatSession, Fingerprint, Opened, ReplyOptions, Sampling};
use crate::error::UsageError;
use crate::files::input::{read_line_capped, LineRead};
use crate::model::weights::WeightSource;
use crate::model::LayerHook;
use crate::storage::stream::StreamStats;
use crate::tokenizer::StreamDecoder;

/// `k3ring chat`: talk to the model through its chat template.
#[derive(Debug, Clone, clap::Args)]
#[command(allow_negative_numbers = true, args_override_self = true)]
pub struct ChatArgs {
    /// Model directory (default: the embedded tiny model).
    #[arg(short = 'm', long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// The system message.
    #[arg(long, value_name = "TEXT")]
    pub system: Option<String>,
    /// Thinking off: the reply opens with the response, and stored reasoning is dropped.
    #[arg(long)]
    pub no_think: bool,
    /// How much to think: low, high or max (medium is refused, as the release encoder does).
    #[arg(long, value_name = "E", default_value = "max")]
    pub thinking_effort: String,
    /// Do not print the reasoning (it is still generated and kept).
    #[arg(long)]
    pub hide_thinking: bool,
    /// Most tokens per reply.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 512)]
    pub max_tokens: usize,
    /// Positions the conversation may hold (the KV cache is sized for them).
    #[arg(short = 'c', long, value_name = "N", default_value_t = 4096)]
    pub context: usize,
    #[arg(long, value_name = "T", default_value_t = 0.0, value_parser = parse_temperature)]
    pub temperature: f32,
    /// Sample only among the K most likely tokens (0: off, as in llama.cpp).
    #[arg(long, value_name = "K")]
    pub top_k: Option<usize>,
    #[arg(long, value_name = "P", value_parser = parse_probability)]
    pub top_p: Option<f32>,
    /// Sampling seed; each reply derives its own from it and the position it starts at.
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub seed: u64,
    #[arg(short = 't', long, value_name = "N", default_value_t = 0, value_parser = super::parse_threads)]
    pub threads: usize,
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = parse_chunk)]
    pub prefill_chunk: usize,
    #[arg(long, value_name = "ISA", default_value = "auto")]
    pub isa: String,
    /// Write the transcript as JSONL here after every turn.
    #[arg(long, value_name = "FILE")]
    pub history: Option<PathBuf>,
    /// Save the session state here after every turn.
    #[arg(long, value_name = "FILE")]
    pub save_state: Option<PathBuf>,
    /// Start from a saved session state.
    #[arg(long, value_name = "FILE")]
    pub load_state: Option<PathBuf>,
    #[command(flatten)]
    pub storage: StorageArgs,
    #[command(flatten)]
    pub pipeline: super::pipeline_flags::PipelineArgs,
    #[command(flatten)]
    pub drafting: super::draft_flags::DraftArgs,
    /// A JSON file holding an OpenAI `tools` list, declared to the model as the release encodes
    /// tools. The reply's calls are shown; answer each with /result TEXT.
    #[arg(long, value_name = "FILE")]
    pub tools: Option<PathBuf>,
    /// auto, none, required or a tool's name (--tools): required and a name make every reply
    /// call a tool (constrained decoding).
    #[arg(long, value_name = "CHOICE", default_value = "auto")]
    pub tool_choice: String,
    /// json_object, or a file holding a JSON schema: every reply is JSON (for the schema),
    /// by constrained decoding.
    #[arg(long, value_name = "FORMAT")]
    pub response_format: Option<String>,
    #[arg(skip)]
    pub given: Vec<String>,
}

const HELP: &str = "commands: /reset, /save FILE, /load FILE, /system TEXT, /result TEXT, /stats, /help, /quit";

/// What `/help` prints: each command and what it does.
const HELP_LONG: &str = "commands (a line that starts with / is a command, any other line a turn):
  /reset          forget the conversation (the system message stays)
  /system TEXT    set the system message; the next turn prefills the conversation again
  /save FILE      save the conversation and its model state
  /load FILE      load a conversation saved with /save (or --save-state)
  /result TEXT    the result of the reply's next tool call (--tools); after the last, the
                  model replies
  /stats          tokens, time and reads of the last turn
  /help           this list
  /quit, /exit    end the chat (so does end of input, Ctrl-D)";

pub fn run(args: &ChatArgs) -> anyhow::Result<()> {
    let effort = Effort::parse(&args.thinking_effort).context("--thinking-effort")?;
    let tools = tool_options(args)?;
    let thinking = Thinking { enabled: !args.no_think, effort };
    args.drafting.check(&Sampling { temperature: args.temperature, ..Sampling::default() }, true)?;
    if args.max_tokens == 0 {
        return Err(UsageError("--max-tokens 0 leaves no room for a reply".into()).into());
    }
    if args.context <= args.max_tokens {
        // Advice that runs: twice the reply leaves as much again for the turn's prompt; half the
        // context leaves the other half for it.
        let lower = match args.context / 2 {
            0 => String::new(),
            half => format!(" or lower --max-tokens (e.g. to {half})"),
        };
        return Err(UsageError(format!(
            "--context {} leaves no room for a turn of up to --max-tokens {} after its prompt; raise --context (e.g. to {}){lower}",
            args.context,
            args.max_tokens,
            args.max_tokens.saturating_mul(2)
        ))
        .into());
    }
    // Checked before the model is opened; written after every turn.
    for (flag, path) in [("--history", &args.history), ("--save-state", &args.save_state)] {
        if let Some(path) = path {
            super::output::create_file_now(flag, path)?;
        }
    }
    let flags = startup_flags!(args);
    let Some(Started { kernels, model_dir, placement }) = start_up(&flags)? else {
        return Ok(());
    };
    let fp = Fingerprint::of_dir(&model_dir).with_context(|| format!("opening model {}", model_dir.display()))?;
    let cfg = crate::config::Config::from_model_dir(&model_dir)?;
    let context = match &cfg.context_length {
        Some(c) if c.positions < args.context => {
            eprintln!(
                "k3ring: --context {}: this model holds {} positions ({}); the conversation gets {}",
                args.context, c.positions, c.source, c.positions
            );
            c.positions
        }
        _ => args.context,
    };
    let Some(trunk) = &args.storage.trunk else {
        let opened = open_resident(&model_dir, args.threads, kernels)
            .with_context(|| format!("opening model {}", model_dir.display()))?;
        return repl(args, &opened, fp, (thinking, tools), context, |_| None);
    };
    let flag = typed_budget_flag(&args.storage);
    let mut run = streaming_run(&args.pipeline, &args.storage, args.threads, args.prefill_chunk, context)
        .map_err(|e| name_budget_flag(e, &flag))?;
    run.placement = placement;
    // The seed does not matter for the plan: only whether the replies are greedy.
    let sampling = Sampling { temperature: args.temperature, ..Sampling::default() };
    run.drafting = args.drafting.plan(&sampling);
    let (opened, plan) =
        open_streaming(&model_dir, trunk, &run, kernels, |plan| eprintln!("k3ring: {}", plan.describe()))
            .with_context(|| format!("opening model {} with trunk pack {}", model_dir.display(), trunk.display()))
            .map_err(|e| name_budget_flag(e, &flag))?;
    let mut args = args.clone();
    args.drafting.yield_to(&plan);
    let args = &args;
    repl(args, &opened, fp, (thinking, tools), context, |src| Some(src.stats()))
}

/// `--tools`, `--tool-choice` and `--response-format` as the server's fields.
fn tool_options(args: &ChatArgs) -> anyhow::Result<crate::chat::tools::ToolOptions> {
    use serde_json::{json, Value};
    let read_json = |flag: &str, path: &Path| -> anyhow::Result<Value> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| UsageError(format!("{flag} {}: cannot be read: {e}", path.display())))?;
        Ok(serde_json::from_str(&text).map_err(|e| UsageError(format!("{flag} {}: not JSON: {e}", path.display())))?)
    };
    let tools = match &args.tools {
        None => None,
        Some(path) => match read_json("--tools", path)? {
            Value::Array(list) => Some(list),
            _ => return Err(UsageError(format!("--tools {}: give a JSON list of tools", path.display())).into()),
        },
    };
    let choice = match args.tool_choice.as_str() {
        c @ ("auto" | "none" | "required") => json!(c),
        name => json!({"type": "function", "function": {"name": name}}),
    };
    let format = match args.response_format.as_deref() {
        None | Some("text") => Value::Null,
        Some("json_object") => json!({"type": "json_object"}),
        Some(file) => {
            let schema = read_json("--response-format", Path::new(file))?;
            json!({"type": "json_schema", "json_schema": {"name": "schema", "schema": schema}})
        }
    };
    crate::chat::openai::options(tools, Some(&choice), Some(&format)).map_err(|e| {
        let flag = match e.param {
            "tools" => "--tools",
            "tool_choice" => "--tool-choice",
            _ => "--response-format",
        };
        UsageError(format!("{flag}: {}", e.message)).into()
    })
}

/// Counters of the last turn, for `/stats`.
#[derive(Default)]
struct TurnStats {
    prefilled: usize,
    generated: usize,
    prefill_seconds: f64,
    decode_seconds: f64,
    bytes_read: Option<u64>,
    hit_rate: Option<f64>,
    /// Decode steps and drafting (`None` when not drafting).
    draft: Option<crate::engine::DraftStats>,
}

impl TurnStats {
    fn describe(&self) -> String {
        let per_token = self.decode_seconds / self.generated.saturating_sub(1).max(1) as f64;
        let mut s = format!(
            "last turn: {} tokens prefilled in {:.3} s, {} generated, {:.4} s/token",
            self.prefilled, self.prefill_seconds, self.generated, per_token
        );
        if let Some(b) = self.bytes_read {
            s.push_str(&format!(", {:.4} GB read", b as f64 / 1e9));
        }
        if let Some(h) = self.hit_rate {
            s.push_str(&format!(", expert hit rate {:.0}%", 100.0 * h));
        }
        if let Some(d) = self.draft {
            s.push_str(&format!(
                ", draft: {} of {} guesses kept in {} steps ({:.2} tokens per step)",
                d.accepted,
                d.drafted,
                d.steps,
                d.tokens_per_step()
            ));
        }
        s
    }
}

/// Bytes read and expert hit rate between two snapshots of the storage counters.
fn storage_delta(before: Option<&StreamStats>, after: Option<&StreamStats>) -> (Option<u64>, Option<f64>) {
    let (Some(a), Some(b)) = (before, after) else { return (None, None) };
    let bytes = (b.trunk_bytes_read + b.expert_bytes_read).saturating_sub(a.trunk_bytes_read + a.expert_bytes_read);
    let hits = b.expert_hits.saturating_sub(a.expert_hits);
    let lookups = hits + b.expert_misses.saturating_sub(a.expert_misses);
    (Some(bytes), (lookups > 0).then(|| hits as f64 / lookups as f64))
}

/// Everything the loop needs besides the conversation.
struct Repl<'a, S: WeightSource + LayerHook> {
    args: &'a ChatArgs,
    opened: &'a Opened<S>,
    fp: Fingerprint,
    storage: &'a dyn Fn(&S) -> Option<StreamStats>,
    last: TurnStats,
    terminal: bool,
    /// The grammar compiler of constrained replies, made at the first.
    grammars: Option<crate::chat::constrain::Grammars>,
}

fn repl<S: WeightSource + LayerHook>(
    args: &ChatArgs,
    opened: &Opened<S>,
    fp: Fingerprint,
    (thinking, tools): (Thinking, crate::chat::tools::ToolOptions),
    context: usize,
    storage: impl Fn(&S) -> Option<StreamStats>,
) -> anyhow::Result<()> {
    let session = ChatSession::new(&opened.engine, context, args.prefill_chunk)?;
    let specials = Specials::of(&opened.tokenizer)?;
    let mut conv = Conversation::new(session, specials, thinking, args.system.as_deref());
    conv.tools = tools;
    let terminal = std::io::stdin().is_terminal();
    let mut r = Repl { args, opened, fp, storage: &storage, last: TurnStats::default(), terminal, grammars: None };
    if let Some(path) = &args.load_state {
        r.load(&mut conv, path)?;
    }
    let mut stdin = std::io::stdin().lock();
    // A turn longer than the whole context cannot fit: the read stops there.
    let line_max = context.saturating_mul(opened.tokenizer.max_token_bytes());
    let (mut bytes, mut number) = (Vec::new(), 0usize);
    loop {
        // The event loop: one line per turn, until /quit or the end of the input.
        if r.terminal {
            eprint!("> ");
        }
        number += 1;
        match read_line_capped(&mut stdin, &mut bytes, line_max).context("reading stdin")? {
            LineRead::End => break,
            LineRead::TooLong => {
                return Err(UsageError(format!(
                    "stdin: line {number} is longer than {line_max} bytes, more than the conversation's context of \
                     {context} positions can hold"
                ))
                .into())
            }
            LineRead::Line => {}
        }
        let line = std::str::from_utf8(&bytes).map_err(|e| {
            UsageError(format!("stdin: line {number} is not UTF-8 text (invalid byte at offset {})", e.valid_up_to()))
        })?;
        let line = line.strip_suffix('\n').unwrap_or(line);
        crate::interrupt::clear();
        let text = line.trim_end_matches('\r');
        if text.trim().is_empty() {
            continue;
        }
        if let Some(cmd) = text.strip_prefix('/') {
            if !r.command(&mut conv, cmd)? {
                break;
            }
            continue;
        }
        r.turn(&mut conv, text)?;
    }
    Ok(())
}

impl<S: WeightSource + LayerHook> Repl<'_, S> {
    /// Runs a command; false ends the chat. Mistakes in a command are reported and the chat
    /// goes on.
    fn command(&mut self, conv: &mut Conversation, cmd: &str) -> anyhow::Result<bool> {
        let (name, rest) = cmd.split_once(' ').map_or((cmd, ""), |(n, r)| (n, r.trim()));
        match (name, rest) {
            ("quit" | "exit", _) => return Ok(false),
            ("reset", _) => {
                conv.reset();
                eprintln!("k3ring: conversation reset (system message kept)");
            }
            ("system", "") => eprintln!("k3ring: /system needs the text of the system message"),
            ("system", text) => {
                conv.set_system(text);
                eprintln!("k3ring: system message set; the next turn prefills the conversation again");
            }
            ("save" | "load", "") => eprintln!("k3ring: /{name} needs a file name"),
            ("save", file) => match crate::files::Output::resolve_file("/save", Path::new(file))
                .map_err(crate::engine::StateFileError::from)
                .and_then(|out| conv.session.save(&out, self.fp, &conv.extra_bytes()))
            {
                Ok(()) => eprintln!("k3ring: state saved to {file} ({} tokens)", conv.session.ids().len()),
                Err(e) => eprintln!("k3ring: error: {e}"),
            },
            ("load", file) => {
                if let Err(e) = self.load(conv, Path::new(file)) {
                    eprintln!("k3ring: error: {}", super::error_text(&e));
                }
            }
            ("stats", _) => eprintln!("k3ring: {}", self.last.describe()),
            ("result", text) => match conv.push_tool_result(&self.opened.tokenizer, text) {
                Err(e) => eprintln!("k3ring: {e}"),
                Ok(None) => eprintln!("k3ring: no tool call waits for a result"),
                Ok(Some(false)) => eprintln!("k3ring: {} more results to give", conv.pending_calls().len()),
                Ok(Some(true)) => self.reply(conv)?,
            },
            ("help", _) => eprintln!("{HELP_LONG}"),
            _ => eprintln!("k3ring: unknown command /{name}; {HELP}"),
        }
        Ok(true)
    }

    fn load(&self, conv: &mut Conversation, path: &Path) -> anyhow::Result<()> {
        let extra = conv.session.restore(&self.opened.engine, path, self.fp)?;
        if let Err(e) = conv.restore_extra(&extra) {
            conv.reset();
            return Err(e).with_context(|| format!("{}", path.display()));
        }
        eprintln!(
            "k3ring: state loaded from {} ({} messages, {} tokens)",
            path.display(),
            conv.messages.len(),
            conv.session.ids().len()
        );
        Ok(())
    }

    /// One user turn and its streamed reply; then the history and state files.
    fn turn(&mut self, conv: &mut Conversation, text: &str) -> anyhow::Result<()> {
        let tok = &self.opened.tokenizer;
        let ids = conv.user_turn_ids(tok, text)?;
        let needed = conv.session.ids().len() + ids.len();
        if needed >= conv.session.capacity() {
            // /reset helps only a conversation that holds more than what it keeps.
            let fresh = conv.messages.iter().all(|m| m.role == crate::chat::template::Role::System);
            let restart = format!("restart with --context {} or more", needed + self.args.max_tokens);
            let advice = if fresh { restart } else { format!("/reset, or {restart}") };
            eprintln!(
                "k3ring: this turn would take the conversation to {needed} of its {} positions; {advice}",
                conv.session.capacity()
            );
            return Ok(());
        }
        conv.push_user(text, &ids);
        self.reply(conv)
    }

    /// Generates the reply to the conversation so far and streams it; then the history and
    /// state files.
    fn reply(&mut self, conv: &mut Conversation) -> anyhow::Result<()> {
        let tok = &self.opened.tokenizer;
        let seed = crate::rng::splitmix64_at(self.args.seed, conv.session.ids().len() as u64);
        let a = self.args;
        let sampling = Sampling { temperature: a.temperature, top_k: a.top_k.filter(|&k| k > 0), top_p: a.top_p, seed };
        let vocab = self.opened.engine.model.cfg.vocab_size;
        let constraint = crate::chat::constrain::reply_constraint(
            &mut self.grammars,
            tok,
            &conv.specials,
            vocab,
            &conv.tools,
            conv.thinking.enabled,
        )?;
        let opts = ReplyOptions {
            max_tokens: a.max_tokens,
            draft: a.drafting.options(&sampling).filter(|_| constraint.is_none()),
            constraint,
            sampling,
            stop_ids: conv.specials.end_ids().to_vec(),
            stop: Some(crate::interrupt::flag()),
        };
        let before = (self.storage)(&self.opened.engine.src);
        let mut parser = conv.parser(tok);
        let mut printer = Printer::new(self.terminal && std::io::stdout().is_terminal(), a.hide_thinking);
        let mut broke: Option<crate::chat::parse::ParseError> = None;
        let reply = conv.session.reply(&self.opened.engine, &opts, |id| match parser.push(id) {
            Ok(Event::Payload(ch)) => {
                printer.token(tok, ch, id);
                true
            }
            Ok(_) => true,
            Err(e) => {
                broke = Some(e);
                false
            }
        })?;
        printer.end();
        crate::interrupt::clear();
        conv.finish_reply(tok, &parser)?;
        for (k, call) in conv.pending_calls().iter().enumerate() {
            eprintln!("k3ring: tool call {}: {} {}", k + 1, call.name, call.arguments);
        }
        if !conv.pending_calls().is_empty() {
            eprintln!("k3ring: answer each call with /result TEXT, in order");
        }
        if let Some(e) = broke {
            eprintln!("k3ring: the reply broke the chat template ({e}); it was closed there");
        } else if reply.interrupted {
            eprintln!("k3ring: reply stopped (Ctrl-C)");
        } else if reply.context_full {
            eprintln!("k3ring: the context is full; /reset to go on");
        }
        let (bytes_read, hit_rate) = storage_delta(before.as_ref(), (self.storage)(&self.opened.engine.src).as_ref());
        self.last = TurnStats {
            prefilled: reply.prefilled,
            generated: reply.ids.len(),
            prefill_seconds: reply.prefill_seconds,
            decode_seconds: reply.decode_seconds,
            bytes_read,
            hit_rate,
            draft: opts.draft.is_some().then_some(reply.draft),
        };
        self.persist(conv)
    }

    /// Writes the history and the state, each atomically.
    fn persist(&self, conv: &Conversation) -> anyhow::Result<()> {
        if let Some(path) = &self.args.history {
            super::output::create_file_now("--history", path)?.write_all(conv.history_jsonl().as_bytes())?;
        }
        if let Some(path) = &self.args.save_state {
            conv.session.save(&super::output::create_file_now("--save-state", path)?, self.fp, &conv.extra_bytes())?;
        }
        Ok(())
    }
}

/// Streams the reply to stdout: reasoning dimmed (on a terminal) or hidden, then the content.
struct Printer {
    out: std::io::Stdout,
    dim: bool,
    hide_thinking: bool,
    decoder: StreamDecoder,
    channel: Option<Channel>,
}

impl Printer {
    fn new(dim: bool, hide_thinking: bool) -> Printer {
        Printer { out: std::io::stdout(), dim, hide_thinking, decoder: StreamDecoder::default(), channel: None }
    }

    fn token(&mut self, tok: &crate::tokenizer::Tokenizer, ch: Channel, id: u32) {
        if ch == Channel::Reasoning && self.hide_thinking {
            return;
        }
        if self.channel != Some(ch) {
            self.switch(Some(ch));
        }
        let piece = self.decoder.push(tok, id).unwrap_or_default();
        // A closed stdout (a pipe whose reader left) is not worth failing a turn for.
        let _ = self.out.write_all(piece.as_bytes()).and_then(|()| self.out.flush());
    }

    /// Ends the current channel's text (its held-back bytes, the dim style, a line break
    /// between reasoning and content).
    fn switch(&mut self, next: Option<Channel>) {
        let mut s = self.decoder.finish();
        if self.channel == Some(Channel::Reasoning) {
            if self.dim {
                s.push_str("\x1b[0m");
            }
            s.push('\n');
        }
        if next == Some(Channel::Reasoning) && self.dim {
            s.push_str("\x1b[2m");
        }
        self.channel = next;
        let _ = self.out.write_all(s.as_bytes());
    }

    fn end(&mut self) {
        self.switch(None);
        let _ = self.out.write_all(b"\n").and_then(|()| self.out.flush());
    }
}
