//! `rvbox-faultproxy`: run a fault proxy, or send it a command.
//!
//! ```text
//! rvbox-faultproxy run --route a,127.0.0.1:7701,127.0.0.1:7700 [--route b,...] --control /run/rvbox-faultproxy.sock
//! rvbox-faultproxy ctl --control /run/rvbox-faultproxy.sock a blackhole both
//! ```

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use rvbox_faultproxy::{Proxy, RouteSpec, control};

#[derive(Debug, Parser)]
#[command(
    name = "rvbox-faultproxy",
    version,
    about = "A TCP fault proxy for RVBox chaos drills",
    long_about = "A TCP fault proxy for RVBox chaos drills. Put it between rvbox clients and the server (or nginx), then break the path on command: drop, delay, cut after N bytes, blackhole without closing, hold and release, refuse, switch upstream.\n\nCommands (ROUTE is a route name or *):\n  pass | heal                      forward normally again, releasing what is held\n  blackhole [up|down|both]         stop forwarding without closing anything\n  hold [up|down|both]              keep reading, write nothing until release\n  release                          write what is held, stop holding\n  delay MS [up|down|both]          delay every chunk by MS milliseconds\n  rate BYTES [up|down|both]        forward at most BYTES per second per connection (0: no limit)\n  cut up|down BYTES                close each connection after BYTES more bytes\n  drop                             close every open connection now\n  refuse | accept                  close new connections at once / accept them again\n  upstream IP:PORT                 send new connections to another upstream\n  status                           print the routes' faults and counters"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// Run the proxy until SIGTERM or SIGINT.
    Run {
        /// A route: NAME,LISTEN,UPSTREAM (repeatable).
        #[arg(long = "route", required = true, value_name = "NAME,LISTEN,UPSTREAM")]
        routes: Vec<RouteSpec>,
        /// The control socket (mode 0600).
        #[arg(long, value_name = "PATH")]
        control: Option<PathBuf>,
    },
    /// Send one command to a running proxy and print its answer.
    Ctl {
        /// The proxy's control socket.
        #[arg(long, value_name = "PATH")]
        control: PathBuf,
        /// ROUTE VERB [ARGS]
        #[arg(required = true, num_args = 1.., value_name = "ROUTE VERB [ARGS]")]
        words: Vec<String>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RVBOX_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("rvbox-faultproxy: the async runtime could not start: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async move {
        match cli.command {
            Cmd::Run { routes, control } => run(routes, control).await,
            Cmd::Ctl { control, words } => match control::send(&control, &words.join(" ")).await {
                Ok(answer) => {
                    println!("{answer}");
                    if answer.starts_with("ok") {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    }
                }
                Err(e) => {
                    eprintln!("rvbox-faultproxy: {e}");
                    ExitCode::FAILURE
                }
            },
        }
    })
}

async fn run(routes: Vec<RouteSpec>, control_path: Option<PathBuf>) -> ExitCode {
    let proxy = match Proxy::bind(&routes).await {
        Ok(p) => Arc::new(p),
        Err(e) => {
            eprintln!("rvbox-faultproxy: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &control_path {
        match control::bind(path) {
            Ok(l) => {
                tracing::info!(path = %path.display(), "control socket listening");
                tokio::spawn(control::serve(l, Arc::clone(&proxy)));
            }
            Err(e) => {
                eprintln!("rvbox-faultproxy: control socket: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    for r in &routes {
        if let Some(addr) = proxy.addr(&r.name) {
            println!("route {} listening on {addr} -> {}", r.name, r.upstream);
        }
    }
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        eprintln!("rvbox-faultproxy: signal handlers could not be installed");
        return ExitCode::FAILURE;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    if let Some(path) = &control_path {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    ExitCode::SUCCESS
}
