//! Tessera's control-plane side. For now: the offline `tessera` CLI (demo, allocate, validate).
