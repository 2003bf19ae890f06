//! The one timer table: every non-terminal state has a deadline from it.
//! Defaults are seconds, not minutes: a
//! request that cannot make progress fails fast with a typed timeout.

use std::time::Duration;

/// Every deadline the protocol uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Timer {
    /// A room waits in Bootstrapping (prefill: for its destinations; decode:
    /// for its pages to be reserved and the destinations sent).
    Bootstrap,
    /// A room waits in WaitingForInput (prefill: for compute to finish;
    /// decode: for the first sign of the transfer).
    WaitingForInput,
    /// A room waits in Transferring for every write / status.
    Transfer,
    /// After an abort, how long a writer may take to drain before the pages
    /// are released anyway (the fence).
    AbortAckFence,
    /// How often each end sends a heartbeat.
    HeartbeatInterval,
    /// Silence after which a peer is declared dead.
    HeartbeatMiss,
    /// How long state about unknown or closed rooms is kept.
    UnknownRoomTtl,
}

impl Timer {
    /// Every timer.
    pub const ALL: [Timer; 7] = [
        Timer::Bootstrap,
        Timer::WaitingForInput,
        Timer::Transfer,
        Timer::AbortAckFence,
        Timer::HeartbeatInterval,
        Timer::HeartbeatMiss,
        Timer::UnknownRoomTtl,
    ];

    /// The default, in seconds.
    pub const fn default_secs(self) -> f64 {
        match self {
            Timer::Bootstrap => 30.0,
            Timer::WaitingForInput => 30.0,
            Timer::Transfer => 30.0,
            Timer::AbortAckFence => 5.0,
            Timer::HeartbeatInterval => 1.0,
            Timer::HeartbeatMiss => 5.0,
            Timer::UnknownRoomTtl => 60.0,
        }
    }

    /// Why the default is what it is.
    pub const fn reason(self) -> &'static str {
        match self {
            Timer::Bootstrap => "a destination that has not arrived in 30 s will not: the decode side is gone or overloaded; fail instead of holding prefill memory (SGLang waits 300 s)",
            Timer::WaitingForInput => "covers a long prompt's prefill compute plus queueing; beyond it the client is better served by an error",
            Timer::Transfer => "moving a whole prompt's KV takes milliseconds to a few seconds even over TCP; 30 s means the writer is stuck",
            Timer::AbortAckFence => "a writer told to stop must drain within seconds; after the fence the pages are reused and the event is logged",
            Timer::HeartbeatInterval => "cheap enough to send every second; gives the miss bound five chances",
            Timer::HeartbeatMiss => "five missed intervals: a peer that silent is dead, and its rooms fail within seconds, not at a transfer timeout",
            Timer::UnknownRoomTtl => "state kept for unknown or finished rooms (parked destinations, tombstones) must expire so a peer cannot grow it without bound",
        }
    }

    /// Stable snake-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Timer::Bootstrap => "bootstrap",
            Timer::WaitingForInput => "waiting_for_input",
            Timer::Transfer => "transfer",
            Timer::AbortAckFence => "abort_ack_fence",
            Timer::HeartbeatInterval => "heartbeat_interval",
            Timer::HeartbeatMiss => "heartbeat_miss",
            Timer::UnknownRoomTtl => "unknown_room_ttl",
        }
    }
}

/// Every timer's length, defaulting to the table; override per deployment.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimerConfig {
    /// See [`Timer::Bootstrap`].
    pub bootstrap: Duration,
    /// See [`Timer::WaitingForInput`].
    pub waiting_for_input: Duration,
    /// See [`Timer::Transfer`].
    pub transfer: Duration,
    /// See [`Timer::AbortAckFence`].
    pub abort_ack_fence: Duration,
    /// See [`Timer::HeartbeatInterval`].
    pub heartbeat_interval: Duration,
    /// See [`Timer::HeartbeatMiss`].
    pub heartbeat_miss: Duration,
    /// See [`Timer::UnknownRoomTtl`].
    pub unknown_room_ttl: Duration,
}

impl Default for TimerConfig {
    fn default() -> Self {
        let d = |t: Timer| Duration::from_secs_f64(t.default_secs());
        Self {
            bootstrap: d(Timer::Bootstrap),
            waiting_for_input: d(Timer::WaitingForInput),
            transfer: d(Timer::Transfer),
            abort_ack_fence: d(Timer::AbortAckFence),
            heartbeat_interval: d(Timer::HeartbeatInterval),
            heartbeat_miss: d(Timer::HeartbeatMiss),
            unknown_room_ttl: d(Timer::UnknownRoomTtl),
        }
    }
}

impl TimerConfig {
    /// The length of `timer`.
    pub fn get(&self, timer: Timer) -> Duration {
        match timer {
            Timer::Bootstrap => self.bootstrap,
            Timer::WaitingForInput => self.waiting_for_input,
            Timer::Transfer => self.transfer,
            Timer::AbortAckFence => self.abort_ack_fence,
            Timer::HeartbeatInterval => self.heartbeat_interval,
            Timer::HeartbeatMiss => self.heartbeat_miss,
            Timer::UnknownRoomTtl => self.unknown_room_ttl,
        }
    }

    /// Set the length of `timer`.
    pub fn set(&mut self, timer: Timer, value: Duration) {
        match timer {
            Timer::Bootstrap => self.bootstrap = value,
            Timer::WaitingForInput => self.waiting_for_input = value,
            Timer::Transfer => self.transfer = value,
            Timer::AbortAckFence => self.abort_ack_fence = value,
            Timer::HeartbeatInterval => self.heartbeat_interval = value,
            Timer::HeartbeatMiss => self.heartbeat_miss = value,
            Timer::UnknownRoomTtl => self.unknown_room_ttl = value,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_seconds_not_minutes() {
        let c = TimerConfig::default();
        for t in Timer::ALL {
            assert_eq!(
                c.get(t),
                Duration::from_secs_f64(t.default_secs()),
                "{}",
                t.name()
            );
            assert!(t.default_secs() <= 60.0, "{} default too long", t.name());
            assert!(!t.reason().is_empty());
        }
        assert_eq!(c.bootstrap, Duration::from_secs(30));
        assert_eq!(c.abort_ack_fence, Duration::from_secs(5));
        assert!(c.heartbeat_miss > c.heartbeat_interval);
    }

    #[test]
    fn set_overrides_one_timer() {
        let mut c = TimerConfig::default();
        c.set(Timer::Transfer, Duration::from_millis(250));
        assert_eq!(c.get(Timer::Transfer), Duration::from_millis(250));
        assert_eq!(c.get(Timer::Bootstrap), Duration::from_secs(30));
    }
}
