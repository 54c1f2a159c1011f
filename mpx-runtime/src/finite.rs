//! Bit-level finiteness checks over slices and trees.
