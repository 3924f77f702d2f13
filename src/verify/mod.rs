//! Verification on the user's adapter: every kernel, storage format and variant the adapter
//! supports against the CPU reference ([`run`]), and the quality table of the KV storage
//! formats. No file or process I/O: results come back as typed reports, progress through a
//! callback.
