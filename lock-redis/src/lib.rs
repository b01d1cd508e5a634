//! Redis backend for withlock (in progress).
