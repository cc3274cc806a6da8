//! The `switchyard` binary: parse the command line, set up logging, dispatch.

use std::process::ExitCode;

use clap::Parser;
use switchyard::cli::{self, Cli, Command};

fn main() -> ExitCode {
    // The clouds' credential libraries (Google's) use the process's TLS
    // provider; switchyard's is ring. Fails only if one is set already.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let cli = Cli::parse();
    match cli.command {
        Command::Validate { paths, strict } => cli::validate(&paths, strict),
        Command::Schema => {
            print!("{}", switchyard::config::json_schema());
            ExitCode::SUCCESS
        }
        Command::Explain {
            config,
            task,
            prompt_tokens,
            max_tokens,
            tools,
            json_mode,
            vision,
        } => {
            let needs = switchyard::routing::Needs {
                tools,
                json_mode,
                vision,
                prompt_tokens,
                max_tokens,
            };
            cli::explain(&config, &cli::ExplainArgs { task, needs })
        }
        Command::Serve {
            config,
            listen,
            admin_listen,
            log_format,
        } => {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    eprintln!("cannot start the async runtime: {e}");
                    return ExitCode::FAILURE;
                }
            };
            let code = runtime.block_on(cli::serve(config, listen, admin_listen, log_format));
            // Drained: a blocking task still running (a DNS lookup, a file
            // read) must not hold the exit.
            runtime.shutdown_timeout(std::time::Duration::from_millis(100));
            code
        }
    }
}
