//! Bit-plane format (work in progress).
