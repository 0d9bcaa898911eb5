//! What a publish derives from the whole registry (the filters' configuration, the virtual
//! servers' names) is kept until one of its inputs changes. At 10,000 services, making it
//! again for every instance that comes or goes was most of a publish, and of every aggregate
//! listing refresh: the catalog alone is 10,000 entries to copy, resolve and serialize.

use std::sync::Mutex;

/// A value with a counter that moves whenever it may have changed. Every mutable access goes
/// through [`modify`](Self::modify), so the compiler sees to it that no change is missed; a
/// memo keyed on the counter compares one integer instead of a copy of the value.
#[derive(Debug, Clone, Default)]
pub struct Versioned<T> {
    value: T,
    version: u64,
}

impl<T> Versioned<T> {
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The value, to change: the version moves whether or not the caller changes it, so
    /// callers that often leave it alone check first.
    pub fn modify(&mut self) -> &mut T {
        self.version += 1;
        &mut self.value
    }
}

impl<T> std::ops::Deref for Versioned<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.value
    }
}

/// The last result of a computation and the key of its inputs. Behind a mutex because it is
/// filled by readers (`&Registry` under the registry's read lock).
pub struct Memo<K, V>(Mutex<Option<(K, V)>>);

impl<K: PartialEq, V: Clone> Memo<K, V> {
    /// The kept result if it was made from `key`, else `make`'s, kept for the next call.
    /// `make` gets the result kept until now (made from other inputs), to return it again
    /// when it comes out the same: readers that compare results by pointer then see no
    /// change.
    pub fn get_or_make(&self, key: K, make: impl FnOnce(Option<&V>) -> V) -> V {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((k, v)) = kept.as_ref() {
            if *k == key {
                return v.clone();
            }
        }
        let made = make(kept.as_ref().map(|(_, v)| v));
        *kept = Some((key, made.clone()));
        made
    }
}

impl<K, V> Default for Memo<K, V> {
    fn default() -> Self {
        Memo(Mutex::new(None))
    }
}

impl<K, V> Clone for Memo<K, V> {
    /// A copy of the registry starts without: its inputs may change apart from ours, and the
    /// versions of two copies are not comparable.
    fn clone(&self) -> Self {
        Memo::default()
    }
}

impl<K, V> std::fmt::Debug for Memo<K, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Memo")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mutable_access_moves_the_version() {
        let mut v: Versioned<Vec<u8>> = Versioned::default();
        let before = v.version();
        v.modify().push(1);
        assert_ne!(v.version(), before);
        let after_push = v.version();
        let _ = v.modify();
        assert_ne!(
            v.version(),
            after_push,
            "conservative: an access counts as a change"
        );
        assert_eq!(*v, vec![1]);
    }

    #[test]
    fn the_memo_makes_again_only_for_a_new_key() {
        let memo: Memo<u64, String> = Memo::default();
        let mut made = 0;
        for key in [1, 1, 2, 2, 1] {
            memo.get_or_make(key, |_| {
                made += 1;
                format!("{key}")
            });
        }
        assert_eq!(made, 3);
        assert_eq!(memo.clone().get_or_make(1, |_| "fresh".into()), "fresh");
        let previous = memo.get_or_make(3, |before| format!("{before:?}"));
        assert_eq!(previous, r#"Some("1")"#, "make sees what was kept");
    }
}
