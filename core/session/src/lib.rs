//! RVBox server session core (being written).
