//! `chaos`: the multi-process fault checker. See the crate docs, or run
//! `chaos` without arguments for the usage.

use std::process::ExitCode;

use lock_chaos::analysis::analyse;
use lock_chaos::args::{parse, Command, USAGE};
use lock_chaos::event::RunLog;
use lock_chaos::{coordinator, worker};

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = match parse(&args) {
        Ok(command) => command,
        Err(error) => {
            eprintln!("{error}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = match runtime() {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("no runtime: {error}");
            return ExitCode::from(2);
        }
    };
    match command {
        Command::Worker(args) => {
            let worker = args.worker;
            let code = match runtime.block_on(worker::run(args)) {
                Ok(()) => 0,
                Err(error) => {
                    eprintln!("worker {worker}: {}", chain(&error));
                    2
                }
            };
            // The stdin watcher thread may still block on a read.
            std::process::exit(code)
        }
        Command::Run(args) => {
            let exe = match std::env::current_exe() {
                Ok(exe) => exe,
                Err(error) => {
                    eprintln!("cannot find this program: {error}");
                    return ExitCode::from(2);
                }
            };
            match runtime.block_on(coordinator::run(args, &exe)) {
                Ok(finished) => {
                    print!("{}", finished.report);
                    println!("logs and report.json in {}", finished.dir.display());
                    if finished.report.is_clean() {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(1)
                    }
                }
                Err(error) => {
                    eprintln!("chaos run failed: {}", chain(&error));
                    ExitCode::from(2)
                }
            }
        }
        Command::Analyse(dir) => match RunLog::read_dir(&dir) {
            Ok(log) => {
                let report = analyse(&log);
                print!("{report}");
                if report.is_clean() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::from(1)
                }
            }
            Err(error) => {
                eprintln!("cannot read {}: {error}", dir.display());
                ExitCode::from(2)
            }
        },
    }
}

fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
