//! A map whose values each may carry a deadline, with the earliest one
//! known without a scan.
//!
//! The core asks for its next deadline after every turn. With 19,000
//! sessions, a scan of every session's deadline on each turn took a fifth
//! of the core's time during a fleet run. [`Timed`] keeps an ordered index
//! of `(deadline, key)`: every mutable access marks the key dirty, and the
//! dirty keys are re-indexed at [`Timed::refresh`] (the core calls it at
//! the end of each input). Until then, [`Timed::earliest`] and
//! [`Timed::due`] look at the dirty keys directly, so no deadline is ever
//! missed whatever the order of calls.
//!
//! Must never: report a deadline later than the earliest value's, or leave
//! a removed key in the index.

use std::borrow::Borrow;
use std::collections::{BTreeMap, BTreeSet};

/// See the module docs. Reads go through `Deref` to the map.
pub(crate) struct Timed<K, V, T> {
    map: BTreeMap<K, V>,
    index: BTreeSet<(T, K)>,
    indexed: BTreeMap<K, T>,
    dirty: BTreeSet<K>,
    deadline: fn(&V) -> Option<T>,
}

impl<K: std::fmt::Debug, V: std::fmt::Debug, T: std::fmt::Debug> std::fmt::Debug
    for Timed<K, V, T>
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Timed")
            .field("map", &self.map)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl<K, V, T> std::ops::Deref for Timed<K, V, T> {
    type Target = BTreeMap<K, V>;

    fn deref(&self) -> &Self::Target {
        &self.map
    }
}

impl<K: Ord + Clone, V, T: Ord + Copy> Timed<K, V, T> {
    /// An empty map; `deadline` reads a value's deadline.
    pub(crate) fn new(deadline: fn(&V) -> Option<T>) -> Self {
        Self {
            map: BTreeMap::new(),
            index: BTreeSet::new(),
            indexed: BTreeMap::new(),
            dirty: BTreeSet::new(),
            deadline,
        }
    }

    /// The value, for a change that may move its deadline.
    pub(crate) fn get_mut<Q>(&mut self, k: &Q) -> Option<&mut V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        let (key, _) = self.map.get_key_value(k)?;
        if !self.dirty.contains(k) {
            self.dirty.insert(key.clone());
        }
        self.map.get_mut(k)
    }

    /// The value under `k`, inserted as the default when absent.
    pub(crate) fn entry_or_default(&mut self, k: K) -> &mut V
    where
        V: Default,
    {
        self.dirty.insert(k.clone());
        self.map.entry(k).or_default()
    }

    /// Inserts or replaces the value under `k`.
    pub(crate) fn insert(&mut self, k: K, v: V) -> Option<V> {
        self.dirty.insert(k.clone());
        self.map.insert(k, v)
    }

    /// Removes the value under `k`, and its deadline.
    pub(crate) fn remove<Q>(&mut self, k: &Q) -> Option<V>
    where
        K: Borrow<Q>,
        Q: Ord + ?Sized,
    {
        self.dirty.remove(k);
        if let Some((key, t)) = self.indexed.remove_entry(k) {
            self.index.remove(&(t, key));
        }
        self.map.remove(k)
    }

    /// Re-indexes the values changed since the last refresh.
    pub(crate) fn refresh(&mut self) {
        for k in std::mem::take(&mut self.dirty) {
            let now = self.map.get(&k).and_then(self.deadline);
            let before = self.indexed.get(&k).copied();
            if now == before {
                continue;
            }
            if let Some(t) = before {
                self.index.remove(&(t, k.clone()));
                self.indexed.remove(&k);
            }
            if let Some(t) = now {
                self.index.insert((t, k.clone()));
                self.indexed.insert(k, t);
            }
        }
    }

    /// The earliest deadline of any value.
    pub(crate) fn earliest(&self) -> Option<T> {
        let clean = self
            .index
            .iter()
            .find(|(_, k)| !self.dirty.contains(k))
            .map(|(t, _)| *t);
        let dirty = self
            .dirty
            .iter()
            .filter_map(|k| self.map.get(k).and_then(self.deadline))
            .min();
        clean.into_iter().chain(dirty).min()
    }

    /// The keys whose deadline is at or before `now`, in key order.
    pub(crate) fn due(&mut self, now: T) -> Vec<K> {
        self.refresh();
        let mut keys: Vec<K> = self
            .index
            .iter()
            .take_while(|(t, _)| *t <= now)
            .map(|(_, k)| k.clone())
            .collect();
        keys.sort();
        keys
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone, Copy)]
    enum Step {
        Insert(u8, Option<u16>),
        Set(u8, Option<u16>),
        Remove(u8),
        Refresh,
        Check(u16),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            (any::<u8>(), proptest::option::of(any::<u16>()))
                .prop_map(|(k, d)| Step::Insert(k % 16, d)),
            (any::<u8>(), proptest::option::of(any::<u16>()))
                .prop_map(|(k, d)| Step::Set(k % 16, d)),
            any::<u8>().prop_map(|k| Step::Remove(k % 16)),
            Just(Step::Refresh),
            any::<u16>().prop_map(Step::Check),
        ]
    }

    proptest! {
        /// The index answers what a scan of every value answers, whatever
        /// the order of changes, refreshes and questions.
        #[test]
        fn agrees_with_a_scan(steps in proptest::collection::vec(step(), 0..200)) {
            let mut t: Timed<u8, Option<u16>, u16> = Timed::new(|v| *v);
            for s in steps {
                match s {
                    Step::Insert(k, d) => { t.insert(k, d); }
                    Step::Set(k, d) => { if let Some(v) = t.get_mut(&k) { *v = d; } }
                    Step::Remove(k) => { t.remove(&k); }
                    Step::Refresh => t.refresh(),
                    Step::Check(now) => {
                        let scan_min = t.values().filter_map(|v| *v).min();
                        prop_assert_eq!(t.earliest(), scan_min);
                        let scan_due: Vec<u8> = t
                            .iter()
                            .filter(|(_, v)| v.is_some_and(|d| d <= now))
                            .map(|(k, _)| *k)
                            .collect();
                        prop_assert_eq!(t.due(now), scan_due);
                    }
                }
                let scan_min = t.values().filter_map(|v| *v).min();
                prop_assert_eq!(t.earliest(), scan_min);
            }
            t.refresh();
            prop_assert_eq!(t.index.len(), t.values().filter(|v| v.is_some()).count());
            prop_assert_eq!(t.indexed.len(), t.index.len());
        }
    }

    #[test]
    fn a_removed_key_leaves_the_index() {
        let mut t: Timed<String, Option<u64>, u64> = Timed::new(|v| *v);
        t.insert("a".into(), Some(5));
        t.insert("b".into(), Some(9));
        t.refresh();
        assert_eq!(t.earliest(), Some(5));
        t.remove("a");
        assert_eq!(t.earliest(), Some(9));
        assert_eq!(t.due(100), vec!["b".to_owned()]);
        if let Some(v) = t.get_mut("b") {
            *v = None;
        }
        assert_eq!(t.earliest(), None);
        assert!(t.due(100).is_empty());
    }
}
