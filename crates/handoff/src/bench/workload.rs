//! The seeded workload of `handoff bench`: length distributions parsed from
//! the command line, the request list (prompts and output lengths) and the
//! Poisson arrival times. Pure functions of (spec, seed): the target and the
//! baseline see exactly the same requests.

use std::fmt;
use std::str::FromStr;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The longest prompt or output a length distribution may ask for.
pub const MAX_LEN: u32 = 1_000_000;

const SPEC_FORMS: &str = "expected N, uniform:A-B or normal:MEAN,SD";

/// A distribution of token counts: `N`, `uniform:A-B` (inclusive) or
/// `normal:MEAN,SD` (rounded, clamped to at least 1).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LenDist {
    /// Always `N`.
    Fixed(u32),
    /// Uniform over `A..=B`.
    Uniform(u32, u32),
    /// Normal with this mean and standard deviation.
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        sd: f64,
    },
}

fn whole(s: &str) -> Option<u32> {
    s.trim()
        .parse::<u32>()
        .ok()
        .filter(|n| (1..=MAX_LEN).contains(n))
}

impl FromStr for LenDist {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.is_empty() {
            return Err(format!("empty length spec: {SPEC_FORMS}"));
        }
        let Some((kind, rest)) = s.split_once(':') else {
            return whole(s).map(LenDist::Fixed).ok_or_else(|| {
                format!("a fixed length must be a whole number in 1..={MAX_LEN}, got '{s}' ({SPEC_FORMS})")
            });
        };
        match kind {
            "uniform" => {
                let bad = || {
                    format!("uniform:A-B needs two whole numbers in 1..={MAX_LEN}, got '{rest}'")
                };
                let (a, b) = rest.split_once('-').ok_or_else(bad)?;
                let (a, b) = (whole(a).ok_or_else(bad)?, whole(b).ok_or_else(bad)?);
                if a > b {
                    return Err(format!("uniform:A-B needs A <= B, got {a}-{b}"));
                }
                Ok(LenDist::Uniform(a, b))
            }
            "normal" => {
                let bad = || {
                    format!("normal:MEAN,SD needs MEAN in (0, {MAX_LEN}] and SD >= 0, got '{rest}'")
                };
                let (m, d) = rest.split_once(',').ok_or_else(bad)?;
                let mean: f64 = m.trim().parse().map_err(|_| bad())?;
                let sd: f64 = d.trim().parse().map_err(|_| bad())?;
                if !(mean > 0.0 && mean <= MAX_LEN as f64 && sd >= 0.0 && sd.is_finite()) {
                    return Err(bad());
                }
                Ok(LenDist::Normal { mean, sd })
            }
            other => Err(format!(
                "unknown length distribution '{other}': {SPEC_FORMS}"
            )),
        }
    }
}

impl fmt::Display for LenDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LenDist::Fixed(n) => write!(f, "{n}"),
            LenDist::Uniform(a, b) => write!(f, "uniform:{a}-{b}"),
            LenDist::Normal { mean, sd } => write!(f, "normal:{mean},{sd}"),
        }
    }
}

/// A standard normal draw (Box-Muller).
fn standard_normal(rng: &mut StdRng) -> f64 {
    let u1 = 1.0 - rng.random::<f64>(); // (0, 1]: ln is finite
    let u2 = rng.random::<f64>();
    (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// An exponential draw with this rate (inverse CDF).
pub fn exponential(rng: &mut StdRng, rate: f64) -> f64 {
    -(1.0 - rng.random::<f64>()).ln() / rate
}

impl LenDist {
    /// One length.
    pub fn sample(&self, rng: &mut StdRng) -> u32 {
        match *self {
            LenDist::Fixed(n) => n,
            LenDist::Uniform(a, b) => rng.random_range(a..=b),
            LenDist::Normal { mean, sd } => {
                let x = (mean + sd * standard_normal(rng)).round();
                x.clamp(1.0, MAX_LEN as f64) as u32
            }
        }
    }
}

/// One workload class of `--mix WEIGHT:PROMPT/OUTPUT`: requests of this
/// class are drawn with probability weight / (sum of weights).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Class {
    /// Relative weight (> 0).
    pub weight: f64,
    /// Prompt lengths.
    pub prompt_len: LenDist,
    /// Output lengths.
    pub output_len: LenDist,
}

impl FromStr for Class {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let form = || format!("a mix class is WEIGHT:PROMPT/OUTPUT (e.g. 0.8:32/128), got '{s}'");
        let (w, lens) = s.split_once(':').ok_or_else(form)?;
        let (p, o) = lens.rsplit_once('/').ok_or_else(form)?;
        let weight: f64 = w.trim().parse().map_err(|_| form())?;
        if !(weight.is_finite() && weight > 0.0) {
            return Err(format!("a mix class weight must be > 0, got '{w}'"));
        }
        Ok(Class {
            weight,
            prompt_len: p.parse().map_err(|e| format!("prompt length '{p}': {e}"))?,
            output_len: o.parse().map_err(|e| format!("output length '{o}': {e}"))?,
        })
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}/{}", self.weight, self.prompt_len, self.output_len)
    }
}

/// Which OpenAI endpoint the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// POST /v1/completions with the prompt as token ids (exact lengths).
    Completions,
    /// POST /v1/chat/completions with random words (approximate lengths).
    Chat,
}

impl Endpoint {
    /// The request path.
    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::Chat => "/v1/chat/completions",
        }
    }
}

/// What shapes the request list.
#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    /// Seed of every random choice.
    pub seed: u64,
    /// Number of requests (warm-up ones included).
    pub requests: usize,
    /// Workload classes (prompt and output lengths); one or more.
    pub classes: Vec<Class>,
    /// Prompt token ids are drawn from `min_token_id..max_token_id`.
    pub min_token_id: u32,
    /// Exclusive upper bound of the prompt token ids.
    pub max_token_id: u32,
    /// Token ids or words.
    pub endpoint: Endpoint,
}

/// The prompt of one request.
#[derive(Debug, Clone, PartialEq)]
pub enum Prompt {
    /// Token ids (completions).
    Ids(Vec<u32>),
    /// Words separated by spaces, about one token each (chat).
    Text(String),
}

/// One request of the workload.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestSpec {
    /// The prompt.
    pub prompt: Prompt,
    /// Index of its class in `WorkloadSpec::classes`.
    pub class: usize,
    /// Its intended length in tokens (exact for ids).
    pub prompt_len: u32,
    /// `max_tokens` (with `ignore_eos`, the exact output length).
    pub max_tokens: u32,
}

/// Common short English words: mostly one token each in BPE vocabularies.
const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "it", "that", "was", "for", "on", "are", "with", "as",
    "his", "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but",
    "what", "some", "we", "can", "out", "other", "were", "all", "there", "when", "up", "use",
    "your", "how", "said", "an", "each", "she", "which", "do", "their", "time", "if", "will",
    "way", "about", "many", "then", "them", "write", "would", "like", "so", "these", "her", "long",
    "make", "thing", "see", "him", "two", "has", "look", "more", "day", "could", "go", "come",
    "did", "number", "sound", "no", "most", "people", "my", "over", "know", "water", "than",
    "call", "first", "who", "may", "down", "side", "been", "now", "find",
];

impl WorkloadSpec {
    /// A class index, by weight (no draw with a single class).
    fn pick_class(&self, rng: &mut StdRng) -> usize {
        if self.classes.len() < 2 {
            return 0;
        }
        let total: f64 = self.classes.iter().map(|c| c.weight).sum();
        let mut x = rng.random::<f64>() * total;
        for (i, c) in self.classes.iter().enumerate() {
            if x < c.weight {
                return i;
            }
            x -= c.weight;
        }
        self.classes.len() - 1
    }

    /// The request list: the same spec gives the same list.
    pub fn generate(&self) -> Vec<RequestSpec> {
        let mut rng = StdRng::seed_from_u64(self.seed);
        (0..self.requests)
            .map(|_| {
                let class = self.pick_class(&mut rng);
                let c = &self.classes[class];
                let prompt_len = c.prompt_len.sample(&mut rng);
                let max_tokens = c.output_len.sample(&mut rng);
                let prompt = match self.endpoint {
                    Endpoint::Completions => Prompt::Ids(
                        (0..prompt_len)
                            .map(|_| rng.random_range(self.min_token_id..self.max_token_id))
                            .collect(),
                    ),
                    Endpoint::Chat => Prompt::Text(
                        (0..prompt_len)
                            .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                            .collect::<Vec<_>>()
                            .join(" "),
                    ),
                };
                RequestSpec {
                    prompt,
                    class,
                    prompt_len,
                    max_tokens,
                }
            })
            .collect()
    }
}

/// The shared-prefix chat workload: `systems` system prompts of
/// `system_len` tokens, `conversations` conversations (conversation `c`
/// uses system prompt `c % systems`) of `turns` turns each. Every turn's
/// prompt is the whole history (system prompt, then each earlier turn's user
/// message and a stand-in for its answer) plus a new user message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPrefix {
    /// Distinct system prompts.
    pub systems: u32,
    /// Tokens of each system prompt.
    pub system_len: u32,
    /// Conversations.
    pub conversations: u32,
    /// Turns per conversation.
    pub turns: u32,
}

impl FromStr for SharedPrefix {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "expected SYSTEMS:SYSTEM_LEN:CONVERSATIONS:TURNS, four whole numbers >= 1, got '{s}'"
            )
        };
        let parts: Vec<u32> = s
            .split(':')
            .map(|p| p.trim().parse::<u32>().ok().filter(|n| *n >= 1))
            .collect::<Option<_>>()
            .ok_or_else(bad)?;
        let [systems, system_len, conversations, turns] = parts[..] else {
            return Err(bad());
        };
        if system_len > MAX_LEN {
            return Err(format!("SYSTEM_LEN {system_len} is over {MAX_LEN}"));
        }
        Ok(SharedPrefix {
            systems,
            system_len,
            conversations,
            turns,
        })
    }
}

impl fmt::Display for SharedPrefix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}:{}",
            self.systems, self.system_len, self.conversations, self.turns
        )
    }
}

impl WorkloadSpec {
    /// The shared-prefix requests, turn by turn (every conversation's turn
    /// 0, then every turn 1, ...): with at most `conversations` requests in
    /// flight, a conversation's next turn is sent about when its previous
    /// one ends. User messages and answers take their lengths from the first
    /// class (`--prompt-len`, `--output-len`).
    pub fn shared_prefix(&self, sp: SharedPrefix) -> Vec<RequestSpec> {
        let mut rng = StdRng::seed_from_u64(self.seed ^ 0x5eed_5eed);
        let class = &self.classes[0];
        let words = |rng: &mut StdRng, n: u32| -> Vec<u32> {
            (0..n)
                .map(|_| rng.random_range(self.min_token_id..self.max_token_id))
                .collect()
        };
        let systems: Vec<Vec<u32>> = (0..sp.systems)
            .map(|_| words(&mut rng, sp.system_len))
            .collect();
        let mut history: Vec<Vec<u32>> = (0..sp.conversations)
            .map(|c| systems[(c % sp.systems) as usize].clone())
            .collect();
        let mut out = Vec::new();
        for _turn in 0..sp.turns {
            for h in history.iter_mut() {
                let user_len = class.prompt_len.sample(&mut rng);
                let max_tokens = class.output_len.sample(&mut rng);
                h.extend(words(&mut rng, user_len));
                out.push(self.request(h.clone(), max_tokens));
                // The answer, as the client would keep it in the history.
                h.extend(words(&mut rng, max_tokens));
            }
        }
        out
    }

    fn request(&self, ids: Vec<u32>, max_tokens: u32) -> RequestSpec {
        let prompt_len = ids.len() as u32;
        let prompt = match self.endpoint {
            Endpoint::Completions => Prompt::Ids(ids),
            Endpoint::Chat => Prompt::Text(
                ids.iter()
                    .map(|&i| WORDS[i as usize % WORDS.len()])
                    .collect::<Vec<_>>()
                    .join(" "),
            ),
        };
        RequestSpec {
            prompt,
            class: 0,
            prompt_len,
            max_tokens,
        }
    }
}

/// Send offsets (seconds from the start) of `n` Poisson arrivals at `rate`
/// requests/s: cumulative exponential gaps, from their own seeded stream so
/// the prompts do not depend on the load shape.
pub fn poisson_arrivals(seed: u64, rate: f64, n: usize) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x9e37_79b9_7f4a_7c15);
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            t += exponential(&mut rng, rate);
            t
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(s: &str) -> String {
        s.parse::<LenDist>().unwrap_err()
    }

    #[test]
    fn shared_prefix_turns_extend_their_conversation_and_share_the_system_prompt() {
        let spec = WorkloadSpec {
            seed: 3,
            requests: 0,
            classes: vec![Class {
                weight: 1.0,
                prompt_len: LenDist::Fixed(5),
                output_len: LenDist::Fixed(4),
            }],
            min_token_id: 100,
            max_token_id: 10_000,
            endpoint: Endpoint::Completions,
        };
        let sp: SharedPrefix = "2:30:3:2".parse().unwrap();
        assert_eq!(sp.to_string(), "2:30:3:2");
        let reqs = spec.shared_prefix(sp);
        assert_eq!(reqs, spec.shared_prefix(sp), "seeded");
        assert_eq!(reqs.len(), 6);
        let ids = |i: usize| match &reqs[i].prompt {
            Prompt::Ids(v) => v.clone(),
            other => panic!("{other:?}"),
        };
        // Turn 0: system + 5 user tokens; conversations 0 and 2 share system 0.
        assert_eq!(ids(0).len(), 35);
        assert_eq!(ids(0)[..30], ids(2)[..30]);
        assert_ne!(ids(0)[..30], ids(1)[..30]);
        // Turn 1 of conversation 0: turn 0's prompt + 4 answer + 5 user.
        assert_eq!(ids(3).len(), 35 + 4 + 5);
        assert_eq!(ids(3)[..35], ids(0)[..]);
        assert_eq!(reqs[3].prompt_len, 44);
        assert_eq!(reqs[3].max_tokens, 4);
        for bad in ["2:30:3", "0:30:3:2", "a:1:1:1", "1:1:1:1:1"] {
            assert!(bad.parse::<SharedPrefix>().is_err(), "{bad}");
        }
    }

    #[test]
    fn parses_good_specs() {
        assert_eq!("32".parse(), Ok(LenDist::Fixed(32)));
        assert_eq!("uniform:16-1024".parse(), Ok(LenDist::Uniform(16, 1024)));
        assert_eq!("uniform:5-5".parse(), Ok(LenDist::Uniform(5, 5)));
        assert_eq!(
            "normal:128,32.5".parse(),
            Ok(LenDist::Normal {
                mean: 128.0,
                sd: 32.5
            })
        );
        for s in ["7", "uniform:1-9", "normal:10,2"] {
            assert_eq!(s.parse::<LenDist>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn bad_specs_say_what_is_wrong() {
        assert_eq!(err("uniform:9-3"), "uniform:A-B needs A <= B, got 9-3");
        assert_eq!(
            err("uniform:3"),
            "uniform:A-B needs two whole numbers in 1..=1000000, got '3'"
        );
        assert_eq!(
            err("uniform:0-4"),
            "uniform:A-B needs two whole numbers in 1..=1000000, got '0-4'"
        );
        assert_eq!(
            err("0"),
            "a fixed length must be a whole number in 1..=1000000, got '0' (expected N, uniform:A-B or normal:MEAN,SD)"
        );
        assert!(err("abc").contains("got 'abc'"));
        assert_eq!(
            err("normal:-1,2"),
            "normal:MEAN,SD needs MEAN in (0, 1000000] and SD >= 0, got '-1,2'"
        );
        assert!(err("normal:10").contains("got '10'"));
        assert!(err("normal:10,-1").contains("SD >= 0"));
        assert_eq!(
            err("zipf:3"),
            "unknown length distribution 'zipf': expected N, uniform:A-B or normal:MEAN,SD"
        );
        assert!(err("").starts_with("empty length spec"));
    }

    #[test]
    fn samples_stay_in_range() {
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..1000 {
            let u = LenDist::Uniform(3, 7).sample(&mut rng);
            assert!((3..=7).contains(&u), "{u}");
            let n = LenDist::Normal {
                mean: 2.0,
                sd: 50.0,
            }
            .sample(&mut rng);
            assert!(n >= 1, "{n}");
        }
        let draws: Vec<f64> = (0..10_000)
            .map(|_| {
                LenDist::Normal {
                    mean: 500.0,
                    sd: 20.0,
                }
                .sample(&mut rng) as f64
            })
            .collect();
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        let var = draws.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / draws.len() as f64;
        assert!((mean - 500.0).abs() < 1.0, "mean {mean}");
        assert!((var.sqrt() - 20.0).abs() < 1.0, "sd {}", var.sqrt());
    }

    fn spec(seed: u64, endpoint: Endpoint) -> WorkloadSpec {
        WorkloadSpec {
            seed,
            requests: 20,
            classes: vec![Class {
                weight: 1.0,
                prompt_len: LenDist::Uniform(16, 64),
                output_len: LenDist::Normal {
                    mean: 20.0,
                    sd: 5.0,
                },
            }],
            min_token_id: 100,
            max_token_id: 10_000,
            endpoint,
        }
    }

    #[test]
    fn workload_is_reproducible_from_its_seed() {
        for endpoint in [Endpoint::Completions, Endpoint::Chat] {
            let a = spec(7, endpoint).generate();
            assert_eq!(a, spec(7, endpoint).generate());
            assert_ne!(a, spec(8, endpoint).generate());
        }
        let a = spec(7, Endpoint::Completions).generate();
        assert_eq!(a.len(), 20);
        for r in &a {
            let Prompt::Ids(ids) = &r.prompt else {
                panic!("completions prompts are ids")
            };
            assert_eq!(ids.len(), r.prompt_len as usize);
            assert!((16..=64).contains(&r.prompt_len));
            assert!(ids.iter().all(|&t| (100..10_000).contains(&t)));
        }
        // Not all alike: the distribution is really sampled.
        assert!(a.iter().any(|r| r.prompt_len != a[0].prompt_len));
        let chat = spec(7, Endpoint::Chat).generate();
        let Prompt::Text(t) = &chat[0].prompt else {
            panic!("chat prompts are text")
        };
        assert_eq!(t.split(' ').count(), chat[0].prompt_len as usize);
    }

    #[test]
    fn mix_classes_parse_and_are_drawn_by_weight() {
        let c: Class = "0.2:uniform:512-1024/16".parse().unwrap();
        assert_eq!(
            c,
            Class {
                weight: 0.2,
                prompt_len: LenDist::Uniform(512, 1024),
                output_len: LenDist::Fixed(16)
            }
        );
        assert_eq!(c.to_string(), "0.2:uniform:512-1024/16");
        assert_eq!(
            "3:normal:100,10/normal:8,2"
                .parse::<Class>()
                .unwrap()
                .output_len,
            LenDist::Normal { mean: 8.0, sd: 2.0 }
        );
        assert_eq!(
            "32/128".parse::<Class>().unwrap_err(),
            "a mix class is WEIGHT:PROMPT/OUTPUT (e.g. 0.8:32/128), got '32/128'"
        );
        assert_eq!(
            "0:32/128".parse::<Class>().unwrap_err(),
            "a mix class weight must be > 0, got '0'"
        );
        assert_eq!(
            "1:uniform:9-3/4".parse::<Class>().unwrap_err(),
            "prompt length 'uniform:9-3': uniform:A-B needs A <= B, got 9-3"
        );
        assert!("1:4/x"
            .parse::<Class>()
            .unwrap_err()
            .starts_with("output length 'x': "));

        let mut spec = spec(1, Endpoint::Completions);
        spec.requests = 4000;
        spec.classes = vec!["3:8/1".parse().unwrap(), "1:100/2".parse().unwrap()];
        let reqs = spec.generate();
        let long = reqs.iter().filter(|r| r.class == 1).count();
        assert!((900..1100).contains(&long), "{long} of 4000");
        for r in &reqs {
            let expect = if r.class == 0 { (8, 1) } else { (100, 2) };
            assert_eq!((r.prompt_len, r.max_tokens), expect);
        }
    }

    #[test]
    fn poisson_gaps_average_one_over_rate() {
        let rate = 4.0;
        let t = poisson_arrivals(3, rate, 10_000);
        assert!(t.windows(2).all(|w| w[1] > w[0]));
        let mean_gap = t[t.len() - 1] / t.len() as f64;
        assert!(
            (mean_gap - 1.0 / rate).abs() < 0.1 / rate,
            "mean gap {mean_gap}"
        );
        assert_eq!(t, poisson_arrivals(3, rate, 10_000));
        assert_ne!(t, poisson_arrivals(4, rate, 10_000));
    }
}
