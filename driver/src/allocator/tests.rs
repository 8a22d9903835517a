//! Unit tests of the allocator.
