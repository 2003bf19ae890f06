use super::*;
use crate::native::act::{ActKind, Acts};
use crate::native::blocks::{unpack, BlockType};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rand::{Rng, SeedableRng};

fn random(rng: &mut rand::rngs::StdRng, len: usize, scale: f32) -> Vec<f32> {
    (0..len)
        .map(|_| rng.random_range(-1.0f32..1.0) * scale)
        .collect()
}

fn quantized(w: &[f32], out: usize, inp: usize, dtype: GgmlDType) -> Vec<u8> {
    let t = Tensor::from_slice(w, (out, inp), &Device::Cpu).unwrap();
    QTensor::quantize(&t, dtype)
        .unwrap()
        .data()
        .unwrap()
        .into_owned()
}

/// The formats' arithmetic from the file's own blocks (decoded by
/// `native::blocks`, not the repacked layout), one element at a time.
fn reference(t: BlockType, data: &[u8], x: &[f32], out: usize, inp: usize, n: usize) -> Vec<f32> {
    let blocks = inp / QK_K;
    let mut y = vec![0f32; n * out];
    for c in 0..n {
        let a = Acts::quantize(ActKind::Q8K, &x[c * inp..(c + 1) * inp], 1, inp);
        for o in 0..out {
            let mut acc = 0f32;
            for b in 0..blocks {
                let u = unpack(t, &data[(o * blocks + b) * t.bytes()..][..t.bytes()]);
                let xq = &a.qs[b * QK_K..][..QK_K];
                let s: i32 = (0..QK_K)
                    .map(|e| u.sc[e / 16] * u.q[e] * i32::from(xq[e]))
                    .sum();
                acc = (s as f32).mul_add(u.d * a.d[b], acc);
                if t == BlockType::Q4K {
                    let m: i32 = (0..8).map(|j| u.m[j] * i32::from(a.bsums[b * 8 + j])).sum();
                    acc = (m as f32).mul_add(u.min * -a.d[b], acc);
                }
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

/// Forward of `F` repacked from `data`, on `path`.
fn forward<F: Format>(
    data: &[u8],
    out: usize,
    inp: usize,
    x: &[f32],
    n: usize,
    path: Q8Path,
) -> Vec<f32> {
    KMatrix::<F>::from_ggml(data, out, inp)
        .unwrap()
        .forward_with(x, n, path)
}

/// Every path this CPU runs gives the bits of the reference computed from
/// the file's own blocks, for each format, row counts that are not whole
/// groups, every tile shape and tail, and a zero activation row.
#[test]
fn every_path_gives_the_same_bits() {
    same_bits::<Q4k>(BlockType::Q4K);
    same_bits::<Q6k>(BlockType::Q6K);
}

fn same_bits<F: Format>(t: BlockType) {
    let paths = Q8Path::available();
    eprintln!("kernel paths on this CPU: {paths:?}");
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    for &(out, inp) in &[(27, 512), (64, 2048), (9, 256)] {
        let data = quantized(&random(&mut rng, out * inp, 0.1), out, inp, F::DTYPE);
        for &n in &[1usize, 2, 3, 4, 5, 7, 9] {
            let mut x = random(&mut rng, n * inp, 3.0);
            if n > 2 {
                x[inp..2 * inp].fill(0.0);
            }
            let want = reference(t, &data, &x, out, inp, n);
            for &p in &paths {
                let got = forward::<F>(&data, out, inp, &x, n, p);
                assert_bits_eq(&got, &want, &format!("{t:?} {p:?} {out}x{inp} n={n}"));
            }
        }
    }
}

/// Within float rounding of candle's K-quant × Q8_K product (llama.cpp's
/// `ggml_vec_dot_q4_K_q8_K` and `_q6_K_q8_K`, which sum in another order),
/// and of the dequantized weights times the activations.
#[test]
fn close_to_candle_and_to_the_dequantized_product() {
    close_to_candle::<Q4k>(BlockType::Q4K);
    close_to_candle::<Q6k>(BlockType::Q6K);
}

fn close_to_candle<F: Format>(t: BlockType) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(6);
    let (out, inp, n) = (40, 1024, 3);
    let dtype = F::DTYPE;
    let w = random(&mut rng, out * inp, 0.2);
    let data = quantized(&w, out, inp, dtype);
    let x = random(&mut rng, n * inp, 2.0);
    let ours = forward::<F>(&data, out, inp, &x, n, Q8Path::chosen());
    let qt = QTensor::quantize(
        &Tensor::from_slice(&w, (out, inp), &Device::Cpu).unwrap(),
        dtype,
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
        .chunks_exact(inp / QK_K * t.bytes())
        .flat_map(|row| crate::native::blocks::dequantize_row(t, row))
        .collect();
    let scale = ours.iter().fold(0f32, |a, v| a.max(v.abs()));
    assert!(scale > 1.0, "a product worth comparing: {scale}");
    for c in 0..n {
        for o in 0..out {
            let exact: f32 = (0..inp).map(|i| dq[o * inp + i] * x[c * inp + i]).sum();
            let (a, b) = (ours[c * out + o], candle[c * out + o]);
            assert!(
                (a - b).abs() <= 1e-4 * scale,
                "{t:?} vs candle at {c},{o}: {a} vs {b}"
            );
            // Activation quantization (8 bits per 256) is the larger error.
            assert!(
                (a - exact).abs() <= 2e-2 * scale,
                "{t:?} vs f32 at {c},{o}: {a} vs {exact}"
            );
        }
    }
}

/// A row's result is the same bits in any batch and on any thread count.
#[test]
fn batch_independent() {
    independent::<Q4k>();
    independent::<Q6k>();
}

fn independent<F: Format>() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (out, inp, n) = (83, 768, 13);
    let data = quantized(&random(&mut rng, out * inp, 0.05), out, inp, F::DTYPE);
    let m = KMatrix::<F>::from_ggml(&data, out, inp).unwrap();
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
    let e = Q4kMatrix::from_ggml(&[0; 144], 1, 128).err().unwrap();
    assert!(e.contains("not whole blocks of 256"), "{e}");
    let e = Q4kMatrix::from_ggml(&[0; 143], 1, 256).err().unwrap();
    assert!(e.contains("143 bytes, expected 144"), "{e}");
    assert!(Q4kMatrix::stored_len(9, 300).is_none());
    assert_eq!(Q4kMatrix::stored_len(9, 512), Some(4));
}

/// Repacked Q4_K (or Q6_K) against the Q8_0 copy of the same weights, layer shapes
/// of the 1B Llama shape (fused QKV, fused gate and up), a distinct matrix
/// per use (streamed from memory):
/// `cargo test --release -p handoff-model kquant_timing -- --ignored --nocapture`.
#[test]
#[ignore]
fn kquant_timing() {
    use crate::linear::{Linear, Phase, PhaseFormats, WeightFormat};
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let layers: usize = std::env::var("KQUANT_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(6);
    // `KQUANT_TYPE=q6k`: every matrix Q6_K.
    let t = match std::env::var("KQUANT_TYPE").as_deref() {
        Ok("q6k") => GgmlDType::Q6K,
        _ => GgmlDType::Q4K,
    };
    let shapes = [
        (2048, 2048, t),
        (1024, 2048, t),
        (2048, 2048, t),
        (16384, 2048, t),
        (2048, 8192, t),
    ];
    let both = |f| PhaseFormats {
        prefill: f,
        decode: f,
    };
    let (mut packed, mut q8) = (Vec::new(), Vec::new());
    for _ in 0..layers {
        for &(out, inp, dtype) in &shapes {
            let w = random(&mut rng, out * inp, 0.1);
            let t = QTensor::quantize(
                &Tensor::from_slice(&w, (out, inp), &Device::Cpu).unwrap(),
                dtype,
            )
            .unwrap();
            packed.push(Linear::new(&t, both(WeightFormat::Repacked)).unwrap());
            q8.push(Linear::new(&t, both(WeightFormat::Q8_0Rows)).unwrap());
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
            for (i, set) in [&packed, &q8].iter().enumerate() {
                let t = std::time::Instant::now();
                pool.install(|| {
                    for (m, &(_, inp, _)) in set.iter().zip(shapes.iter().cycle()) {
                        std::hint::black_box(m.forward(&x[..n * inp], n, Phase::Decode).unwrap());
                    }
                });
                if round > 0 {
                    best[i] = best[i].min(t.elapsed().as_secs_f64());
                }
            }
        }
        let mb = |s: &Vec<Linear>| s.iter().map(|m| m.bytes()).sum::<usize>() >> 20;
        println!(
            "n={n}: repacked {:.1} ms ({} MiB, {:.1} GB/s), q8_0 {:.1} ms ({} MiB, {:.1} GB/s): time ratio {:.3}",
            best[0] * 1e3,
            mb(&packed),
            (mb(&packed) << 20) as f64 / best[0] / 1e9,
            best[1] * 1e3,
            mb(&q8),
            (mb(&q8) << 20) as f64 / best[1] / 1e9,
            best[0] / best[1]
        );
    }
}

/// Bytes a second of one decode row (n = 1) through repacked Q4_K and
/// through Q8_0 copies, beside a plain read loop over as many bytes, on 1
/// and 2 threads; about 200 MB of `KBW_OUT` × `KBW_IN` matrices (default
/// 8192 × 2048), each read once per pass (streamed from memory). "one
/// group stream" calls the kernel on one thread without the pool.
/// `KBW_OUT=2048 KBW_IN=2048 cargo test --release -p handoff-model --lib
/// kquant_bandwidth -- --ignored --nocapture`.
#[test]
#[ignore]
fn kquant_bandwidth() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (out, inp) = (env("KBW_OUT", 8192), env("KBW_IN", 2048));
    let count = 200_000_000 / (out * inp / 2);
    let mats: Vec<Q4kMatrix> = (0..count)
        .map(|_| {
            let w = random(&mut rng, out * inp, 0.1);
            let data = quantized(&w, out, inp, GgmlDType::Q4K);
            Q4kMatrix::from_ggml(&data, out, inp).unwrap()
        })
        .collect();
    let q8: Vec<crate::q8_matmul::Q8Matrix> = (0..count * 9 / 17)
        .map(|_| {
            let w = random(&mut rng, out * inp, 0.1);
            let data = quantized(&w, out, inp, GgmlDType::Q8_0);
            crate::q8_matmul::Q8Matrix::from_ggml_q8_0(&data, out, inp).unwrap()
        })
        .collect();
    let q8_bytes: usize = q8.iter().map(|m| m.bytes()).sum();
    let bytes: usize = mats.iter().map(|m| m.bytes()).sum();
    let x = random(&mut rng, inp, 1.0);
    let buf: Vec<u64> = (0..(bytes / 8) as u64).collect();
    for threads in [1usize, 2] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let mut best = [f64::MAX; 4];
        for _ in 0..6 {
            let t = std::time::Instant::now();
            pool.install(|| {
                for m in &q8 {
                    std::hint::black_box(m.forward(&x, 1));
                }
            });
            best[3] = best[3].min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            pool.install(|| {
                for m in &mats {
                    std::hint::black_box(m.forward(&x, 1));
                }
            });
            best[0] = best[0].min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            pool.install(|| {
                use rayon::prelude::*;
                let s: u64 = buf
                    .par_chunks(1 << 16)
                    .map(|c| {
                        let l = c.chunks_exact(8).fold([0u64; 8], |mut a, x| {
                            for (a, x) in a.iter_mut().zip(x) {
                                *a = a.wrapping_add(*x);
                            }
                            a
                        });
                        l.iter().fold(0u64, |a, &x| a.wrapping_add(x))
                    })
                    .reduce(|| 0, u64::wrapping_add);
                std::hint::black_box(s);
            });
            best[1] = best[1].min(t.elapsed().as_secs_f64());
            let acts = quantize_rows(&x, 1, inp, false);
            let t = std::time::Instant::now();
            pool.install(|| {
                for m in &mats {
                    let mut o = vec![0f32; out];
                    m.groups(&acts, 1, 0, &mut o, Q8Path::chosen());
                    std::hint::black_box(o);
                }
            });
            best[2] = best[2].min(t.elapsed().as_secs_f64());
        }
        println!(
            "threads {threads}: q4_k {:.1} GB/s, read loop {:.1} GB/s, q4_k one thread without the pool {:.1} GB/s, q8_0 {:.1} GB/s",
            bytes as f64 / best[0] / 1e9,
            bytes as f64 / best[1] / 1e9,
            bytes as f64 / best[2] / 1e9,
            q8_bytes as f64 / best[3] / 1e9
        );
    }
}
