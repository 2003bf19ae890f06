//! Several choices from one prompt (`n`, `best_of`): one sequence per
//! choice, each with its own sampler, sharing the prompt's KV.
//!
//! The first sequence runs alone until its first token: by then its
//! prompt's full pages are in the prefix cache (the colocated engine's, and
//! in PD the prefill's and the decode's), so the other sequences, submitted
//! then, find them there: the prompt is computed once and, in PD, crosses
//! once; each later sequence recomputes (and sends) only the prompt's
//! partial last page, which it must own since its own tokens follow in it.
//! With the prefix cache off every sequence computes its prompt.
//!
//! A seeded request's choice `i` samples with seed `seed + i`; greedy
//! choices are all the greedy output. In PD both workers read the same `n`
//! and pair choice `i` under the room derived from the router's room and
//! `i` ([`sub_room`]), which the router signed.

use futures_util::StreamExt;
use handoff_engine::request::GenerateRequest;

use crate::http::errors::ApiError;
use crate::state::AppState;
use crate::worker::backend::Bootstrap;
use crate::worker::generation::{Collected, Generation, Step};

/// Most sequences one request may run (`n`, `best_of`, prompts × `n`):
/// each holds its own KV pages for its output.
pub const MAX_CHOICES: usize = 16;

/// The room of choice `i` (choice 0 keeps the router's): a fixed mix of
/// the room and `i`, so prefill and decode derive the same one.
pub fn sub_room(room: u64, i: usize) -> u64 {
    if i == 0 {
        return room;
    }
    // splitmix64 of the room and the index, in the room's range 1..2^63.
    let mut z = room ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z >> 1).max(1)
}

/// `req` as choice `i`: its own seed when the request has one.
fn sub_request(req: &GenerateRequest, i: usize) -> GenerateRequest {
    let mut r = req.clone();
    r.sampling.seed = req.sampling.seed.map(|s| s.wrapping_add(i as u64));
    r
}

fn sub_bootstrap(pd: &Bootstrap, i: usize) -> Bootstrap {
    let mut b = pd.clone();
    b.room = pd.room.map(|r| sub_room(r, i));
    b
}

/// Check `n` (and `best_of`, at least `n`): the number of sequences to
/// run, each request of `prompts` prompts running `n` (or `best_of`).
pub fn count(
    n: Option<i64>,
    n_field: &str,
    best_of: Option<i64>,
    prompts: usize,
) -> Result<(usize, usize), ApiError> {
    let read = |v: Option<i64>, field: &str| -> Result<usize, ApiError> {
        match v {
            None => Ok(1),
            Some(v) if (1..=MAX_CHOICES as i64).contains(&v) => Ok(v as usize),
            Some(v) => Err(ApiError::invalid_param(
                field,
                format!("{field} must be between 1 and {MAX_CHOICES}, got {v}"),
            )),
        }
    };
    let n = read(n, n_field)?;
    let runs = match best_of {
        None => n,
        b => {
            let b = read(b, "best_of")?;
            if b < n {
                return Err(ApiError::invalid_param(
                    "best_of",
                    format!("best_of ({b}) must be at least n ({n})"),
                ));
            }
            b
        }
    };
    if runs * prompts > MAX_CHOICES {
        return Err(ApiError::invalid_param(
            n_field,
            format!(
                "{prompts} prompts × {runs} sequences is {}: at most {MAX_CHOICES} sequences per request",
                runs * prompts
            ),
        ));
    }
    Ok((n, runs))
}

/// Submit `count` sequences of `req`: the first alone, the others once it
/// has its first token (see the module's note).
/// Sequence `i` pairs (in PD) under the room of index `rooms_from + i`.
pub async fn submit(
    state: &AppState,
    req: GenerateRequest,
    count: usize,
    rooms_from: usize,
    endpoint: &'static str,
    pd: &Bootstrap,
    rid: &str,
) -> Result<Vec<Generation>, ApiError> {
    let first = sub_request(&req, 0);
    let mut first =
        Generation::submit(state, first, endpoint, &sub_bootstrap(pd, rooms_from), rid).await?;
    if count == 1 {
        return Ok(vec![first]);
    }
    first.started().await?;
    let mut gens = vec![first];
    for i in 1..count {
        let sub = sub_request(&req, i);
        let pd = sub_bootstrap(pd, rooms_from + i);
        gens.push(Generation::submit(state, sub, endpoint, &pd, rid).await?);
    }
    Ok(gens)
}

/// One request per prompt, each with the same sampling parameters.
pub fn requests(
    prompts: Vec<Vec<u32>>,
    sampling: &handoff_engine::SamplingParams,
    arrived: std::time::Instant,
) -> Vec<GenerateRequest> {
    prompts
        .into_iter()
        .map(|prompt_ids| GenerateRequest {
            prompt_ids,
            sampling: sampling.clone(),
            arrived,
            output_so_far: Vec::new(),
            class: Default::default(),
        })
        .collect()
}

/// [`submit`] `runs` sequences of every prompt's request, the prompts side
/// by side; prompt `p`'s sequence `j` pairs (in PD) under the room of index
/// `p * runs + j`.
pub async fn submit_prompts(
    state: &AppState,
    reqs: Vec<GenerateRequest>,
    runs: usize,
    endpoint: &'static str,
    pd: &Bootstrap,
    rid: &str,
) -> Result<Vec<Vec<Generation>>, ApiError> {
    futures_util::future::join_all(
        reqs.into_iter()
            .enumerate()
            .map(|(p, req)| submit(state, req, runs, p * runs, endpoint, pd, rid)),
    )
    .await
    .into_iter()
    .collect()
}

/// Every sequence's whole answer, read together; the first error ends it.
pub async fn collect(gens: Vec<Generation>) -> Result<Vec<Collected>, ApiError> {
    futures_util::future::join_all(gens.into_iter().map(Generation::collect))
        .await
        .into_iter()
        .collect()
}

/// The `n` answers of highest total log-probability, best first (`best_of`).
pub fn best(mut all: Vec<Collected>, n: usize) -> Vec<Collected> {
    let score = |c: &Collected| -> f64 { c.tokens.iter().map(|t| f64::from(t.logprob)).sum() };
    all.sort_by(|a, b| score(b).total_cmp(&score(a)));
    all.truncate(n);
    all
}

/// Every sequence's steps as they come, each with its index.
pub fn merged(
    gens: Vec<Generation>,
) -> impl futures_util::Stream<Item = (usize, Step)> + Send + Unpin {
    futures_util::stream::select_all(gens.into_iter().enumerate().map(|(i, g)| {
        futures_util::stream::unfold(g, move |mut g| async move {
            g.next().await.map(|s| ((i, s), g))
        })
        .boxed()
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sub_rooms_are_fixed_distinct_and_in_range() {
        let rooms: Vec<u64> = (0..16).map(|i| sub_room(12345, i)).collect();
        assert_eq!(rooms[0], 12345);
        assert_eq!(
            rooms,
            (0..16).map(|i| sub_room(12345, i)).collect::<Vec<_>>()
        );
        let mut d = rooms.clone();
        d.sort();
        d.dedup();
        assert_eq!(d.len(), 16);
        assert!(rooms.iter().all(|&r| r > 0 && r <= i64::MAX as u64));
        assert_ne!(sub_room(12346, 1), sub_room(12345, 1));
    }

    #[test]
    fn counts_are_checked_by_name() {
        assert_eq!(count(None, "n", None, 1).unwrap(), (1, 1));
        assert_eq!(count(Some(3), "n", Some(5), 1).unwrap(), (3, 5));
        let e = count(Some(3), "n", Some(2), 1).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("best_of"));
        let e = count(Some(0), "n", None, 1).unwrap_err();
        assert!(
            e.message.contains("n must be between 1 and 16, got 0"),
            "{}",
            e.message
        );
        let e = count(Some(4), "n", None, 5).unwrap_err();
        assert!(
            e.message.contains("5 prompts × 4 sequences is 20"),
            "{}",
            e.message
        );
    }
}
