#![allow(clippy::unwrap_used, reason = "tests")]
use super::*;
