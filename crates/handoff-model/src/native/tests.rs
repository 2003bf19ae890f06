use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use rand::{Rng, SeedableRng};

use super::*;

fn ggml(t: BlockType) -> GgmlDType {
    match t {
        BlockType::Q4_0 => GgmlDType::Q4_0,
        BlockType::Q4_1 => GgmlDType::Q4_1,
        BlockType::Q5_0 => GgmlDType::Q5_0,
        BlockType::Q5_1 => GgmlDType::Q5_1,
        BlockType::Q8_0 => GgmlDType::Q8_0,
        BlockType::Q4K => GgmlDType::Q4K,
        BlockType::Q5K => GgmlDType::Q5K,
        BlockType::Q6K => GgmlDType::Q6K,
    }
}

/// Weights `[out, inp]` quantized to `t` by candle (llama.cpp's reference
/// quantizers), activations `[n, inp]`.
fn case(t: BlockType, out: usize, inp: usize, n: usize, seed: u64) -> (QTensor, Vec<f32>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let w: Vec<f32> = (0..out * inp)
        .map(|_| rng.random_range(-0.5f32..0.5))
        .collect();
    let x: Vec<f32> = (0..n * inp).map(|_| rng.random_range(-2f32..2.0)).collect();
    let q = QTensor::quantize(
        &Tensor::from_slice(&w, (out, inp), &Device::Cpu).unwrap(),
        ggml(t),
    )
    .unwrap();
    (q, x)
}

fn matrix(t: BlockType, q: &QTensor) -> NativeMatrix {
    let (rows, inp) = q.shape().dims2().unwrap();
    let data = WeightBytes::Owned(Arc::new(q.data().unwrap().into_owned()));
    NativeMatrix::new(vec![Part { t, rows, data }], inp).unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

/// Every path gives the same bits, and a row's result is the same bits
/// whatever else is in the batch (the row rule).
#[test]
fn every_path_and_batch_gives_the_same_bits() {
    for t in BlockType::ALL {
        let (out, inp) = (37, 512);
        let (q, x) = case(t, out, inp, 11, 11);
        let m = matrix(t, &q);
        let full = m.forward_with(&x, 11, NativePath::Portable);
        for path in NativePath::available() {
            for n in 1..=11 {
                let got = m.forward_with(&x[..n * inp], n, path);
                assert_eq!(bits(&got), bits(&full[..n * out]), "{t:?} {path:?} n={n}");
            }
            // Row 5 alone is the same bits as row 5 among eleven.
            let alone = m.forward_with(&x[5 * inp..6 * inp], 1, path);
            assert_eq!(
                bits(&alone),
                bits(&full[5 * out..6 * out]),
                "{t:?} {path:?}"
            );
        }
    }
}

/// Unpacking equals candle's dequantization (llama.cpp's `dequantize_row_*`)
/// bit for bit, and the kernel is within rounding of candle's own block
/// dot products (llama.cpp's `ggml_vec_dot_*` formulas) and of the
/// dequantized f64 product.
#[test]
fn close_to_llamacpp_dot_products() {
    for t in BlockType::ALL {
        let (out, inp, n) = (19, 768, 3);
        let (q, x) = case(t, out, inp, n, 5);
        let deq = q.dequantize(&Device::Cpu).unwrap();
        let deq: Vec<f32> = deq.flatten_all().unwrap().to_vec1().unwrap();
        let data = q.data().unwrap();
        let ours_deq = blocks::dequantize_row(t, &data);
        assert_eq!(bits(&ours_deq), bits(&deq), "{t:?} dequantization");
        let ours = matrix(t, &q).forward(&x, n);
        let candle = QMatMul::from_qtensor(q)
            .unwrap()
            .forward(&Tensor::from_slice(&x, (n, inp), &Device::Cpu).unwrap())
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for r in 0..n {
            for o in 0..out {
                let (w, xr) = (&deq[o * inp..][..inp], &x[r * inp..][..inp]);
                let exact: f64 = w.iter().zip(xr).map(|(a, b)| f64::from(*a * *b)).sum();
                let mag: f64 = w
                    .iter()
                    .zip(xr)
                    .map(|(a, b)| f64::from((a * b).abs()))
                    .sum();
                let got = f64::from(ours[r * out + o]);
                let theirs = f64::from(candle[r * out + o]);
                // Activation quantization: about 1/254 of each |w·x|.
                assert!(
                    (got - exact).abs() <= mag / 100.0,
                    "{t:?}: {got} vs {exact}"
                );
                // The same quantized activations: float rounding only.
                assert!(
                    (got - theirs).abs() <= mag * 1e-5,
                    "{t:?}: {got} vs candle {theirs}"
                );
            }
        }
    }
}

/// A stacked matrix of parts in different formats equals its parts.
#[test]
fn mixed_parts_stack_exactly() {
    let inp = 256;
    let (qa, x) = case(BlockType::Q4K, 9, inp, 2, 1);
    let (qb, _) = case(BlockType::Q6K, 5, inp, 2, 2);
    let (qc, _) = case(BlockType::Q8_0, 4, inp, 2, 3);
    let (a, b, c) = (
        matrix(BlockType::Q4K, &qa),
        matrix(BlockType::Q6K, &qb),
        matrix(BlockType::Q8_0, &qc),
    );
    let both = NativeMatrix::new(
        [
            (&a, BlockType::Q4K),
            (&b, BlockType::Q6K),
            (&c, BlockType::Q8_0),
        ]
        .iter()
        .map(|(m, t)| Part {
            t: *t,
            rows: m.out_dim,
            data: m.parts[0].data.clone(),
        })
        .collect(),
        inp,
    )
    .unwrap();
    let y = both.forward(&x, 2);
    for r in 0..2 {
        let xr = &x[r * inp..][..inp];
        let want: Vec<f32> = [a.forward(xr, 1), b.forward(xr, 1), c.forward(xr, 1)].concat();
        assert_eq!(bits(&y[r * 18..][..18]), bits(&want));
    }
}

/// A Q8_0 weight of -128 (which llama.cpp's quantizer never writes) gets
/// the same bits on every path; a part of the wrong length is refused.
#[test]
fn odd_bytes_agree_and_bad_lengths_are_refused() {
    let (q, x) = case(BlockType::Q8_0, 3, 64, 2, 9);
    let mut bytes = q.data().unwrap().into_owned();
    for b in bytes.iter_mut().skip(2).step_by(5) {
        *b = 0x80;
    }
    let m = NativeMatrix::new(
        vec![Part {
            t: BlockType::Q8_0,
            rows: 3,
            data: WeightBytes::Owned(Arc::new(bytes.clone())),
        }],
        64,
    )
    .unwrap();
    let want = m.forward_with(&x, 2, NativePath::Portable);
    for path in NativePath::available() {
        assert_eq!(bits(&m.forward_with(&x, 2, path)), bits(&want));
    }
    bytes.pop();
    let err = NativeMatrix::new(
        vec![Part {
            t: BlockType::Q8_0,
            rows: 3,
            data: WeightBytes::Owned(Arc::new(bytes)),
        }],
        64,
    )
    .unwrap_err();
    assert_eq!(err, "Q8_0 part of 3 rows holds 203 bytes, expected 204");
    let err = NativeMatrix::new(
        vec![Part {
            t: BlockType::Q4K,
            rows: 1,
            data: WeightBytes::Owned(Arc::new(vec![0; 144])),
        }],
        64,
    )
    .unwrap_err();
    assert_eq!(err, "Q4K rows of 64 are not whole blocks of 256");
}
