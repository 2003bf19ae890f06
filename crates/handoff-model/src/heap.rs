//! Handing freed heap memory back to the system, and keeping the buffers
//! a forward pass frees for the next one.

/// Return the heap's free memory to the system where the allocator keeps it
/// (glibc keeps freed blocks below its adaptive mmap threshold, up to 32
/// MiB each, in its arenas): after a load has converted a model's weights,
/// written them to the weight cache and dropped them, this is the
/// difference between the process holding them (anonymous, resident) and
/// not.
pub fn trim() {
    glibc(Tune::Trim);
}

/// What [`glibc`] asks of the allocator.
enum Tune {
    Trim,
    KeepPassBuffers,
}

/// The one place this crate calls the C allocator.
fn glibc(tune: Tune) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists and
    // mallopt sets its tunables; neither takes a pointer, both are
    // thread-safe.
    unsafe {
        match tune {
            Tune::Trim => {
                libc::malloc_trim(0);
            }
            Tune::KeepPassBuffers => {
                libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD as libc::c_int);
                libc::mallopt(libc::M_TRIM_THRESHOLD, (2 * MMAP_THRESHOLD) as libc::c_int);
            }
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = tune;
}

/// Above this size an allocation is its own mapping (glibc's
/// `M_MMAP_THRESHOLD`, fixed by [`keep_pass_buffers`]).
pub const MMAP_THRESHOLD: usize = 32 << 20;

/// Keep the buffers a forward pass allocates and frees (activations of a
/// prefill chunk: megabytes each) in the heap for the next pass, instead
/// of mapping fresh zeroed pages for every one.
///
/// glibc maps each allocation above its mmap threshold on its own and
/// unmaps it when freed. The threshold starts at 128 KiB and rises only
/// when a mapped block is freed; a process that converts its weights at
/// load frees many and ends with a threshold of 32 MiB, but one that maps
/// them from the weight cache frees none, stays at 128 KiB, and page-faults
/// and zeroes every activation buffer of every pass (measured: SmolLM2's
/// TTFT 1.45x that of the same server without the cache). Fixing the
/// threshold at 32 MiB, and the top-of-heap trim threshold at twice that
/// (glibc's own pairing), makes both the same.
pub fn keep_pass_buffers() {
    glibc(Tune::KeepPassBuffers);
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    /// Minor page faults of the calling thread so far (field 10 of
    /// `/proc/thread-self/stat`, counted after the command's parenthesis).
    fn thread_faults() -> i64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        let after = &stat[stat.rfind(')').unwrap() + 2..];
        after.split(' ').nth(7).unwrap().parse().unwrap()
    }

    /// A pass's buffers, allocated, written and freed, as a forward pass
    /// does with its activations.
    fn pass(sizes: &[usize]) {
        let bufs: Vec<Vec<f32>> = sizes
            .iter()
            .map(|&n| {
                let mut v = vec![0f32; n / 4];
                v.iter_mut().step_by(1024).for_each(|x| *x = 1.0);
                v
            })
            .collect();
        std::hint::black_box(&bufs);
    }

    /// The second pass of the same shape takes its buffers from the heap:
    /// no fresh pages to fault in and zero.
    #[test]
    fn a_second_pass_reuses_the_first_ones_buffers() {
        std::thread::spawn(|| {
            super::keep_pass_buffers();
            let sizes = [3 << 20, 6 << 20, 12 << 20, 1 << 20, 24 << 20];
            pass(&sizes);
            let before = thread_faults();
            pass(&sizes);
            let faults = thread_faults() - before;
            assert!(
                faults < 1000,
                "{faults} page faults in a pass of the same shape"
            );
        })
        .join()
        .unwrap();
    }
}
