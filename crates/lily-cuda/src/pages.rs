//! The host side of the paged KV pool: which page ids are free, which pages each sequence slot holds, in order
//! (entry j of a slot's page-table row holds its positions KV_PAGE j .. KV_PAGE j + KV_PAGE - 1), and which pages
//! each snapshot holds. A page may be held by several slots and snapshots at once (a prefix they share); it returns
//! to the free list when the last of them lets go. The device page table mirrors the slots' rows;
//! [`crate::model::CudaModel::reserve`] uploads what a reservation changed.

use lily_model::Config;

/// Positions a page holds (KV_PAGE in common.cuh; equal to the prefill attention's key tile).
pub const KV_PAGE: usize = 64;

/// Sequence slots, KV pages and snapshot buffers the model allocates at start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Sequences whose state the GPU holds at once (slots 0 .. max_seqs).
    pub max_seqs: usize,
    /// Pages of KV_PAGE positions in the attention pools, shared by all slots and snapshots.
    pub kv_pages: usize,
    /// Snapshots whose DeltaNet state the GPU holds at once, each in a buffer of its own beside the slots'.
    pub snapshots: usize,
}

impl Capacity {
    /// One sequence with pages for all of `max_context` (the single-sequence backend), and no snapshots.
    pub fn single(max_context: usize) -> Capacity {
        Capacity {
            max_seqs: 1,
            kv_pages: pages_for(max_context),
            snapshots: 0,
        }
    }

    /// GPU bytes of one slot's DeltaNet state (and of one snapshot's): the f16 recurrent state and the f32 conv
    /// ring of every DeltaNet layer.
    pub fn deltanet_bytes_per_seq(c: &Config) -> usize {
        let recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
        let ring = c.linear_conv_kernel_dim * c.linear_conv_dim();
        c.num_linear_layers() * (recurrent * 2 + ring * 4)
    }

    /// GPU bytes of one KV page: bf16 keys and values of KV_PAGE positions in every attention layer.
    pub fn kv_bytes_per_page(c: &Config) -> usize {
        c.num_full_layers() * 2 * KV_PAGE * c.kv_dim() * 2
    }

    /// GPU bytes of the sequence state this capacity allocates (slots' and snapshots' DeltaNet state, KV pools,
    /// page table).
    pub fn state_bytes(&self, c: &Config, max_context: usize) -> usize {
        self.max_seqs * (Self::deltanet_bytes_per_seq(c) + pages_for(max_context) * 4)
            + self.snapshots * Self::deltanet_bytes_per_seq(c)
            + self.kv_pages * Self::kv_bytes_per_page(c)
    }
}

/// Pages that `tokens` positions take.
pub fn pages_for(tokens: usize) -> usize {
    tokens.div_ceil(KV_PAGE)
}

/// What [`PageAllocator::restore`] and [`PageAllocator::share_prefix`] leave for the device to do: copy page
/// `from` (the source's partial last page) into page `to` (the slot's own), in every attention layer's pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageCopy {
    pub from: i32,
    pub to: i32,
}

/// The free list, each slot's pages, each snapshot's pages, and every page's holders.
#[derive(Debug)]
pub struct PageAllocator {
    /// Free page ids; the lowest id is taken first (at the end of the vector).
    free: Vec<i32>,
    /// The length of `free`'s sorted part (highest id first): pages freed since are pushed after it unsorted.
    free_sorted: usize,
    /// Per slot, its pages in position order.
    slots: Vec<Vec<i32>>,
    /// Per snapshot buffer, the pages of the snapshot it holds (`None`: the buffer is unused).
    snapshots: Vec<Option<Vec<i32>>>,
    /// Per page, how many slots and how many snapshots list it; a page is free when both are 0.
    slot_refs: Vec<u32>,
    snapshot_refs: Vec<u32>,
    /// Pages that snapshots hold and no slot does.
    snapshot_only: usize,
    pages_per_seq: usize,
}

impl PageAllocator {
    /// `kv_pages` pages for `max_seqs` slots of at most `pages_per_seq` pages each and `snapshots` snapshots.
    pub fn new(max_seqs: usize, kv_pages: usize, pages_per_seq: usize, snapshots: usize) -> PageAllocator {
        assert!(kv_pages <= i32::MAX as usize, "page ids are i32 on the device");
        PageAllocator {
            free: (0..kv_pages as i32).rev().collect(),
            free_sorted: kv_pages,
            slots: vec![Vec::new(); max_seqs],
            snapshots: vec![None; snapshots],
            slot_refs: vec![0; kv_pages],
            snapshot_refs: vec![0; kv_pages],
            snapshot_only: 0,
            pages_per_seq,
        }
    }

    pub fn max_seqs(&self) -> usize {
        self.slots.len()
    }

    pub fn pages_per_seq(&self) -> usize {
        self.pages_per_seq
    }

    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages of the pool, held or free.
    pub fn total_pages(&self) -> usize {
        self.slot_refs.len()
    }

    /// Pages that snapshots hold and no slot shares: what dropping every snapshot would return to the free list.
    pub fn snapshot_only_pages(&self) -> usize {
        self.snapshot_only
    }

    /// The pages slot `slot` holds, in position order.
    pub fn pages(&self, slot: usize) -> &[i32] {
        &self.slots[slot]
    }

    /// The pages snapshot buffer `snapshot` holds, in position order (`None` when it is unused).
    pub fn snapshot_pages(&self, snapshot: usize) -> Option<&[i32]> {
        self.snapshots[snapshot].as_deref()
    }

    /// Positions slot `slot` has room for without another reservation.
    pub fn capacity(&self, slot: usize) -> usize {
        self.slots[slot].len() * KV_PAGE
    }

    /// Adds (`by` = 1) or removes (`by` = -1) one holder of `page`, a slot's or a snapshot's; a page left with no
    /// holder goes back to the free list (unsorted: the caller sorts it once).
    fn count(&mut self, page: i32, snapshot: bool, by: i32) {
        let p = page as usize;
        let only_snapshots = |a: &PageAllocator| a.slot_refs[p] == 0 && a.snapshot_refs[p] > 0;
        let was = only_snapshots(self);
        let refs = if snapshot {
            &mut self.snapshot_refs[p]
        } else {
            &mut self.slot_refs[p]
        };
        *refs = refs
            .checked_add_signed(by)
            .expect("a page's holders never go below zero");
        let now = only_snapshots(self);
        self.snapshot_only = self.snapshot_only + now as usize - was as usize;
        if self.slot_refs[p] == 0 && self.snapshot_refs[p] == 0 {
            self.free.push(page);
        }
    }

    /// Keeps the lowest ids first in line, so a fresh single sequence gets the identity table again.
    /// Only the pages pushed since the last sort are sorted, then merged into the sorted part from its end (where
    /// the lowest ids are), so that a release costs a sort of its own pages, not of the whole free list (tens of
    /// thousands of pages), and a slot that held none costs nothing.
    fn sort_free(&mut self) {
        let sorted = self.free_sorted.min(self.free.len());
        let mut pushed = self.free.split_off(sorted);
        pushed.sort_unstable_by(|a, b| b.cmp(a));
        let (mut i, mut j) = (sorted, pushed.len());
        self.free.resize(sorted + pushed.len(), 0);
        let mut at = self.free.len();
        while j > 0 {
            at -= 1;
            if i > 0 && self.free[i - 1] < pushed[j - 1] {
                self.free[at] = self.free[i - 1];
                i -= 1;
            } else {
                self.free[at] = pushed[j - 1];
                j -= 1;
            }
        }
        self.free_sorted = self.free.len();
    }

    /// Takes `n` free pages (at most `free_pages()`) for slot `slot`, appended to its row.
    fn take(&mut self, slot: usize, n: usize) {
        let at = self.free.len() - n;
        // The lowest ids are at the end: take them in ascending order.
        let taken: Vec<i32> = self.free.drain(at..).rev().collect();
        self.free_sorted = self.free_sorted.min(at);
        for &page in &taken {
            self.slot_refs[page as usize] = 1;
        }
        self.slots[slot].extend(taken);
    }

    /// Gives slot `slot` pages for positions 0 .. `tokens` (appending to what it holds). Returns false, changing
    /// nothing, when the free pages are too few or `tokens` is past the slot's page-table row.
    pub fn reserve(&mut self, slot: usize, tokens: usize) -> bool {
        let want = pages_for(tokens);
        let held = self.slots[slot].len();
        if want <= held {
            return true;
        }
        let more = want - held;
        if want > self.pages_per_seq || more > self.free.len() {
            return false;
        }
        self.take(slot, more);
        true
    }

    /// Slot `slot` lets go of its pages: each returns to the free list unless another slot or a snapshot holds it.
    pub fn release(&mut self, slot: usize) {
        let pages = std::mem::take(&mut self.slots[slot]);
        for page in pages {
            self.count(page, false, -1);
        }
        self.sort_free();
    }

    /// Snapshot buffer `snapshot` (unused) takes a reference on the pages of slot `slot` that cover positions
    /// 0 .. `tokens` (at most the slot's capacity). The last may be partial: the slot goes on writing positions
    /// from `tokens` on into it, which the snapshot never reads.
    pub fn snapshot(&mut self, slot: usize, tokens: usize, snapshot: usize) {
        assert!(
            self.snapshots[snapshot].is_none(),
            "snapshot buffer {snapshot} is in use"
        );
        assert!(
            tokens <= self.capacity(slot),
            "a snapshot of {tokens} positions: the slot holds fewer"
        );
        let pages = self.slots[slot][..pages_for(tokens)].to_vec();
        for &page in &pages {
            self.count(page, true, 1);
        }
        self.snapshots[snapshot] = Some(pages);
    }

    /// Snapshot buffer `snapshot` lets go of its pages (nothing when it is unused).
    pub fn drop_snapshot(&mut self, snapshot: usize) {
        if let Some(pages) = self.snapshots[snapshot].take() {
            for page in pages {
                self.count(page, true, -1);
            }
            self.sort_free();
        }
    }

    /// Starts the empty slot `slot` from the snapshot in buffer `snapshot`, of `len` positions: the slot shares the
    /// snapshot's full pages (positions below `len` rounded down to a page) and gets fresh pages for the rest of
    /// positions 0 .. max(`tokens`, `len`). The snapshot's partial last page (where `len` is not a multiple of
    /// KV_PAGE) is not shared but returned as a copy to make into the slot's own, so that the slot never writes
    /// into a page another holder reads. `None`, changing nothing, when the free pages are too few or the length
    /// is past the slot's page-table row.
    pub fn restore(&mut self, snapshot: usize, slot: usize, len: usize, tokens: usize) -> Option<Option<PageCopy>> {
        assert!(
            self.slots[slot].is_empty(),
            "restore into slot {slot}, which holds pages"
        );
        let source = self.snapshots[snapshot]
            .as_ref()
            .expect("restore from an unused snapshot buffer");
        assert!(
            pages_for(len) <= source.len(),
            "a snapshot of {len} positions holds fewer pages"
        );
        let (full, want) = (len / KV_PAGE, pages_for(tokens.max(len)));
        if want > self.pages_per_seq || want - full > self.free.len() {
            return None;
        }
        let shared = source[..full].to_vec();
        let partial = (!len.is_multiple_of(KV_PAGE)).then(|| source[full]);
        for &page in &shared {
            self.count(page, false, 1);
        }
        self.slots[slot] = shared;
        self.take(slot, want - full);
        Some(partial.map(|from| PageCopy {
            from,
            to: self.slots[slot][full],
        }))
    }

    /// Makes slot `to` (holding at least `pages_for(len)` pages) share the full pages of slot `from`'s first `len`
    /// positions in place of its own first ones, which it lets go; the partial last page (where `len` is not a
    /// multiple of KV_PAGE) stays `to`'s own and is returned as the copy to make.
    pub fn share_prefix(&mut self, from: usize, to: usize, len: usize) -> Option<PageCopy> {
        assert!(from != to && self.slots[to].len() >= pages_for(len) && self.slots[from].len() >= pages_for(len));
        let full = len / KV_PAGE;
        for j in 0..full {
            let (shared, own) = (self.slots[from][j], self.slots[to][j]);
            self.count(shared, false, 1);
            self.slots[to][j] = shared;
            self.count(own, false, -1);
        }
        self.sort_free();
        (!len.is_multiple_of(KV_PAGE)).then(|| PageCopy {
            from: self.slots[from][full],
            to: self.slots[to][full],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    fn all_pages(a: &PageAllocator) -> Vec<i32> {
        let mut v: Vec<i32> = a.free.clone();
        for s in 0..a.max_seqs() {
            v.extend(a.pages(s));
        }
        v.sort_unstable();
        v
    }

    #[test]
    fn state_sizes_at_the_full_shape() {
        let c = Config::full_shape();
        // 30 DeltaNet layers of 32 x 128 x 128 f16 state and a 4 x 8192 f32 ring: about 35 MB a sequence.
        assert_eq!(
            Capacity::deltanet_bytes_per_seq(&c),
            30 * (32 * 128 * 128 * 2 + 4 * 8192 * 4)
        );
        // 10 attention layers, K and V, 64 positions of 2 x 256 bf16: 1.25 MiB a page, 20 KiB a token.
        assert_eq!(Capacity::kv_bytes_per_page(&c), 10 * 2 * 64 * 512 * 2);
        let single = Capacity::single(4096);
        assert_eq!(single.kv_pages, 64);
        assert_eq!(
            single.state_bytes(&c, 4096),
            Capacity::deltanet_bytes_per_seq(&c) + 64 * 4 + 64 * Capacity::kv_bytes_per_page(&c)
        );
        let with_snapshots = Capacity { snapshots: 3, ..single };
        assert_eq!(
            with_snapshots.state_bytes(&c, 4096),
            single.state_bytes(&c, 4096) + 3 * Capacity::deltanet_bytes_per_seq(&c)
        );
    }

    #[test]
    fn a_single_sequence_gets_the_identity_table() {
        let mut a = PageAllocator::new(1, pages_for(4096), pages_for(4096), 0);
        assert!(a.reserve(0, 4096));
        assert_eq!(a.pages(0), (0..64).collect::<Vec<i32>>().as_slice());
        assert_eq!(a.free_pages(), 0);
        a.release(0);
        assert!(a.reserve(0, 100));
        assert_eq!(a.pages(0), &[0, 1]);
    }

    #[test]
    fn reserve_grows_in_whole_pages_and_refuses_when_short_changing_nothing() {
        let mut a = PageAllocator::new(3, 10, 6, 0);
        assert!(a.reserve(0, 1));
        assert_eq!(a.pages(0).len(), 1);
        assert!(a.reserve(0, 64));
        assert_eq!(a.pages(0).len(), 1);
        assert!(a.reserve(0, 65));
        assert_eq!(a.pages(0).len(), 2);
        assert!(a.reserve(1, 5 * 64));
        assert_eq!(a.free_pages(), 3);
        // Four more pages for slot 2: only three are free.
        let before = (a.free.clone(), a.slots.clone());
        assert!(!a.reserve(2, 4 * 64));
        assert_eq!((a.free.clone(), a.slots.clone()), before);
        // Past the slot's row (6 pages) is refused too, even with pages free.
        a.release(1);
        let before = (a.free.clone(), a.slots.clone());
        assert!(!a.reserve(0, 7 * 64));
        assert_eq!((a.free.clone(), a.slots.clone()), before);
        assert!(a.reserve(2, 6 * 64));
        assert_eq!(a.capacity(2), 6 * 64);
    }

    #[test]
    fn random_reservations_never_leak_or_share_a_page() {
        let (slots, pages) = (5, 40);
        let mut a = PageAllocator::new(slots, pages, 16, 0);
        let mut rng = lily_model::rng::Rng::new(7);
        for _ in 0..10_000 {
            let slot = (rng.next_u64() % slots as u64) as usize;
            if rng.next_u64().is_multiple_of(4) {
                a.release(slot);
            } else {
                let tokens = (rng.next_u64() % (17 * 64)) as usize;
                let before = a.pages(slot).to_vec();
                let free = a.free_pages();
                if a.reserve(slot, tokens) {
                    assert!(a.capacity(slot) >= tokens);
                    assert_eq!(
                        &a.pages(slot)[..before.len()],
                        before.as_slice(),
                        "held pages keep their place"
                    );
                } else {
                    assert_eq!(a.pages(slot), before.as_slice());
                    assert_eq!(a.free_pages(), free);
                    assert!(pages_for(tokens) > 16 || pages_for(tokens) - before.len() > free);
                }
            }
            // Every page is exactly once either free or in one slot, and the free list is in order.
            assert_eq!(all_pages(&a), (0..pages as i32).collect::<Vec<_>>());
            assert!(a.free.windows(2).all(|w| w[0] > w[1]), "lowest ids first in line");
            let held: BTreeSet<i32> = (0..slots).flat_map(|s| a.pages(s).to_vec()).collect();
            assert_eq!(held.len() + a.free_pages(), pages);
        }
        for s in 0..slots {
            a.release(s);
        }
        assert_eq!(a.free_pages(), pages);
    }

    /// A model of the pool's contents: each page holds a value per position, written by the slot that writes it.
    /// Sequences and snapshots are lists of values; reading one back through its pages must give them all.
    struct Shadow {
        content: Vec<[u64; KV_PAGE]>,
        seqs: Vec<Vec<u64>>,
        snapshots: Vec<Option<Vec<u64>>>,
    }

    impl Shadow {
        fn copy(&mut self, copy: Option<PageCopy>) {
            if let Some(PageCopy { from, to }) = copy {
                assert_ne!(from, to);
                self.content[to as usize] = self.content[from as usize];
            }
        }
    }

    /// Every invariant of the allocator, and every sequence and snapshot read back through its pages.
    fn check_consistent(a: &PageAllocator, shadow: &Shadow, kv_pages: usize) {
        let (mut slot_refs, mut snapshot_refs) = (vec![0u32; kv_pages], vec![0u32; kv_pages]);
        for (s, pages) in a.slots.iter().enumerate() {
            let distinct: BTreeSet<i32> = pages.iter().copied().collect();
            assert_eq!(distinct.len(), pages.len(), "slot {s} lists a page twice");
            pages.iter().for_each(|&p| slot_refs[p as usize] += 1);
            let seq = &shadow.seqs[s];
            assert!(seq.len() <= a.capacity(s));
            for (i, &v) in seq.iter().enumerate() {
                assert_eq!(
                    shadow.content[pages[i / KV_PAGE] as usize][i % KV_PAGE],
                    v,
                    "slot {s} position {i}"
                );
            }
        }
        for (n, pages) in a.snapshots.iter().enumerate() {
            assert_eq!(pages.is_some(), shadow.snapshots[n].is_some());
            let (Some(pages), Some(seq)) = (pages, &shadow.snapshots[n]) else {
                continue;
            };
            assert_eq!(pages.len(), pages_for(seq.len()));
            pages.iter().for_each(|&p| snapshot_refs[p as usize] += 1);
            for (i, &v) in seq.iter().enumerate() {
                assert_eq!(
                    shadow.content[pages[i / KV_PAGE] as usize][i % KV_PAGE],
                    v,
                    "snapshot {n} position {i}"
                );
            }
        }
        assert_eq!(a.slot_refs, slot_refs, "slot holders counted");
        assert_eq!(a.snapshot_refs, snapshot_refs, "snapshot holders counted");
        let free: BTreeSet<i32> = a.free.iter().copied().collect();
        assert_eq!(free.len(), a.free.len(), "a page is free twice");
        let unheld: BTreeSet<i32> = (0..kv_pages as i32)
            .filter(|&p| slot_refs[p as usize] + snapshot_refs[p as usize] == 0)
            .collect();
        assert_eq!(
            free, unheld,
            "the free pages are exactly those no slot or snapshot holds"
        );
        assert!(a.free.windows(2).all(|w| w[0] > w[1]), "lowest ids first in line");
        let only = (0..kv_pages)
            .filter(|&p| slot_refs[p] == 0 && snapshot_refs[p] > 0)
            .count();
        assert_eq!(a.snapshot_only_pages(), only);
    }

    /// Random reservations, writes, releases, snapshots, restores, forks and drops on a small pool: no page leaks,
    /// none is free while held, the holder counts match, and every sequence and snapshot reads back what was
    /// written for it (so no slot ever wrote into a page another holder reads).
    #[test]
    fn random_sharing_never_leaks_frees_a_held_page_or_overwrites_a_shared_one() {
        let (slots, kv_pages, per_seq, snapshots) = (5, 48, 12, 4);
        let mut a = PageAllocator::new(slots, kv_pages, per_seq, snapshots);
        let mut shadow = Shadow {
            content: vec![[0; KV_PAGE]; kv_pages],
            seqs: vec![Vec::new(); slots],
            snapshots: vec![None; snapshots],
        };
        let mut rng = lily_model::rng::Rng::new(11);
        let mut next_value = 1u64;
        let (mut restored, mut refused, mut forked) = (0, 0, 0);
        for _ in 0..20_000 {
            let r = |rng: &mut lily_model::rng::Rng, n: usize| (rng.next_u64() % n as u64) as usize;
            let slot = r(&mut rng, slots);
            let snap = r(&mut rng, snapshots);
            match r(&mut rng, 8) {
                0 => {
                    a.release(slot);
                    shadow.seqs[slot].clear();
                }
                1 => {
                    let tokens = r(&mut rng, (per_seq + 1) * KV_PAGE);
                    let (before, free) = (a.pages(slot).to_vec(), a.free_pages());
                    if a.reserve(slot, tokens) {
                        assert!(a.capacity(slot) >= tokens);
                        assert_eq!(&a.pages(slot)[..before.len()], before.as_slice());
                    } else {
                        assert_eq!((a.pages(slot), a.free_pages()), (before.as_slice(), free));
                    }
                }
                2 | 3 => {
                    // The sequence writes its next positions, within its reservation.
                    let len = shadow.seqs[slot].len();
                    let n = r(&mut rng, 100).min(a.capacity(slot) - len);
                    for p in len..len + n {
                        let page = a.pages(slot)[p / KV_PAGE] as usize;
                        shadow.content[page][p % KV_PAGE] = next_value;
                        shadow.seqs[slot].push(next_value);
                        next_value += 1;
                    }
                }
                4 => {
                    if shadow.snapshots[snap].is_none() {
                        a.snapshot(slot, shadow.seqs[slot].len(), snap);
                        shadow.snapshots[snap] = Some(shadow.seqs[slot].clone());
                    }
                }
                5 => {
                    a.drop_snapshot(snap);
                    shadow.snapshots[snap] = None;
                }
                6 => {
                    if let Some(seq) = shadow.snapshots[snap].clone() {
                        a.release(slot);
                        let tokens = r(&mut rng, (per_seq + 1) * KV_PAGE);
                        let free = a.free_pages();
                        match a.restore(snap, slot, seq.len(), tokens) {
                            Some(copy) => {
                                assert!(a.capacity(slot) >= tokens.max(seq.len()));
                                shadow.copy(copy);
                                shadow.seqs[slot] = seq;
                                restored += 1;
                            }
                            None => {
                                assert!(a.pages(slot).is_empty());
                                assert_eq!(a.free_pages(), free);
                                shadow.seqs[slot].clear();
                                refused += 1;
                            }
                        }
                    }
                }
                _ => {
                    let to = r(&mut rng, slots);
                    let len = shadow.seqs[slot].len();
                    if to != slot {
                        a.release(to);
                        shadow.seqs[to].clear();
                        if a.reserve(to, len) {
                            let copy = a.share_prefix(slot, to, len);
                            shadow.copy(copy);
                            shadow.seqs[to] = shadow.seqs[slot].clone();
                            forked += 1;
                        }
                    }
                }
            }
            check_consistent(&a, &shadow, kv_pages);
        }
        assert!(
            restored > 100 && refused > 10 && forked > 100,
            "{restored} {refused} {forked}"
        );
        for s in 0..slots {
            a.release(s);
        }
        for n in 0..snapshots {
            a.drop_snapshot(n);
        }
        assert_eq!(a.free_pages(), kv_pages);
        assert_eq!(a.snapshot_only_pages(), 0);
    }

    #[test]
    fn a_restore_shares_full_pages_and_copies_the_partial_one() {
        let mut a = PageAllocator::new(3, 10, 6, 2);
        assert!(a.reserve(0, 3 * KV_PAGE));
        a.snapshot(0, 2 * KV_PAGE + 5, 0);
        assert_eq!(a.snapshot_pages(0), Some(&[0, 1, 2][..]));
        assert_eq!(a.snapshot_only_pages(), 0);
        // Two full pages shared, the partial one copied into a fresh page, one more for the tokens asked.
        let copy = a.restore(0, 1, 2 * KV_PAGE + 5, 4 * KV_PAGE).unwrap();
        assert_eq!(copy, Some(PageCopy { from: 2, to: 3 }));
        assert_eq!(a.pages(1), &[0, 1, 3, 4]);
        assert_eq!(a.free_pages(), 5);
        a.release(0);
        // Page 2 is the snapshot's alone now; 0 and 1 are shared with slot 1.
        assert_eq!(a.snapshot_only_pages(), 1);
        assert_eq!(a.free_pages(), 5);
        a.drop_snapshot(0);
        assert_eq!(a.snapshot_only_pages(), 0);
        assert_eq!(a.free_pages(), 6);
        // A snapshot at a page boundary restores with no fresh page at all, even when none is free.
        a.snapshot(1, 2 * KV_PAGE, 1);
        a.release(1);
        assert!(a.reserve(2, 6 * KV_PAGE));
        assert!(a.reserve(0, 2 * KV_PAGE));
        assert_eq!(a.free_pages(), 0);
        assert_eq!(a.restore(1, 1, 2 * KV_PAGE, 2 * KV_PAGE), Some(None));
        assert_eq!(a.pages(1), &[0, 1]);
        // One position more needs a fresh page: refused, the slot left empty.
        a.release(1);
        assert_eq!(a.restore(1, 1, 2 * KV_PAGE, 2 * KV_PAGE + 1), None);
        assert!(a.pages(1).is_empty());
    }
}
