//! Element-wise pieces of the forward pass, written to follow ggml's
//! arithmetic (sums accumulated in f64 as ggml does) so results track
//! llama.cpp closely.

/// RMSNorm of each row of `x` (`[n, dim]`) scaled by `weight`.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rms_norm_in_place(&mut out, weight, eps);
    out
}

/// [`rms_norm`] in place, the same bits: each row of `weight.len()`
/// elements (a token's hidden state, or one head of Q or K).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for row in x.chunks_exact_mut(dim) {
        let sum: f64 = row.iter().map(|&v| (v as f64) * (v as f64)).sum();
        let mean = (sum / dim as f64) as f32;
        let scale = 1.0 / (mean + eps).sqrt();
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// ggml's GELU table: the tanh approximation of every f16 input, rounded
/// to f16 (`GGML_GELU_FP16`), built once.
fn gelu_table() -> &'static [f32] {
    use std::sync::OnceLock;
    static TABLE: OnceLock<Vec<f32>> = OnceLock::new();
    TABLE.get_or_init(|| {
        const SQRT_2_OVER_PI: f32 = 0.797_884_6;
        const COEF_A: f32 = 0.044715;
        (0..=u16::MAX)
            .map(|bits| {
                let f = half::f16::from_bits(bits).to_f32();
                let g = 0.5 * f * (1.0 + (SQRT_2_OVER_PI * f * (1.0 + COEF_A * f * f)).tanh());
                half::f16::from_f32(g).to_f32()
            })
            .collect()
    })
}

/// GELU with the tanh approximation, as ggml's CPU backend computes it:
/// the input rounded to f16 and looked up in `table`, outside [-10, 10]
/// zero or the input itself.
fn gelu_in(table: &[f32], x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        table[half::f16::from_f32(x).to_bits() as usize]
    }
}

/// GELU with the tanh approximation, as ggml's CPU backend computes it.
pub fn gelu(x: f32) -> f32 {
    gelu_in(gelu_table(), x)
}

/// `gelu(gate) * up`, element-wise (GeGLU); the table is fetched once.
pub fn gelu_mul(gate: &[f32], up: &[f32]) -> Vec<f32> {
    let table = gelu_table();
    gate.iter()
        .zip(up)
        .map(|(&g, &u)| gelu_in(table, g) * u)
        .collect()
}

/// `c * tanh(x / c)` for every element (final logit soft-capping).
pub fn softcap(x: &mut [f32], c: f32) {
    for v in x {
        *v = (*v / c).tanh() * c;
    }
}

/// Multiply every element by `s`.
pub fn scale(x: &mut [f32], s: f32) {
    for v in x {
        *v *= s;
    }
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

/// `out[j] = dot(q, rows[j])` for consecutive rows of `q.len()` elements,
/// the same bits as [`dot`] per row. With AVX (x86-64-v3) eight rows are
/// reduced together: their lane accumulators are transposed so that the
/// sequential sum of each row's 8 lanes becomes 7 vector adds.
pub fn dots(q: &[f32], rows: &[f32], out: &mut Vec<f32>) {
    let d = q.len();
    let mut rows = rows.chunks_exact(d);
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    if d.is_multiple_of(8) {
        while rows.len() >= 8 {
            let k: [&[f32]; 8] = std::array::from_fn(|_| rows.next().unwrap_or_default());
            out.extend(dot8(q, k));
        }
    }
    out.extend(rows.map(|k| dot(q, k)));
}

/// [`dot`] of `q` with eight rows; `q.len()` is a multiple of 8.
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
#[inline]
fn dot8(q: &[f32], k: [&[f32]; 8]) -> [f32; 8] {
    use safe_arch::{
        add_m256, m256, mul_m256, permute2z_m256, shuffle_m256, unpack_hi_m256, unpack_lo_m256,
        zeroed_m256,
    };
    let load = |s: &[f32]| -> m256 { <[f32; 8]>::try_from(s).unwrap_or_default().into() };
    // `dot`'s lane accumulators, one vector per row: lane l sums the
    // products of elements 8i + l, a multiply then an add per step.
    let mut acc = [zeroed_m256(); 8];
    for (i, qc) in q.chunks_exact(8).enumerate() {
        let qv = load(qc);
        for (a, k) in acc.iter_mut().zip(&k) {
            *a = add_m256(*a, mul_m256(qv, load(&k[8 * i..8 * i + 8])));
        }
    }
    // Transpose: t[l] holds lane l of every row.
    let [r0, r1, r2, r3, r4, r5, r6, r7] = acc;
    let (a0, a1) = (unpack_lo_m256(r0, r1), unpack_hi_m256(r0, r1));
    let (a2, a3) = (unpack_lo_m256(r2, r3), unpack_hi_m256(r2, r3));
    let (a4, a5) = (unpack_lo_m256(r4, r5), unpack_hi_m256(r4, r5));
    let (a6, a7) = (unpack_lo_m256(r6, r7), unpack_hi_m256(r6, r7));
    let (b0, b1) = (shuffle_m256::<0x44>(a0, a2), shuffle_m256::<0xEE>(a0, a2));
    let (b2, b3) = (shuffle_m256::<0x44>(a1, a3), shuffle_m256::<0xEE>(a1, a3));
    let (b4, b5) = (shuffle_m256::<0x44>(a4, a6), shuffle_m256::<0xEE>(a4, a6));
    let (b6, b7) = (shuffle_m256::<0x44>(a5, a7), shuffle_m256::<0xEE>(a5, a7));
    let t = [
        permute2z_m256::<0x20>(b0, b4),
        permute2z_m256::<0x20>(b1, b5),
        permute2z_m256::<0x20>(b2, b6),
        permute2z_m256::<0x20>(b3, b7),
        permute2z_m256::<0x31>(b0, b4),
        permute2z_m256::<0x31>(b1, b5),
        permute2z_m256::<0x31>(b2, b6),
        permute2z_m256::<0x31>(b3, b7),
    ];
    // `acc.iter().sum()` per row: ((l0 + l1) + l2) + ... (the fold starts
    // at -0.0, and -0.0 + l0 is l0).
    t[1..].iter().fold(t[0], |s, &l| add_m256(s, l)).into()
}

/// `acc += w * x`, element-wise.
#[inline]
pub fn axpy(acc: &mut [f32], w: f32, x: &[f32]) {
    for (a, &b) in acc.iter_mut().zip(x) {
        *a += w * b;
    }
}

/// [`axpy`] with `ws[j]` and row `j` of `rows` (`ws.len()` rows of
/// `acc.len()` elements), for each row in order: the same bits as calling
/// [`axpy`] row by row. With AVX, 64 elements of `acc` at a time stay in
/// registers across all rows instead of being loaded and stored per row.
pub fn axpy_rows(acc: &mut [f32], ws: &[f32], rows: &[f32]) {
    let d = acc.len();
    debug_assert_eq!(rows.len(), ws.len() * d);
    #[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
    if d.is_multiple_of(64) {
        use safe_arch::{add_m256, m256, mul_m256, set_splat_m256};
        let load = |s: &[f32]| -> m256 { <[f32; 8]>::try_from(s).unwrap_or_default().into() };
        for (c, chunk) in acc.chunks_exact_mut(64).enumerate() {
            let mut a: [m256; 8] = std::array::from_fn(|l| load(&chunk[8 * l..8 * l + 8]));
            for (&w, row) in ws.iter().zip(rows.chunks_exact(d)) {
                let wv = set_splat_m256(w);
                let x = &row[64 * c..64 * c + 64];
                for (l, a) in a.iter_mut().enumerate() {
                    *a = add_m256(*a, mul_m256(wv, load(&x[8 * l..8 * l + 8])));
                }
            }
            for (l, a) in a.iter().enumerate() {
                chunk[8 * l..8 * l + 8].copy_from_slice(&<[f32; 8]>::from(*a));
            }
        }
        return;
    }
    for (&w, row) in ws.iter().zip(rows.chunks_exact(d)) {
        axpy(acc, w, row);
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

    /// A seeded stream of values in [-1, 1) (a linear congruential
    /// generator: the tests' inputs, reproducible without a crate).
    fn lcg(mut seed: u32) -> impl FnMut() -> f32 {
        move || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 * 2.0 - 1.0
        }
    }

    /// `dots` gives `dot`'s bits for every row, with and without a
    /// multiple of 8 rows or of 8 elements.
    #[test]
    fn dots_equal_dot() {
        let mut rnd = lcg(1);
        for (d, n) in [(64, 16), (64, 13), (8, 9), (12, 10), (64, 3)] {
            let q: Vec<f32> = (0..d).map(|_| rnd()).collect();
            let rows: Vec<f32> = (0..d * n).map(|_| rnd() * 3.0).collect();
            let mut got = Vec::new();
            dots(&q, &rows, &mut got);
            assert_eq!(got.len(), n);
            for (g, k) in got.iter().zip(rows.chunks_exact(d)) {
                assert_eq!(g.to_bits(), dot(&q, k).to_bits());
            }
        }
    }

    /// `axpy_rows` gives the bits of `axpy` row by row, for head sizes on
    /// and off its 64-element register path.
    #[test]
    fn axpy_rows_equals_axpy_per_row() {
        let mut rnd = lcg(7);
        for (d, n) in [(64, 16), (128, 5), (64, 1), (48, 7), (8, 3)] {
            let init: Vec<f32> = (0..d).map(|_| rnd()).collect();
            let ws: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let rows: Vec<f32> = (0..d * n).map(|_| rnd() * 3.0).collect();
            let mut got = init.clone();
            axpy_rows(&mut got, &ws, &rows);
            let mut want = init;
            for (&w, row) in ws.iter().zip(rows.chunks_exact(d)) {
                axpy(&mut want, w, row);
            }
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&got), bits(&want), "d={d} n={n}");
        }
    }

    #[test]
    fn dot_handles_tails() {
        let a: Vec<f32> = (0..13).map(|i| i as f32).collect();
        let b = vec![2.0f32; 13];
        assert_eq!(dot(&a, &b), 2.0 * 78.0);
    }
}
