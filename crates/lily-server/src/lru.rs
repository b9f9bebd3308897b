//! Values kept by id in memory up to a number of bytes, the least recently used dropped first: the store of the
//! kept responses ([`crate::response_store`]) and of the conversations ([`crate::conversations`]).

use std::collections::{BTreeMap, HashMap};

/// What an entry costs beyond the bytes its owner counts (its id held thrice, the map's and the value's headers):
/// this many bytes and its id's length three times. The stores count their values' items at the same cost.
pub const ENTRY_OVERHEAD: usize = 256;

/// What an entry of id `id` whose owner counts `bytes` counts for in the store.
pub fn entry_bytes(id: &str, bytes: usize) -> usize {
    bytes.saturating_add(ENTRY_OVERHEAD + 3 * id.len())
}

/// The values by id, with the order of their last use and the bytes they count for.
pub struct Lru<V> {
    capacity_bytes: usize,
    /// Each value, the bytes it counts for, and the tick of its last use.
    entries: HashMap<String, (V, usize, u64)>,
    /// The ids by the tick of their last use, oldest first.
    recency: BTreeMap<u64, String>,
    tick: u64,
    bytes: usize,
}

impl<V> Lru<V> {
    pub fn new(capacity_bytes: usize) -> Lru<V> {
        Lru {
            capacity_bytes,
            entries: HashMap::new(),
            recency: BTreeMap::new(),
            tick: 0,
            bytes: 0,
        }
    }

    pub fn contains(&self, id: &str) -> bool {
        self.entries.contains_key(id)
    }

    /// The value of `id`, now the most recently used.
    pub fn get(&mut self, id: &str) -> Option<&mut V> {
        self.tick += 1;
        let tick = self.tick;
        let (value, _, used) = self.entries.get_mut(id)?;
        self.recency.remove(used);
        *used = tick;
        self.recency.insert(tick, id.to_string());
        Some(value)
    }

    pub fn remove(&mut self, id: &str) -> Option<V> {
        let (value, bytes, used) = self.entries.remove(id)?;
        self.recency.remove(&used);
        self.bytes -= bytes;
        Some(value)
    }

    /// Keeps `value` (of `bytes`) as `id`, the most recently used, replacing what `id` held and dropping the least
    /// recently used values that `pinned` does not name until it fits. False where it cannot be kept (then what
    /// `id` held stays).
    pub fn insert(&mut self, id: String, value: V, bytes: usize, pinned: impl Fn(&str) -> bool) -> bool {
        let bytes = entry_bytes(&id, bytes);
        if !self.make_room(&id, bytes, pinned) {
            return false;
        }
        self.remove(&id);
        self.tick += 1;
        self.recency.insert(self.tick, id.clone());
        self.entries.insert(id, (value, bytes, self.tick));
        self.bytes += bytes;
        true
    }

    /// Counts the value of `id` (changed in place through [`Lru::get`]) for `bytes` from now on, the most recently
    /// used, dropping the least recently used values that `pinned` does not name until it fits. False where `id`
    /// is not kept or cannot count for that much (then nothing changes).
    pub fn resize(&mut self, id: &str, bytes: usize, pinned: impl Fn(&str) -> bool) -> bool {
        let bytes = entry_bytes(id, bytes);
        if !self.contains(id) || !self.make_room(id, bytes, pinned) {
            return false;
        }
        self.get(id);
        let (_, held, _) = self.entries.get_mut(id).expect("make_room never drops `id`");
        self.bytes = self.bytes - *held + bytes;
        *held = bytes;
        true
    }

    /// Drops the least recently used values other than `id` that `pinned` does not name until `id` can count for
    /// `bytes` (what it counts for now is taken as free). False where dropping all of them would not do; then
    /// nothing is dropped.
    fn make_room(&mut self, id: &str, bytes: usize, pinned: impl Fn(&str) -> bool) -> bool {
        if bytes > self.capacity_bytes {
            return false;
        }
        let held = self.entries.get(id).map_or(0, |(_, bytes, _)| *bytes);
        let free = |lru: &Lru<V>| lru.capacity_bytes - (lru.bytes - held);
        let evictable: usize = (self.entries.iter())
            .filter(|(victim, _)| *victim != id && !pinned(victim))
            .map(|(_, (_, bytes, _))| bytes)
            .sum();
        if free(self) + evictable < bytes {
            return false;
        }
        while free(self) < bytes {
            let victim = (self.recency.values())
                .find(|victim| *victim != id && !pinned(victim))
                .cloned();
            let Some(victim) = victim else {
                return false;
            };
            self.remove(&victim);
        }
        true
    }

    /// The values kept and the bytes they count for.
    pub fn usage(&self) -> (usize, usize) {
        (self.entries.len(), self.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::Lru;

    /// What a value of 10 bytes with a one-letter id counts for.
    const TEN: usize = 10 + super::ENTRY_OVERHEAD + 3;

    #[test]
    fn the_least_recently_used_unpinned_values_go_first() {
        let mut lru = Lru::new(3 * TEN);
        for id in ["a", "b", "c"] {
            assert!(lru.insert(id.into(), id, 10, |_| false));
        }
        assert!(lru.get("a").is_some());
        // b is the least recently used, but pinned: c goes.
        assert!(lru.insert("d".into(), "d", 10, |id| id == "b"));
        assert!(lru.contains("a") && lru.contains("b") && !lru.contains("c") && lru.contains("d"));
        assert_eq!(lru.usage(), (3, 3 * TEN));
        // Replacing a value counts only the difference, and the oldest value may be the one replaced.
        assert!(lru.insert("b".into(), "b2", 10, |_| false));
        assert_eq!(lru.usage(), (3, 3 * TEN));
        assert!(lru.contains("a") && lru.contains("d"));
        // No room, everything pinned: nothing changes, nothing is dropped.
        assert!(!lru.insert("e".into(), "e", 10, |_| true));
        assert!(!lru.insert("f".into(), "f", 3 * TEN, |_| false));
        assert!(!lru.insert("g".into(), "g", 2 * TEN, |id| id != "a"));
        assert_eq!(lru.usage(), (3, 3 * TEN));
        assert_eq!(lru.remove("a"), Some("a"));
        assert_eq!(lru.usage(), (2, 2 * TEN));
        assert!(lru.insert("h".into(), "h", 2 * TEN, |_| false));
        assert_eq!(lru.usage(), (1, 2 * TEN + super::ENTRY_OVERHEAD + 3));
    }

    #[test]
    fn a_value_grown_in_place_makes_room_as_a_replacement_would() {
        let mut lru = Lru::new(3 * TEN);
        for id in ["a", "b", "c"] {
            assert!(lru.insert(id.into(), id, 10, |_| false));
        }
        // Growing b by one value's room drops the least recently used other value (a), and b is then the newest.
        assert!(lru.resize("b", 10 + TEN, |_| false));
        assert!(!lru.contains("a") && lru.contains("b") && lru.contains("c"));
        assert_eq!(lru.usage(), (2, 3 * TEN));
        // c is now the oldest; growing past what dropping it frees changes nothing.
        assert!(!lru.resize("b", 10 + 2 * TEN + 1, |_| false));
        assert!(!lru.resize("b", 10 + 2 * TEN, |id| id == "c"));
        assert_eq!(lru.usage(), (2, 3 * TEN));
        assert!(lru.contains("c"));
        // Shrinking always fits; an id not kept is refused.
        assert!(lru.resize("b", 10, |_| true));
        assert_eq!(lru.usage(), (2, 2 * TEN));
        assert!(!lru.resize("z", 10, |_| false));
        assert_eq!(lru.usage(), (2, 2 * TEN));
        // The value itself is what get() changed.
        *lru.get("c").unwrap() = "c2";
        assert_eq!(lru.remove("c"), Some("c2"));
    }
}
