//! The repository's README, whose examples run as this package's doctests.

#![cfg(doctest)]
#![doc = include_str!("../README.md")]
