#![doc = include_str!("../README.md")]

mod admin;
mod args;
mod child;
mod exit;
mod format;
mod group;
mod record;
mod run;
mod setup;
mod store;
mod supervise;

use std::ffi::OsString;
use std::process::ExitCode;
use std::time::Duration;

use clap::error::{ContextKind, ContextValue, ErrorKind};
use clap::{CommandFactory, FromArgMatches};

use crate::args::{Cli, Command, Sources};

/// How long the runtime may take to stop its tasks at exit.
const RUNTIME_SHUTDOWN: Duration = Duration::from_millis(200);

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    let parsed = Cli::command()
        .try_get_matches_from(&argv)
        .and_then(|matches| Ok((Cli::from_arg_matches(&matches)?, matches)));
    let (mut cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(error) => return ExitCode::from(argument_error(&error, &argv)),
    };
    // `-q` keeps a cron job's runs silent: no warnings either.
    let quiet = matches!(&cli.command, Command::Run(args) if args.quiet);
    if let Some(store) = cli.command.store_mut() {
        if let Some((_, sub)) = matches.subcommand() {
            store.sources = Sources::of(sub);
        }
        let checked = store.resolve_url().and_then(|()| store.backend_options());
        match checked {
            Ok(warnings) if !quiet => {
                for warning in warnings {
                    eprintln!("withlock: {warning}");
                }
            }
            Ok(_) => {}
            Err(failure) => {
                eprintln!("withlock: {}", failure.message);
                return ExitCode::from(failure.code);
            }
        }
    }
    let command = match cli.command {
        Command::Supervise(args) => return supervise::main(args),
        other => other,
    };
    library_events();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("withlock: cannot start: {error}");
            return ExitCode::from(exit::SOFTWARE);
        }
    };
    let outcome = runtime.block_on(async {
        match command {
            Command::Run(args) => run::run(args).await,
            Command::List(args) => admin::list(args).await,
            Command::Inspect(args) => admin::inspect(args).await,
            Command::Release(args) => admin::release(args).await,
            Command::Status(args) => admin::status(args).await,
            Command::Migrate(args) => admin::migrate(args).await,
            // Handled above, without this runtime.
            Command::Supervise(_) => Err(exit::Failure::new(
                exit::SOFTWARE,
                "the supervisor runs on its own",
            )),
        }
    });
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    match outcome {
        Ok(code) => ExitCode::from(code),
        Err(failure) => {
            eprintln!("withlock: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}

/// The library's own events (a lost lock's cause, a release that failed,
/// retries) on stderr, as `RUST_LOG` selects them (`RUST_LOG=info`); none
/// without it.
fn library_events() {
    let Ok(filter) = tracing_subscriber::EnvFilter::try_from_default_env() else {
        return;
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Prints a clap error as one line (help and version as clap prints them)
/// and gives the exit code: 0 for help and version, 64 otherwise.
fn argument_error(error: &clap::Error, argv: &[OsString]) -> u8 {
    match error.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = error.print();
            return 0;
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = error.print();
            return exit::USAGE;
        }
        _ => {}
    }
    let is_run = argv.get(1).is_some_and(|a| a == "run");
    let line = if is_run && !argv.iter().any(|a| a == "--") {
        "the command must follow `--`, as in: withlock run --key KEY -- CMD [ARGS…]".to_owned()
    } else {
        one_line(error)
    };
    eprintln!("withlock: {line}");
    exit::USAGE
}

/// The problem a clap error names, on one line, without its usage block.
fn one_line(error: &clap::Error) -> String {
    if error.kind() == ErrorKind::MissingRequiredArgument {
        if let Some(ContextValue::Strings(missing)) = error.get(ContextKind::InvalidArg) {
            return format!("missing {}", missing.join(", "));
        }
    }
    let rendered = error.render().to_string();
    let text = rendered
        .lines()
        .map(str::trim)
        .take_while(|line| !line.starts_with("Usage:"))
        .filter(|line| {
            !line.is_empty()
                && !line.starts_with("tip:")
                && !line.starts_with("For more information")
        })
        .collect::<Vec<_>>()
        .join(" ");
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    format!("{text} (see --help)")
}
