//! Any-precision quantizer (work in progress).
