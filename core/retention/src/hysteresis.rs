//! Watermark hysteresis for the client spool's loss mode and server ingress
//! admission (plan §7.2 "Loss mode is hysteretic", §6.1).

use rvbox_domain::limits;
use thiserror::Error;

/// What an observation changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// The level reached the high watermark: loss/backpressure begins.
    Engaged,
    /// The level fell below the low watermark: it ends.
    Released,
    /// No change.
    Unchanged,
}

/// The watermarks are not `low < high`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("low watermark {low} is not below high watermark {high}")]
pub struct WatermarkError {
    /// High watermark.
    pub high: u64,
    /// Low watermark.
    pub low: u64,
}

/// One high/low watermark pair: engaged at `level >= high`, released only at
/// `level < low`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hysteresis {
    high: u64,
    low: u64,
    engaged: bool,
}

impl Hysteresis {
    /// A released pair; `low` must be below `high`.
    pub fn new(high: u64, low: u64) -> Result<Hysteresis, WatermarkError> {
        if low >= high {
            return Err(WatermarkError { high, low });
        }
        Ok(Hysteresis {
            high,
            low,
            engaged: false,
        })
    }

    /// Per-command raw backlog: 1 MiB / 256 KiB.
    #[must_use]
    pub const fn command_defaults() -> Hysteresis {
        Hysteresis {
            high: limits::DEFAULT_COMMAND_HIGH_WATERMARK_BYTES,
            low: limits::DEFAULT_COMMAND_LOW_WATERMARK_BYTES,
            engaged: false,
        }
    }

    /// Per client daemon raw backlog: 8 MiB / 4 MiB.
    #[must_use]
    pub const fn client_daemon_defaults() -> Hysteresis {
        Hysteresis {
            high: limits::DEFAULT_CLIENT_HIGH_WATERMARK_BYTES,
            low: limits::DEFAULT_CLIENT_LOW_WATERMARK_BYTES,
            engaged: false,
        }
    }

    /// Server-wide ingress backlog: 64 MiB / 32 MiB.
    #[must_use]
    pub const fn server_ingress_defaults() -> Hysteresis {
        Hysteresis {
            high: limits::DEFAULT_SERVER_HIGH_WATERMARK_BYTES,
            low: limits::DEFAULT_SERVER_LOW_WATERMARK_BYTES,
            engaged: false,
        }
    }

    /// High watermark.
    #[must_use]
    pub const fn high(&self) -> u64 {
        self.high
    }

    /// Low watermark.
    #[must_use]
    pub const fn low(&self) -> u64 {
        self.low
    }

    /// Whether the pair is engaged.
    #[must_use]
    pub const fn is_engaged(&self) -> bool {
        self.engaged
    }

    /// Feed the current level.
    pub fn observe(&mut self, level: u64) -> Transition {
        if !self.engaged && level >= self.high {
            self.engaged = true;
            Transition::Engaged
        } else if self.engaged && level < self.low {
            self.engaged = false;
            Transition::Released
        } else {
            Transition::Unchanged
        }
    }
}

/// Scoped loss mode of one command on the client (plan §7.2): crossing
/// *either* the command or the daemon high watermark engages it, and it is
/// released only once *both* backlogs are below their lows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LossMode {
    command: Hysteresis,
    daemon: Hysteresis,
    engaged: bool,
}

impl LossMode {
    /// A released loss mode over the two watermark pairs (their own engaged
    /// flags are ignored).
    #[must_use]
    pub const fn new(command: Hysteresis, daemon: Hysteresis) -> LossMode {
        LossMode {
            command: Hysteresis {
                engaged: false,
                ..command
            },
            daemon: Hysteresis {
                engaged: false,
                ..daemon
            },
            engaged: false,
        }
    }

    /// Whether output is being dropped.
    #[must_use]
    pub const fn is_engaged(&self) -> bool {
        self.engaged
    }

    /// Feed both current backlogs.
    pub fn observe(&mut self, command_level: u64, daemon_level: u64) -> Transition {
        let crossed = command_level >= self.command.high || daemon_level >= self.daemon.high;
        let both_low = command_level < self.command.low && daemon_level < self.daemon.low;
        if !self.engaged && crossed {
            self.engaged = true;
            Transition::Engaged
        } else if self.engaged && both_low {
            self.engaged = false;
            Transition::Released
        } else {
            Transition::Unchanged
        }
    }
}
