//! The command line: `serve`, `validate`, `explain` and `schema`, and what
//! each does with its result.
//!
//! Exit codes: 0 success; 1 an invalid config (`validate`, `explain`), no
//! such task or no candidate left for the request (`explain`) or a failed
//! start (`serve`); 2 bad arguments (clap's own).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::config::diagnostic::Severity;
use crate::server::Gateway;
use crate::snapshot::{self, CompileOptions, LiveState};
use crate::telemetry::{self, export::Pipeline};

/// switchyard: a sidecar LLM gateway with failover along declared degradation chains.
#[derive(Debug, Parser)]
#[command(version, about)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the OpenAI Chat Completions, Anthropic Messages and OpenAI Responses APIs (and embeddings), routing by routes.yaml (reloaded on change).
    Serve {
        /// The routes file.
        #[arg(long, short, default_value = "routes.yaml")]
        config: PathBuf,
        /// Listen address; overrides the file's `listen:` (default 127.0.0.1:8080).
        #[arg(long)]
        listen: Option<SocketAddr>,
        /// Separate listener for `/admin/*`; overrides the file's `admin_listen:`.
        #[arg(long)]
        admin_listen: Option<SocketAddr>,
        /// Log format on stderr.
        #[arg(long, value_enum, default_value_t = LogFormat::Text)]
        log_format: LogFormat,
    },
    /// Show how a request would be routed: ordered candidates, and why each other target is excluded.
    Explain {
        /// The routes file.
        #[arg(long, short, default_value = "routes.yaml")]
        config: PathBuf,
        /// Task name (or alias).
        #[arg(long)]
        task: String,
        /// Estimated prompt tokens of the request.
        #[arg(long, default_value_t = 0)]
        prompt_tokens: u64,
        /// `max_tokens` of the request.
        #[arg(long)]
        max_tokens: Option<u64>,
        /// The request offers tools.
        #[arg(long)]
        tools: bool,
        /// The request asks for JSON output.
        #[arg(long)]
        json_mode: bool,
        /// The request has image parts.
        #[arg(long)]
        vision: bool,
    },
    /// Print the JSON Schema of routes.yaml (what schemas/routes.schema.json holds).
    Schema,
    /// Check routes files: prints `PATH:LINE:COLUMN: error: message (at key.path)` per problem, exit 1 if any is invalid.
    Validate {
        /// Files to check.
        #[arg(required = true)]
        paths: Vec<PathBuf>,
        /// Treat warnings (e.g. an unset api_key_env) as errors.
        #[arg(long)]
        strict: bool,
    },
}

/// Log line format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Keeps the log flusher's thread alive; dropped last, it writes out what is
/// still buffered.
pub type LogGuard = Option<telemetry::stderr::Flusher>;

/// The writer of every log line: batched to stderr by a thread of its own
/// ([`telemetry::stderr`]), or stderr itself if that thread cannot start.
fn log_writer(
    format: LogFormat,
    ansi: bool,
) -> (tracing_subscriber::fmt::writer::BoxMakeWriter, LogGuard) {
    use tracing_subscriber::fmt::writer::BoxMakeWriter;
    match telemetry::stderr::batched() {
        Ok((writer, flusher)) => {
            // Coloured lines keep `tracing`'s formatter, access lines included.
            if !ansi {
                let layout = match format {
                    LogFormat::Text => telemetry::access::Layout::Text,
                    LogFormat::Json => telemetry::access::Layout::Json,
                };
                telemetry::access::write_directly(writer.clone(), layout);
            }
            (BoxMakeWriter::new(writer), Some(flusher))
        }
        Err(_) => (BoxMakeWriter::new(std::io::stderr), None),
    }
}

/// Sets up tracing to stderr. `RUST_LOG` overrides the default `info` level.
/// Text lines are coloured only on a terminal, and never with `NO_COLOR` set
/// (<https://no-color.org>): escape codes in a file or a log collector are noise.
///
/// With a `tracer` (traces exported), spans of [`telemetry::OTEL_TARGET`]
/// go to OpenTelemetry and nowhere else, and the log lines go on as they
/// were; without one the subscriber is the plain formatter, as cheap as before.
pub fn init_tracing(
    format: LogFormat,
    tracer: Option<opentelemetry_sdk::trace::Tracer>,
) -> LogGuard {
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    use tracing_subscriber::Layer as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let ansi = use_colour(
        std::io::IsTerminal::is_terminal(&std::io::stderr()),
        std::env::var_os("NO_COLOR").as_deref(),
    );
    let (writer, guard) = log_writer(format, ansi);
    let Some(tracer) = tracer else {
        let builder = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_ansi(ansi)
            .with_writer(writer);
        let _ = match format {
            LogFormat::Text => builder.try_init(),
            LogFormat::Json => builder.json().try_init(),
        };
        return guard;
    };
    let quiet = format!("{}=off", telemetry::OTEL_TARGET)
        .parse()
        .map_or(filter, |d| {
            // The exported spans are not log lines.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"))
                .add_directive(d)
        });
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(writer);
    let fmt = match format {
        LogFormat::Text => fmt.with_filter(quiet).boxed(),
        LogFormat::Json => fmt.json().with_filter(quiet).boxed(),
    };
    let otel = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_location(false)
        .with_threads(false)
        .with_level(false)
        .with_target(false)
        .with_tracked_inactivity(false)
        .with_filter(
            tracing_subscriber::filter::Targets::new()
                .with_target(telemetry::OTEL_TARGET, tracing::Level::TRACE),
        );
    let _ = tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init();
    guard
}

/// Builds the OTLP exporter if the environment or the file's
/// `telemetry.traces` asks for one; logs (once tracing is up) why not if it
/// cannot be built. Runs inside the runtime, where the exporter's
/// connections live.
fn start_telemetry(config: &std::path::Path, format: LogFormat) -> (Option<Pipeline>, LogGuard) {
    let settings = snapshot::read_traces(config);
    let Some(plan) = telemetry::export::plan(&settings, &|name| std::env::var(name).ok()) else {
        return (None, init_tracing(format, None));
    };
    match Pipeline::start(&plan) {
        Ok(pipeline) => {
            let guard = init_tracing(format, Some(pipeline.tracer()));
            for w in &plan.warnings {
                tracing::warn!("{w}");
            }
            tracing::info!(
                protocol = plan.protocol.as_str(),
                "exporting OpenTelemetry traces"
            );
            (Some(pipeline), guard)
        }
        Err(e) => {
            let guard = init_tracing(format, None);
            tracing::error!("{e}; running without traces");
            (None, guard)
        }
    }
}

/// Whether log lines get ANSI colour: on a terminal, unless `NO_COLOR` is
/// set to something non-empty.
fn use_colour(terminal: bool, no_color: Option<&std::ffi::OsStr>) -> bool {
    terminal && no_color.is_none_or(std::ffi::OsStr::is_empty)
}

/// `n` and `noun`, plural unless `n` is 1: "1 task", "2 tasks", "0 errors".
fn count(n: usize, noun: &str) -> String {
    if n == 1 {
        format!("1 {noun}")
    } else {
        format!("{n} {noun}s")
    }
}

/// Runs `validate`: every file, every problem, one line each.
#[must_use]
pub fn validate(paths: &[PathBuf], strict: bool) -> ExitCode {
    let mut ok = true;
    for path in paths {
        let shown = path.display().to_string();
        let result = snapshot::load(path, &LiveState::default(), CompileOptions { strict });
        match result {
            Ok(compiled) => {
                for w in &compiled.warnings {
                    println!("{}", w.render(&shown));
                }
                let s = &compiled.snapshot;
                println!(
                    "{shown}: ok ({}, {}, config hash {:016x})",
                    count(s.tasks.len(), "task"),
                    count(s.targets.len(), "target"),
                    s.hash
                );
            }
            Err(diags) => {
                ok = false;
                let errors = diags
                    .iter()
                    .filter(|d| d.severity == Severity::Error)
                    .count();
                for d in &diags {
                    println!("{}", d.render(&shown));
                }
                eprintln!("{shown}: invalid ({})", count(errors, "error"));
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

/// What `explain` is asked about.
#[derive(Debug, Clone)]
pub struct ExplainArgs {
    /// Task name or alias.
    pub task: String,
    /// The request's needs.
    pub needs: crate::routing::Needs,
}

/// Runs `explain`: prints the plan for a request with the given needs, all
/// targets assumed healthy. Fails (exit 1) when no candidate remains, so a
/// script can tell a request that could be served from one that could not.
#[must_use]
pub fn explain(config: &std::path::Path, args: &ExplainArgs) -> ExitCode {
    let shown = config.display().to_string();
    let result = snapshot::load(config, &LiveState::default(), CompileOptions::default());
    let snapshot = match result {
        Ok(compiled) => compiled.snapshot,
        Err(diags) => {
            for d in &diags {
                println!("{}", d.render(&shown));
            }
            return ExitCode::FAILURE;
        }
    };
    // By name or alias only: an unknown name is an error here, even where a
    // request naming it would fall through to `default_task`.
    let Some(task) = snapshot.models.get(&args.task) else {
        let fallback = snapshot.default_task.as_ref().map_or(String::new(), |d| {
            format!(
                " (a request with this `model` would go to default_task `{}`)",
                d.name
            )
        });
        eprintln!("{shown}: no task or alias `{}`{fallback}", args.task);
        return ExitCode::FAILURE;
    };
    let plan = crate::routing::plan(task, &args.needs, tokio::time::Instant::now());
    print!("{}", plan.to_text(task, &args.needs));
    if plan.candidates.is_empty() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

/// Runs `serve` until SIGTERM or Ctrl-C: sets up logging (and the trace
/// exporter, flushed before returning), then the gateway.
pub async fn serve(
    config: PathBuf,
    listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
    log_format: LogFormat,
) -> ExitCode {
    let (pipeline, logs) = start_telemetry(&config, log_format);
    let code = run_gateway(config, listen, admin_listen).await;
    if let Some(pipeline) = pipeline {
        // Blocks until the last spans are out (bounded): off the runtime's threads.
        let _ = tokio::task::spawn_blocking(move || pipeline.shutdown()).await;
    }
    // The last lines out before the process ends.
    drop(logs);
    code
}

async fn run_gateway(
    config: PathBuf,
    listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
) -> ExitCode {
    let gateway =
        match Gateway::bind_with(&config, listen, admin_listen, CompileOptions::default()).await {
            Ok(g) => g,
            Err(e) => {
                eprintln!("{e}");
                return ExitCode::FAILURE;
            }
        };
    if let Ok(addr) = gateway.local_addr() {
        match gateway.admin_addr() {
            Some(admin) => {
                tracing::info!(%addr, %admin, config = %config.display(), "switchyard listening");
            }
            None => tracing::info!(%addr, config = %config.display(), "switchyard listening"),
        }
    }
    match gateway.run(shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{e}");
            ExitCode::FAILURE
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
    tracing::info!("shutdown signal received");
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        assert!(use_colour(true, None));
        assert!(
            use_colour(true, Some(OsStr::new(""))),
            "an empty NO_COLOR is unset"
        );
        assert!(!use_colour(true, Some(OsStr::new("1"))));
        assert!(!use_colour(false, None));
        assert!(!use_colour(false, Some(OsStr::new("1"))));
    }

    #[test]
    fn counts_are_singular_for_one() {
        assert_eq!(count(1, "task"), "1 task");
        assert_eq!(count(0, "error"), "0 errors");
        assert_eq!(count(2, "target"), "2 targets");
    }
}
