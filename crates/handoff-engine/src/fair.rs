//! The order in which waiting requests get their turn (issue 32 item 4):
//! priority classes first, then a fair share between tenants (API keys),
//! then arrival.
//!
//! - **Priority** is strict: a waiting request of a higher class always
//!   goes before any of a lower one (SGLang's convention: a larger
//!   `priority` is served sooner). Nothing already running is preempted.
//! - **Fair share** within a class is start-time fair queueing over tokens:
//!   each tenant has a tag, the tokens it was given (prompt + most new
//!   tokens) on top of the virtual time when it last got a turn; the tenant
//!   with the smallest tag goes next. A tenant that was idle starts at the
//!   current virtual time, so idleness banks no credit, and a tenant with a
//!   backlog of a hundred requests cannot keep one with a single request
//!   waiting behind all of them.
//! - Within a tenant, requests go in arrival order.
//!
//! Every waiting point of the engines uses this order: the colocated
//! scheduler's admission, a decode worker's batch slots, and the prealloc
//! queue that hands out KV pages ([`Turnstile`]).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The lowest and highest priority a request may carry.
pub const PRIORITY_RANGE: std::ops::RangeInclusive<i32> = -1000..=1000;

/// Whom a request is served for, and how urgently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Class {
    /// Larger goes first; 0 by default.
    pub priority: i32,
    /// The tenant sharing fairly with others (an API key's name); `None`
    /// is one anonymous tenant.
    pub tenant: Option<Arc<str>>,
}

/// Most tenants' tags kept: past it, those no later than the virtual time
/// (which say nothing a fresh tag would not) are dropped, and if that is not
/// enough, all of them.
const MAX_TAGS: usize = 1024;

/// Tenants' start tags and the virtual time.
#[derive(Debug, Default)]
pub struct FairOrder {
    tags: HashMap<Option<Arc<str>>, u64>,
    vtime: u64,
}

impl FairOrder {
    /// `tenant`'s start tag: the smaller, the more it is owed.
    pub fn tag(&self, tenant: &Option<Arc<str>>) -> u64 {
        self.tags.get(tenant).copied().unwrap_or(0).max(self.vtime)
    }

    /// Which of `waiting` (each a class, in arrival order) goes next, or
    /// `None` when it is empty. Nothing is charged: call [`Self::charge`]
    /// for the one that got its turn.
    pub fn next<'a>(&self, waiting: impl IntoIterator<Item = &'a Class>) -> Option<usize> {
        let mut best: Option<(usize, i32, u64)> = None;
        for (i, c) in waiting.into_iter().enumerate() {
            let tag = self.tag(&c.tenant);
            let better = match best {
                None => true,
                // Strictly better only: the earlier arrival wins ties.
                Some((_, p, t)) => c.priority > p || (c.priority == p && tag < t),
            };
            if better {
                best = Some((i, c.priority, tag));
            }
        }
        best.map(|(i, _, _)| i)
    }

    /// `class` got its turn for `tokens` tokens of work.
    pub fn charge(&mut self, class: &Class, tokens: usize) {
        let start = self.tag(&class.tenant);
        self.vtime = start;
        if self.tags.len() >= MAX_TAGS && !self.tags.contains_key(&class.tenant) {
            let v = self.vtime;
            self.tags.retain(|_, t| *t > v);
            if self.tags.len() >= MAX_TAGS {
                // More tenants than are worth a tag each: everyone starts
                // over at the virtual time (each loses what it was ahead).
                self.tags.clear();
            }
        }
        self.tags
            .insert(class.tenant.clone(), start.saturating_add(tokens as u64));
    }
}

/// An asynchronous turn in [`FairOrder`]: one holder at a time, and when it
/// lets go the best waiter is next (not the first to arrive). The prealloc
/// queue holds a turn while it waits for pages, so the pages that come back
/// go to the request the order names.
#[derive(Debug, Default)]
pub struct Turnstile {
    inner: Arc<Mutex<Gate>>,
}

#[derive(Debug, Default)]
struct Gate {
    held: bool,
    order: FairOrder,
    next_id: u64,
    /// Waiters in arrival order.
    waiting: Vec<Waiter>,
}

#[derive(Debug)]
struct Waiter {
    id: u64,
    class: Class,
    tokens: usize,
    wake: tokio::sync::oneshot::Sender<()>,
}

/// The turn; the next waiter's when dropped.
#[derive(Debug)]
pub struct Turn {
    gate: Arc<Mutex<Gate>>,
}

impl Drop for Turn {
    fn drop(&mut self) {
        pass_on(&self.gate);
    }
}

/// A waiter that gave up (its request was cancelled) while it waited, or
/// after it was handed the turn but before it took it: the turn must not be
/// lost with it.
struct Pending {
    gate: Arc<Mutex<Gate>>,
    id: u64,
    rx: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl Drop for Pending {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let mut g = lock(&self.gate);
        g.waiting.retain(|w| w.id != self.id);
        drop(g);
        if rx.try_recv().is_ok() {
            // Handed the turn and never took it: hand it on.
            pass_on(&self.gate);
        }
    }
}

fn lock(gate: &Mutex<Gate>) -> std::sync::MutexGuard<'_, Gate> {
    // Every change under the lock is complete before it can panic.
    gate.lock().unwrap_or_else(|e| e.into_inner())
}

/// The turn goes to the best waiter still there, or is free.
fn pass_on(gate: &Mutex<Gate>) {
    let mut g = lock(gate);
    loop {
        let Some(i) = g.order.next(g.waiting.iter().map(|w| &w.class)) else {
            g.held = false;
            return;
        };
        let w = g.waiting.remove(i);
        if w.wake.send(()).is_ok() {
            g.order.charge(&w.class, w.tokens);
            return;
        }
        // Gone (its `Pending` is removing it): the next one.
    }
}

impl Turnstile {
    /// A turnstile nobody holds.
    pub fn new() -> Self {
        Self::default()
    }

    /// Wait for the turn of a request of `class` needing `tokens` tokens
    /// of work. Cancel-safe: dropping the future gives up its place (or
    /// the turn, if it was just handed over).
    pub async fn turn(&self, class: &Class, tokens: usize) -> Turn {
        let rx = {
            let mut g = lock(&self.inner);
            if !g.held && g.waiting.is_empty() {
                g.held = true;
                g.order.charge(class, tokens);
                return Turn {
                    gate: Arc::clone(&self.inner),
                };
            }
            let (wake, rx) = tokio::sync::oneshot::channel();
            let id = g.next_id;
            g.next_id += 1;
            g.waiting.push(Waiter {
                id,
                class: class.clone(),
                tokens,
                wake,
            });
            Pending {
                gate: Arc::clone(&self.inner),
                id,
                rx: Some(rx),
            }
        };
        let mut pending = rx;
        let rx = pending.rx.as_mut().expect("set above");
        // The sender is only dropped after a send or with the turnstile.
        let _ = rx.await;
        pending.rx = None;
        Turn {
            gate: Arc::clone(&self.inner),
        }
    }

    /// How many wait for the turn.
    pub fn waiting(&self) -> usize {
        lock(&self.inner).waiting.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn class(priority: i32, tenant: &str) -> Class {
        Class {
            priority,
            tenant: Some(tenant.into()),
        }
    }

    /// Serve everything in `queue` (charging `tokens` each); the order.
    fn drain(order: &mut FairOrder, mut queue: Vec<(Class, &'static str)>) -> Vec<&'static str> {
        let mut out = Vec::new();
        while let Some(i) = order.next(queue.iter().map(|(c, _)| c)) {
            let (c, name) = queue.remove(i);
            order.charge(&c, 100);
            out.push(name);
        }
        out
    }

    #[test]
    fn higher_priority_first_then_arrival() {
        let mut o = FairOrder::default();
        let q = vec![
            (class(0, "a"), "a0"),
            (class(5, "a"), "a-high"),
            (class(-3, "a"), "a-low"),
            (class(0, "a"), "a1"),
        ];
        assert_eq!(drain(&mut o, q), ["a-high", "a0", "a1", "a-low"]);
    }

    #[test]
    fn a_light_tenant_does_not_wait_behind_a_heavy_ones_backlog() {
        let mut o = FairOrder::default();
        let mut q: Vec<(Class, &str)> = ["h0", "h1", "h2", "h3", "h4"]
            .into_iter()
            .map(|n| (class(0, "heavy"), n))
            .collect();
        q.push((class(0, "light"), "l0"));
        q.push((class(0, "light"), "l1"));
        // Alternating from the start: the heavy tenant's backlog does not
        // make the light one wait.
        assert_eq!(drain(&mut o, q), ["h0", "l0", "h1", "l1", "h2", "h3", "h4"]);
    }

    #[test]
    fn idleness_banks_no_credit() {
        let mut o = FairOrder::default();
        // `heavy` is served alone for a long while...
        for _ in 0..50 {
            o.charge(&class(0, "heavy"), 100);
        }
        // ...then `late` arrives: it gets its share, not fifty turns in a row.
        let q = vec![
            (class(0, "heavy"), "h0"),
            (class(0, "heavy"), "h1"),
            (class(0, "late"), "l0"),
            (class(0, "late"), "l1"),
            (class(0, "late"), "l2"),
        ];
        assert_eq!(drain(&mut o, q), ["l0", "h0", "l1", "h1", "l2"]);
    }

    #[test]
    fn tags_stay_bounded() {
        let mut o = FairOrder::default();
        for i in 0..5000 {
            o.charge(&class(0, &format!("t{i}")), 1);
        }
        assert!(o.tags.len() <= MAX_TAGS + 1, "{}", o.tags.len());
    }

    #[tokio::test]
    async fn the_turn_goes_to_the_best_waiter_and_survives_cancellation() {
        let t = Arc::new(Turnstile::new());
        let held = t.turn(&class(0, "a"), 10).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (name, c) in [
            ("a-low", class(0, "a")),
            ("gone", class(9, "b")),
            ("b-high", class(5, "b")),
        ] {
            let (gate, tx) = (Arc::clone(&t), tx.clone());
            tasks.push(tokio::spawn(async move {
                let _turn = gate.turn(&c, 10).await;
                tx.send(name).unwrap();
                tokio::task::yield_now().await;
            }));
            while t.waiting() < tasks.len() {
                tokio::task::yield_now().await;
            }
        }
        // The best waiter gives up before the turn is free.
        tasks[1].abort();
        while t.waiting() > 2 {
            tokio::task::yield_now().await;
        }
        drop(held);
        assert_eq!(rx.recv().await, Some("b-high"));
        assert_eq!(rx.recv().await, Some("a-low"));
        // And the turn is free again.
        let _again = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            t.turn(&Class::default(), 1),
        )
        .await
        .expect("the turn was lost");
    }
}
