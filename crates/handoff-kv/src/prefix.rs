//! The prefix cache: a radix tree over page-aligned blocks of tokens
//! (SGLang's radix cache at page granularity). Each node is one full page
//! of a prompt: its `page_size` tokens, reached from its parent, and the
//! page that holds their K/V. A new request walks the tree with its prompt
//! and reuses the pages of the longest cached prefix; the rest it computes
//! into pages of its own, which it hands to the cache once they are written.
//!
//! Ownership, so nothing is freed under a reader:
//! * the cache owns each cached page through a one-page [`PageLease`];
//! * a request that uses cached pages holds a [`PrefixLock`]: one reference
//!   per node it reads. A node with a reference (or with children) is never
//!   evicted, so a page in use by a running request, an in-flight transfer
//!   or anything else holding the lock stays;
//! * eviction takes unreferenced leaves, least recently used first, only
//!   when a lease would fail ([`PrefixCache::lease`]) or on a flush.
//!
//! The partial last page of a prompt is never cached, and a match for a
//! request that computes never covers the whole prompt: at least one token
//! is left to compute, whose logits give the first output token. A decode
//! worker (delta transfer) computes no prompt token and may match it all
//! ([`PrefixCache::lookup_within`]).

use std::cmp::Reverse;
use std::collections::hash_map::DefaultHasher;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use crate::error::KvError;
use crate::layout::PageIndex;
use crate::lease::{PageAllocator, PageLease};

/// A node's slot in the tree's slab.
type NodeId = usize;

/// The parent of the first block of every prompt.
const ROOT: NodeId = usize::MAX;

struct Node {
    parent: NodeId,
    /// The block's tokens (`page_size` of them).
    tokens: Box<[u32]>,
    /// The cache's ownership of the page.
    lease: PageLease,
    /// One clone per request reading the page ([`PrefixLock`]).
    readers: Arc<()>,
    children: usize,
    last_used: u64,
}

impl Node {
    fn page(&self) -> PageIndex {
        self.lease.pages()[0]
    }

    fn referenced(&self) -> bool {
        Arc::strong_count(&self.readers) > 1
    }
}

/// The pages of a cached prefix a request reads, kept from eviction for as
/// long as this lives (drop it when the request no longer reads them).
#[derive(Debug, Default)]
pub struct PrefixLock {
    readers: Vec<Arc<()>>,
    pages: Vec<PageIndex>,
}

impl PrefixLock {
    /// The locked pages, in sequence order (page `i` holds tokens
    /// `i*page_size..(i+1)*page_size`).
    pub fn pages(&self) -> &[PageIndex] {
        &self.pages
    }

    /// Tokens the locked pages hold.
    pub fn tokens(&self, page_size: usize) -> usize {
        self.pages.len() * page_size
    }

    /// A request's whole page sequence: these locked pages, then the pages
    /// of `lease` (its own, for the rest of the sequence).
    pub fn followed_by(&self, lease: &PageLease) -> Vec<PageIndex> {
        let mut pages = Vec::with_capacity(self.pages.len() + lease.len());
        pages.extend_from_slice(&self.pages);
        pages.extend_from_slice(lease.pages());
        pages
    }
}

/// Counts for metrics and load reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixStats {
    /// Pages the cache holds.
    pub pages: usize,
    /// Of those, pages no request reads and no cached page depends on:
    /// what eviction could free right now, and more as leaves go.
    pub evictable: usize,
}

/// The tree. One owner (the engine's scheduler) drives it.
pub struct PrefixCache {
    page_size: usize,
    nodes: Vec<Option<Node>>,
    free_ids: Vec<NodeId>,
    /// (parent, hash of the block's tokens) → candidate children.
    children: HashMap<(NodeId, u64), Vec<NodeId>>,
    tick: u64,
}

fn block_hash(tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    tokens.hash(&mut h);
    h.finish()
}

impl PrefixCache {
    /// An empty cache of blocks of `page_size` tokens.
    pub fn new(page_size: usize) -> Self {
        Self {
            page_size: page_size.max(1),
            nodes: Vec::new(),
            free_ids: Vec::new(),
            children: HashMap::new(),
            tick: 0,
        }
    }

    fn node(&self, id: NodeId) -> &Node {
        self.nodes[id].as_ref().expect("live node id")
    }

    fn node_mut(&mut self, id: NodeId) -> &mut Node {
        self.nodes[id].as_mut().expect("live node id")
    }

    fn child(&self, parent: NodeId, block: &[u32]) -> Option<NodeId> {
        self.children
            .get(&(parent, block_hash(block)))?
            .iter()
            .copied()
            .find(|&c| &*self.node(c).tokens == block)
    }

    /// The longest cached prefix of `prompt`, in whole pages, leaving at
    /// least one token of the prompt to compute; locked for the caller.
    pub fn lookup(&mut self, prompt: &[u32]) -> PrefixLock {
        self.lookup_within(prompt, prompt.len().saturating_sub(1))
    }

    /// The longest cached prefix of `prompt` in whole pages that ends at or
    /// before token `max_tokens`; locked for the caller. A decode worker,
    /// which computes no prompt token (prefill sends the first output
    /// token), may take every full page: `max_tokens = prompt.len()`.
    pub fn lookup_within(&mut self, prompt: &[u32], max_tokens: usize) -> PrefixLock {
        let ps = self.page_size;
        let max_blocks = max_tokens.min(prompt.len()) / ps;
        self.tick += 1;
        let tick = self.tick;
        let mut lock = PrefixLock::default();
        let mut at = ROOT;
        for block in prompt.chunks_exact(ps).take(max_blocks) {
            let Some(c) = self.child(at, block) else {
                break;
            };
            let n = self.node_mut(c);
            n.last_used = tick;
            lock.readers.push(n.readers.clone());
            lock.pages.push(n.page());
            at = c;
        }
        lock
    }

    /// Hand the full pages of a computed prompt to the cache: `pages` is the
    /// request's sequence of pages (the first `lock.pages()` of them are the
    /// locked prefix), `lease` owns the rest. Each full block the tree lacks
    /// becomes a node taking its page out of `lease`; blocks the tree already
    /// has (another request cached the same prefix meanwhile) keep the
    /// request's own page in its lease. Every node of the prompt ends up in
    /// `lock`, which the request keeps while it reads them.
    pub fn insert(
        &mut self,
        prompt: &[u32],
        pages: &[PageIndex],
        lease: &mut PageLease,
        lock: &mut PrefixLock,
    ) {
        let ps = self.page_size;
        self.tick += 1;
        let tick = self.tick;
        let mut at = ROOT;
        let mut readers = Vec::new();
        let mut locked = Vec::new();
        for (i, block) in prompt.chunks_exact(ps).enumerate() {
            let Some(&page) = pages.get(i) else { break };
            let id = match self.child(at, block) {
                Some(c) => c,
                None => {
                    let Ok(owned) = lease.take_page(page) else {
                        // Not ours to give (the locked prefix of another
                        // tree path, or a guarded lease): stop here.
                        break;
                    };
                    self.add(at, block, owned, tick)
                }
            };
            let n = self.node_mut(id);
            n.last_used = tick;
            readers.push(n.readers.clone());
            locked.push(n.page());
            at = id;
        }
        // The new lock replaces the old one only after the new references
        // are taken, so no node of the prefix is unreferenced in between.
        *lock = PrefixLock {
            readers,
            pages: locked,
        };
    }

    fn add(&mut self, parent: NodeId, block: &[u32], lease: PageLease, tick: u64) -> NodeId {
        let node = Node {
            parent,
            tokens: block.into(),
            lease,
            readers: Arc::new(()),
            children: 0,
            last_used: tick,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.nodes[id] = Some(node);
                id
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        };
        self.children
            .entry((parent, block_hash(block)))
            .or_default()
            .push(id);
        if parent != ROOT {
            self.node_mut(parent).children += 1;
        }
        id
    }

    fn remove(&mut self, id: NodeId) -> Node {
        let node = self.nodes[id].take().expect("live node id");
        let key = (node.parent, block_hash(&node.tokens));
        if let Some(v) = self.children.get_mut(&key) {
            v.retain(|&c| c != id);
            if v.is_empty() {
                self.children.remove(&key);
            }
        }
        if node.parent != ROOT {
            self.node_mut(node.parent).children -= 1;
        }
        self.free_ids.push(id);
        node
    }

    fn evictable(&self, id: NodeId) -> bool {
        let n = self.node(id);
        n.children == 0 && !n.referenced()
    }

    /// Free up to `pages` pages, least recently used unreferenced leaves
    /// first (a parent becomes a leaf once its children go). Returns how
    /// many were freed; their pages are back in the allocator.
    pub fn evict(&mut self, pages: usize) -> usize {
        let mut heap: BinaryHeap<Reverse<(u64, NodeId)>> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(id, n)| n.as_ref().map(|n| (id, n)))
            .filter(|(id, _)| self.evictable(*id))
            .map(|(id, n)| Reverse((n.last_used, id)))
            .collect();
        let mut freed = 0;
        while freed < pages {
            let Some(Reverse((_, id))) = heap.pop() else {
                break;
            };
            let node = self.remove(id);
            let parent = node.parent;
            drop(node); // its page goes back to the allocator
            freed += 1;
            if parent != ROOT && self.evictable(parent) {
                heap.push(Reverse((self.node(parent).last_used, parent)));
            }
        }
        freed
    }

    /// Lease `n` pages of `allocator`, evicting what is short first (least
    /// recently used unreferenced pages); fails, taking nothing, when even
    /// that does not free enough.
    pub fn lease(&mut self, allocator: &PageAllocator, n: usize) -> Result<PageLease, KvError> {
        allocator.lease(n).or_else(|_| {
            self.evict(n.saturating_sub(allocator.stats().free()));
            allocator.lease(n)
        })
    }

    /// Evict everything no request reads (`/flush_cache`). Returns the
    /// number of pages freed.
    pub fn flush(&mut self) -> usize {
        self.evict(usize::MAX)
    }

    /// Pages held and pages evictable now.
    pub fn stats(&self) -> PrefixStats {
        let live = self.nodes.iter().flatten().count();
        // Evictable now or once their evictable descendants go: every node
        // not referenced and with no referenced descendant. Computed bottom
        // up through the parents of referenced nodes.
        let mut pinned = vec![false; self.nodes.len()];
        for (id, n) in self.nodes.iter().enumerate() {
            let Some(n) = n else { continue };
            if n.referenced() {
                let mut at = id;
                while at != ROOT && !pinned[at] {
                    pinned[at] = true;
                    at = self.node(at).parent;
                }
            }
        }
        let pinned = pinned.iter().filter(|p| **p).count();
        PrefixStats {
            pages: live,
            evictable: live - pinned,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::PageAllocator;

    /// A request that computed `prompt` into fresh pages after `lock`'s
    /// prefix: its sequence pages and its lease.
    fn computed(
        alloc: &PageAllocator,
        lock: &PrefixLock,
        prompt: &[u32],
        ps: usize,
    ) -> (Vec<PageIndex>, PageLease) {
        let total = prompt.len().div_ceil(ps);
        let lease = alloc.lease(total - lock.pages().len()).unwrap();
        (lock.followed_by(&lease), lease)
    }

    #[test]
    fn a_second_prompt_reuses_the_shared_whole_pages_and_never_the_last_token() {
        let alloc = PageAllocator::new(32);
        let mut cache = PrefixCache::new(4);
        let a: Vec<u32> = (0..10).collect(); // 2 full pages + 2 tokens
        let mut lock = cache.lookup(&a);
        assert!(lock.pages().is_empty());
        let (pages, mut lease) = computed(&alloc, &lock, &a, 4);
        cache.insert(&a, &pages, &mut lease, &mut lock);
        assert_eq!(lock.pages(), &pages[..2], "the 2 full pages are cached");
        assert_eq!(lease.pages(), &pages[2..], "the partial page stays");
        assert_eq!(
            cache.stats(),
            PrefixStats {
                pages: 2,
                evictable: 0
            }
        );
        drop(lease);
        drop(lock);
        assert_eq!(
            cache.stats(),
            PrefixStats {
                pages: 2,
                evictable: 2
            }
        );
        assert_eq!(alloc.stats().leased, 2);
        // Same first page, another second page.
        let mut b = a.clone();
        b[5] = 99;
        let lock = cache.lookup(&b);
        assert_eq!(lock.pages(), &pages[..1]);
        assert_eq!(lock.tokens(4), 4);
        drop(lock);
        // Exactly 2 pages long: the second page is not matched, so its last
        // token is computed for the first output token.
        assert_eq!(cache.lookup(&a[..8]).pages(), &pages[..1]);
        assert_eq!(cache.lookup(&a[..9]).pages(), &pages[..2]);
        assert_eq!(cache.lookup(&a[..3]).pages(), &[] as &[PageIndex]);
        // A decode worker computes no prompt token: it may take both.
        assert_eq!(cache.lookup_within(&a[..8], 8).pages(), &pages[..2]);
        assert_eq!(cache.lookup_within(&a[..8], 7).pages(), &pages[..1]);
        assert_eq!(cache.lookup_within(&a[..8], 100).pages(), &pages[..2]);
        // A lease the free pages cannot hold evicts just what is short.
        let all = alloc.lease(alloc.stats().free() - 1).unwrap();
        assert_eq!(cache.lease(&alloc, 2).unwrap().len(), 2);
        assert_eq!(cache.stats().pages, 1, "one page evicted, one kept");
        // 2 free and 1 evictable: 4 cannot be had; it evicts, takes nothing.
        assert!(cache.lease(&alloc, 4).is_err(), "not enough even evicting");
        assert_eq!((cache.stats().pages, alloc.stats().free()), (0, 3));
        drop(all);
    }

    #[test]
    fn eviction_takes_unreferenced_leaves_lru_first_and_never_a_locked_page() {
        let alloc = PageAllocator::new(64);
        let mut cache = PrefixCache::new(2);
        let insert = |cache: &mut PrefixCache, prompt: &[u32]| -> Vec<PageIndex> {
            let mut lock = cache.lookup(prompt);
            let (pages, mut lease) = computed(&alloc, &lock, prompt, 2);
            cache.insert(prompt, &pages, &mut lease, &mut lock);
            pages
        };
        let old = insert(&mut cache, &[1, 2, 3, 4, 5]); // pages for [1,2] [3,4]
        let new = insert(&mut cache, &[1, 2, 7, 8, 9]); // shares [1,2]; adds [7,8]
        assert_eq!(old[0], new[0]);
        assert_eq!(cache.stats().pages, 3);
        // A running request reads [1,2][7,8].
        let held = cache.lookup(&[1, 2, 7, 8, 0]);
        assert_eq!(held.pages(), &new[..2]);
        assert_eq!(cache.stats().evictable, 1, "only [3,4] is free to go");
        assert_eq!(cache.evict(10), 1);
        assert!(cache.lookup(&[1, 2, 3, 4, 0]).pages().len() == 1);
        assert_eq!(cache.flush(), 0, "the rest is locked");
        drop(held);
        // LRU: touch [1,2,7,8] last, add a fresh branch, evict one leaf.
        let fresh = insert(&mut cache, &[5, 5, 6]);
        drop(cache.lookup(&[1, 2, 7, 8, 0]));
        assert_eq!(cache.evict(1), 1);
        assert!(
            cache.lookup(&[5, 5, 0]).pages().is_empty(),
            "{fresh:?} went"
        );
        assert_eq!(cache.lookup(&[1, 2, 7, 8, 0]).pages().len(), 2);
        // Flush frees a chain leaf by leaf.
        assert_eq!(cache.flush(), 2);
        assert_eq!(cache.stats(), PrefixStats::default());
    }

    #[test]
    fn a_prefix_cached_meanwhile_by_another_request_is_shared_not_duplicated() {
        let alloc = PageAllocator::new(16);
        let mut cache = PrefixCache::new(2);
        let p = [4, 4, 5, 5, 6];
        // Two requests miss at once and compute the same prompt.
        let mut l1 = cache.lookup(&p);
        let mut l2 = cache.lookup(&p);
        let (pages1, mut lease1) = computed(&alloc, &l1, &p, 2);
        let (pages2, mut lease2) = computed(&alloc, &l2, &p, 2);
        cache.insert(&p, &pages1, &mut lease1, &mut l1);
        cache.insert(&p, &pages2, &mut lease2, &mut l2);
        assert_eq!(l2.pages(), &pages1[..2], "the first one's pages");
        assert_eq!(lease2.len(), 3, "the second keeps its own");
        assert_eq!(cache.stats().pages, 2);
    }
}
