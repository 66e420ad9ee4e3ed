//! RVBox deterministic simulator (being written).
