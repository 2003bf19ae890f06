//! Page allocation with single-owner RAII leases.
//!
//! A [`PageLease`] owns a set of pages; dropping it returns them to the free
//! list. A writer that may still be writing into the pages (a prefill peer's
//! transfer) holds a [`WriterGuard`]: the pages return only when the owner
//! *and* every writer guard are gone, so a page is never reused under an
//! in-flight write (FIELD-NOTES invariant 8).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::KvError;
use crate::layout::PageIndex;
use crate::shm::PageGenerations;

/// Free pages as a stack (leases pop from the end), with each page's
/// position in it so an exact lease takes its pages in O(pages wanted),
/// never O(pool).
struct FreeList {
    stack: Vec<PageIndex>,
    /// Page → its index in `stack`, or [`NOT_FREE`].
    pos: Vec<u32>,
}

/// `FreeList::pos` of a page that is leased.
const NOT_FREE: u32 = u32::MAX;

impl FreeList {
    fn is_free(&self, p: PageIndex) -> bool {
        self.pos.get(p.0 as usize).is_some_and(|i| *i != NOT_FREE)
    }

    fn push(&mut self, p: PageIndex) {
        if let Some(slot) = self.pos.get_mut(p.0 as usize) {
            *slot = self.stack.len() as u32;
            self.stack.push(p);
        }
    }

    /// Take the last `n` pages (the caller checked there are `n`).
    fn pop_n(&mut self, n: usize) -> Vec<PageIndex> {
        let at = self.stack.len() - n;
        let pages = self.stack.split_off(at);
        for p in &pages {
            self.pos[p.0 as usize] = NOT_FREE;
        }
        pages
    }

    /// Take free page `p` out of the stack: the last page moves into its slot.
    fn remove(&mut self, p: PageIndex) {
        let i = self.pos[p.0 as usize] as usize;
        self.pos[p.0 as usize] = NOT_FREE;
        if let Some(last) = self.stack.pop() {
            if last != p {
                self.stack[i] = last;
                self.pos[last.0 as usize] = i as u32;
            }
        }
    }
}

/// Called each time pages return to the free list.
type OnReturn = Box<dyn Fn() + Send + Sync>;

struct AllocInner {
    free: Mutex<FreeList>,
    returned: Condvar,
    /// Callbacks for async waiters (see [`PageAllocator::on_return`]).
    on_return: Mutex<Vec<OnReturn>>,
    total: usize,
    leased: AtomicUsize,
    leases: AtomicUsize,
    /// A shared pool's page generations, stamped as pages are handed out.
    generations: Option<PageGenerations>,
}

impl AllocInner {
    fn free_list(&self) -> MutexGuard<'_, FreeList> {
        // A poisoned free list still holds valid page indices: keep going.
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn give_back(&self, pages: &mut Vec<PageIndex>) {
        let n = pages.len();
        let mut free = self.free_list();
        for p in pages.drain(..) {
            free.push(p);
        }
        self.leased.fetch_sub(n, Ordering::AcqRel);
        drop(free);
        self.returned.notify_all();
        let callbacks = self.on_return.lock().unwrap_or_else(|e| e.into_inner());
        for f in callbacks.iter() {
            f();
        }
    }
}

/// Hands out pages of one pool. Cheap to clone; all clones share the free list.
#[derive(Clone)]
pub struct PageAllocator {
    inner: Arc<AllocInner>,
}

/// Counts for the pages gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageStats {
    /// Pages in the pool.
    pub total: usize,
    /// Pages held by leases (including those waiting for a writer to drain).
    pub leased: usize,
    /// Leases alive (owner or writer guards).
    pub leases: usize,
}

impl PageStats {
    /// Pages free to lease.
    pub fn free(&self) -> usize {
        self.total - self.leased
    }
}

impl PageAllocator {
    /// An allocator for pages `0..num_pages`, all free.
    pub fn new(num_pages: usize) -> Self {
        Self::build(num_pages, None)
    }

    /// An allocator for a shared pool: every page it hands out is first
    /// stamped in `generations` (which must cover `num_pages`), so a peer
    /// copying pages out can tell a page that changed hands under its copy.
    pub fn with_generations(num_pages: usize, generations: PageGenerations) -> Self {
        Self::build(num_pages, Some(generations))
    }

    /// The page generations this allocator stamps, if any.
    pub fn generations(&self) -> Option<&PageGenerations> {
        self.inner.generations.as_ref()
    }

    fn build(num_pages: usize, generations: Option<PageGenerations>) -> Self {
        // Pop from the end: hand out low page numbers first.
        let stack: Vec<PageIndex> = (0..num_pages as u32).rev().map(PageIndex).collect();
        let pos = (0..num_pages as u32)
            .map(|p| num_pages as u32 - 1 - p)
            .collect();
        Self {
            inner: Arc::new(AllocInner {
                free: Mutex::new(FreeList { stack, pos }),
                returned: Condvar::new(),
                on_return: Mutex::new(Vec::new()),
                total: num_pages,
                leased: AtomicUsize::new(0),
                leases: AtomicUsize::new(0),
                generations,
            }),
        }
    }

    /// Lease `n` pages (possibly zero), or fail without taking any.
    pub fn lease(&self, n: usize) -> Result<PageLease, KvError> {
        let pages = self.take(n)?;
        self.inner.leases.fetch_add(1, Ordering::AcqRel);
        Ok(PageLease {
            pages: pages.clone(),
            core: Arc::new(LeaseCore {
                pages: Mutex::new(pages),
                alloc: self.inner.clone(),
            }),
        })
    }

    /// Lease exactly `pages` (in this order), or fail without taking any if
    /// one of them is out of range, repeated, or not free. For placement that
    /// must be chosen by the caller (benchmarks, restoring a known layout).
    pub fn lease_exact(&self, pages: &[PageIndex]) -> Result<PageLease, KvError> {
        let mut wanted = std::collections::HashSet::with_capacity(pages.len());
        for p in pages {
            if p.0 as usize >= self.inner.total {
                return Err(KvError::PageOutOfRange {
                    page: p.0,
                    num_pages: self.inner.total,
                });
            }
            if !wanted.insert(*p) {
                return Err(KvError::OutOfPages {
                    needed: pages.len(),
                    free: wanted.len(),
                });
            }
        }
        {
            let mut free = self.inner.free_list();
            let available = pages.iter().filter(|p| free.is_free(**p)).count();
            if available != pages.len() {
                return Err(KvError::OutOfPages {
                    needed: pages.len(),
                    free: available,
                });
            }
            for p in pages {
                free.remove(*p);
            }
            if let Some(g) = &self.inner.generations {
                g.stamp(pages.iter().map(|p| p.0));
            }
            self.inner.leased.fetch_add(pages.len(), Ordering::AcqRel);
        }
        self.inner.leases.fetch_add(1, Ordering::AcqRel);
        let pages = pages.to_vec();
        Ok(PageLease {
            pages: pages.clone(),
            core: Arc::new(LeaseCore {
                pages: Mutex::new(pages),
                alloc: self.inner.clone(),
            }),
        })
    }

    fn take(&self, n: usize) -> Result<Vec<PageIndex>, KvError> {
        let mut free = self.inner.free_list();
        if free.stack.len() < n {
            return Err(KvError::OutOfPages {
                needed: n,
                free: free.stack.len(),
            });
        }
        let mut pages = free.pop_n(n);
        pages.reverse();
        if let (Some(g), false) = (&self.inner.generations, pages.is_empty()) {
            g.stamp(pages.iter().map(|p| p.0));
        }
        self.inner.leased.fetch_add(n, Ordering::AcqRel);
        Ok(pages)
    }

    /// Block until at most `leased` pages are leased, or `timeout` passes
    /// (returns whether the condition holds). For drains and measurements of
    /// when pages come back, without spinning.
    pub fn wait_leased_at_most(&self, leased: usize, timeout: Duration) -> bool {
        let end = Instant::now() + timeout;
        let mut free = self.inner.free_list();
        loop {
            if self.inner.leased.load(Ordering::Acquire) <= leased {
                return true;
            }
            let now = Instant::now();
            if now >= end {
                return false;
            }
            free = match self.inner.returned.wait_timeout(free, end - now) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
    }

    /// Call `f` each time pages return to the free list (after they are
    /// back, from the thread that returned them): an async queue of
    /// requests waiting for pages wakes on it instead of polling. `f` must
    /// be quick and must not lease or return pages itself.
    pub fn on_return(&self, f: impl Fn() + Send + Sync + 'static) {
        self.inner
            .on_return
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(Box::new(f));
    }

    /// Current counts.
    pub fn stats(&self) -> PageStats {
        PageStats {
            total: self.inner.total,
            leased: self.inner.leased.load(Ordering::Acquire),
            leases: self.inner.leases.load(Ordering::Acquire),
        }
    }
}

struct LeaseCore {
    pages: Mutex<Vec<PageIndex>>,
    alloc: Arc<AllocInner>,
}

impl Drop for LeaseCore {
    fn drop(&mut self) {
        let mut pages = std::mem::take(&mut *self.pages.lock().unwrap_or_else(|e| e.into_inner()));
        self.alloc.give_back(&mut pages);
        self.alloc.leases.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The single owner of a set of pages, in sequence order (page `i` holds
/// token positions `i*page_size..(i+1)*page_size`).
pub struct PageLease {
    pages: Vec<PageIndex>,
    core: Arc<LeaseCore>,
}

impl std::fmt::Debug for PageLease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PageLease")
            .field("pages", &self.pages)
            .finish()
    }
}

impl PageLease {
    /// The leased pages, in sequence order.
    pub fn pages(&self) -> &[PageIndex] {
        &self.pages
    }

    /// Number of pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether the lease holds no page.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Add `n` more pages at the end (a decoding sequence crossing a page
    /// boundary), or fail without taking any.
    pub fn grow(&mut self, allocator: &PageAllocator, n: usize) -> Result<(), KvError> {
        let more = allocator.take(n)?;
        self.core
            .pages
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend_from_slice(&more);
        self.pages.extend(more);
        Ok(())
    }

    /// Move page `page` out of this lease into a lease of its own (a page
    /// handed to the prefix cache). Refused while a writer guard is out:
    /// the guard must keep every page of the lease out of the free list
    /// until the writer drains, and a page moved away would escape it.
    pub fn take_page(&mut self, page: PageIndex) -> Result<PageLease, KvError> {
        if Arc::strong_count(&self.core) > 1 {
            return Err(KvError::LeaseGuarded);
        }
        let at = self
            .pages
            .iter()
            .position(|p| *p == page)
            .ok_or(KvError::NotInLease { page: page.0 })?;
        self.pages.remove(at);
        self.core
            .pages
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|p| *p != page);
        let alloc = self.core.alloc.clone();
        alloc.leases.fetch_add(1, Ordering::AcqRel);
        Ok(PageLease {
            pages: vec![page],
            core: Arc::new(LeaseCore {
                pages: Mutex::new(vec![page]),
                alloc,
            }),
        })
    }

    /// A guard for a writer that may still write into these pages. The pages
    /// are returned only once the lease and all its guards are dropped.
    pub fn writer_guard(&self) -> WriterGuard {
        WriterGuard {
            _core: self.core.clone(),
        }
    }
}

/// Keeps a lease's pages out of the free list while a writer may still write
/// into them. Drop it once the writer has drained.
pub struct WriterGuard {
    _core: Arc<LeaseCore>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_says_whether_it_holds_pages_and_which() {
        let alloc = PageAllocator::new(4);
        let none = alloc.lease(0).unwrap();
        let two = alloc.lease(2).unwrap();
        assert!(none.is_empty());
        assert!(!two.is_empty());
        let shown = format!("{two:?}");
        let want = format!("PageLease {{ pages: {:?} }}", two.pages());
        assert_eq!(shown, want);
    }

    #[test]
    fn a_page_taken_out_of_a_lease_returns_with_its_new_owner() {
        let alloc = PageAllocator::new(4);
        let mut lease = alloc.lease(3).unwrap();
        let pages = lease.pages().to_vec();
        let one = lease.take_page(pages[1]).unwrap();
        assert_eq!(lease.pages(), &[pages[0], pages[2]]);
        assert_eq!(one.pages(), &[pages[1]]);
        assert_eq!(alloc.stats().leases, 2);
        assert_eq!(
            lease.take_page(pages[1]).unwrap_err(),
            KvError::NotInLease { page: pages[1].0 }
        );
        drop(lease);
        assert_eq!(alloc.stats().leased, 1, "the taken page is still held");
        drop(one);
        assert_eq!(alloc.stats().leased, 0);
        assert_eq!(alloc.stats().leases, 0);
        // A lease with a writer out gives nothing away.
        let mut lease = alloc.lease(2).unwrap();
        let guard = lease.writer_guard();
        let p = lease.pages()[0];
        assert_eq!(lease.take_page(p).unwrap_err(), KvError::LeaseGuarded);
        drop(guard);
        assert!(lease.take_page(p).is_ok());
    }

    #[test]
    fn on_return_runs_once_the_pages_are_back() {
        let alloc = PageAllocator::new(4);
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (a, s) = (alloc.clone(), seen.clone());
        alloc.on_return(move || s.lock().unwrap().push(a.stats().free()));
        let lease = alloc.lease(3).unwrap();
        let guard = lease.writer_guard();
        drop(lease);
        assert!(seen.lock().unwrap().is_empty(), "a writer still holds them");
        drop(guard);
        assert_eq!(*seen.lock().unwrap(), vec![4], "called once, pages free");
    }

    #[test]
    fn leases_return_pages_on_drop() {
        let alloc = PageAllocator::new(10);
        let a = alloc.lease(4).unwrap();
        let mut b = alloc.lease(3).unwrap();
        assert_eq!(
            a.pages(),
            &[PageIndex(0), PageIndex(1), PageIndex(2), PageIndex(3)]
        );
        assert_eq!(
            alloc.stats(),
            PageStats {
                total: 10,
                leased: 7,
                leases: 2
            }
        );
        assert_eq!(
            alloc.lease(4).unwrap_err(),
            KvError::OutOfPages { needed: 4, free: 3 }
        );
        assert_eq!(alloc.stats().leased, 7, "a failed lease takes nothing");
        b.grow(&alloc, 2).unwrap();
        assert_eq!(b.len(), 5);
        drop(a);
        drop(b);
        assert_eq!(
            alloc.stats(),
            PageStats {
                total: 10,
                leased: 0,
                leases: 0
            }
        );
        assert_eq!(alloc.lease(10).unwrap().len(), 10);
    }

    #[test]
    fn pages_under_a_writer_are_not_reused() {
        let alloc = PageAllocator::new(4);
        let lease = alloc.lease(4).unwrap();
        let guard = lease.writer_guard();
        drop(lease);
        assert_eq!(alloc.stats().leased, 4, "writer still holds the pages");
        assert!(alloc.lease(1).is_err());
        drop(guard);
        assert_eq!(alloc.stats().leased, 0);
        assert!(alloc.lease(4).is_ok());
    }

    #[test]
    fn exact_leases_take_those_pages_or_nothing() {
        let alloc = PageAllocator::new(8);
        let a = alloc.lease_exact(&[PageIndex(6), PageIndex(1)]).unwrap();
        assert_eq!(a.pages(), &[PageIndex(6), PageIndex(1)]);
        assert!(alloc.lease_exact(&[PageIndex(2), PageIndex(6)]).is_err());
        assert!(alloc.lease_exact(&[PageIndex(2), PageIndex(2)]).is_err());
        assert!(alloc.lease_exact(&[PageIndex(8)]).is_err());
        assert_eq!(alloc.stats().leased, 2, "failed exact leases take nothing");
        let rest = alloc.lease(6).unwrap();
        assert!(!rest.pages().contains(&PageIndex(6)));
        drop((a, rest));
        assert_eq!(alloc.stats().leased, 0);
    }

    #[test]
    fn exact_leases_keep_the_free_list_consistent() {
        // Exact leases punch holes anywhere in the free stack; every page
        // must still be handed out exactly once, and come back.
        let alloc = PageAllocator::new(32);
        let holes: Vec<_> = [31u32, 0, 17, 5, 16]
            .into_iter()
            .map(|p| alloc.lease_exact(&[PageIndex(p)]).unwrap())
            .collect();
        let pair = alloc.lease_exact(&[PageIndex(9), PageIndex(8)]).unwrap();
        let rest = alloc.lease(25).unwrap();
        assert!(alloc.lease(1).is_err(), "every page is leased");
        let mut seen: Vec<u32> = holes
            .iter()
            .chain([&pair, &rest])
            .flat_map(|l| l.pages().iter().map(|p| p.0))
            .collect();
        seen.sort_unstable();
        assert_eq!(seen, (0..32).collect::<Vec<_>>());
        drop(rest);
        drop(holes);
        assert!(
            alloc.lease_exact(&[PageIndex(8)]).is_err(),
            "8 is still leased"
        );
        let again = alloc.lease_exact(&[PageIndex(17), PageIndex(3)]).unwrap();
        assert_eq!(alloc.stats().leased, 4);
        drop((pair, again));
        assert_eq!(alloc.lease(32).unwrap().len(), 32);
    }

    #[test]
    fn waiting_for_pages_wakes_when_they_return() {
        let alloc = PageAllocator::new(4);
        let lease = alloc.lease(3).unwrap();
        assert!(!alloc.wait_leased_at_most(0, Duration::from_millis(5)));
        let a2 = alloc.clone();
        let t = std::thread::spawn(move || a2.wait_leased_at_most(0, Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        drop(lease);
        assert!(t.join().unwrap());
    }

    #[test]
    fn no_page_is_handed_out_twice() {
        let alloc = PageAllocator::new(64);
        let leases: Vec<_> = (0..8).map(|_| alloc.lease(8).unwrap()).collect();
        let mut seen: Vec<_> = leases.iter().flat_map(|l| l.pages().to_vec()).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 64);
    }
}
