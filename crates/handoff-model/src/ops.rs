//! Element-wise pieces of the forward pass, written to follow ggml's
//! arithmetic (sums accumulated in f64 as ggml does) so results track
//! llama.cpp closely.

/// RMSNorm of each row of `x` (`[n, dim]`) scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let dim = weight.len();
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(dim) {
        let sum: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let mean = (sum / dim as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        out.extend(row.iter().zip(weight).map(|(&v, &w)| v * scale * w));
    }
    out
}

/// `silu(gate) * up`, element-wise.
pub fn silu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
        .collect()
}

/// `acc += x`, element-wise.
pub fn add_assign(acc: &mut [f32], x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += b;
    }
}

/// Add a bias to each row of `x` (`[n, bias.len()]`).
pub fn add_bias(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_assign(row, bias);
    }
}

/// In-place softmax of a row.
pub fn softmax(row: &mut [f32]) {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for v in row.iter_mut() {
        *v = (*v - max).exp();
        sum += *v as f64;
    }
    let inv = (1.0 / sum) as f32;
    for v in row.iter_mut() {
        *v *= inv;
    }
}

/// Dot product, written so the compiler vectorises it (8 lanes).
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let chunks = a.len() / 8;
    for i in 0..chunks {
        for l in 0..8 {
            acc[l] += a[i * 8 + l] * b[i * 8 + l];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `acc += w * x`, element-wise.
#[inline]
pub fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += w * b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_matches_definition() {
        let x = [1.0f32, 2.0, 3.0, 4.0, -1.0, 0.0, 1.0, 0.0];
        let w = [1.0f32, 0.5, 2.0, 1.0];
        let y = rms_norm(&x, &w, 0.0);
        let r = (30.0f32 / 4.0).sqrt();
        assert!((y[0] - 1.0 / r).abs() < 1e-6);
        assert!((y[2] - 6.0 / r).abs() < 1e-6);
        let r2 = (2.0f32 / 4.0).sqrt();
        assert!((y[4] + 1.0 / r2).abs() < 1e-6);
    }

    #[test]
    fn softmax_sums_to_one_and_orders() {
        let mut r = [1.0f32, 3.0, 2.0, -50.0];
        softmax(&mut r);
        assert!((r.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r[1] > r[2] && r[2] > r[0] && r[0] > r[3]);
    }

    #[test]
    fn dot_handles_tails() {
        let a: Vec<f32> = (0..13).map(|i| i as f32).collect();
        let b = vec![2.0f32; 13];
        assert_eq!(dot(&a, &b), 2.0 * 78.0);
    }
}
