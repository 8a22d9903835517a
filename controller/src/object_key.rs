//! `namespace/name` keys for map lookups without making a new string per lookup: a pass looks
//! up every pod's requests and every unbound pod's claims by key, thousands of times at scale
//! (docs/controller.md, "CPU on a real control plane").

use std::cell::RefCell;

thread_local! {
    static KEY: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Calls `f` with `namespace/name`, written into a buffer this thread keeps for it.
pub(crate) fn with_key<R>(namespace: &str, name: &str, f: impl FnOnce(&str) -> R) -> R {
    KEY.with(|buffer| match buffer.try_borrow_mut() {
        Ok(mut key) => {
            key.clear();
            key.push_str(namespace);
            key.push('/');
            key.push_str(name);
            f(&key)
        }
        // Called again from inside `f`: the buffer is in use.
        Err(_) => f(&format!("{namespace}/{name}")),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_namespace_slash_name_also_when_nested() {
        let outer = with_key("ml", "p", |k| {
            let inner = with_key("ns", "claim-1", str::to_owned);
            (k.to_owned(), inner)
        });
        assert_eq!(outer, ("ml/p".to_owned(), "ns/claim-1".to_owned()));
        assert_eq!(with_key("a", "b", str::len), 3);
    }
}
