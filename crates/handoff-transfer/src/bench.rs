//! Benchmark (filled in later).
