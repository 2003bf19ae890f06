//! Rotary position embedding with the GGUF's parameters. Llama/Mistral GGUFs
//! rotate adjacent pairs (ggml's "normal" mode; the converter permuted Q/K
//! for it); Qwen2 rotates halves ("neox" mode).

/// Which elements form a rotated pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeMode {
    /// Pairs `(2i, 2i+1)`.
    Interleaved,
    /// Pairs `(i, i + dims/2)`.
    Halves,
}

/// Precomputed cos/sin for every position up to a limit.
pub struct Rope {
    mode: RopeMode,
    dims: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
    max_pos: usize,
}

impl Rope {
    /// Tables for positions `0..max_pos`, rotating the first `dims` elements of each head.
    pub fn new(mode: RopeMode, dims: usize, theta: f32, max_pos: usize) -> Self {
        let half = dims / 2;
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for pos in 0..max_pos {
            for i in 0..half {
                let freq = (theta as f64).powf(-2.0 * i as f64 / dims as f64);
                let angle = pos as f64 * freq;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Self {
            mode,
            dims,
            cos,
            sin,
            max_pos,
        }
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

    #[test]
    fn rotation_keeps_norm_and_position_zero_is_identity() {
        let rope = Rope::new(RopeMode::Interleaved, 4, 10_000.0, 16);
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
}
