//! The drivers' wake-up timer.

use std::pin::Pin;
use std::time::Instant;

use tokio::time::Sleep;

/// One `Sleep` a driver waits on for its next deadline, moved only when the
/// deadline changes. A fresh `sleep_until` per turn of the driver would
/// insert an entry into tokio's timer wheel and take it out again on every
/// event, though the next deadline (a heartbeat, a room's timer) rarely
/// changes from one event to the next.
pub(crate) struct Wakeup {
    sleep: Pin<Box<Sleep>>,
    /// The deadline `sleep` is set to.
    armed: Option<Instant>,
}

impl Wakeup {
    pub(crate) fn new() -> Self {
        Self {
            sleep: Box::pin(tokio::time::sleep(std::time::Duration::from_secs(3600))),
            armed: None,
        }
    }

    /// Complete at `deadline`, never when there is none. Cancel-safe: a
    /// wait dropped before its deadline leaves the timer set for the next.
    pub(crate) async fn until(&mut self, deadline: Option<Instant>) {
        let Some(d) = deadline else {
            return std::future::pending().await;
        };
        if self.armed != Some(d) {
            self.sleep.as_mut().reset(tokio::time::Instant::from_std(d));
            self.armed = Some(d);
        }
        // A `Sleep` that already fired stays ready: a wait for the same
        // (past) deadline completes at once.
        self.sleep.as_mut().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn fires_at_its_deadline_keeps_it_across_a_dropped_wait_and_rearms() {
        let ms = Duration::from_millis;
        let mut w = Wakeup::new();
        // No deadline: never.
        assert!(tokio::time::timeout(ms(20), w.until(None)).await.is_err());
        // A wait dropped before the deadline leaves the timer set; the next
        // wait for the same deadline completes at it.
        let t0 = Instant::now();
        let d = t0 + ms(30);
        assert!(tokio::time::timeout(ms(10), w.until(Some(d)))
            .await
            .is_err());
        let fired = tokio::time::timeout(ms(2000), w.until(Some(d))).await;
        assert!(fired.is_ok(), "never fired");
        assert!(t0.elapsed() >= ms(30), "fired early: {:?}", t0.elapsed());
        // Once fired, a wait for the same instant (now past) completes at
        // once rather than hanging on the spent timer.
        let again = tokio::time::timeout(ms(5), w.until(Some(d))).await;
        assert!(again.is_ok(), "a wait for a past deadline hung");
        // A new, earlier deadline moves it.
        let t1 = Instant::now();
        let later = tokio::time::timeout(ms(5), w.until(Some(t1 + ms(10_000)))).await;
        assert!(later.is_err());
        let moved = tokio::time::timeout(ms(2000), w.until(Some(t1 + ms(20)))).await;
        assert!(moved.is_ok(), "not moved earlier");
        assert!(t1.elapsed() >= ms(20), "fired early: {:?}", t1.elapsed());
    }
}
