//! Pairing policies: which healthy worker of a role gets the
//! next request. Functions of the candidates' loads (an RNG for power of
//! two; for cache aware, the prompt and what was routed where), so they are
//! tested with fixed loads.

use std::collections::HashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use rand::Rng;

use crate::router::prefix_index::{BlockSet, MAX_BLOCKS};

/// A pairing policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    /// Each healthy worker in turn.
    RoundRobin,
    /// The worker with the least load (requests in flight at the router plus
    /// the load it last reported).
    LeastLoad,
    /// Two random healthy workers; the less loaded one wins.
    PowerOfTwo,
    /// The worker most likely to hold the request's prompt prefix in its
    /// cache (an approximate per-worker index of what was routed to it),
    /// unless it is much busier than the least loaded one, which then wins.
    CacheAware,
}

impl PolicyKind {
    /// The default for a role of `workers` workers: `cache_aware` when
    /// there is a choice, `round_robin` otherwise.
    pub fn default_for(workers: usize) -> Self {
        if workers > 1 {
            PolicyKind::CacheAware
        } else {
            PolicyKind::RoundRobin
        }
    }

    /// The CLI name (`round_robin`, `least_load`, `power_of_two`).
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::PowerOfTwo => "power_of_two",
            PolicyKind::CacheAware => "cache_aware",
        }
    }
}

impl std::fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for PolicyKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.replace('-', "_").as_str() {
            "round_robin" => Ok(PolicyKind::RoundRobin),
            "least_load" => Ok(PolicyKind::LeastLoad),
            "power_of_two" => Ok(PolicyKind::PowerOfTwo),
            "cache_aware" => Ok(PolicyKind::CacheAware),
            _ => Err(format!(
                "unknown policy `{s}` (expected round_robin, least_load, power_of_two or cache_aware)"
            )),
        }
    }
}

/// `cache_aware` sends a request to its best-matching worker only if that
/// worker has at most this many more requests in flight than the least
/// loaded one.
pub const CACHE_AWARE_SLACK: u64 = 8;

/// A policy with its state (the round-robin cursor, the cache-aware index).
#[derive(Debug)]
pub struct Policy {
    kind: PolicyKind,
    cursor: AtomicUsize,
    /// Worker URL → what was routed to it.
    index: Mutex<HashMap<String, BlockSet>>,
}

impl Policy {
    /// A fresh policy of this kind.
    pub fn new(kind: PolicyKind) -> Self {
        Policy {
            kind,
            cursor: AtomicUsize::new(0),
            index: Mutex::new(HashMap::new()),
        }
    }

    /// Index into `workers` (URLs, with their `loads`) for a request whose
    /// prompt has the chained block hashes `blocks`. `cache_aware` takes the
    /// worker holding the longest prefix of it if that covers at least half
    /// the prompt and the worker is within [`CACHE_AWARE_SLACK`] of the least
    /// load, else the least loaded (equally loaded ones in turn); it then
    /// remembers the prompt there.
    /// Other kinds ignore the prompt in their choice (and remember it too,
    /// for [`Self::pick_matched`]).
    pub fn pick_for(&self, workers: &[&str], loads: &[u64], blocks: &[u64]) -> Option<usize> {
        self.pick_matched(workers, loads, blocks).map(|(i, _)| i)
    }

    /// [`Self::pick_for`], and how many of `blocks` the chosen worker held
    /// before (the share of the prompt likely in its prefix cache).
    pub fn pick_matched(
        &self,
        workers: &[&str],
        loads: &[u64],
        blocks: &[u64],
    ) -> Option<(usize, usize)> {
        if loads.is_empty() {
            return None;
        }
        let mut index = self.index.lock().unwrap_or_else(|e| e.into_inner());
        let matched: Vec<usize> = workers
            .iter()
            .map(|w| index.get(*w).map_or(0, |s| s.matched(blocks)))
            .collect();
        if self.kind != PolicyKind::CacheAware {
            let chosen = self.pick(loads)?;
            if let Some(w) = workers.get(chosen) {
                index
                    .entry((*w).to_string())
                    .or_default()
                    .insert(blocks, MAX_BLOCKS);
            }
            return Some((chosen, matched.get(chosen).copied().unwrap_or(0)));
        }
        // The least loaded; among equals, in turn, so new prompts spread.
        let min = loads.iter().copied().min().unwrap_or(0);
        let idle: Vec<usize> = (0..loads.len()).filter(|&i| loads[i] == min).collect();
        let least = idle[self.cursor.fetch_add(1, Ordering::Relaxed) % idle.len()];
        let best = (0..loads.len())
            .max_by_key(|&i| {
                (
                    matched[i],
                    std::cmp::Reverse(loads[i]),
                    std::cmp::Reverse(i),
                )
            })
            .unwrap_or(least);
        let worth = matched[best] > 0 && 2 * matched[best] >= blocks.len();
        let idle_enough = loads[best] <= loads[least].saturating_add(CACHE_AWARE_SLACK);
        let chosen = if worth && idle_enough { best } else { least };
        if let Some(w) = workers.get(chosen) {
            index
                .entry((*w).to_string())
                .or_default()
                .insert(blocks, MAX_BLOCKS);
        }
        Some((chosen, matched[chosen]))
    }

    /// Its kind.
    pub fn kind(&self) -> PolicyKind {
        self.kind
    }

    /// Index into `loads` (one entry per candidate) of the chosen one, or
    /// `None` when there is no candidate.
    pub fn pick(&self, loads: &[u64]) -> Option<usize> {
        self.pick_with(loads, &mut rand::rng())
    }

    /// [`Policy::pick`] with a given RNG.
    pub fn pick_with<R: Rng + ?Sized>(&self, loads: &[u64], rng: &mut R) -> Option<usize> {
        if loads.is_empty() {
            return None;
        }
        let n = loads.len();
        Some(match self.kind {
            PolicyKind::RoundRobin => self.cursor.fetch_add(1, Ordering::Relaxed) % n,
            PolicyKind::LeastLoad | PolicyKind::CacheAware => least_loaded(loads),
            PolicyKind::PowerOfTwo => {
                if n == 1 {
                    0
                } else {
                    let a = rng.random_range(0..n);
                    let mut b = rng.random_range(0..n - 1);
                    if b >= a {
                        b += 1;
                    }
                    if loads[b] < loads[a] {
                        b
                    } else {
                        a
                    }
                }
            }
        })
    }
}

/// The first index with the smallest load.
fn least_loaded(loads: &[u64]) -> usize {
    loads
        .iter()
        .enumerate()
        .min_by_key(|(i, l)| (**l, *i))
        .map(|(i, _)| i)
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn names_round_trip() {
        for k in [
            PolicyKind::RoundRobin,
            PolicyKind::LeastLoad,
            PolicyKind::PowerOfTwo,
            PolicyKind::CacheAware,
        ] {
            assert_eq!(k.name().parse::<PolicyKind>().unwrap(), k);
        }
        assert_eq!(
            "power-of-two".parse::<PolicyKind>().unwrap(),
            PolicyKind::PowerOfTwo
        );
        let e = "random".parse::<PolicyKind>().unwrap_err();
        assert!(e.contains("`random`") && e.contains("least_load"), "{e}");
    }

    #[test]
    fn cache_aware_follows_the_prefix_unless_its_worker_is_much_busier() {
        let p = Policy::new(PolicyKind::CacheAware);
        let ws = ["http://a", "http://b", "http://c"];
        let conv = |turns: u64| -> Vec<u64> { (1..=turns * 4).collect() };
        // A new prompt goes to the least loaded, and is remembered there.
        assert_eq!(p.pick_for(&ws, &[3, 1, 2], &conv(1)), Some(1));
        // Its next turns follow it, though b is now the busiest.
        assert_eq!(p.pick_for(&ws, &[0, 4, 0], &conv(2)), Some(1));
        assert_eq!(p.pick_for(&ws, &[0, 4, 0], &conv(3)), Some(1));
        // Unless b is more than the slack busier: then the least loaded.
        let busy = CACHE_AWARE_SLACK + 1;
        assert_eq!(p.pick_for(&ws, &[0, busy, 2], &conv(4)), Some(0));
        // a holds turn 4, b only turn 3: turn 5 goes to the longer match.
        assert_eq!(p.pick_for(&ws, &[1, 0, 0], &conv(5)), Some(0));
        // Less than half the prompt matched: load decides.
        let mut other: Vec<u64> = (1..=2).collect();
        other.extend(100..110);
        assert_eq!(p.pick_for(&ws, &[2, 2, 0], &other), Some(2));
        // Other kinds ignore the prompt.
        let rr = Policy::new(PolicyKind::RoundRobin);
        assert_eq!(rr.pick_for(&ws, &[0, 0, 0], &conv(1)), Some(0));
        assert_eq!(rr.pick_for(&ws, &[0, 0, 0], &conv(1)), Some(1));
        assert_eq!(p.pick_for(&[], &[], &conv(1)), None);
    }

    #[test]
    fn round_robin_cycles() {
        let p = Policy::new(PolicyKind::RoundRobin);
        let picks: Vec<_> = (0..6).map(|_| p.pick(&[5, 0, 9]).unwrap()).collect();
        assert_eq!(picks, [0, 1, 2, 0, 1, 2]);
        assert_eq!(p.pick(&[]), None);
    }

    #[test]
    fn least_load_takes_the_minimum_first_on_ties() {
        let p = Policy::new(PolicyKind::LeastLoad);
        assert_eq!(p.pick(&[3, 1, 2]), Some(1));
        assert_eq!(p.pick(&[2, 0, 0]), Some(1));
        assert_eq!(p.pick(&[7]), Some(0));
    }

    #[test]
    fn power_of_two_never_picks_the_worst_of_three_and_spreads() {
        let p = Policy::new(PolicyKind::PowerOfTwo);
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut seen = [0usize; 3];
        for _ in 0..300 {
            let i = p.pick_with(&[1, 5, 9], &mut rng).unwrap();
            seen[i] += 1;
        }
        assert_eq!(seen[2], 0, "the most loaded of three always loses its pair");
        assert!(seen[0] > seen[1] && seen[1] > 0, "{seen:?}");
        assert_eq!(p.pick_with(&[4], &mut rng), Some(0));
        // Equal loads: both candidates get picked.
        let mut eq = [0usize; 2];
        for _ in 0..100 {
            eq[p.pick_with(&[0, 0], &mut rng).unwrap()] += 1;
        }
        assert!(eq[0] > 0 && eq[1] > 0, "{eq:?}");
    }
}
