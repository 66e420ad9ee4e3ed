//! The fault commands and their one-line text form (the control socket's
//! protocol and the `ctl` subcommand): `ROUTE VERB [ARGS]`, where ROUTE is
//! a route's name or `*` for every route.

use std::fmt;
use std::net::SocketAddr;
use std::time::Duration;

/// A direction of a proxied connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Client to upstream.
    Up,
    /// Upstream to client.
    Down,
    /// Both.
    Both,
}

impl Dir {
    /// Whether this covers the `up` direction.
    #[must_use]
    pub fn up(self) -> bool {
        matches!(self, Self::Up | Self::Both)
    }

    /// Whether this covers the `down` direction.
    #[must_use]
    pub fn down(self) -> bool {
        matches!(self, Self::Down | Self::Both)
    }
}

impl fmt::Display for Dir {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Up => "up",
            Self::Down => "down",
            Self::Both => "both",
        })
    }
}

/// Longest delay a route accepts.
pub const MAX_DELAY: Duration = Duration::from_secs(600);

/// One fault command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// Heal everything: forwarding resumes, held bytes are released, no
    /// delay, no armed cut, new connections accepted.
    Pass,
    /// Stop forwarding in `Dir` without closing anything: nothing is read
    /// (the sender's buffers fill) and nothing is written. New connections
    /// are accepted but not connected upstream until the hole heals.
    Blackhole(Dir),
    /// Keep reading in `Dir` but write nothing: bytes wait in the proxy
    /// (bounded; past the bound reading stops) until `release`.
    Hold(Dir),
    /// Write everything held, and stop holding.
    Release,
    /// Delay every chunk by this long in `Dir` (a delay line: throughput
    /// is kept).
    Delay(Duration, Dir),
    /// Forward at most this many bytes per second in `Dir`, per
    /// connection (a slow link); 0 lifts the limit.
    Rate(u64, Dir),
    /// Cut every connection after this many more bytes in `Dir` (`up` or
    /// `down`): exactly that many are forwarded, then both sockets close.
    /// New connections are cut at that offset too, until `pass`.
    Cut(Dir, u64),
    /// Close every open connection now.
    Drop,
    /// Close new connections as soon as they are accepted.
    Refuse,
    /// Accept new connections again (undoes `refuse`).
    Accept,
    /// New connections go to this upstream.
    Upstream(SocketAddr),
    /// Report the route's counters.
    Status,
}

impl fmt::Display for Command {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Pass => f.write_str("pass"),
            Self::Blackhole(d) => write!(f, "blackhole {d}"),
            Self::Hold(d) => write!(f, "hold {d}"),
            Self::Release => f.write_str("release"),
            Self::Delay(t, d) => write!(f, "delay {} {d}", t.as_millis()),
            Self::Rate(n, d) => write!(f, "rate {n} {d}"),
            Self::Cut(d, n) => write!(f, "cut {d} {n}"),
            Self::Drop => f.write_str("drop"),
            Self::Refuse => f.write_str("refuse"),
            Self::Accept => f.write_str("accept"),
            Self::Upstream(a) => write!(f, "upstream {a}"),
            Self::Status => f.write_str("status"),
        }
    }
}

/// Which routes a command is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// Every route.
    All,
    /// The route of this name.
    Route(String),
}

/// A command line that cannot be understood.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// Nothing but blanks.
    #[error("empty command: expected `ROUTE VERB [ARGS]`")]
    Empty,
    /// No verb after the route.
    #[error("no verb after route `{0}`")]
    NoVerb(String),
    /// A verb this proxy does not know.
    #[error(
        "unknown verb `{0}` (pass, blackhole, hold, release, delay, rate, cut, drop, refuse, accept, upstream, status)"
    )]
    UnknownVerb(String),
    /// A bad or missing argument.
    #[error("`{verb}`: {why}")]
    Argument {
        /// The verb.
        verb: String,
        /// What is wrong.
        why: String,
    },
    /// A route name that is not a plain word.
    #[error("route name `{0}` must be 1-32 letters, digits, `-` or `_`, or `*`")]
    RouteName(String),
}

/// Whether `name` is a valid route name.
#[must_use]
pub fn valid_route_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
}

fn arg_error(verb: &str, why: impl Into<String>) -> ParseError {
    ParseError::Argument {
        verb: verb.to_owned(),
        why: why.into(),
    }
}

fn parse_dir(verb: &str, word: Option<&str>, default: Dir) -> Result<Dir, ParseError> {
    match word {
        None => Ok(default),
        Some("up") => Ok(Dir::Up),
        Some("down") => Ok(Dir::Down),
        Some("both") => Ok(Dir::Both),
        Some(other) => Err(arg_error(
            verb,
            format!("direction `{other}` is not up, down or both"),
        )),
    }
}

/// Parses one command line.
///
/// # Errors
/// [`ParseError`] naming what is wrong.
pub fn parse(line: &str) -> Result<(Target, Command), ParseError> {
    let mut words = line.split_whitespace();
    let route = words.next().ok_or(ParseError::Empty)?;
    let target = if route == "*" {
        Target::All
    } else if valid_route_name(route) {
        Target::Route(route.to_owned())
    } else {
        return Err(ParseError::RouteName(route.to_owned()));
    };
    let verb = words
        .next()
        .ok_or_else(|| ParseError::NoVerb(route.to_owned()))?;
    let args: Vec<&str> = words.collect();
    let extra = |n: usize| -> Result<(), ParseError> {
        if args.len() > n {
            Err(arg_error(
                verb,
                format!(
                    "unexpected argument `{}`",
                    args.get(n).copied().unwrap_or("")
                ),
            ))
        } else {
            Ok(())
        }
    };
    let command = match verb {
        "pass" | "heal" => {
            extra(0)?;
            Command::Pass
        }
        "blackhole" => {
            extra(1)?;
            Command::Blackhole(parse_dir(verb, args.first().copied(), Dir::Both)?)
        }
        "hold" => {
            extra(1)?;
            Command::Hold(parse_dir(verb, args.first().copied(), Dir::Both)?)
        }
        "release" => {
            extra(0)?;
            Command::Release
        }
        "delay" => {
            extra(2)?;
            let ms = args
                .first()
                .ok_or_else(|| arg_error(verb, "expected milliseconds"))?;
            let ms: u64 = ms
                .parse()
                .map_err(|_| arg_error(verb, format!("`{ms}` is not a number of milliseconds")))?;
            let t = Duration::from_millis(ms);
            if t > MAX_DELAY {
                return Err(arg_error(
                    verb,
                    format!("{ms} ms is above the {} s limit", MAX_DELAY.as_secs()),
                ));
            }
            Command::Delay(t, parse_dir(verb, args.get(1).copied(), Dir::Both)?)
        }
        "rate" => {
            extra(2)?;
            let n = args
                .first()
                .ok_or_else(|| arg_error(verb, "expected bytes per second"))?;
            let n: u64 = n.parse().map_err(|_| {
                arg_error(verb, format!("`{n}` is not a number of bytes per second"))
            })?;
            Command::Rate(n, parse_dir(verb, args.get(1).copied(), Dir::Both)?)
        }
        "cut" => {
            extra(2)?;
            let dir = parse_dir(verb, args.first().copied(), Dir::Both)?;
            if dir == Dir::Both || args.is_empty() {
                return Err(arg_error(verb, "expected `cut up|down BYTES`"));
            }
            let n = args
                .get(1)
                .ok_or_else(|| arg_error(verb, "expected a byte count"))?;
            let n: u64 = n
                .parse()
                .map_err(|_| arg_error(verb, format!("`{n}` is not a byte count")))?;
            Command::Cut(dir, n)
        }
        "drop" => {
            extra(0)?;
            Command::Drop
        }
        "refuse" => {
            extra(0)?;
            Command::Refuse
        }
        "accept" => {
            extra(0)?;
            Command::Accept
        }
        "upstream" => {
            extra(1)?;
            let a = args
                .first()
                .ok_or_else(|| arg_error(verb, "expected HOST:PORT"))?;
            let addr: SocketAddr = a
                .parse()
                .map_err(|_| arg_error(verb, format!("`{a}` is not an IP:PORT address")))?;
            Command::Upstream(addr)
        }
        "status" => {
            extra(0)?;
            Command::Status
        }
        other => return Err(ParseError::UnknownVerb(other.to_owned())),
    };
    Ok((target, command))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(line: &str) -> (Target, Command) {
        match parse(line) {
            Ok(v) => v,
            Err(e) => unreachable!("{line}: {e}"),
        }
    }

    #[test]
    fn every_verb_parses_and_prints_back() {
        for line in [
            "a pass",
            "a blackhole both",
            "a blackhole up",
            "a hold down",
            "a release",
            "a delay 250 both",
            "a rate 65536 down",
            "a cut up 100",
            "a cut down 0",
            "a drop",
            "a refuse",
            "a accept",
            "a upstream 127.0.0.1:7700",
            "a status",
        ] {
            let (t, c) = ok(line);
            assert_eq!(t, Target::Route("a".into()));
            assert_eq!(format!("a {c}"), line);
        }
        assert_eq!(ok("* drop"), (Target::All, Command::Drop));
        assert_eq!(
            ok("b blackhole"),
            (Target::Route("b".into()), Command::Blackhole(Dir::Both))
        );
        assert_eq!(ok("b heal"), (Target::Route("b".into()), Command::Pass));
    }

    #[test]
    fn bad_lines_name_what_is_wrong() {
        assert_eq!(parse("  "), Err(ParseError::Empty));
        assert_eq!(parse("a"), Err(ParseError::NoVerb("a".into())));
        assert!(matches!(parse("a explode"), Err(ParseError::UnknownVerb(v)) if v == "explode"));
        assert!(matches!(parse("a/b drop"), Err(ParseError::RouteName(_))));
        let e = parse("a delay soon").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("`soon` is not a number"), "{e}");
        let e = parse("a delay 999999").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("above the 600 s limit"), "{e}");
        let e = parse("a cut both 5").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("cut up|down BYTES"), "{e}");
        let e = parse("a cut up").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("byte count"), "{e}");
        let e = parse("a blackhole sideways")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("`sideways` is not up, down or both"), "{e}");
        let e = parse("a drop now").map(|_| ()).unwrap_err().to_string();
        assert!(e.contains("unexpected argument `now`"), "{e}");
        let e = parse("a upstream example.com:80")
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(e.contains("not an IP:PORT"), "{e}");
    }
}
