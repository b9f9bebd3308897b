//! The host side of the paged KV pool: which page ids are free and which pages each sequence slot holds, in
//! order (entry j of a slot's page-table row holds its positions KV_PAGE j .. KV_PAGE j + KV_PAGE - 1). The
//! device page table mirrors the rows; [`crate::model::CudaModel::reserve`] uploads what a reservation changed.

use lily_model::Config;

/// Positions a page holds (KV_PAGE in common.cuh; equal to the prefill attention's key tile).
pub const KV_PAGE: usize = 64;

/// Sequence slots and KV pages the model allocates at start-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capacity {
    /// Sequences whose state the GPU holds at once (slots 0 .. max_seqs).
    pub max_seqs: usize,
    /// Pages of KV_PAGE positions in the attention pools, shared by all slots.
    pub kv_pages: usize,
}

impl Capacity {
    /// One sequence with pages for all of `max_context` (the single-sequence backend).
    pub fn single(max_context: usize) -> Capacity {
        Capacity {
            max_seqs: 1,
            kv_pages: pages_for(max_context),
        }
    }

    /// GPU bytes of one slot's DeltaNet state: f32 recurrent state and conv ring of every DeltaNet layer.
    pub fn deltanet_bytes_per_seq(c: &Config) -> usize {
        let recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
        let ring = c.linear_conv_kernel_dim * c.linear_conv_dim();
        c.num_linear_layers() * (recurrent + ring) * 4
    }

    /// GPU bytes of one KV page: bf16 keys and values of KV_PAGE positions in every attention layer.
    pub fn kv_bytes_per_page(c: &Config) -> usize {
        c.num_full_layers() * 2 * KV_PAGE * c.kv_dim() * 2
    }

    /// GPU bytes of the sequence state this capacity allocates (slots' DeltaNet state, KV pools, page table).
    pub fn state_bytes(&self, c: &Config, max_context: usize) -> usize {
        self.max_seqs * (Self::deltanet_bytes_per_seq(c) + pages_for(max_context) * 4)
            + self.kv_pages * Self::kv_bytes_per_page(c)
    }
}

/// Pages that `tokens` positions take.
pub fn pages_for(tokens: usize) -> usize {
    tokens.div_ceil(KV_PAGE)
}

/// A free list of page ids and each slot's pages.
#[derive(Debug)]
pub struct PageAllocator {
    /// Free page ids; the lowest id is taken first (at the end of the vector).
    free: Vec<i32>,
    /// Per slot, its pages in position order.
    slots: Vec<Vec<i32>>,
    pages_per_seq: usize,
}

impl PageAllocator {
    /// `kv_pages` pages for `max_seqs` slots of at most `pages_per_seq` pages each.
    pub fn new(max_seqs: usize, kv_pages: usize, pages_per_seq: usize) -> PageAllocator {
        assert!(kv_pages <= i32::MAX as usize, "page ids are i32 on the device");
        PageAllocator {
            free: (0..kv_pages as i32).rev().collect(),
            slots: vec![Vec::new(); max_seqs],
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

    /// The pages slot `slot` holds, in position order.
    pub fn pages(&self, slot: usize) -> &[i32] {
        &self.slots[slot]
    }

    /// Positions slot `slot` has room for without another reservation.
    pub fn capacity(&self, slot: usize) -> usize {
        self.slots[slot].len() * KV_PAGE
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
        let at = self.free.len() - more;
        // The lowest ids are at the end: take them in ascending order.
        let taken: Vec<i32> = self.free.drain(at..).rev().collect();
        self.slots[slot].extend(taken);
        true
    }

    /// Returns slot `slot`'s pages to the free list.
    pub fn release(&mut self, slot: usize) {
        let pages = std::mem::take(&mut self.slots[slot]);
        self.free.extend(pages.into_iter().rev());
        // Keep the lowest ids first in line, so a fresh single sequence gets the identity table again.
        self.free.sort_unstable_by(|a, b| b.cmp(a));
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
        // 30 DeltaNet layers of 32 x 128 x 128 f32 state and a 4 x 8192 f32 ring: about 63 MB a sequence.
        assert_eq!(
            Capacity::deltanet_bytes_per_seq(&c),
            30 * (32 * 128 * 128 + 4 * 8192) * 4
        );
        // 10 attention layers, K and V, 64 positions of 2 x 256 bf16: 1.25 MiB a page, 20 KiB a token.
        assert_eq!(Capacity::kv_bytes_per_page(&c), 10 * 2 * 64 * 512 * 2);
        let single = Capacity::single(4096);
        assert_eq!(single.kv_pages, 64);
        assert_eq!(
            single.state_bytes(&c, 4096),
            Capacity::deltanet_bytes_per_seq(&c) + 64 * 4 + 64 * Capacity::kv_bytes_per_page(&c)
        );
    }

    #[test]
    fn a_single_sequence_gets_the_identity_table() {
        let mut a = PageAllocator::new(1, pages_for(4096), pages_for(4096));
        assert!(a.reserve(0, 4096));
        assert_eq!(a.pages(0), (0..64).collect::<Vec<i32>>().as_slice());
        assert_eq!(a.free_pages(), 0);
        a.release(0);
        assert!(a.reserve(0, 100));
        assert_eq!(a.pages(0), &[0, 1]);
    }

    #[test]
    fn reserve_grows_in_whole_pages_and_refuses_when_short_changing_nothing() {
        let mut a = PageAllocator::new(3, 10, 6);
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
        let mut a = PageAllocator::new(slots, pages, 16);
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
            // Every page is exactly once either free or in one slot.
            assert_eq!(all_pages(&a), (0..pages as i32).collect::<Vec<_>>());
            let held: BTreeSet<i32> = (0..slots).flat_map(|s| a.pages(s).to_vec()).collect();
            assert_eq!(held.len() + a.free_pages(), pages);
        }
        for s in 0..slots {
            a.release(s);
        }
        assert_eq!(a.free_pages(), pages);
    }
}
