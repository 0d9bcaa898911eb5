//! What a wrapped server's exit means (`toolgate-register --restart`): start it again after a
//! capped exponential backoff, or end the registrar; and when a crash loop ends the trying.
//!
//! Restarts come in rows: the delay before the nth restart of a row is the first delay doubled
//! n-1 times, up to a cap (jittered down by up to half, so that servers that died together do
//! not come back in lockstep). A server that ran for the window before it exited starts a new
//! row. More restarts in a row than the limit: the registrar gives up.

use std::time::Duration;

use toolgate_model::Backoff;

/// `--restart`: when the registrar starts its child again after it exited on its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// After a non-zero exit or a death by signal; a server that exits 0 stopped on purpose.
    OnFailure,
    /// After any exit.
    Always,
    /// Never: the registrar deregisters and exits with the server's code.
    Never,
}

impl std::str::FromStr for Policy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "on-failure" => Ok(Policy::OnFailure),
            "always" => Ok(Policy::Always),
            "never" => Ok(Policy::Never),
            _ => Err(format!(
                "restart policy {s:?} is not one of on-failure, always, never"
            )),
        }
    }
}

impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Policy::OnFailure => "on-failure",
            Policy::Always => "always",
            Policy::Never => "never",
        })
    }
}

/// The limits of [`Restarts`], as the flags give them.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Restarts allowed in a row.
    pub limit: u32,
    /// A server that ran this long before it exited starts a new row.
    pub window: Duration,
    /// The delay before the first restart of a row.
    pub delay: Duration,
    /// The cap of the delay.
    pub max_delay: Duration,
}

/// What to do after the child exited on its own.
#[derive(Debug, Clone, PartialEq)]
pub enum Decision {
    /// Start it again after `delay`; this is restart `nth` of the row.
    Restart { delay: Duration, nth: u32 },
    /// The policy does not restart this exit: deregistered, the registrar exits with it.
    Exit,
    /// `exits` exits in a row, each within the window of its start: a crash loop.
    GiveUp { exits: u32 },
}

/// The restart state of one wrapped server.
#[derive(Debug, Clone)]
pub struct Restarts {
    policy: Policy,
    limits: Limits,
    /// Restarts in the current row.
    row: u32,
    backoff: Backoff,
}

impl Restarts {
    pub fn new(policy: Policy, limits: Limits) -> Self {
        Restarts {
            policy,
            limits,
            row: 0,
            backoff: Backoff::new(limits.delay, limits.max_delay.max(limits.delay)),
        }
    }

    pub fn policy(&self) -> Policy {
        self.policy
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The child exited (`failed`: a non-zero code or a signal) after running for `ran`;
    /// `unit` (0.0..=1.0) places the delay within its jitter.
    pub fn after_exit(&mut self, failed: bool, ran: Duration, unit: f64) -> Decision {
        let restart = match self.policy {
            Policy::Never => false,
            Policy::OnFailure => failed,
            Policy::Always => true,
        };
        if !restart {
            return Decision::Exit;
        }
        if ran >= self.limits.window {
            self.row = 0;
            self.backoff.reset();
        }
        if self.row >= self.limits.limit {
            return Decision::GiveUp {
                exits: self.row.saturating_add(1),
            };
        }
        self.row += 1;
        Decision::Restart {
            delay: self.backoff.next_delay(unit),
            nth: self.row,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        limit: 3,
        window: Duration::from_secs(60),
        delay: Duration::from_secs(1),
        max_delay: Duration::from_secs(3),
    };

    fn delay(d: Decision) -> Duration {
        match d {
            Decision::Restart { delay, .. } => delay,
            other => panic!("not a restart: {other:?}"),
        }
    }

    #[test]
    fn on_failure_restarts_failures_only_and_never_restarts_nothing() {
        let quick = Duration::from_millis(10);
        let mut r = Restarts::new(Policy::OnFailure, LIMITS);
        assert_eq!(r.after_exit(false, quick, 1.0), Decision::Exit);
        assert_eq!(
            r.after_exit(true, quick, 1.0),
            Decision::Restart {
                delay: Duration::from_secs(1),
                nth: 1
            }
        );
        let mut never = Restarts::new(Policy::Never, LIMITS);
        assert_eq!(never.after_exit(true, quick, 1.0), Decision::Exit);
        let mut always = Restarts::new(Policy::Always, LIMITS);
        assert!(matches!(
            always.after_exit(false, quick, 1.0),
            Decision::Restart { nth: 1, .. }
        ));
    }

    #[test]
    fn a_crash_loop_backs_off_to_the_cap_and_gives_up_past_the_limit() {
        let quick = Duration::from_millis(10);
        let mut r = Restarts::new(Policy::OnFailure, LIMITS);
        assert_eq!(
            delay(r.after_exit(true, quick, 1.0)),
            Duration::from_secs(1)
        );
        assert_eq!(
            delay(r.after_exit(true, quick, 1.0)),
            Duration::from_secs(2)
        );
        // Capped, and jittered down by at most half.
        assert_eq!(
            delay(r.after_exit(true, quick, 0.0)),
            Duration::from_millis(1500)
        );
        assert_eq!(
            r.after_exit(true, quick, 1.0),
            Decision::GiveUp { exits: 4 }
        );
    }

    #[test]
    fn a_server_that_ran_the_window_starts_a_new_row() {
        let quick = Duration::from_millis(10);
        let mut r = Restarts::new(Policy::OnFailure, LIMITS);
        for _ in 0..3 {
            r.after_exit(true, quick, 1.0);
        }
        assert_eq!(
            r.after_exit(true, Duration::from_secs(60), 1.0),
            Decision::Restart {
                delay: Duration::from_secs(1),
                nth: 1
            }
        );
    }

    #[test]
    fn a_limit_of_zero_restarts_nothing_and_says_so() {
        let mut r = Restarts::new(Policy::Always, Limits { limit: 0, ..LIMITS });
        assert_eq!(
            r.after_exit(true, Duration::ZERO, 1.0),
            Decision::GiveUp { exits: 1 }
        );
    }

    #[test]
    fn policies_parse_from_their_flag_values() {
        for p in [Policy::OnFailure, Policy::Always, Policy::Never] {
            assert_eq!(p.to_string().parse::<Policy>(), Ok(p));
        }
        assert!("sometimes".parse::<Policy>().is_err());
    }
}
