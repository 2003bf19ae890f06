//! Rotary position embedding with the GGUF's parameters, with ggml's
//! formulas (`ggml_rope_cache_init`, `rope_yarn`; angles here in f64):
//! per-dimension frequency factors (Llama 3's `rope_freqs.weight`), linear
//! scaling and YaRN. Llama/Mistral GGUFs rotate adjacent pairs (ggml's
//! "normal" mode; the converter permuted Q/K for it); Qwen and Gemma rotate
//! halves ("neox" mode).

use crate::config::RopeScaling;

/// Which elements form a rotated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// Pairs `(2i, 2i+1)`.
    Interleaved,
    /// Pairs `(i, i + dims/2)`.
    Halves,
}

/// What a RoPE table is computed from.
#[derive(Debug, Clone)]
pub struct RopeParams {
    /// Pairing of the rotated elements.
    pub mode: RopeMode,
    /// Rotated elements per head (even).
    pub dims: usize,
    /// Base frequency.
    pub theta: f32,
    /// Position scaling.
    pub scaling: RopeScaling,
    /// Per-pair divisors of the frequency (`rope_freqs.weight`, `dims/2`
    /// values), if the file has them.
    pub freq_factors: Option<Vec<f32>>,
    /// Factor on cos and sin (`rope.scaling.attn_factor`).
    pub attn_factor: f32,
}

/// Precomputed cos/sin for every position up to a limit.
pub struct Rope {
    mode: RopeMode,
    dims: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    max_pos: usize,
}

/// ggml's `rope_yarn_ramp`.
fn yarn_ramp(low: f32, high: f32, i0: usize) -> f32 {
    let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// ggml's `ggml_rope_yarn_corr_dims`.
fn yarn_corr_dims(
    dims: usize,
    n_ctx_orig: usize,
    base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let corr = |n_rot: f32| {
        dims as f32 * (n_ctx_orig as f32 / (n_rot * 2.0 * std::f32::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let start = corr(beta_fast).floor();
    let end = corr(beta_slow).ceil();
    [start.max(0.0), end.min(dims as f32 - 1.0)]
}

impl Rope {
    /// Tables for positions `0..max_pos`.
    pub fn new(p: &RopeParams, max_pos: usize) -> Self {
        let half = p.dims / 2;
        // llama.cpp's context setup for YaRN: `yarn_attn_factor` cancels
        // the magnitude correction of `rope_yarn`'s own, then
        // `rope_yarn` applies it again: net `1 + 0.1 ln(factor)`.
        let (freq_scale, ext_factor, corr, mscale) = match p.scaling {
            RopeScaling::None => (1.0f32, 0.0f32, [0.0f32; 2], p.attn_factor),
            RopeScaling::Linear { factor } => (1.0 / factor, 0.0, [0.0; 2], p.attn_factor),
            RopeScaling::Yarn {
                factor,
                original_context,
                ext_factor,
                beta_fast,
                beta_slow,
            } => {
                let corr = yarn_corr_dims(p.dims, original_context, p.theta, beta_fast, beta_slow);
                let mut attn = p.attn_factor;
                if ext_factor != 0.0 {
                    let m = if factor <= 1.0 {
                        1.0
                    } else {
                        0.1 * factor.ln() + 1.0
                    };
                    attn *= m * (1.0 / (1.0 + 0.1 * factor.ln()));
                }
                (1.0 / factor, ext_factor, corr, attn)
            }
        };
        // Angles in f64 (as before scaling existed, so an unscaled model's
        // tables are unchanged), the ggml formulas otherwise.
        let (freq_scale, ext_factor, mscale) =
            (freq_scale as f64, ext_factor as f64, mscale as f64);
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for pos in 0..max_pos {
            for i in 0..half {
                let ff = p.freq_factors.as_ref().map_or(1.0, |f| f[i] as f64);
                let freq = (p.theta as f64).powf(-2.0 * i as f64 / p.dims as f64);
                let extrap = pos as f64 * freq / ff;
                let interp = freq_scale * extrap;
                let (mut t, mut m) = (interp, mscale);
                if ext_factor != 0.0 {
                    let mix = yarn_ramp(corr[0], corr[1], 2 * i) as f64 * ext_factor;
                    t = interp * (1.0 - mix) + extrap * mix;
                    m *= 1.0 + 0.1 * (1.0 / freq_scale).ln();
                }
                cos.push((t.cos() * m) as f32);
                sin.push((t.sin() * m) as f32);
            }
        }
        Self {
            mode: p.mode,
            dims: p.dims,
            cos,
            sin,
            max_pos,
        }
    }

    /// Bytes of the tables.
    pub fn bytes(&self) -> usize {
        (self.cos.len() + self.sin.len()) * 4
    }

    /// Largest position + 1 the tables cover.
    pub fn max_pos(&self) -> usize {
        self.max_pos
    }

    /// Rotate every head of one token's `x` (`[heads][head_dim]`) for position `pos`.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, pos: usize) {
        let half = self.dims / 2;
        let cos = &self.cos[pos * half..(pos + 1) * half];
        let sin = &self.sin[pos * half..(pos + 1) * half];
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let (a, b) = match self.mode {
                    RopeMode::Interleaved => (2 * i, 2 * i + 1),
                    RopeMode::Halves => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos[i] - x1 * sin[i];
                head[b] = x0 * sin[i] + x1 * cos[i];
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(scaling: RopeScaling, freq_factors: Option<Vec<f32>>) -> RopeParams {
        RopeParams {
            mode: RopeMode::Interleaved,
            dims: 4,
            theta: 10_000.0,
            scaling,
            freq_factors,
            attn_factor: 1.0,
        }
    }

    #[test]
    fn rotation_keeps_norm_and_position_zero_is_identity() {
        let rope = Rope::new(&params(RopeScaling::None, None), 16);
        let orig = [1.0f32, 2.0, 3.0, 4.0];
        let mut x = orig;
        rope.apply(&mut x, 4, 0);
        assert_eq!(x, orig);
        rope.apply(&mut x, 4, 7);
        let n0: f32 = orig.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        // First pair rotates by exactly `pos` radians.
        assert!((x[0] - (1.0 * 7f32.cos() - 2.0 * 7f32.sin())).abs() < 1e-5);
    }

    /// A frequency factor divides the angle of its pair; linear scaling
    /// divides every angle. Either one ignored fails here.
    #[test]
    fn freq_factors_and_linear_scaling_change_the_angles() {
        let plain = Rope::new(&params(RopeScaling::None, None), 8);
        let ff = Rope::new(&params(RopeScaling::None, Some(vec![1.0, 4.0])), 8);
        let lin = Rope::new(&params(RopeScaling::Linear { factor: 2.0 }, None), 8);
        let angle = |r: &Rope, pos: usize, i: usize| r.sin[pos * 2 + i].atan2(r.cos[pos * 2 + i]);
        assert_eq!(angle(&ff, 5, 0), angle(&plain, 5, 0));
        assert!((angle(&ff, 5, 1) - angle(&plain, 5, 1) / 4.0).abs() < 1e-6);
        assert!((angle(&lin, 6, 0) - angle(&plain, 3, 0)).abs() < 1e-6);
    }

    /// YaRN leaves high-frequency pairs unscaled, interpolates low ones,
    /// and scales magnitudes by 1 + 0.1 ln(factor).
    #[test]
    fn yarn_mixes_and_scales_magnitude() {
        let yarn = RopeScaling::Yarn {
            factor: 4.0,
            original_context: 64,
            ext_factor: 1.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
        };
        let mut p = params(yarn, None);
        p.dims = 64;
        let r = Rope::new(&p, 4);
        let m = (r.cos[32 + 1].powi(2) + r.sin[32 + 1].powi(2)).sqrt();
        assert!((m - (1.0 + 0.1 * 4f32.ln())).abs() < 1e-4, "{m}");
    }
}
