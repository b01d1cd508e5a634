//! PostgreSQL backend for withlock (in progress).
