//! Pairing policies (DESIGN.md §7): which healthy worker of a role gets the
//! next request. Pure functions of the candidates' loads (and an RNG for
//! power of two), so they are tested with fixed loads.

use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::Rng;

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
}

impl PolicyKind {
    /// The CLI name (`round_robin`, `least_load`, `power_of_two`).
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::PowerOfTwo => "power_of_two",
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
            _ => Err(format!(
                "unknown policy `{s}` (expected round_robin, least_load or power_of_two)"
            )),
        }
    }
}

/// A policy with its state (the round-robin cursor).
#[derive(Debug)]
pub struct Policy {
    kind: PolicyKind,
    cursor: AtomicUsize,
}

impl Policy {
    /// A fresh policy of this kind.
    pub fn new(kind: PolicyKind) -> Self {
        Policy {
            kind,
            cursor: AtomicUsize::new(0),
        }
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
            PolicyKind::LeastLoad => least_loaded(loads),
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
