use super::*;
use crate::native::act::{ActKind, Acts};
use crate::native::blocks::k4_scales;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rand::{Rng, SeedableRng};

fn random(rng: &mut rand::rngs::StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn q4k(w: &[f32], out: usize, inp: usize) -> Vec<u8> {
    let t = Tensor::from_slice(w, (out, inp), &Device::Cpu).unwrap();
    QTensor::quantize(&t, GgmlDType::Q4K)
        .unwrap()
        .data()
        .unwrap()
        .into_owned()
}

/// The module's arithmetic from the file's own blocks (not the repacked
/// layout), one element at a time.
fn reference(data: &[u8], x: &[f32], out: usize, inp: usize, n: usize) -> Vec<f32> {
    let blocks = inp / QK_K;
    let mut y = vec![0f32; n * out];
    for c in 0..n {
        let a = Acts::quantize(ActKind::Q8K, &x[c * inp..(c + 1) * inp], 1, inp);
        for o in 0..out {
            let mut acc = 0f32;
            for b in 0..blocks {
                let blk = &data[(o * blocks + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                let (sc, mn) = k4_scales(&blk[4..16]);
                let (sc, mn) = (sc.to_le_bytes(), mn.to_le_bytes());
                let xq = &a.qs[b * QK_K..][..QK_K];
                let (mut s, mut msum) = (0i32, 0i32);
                for j in 0..8 {
                    let mut dot = 0i32;
                    for l in 0..32 {
                        let byte = blk[16 + 32 * (j / 2) + l];
                        let q = if j % 2 == 0 { byte & 0xF } else { byte >> 4 };
                        dot += i32::from(q) * i32::from(xq[32 * j + l]);
                    }
                    s += i32::from(sc[j]) * dot;
                    msum += i32::from(mn[j]) * i32::from(a.bsums[b * 8 + j]);
                }
                let dw = half::f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let dm = half::f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                acc = (s as f32).mul_add(dw * a.d[b], acc);
                acc = (msum as f32).mul_add(dm * -a.d[b], acc);
            }
            y[c * out + o] = acc;
        }
    }
    y
}

fn assert_bits_eq(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}: element {i}: {x} vs {y}");
    }
}

/// Every path this CPU runs gives the bits of the reference computed from
/// the file's own blocks, for row counts that are not whole groups, every
/// tile shape and tail, and activations with zero rows.
#[test]
fn every_path_gives_the_same_bits() {
    let mut paths = Q8Path::available();
    eprintln!("kernel paths on this CPU: {paths:?}");
    paths.retain(|p| *p != Q8Path::Baseline);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for &(out, inp) in &[(27, 512), (64, 2048), (9, 256)] {
        let w = random(&mut rng, out * inp, 0.1);
        let data = q4k(&w, out, inp);
        let m = Q4kMatrix::from_ggml_q4k(&data, out, inp).unwrap();
        for &n in &[1usize, 2, 3, 4, 5, 7, 9] {
            let mut x = random(&mut rng, n * inp, 3.0);
            if n > 2 {
                x[inp..2 * inp].fill(0.0);
            }
            let want = reference(&data, &x, out, inp, n);
            let portable = m.forward_with(&x, n, Q8Path::Baseline);
            assert_bits_eq(&portable, &want, &format!("portable {out}x{inp} n={n}"));
            for &p in &paths {
                let got = m.forward_with(&x, n, p);
                assert_bits_eq(&got, &want, &format!("{p:?} {out}x{inp} n={n}"));
            }
        }
    }
}

/// Within float rounding of candle's Q4_K × Q8_K product (llama.cpp's
/// `ggml_vec_dot_q4_K_q8_K`, which sums in another order), and of the
/// dequantized weights times the activations.
#[test]
fn close_to_candle_and_to_the_dequantized_product() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    let (out, inp, n) = (40, 1024, 3);
    let w = random(&mut rng, out * inp, 0.2);
    let data = q4k(&w, out, inp);
    let m = Q4kMatrix::from_ggml_q4k(&data, out, inp).unwrap();
    let x = random(&mut rng, n * inp, 2.0);
    let ours = m.forward(&x, n);
    let qt = QTensor::quantize(
        &Tensor::from_slice(&w, (out, inp), &Device::Cpu).unwrap(),
        GgmlDType::Q4K,
    )
    .unwrap();
    let candle = QMatMul::from_qtensor(qt)
        .unwrap()
        .forward(&Tensor::from_slice(&x, (n, inp), &Device::Cpu).unwrap())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let dq: Vec<f32> = data
        .chunks_exact(inp / QK_K * BLOCK_BYTES)
        .flat_map(|row| crate::native::blocks::dequantize_row(crate::native::BlockType::Q4K, row))
        .collect();
    let scale = ours.iter().fold(0f32, |a, v| a.max(v.abs()));
    assert!(scale > 1.0, "a product worth comparing: {scale}");
    for c in 0..n {
        for o in 0..out {
            let exact: f32 = (0..inp).map(|i| dq[o * inp + i] * x[c * inp + i]).sum();
            let (a, b) = (ours[c * out + o], candle[c * out + o]);
            assert!(
                (a - b).abs() <= 1e-4 * scale,
                "vs candle at {c},{o}: {a} vs {b}"
            );
            // Activation quantization (8 bits per 256) is the larger error.
            assert!(
                (a - exact).abs() <= 2e-2 * scale,
                "vs f32 at {c},{o}: {a} vs {exact}"
            );
        }
    }
}

/// A row's result is the same bits in any batch and on any thread count.
#[test]
fn batch_independent() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (out, inp, n) = (83, 768, 13);
    let data = q4k(&random(&mut rng, out * inp, 0.05), out, inp);
    let m = Q4kMatrix::from_ggml_q4k(&data, out, inp).unwrap();
    let x = random(&mut rng, n * inp, 3.0);
    let all = m.forward(&x, n);
    for r in 0..n {
        let solo = m.forward(&x[r * inp..(r + 1) * inp], 1);
        assert_bits_eq(&solo, &all[r * out..(r + 1) * out], "alone");
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    assert_bits_eq(&pool.install(|| m.forward(&x, n)), &all, "one thread");
    assert!(m.forward(&[], 0).is_empty());
}

#[test]
fn rejects_bad_shapes() {
    let e = Q4kMatrix::from_ggml_q4k(&[0; 144], 1, 128).err().unwrap();
    assert!(e.contains("not whole blocks of 256"), "{e}");
    let e = Q4kMatrix::from_ggml_q4k(&[0; 143], 1, 256).err().unwrap();
    assert!(e.contains("143 bytes, expected 144"), "{e}");
    assert!(Q4kMatrix::stored_len(9, 300).is_none());
    assert_eq!(Q4kMatrix::stored_len(9, 512), Some(4));
}

/// Q4_K×8 against the Q8_0 copy of the same weights, layer shapes of the
/// 1B Llama shape, a distinct matrix per use (streamed from memory):
/// `cargo test --release -p handoff-model q4k_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn q4k_timing() {
    use crate::q8_matmul::Q8Matrix;
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let layers: usize = std::env::var("Q4K_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    let shapes = [
        (2048, 2048),
        (512, 2048),
        (512, 2048),
        (2048, 2048),
        (8192, 2048),
        (8192, 2048),
        (2048, 8192),
    ];
    let mut q4 = Vec::new();
    let mut q8 = Vec::new();
    for _ in 0..layers {
        for &(out, inp) in &shapes {
            let w = random(&mut rng, out * inp, 0.1);
            let t = QTensor::quantize(
                &Tensor::from_slice(&w, (out, inp), &Device::Cpu).unwrap(),
                GgmlDType::Q4K,
            )
            .unwrap();
            let data = t.data().unwrap().into_owned();
            q4.push(Q4kMatrix::from_ggml_q4k(&data, out, inp).unwrap());
            let q8t =
                QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), GgmlDType::Q8_0).unwrap();
            q8.push(Q8Matrix::from_ggml_q8_0(&q8t.data().unwrap(), out, inp).unwrap());
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for n in [1usize, 8, 64] {
        let x = random(&mut rng, n * 8192, 1.0);
        let mut best = [f64::MAX; 2];
        for round in 0..5 {
            for (i, best) in best.iter_mut().enumerate() {
                let t = std::time::Instant::now();
                pool.install(|| {
                    for (a, b) in q4.iter().zip(&q8) {
                        let xs = &x[..n * a.in_dim()];
                        if i == 0 {
                            std::hint::black_box(a.forward(xs, n));
                        } else {
                            std::hint::black_box(b.forward(xs, n));
                        }
                    }
                });
                if round > 0 {
                    *best = best.min(t.elapsed().as_secs_f64());
                }
            }
        }
        let mb4: usize = q4.iter().map(|m| m.bytes()).sum::<usize>() >> 20;
        let mb8: usize = q8.iter().map(|m| m.bytes()).sum::<usize>() >> 20;
        println!(
            "n={n}: q4k×8 {:.1} ms ({mb4} MiB), q8_0 {:.1} ms ({mb8} MiB): q4k/q8 time {:.3}",
            best[0] * 1e3,
            best[1] * 1e3,
            best[0] / best[1]
        );
    }
}

#[test]
#[ignore]
fn q8k_quantize_timing() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let x = random(&mut rng, 64 * 8192, 1.0);
    let t = std::time::Instant::now();
    for _ in 0..10 {
        std::hint::black_box(quantize_rows(&x, 64, 8192));
    }
    println!(
        "q8k quantize 64x8192: {:.2} ms",
        t.elapsed().as_secs_f64() * 100.0
    );
    let t = std::time::Instant::now();
    for _ in 0..10 {
        std::hint::black_box(crate::q8_matmul::quantize_rows(&x, 64, 8192));
    }
    println!(
        "q8_0 quantize 64x8192: {:.2} ms",
        t.elapsed().as_secs_f64() * 100.0
    );
}
