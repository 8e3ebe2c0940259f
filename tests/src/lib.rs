//! Message-level integration tests for lockstep live in `tests/tests/`.

#![forbid(unsafe_code)]
