//! The prefix cache's index: which token sequences the backend holds a snapshot of (see
//! `BatchBackend::snapshot`), found by the longest one that starts a new prompt.
//!
//! Entries are keyed by their length and a hash of their tokens; a lookup hashes the prompt's prefixes once and
//! tries the cached lengths from the longest down, comparing the tokens of a candidate before it answers, so a hash
//! collision can never restore the wrong state. The least recently used entry is the first to go when the engine
//! needs memory, where a use of an entry counts as a use of every indexed prefix of it as well: a snapshot of a
//! shared system prompt outlives the snapshots of the conversations that extend it, which fewer prompts can use.
//! The snapshots themselves belong to the backend, which the engine tells to drop them.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use lily_model::SnapshotId;

/// The index of the snapshots the backend holds for reuse.
#[derive(Default)]
pub struct PrefixCache {
    entries: HashMap<SnapshotId, Entry>,
    /// Entries by (length, hash of their tokens).
    by_key: HashMap<(usize, u64), Vec<SnapshotId>>,
    /// How many entries have each length.
    lengths: BTreeMap<usize, usize>,
    /// Bumped at every use, so that `last_used` orders the entries.
    clock: u64,
}

struct Entry {
    tokens: Arc<[u32]>,
    hash: u64,
    last_used: u64,
}

/// The hash of a token sequence extended by one token: FNV-1a's step taken over the whole token (one multiply a
/// token, where FNV-1a over its four bytes would take four). The cache's keys need no more: every candidate's tokens
/// are compared before it is used.
fn hash_step(hash: u64, token: u32) -> u64 {
    (hash ^ u64::from(token)).wrapping_mul(0x0000_0100_0000_01b3)
}

const HASH_START: u64 = 0xcbf2_9ce4_8422_2325;

fn hash_of(tokens: &[u32]) -> u64 {
    tokens.iter().fold(HASH_START, |h, &t| hash_step(h, t))
}

/// The hash of every prefix of a token sequence, the empty one first: computed once for a prompt, so that the
/// lookups, checks and inserts along it (at admission, before each prefill call, at each snapshot) need no pass
/// over its tokens of their own.
#[derive(Debug, Clone)]
pub struct PrefixHashes(Vec<u64>);

impl PrefixHashes {
    pub fn new(tokens: &[u32]) -> PrefixHashes {
        let mut hashes = Vec::with_capacity(tokens.len() + 1);
        let mut hash = HASH_START;
        hashes.push(hash);
        for &t in tokens {
            hash = hash_step(hash, t);
            hashes.push(hash);
        }
        PrefixHashes(hashes)
    }

    /// Tokens covered: the hash of every prefix up to this length is known.
    pub fn len(&self) -> usize {
        self.0.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The hash of the first `len` tokens (at most [`PrefixHashes::len`]).
    pub fn of(&self, len: usize) -> u64 {
        self.0[len]
    }

    /// The hash of the first `len` tokens followed by `more`.
    pub fn extended(&self, len: usize, more: &[u32]) -> u64 {
        more.iter().fold(self.of(len), |h, &t| hash_step(h, t))
    }
}

impl PrefixCache {
    pub fn new() -> PrefixCache {
        PrefixCache::default()
    }

    /// Snapshots indexed.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn find(&self, tokens: &[u32], hash: u64) -> Option<SnapshotId> {
        self.by_key
            .get(&(tokens.len(), hash))?
            .iter()
            .copied()
            .find(|id| *self.entries[id].tokens == *tokens)
    }

    /// Whether a snapshot of exactly `tokens` is indexed.
    pub fn contains(&self, tokens: &[u32]) -> bool {
        self.contains_hashed(tokens, hash_of(tokens))
    }

    /// [`PrefixCache::contains`] for tokens whose hash is known (from [`PrefixHashes`]).
    pub fn contains_hashed(&self, tokens: &[u32], hash: u64) -> bool {
        debug_assert_eq!(hash, hash_of(tokens));
        self.find(tokens, hash).is_some()
    }

    /// The snapshot of the longest prefix of `tokens` no longer than `max_len` tokens, with its length; counts as a
    /// use of it.
    pub fn lookup(&mut self, tokens: &[u32], max_len: usize) -> Option<(SnapshotId, usize)> {
        let max_len = max_len.min(tokens.len());
        self.lookup_hashed(tokens, &PrefixHashes::new(&tokens[..max_len]), max_len)
    }

    /// [`PrefixCache::lookup`] with the hashes of the prefixes of `tokens` (covering at least `max_len` of them, or
    /// all of `tokens`).
    pub fn lookup_hashed(
        &mut self,
        tokens: &[u32],
        hashes: &PrefixHashes,
        max_len: usize,
    ) -> Option<(SnapshotId, usize)> {
        let max_len = max_len.min(tokens.len()).min(hashes.len());
        let shortest = *self.lengths.keys().next()?;
        if shortest > max_len {
            return None;
        }
        let found = self
            .lengths
            .range(..=max_len)
            .rev()
            .find_map(|(&len, _)| self.find(&tokens[..len], hashes.of(len)).map(|id| (id, len)));
        if let Some((id, len)) = found {
            self.touch(id, len, |l| hashes.of(l));
        }
        found
    }

    /// Marks entry `id` (of `len` tokens) used, then every indexed shorter prefix of its tokens, the shortest last
    /// (`hash_of_len` gives the hash of their first `l` tokens): a prefix is never less recently used than an entry
    /// that extends it, so eviction takes the longer entry first. The prefixes are found by their keys alone, without
    /// comparing tokens: a hash collision would only reorder the eviction of an unrelated entry, and a long chain of
    /// prefixes (an agent's many turns) costs one hash lookup each.
    fn touch(&mut self, id: SnapshotId, len: usize, hash_of_len: impl Fn(usize) -> u64) {
        self.clock += 1;
        self.entries.get_mut(&id).expect("an indexed entry").last_used = self.clock;
        let shorter: Vec<usize> = self.lengths.range(..len).rev().map(|(&l, _)| l).collect();
        for l in shorter {
            for other in self.by_key.get(&(l, hash_of_len(l))).into_iter().flatten() {
                self.clock += 1;
                self.entries.get_mut(other).expect("keys index entries").last_used = self.clock;
            }
        }
    }

    /// Indexes snapshot `id` of `tokens`. The caller checks `contains` first: a sequence is indexed once.
    pub fn insert(&mut self, id: SnapshotId, tokens: &[u32]) {
        self.insert_hashed(id, tokens, hash_of(tokens));
    }

    /// [`PrefixCache::insert`] for tokens whose hash is known (from [`PrefixHashes`]).
    pub fn insert_hashed(&mut self, id: SnapshotId, tokens: &[u32], hash: u64) {
        debug_assert_eq!(hash, hash_of(tokens));
        let has_shorter = self.lengths.range(..tokens.len()).next().is_some();
        self.by_key.entry((tokens.len(), hash)).or_default().push(id);
        *self.lengths.entry(tokens.len()).or_default() += 1;
        self.entries.insert(
            id,
            Entry {
                tokens: tokens.into(),
                hash,
                last_used: 0,
            },
        );
        // The prefixes' hashes cost a pass over the tokens, taken only where a shorter entry could be one.
        match has_shorter {
            true => {
                let hashes = PrefixHashes::new(tokens);
                self.touch(id, tokens.len(), |len| hashes.of(len));
            }
            false => self.touch(id, tokens.len(), |_| hash),
        }
    }

    /// Takes snapshot `id` out of the index; false when it was not in it.
    pub fn remove(&mut self, id: SnapshotId) -> bool {
        let Some(entry) = self.entries.remove(&id) else {
            return false;
        };
        let len = entry.tokens.len();
        let key = (len, entry.hash);
        if let Some(ids) = self.by_key.get_mut(&key) {
            ids.retain(|&other| other != id);
            if ids.is_empty() {
                self.by_key.remove(&key);
            }
        }
        if let Some(count) = self.lengths.get_mut(&len) {
            *count -= 1;
            if *count == 0 {
                self.lengths.remove(&len);
            }
        }
        true
    }

    /// Takes the least recently used snapshot out of the index and returns it, for the caller to drop.
    pub fn evict(&mut self) -> Option<SnapshotId> {
        self.evict_except(None)
    }

    /// [`PrefixCache::evict`], taking `keep` (the snapshot a sequence is about to start from) only when no other
    /// entry is left: a lookup leaves the entry it found less recent than the shorter prefixes of it, which would
    /// otherwise go after it and leave the sequence nothing to start from.
    pub fn evict_except(&mut self, keep: Option<SnapshotId>) -> Option<SnapshotId> {
        let id = (self.entries.iter())
            .filter(|(&id, _)| Some(id) != keep)
            .min_by_key(|(_, e)| e.last_used)
            .map(|(&id, _)| id)
            .or(keep.filter(|id| self.entries.contains_key(id)))?;
        self.remove(id);
        Some(id)
    }

    /// Takes every snapshot out of the index and returns them.
    pub fn clear(&mut self) -> Vec<SnapshotId> {
        let ids: Vec<SnapshotId> = self.entries.keys().copied().collect();
        *self = PrefixCache::default();
        ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_longest_cached_prefix_within_the_limit() {
        let mut cache = PrefixCache::new();
        let prompt: Vec<u32> = (0..100).collect();
        assert_eq!(cache.lookup(&prompt, 99), None);
        cache.insert(1, &prompt[..10]);
        cache.insert(2, &prompt[..50]);
        cache.insert(3, &prompt[..100]);
        let mut other = prompt.clone();
        other[30] = 7;
        cache.insert(4, &other[..40]);
        assert!(cache.contains(&prompt[..50]));
        assert!(!cache.contains(&prompt[..51]));
        assert_eq!(cache.lookup(&prompt, 99), Some((2, 50)));
        assert_eq!(cache.lookup(&prompt, 100), Some((3, 100)));
        assert_eq!(cache.lookup(&prompt, 49), Some((1, 10)));
        // Shares 30 tokens with entry 4, whose tokens differ after that: entry 1 is the longest real prefix.
        assert_eq!(cache.lookup(&other, 45), Some((4, 40)));
        assert_eq!(cache.lookup(&other[..35], 35), Some((1, 10)));
        assert_eq!(cache.lookup(&[5, 6], 2), None);
    }

    #[test]
    fn evicts_the_least_recently_used_and_removes_cleanly() {
        let mut cache = PrefixCache::new();
        let starts: Vec<Vec<u32>> = (0..3).map(|s| (0..20).map(|t| 100 * s + t).collect()).collect();
        for (id, tokens) in starts.iter().enumerate() {
            cache.insert(id as SnapshotId, &tokens[..5 + 5 * id]);
        }
        // Using entry 0 makes entry 1 the least recently used.
        assert_eq!(cache.lookup(&starts[0], 7), Some((0, 5)));
        assert_eq!(cache.evict(), Some(1));
        assert_eq!(cache.lookup(&starts[1], 20), None);
        assert!(cache.remove(2));
        assert!(!cache.remove(2));
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.clear(), vec![0]);
        assert!(cache.is_empty());
        assert_eq!(cache.evict(), None);
        assert_eq!(cache.lookup(&starts[0], 20), None);
    }

    /// A shared prefix outlives the entries that extend it, even where it was inserted and used before them: the
    /// prompts that restored it passed through it, and more prompts can use it.
    #[test]
    fn evicts_extensions_before_the_prefix_they_extend() {
        let mut cache = PrefixCache::new();
        let system: Vec<u32> = (0..10).collect();
        let talks: Vec<Vec<u32>> = (0..3)
            .map(|c| {
                system
                    .iter()
                    .copied()
                    .chain((0..5).map(|t| 100 * (c + 1) + t))
                    .collect()
            })
            .collect();
        cache.insert(0, &system);
        for (c, talk) in talks.iter().enumerate() {
            assert_eq!(cache.lookup(talk, talk.len() - 1), Some((0, 10)));
            cache.insert(1 + c as SnapshotId, talk);
        }
        let other: Vec<u32> = (50..60).collect();
        cache.insert(9, &other);
        // Using an extension uses the prefix too.
        assert_eq!(cache.lookup(&talks[0], 15), Some((1, 15)));
        let evicted: Vec<SnapshotId> = std::iter::from_fn(|| cache.evict()).collect();
        assert_eq!(evicted, vec![2, 3, 9, 1, 0]);
    }

    /// The snapshot a sequence is about to restore goes last, after the shorter prefixes a lookup made more recent.
    #[test]
    fn evicts_the_snapshot_being_restored_last() {
        let mut cache = PrefixCache::new();
        let tokens: Vec<u32> = (0..30).collect();
        for (id, len) in [(0, 10), (1, 20), (2, 30)] {
            cache.insert(id, &tokens[..len]);
        }
        assert_eq!(cache.lookup(&tokens, 25), Some((1, 20)));
        let evicted: Vec<SnapshotId> = std::iter::from_fn(|| cache.evict_except(Some(1))).collect();
        assert_eq!(evicted, vec![2, 0, 1]);
        assert!(cache.is_empty());
        assert_eq!(cache.evict_except(Some(1)), None);
    }

    /// Many random entries: a lookup answers exactly the longest indexed prefix that a scan finds.
    #[test]
    fn lookups_agree_with_a_scan() {
        let mut rng = lily_model::rng::Rng::new(3);
        let mut cache = PrefixCache::new();
        let mut indexed: Vec<(SnapshotId, Vec<u32>)> = Vec::new();
        for id in 0..300 {
            let len = 1 + (rng.next_u64() % 12) as usize;
            let tokens: Vec<u32> = (0..len).map(|_| (rng.next_u64() % 3) as u32).collect();
            if !cache.contains(&tokens) {
                cache.insert(id, &tokens);
                indexed.push((id, tokens));
            }
            if rng.next_u64().is_multiple_of(5) {
                if let Some(gone) = cache.evict() {
                    indexed.retain(|(i, _)| *i != gone);
                }
            }
            let query: Vec<u32> = (0..12).map(|_| (rng.next_u64() % 3) as u32).collect();
            let limit = (rng.next_u64() % 13) as usize;
            let expected = indexed
                .iter()
                .filter(|(_, t)| t.len() <= limit && query.starts_with(t))
                .max_by_key(|(_, t)| t.len())
                .map(|(i, t)| (*i, t.len()));
            assert_eq!(cache.lookup(&query, limit), expected);
            // The same with the query's prefix hashes computed once, as the engine does.
            let hashes = PrefixHashes::new(&query);
            assert_eq!(cache.lookup_hashed(&query, &hashes, limit), expected);
            for (len, contained) in (0..=query.len()).map(|len| (len, cache.contains(&query[..len]))) {
                assert_eq!(cache.contains_hashed(&query[..len], hashes.of(len)), contained);
            }
        }
    }

    #[test]
    fn prefix_hashes_are_the_hashes_of_the_prefixes() {
        let tokens: Vec<u32> = (0..50).map(|i| (i * 7919) % 1000).collect();
        let hashes = PrefixHashes::new(&tokens[..30]);
        assert_eq!(hashes.len(), 30);
        for len in 0..=30 {
            assert_eq!(hashes.of(len), hash_of(&tokens[..len]));
            assert_eq!(hashes.extended(len, &tokens[len..]), hash_of(&tokens));
        }
        // Sequences differing in one token, or only in length, hash apart.
        let mut other = tokens.clone();
        other[10] += 1;
        assert_ne!(hash_of(&other), hash_of(&tokens));
        assert_ne!(hash_of(&tokens[..49]), hash_of(&tokens));
        // An entry inserted with its known hash is found by a plain lookup.
        let mut cache = PrefixCache::new();
        cache.insert_hashed(9, &tokens[..20], hashes.of(20));
        assert_eq!(cache.lookup(&tokens, 50), Some((9, 20)));
        assert!(cache.contains(&tokens[..20]));
    }
}
