//! Putting files into the store.
